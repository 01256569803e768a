"""The package's version and metadata: `kvgate --version`, the vLLM releases
the gate was checked on, and what the gate path imports (what may be an
optional extra)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvgate
from kvgate import cli

ROOT = Path(__file__).resolve().parents[1]


def test_version_names_the_checked_vllm_releases(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvgate {kvgate.__version__} (checked on vLLM 0.32.0, 0.33.0, 0.34.0; ")


def test_metadata_states_the_releases_the_matrix_checks() -> None:
    # (tomllib is Python 3.11's; kvgate runs on 3.10 too.)
    pyproject = (ROOT / "pyproject.toml").read_text()
    low, high = kvgate.CHECKED_VLLM[0], kvgate.CHECKED_VLLM[-1]
    assert f'\nvllm = ["vllm>={low},<={high}"]\n' in pyproject
    description = re.search(r'^description = "(.*)"$', pyproject, re.MULTILINE)
    assert description is not None
    assert ", ".join(kvgate.CHECKED_VLLM[:-1]) + f" and {high}" in description.group(1)
    matrix = (ROOT / "scripts" / "vllm-matrix.sh").read_text()
    found = re.search(r"releases=\(([0-9. ]+)\)", matrix)
    assert found is not None and tuple(found.group(1).split()) == kvgate.CHECKED_VLLM


def test_the_gate_imports_no_optional_dependency(tmp_path: Path) -> None:
    """`kvgate gate` (on the model) never imports what an extra installs, nor pytest."""
    program = (
        "import sys\n"
        "from kvgate import cli\n"
        "code = cli.main(['gate', '--target', 'model', '-k', 'seed1'])\n"
        "optional = ('matplotlib', 'ray', 'pytest', '_pytest', 'vllm', 'torch')\n"
        "print(code, sorted({m.split('.')[0] for m in sys.modules} & set(optional)))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        timeout=300,
    )
    assert run.stdout.splitlines()[-1] == "0 []", run.stdout[-2000:] + run.stderr[-2000:]
