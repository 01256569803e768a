"""`--plugin entry-points` reports the hold as a serving process in the same
environment has it. Each way (the hold switch unset, the switch on), one
child process starts vLLM's own general-plugin loader as an engine does and
builds a hybrid manager without kvgate touching the switch (the serving
process), and another runs `kvgate gate --plugin entry-points` on a trace
that asks for the hold: the gate's `hold:` must be the serving process's,
and `kvgate hold-check` must read the same from the serving process's log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from configs import needs_vllm

from kvgate import cli

pytestmark = needs_vllm

ROOT = Path(__file__).resolve().parent.parent
SWITCH = "VLLM_E2_MAMBA_RETAIN_CHECKPOINT"
TRACE = ROOT / "kvgate/conformance/corpus/seed1-next-turn-after-burst.hold-on.yaml"

# The serving process: vLLM's logging configured as its engine core
# configures it, vLLM's loader, then a manager built as the engine builds
# one, with the environment as the user set it.
SERVING = """
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
from kvgate.impl import _vllm_api
from kvgate.impl.vllm_build import build_manager
from kvgate.impl.vllm_probe import holds_partial_tails
from kvgate.impl.vllm_probe import _PROBE_CONFIG as config
api = _vllm_api.load()
from vllm.plugins import load_general_plugins
load_general_plugins()
api.init_none_hash(api.sha256)
managers = build_manager(api, config).coordinator.single_type_managers
print("hold:", "yes" if holds_partial_tails(api, managers, False) else "no")
"""


def _env(switch: str | None) -> dict[str, str]:
    unset = (SWITCH, "KVGATE_HOLD_OVERLAY", "VLLM_CONFIGURE_LOGGING")  # as a server starts
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_PLUGINS="kvgate_hold", PYTHONPATH=str(ROOT))
    if switch is not None:
        env[SWITCH] = switch
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(("switch", "hold"), [(None, "no"), ("1", "yes")], ids=["unset", "on"])
def test_the_gate_reports_the_serving_process_hold(
    switch: str | None, hold: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = _env(switch)
    serving = _run(["-c", SERVING], env)
    assert serving.returncode == 0, serving.stderr[-2000:]
    assert serving.stdout.strip().splitlines()[-1] == f"hold: {hold}"

    # `kvgate hold-check` reads the same answer from the serving process's log.
    log = tmp_path / "server.log"
    log.write_text(serving.stdout + serving.stderr)
    assert cli.main(["hold-check", str(log)]) == (0 if hold == "yes" else 1)
    assert capsys.readouterr().out.startswith(f"hold: {hold} (")

    gate = _run(
        ["-m", "kvgate", "replay", str(TRACE), "--target", "vllm", "--plugin", "entry-points"],
        env,
    )
    header = gate.stdout.splitlines()[0]
    assert header.startswith("target: vllm "), gate.stdout + gate.stderr[-2000:]
    if hold == "yes":
        assert "hold: yes (kvgate overlay" in header
        assert gate.returncode == 0, gate.stdout
    else:
        assert "hold: no)" in header
        assert gate.returncode == 4, gate.stdout
        assert "VLLM_E2_MAMBA_RETAIN_CHECKPOINT=1" in gate.stdout


def test_hold_check_names_a_refusal_and_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgate.impl.hold_overlay import REFUSED_LINE

    log = tmp_path / "server.log"
    refused = REFUSED_LINE % ("9.9.9", "MambaManager.allocate_new_blocks")
    log.write_text(f"(APIServer pid=1) WARNING 12-07 00:00:00 [hold_overlay.py:1] {refused}\n")
    assert cli.main(["hold-check", str(log)]) == 1
    assert capsys.readouterr().out == f"hold: no (line 1: {refused})\n"
    assert cli.main(["hold-check", str(tmp_path / "missing.log")]) == 2
    assert "cannot read the log" in capsys.readouterr().err
