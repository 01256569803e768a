"""A scheduler-level trace read entry by entry (`kvgate replay --stream`):
validated whole before anything runs, replayed as the whole-file reader's
trace is, and each ended request dropped on both sides once no later entry
names it (and no live request still needs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm

from kvgate import cli
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.stream import stream_trace
from kvgate.conformance.trace import TraceError, load_trace
from kvgate.model.scheduler import SchedulerModel
from kvgate.workload.deployment import Deployment
from kvgate.workload.engine_trace import write_engine_trace
from kvgate.workload.plan import Workload
from kvgate.workload.runner import Arm

# The production workload, small: every token count divided by 64.
SCALE = 64


@pytest.fixture(scope="module")
def two_days(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workload's scheduler-level trace, its day played twice."""
    deployment = Deployment(build="upstream").scaled(SCALE)
    out = tmp_path_factory.mktemp("w")
    return write_engine_trace(Workload(sessions=3, turns=3), deployment, Arm(64, False), out, 2)


def test_the_days_arrive_under_their_own_names(two_days: Path) -> None:
    trace = load_trace(two_days)
    names = [e.req for e in trace.engine if e.op == "arrive"]
    assert len(names) == 2 * 3 * 3 and len(set(names)) == len(names)
    assert sum(str(n).startswith("d1-") for n in names) == 3 * 3


def test_a_streamed_trace_replays_as_the_whole_one(two_days: Path) -> None:
    whole, streamed = load_trace(two_days), stream_trace(two_days)
    assert streamed.stream is not None and streamed.engine == ()
    assert (streamed.name, streamed.config, streamed.scheduler) == (
        whole.name,
        whole.config,
        whole.scheduler,
    )
    results = [replay_scheduler(t, SchedulerModel, None, "strict") for t in (whole, streamed)]
    assert results[0].passed and results[1].passed, results[1].divergence
    assert results[0].steps_run == results[1].steps_run == len(whole.engine)
    assert results[0].cached_tokens == results[1].cached_tokens


def test_ended_requests_are_dropped_once_no_entry_names_them(two_days: Path) -> None:
    trace = stream_trace(two_days)
    held: list[set[str]] = []

    class Watched(SchedulerModel):
        def step(self, aborted: tuple[str, ...] = ()) -> Any:
            outcome = super().step(aborted)
            held.append(set(self.oracle.requests))
            return outcome

    assert replay_scheduler(trace, Watched, None, "strict").passed
    first_day = {f"s{s:02d}t{t:02d}" for s in range(3) for t in range(3)}
    second = next(i for i, names in enumerate(held) if any(n.startswith("d1-") for n in names))
    assert any(len(first_day & names) >= 3 for names in held[:second])
    # Once the second day runs, the first day's requests are gone.
    assert not first_day & set().union(*held[second + 1 :])
    assert len(held[-1]) <= 3


def test_a_bad_entry_is_refused_before_anything_runs(two_days: Path, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    lines = two_days.read_text().splitlines(keepends=True)
    lines[-1] = "  - {op: abort, req: nobody}\n"
    path.write_text("".join(lines))
    with pytest.raises(TraceError) as whole:
        load_trace(path)
    with pytest.raises(TraceError) as streamed:
        stream_trace(path)
    assert str(streamed.value) == str(whole.value)
    assert "nobody" in str(streamed.value)


@needs_vllm
def test_replay_streams_on_vllm_at_strict_level(
    two_days: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--stream", "--target", "vllm", "--require", "none", str(two_days)]
    assert cli.main(argv) == 0, capsys.readouterr().out
