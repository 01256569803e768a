"""A pytest plugin that runs a test session with one campaign fault applied.

    KVGATE_FAULT=free-order-not-reversed KVGATE_FAULT_REPORT=run.json \\
        pytest -p kvgate.mutate.pytest_plugin ...

At configure time (before any test module is collected) the named fault is
applied in the pytest process exactly as the campaign applies it; the
tests then see the edited vLLM. Without KVGATE_FAULT the session runs
unmutated (the baseline). The JSON report says whether the fault applied
(the line it changed, or why it is not applicable) and lists the tests that
failed, the first one first. A fault that does not apply ends the session
before any test runs, with exit code `NOT_APPLICABLE_EXIT`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvgate.mutate.faults import BY_NAME, FAULT_ENV, NOT_APPLICABLE_EXIT, REPORT_ENV
from kvgate.mutate.inject import Applied, NotApplicable, apply

_report: dict[str, Any] = {}
# The fault in effect, reverted when the session ends (a session run inside
# another process, as a test does, must leave vLLM as it found it).
_applied: list[Applied] = []


def _write() -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(_report, indent=1), encoding="utf-8")


def pytest_configure(config: pytest.Config) -> None:
    name = os.environ.get(FAULT_ENV, "")
    _report.clear()
    _report.update(fault=name or None, failed=[])
    if name:
        fault = BY_NAME.get(name)
        if fault is None:
            raise pytest.UsageError(f"{FAULT_ENV}={name}: no such fault")
        try:
            applied = apply(fault)
        except NotApplicable as reason:
            _report["not_applicable"] = str(reason)
            _write()
            pytest.exit(f"fault {name} not applicable: {reason}", returncode=NOT_APPLICABLE_EXIT)
        _applied.append(applied)
        edit = applied.edit
        _report["edit"] = {
            "file": edit.filename,
            "line": edit.lineno,
            "before": edit.before,
            "after": edit.after,
        }
    _write()


def pytest_unconfigure(config: pytest.Config) -> None:
    while _applied:
        _applied.pop().revert()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        message = report.longreprtext.strip().splitlines()
        _report["failed"].append(
            {"test": report.nodeid, "when": report.when, "message": message[-1] if message else ""}
        )
        _write()
