"""The known vLLM defects: each standalone reproduction under findings/ run on
the installed (pinned) vLLM in a subprocess, without kvgate on its path, must
still show its defect (exit 10); and a reproduction needs nothing of kvgate.

Each reproduction builds a real vLLM Scheduler on CPU: about 10 s apiece.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLUGS = sorted(p.parent.name for p in (ROOT / "findings").glob("*/repro.py"))
PRESENT = 10


def test_four_findings_each_with_a_reproduction_and_a_trace() -> None:
    assert len(SLUGS) == 4
    for slug in SLUGS:
        assert (ROOT / "findings" / slug / "trace.yaml").is_file(), slug


@pytest.mark.parametrize("slug", SLUGS)
def test_a_reproduction_imports_nothing_of_kvgate(slug: str) -> None:
    """Only the standard library, vLLM and torch (which vLLM brings)."""
    tree = ast.parse((ROOT / "findings" / slug / "repro.py").read_text(encoding="utf-8"))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    outside = roots - set(sys.stdlib_module_names) - {"vllm", "torch", "__future__"}
    assert not outside, f"{slug}/repro.py imports {sorted(outside)}"


@pytest.mark.parametrize("slug", SLUGS)
def test_each_reproduction_still_shows_its_defect_on_the_pinned_release(slug: str) -> None:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, f"findings/{slug}/repro.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == PRESENT, done.stdout[-2000:] + done.stderr[-2000:]
    assert "expected:" in done.stdout and "actual:" in done.stdout
