"""Replaying scheduler-level traces in tests: a bundled trace by name (its
text, or the trace read from it, edited or not), a replay on kvgate's
scheduler model alone or on vLLM's real `Scheduler` in lockstep with it
(with the recorder on, too), where a replay first failed, the error a bad
trace reads as, and vLLM's `Scheduler` wrapped to plant a drift."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgate.conformance.replay import Level, ReplayResult
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import Trace, TraceError, bundled_scheduler_corpus, parse_trace
from kvgate.model.scheduler import SchedulerModel
from kvgate.vocabulary.scheduling import SchedulerTarget

CORPUS_DIR = bundled_scheduler_corpus()
# Loaded into vLLM for the traces that need the hold or the retention.
PLUGIN = "kvgate.impl.hold_overlay"


def text_of(name: str) -> str:
    """The bundled scheduler-level trace `name`'s text."""
    return (CORPUS_DIR / f"{name}.yaml").read_text()


def trace_of(name: str, text: str | None = None) -> Trace:
    """The bundled trace `name`, or `text` (an edit of it) read in its place."""
    return parse_trace(text_of(name) if text is None else text, f"{name}.yaml")


def run_model(trace: Trace) -> ReplayResult:
    """`trace` on kvgate's scheduler model alone, at level strict."""
    return replay_scheduler(trace, SchedulerModel, None, "strict")


def run_vllm(
    trace: Trace, wrap: Callable[[Any], SchedulerTarget] | None = None, level: Level = "strict"
) -> ReplayResult:
    """`trace` on vLLM's `Scheduler` (`wrap`ped, to plant a drift) in
    lockstep with the model, at `level`."""
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert trace.scheduler is not None
    real = VllmScheduler(
        trace.config,
        spec_tokens=trace.scheduler.spec,
        max_num_seqs=trace.scheduler.max_num_seqs,
        plugin=PLUGIN if trace.config.hold or trace.config.retain_retired else None,
    )
    try:
        return replay_scheduler(trace, SchedulerModel, real if wrap is None else wrap(real), level)
    finally:
        real.close()


def first_failure(result: ReplayResult) -> tuple[int, str, str]:
    """Where `result` first failed: (step, level, what)."""
    divergence = result.divergence
    assert divergence is not None, "the replay passed"
    return divergence.step.index, divergence.level, divergence.what


def read_error(text: str) -> TraceError:
    """The error reading `text` (as `bad.yaml`) raises: one line, naming the file."""
    try:
        parse_trace(text, "bad.yaml")
    except TraceError as error:
        line = str(error)
        assert "\n" not in line and line.startswith("bad.yaml: "), line
        return error
    raise AssertionError("the trace was read")


def recorded(trace: Trace, out: Path) -> Path:
    """`trace` replayed on vLLM's Scheduler with kvgate's recorder writing to
    `out` (it must pass): the one recording."""
    from kvgate.impl import recorder

    recorder.install(out)
    try:
        assert run_vllm(trace).passed
    finally:
        recorder.uninstall()
    [path] = sorted(out.iterdir())
    return path


class Wrapped:
    """vLLM's `Scheduler` target with the calls a subclass overrides changed
    (a drift planted for a test); every other call goes to `real`."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)
