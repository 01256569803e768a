"""Fixtures shared by the exploration tests."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvgate import cli


@dataclass(frozen=True)
class Found:
    code: int
    out: str
    saved: Path


@pytest.fixture(scope="session")
def total_miss(tmp_path_factory: pytest.TempPathFactory) -> Found:
    """`kvgate explore --hold off` on the model, from nothing but a seed: the
    seed's total miss, shrunk and saved (run once, read by several tests)."""
    out_dir = tmp_path_factory.mktemp("hold-off")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli.main(
            ["explore", "--hold", "off", "--budget", "3000", "--seed", "0", "--out", str(out_dir)]
        )
    saved = sorted(out_dir.glob("*.yaml"))
    assert len(saved) == 1, buffer.getvalue()
    return Found(code, buffer.getvalue(), saved[0])
