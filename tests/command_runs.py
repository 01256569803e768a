"""Running kvgate from tests: a trace's text replayed on the model in this
process, and a Python program in a fresh process (vLLM on CPU), each with
what it printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.cli import main


def replay_text(
    directory: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> tuple[Path, int, str, str]:
    """`text` written to `bad.yaml` in `directory` and replayed on the model:
    the file, the exit code and what was printed (out, err)."""
    path = directory / "bad.yaml"
    path.write_text(text)
    code = main(["replay", str(path), "--target", "model"])
    out, err = capsys.readouterr()
    return path, code, out, err


def run_python(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in a fresh process with vLLM on CPU, its output as text."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        timeout=timeout,
    )
