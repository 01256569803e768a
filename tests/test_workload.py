"""The workload generator and `kvgate workload`, at a reduced scale.

The small workload is the default one (9 agent sessions x 8 turns, seed 0)
with every token count divided by 32, so the Mamba block is 128 tokens and
the units 8, 32 and 128 stand for 256, 1024 and 4096. It keeps the pool under
the same moderate pressure as the full-size run and replays in seconds.
"""

from __future__ import annotations

import importlib.util
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvgate import cli, targets
from kvgate.conformance.replay import replay
from kvgate.conformance.trace import parse_trace
from kvgate.conformance.writer import dump_trace
from kvgate.model import ModelTarget
from kvgate.workload.deployment import Deployment
from kvgate.workload.generator import generate
from kvgate.workload.measure import ArmCounts, Recorder, count
from kvgate.workload.plan import Workload, make_plan
from kvgate.workload.progress import Progress
from kvgate.workload.runner import Arm, ArmResult, factories, replay_arm, write_traces

SCALE = 32
WORKLOAD = Workload()
# The production build (retired states retained in both arms) and upstream.
FORK = Deployment(build="fork").scaled(SCALE)
UPSTREAM = Deployment(build="upstream").scaled(SCALE)
BLOCK = FORK.mamba_block_size // SCALE
UNITS = (256 // SCALE, 1024 // SCALE, BLOCK)
ARMS = [Arm(unit, hold) for unit in UNITS for hold in (False, True)]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _quiet() -> Progress:
    return Progress(stream=io.StringIO())


def _generate(workload: Workload, unit: int, hold: bool) -> str:
    config = FORK.config(unit, hold, workload.sessions)
    steps = generate(config, make_plan(workload, SCALE), FORK.serving(workload.system_prompt))
    return dump_trace("t", config, steps)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Each build's traces, one per arm."""
    out = tmp_path_factory.mktemp("workload")
    return {d.build: write_traces(WORKLOAD, d, ARMS, out, _quiet()) for d in (FORK, UPSTREAM)}


def _replay_all(paths: list[Path], target: str, plugin: str | None) -> list[ArmResult]:
    factory, model = factories(targets.target_factory, target, plugin, targets.LOCKSTEP_MODEL)
    return [
        replay_arm(path, arm, factory, model, "api", _quiet())
        for arm, path in zip(ARMS, paths, strict=True)
    ]


@pytest.fixture(scope="module")
def on_model(traces: dict[str, list[Path]]) -> dict[str, list[ArmResult]]:
    return {build: _replay_all(paths, "model", None) for build, paths in traces.items()}


def _counts(results: list[ArmResult], unit: int, hold: bool) -> ArmCounts:
    (result,) = [r for r in results if r.arm == Arm(unit, hold)]
    assert result.replay is not None and result.replay.passed, result.replay
    assert result.counts is not None
    return result.counts


# -- the plan and the generator ---------------------------------------------------


def test_plan_grows_prompts_to_the_final_length() -> None:
    sessions = make_plan(WORKLOAD)
    assert len(sessions) == WORKLOAD.sessions
    low, high = WORKLOAD.final_prompt
    for session in sessions:
        assert len(session.turns) == WORKLOAD.turns
        assert low <= session.final_prompt + WORKLOAD.system_prompt <= high
        assert all(t.output >= 2 for t in session.turns)
        assert all(t.delay >= 1 for t in session.turns[1:])


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    small = Workload(sessions=3, turns=3)
    first = _generate(small, UNITS[0], hold=False)
    assert _generate(small, UNITS[0], hold=False) == first
    assert _generate(Workload(sessions=3, turns=3, seed=1), UNITS[0], hold=False) != first


def test_pool_has_the_same_attention_capacity_at_every_unit() -> None:
    full = Deployment()
    footprint = WORKLOAD.sessions * full.mamba_footprint
    tokens = [
        (full.num_blocks(u, WORKLOAD.sessions) - 1 - footprint) * full.attention_block(u)
        for u in (64, 256, 1024, 4096)
    ]
    assert max(tokens) - min(tokens) < 4096  # rounding to whole blocks only
    # The worker's blocks in align mode: one block for attention and Mamba,
    # only the hash unit finer; one MTP layer's lookahead hashes.
    config = full.config(64, hold=False, concurrency=1)
    assert {g.block_size for g in config.groups} == {full.mamba_block_size}
    assert (config.hash_unit, config.hash_lookahead_tokens) == (64, 1)
    with pytest.raises(ValueError, match="does not divide"):
        full.config(48, hold=False, concurrency=1)


def test_trace_reads_back_as_written(traces: dict[str, list[Path]]) -> None:
    from kvgate.conformance.trace import load_trace

    path = traces["fork"][0]
    trace = load_trace(path)
    assert trace.config == FORK.config(ARMS[0].unit, ARMS[0].hold, WORKLOAD.sessions)
    assert trace.config.retain_retired and not UPSTREAM.config(8, False, 1).retain_retired
    assert dump_trace(trace.name, trace.config, trace.steps, trace.about) == path.read_text()
    ops = {s.op for s in trace.steps}
    # Interleaved sessions: explicit and auto chunks, decodes, admissions, checks.
    assert {"arrive", "lookup", "reserve", "allocate", "decode1", "step", "drain"} <= ops
    assert {"free", "check"} <= ops
    assert {s.tokens == "auto" for s in trace.steps if s.op == "allocate"} == {True, False}


# -- the measurement on the model ---------------------------------------------------


def test_production_table_misses_only_after_partial_tail_resumes(
    on_model: dict[str, list[ArmResult]],
) -> None:
    """The fork without the hold: total misses below the Mamba block size,
    every one after a partial-tail resume; none at the block size."""
    fork = on_model["fork"]
    for unit in UNITS[:-1]:
        off = _counts(fork, unit, hold=False)
        assert len(off.follow_ups) == WORKLOAD.sessions * (WORKLOAD.turns - 1)
        assert off.total_misses > 0
        assert off.after_partial == off.total_misses and off.after_aligned == 0
    assert _counts(fork, BLOCK, hold=False).total_misses == 0


def test_the_hold_removes_every_miss_on_the_fork(on_model: dict[str, list[ArmResult]]) -> None:
    fork = on_model["fork"]
    for unit in UNITS:
        assert _counts(fork, unit, hold=True).total_misses == 0
    for unit in UNITS[:-1]:
        off, on = _counts(fork, unit, hold=False), _counts(fork, unit, hold=True)
        assert on.mean_cached_fraction > off.mean_cached_fraction


def test_upstream_misses_at_the_block_size_too(on_model: dict[str, list[ArmResult]]) -> None:
    """vLLM 0.33.0 keeps no retired state: a turn's whole-block state waits in
    the free queue like the tail copy. The hold alone covers sub-block tails
    only (a miss is left where a turn's tail is a whole-block key, or where
    the turn before resumed at a whole block: nothing was held), and at the
    block size changes nothing."""
    upstream = on_model["upstream"]
    for unit in UNITS[:-1]:
        off, on = _counts(upstream, unit, hold=False), _counts(upstream, unit, hold=True)
        assert off.after_partial > 0
        assert on.after_partial == 0
        # Each miss left: a whole-block tail key, or a turn after one that
        # resumed at a whole block (it held nothing).
        after_whole_resume = [
            f
            for f in on.follow_ups
            if f.total_miss
            and not f.aligned_tail
            and f.previous_hit > 0
            and f.previous_hit % BLOCK == 0
        ]
        assert on.total_misses == on.aligned_tail + len(after_whole_resume)
        assert on.total_misses < off.total_misses
    off, on = _counts(upstream, BLOCK, hold=False), _counts(upstream, BLOCK, hold=True)
    assert on == off
    assert off.total_misses > 0 and off.total_misses == off.aligned_tail == off.after_aligned
    (off_trace,) = [r.trace for r in upstream if r.arm == Arm(BLOCK, False)]
    (on_trace,) = [r.trace for r in upstream if r.arm == Arm(BLOCK, True)]
    assert on_trace.steps == off_trace.steps


# -- the same traces on vLLM ------------------------------------------------------------


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_vllm_matches_the_model_exactly(
    traces: dict[str, list[Path]],
    on_model: dict[str, list[ArmResult]],
    hold_overlay_plugin: str,
) -> None:
    for build, paths in traces.items():
        on_vllm = _replay_all(paths, "vllm", hold_overlay_plugin)
        for model_result, vllm_result in zip(on_model[build], on_vllm, strict=True):
            # The overlay gives vLLM the hold and the fork's retention.
            assert not vllm_result.skipped, (build, vllm_result.arm)
            assert vllm_result.replay is not None
            assert vllm_result.replay.passed, vllm_result.replay.divergence
            assert vllm_result.replay.capabilities.implementation.startswith("vllm")
            assert vllm_result.counts == model_result.counts
        assert {r.arm.hold for r in on_vllm} == {True, False}


# -- counting, on a hand-written trace ----------------------------------------------------

# The seed's first scenario: A1 resumes at A0's partial tail; a burst takes
# every free block while A1 decodes; A2 follows A1.
SEED1 = """\
format: kvgate-trace/1
name: seed1
config:
  num_blocks: 96
  hash_unit: 8
  eagle: true
  retention_interval: 0
  retain_checkpoint: {hold}
  groups:
    - {{kind: full_attention, block_size: 8}}
    - {{kind: mamba_align, block_size: 32, speculative_blocks: 3}}
steps:
  - {{op: arrive, req: A0, prompt: [{{fresh: 150}}]}}
  - {{op: prefill, req: A0, lookahead: 3}}
  - {{op: decode, req: A0, steps: 4, spec: 3}}
  - {{op: free, req: A0, how: finish}}
  - {{op: drain}}
  - {{op: arrive, req: A1, prompt: [{{all_of: A0}}, {{fresh: 26}}]}}
  - {{op: check, attention_cached: {{A0: 144}}}}
  - {{op: prefill, req: A1, lookahead: 3, expect: {{hit: 136}}}}
  - {{op: decode, req: A1, steps: 4, spec: 3}}
  - {{op: evict, blocks: all}}
  - {{op: free, req: A1, how: finish}}
  - {{op: drain}}
  - {{op: arrive, req: A2, prompt: [{{all_of: A1}}, {{fresh: 22}}]}}
  - {{op: check, attention_cached: {{A1: 176}}}}
  - {{op: prefill, req: A2, lookahead: 3, expect: {{hit: {hit}}}}}
"""


@pytest.mark.parametrize(("hold", "hit"), [(False, 0), (True, 168)])
def test_counts_classify_the_seed_scenario(hold: bool, hit: int) -> None:
    trace = parse_trace(SEED1.format(hold=str(hold).lower(), hit=hit))
    recorder = Recorder(ModelTarget(trace.config))
    assert replay(trace, recorder, None, "api").passed
    counts = count(recorder, trace.config)
    by_name = {f.name: f for f in counts.follow_ups}
    assert set(by_name) == {"A1", "A2"}
    assert by_name["A1"].hit == 136 and not by_name["A1"].partial_resume  # A0 was cold
    a2 = by_name["A2"]
    assert (a2.hit, a2.previous_hit, a2.previous_whole, a2.partial_resume) == (hit, 136, True, True)
    assert counts.total_misses == counts.after_partial == (0 if hold else 1)
    assert counts.after_aligned == counts.prefix_evicted == 0


# -- the command -------------------------------------------------------------------------


def test_command_writes_traces_table_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["workload", "--target", "model", "--scale", "64", "--units", "256,4096"]
    argv += ["--sessions", "2", "--turns", "2", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "total misses" in out and "after partial-tail" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["4"], ["64"])]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("4", "off", "2"),
        ("4", "on", "2"),
        ("64", "off", "2"),
        ("64", "on", "2"),
    ]
    assert len(list(tmp_path.glob("workload-2x2-seed0-div64-u*.fork.hold-o*.yaml"))) == 4
    stem = tmp_path / "workload-2x2-seed0-div64-fork"
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert '"follow_ups": 2' in stem.with_suffix(".json").read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--units", "100"], "--units: 100 is not a positive multiple of --scale 64"),
        (["--units", "a"], "--units: 'a' is not a comma-separated list"),
        (["--hold", "maybe"], "--hold: 'maybe' is not on, off or both"),
        (["--plugin", "x"], "--plugin: only the vLLM targets load plugins"),
        (["--units", "192"], "unit 3 does not divide the Mamba block 64"),
    ],
)
def test_command_refuses_bad_input_in_one_line(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["workload", "--target", "model", "--scale", "64", "--out", str(tmp_path), *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_progress_bar_redraws_on_a_terminal_and_logs_one_line_elsewhere(tmp_path: Path) -> None:
    class Tty:
        def __init__(self) -> None:
            self.text = ""

        def isatty(self) -> bool:
            return True

        def write(self, s: str) -> int:
            self.text += s
            return len(s)

        def flush(self) -> None:
            return None

    tty = Tty()
    bar = Progress(stream=tty, interval=0)  # type: ignore[arg-type]
    bar.start("replay", 4)
    bar.advance(2)
    bar.finish("ok")
    assert "\r" in tty.text and " 50%" in tty.text and tty.text.endswith("ok\n")
    log = tmp_path / "log.txt"
    with log.open("w") as stream:
        plain = Progress(stream=stream)
        plain.start("replay", 4)
        plain.advance(4)
        plain.finish("ok")
    assert log.read_text().startswith("replay: done in ")
    assert log.read_text().count("\n") == 1


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_no_arm_the_target_can_run_is_an_error_not_a_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fork's arms need retired-state retention, which vLLM 0.33.0 lacks
    without the overlay: nothing can replay, so the command fails in one
    line, before it writes a single trace."""
    argv = ["workload", "--target", "vllm", "--scale", "64", "--units", "4096", "--hold", "off"]
    argv += ["--sessions", "2", "--turns", "2", "--out", str(tmp_path), "--build", "fork"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("kvgate: error:")]
    assert len(errors) == 1 and "keeps no retired state" in errors[0]
    assert err.rstrip().endswith(errors[0]) and "Traceback" not in err
    # Refused before generation: no trace, no progress line of one.
    assert not list(tmp_path.glob("*.yaml"))
    assert "generate" not in err


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@pytest.mark.parametrize("build", [None, "fork"])
def test_workload_on_vllm_runs_or_refuses_before_generating(
    build: str | None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvgate workload --target vllm` with no other flags: the build
    follows the target (upstream: vLLM keeps no retired state), so it gets
    as far as generating; with `--build fork` it is refused before that."""
    from kvgate.workload import command
    from kvgate.workload.generator import WorkloadStuck

    generated: list[str] = []

    def generation_stands_in(_workload: Any, deployment: Any, *_: Any) -> list[Path]:
        generated.append(deployment.build)
        raise WorkloadStuck("stopped here by the test, at generation")

    monkeypatch.setattr(command, "write_traces", generation_stands_in)
    argv = ["workload", "--target", "vllm", "--out", str(tmp_path)]
    argv += [] if build is None else ["--build", build]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    if build is None:
        assert generated == ["upstream"]
        assert "stopped here by the test" in err
    else:
        assert generated == []
        assert "no arm can run: vllm 0.33.0 keeps no retired state" in err


def test_the_build_follows_the_target() -> None:
    from kvgate.workload.command import default_build

    assert default_build("model", None) == "fork"
    assert default_build("vllm", None) == "upstream"
    assert default_build("vllm-scheduler", None) == "upstream"
    assert default_build("vllm", "kvgate.impl.hold_overlay") == "fork"


def test_a_turn_that_outgrows_the_pool_alone_is_stuck_not_a_livelock() -> None:
    """Its prompt fits (admitted), its sequence does not: alone it preempts
    itself and is re-admitted to the same end for ever, each step running
    something, while the turns waiting behind it never run (found on a pool
    too small for the plan; before, generation never ended)."""
    from configs import EXAMPLE_CONFIG

    from kvgate.vocabulary.config import GroupConfig
    from kvgate.workload.deployment import Serving
    from kvgate.workload.generator import WorkloadStuck
    from kvgate.workload.plan import Session, Turn

    config = replace(
        EXAMPLE_CONFIG,
        num_blocks=30,
        groups=(
            GroupConfig("full_attention", 8),
            GroupConfig("mamba_align", 512, speculative_blocks=2),
        ),
        hold=False,
        scheduler_block_size=512,
        max_model_len=512,
        max_num_scheduled_tokens=48,
        prefix_caching=False,
        mamba_cache_mode="none",
    )
    sessions = tuple(
        Session(i, (Turn(fresh=70 + 13 * i, output=150, delay=i), Turn(20, 75, 3)))
        for i in range(3)
    )
    with pytest.raises(WorkloadStuck, match="cannot run on a pool of 30 blocks: alone"):
        generate(config, sessions, Serving(0, 2, 16))
