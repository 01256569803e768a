"""The recorder: vLLM's real `Scheduler` records its history as scheduler-level traces.

A seeded multi-turn workload (three sessions x two turns, every token count
/ 32, the hold on through the overlay) is served by vLLM's `Scheduler` on
CPU with the recorder on; the recording replays with no divergence on the
model and on vLLM at strict level, and diverges on vLLM under one of the
fault campaign's faults. With the recorder off, no vLLM method is wrapped.
Recordings cut short (no end line, a line cut mid-write, an entry this
reader does not know) are one error naming the file and the entry, and
replay up to the cut with `--partial`. A write that fails stops recording
with one log line and leaves the engine serving.

`KVGATE_LONG_RECORDING=1` also records a longer workload (several hundred
engine steps), replays it on both targets, and shrinks its divergence under
the fault to at most 5% of its entries (`kvgate shrink`).
"""

from __future__ import annotations

import errno
import functools
import io
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm

from kvgate import cli, targets
from kvgate.conformance.trace import bundled_scheduler_corpus, load_trace
from kvgate.impl import recorder
from kvgate.mutate.faults import select
from kvgate.mutate.inject import injected
from kvgate.workload.deployment import Deployment
from kvgate.workload.lockstep import scheduler_arm
from kvgate.workload.plan import Workload
from kvgate.workload.progress import Progress
from kvgate.workload.runner import Arm, ArmResult

pytestmark = needs_vllm

PLUGIN = "kvgate.impl.hold_overlay"
SCALE = 32
UNIT = 64 // SCALE
# A fault the workload's multi-turn traffic runs into.
FAULT = "free-order-not-reversed"


@pytest.fixture(autouse=True, scope="module")
def _vllm_as_found() -> Iterator[None]:
    """These runs load the overlay and the recorder; no later test may run on them."""
    from kvgate.impl import hold_overlay

    before = hold_overlay.is_registered()
    yield
    recorder.uninstall()
    if not before and hold_overlay.is_registered():
        hold_overlay.unregister()


def wrapped_methods() -> list[str]:
    """The `Scheduler` methods that are not vLLM's own."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return sorted(
        name
        for name, value in vars(Scheduler).items()
        if callable(value) and not str(getattr(value, "__module__", "vllm")).startswith("vllm")
    )


def record_workload(out: Path, workload: Workload, hold: bool) -> tuple[ArmResult, Path]:
    """Serve `workload` on vLLM's Scheduler with the recorder on: the arm's
    result and the one recording it wrote."""
    factory: Any = targets.target_factory("vllm-scheduler")
    if hold:
        factory = functools.partial(factory, plugin=PLUGIN)
    recordings = out / "recordings"
    recorder.install(recordings)
    try:
        result = scheduler_arm(
            workload,
            Deployment(build="upstream").scaled(SCALE),
            Arm(UNIT, hold),
            factory,
            out / "workload",
            "strict",
            Progress(stream=io.StringIO()),
        )
    finally:
        recorder.uninstall()
    [path] = sorted(recordings.iterdir())
    return result, path


@pytest.fixture(scope="module")
def small_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short recording: a bundled trace's history on vLLM's Scheduler."""
    trace = bundled_scheduler_corpus() / "sched-next-turn-after-preempted.yaml"
    recordings = tmp_path_factory.mktemp("small") / "recordings"
    recorder.install(recordings)
    try:
        assert cli.main(["replay", str(trace), "--target", "vllm"]) == 0
    finally:
        recorder.uninstall()
    [path] = sorted(recordings.iterdir())
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[ArmResult, Path]:
    return record_workload(tmp_path_factory.mktemp("record"), Workload(sessions=3, turns=2), True)


def test_with_the_recorder_off_nothing_is_wrapped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    recorder.uninstall()
    monkeypatch.delenv(recorder.RECORD_SWITCH, raising=False)
    recorder.register()
    assert wrapped_methods() == []
    monkeypatch.setenv(recorder.RECORD_SWITCH, "")
    recorder.register()
    assert wrapped_methods() == []
    # Opted in, the same entry point wraps every entry point of the Scheduler.
    monkeypatch.setenv(recorder.RECORD_SWITCH, str(tmp_path))
    try:
        recorder.register()
        assert wrapped_methods() == sorted(recorder.WRAPPED)
    finally:
        recorder.uninstall()
    assert wrapped_methods() == []


def test_the_recorded_arm_is_gated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run with the hold, where the hold decides a follow-up's cached
    tokens, records the hold-on arm: the recording conforms on the model
    (hold on) and on vLLM with the overlay; on vLLM without it the gate says
    the build lacks the hold (the follow-up's recorded hit is not there)."""
    from kvgate.impl import hold_overlay

    trace = bundled_scheduler_corpus() / "sched-mamba2-next-turn-after-burst.hold-on.yaml"
    recordings = tmp_path / "recordings"
    recorder.install(recordings)
    try:
        assert cli.main(["replay", str(trace), "--target", "vllm", "--plugin", PLUGIN]) == 0
    finally:
        recorder.uninstall()
    [path] = sorted(recordings.iterdir())
    assert load_trace(path).config.hold
    assert cli.main(["replay", str(path), "--target", "model"]) == 0
    assert cli.main(["replay", str(path), "--target", "vllm", "--plugin", PLUGIN]) == 0
    hold_overlay.unregister()
    capsys.readouterr()
    assert cli.main(["replay", str(path), "--target", "vllm"]) == 4
    out = capsys.readouterr().out
    assert f"LACKS {path.stem}" in out and "hold" in out


def test_the_recording_diverges_under_a_fault(
    recorded: tuple[ArmResult, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, path = recorded
    [fault] = select([FAULT])
    with injected(fault):
        code = cli.main(["replay", str(path), "--target", "vllm", "--plugin", PLUGIN])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL" in out


def test_token_ids_are_renamed_to_prefixes() -> None:
    renamer = recorder._Renamer()
    first, _ = renamer.prompt("r0", [5, 6, 7])
    shared, _ = renamer.prompt("r1", [5, 6, 8])
    moved, _ = renamer.prompt("r2", [9, 6, 7])
    ids = [s["tokens"] for s in (first[0], shared[0], moved[0])]
    assert ids[0][:2] == ids[1][:2] and ids[0][2] != ids[1][2]
    # The same tokens after another first token share nothing.
    assert not set(ids[2]) & set(ids[0])
    assert all(t >= recorder.RENAMED_BASE for t in ids[0] + ids[2])
    # A prompt continuing a finished request's whole sequence copies it.
    renamer.finished("r0", [5, 6, 7, 40, 41])
    follow_up, follows = renamer.prompt("r3", [5, 6, 7, 40, 41, 3])
    assert follows == "r0" and follow_up[0] == {"all_of": "r0"} and len(follow_up[1]["tokens"]) == 1
    # Its renamed tail is the trie's: another prompt continuing r0 the same
    # way shares it.
    same, follows = renamer.prompt("r4", [5, 6, 7, 40, 41, 3, 8])
    assert follows == "r0" and same[1]["tokens"][0] == follow_up[1]["tokens"][0]


def cut_variants(path: Path, out: Path) -> dict[str, tuple[Path, int]]:
    """The recording cut three ways: each file and the entries before its cut."""
    lines = path.read_text().splitlines(keepends=True)
    start = lines.index("engine:\n") + 1
    entries = len(lines) - start - 1
    assert lines[-1].startswith("end:")
    cut_at = entries // 2
    variants = {
        "truncated": ("".join(lines[:-1]), entries),
        "cut-mid-write": ("".join(lines[: start + cut_at]) + lines[start + cut_at][:25], cut_at),
        "unknown-call": (
            "".join(lines[: start + cut_at])
            + "  - {op: drafts, req: r0, accepted: 2}\n"
            + "".join(lines[start + cut_at :]),
            cut_at,
        ),
    }
    out.mkdir()
    written = {}
    for name, (text, before) in variants.items():
        file = out / f"{name}.yaml"
        file.write_text(text.replace(f"name: {path.stem}", f"name: {name}"))
        written[name] = (file, before)
    return written


@pytest.mark.parametrize("how", ["truncated", "cut-mid-write", "unknown-call"])
def test_a_recording_cut_short_is_one_error_and_replays_up_to_the_cut(
    small_recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    file, before = cut_variants(small_recording, tmp_path / "cut")[how]
    assert cli.main(["replay", str(small_recording), "--target", "model"]) == 0
    assert cli.main(["replay", str(file), "--target", "model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"kvgate: error: {file}: step {before}: ")
    assert f"--partial replays the {before} entries recorded before it" in err[0]
    assert cli.main(["replay", str(file), "--target", "model", "--partial", "-v"]) == 0
    out = capsys.readouterr().out
    assert f"PASS {how} ({before} steps" in out


def test_shrink_refuses_a_recording_cut_short_unless_partial(
    small_recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file, before = cut_variants(small_recording, tmp_path / "cut")["truncated"]
    shrink = ["shrink", str(file), "--target", "model", "-o", str(tmp_path / "out.yaml")]
    assert cli.main(shrink) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"kvgate: error: {file}: step {before}: ")
    assert "--partial replays" in line
    # With --partial the entries before the cut are read: they conform on
    # the model, so there is nothing to shrink.
    assert cli.main([*shrink, "--partial"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"kvgate: error: {file}: does not diverge on --target model: nothing to shrink"


def serve_with_a_stop_token(recordings: Path) -> None:
    """vLLM's Scheduler serves A, whose client asked for a stop token that A
    samples as its 4th output token of 8, then B, which continues A's whole
    conversation; recorded into `recordings`."""
    from kvgate.impl.vllm_scheduler import VllmScheduler

    stop_token = 7
    config = load_trace(bundled_scheduler_corpus() / "sched-abort-mid-prefill.yaml").config
    recorder.install(recordings)
    try:
        real = VllmScheduler(config, spec_tokens=0, max_num_seqs=4)
        real.add_request("A", list(range(1000, 1100)), 8, None)
        requests = real.scheduler.requests
        requests["A"].sampling_params.stop_token_ids = [stop_token]
        sequence_of_a: list[int] = []
        for _ in range(40):
            if not requests and not sequence_of_a:
                sequence_of_a = [*range(1000, 1100), 5, 5, 5, stop_token]
                real.add_request("B", [*sequence_of_a, 9, 9, 9], 2, "A")
            if not requests:
                break
            scheduled = real.schedule().scheduled
            sampled = {}
            for name, _ in scheduled:
                request = requests[name]
                # A chunk that reaches the sequence's end samples a token.
                if request.num_computed_tokens >= request.num_tokens:
                    last = name == "A" and request.num_output_tokens == 3
                    sampled[name] = [stop_token if last else 5]
            real.update(sampled)
        assert not requests, "both requests finished"
        # Shutting the Scheduler down ends its file (the recorder is still on).
        real.scheduler.shutdown()
        [path] = sorted(recordings.iterdir())
        entries = len(load_trace(path).engine)
        assert path.read_text().endswith(f"end: {{entries: {entries}}}\n")
        real.close()
    finally:
        recorder.uninstall()


def test_a_request_ended_by_a_stop_token_is_recorded_and_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recordings = tmp_path / "recordings"
    serve_with_a_stop_token(recordings)
    [path] = sorted(recordings.iterdir())
    trace = load_trace(path)
    [stop_step] = [e for e in trace.engine if e.stop]
    assert stop_step.stop == ("r0",) and stop_step.expect["finished"] == ["r0"]
    follow_up = [e for e in trace.engine if e.op == "arrive"][1]
    assert follow_up.follows == "r0" and follow_up.prompt[0].req == "r0"
    assert cli.main(["replay", str(path), "--target", "model"]) == 0
    assert cli.main(["replay", str(path), "--target", "vllm"]) == 0
    # Without its stop, r0 runs on to its max_tokens: not what was recorded.
    drifted = tmp_path / "drifted.yaml"
    drifted.write_text(path.read_text().replace("stop: [r0], ", ""))
    capsys.readouterr()
    assert cli.main(["replay", str(drifted), "--target", "model"]) == 1
    assert "finished" in capsys.readouterr().out


class _FillsUp(io.StringIO):
    """A file on a disk that fills up after a few lines."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def write(self, text: str) -> int:
        self.room -= 1
        if self.room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(text)


@pytest.mark.parametrize("how", ["disk-full", "directory-unwritable"])
def test_a_failed_write_stops_recording_and_the_engine_serves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    trace = bundled_scheduler_corpus() / "sched-preempt-under-pressure-and-resume.yaml"
    if how == "disk-full":
        recorder.install(tmp_path, opener=lambda _path: _FillsUp(room=4))
    else:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        recorder.install(blocker / "recordings")
    # vLLM's loggers do not propagate to the root logger pytest listens on.
    logger = logging.getLogger(recorder.LOGGER_NAME)
    logger.addHandler(caplog.handler)
    try:
        assert cli.main(["replay", str(trace), "--target", "vllm"]) == 0
    finally:
        logger.removeHandler(caplog.handler)
        recorder.uninstall()
    lines = [r.getMessage() for r in caplog.records if r.name == recorder.LOGGER_NAME]
    assert len(lines) == 1, lines
    assert "stopped recording" in lines[0] and "writing failed" in lines[0]


def test_files_are_bounded_and_the_next_starts_from_an_empty_scheduler(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three entries a file: the first file ends mid-prefill; the next starts
    at the next arrival to an empty Scheduler (after the abort), with a warm
    prefix cache, so without expectations; each replays on the model."""
    trace = bundled_scheduler_corpus() / "sched-abort-mid-prefill.yaml"
    recordings = tmp_path / "recordings"
    recorder.install(recordings, recorder.RecordLimits(max_entries=3, max_files=2))
    try:
        assert cli.main(["replay", str(trace), "--target", "vllm"]) == 0
    finally:
        recorder.uninstall()
    first, second = (load_trace(p) for p in sorted(recordings.iterdir()))
    assert [e.op for e in first.engine] == ["arrive", "step", "step"]
    assert [e.op for e in second.engine] == ["arrive", "step", "step"]
    # A run without the hold records the hold-off arm.
    assert not first.config.hold
    assert first.engine[1].expect == {"scheduled": [("r0", 64)]}
    assert all(not e.expect for e in second.engine)
    capsys.readouterr()
    assert cli.main(["gate", "--no-bundled", "--corpus", str(recordings), "--target", "model"]) == 0
    assert "2 passed" in capsys.readouterr().out


needs_long = pytest.mark.skipif(
    not os.environ.get("KVGATE_LONG_RECORDING"), reason="set KVGATE_LONG_RECORDING=1"
)


@pytest.fixture(scope="module")
def long_recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[ArmResult, Path]:
    return record_workload(tmp_path_factory.mktemp("long"), Workload(sessions=10, turns=6), True)


@pytest.mark.parametrize(
    ("fixture", "least_steps"),
    [("recorded", 51), pytest.param("long_recorded", 300, marks=needs_long)],
    ids=["short", "long"],
)
def test_a_recording_replays_on_the_model_and_on_vllm(
    fixture: str,
    least_steps: int,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The workload's recording (short, or long with `KVGATE_LONG_RECORDING`)
    passed its own replay, replays on the model, and passes the gate over its
    directory on vLLM's Scheduler in strict lockstep."""
    result, path = request.getfixturevalue(fixture)
    assert result.replay is not None and result.replay.passed
    trace = load_trace(path)
    steps = sum(e.op == "step" for e in trace.engine)
    assert steps >= least_steps
    # The arm is recorded: the run had the hold on.
    assert trace.config.hold
    assert cli.main(["replay", str(path), "--target", "model"]) == 0
    code = cli.main(
        [
            "gate",
            "--no-bundled",
            "--corpus",
            str(path.parent),
            "--target",
            "vllm",
            "--plugin",
            PLUGIN,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"PASS {trace.name}" in out
    print(f"{fixture}: {steps} engine steps, {len(trace.engine)} entries", file=sys.stderr)


@needs_long
def test_the_long_recording_diverging_under_a_fault_shrinks_to_five_percent(
    long_recorded: tuple[ArmResult, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under the fault the long recording diverges, and `kvgate shrink` makes
    it at most 5% of its engine steps, still diverging on vLLM."""
    _, path = long_recorded
    out = tmp_path / "small.yaml"
    [fault] = select([FAULT])
    shrink = ["shrink", str(path), "--target", "vllm", "--plugin", PLUGIN, "-o", str(out), "-q"]
    with injected(fault):
        assert cli.main(shrink) == 0
        account = capsys.readouterr().out.strip().splitlines()[-1]
        code = cli.main(["replay", str(out), "--target", "vllm", "--plugin", PLUGIN])
    replayed = capsys.readouterr().out
    assert code == 1 and "FAIL" in replayed, replayed
    assert len(load_trace(out).engine) <= 0.05 * len(load_trace(path).engine), account
    print(f"long recording shrunk: {account}", file=sys.stderr)
