"""What differs between vLLM releases at the Scheduler level: the three
Scheduler-level differences of vLLM 0.32.0, named exactly, and a recording
of one replayed on another release, whose report names both releases; what kvgate
gives the Scheduler of a release that needs Triton to build its engine
config and has only the v2 model runner (vLLM 0.34.0), probed on the
installed build's objects; and, where `scripts/vllm-matrix.sh` has made a
release's environment (`.venvs/vllm-RELEASE`, or under
`KVGATE_MATRIX_VENVS`), the gate on that release itself."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from configs import needs_vllm
from scheduler_runs import CORPUS_DIR, trace_of

from kvgate.conformance.differences import explain
from kvgate.conformance.replay import Divergence
from kvgate.vocabulary.ops import Step

ROOT = Path(__file__).resolve().parent.parent


def _divergence(
    trace: str, index: int, level: str, what: str, expected: object, actual: object
) -> Divergence:
    return Divergence(
        trace=trace,
        path=Path(f"{trace}.yaml"),
        step=Step(op="step", index=index),
        level=level,  # type: ignore[arg-type]
        what=what,
        expected=expected,
        actual=actual,
    )


def test_accepted_drafts_keyed_late_explains_only_its_divergence() -> None:
    def at(index: int, what: str, actual: tuple[str, ...]) -> Divergence:
        return _divergence("sched-mtp-accepted-drafts", index, "strict", what, ("g0/64:k",), actual)

    known = explain(at(3, "engine step 3: block 12 hashes", ()))
    assert known is not None and known.name == "accepted-drafts-keyed-late"
    assert "0.32.0 bug" in known.verdict
    assert explain(at(4, "engine step 4: block 12 hashes", ())) is None  # another step
    assert explain(at(3, "engine step 3: block 12 hashes", ("g0/64:x",))) is None
    assert explain(at(3, "engine step 3: block 12 ref", ())) is None


def test_priority_self_preemption_explains_only_its_divergence() -> None:
    def at(index: int, expected: object, actual: object) -> Divergence:
        return _divergence(
            "sched-priority-preempts-lowest-running", index, "expect", "scheduled", expected, actual
        )

    known = explain(at(8, [("H", 1)], []))
    assert known is not None and known.name == "priority-self-preemption-ends-scan"
    assert "0.32.0 bug" in known.verdict
    assert explain(at(8, [("H", 1)], [("L", 1)])) is None  # another schedule
    assert explain(at(7, [("H", 1)], [])) is None  # another step


def test_rekeyed_hit_explains_only_its_divergence() -> None:
    def at(index: int, actual: object) -> Divergence:
        return _divergence(
            "sched-first-turns-resume-from-one-cached-prefix",
            index,
            "expect",
            "scheduled",
            [("W", 1), ("S1", 10), ("S2", 20)],
            actual,
        )

    known = explain(at(5, [("W", 1), ("S1", 10)]))
    assert known is not None and known.name == "rekeyed-hit-holds-back-siblings"
    assert "0.32.0 bug" in known.verdict
    assert explain(at(5, [("W", 1)])) is None  # another schedule
    assert explain(at(6, [("W", 1), ("S1", 10)])) is None  # another step


def _recording(tmp_path: Path, release: str) -> Path:
    """The bundled trace whose two first turns vLLM 0.32.0 admits a step
    apart, as a recording by `release` holding what vLLM 0.32.0 did up to
    that step: S1 admitted alone, S2 held back."""
    text = (CORPUS_DIR / "sched-first-turns-resume-from-one-cached-prefix.yaml").read_text()
    head, _, entries = text.partition("engine:\n")
    lines = entries.splitlines()[:5] + [
        "  - {op: step, expect: {scheduled: [[W, 1], [S1, 10]], finished: [W]}}"
    ]
    path = tmp_path / f"rec-by-{release}.yaml"
    path.write_text(
        head.replace("name: sched-", "name: rec-")
        + f"recording: {{vllm: {release}, part: 1, device: cpu}}\nengine:\n"
        + "\n".join(lines)
        + f"\nend: {{entries: {len(lines)}}}\n"
    )
    return path


@needs_vllm
@pytest.mark.parametrize("target", ["vllm", "model"])
def test_a_recording_replayed_on_another_release_names_both_where_they_differ(
    tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 0.32.0 recording fails on 0.33.0 (and on the model of it) where the
    releases differ, and the report says that both agree there and that the
    recording's release did otherwise; a recording that names the release
    it is replayed on gets no such line."""
    from kvgate import cli

    assert cli.main(["replay", str(_recording(tmp_path, "0.32.0")), "--target", target]) == 1
    out = capsys.readouterr().out
    assert "first divergence at step 5 (step), level expect" in out
    on = "kvgate's model of vLLM 0.33.0" if target == "model" else "vLLM 0.33.0, with which"
    assert f"  releases: recorded by vLLM 0.32.0, replayed on {on}" in out
    assert "the expected value is what vLLM 0.32.0 did" in out
    assert cli.main(["replay", str(_recording(tmp_path, "0.33.0")), "--target", target]) == 1
    out = capsys.readouterr().out
    assert "first divergence at step 5 (step), level expect" in out
    assert "releases:" not in out


@needs_vllm
def test_the_model_runner_is_probed_on_the_scheduler() -> None:
    """A build with both runners carries the engine's choice; one whose v1
    runner was removed carries neither the choice nor the v1 runner's record
    of last step's requests, and stands for a v1 trace's runner; one with the
    v1 runner only cannot stand for the v2 one."""
    from kvgate.impl.vllm_probe import model_runner
    from kvgate.impl.vllm_scheduler import VllmScheduler
    from kvgate.impl.vllm_scheduler_config import _runner_for

    v2 = trace_of("sched-model-runner-v2-preempt-and-resume")
    v1 = trace_of("sched-abort-mid-prefill")
    for trace, runner in ((v1, "v1"), (v2, "v2")):
        assert trace.config.model_runner == runner and trace.scheduler is not None
        real = VllmScheduler(trace.config, spec_tokens=0, max_num_seqs=4)
        try:
            scheduler = real._scheduler
            assert model_runner(scheduler) == (runner, True)
            if hasattr(scheduler, "prev_step_scheduled_req_ids"):
                del scheduler.use_v2_model_runner  # a build with the v1 runner only
                assert model_runner(scheduler) == ("v1", False)
                assert _runner_for(scheduler, v2.config) == "v1"
                del scheduler.prev_step_scheduled_req_ids  # one without it
                assert model_runner(scheduler) == ("v2", False)
                assert _runner_for(scheduler, v1.config) == "v1"
                assert _runner_for(scheduler, v2.config) == "v2"
        finally:
            real.close()


@needs_vllm
def test_triton_is_recorded_present_only_while_the_engine_config_is_built() -> None:
    """In `vllm.triton_utils`, and in the copy the engine config's module
    took (vLLM 0.32.0 refuses the v2 model runner by it)."""
    import importlib

    from kvgate.impl.vllm_scheduler_config import _triton_as_on_a_gpu

    modules = [importlib.import_module(n) for n in ("vllm.triton_utils", "vllm.config.vllm")]
    before = [getattr(m, "HAS_TRITON", None) for m in modules]
    assert before[0] is not None
    with _triton_as_on_a_gpu():
        during = [getattr(m, "HAS_TRITON", None) for m in modules]
    assert during == [None if b is None else True for b in before]
    assert [getattr(m, "HAS_TRITON", None) for m in modules] == before


def _release_venv(release: str) -> Path:
    base = Path(os.environ.get("KVGATE_MATRIX_VENVS", ROOT / ".venvs"))
    venv = base / f"vllm-{release}"
    if not (venv / "bin" / "python").exists():
        pytest.skip(
            f"no environment for vLLM {release} (scripts/vllm-matrix.sh {release} makes it)"
        )
    return venv


def _gate(release: str, *names: str) -> str:
    """The gate's report on `names` (Scheduler-level traces) on that release."""
    venv = _release_venv(release)
    expr = " or ".join(names)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "kvgate", "gate", "--target", "vllm"]
        + ["--require", "none", "--corpus", str(CORPUS_DIR), "-k", expr],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert done.stdout.startswith(f"target: vllm {release} "), done.stdout + done.stderr
    return done.stdout


def test_vllm_0_32_0_fails_its_three_scheduler_differences_by_name() -> None:
    """And runs the traces for the v2 model runner, which its engine config
    refuses without Triton."""
    out = _gate(
        "0.32.0",
        "sched-mtp-accepted-drafts",
        "sched-priority-preempts-lowest-running",
        "sched-first-turns-resume-from-one-cached-prefix",
        "sched-model-runner-v2-preempt-and-resume",
    )
    assert "PASS sched-model-runner-v2-preempt-and-resume " in out
    assert "FAIL sched-mtp-accepted-drafts " in out
    assert "FAIL sched-priority-preempts-lowest-running " in out
    assert "known:    difference accepted-drafts-keyed-late:" in out
    assert "known:    difference priority-self-preemption-ends-scan:" in out
    assert "FAIL sched-first-turns-resume-from-one-cached-prefix " in out
    assert "known:    difference rekeyed-hit-holds-back-siblings:" in out
    assert out.rstrip().endswith("1 passed, 3 failed")


def test_vllm_0_34_0_runs_the_scheduler_level_traces() -> None:
    """Its engine config needs Triton and its Scheduler has the v2 model
    runner only: traces for either runner run on it."""
    out = _gate("0.34.0", "sched-abort-mid-prefill", "sched-model-runner-v2-preempt-and-resume")
    assert out.rstrip().endswith("2 passed, 0 failed"), out


def test_the_how_to_lists_every_known_difference_with_its_trace() -> None:
    from kvgate.conformance.differences import KNOWN

    page = (ROOT / "docs" / "how-to" / "gate-another-release.md").read_text()
    rows = {
        line.split("|")[1].strip(" `"): line for line in page.splitlines() if line.startswith("| `")
    }
    assert set(rows) >= {known.name for known in KNOWN}
    for known in KNOWN:
        assert f"`{known.trace}`" in rows[known.name], known.name
