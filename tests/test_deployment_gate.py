"""`kvgate gate --deployment` and `kvgate workload --deployment`: the
scenario families generated at the config a serve command line resolves to
(Qwen3-Next's shapes over four GPUs, three MTP drafts, prefix caching in align mode, unit
64, eight sequences)
run in strict lockstep on vLLM's real Scheduler, with one verdict; the
workload measured at that deployment's pool."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from configs import MTP, SEED_BLOCK_FLAGS, needs_vllm

from kvgate import cli
from kvgate.conformance.deployment_families import FAMILY_NAMES
from kvgate.errors import EXIT_LACKS_REQUIRED

pytestmark = needs_vllm


@functools.cache
def qwen3_next_dir() -> Path:
    """Qwen3-Next-80B-A3B's shapes (transformers' defaults for the class),
    one MTP layer as it ships: config.json only."""
    from transformers import Qwen3NextConfig

    folder = Path(tempfile.mkdtemp(prefix="kvgate-qwen3-next-"))
    atexit.register(shutil.rmtree, folder, True)
    config = Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], max_position_embeddings=262144)
    config.num_nextn_predict_layers = 1
    config.save_pretrained(folder)
    return folder


def serve_line() -> list[str]:
    return [
        "vllm",
        "serve",
        str(qwen3_next_dir()),
        "--tensor-parallel-size",
        "4",
        *SEED_BLOCK_FLAGS,
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "131072",
        "--speculative-config",
        MTP,
    ]


def test_the_deployment_gate_runs_its_families_on_vllms_scheduler(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvgate.impl import vllm_scheduler_config

    # The Scheduler class vLLM's engine picks for each replay, as it built it.
    built: list[str] = []
    pick = vllm_scheduler_config.scheduler_class

    def recorded(vllm_config: Any, config: Any) -> Any:
        chosen = pick(vllm_config, config)
        built.append(chosen.__name__)
        return chosen

    monkeypatch.setattr(vllm_scheduler_config, "scheduler_class", recorded)
    code = cli.main(
        [
            "gate",
            "--target",
            "vllm",
            "--no-bundled",
            "--known-defects",
            "skip",
            "--deployment-traces",
            str(tmp_path),
            "--deployment",
            *serve_line(),
        ]
    )
    out = capsys.readouterr().out
    verdicts = {
        line.split()[1]: line.split()[0]
        for line in out.splitlines()
        if line.split()[:1] in (["PASS"], ["FAIL"], ["LACKS"], ["SKIP"], ["ERROR"])
    }
    # Every family ran, each at the resolved config, on vLLM in lockstep.
    families = {name.removeprefix("deploy-").split(".")[0] for name in verdicts}
    assert families == set(FAMILY_NAMES)
    assert set(verdicts.values()) <= {"PASS", "LACKS"}, out
    from kvgate.impl.serve_flags import resolve

    resolved = resolve(serve_line()[2:], 64).config
    assert resolved is not None and resolved.async_scheduling
    accepted = 0
    for path in tmp_path.glob("deploy-*.yaml"):
        trace = yaml.safe_load(path.read_text())
        config = trace["config"]
        # One MTP layer reused for three drafts: lookahead 1.
        assert (config["hash_unit"], config["hash_lookahead_tokens"]) == (64, 1)
        assert config["max_num_scheduled_tokens"] == resolved.max_num_scheduled_tokens
        # The worker's served blocks (a Mamba page of the real shapes over
        # four GPUs raises the 64-token block), not the asked 64 and 256.
        assert config["scheduler_block_size"] == resolved.scheduler_block_size == 320
        # As the deployment schedules: asynchronously, with its three drafts.
        assert config["async_scheduling"] is True and trace["scheduler"]["spec"] == 3
        accepted += sum(len(e.get("accept", {})) for e in trace["engine"])
        assert not any("abort" in e for e in trace["engine"] if e["op"] == "step")
    assert accepted > 0  # drafts accepted in the families' decodes
    # Every replay ran on vLLM's AsyncScheduler, and the report says how.
    assert built and set(built) == {"AsyncScheduler"}, built
    assert "AsyncScheduler" in out and "mixed acceptance" in out and "3 drafts" in out
    assert "synchronously" not in out
    # The short seeded exploration at the deployment's config, in lockstep.
    assert "deployment: exploration: clean at that config" in out
    assert "on the model and vLLM in lockstep" in out
    # Upstream lacks the hold; the hold arm of the next turn after a burst
    # asks for it, and the gate's default requires it: exit 4.
    assert verdicts["deploy-next-turn-after-burst.hold-on"] == "LACKS"
    assert verdicts["deploy-next-turn-after-burst.hold-off"] == "PASS"
    assert code == EXIT_LACKS_REQUIRED
    # The hold's cost, measured at the deployment, on the lacks line.
    lacks = next(line for line in out.splitlines() if line.startswith("lacks hold: "))
    assert "; at the deployment: " in lacks and "(next-turn-after-burst" in lacks
    assert f"verdict: exit {EXIT_LACKS_REQUIRED}" in out


def test_the_hold_arm_shows_the_hold_at_the_deployment(tmp_path: Path) -> None:
    """The generated next turn after a burst resumes with the hold where it
    misses without it: the family is about the hold at this config."""
    from kvgate.conformance.deployment_families import generate
    from kvgate.impl.serve_flags import resolve
    from kvgate.targets import scheduler_factories
    from kvgate.vocabulary.scheduling import EngineSettings

    deployment = resolve(serve_line()[2:], 64)
    assert deployment.config is not None and deployment.config.async_scheduling
    model, _ = scheduler_factories("model", None)
    traces, skipped = generate(deployment.config, EngineSettings(3, 8), model, tmp_path)
    assert not skipped
    by_name = {t.name: t.trace for t in traces}

    def follow_up_hit(name: str) -> int:
        hits = [
            e.expect["cached_tokens"]["A2"]
            for e in by_name[name].engine
            if "A2" in e.expect.get("cached_tokens", {})
        ]
        return int(hits[0])

    off = follow_up_hit("deploy-next-turn-after-burst.hold-off")
    on = follow_up_hit("deploy-next-turn-after-burst.hold-on")
    assert on > off


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_deployment_without_drafts_runs_as_before(asynchronous: bool, tmp_path: Path) -> None:
    """Without drafts nothing is accepted, and a synchronous deployment keeps
    its abort inside a step."""
    from kvgate.conformance.deployment_families import generate
    from kvgate.impl.serve_flags import resolve
    from kvgate.targets import scheduler_factories
    from kvgate.vocabulary.scheduling import EngineSettings

    line = serve_line()[2:-2]  # no speculative config
    if not asynchronous:
        line.append("--no-async-scheduling")
    config = resolve(line, 64).config
    assert config is not None and config.async_scheduling == asynchronous
    model, _ = scheduler_factories("model", None)
    traces, skipped = generate(config, EngineSettings(0, 8), model, tmp_path)
    assert not skipped and {t.name.split(".")[0] for t in traces} == {
        f"deploy-{name}" for name in FAMILY_NAMES
    }
    for t in traces:
        assert t.trace.config.async_scheduling == asynchronous
        assert not any(e.accept for e in t.trace.engine)
    aborts = next(t.trace for t in traces if t.name == "deploy-aborts")
    assert any(e.aborted for e in aborts.engine) != asynchronous


def test_a_bad_serve_line_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["gate", "--deployment", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a local directory holding config.json" in err and "Traceback" not in err


def test_the_workload_at_the_deployment(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`kvgate workload --deployment` sizes the pool from the deployment's own
    GPUs, utilization, layers and pages (the memory no flag says from its
    options) and measures at its served block and hash unit."""
    argv = ["workload", "--target", "model", "--scale", "16", "--sessions", "2"]
    argv += ["--turns", "3", "--out", str(tmp_path), "--gpu-memory-gib", "80", "-q"]
    assert cli.main([*argv, "--deployment", *serve_line()]) == 0
    out = capsys.readouterr().out
    assert "served: " in out and "80 GiB a GPU (--gpu-memory-gib)" in out
    assert "deployment: 4x80 GiB, utilization 0.92" in out
    assert "lookahead hashes 1" in out and "max 8 seqs" in out
    # The served block (320 tokens) and hash unit (64), divided by --scale.
    traces = sorted(tmp_path.glob("*.yaml"))
    assert traces
    for path in traces:
        config = yaml.safe_load(path.read_text())["config"]
        assert config["hash_unit"] == 64 // 16
        assert [g["block_size"] for g in config["groups"]] == [320 // 16, 320 // 16]
    pool = next(line for line in out.splitlines() if line.startswith("pool: "))
    assert pool.endswith("at unit 4") or " blocks at unit 4;" in pool
    assert any(line.split()[:2] == ["4", "off"] for line in out.splitlines())
