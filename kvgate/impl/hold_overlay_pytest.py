"""A pytest plugin: the session runs with kvgate's hold overlay installed.

    pytest -p kvgate.impl.hold_overlay_pytest ...

Used by `scripts/vllm-own-tests.sh --overlay` to run vLLM's own tests on
upstream vLLM plus the overlay. At session start it calls
`hold_overlay.install()` (naming the plugin opts in); whether managers hold
is the environment switch (`VLLM_E2_MAMBA_RETAIN_CHECKPOINT`), which the
script sets to 1. The report
header says both, and the summary counts what the overlay did, so a run that
never exercised the hold shows it.
"""

from __future__ import annotations

import os

import pytest

from kvgate.impl import hold_overlay
from kvgate.impl._vllm_api import RETAIN_SWITCH


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    hold_overlay.install()


def pytest_report_header(config: pytest.Config) -> str:
    switch = os.environ.get(RETAIN_SWITCH, "(unset)")
    state = "installed" if hold_overlay.is_registered() else "NOT installed"
    return f"kvgate hold overlay: {state}, {RETAIN_SWITCH}={switch}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    counts = ", ".join(f"{k} {v}" for k, v in sorted(hold_overlay.stats.items())) or "none"
    terminalreporter.write_line(f"kvgate hold overlay activity: {counts}")
