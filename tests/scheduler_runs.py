"""Replaying scheduler-level traces in tests: a bundled trace by name (its
text, or the trace read from it, edited or not), a replay on kvgate's
scheduler model alone or on vLLM's real `Scheduler` in lockstep with it
(with the recorder on, too), where a replay first failed, the error a bad
trace reads as, and vLLM's `Scheduler` wrapped to plant a drift (among them, faults in
the AsyncScheduler's output accounting)."""

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


class NoPlaceholderForAPrompt(Wrapped):
    """vLLM's AsyncScheduler counting no output placeholder for the batch
    that completes a prompt (as if its sampled token were already in)."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        scheduler = real.scheduler
        after = scheduler._update_after_schedule

        def drifted(output: Any) -> None:
            completing = {
                r
                for r, n in output.num_scheduled_tokens.items()
                if scheduler.requests[r].num_output_placeholders == 0
            }
            after(output)
            for r in completing:
                request = scheduler.requests[r]
                if request.num_output_placeholders:
                    request.num_output_placeholders -= 1

        scheduler._update_after_schedule = drifted


class RejectedDraftsKept(Wrapped):
    """vLLM's AsyncScheduler that does not take rejected drafts back from a
    request's output placeholders (`placeholders`) or its computed tokens
    (`computed`) when a batch's output is processed."""

    def __init__(self, real: Any, counter: str) -> None:
        super().__init__(real)
        scheduler = real.scheduler
        update = scheduler.update_from_output

        def drifted(output: Any, runner: Any) -> Any:
            rejected = {
                r: len(drafts) - (len(runner.sampled_token_ids[runner.req_id_to_index[r]]) - 1)
                for r, drafts in output.scheduled_spec_decode_tokens.items()
                if r in scheduler.requests and drafts
            }
            result = update(output, runner)
            for r, n in rejected.items():
                request = scheduler.requests.get(r)
                if request is None or request.is_finished() or n <= 0:
                    continue
                if counter == "placeholders":
                    request.num_output_placeholders += n
                else:
                    request.num_computed_tokens += n
            return result

        scheduler.update_from_output = drifted
