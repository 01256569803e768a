"""The style rules CI holds the tree to: ruff's lint and format, and mypy
(strict, configured in pyproject.toml), run as the developers run them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SOURCES = ["kvgate", "tests", "benchmarks"]


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", *SOURCES],
        ["ruff", "format", "--check", *SOURCES],
        ["mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_the_tree_is_clean(command: list[str]) -> None:
    tool = BIN / command[0]
    assert tool.exists(), f"{command[0]} is not installed next to {sys.executable}"
    done = subprocess.run(
        [str(tool), *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
