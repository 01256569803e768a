"""Fixtures shared by several test modules."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvgate import cli

# `kvgate gate --target vllm` probes the build for vLLM's known defects (four
# child processes) only in the tests that ask for it with --known-defects.
os.environ.setdefault("KVGATE_KNOWN_DEFECTS", "skip")


@dataclass(frozen=True)
class Found:
    code: int
    out: str
    saved: Path


@pytest.fixture(scope="session")
def total_miss(tmp_path_factory: pytest.TempPathFactory) -> Found:
    """`kvgate explore --hold off --profile ci` on the model: the ci profile
    (derandomized, its default budget) finds the seed's total miss, shrinks
    and saves it (run once, read by several tests)."""
    out_dir = tmp_path_factory.mktemp("hold-off")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli.main(["explore", "--hold", "off", "--profile", "ci", "--out", str(out_dir)])
    saved = sorted(out_dir.glob("*.yaml"))
    assert len(saved) == 1, buffer.getvalue()
    return Found(code, buffer.getvalue(), saved[0])


HOLD_OVERLAY = "kvgate.impl.hold_overlay"


@pytest.fixture
def hold_overlay_plugin() -> Iterator[str]:
    """The hold overlay's plugin name, for a test that loads it into vLLM;
    uninstalled afterwards unless it was installed before, so no later test
    in this process runs on an overlaid vLLM."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    from kvgate.impl import hold_overlay

    was_installed = hold_overlay.is_registered()
    try:
        yield HOLD_OVERLAY
    finally:
        if not was_installed:
            # A later `plugin=` target installs it again (the adapter asks
            # the plugin whether it is installed).
            hold_overlay.unregister()


@pytest.fixture(scope="module")
def overlay() -> Iterator[Any]:
    """The hold overlay, installed through the adapter for a test module;
    uninstalled afterwards if it was not installed before the module ran."""
    from kvgate.impl import _vllm_api, hold_overlay

    _vllm_api.load()
    was_installed = hold_overlay.is_registered()
    hold_overlay.install()
    yield hold_overlay
    if not was_installed:
        hold_overlay.unregister()


@pytest.fixture
def upstream(overlay: Any) -> Iterator[None]:
    """vLLM's own methods for the test's duration, the overlay back after."""
    overlay.unregister()
    try:
        yield
    finally:
        overlay.install()
