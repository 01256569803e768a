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


def test_the_recording_names_the_device_its_engine_ran_on(small_recording: Path) -> None:
    """The header names the device of vLLM's platform (a CPU build's
    recording is then of the `gdn-cpu` family, not `gdn-triton`)."""
    from vllm.platforms import current_platform

    assert current_platform.device_type
    assert load_trace(small_recording).device == current_platform.device_type


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


def small_scheduler() -> Any:
    """vLLM's Scheduler (a `VllmScheduler`) on a small bundled trace's config:
    no drafts, four sequences at most."""
    from kvgate.impl.vllm_scheduler import VllmScheduler

    config = load_trace(bundled_scheduler_corpus() / "sched-abort-mid-prefill.yaml").config
    return VllmScheduler(config, spec_tokens=0, max_num_seqs=4)


def schedule_to_the_end(real: Any) -> list[str]:
    """One `schedule()` on `real`: the requests scheduled in it whose chunk
    reaches their sequence's end, the ones that sample a token."""
    requests = real.scheduler.requests
    return [
        name
        for name, _ in real.schedule().scheduled
        if requests[name].num_computed_tokens >= requests[name].num_tokens
    ]


def serve_with_a_stop_token(recordings: Path) -> None:
    """vLLM's Scheduler serves A, whose client asked for a stop token that A
    samples as its 4th output token of 8, then B, which continues A's whole
    conversation; recorded into `recordings`."""
    stop_token = 7
    recorder.install(recordings)
    try:
        real = small_scheduler()
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
            sampled = {}
            for name in schedule_to_the_end(real):
                last = name == "A" and requests[name].num_output_tokens == 3
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
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == recorder.LOGGER_NAME and r.levelno >= logging.WARNING
    ]
    assert len(lines) == 1, lines
    assert "stopped recording" in lines[0] and "writing failed" in lines[0]


def recorder_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == recorder.LOGGER_NAME]


@pytest.fixture
def recorder_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The recorder's log lines (vLLM's loggers do not propagate to the root
    logger pytest listens on)."""
    logger = logging.getLogger(recorder.LOGGER_NAME)
    level = logger.level
    logger.addHandler(caplog.handler)
    # A served engine logs at INFO (vLLM's default level).
    logger.setLevel(logging.INFO)
    caplog.handler.setLevel(logging.INFO)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)


def test_a_recording_goes_on_in_parts_under_steady_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recorder_log: pytest.LogCaptureFixture
) -> None:
    """Five entries a file while two requests decode side by side, one
    preempted: the Scheduler never empties, and the recording goes on in
    parts, each following the one before it; each part replays (after the
    parts before it) on the model and on vLLM at strict level, the gate over
    the directory replays the recording once, and each file's end is logged
    with why. After the file limit recording stops, saying so."""
    trace = bundled_scheduler_corpus() / "sched-preempt-under-pressure-and-resume.yaml"
    recordings = tmp_path / "recordings"
    recorder.install(recordings, recorder.RecordLimits(max_entries=5, max_files=4))
    try:
        assert cli.main(["replay", str(trace), "--target", "vllm"]) == 0
    finally:
        recorder.uninstall()
    parts = sorted(recordings.iterdir())
    assert len(parts) == 4
    lines = recorder_lines(recorder_log)
    for number, part in enumerate(parts, 1):
        text = part.read_text()
        assert text.endswith("end: {entries: 5}\n")
        if number > 1:
            assert f"follows: {parts[number - 2].name}" in text
        assert any(part.name in line and "limit is reached" in line for line in lines), lines
    assert "stopped recording" in lines[-1] and "the file limit (4)" in lines[-1]
    # The later parts hold expectations: the Scheduler was never emptied.
    last = load_trace(parts[-1])
    assert len(last.engine) == 20 and last.engine[-1].expect
    capsys.readouterr()
    for part in parts:
        assert cli.main(["replay", str(part), "--target", "model"]) == 0
        assert cli.main(["replay", str(part), "--target", "vllm", "--level", "strict"]) == 0
    assert cli.main(["gate", "--no-bundled", "--corpus", str(recordings), "--target", "vllm"]) == 0
    out = capsys.readouterr().out
    assert f"PASS {parts[-1].stem} (" in out and "1 passed" in out
    # A part whose predecessor is gone does not replay: one line naming it.
    parts[0].unlink()
    assert cli.main(["replay", str(parts[2]), "--target", "model"]) == 2
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error.startswith(
        f"kvgate: error: {parts[2]}: recording.follows: {parts[0].name}, which {parts[1].name} "
        "follows, is not in"
    )


def serve_with_an_abort_inside_a_step(recordings: Path, abort: str) -> None:
    """vLLM's Scheduler serves A and B side by side; while the step that runs
    `abort`'s last prompt chunk is in flight its client goes away (vLLM's
    engine core aborts it after `schedule()`, before the update); A runs to
    its end. Recorded into `recordings`."""
    from vllm.v1.request import RequestStatus

    recorder.install(recordings)
    try:
        real = small_scheduler()
        real.add_request("A", list(range(1000, 1100)), 6, None)
        real.add_request("B", list(range(2000, 2100)), 6, None)
        requests = real.scheduler.requests
        aborted = False
        for _ in range(40):
            if not requests:
                break
            sampled = {name: [5] for name in schedule_to_the_end(real)}
            if not aborted and abort in sampled:
                # Through the Scheduler's own entry point, as the engine calls it.
                real.scheduler.finish_requests(abort, RequestStatus.FINISHED_ABORTED)
                aborted = True
            real.update(sampled)
        assert aborted and not requests
        real.scheduler.shutdown()
        real.close()
    finally:
        recorder.uninstall()


def test_an_abort_inside_a_step_is_recorded_and_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recorder_log: pytest.LogCaptureFixture
) -> None:
    recordings = tmp_path / "recordings"
    serve_with_an_abort_inside_a_step(recordings, "B")
    assert not any("stopped recording" in line for line in recorder_lines(recorder_log))
    [path] = sorted(recordings.iterdir())
    trace = load_trace(path)
    [inside] = [e for e in trace.engine if e.aborted]
    assert inside.aborted == ("r1",)
    assert "r1" in dict(inside.expect["scheduled"])
    assert not [e for e in trace.engine if e.op == "abort"]
    assert cli.main(["replay", str(path), "--target", "model"]) == 0
    assert cli.main(["replay", str(path), "--target", "vllm", "--level", "strict"]) == 0
    # Written as an abort before the step instead, r1 is not scheduled in
    # it: the step's recorded expectations disagree.
    text = path.read_text()
    line = next(x for x in text.splitlines() if "abort: [r1]" in x)
    moved = "  - {op: abort, req: r1}\n" + line.replace("abort: [r1], ", "")
    drifted = tmp_path / "drifted.yaml"
    entries = len(trace.engine)
    drifted.write_text(
        text.replace(line, moved)
        .replace(f"name: {path.stem}", "name: drifted")
        .replace(f"end: {{entries: {entries}}}", f"end: {{entries: {entries + 1}}}")
    )
    capsys.readouterr()
    assert cli.main(["replay", str(drifted), "--target", "model"]) == 1
    out = capsys.readouterr().out
    assert "FAIL drifted" in out and "scheduled" in out


def test_entries_reach_the_file_as_they_are_made_and_a_cut_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mid-run, before any file is closed, the file on disk already holds
    every entry recorded (as a killed process leaves it): it replays with
    `--partial`, and the report line and the JUnit case say where it was cut."""
    recordings = tmp_path / "recordings"
    recorder.install(recordings)
    try:
        real = small_scheduler()
        real.add_request("A", list(range(1000, 1100)), 30, None)
        for _ in range(8):
            real.update({name: [5] for name in schedule_to_the_end(real)})
        recording = getattr(real.scheduler, recorder.ATTR)
        [path] = sorted(recordings.iterdir())
        # Copied as the kill leaves it: every entry so far, no end line.
        killed = tmp_path / "killed.yaml"
        killed.write_text(path.read_text().replace(f"name: {path.stem}", "name: killed"))
        real.close()
    finally:
        recorder.uninstall()
    entries = recording.entries
    assert entries == 9  # the arrival and eight steps
    assert cli.main(["replay", str(killed), "--target", "model"]) == 2
    [error] = capsys.readouterr().err.strip().splitlines()
    assert f"the recording was cut after {entries} entries" in error
    junit = tmp_path / "cut.xml"
    code = cli.main(
        ["replay", str(killed), "--target", "vllm", "--partial", "--junit-xml", str(junit)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"PASS killed ({entries} steps" in out
    assert f"recording cut at entry {entries}: end: missing" in out
    xml = junit.read_text()
    assert f'<property name="cut" value="entry {entries}: end: missing' in xml
    assert "<system-out>recording cut at entry" in xml


@pytest.mark.parametrize("partial", [False, True])
def test_a_recording_without_entries_is_one_clear_line(
    small_recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], partial: bool
) -> None:
    head = small_recording.read_text().split("engine:\n")[0] + "engine:\n"
    empty = tmp_path / "empty.yaml"
    empty.write_text(head)
    assert cli.main(["replay", str(empty), "--target", "model", *(["--partial"] * partial)]) == 2
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error == (
        f"kvgate: error: {empty}: engine: the recording holds no entries (the engine stopped "
        "before the recorder wrote its first call): nothing to replay"
    )


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


def test_the_served_numbers_on_the_record_and_replay_page_are_the_measured_ones() -> None:
    """The page's table of what a served engine recorded is rendered from the
    measurements `scripts/served-e2e.sh` wrote (`served_e2e.py docs`), not typed."""
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts" / "served_e2e.py"
    spec = importlib.util.spec_from_file_location("served_e2e", script)
    assert spec is not None and spec.loader is not None
    served = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served)
    import json

    measured = json.loads(served.MEASURED.read_text())
    part = served.PART.search(served.PAGE.read_text())
    assert part is not None, "the page has no generated served-e2e part"
    assert part.group(2) == served.served_table(measured)
    # What the test asserts of the served run holds in the numbers kept.
    assert measured["arrivals"] == measured["requests"]
    assert measured["aborted_inside_a_step"] > 0 and measured["files"] > 1
    assert measured["preempted"] > 0
    sharing = sum(shares for _, shares in measured["follow_ups"].values())
    assert measured["follow_ups_written_as_continuations"] == sharing


def test_an_engine_splitting_prefills_at_another_block_size_is_not_recorded() -> None:
    """vLLM's CPU platform can leave the cache config's block size, where the
    Scheduler splits align-mode prefills, apart from the Scheduler's own
    block size; a trace has one, so the recorder refuses such an engine by
    name rather than write a config its replay would split differently."""
    real = small_scheduler()
    try:
        recorder.engine_config(real.scheduler)  # the same sizes: expressible
        block = int(real.scheduler.block_size)
        real.scheduler.cache_config.block_size = block // 2
        with pytest.raises(recorder.NotExpressible, match=f"--block-size {block}"):
            recorder.engine_config(real.scheduler)
    finally:
        real.scheduler.cache_config.block_size = block
        real.close()


@pytest.mark.parametrize(
    ("step", "field", "message"),
    [
        ("{op: step, steps: 2, abort: [A]}", "abort", "applies to one engine step"),
        ("{op: step, abort: [Z]}", "abort[0]", "names no request that has arrived"),
        ("{op: step, abort: [A, A]}", "abort", "names a request twice"),
        ("{op: step, stop: [A], abort: [A]}", "abort[0]", "also stops in this step"),
        ("{op: step, abort: A}", "abort", "must be a list of requests"),
    ],
)
def test_a_steps_abort_is_refused_by_name_where_it_cannot_be(
    tmp_path: Path, step: str, field: str, message: str
) -> None:
    """The reader's refusals of a step's `abort`, each one line naming it;
    a request aborted inside a step has ended (a later abort of it is refused)."""
    from kvgate.conformance.trace import TraceError, parse_trace

    base = (bundled_scheduler_corpus() / "sched-abort-mid-prefill.yaml").read_text()
    head = base.split("engine:\n")[0] + "engine:\n"
    text = head + "  - {op: arrive, req: A, prompt: [{fresh: 300}], max_tokens: 2}\n"
    with pytest.raises(TraceError) as refused:
        parse_trace(text + f"  - {step}\n", tmp_path / "t.yaml")
    assert refused.value.field == field and message in refused.value.message
    aborted = parse_trace(text + "  - {op: step, abort: [A]}\n", tmp_path / "t.yaml")
    assert aborted.engine[-1].aborted == ("A",)
    with pytest.raises(TraceError, match="was aborted in step 1"):
        parse_trace(text + "  - {op: step, abort: [A]}\n  - {op: abort, req: A}\n")
    with pytest.raises(TraceError, match="under async scheduling"):
        parse_trace(
            text.replace("config:\n", "config:\n  async_scheduling: true\n")
            + "  - {op: step, abort: [A]}\n"
        )
