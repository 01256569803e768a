"""A trace read entry by entry (`kvgate replay --stream`): validated whole
before anything runs, replayed as the whole-file reader's trace is, and each
ended request dropped once no later step names it."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest
from configs import needs_vllm

from kvgate import cli
from kvgate.conformance.replay import replay
from kvgate.conformance.stream import stream_trace
from kvgate.conformance.trace import TraceError, bundled_corpus, load_trace
from kvgate.model import ModelTarget
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.target import Target, WatchedTarget

TRACE = bundled_corpus() / "shared-prefix-concurrent.yaml"


def _two_days(tmp_path: Path) -> Path:
    """The trace's steps twice, the second time under other request names."""
    text = TRACE.read_text()
    head, marker, body = text.partition("\nsteps:\n")
    second = body.replace("req: A", "req: C").replace("req: B", "req: D")
    second = second.replace("prompt_of: A", "prompt_of: C")
    path = tmp_path / "two-days.yaml"
    path.write_text(head + marker + body + second)
    return path


def test_a_streamed_trace_replays_as_the_whole_one(tmp_path: Path) -> None:
    path = _two_days(tmp_path)
    whole, streamed = load_trace(path), stream_trace(path)
    assert streamed.stream is not None and streamed.primitives == ()
    assert (streamed.name, streamed.config) == (whole.name, whole.config)
    results = []
    for trace in (whole, streamed):
        with closing(ModelTarget(trace.config)) as target:
            results.append(replay(trace, target, ModelTarget, "strict"))
    assert results[0].passed and results[1].passed
    assert results[0].steps_run == results[1].steps_run


def test_ended_requests_are_dropped_once_no_step_names_them(tmp_path: Path) -> None:
    trace = stream_trace(_two_days(tmp_path))
    held: list[set[str]] = []

    def after(step: Step, target: Target) -> None:
        assert isinstance(target, ModelTarget)
        held.append(set(target.requests))

    with closing(WatchedTarget(ModelTarget(trace.config), after)) as target:
        assert replay(trace, target, None, "api").passed
    # The first day's requests are held while it runs, gone once the second
    # day starts (its requests are held in turn).
    second = next(i for i, names in enumerate(held) if "C" in names)
    assert any({"A", "B"} <= names for names in held[:second])
    assert not {"A", "B"} & set().union(*held[second:])
    assert any({"C", "D"} <= names for names in held[second:])


def test_a_bad_step_is_refused_before_anything_runs(tmp_path: Path) -> None:
    path = _two_days(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    lines[-2] = "  - {op: free, req: nobody, how: finish}\n"
    path.write_text("".join(lines))
    with pytest.raises(TraceError) as whole:
        load_trace(path)
    with pytest.raises(TraceError) as streamed:
        stream_trace(path)
    assert str(streamed.value) == str(whole.value)


def test_a_trace_in_another_form_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "commented.yaml"
    path.write_text(TRACE.read_text().replace("\nsteps:\n", "\nsteps:\n  # the steps\n"))
    trace = stream_trace(path)
    assert trace.stream is None and trace.primitives == load_trace(path).primitives


def test_the_file_limit_still_applies(tmp_path: Path) -> None:
    from dataclasses import replace

    from kvgate.conformance.limits import DEFAULT_LIMITS

    with pytest.raises(TraceError, match="file_bytes"):
        stream_trace(_two_days(tmp_path), replace(DEFAULT_LIMITS, file_bytes=100))


@needs_vllm
def test_replay_streams_on_vllm_at_strict_level(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _two_days(tmp_path)
    argv = ["replay", "--stream", "--target", "vllm", "--require", "none", str(path)]
    assert cli.main(argv) == 0, capsys.readouterr().out
