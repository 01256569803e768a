"""Replay a scheduler-level trace: engine steps on a whole scheduler.

`replay_scheduler` walks a trace's `engine` steps on kvgate's scheduler
model (built by `model_factory`, over the model manager) and, when given,
on a real scheduler (`SchedulerTarget`: vLLM's own `Scheduler` owning its
`KVCacheManager`) in strict lockstep:

- `arrive`: the request is added to both (the real one gets the token ids
  the model resolved the prompt's segments to, and its hash inputs; with a
  KV connector, what its external store holds is scripted on both first);
- `abort`: both finish it as aborted;
- `chunk`: a streaming-input session's next input chunk (or its end) sent
  to both, the real one as vLLM's engine sends it (the request id again);
- `reset`: both reset the prefix cache (`running`: preempting every
  running request first); whether it reset and the waiting queue after are
  checked against `expect`, then compared (api), then the views (strict);
- `step`: one engine step. The model schedules and runs it (each request
  that completes its prompt or decodes samples one token, drafts all
  rejected); the real scheduler runs one `schedule()`, then one `update()`
  with the tokens the model sampled (and the async KV loads the model's
  worker reports done in it). The target's observations (the real
  scheduler's, or the model's own on `--target model`) are checked against
  the step's `expect` (recorded, the replay goes on), then compared with the
  model's at level `api`: lookups, attention checks, preemptions, what was
  scheduled in order, admissions, copies, connector questions, which
  requests finished, each first output's prefill stats (cached tokens and
  the prefix-cache writes), the step's prefix-cache stats (when the real
  scheduler logs stats), the KV-cache events the step's update published
  (with `config.kv_events`) and the pool's usage; at level `strict` also
  the owned manager's state. The first difference ends the replay as a `Divergence`.

At level strict, when both sides can show a step's view (`StepView`), each
entry compares the blocks either side changed and the requests the model's
manager calls named, and the whole views are compared every
`whole_view_every` entries and after the last (as the manager-level
lockstep does, `kvgate.conformance.replay`); a difference only the whole
view finds names the window of entries it was caught in. Otherwise the
whole views are compared after every entry.

A request the real scheduler refuses, or a config it cannot build, is the
trace's `TraceError`; an exception inside the model is a `ModelBug`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, cast

from kvgate.conformance.collector import few_young_collections
from kvgate.conformance.replay import (
    HOLD_NOTE,
    RETIRE_NOTE,
    WHOLE_VIEW_EVERY,
    Diverged,
    Divergence,
    DivergenceLevel,
    Level,
    ModelBug,
    ReplayResult,
    one_line,
)
from kvgate.conformance.trace import Trace, TraceError
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.events import KvEvent, normalized
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.scheduling import (
    ASYNC_BATCHES,
    PREFIX_CACHE_STATS_KEYS,
    EngineOutcome,
    EngineStep,
    PrefillStats,
    RemoteHit,
    ScheduledStep,
    SchedulerModelRun,
    SchedulerTarget,
    step_differences,
)
from kvgate.vocabulary.snapshot import StepView
from kvgate.vocabulary.target import Capabilities, StepRefused, StepViewing, step_viewing
from kvgate.vocabulary.tokens import HashInputs

# Builds kvgate's scheduler model: (config, spec, max_num_seqs).
SchedulerModelFactory = Callable[[Config, int, int], SchedulerModelRun]

NOT_REPORTED = "not reported"


def model_config(trace: Trace, capabilities: Capabilities | None) -> tuple[Config, list[str]]:
    """The config the lockstep model runs: the hold (or the retired-state
    retention) off when the real scheduler lacks it, with the note saying so."""
    config, notes = trace.config, []
    if capabilities is not None and config.hold and not capabilities.hold:
        config = replace(config, hold=False)
        notes.append(HOLD_NOTE)
    if capabilities is not None and config.retain_retired and not capabilities.retain_retired:
        config = replace(config, retain_retired=False)
        notes.append(RETIRE_NOTE)
    return config, notes


def replay_scheduler(
    trace: Trace,
    model_factory: SchedulerModelFactory,
    real: SchedulerTarget | None,
    level: Level,
    observe: EngineObserver | None = None,
    whole_view_every: int = WHOLE_VIEW_EVERY,
) -> ReplayResult:
    """Replay scheduler-level `trace` (see the module's docstring); the caller
    owns `real`. Without `real` the model is the target, judged by the
    trace's expectations alone. `observe` is told what the target reported
    at each `step` and `reset` (every key such an entry may expect).
    `whole_view_every`: at level strict, the whole views are compared every
    that many entries and after the last (1: after every entry)."""
    if whole_view_every < 1:
        raise ValueError(f"whole_view_every must be at least 1, not {whole_view_every}")
    assert trace.scheduler is not None, "a scheduler-level trace"
    started = time.perf_counter()
    config, notes = model_config(trace, None if real is None else real.capabilities)
    if trace.cut:
        notes.append(f"a recording cut short, replayed up to the cut ({trace.cut})")
    try:
        model = model_factory(config, trace.scheduler.spec, trace.scheduler.max_num_seqs)
    except UnsupportedConfig as error:
        raise TraceError.unsupported(trace.path, error) from None
    # A replay writes no trace: the model's manager calls are run, not kept.
    writer = getattr(model, "writer", None)
    if writer is not None:
        writer.keep = False
    run = EngineLockstep(trace.name, trace.path, trace.config, model, real, level, whole_view_every)
    run.observe = observe
    failures = run.missed
    stream = trace.stream
    events = trace.engine if stream is None else stream.engine(run.forget)
    try:
        with few_young_collections():
            for event in events:
                run.engine_step(event)
            run.whole_views_agree()
    except Diverged as diverged:
        failures = [*run.missed, diverged.divergence]
    return ReplayResult(
        trace=trace,
        level=level,
        capabilities=model.capabilities if real is None else real.capabilities,
        steps_run=run.steps_run,
        seconds=time.perf_counter() - started,
        divergence=failures[0] if failures else None,
        notes=tuple(notes),
        also=tuple(failures[1:]),
        cached_tokens=run.cached_tokens,
    )


class SchedulerLockstep:
    """The same lockstep fed one engine step at a time, for exploration,
    which decides each step from the state the last one left: `apply`
    returns the first divergence (None while both agree). A refusal is the
    `TraceError`, an exception inside the model the `ModelBug`, as in a
    replay."""

    def __init__(
        self, trace: Trace, model: SchedulerModelRun, real: SchedulerTarget, level: Level
    ) -> None:
        # Exploration's runs are short and end anywhere: the whole views
        # after every step.
        self._run = EngineLockstep(
            trace.name, trace.path, trace.config, model, real, level, whole_view_every=1
        )

    def apply(self, event: EngineStep) -> Divergence | None:
        try:
            self._run.engine_step(event)
        except Diverged as diverged:
            return diverged.divergence
        return None


# Told an engine entry and what the target reported there, by expect key.
EngineObserver = Callable[[EngineStep, dict[str, Any]], None]


class _ModelStepViews(StepViewing, Protocol):
    """The scheduler model's side of step views: also the requests its
    manager calls named since it was last asked."""

    def take_touched_requests(self) -> set[str]: ...


class EngineLockstep:
    """The scheduler-level lockstep, the one every caller runs: a replay
    (`replay_scheduler`), exploration (`SchedulerLockstep`) and the
    workload on vLLM's real Scheduler. `engine_step` drives both sides with
    one trace entry; a caller that drives the model itself (the workload's
    sessions) hands the real side the same arrivals (`add_to_real`) and
    each engine step's modelled outcome (`judge_step`), and is compared on
    everything a replay compares. `observe` is told what the target
    reported at each `step` and `reset` (bless fills expectations from it).
    At level strict, a caller that drives it with step views (every
    `whole_view_every` entries the whole views) ends with
    `whole_views_agree`."""

    observe: EngineObserver | None = None

    def __init__(
        self,
        name: str,
        path: Path,
        config: Config,
        model: SchedulerModelRun,
        real: SchedulerTarget | None,
        level: Level,
        whole_view_every: int = WHOLE_VIEW_EVERY,
    ) -> None:
        self.name = name
        self.path = path
        self.config = config
        self.model = model
        self.real = real
        self.level = level
        self.whole_view_every = whole_view_every
        # Step views, when both sides show them (else the whole views every entry).
        self.step_views: tuple[_ModelStepViews, StepViewing] | None = None
        if level == "strict" and real is not None and whole_view_every > 1:
            ours, theirs = step_viewing(model), step_viewing(real)
            if ours is not None and theirs is not None and hasattr(ours, "take_touched_requests"):
                self.step_views = (cast(_ModelStepViews, ours), theirs)
        # The entries compared since the whole views last agreed: the first
        # one's and the last one's place and name, and how many.
        self.window_start: tuple[Step, str] | None = None
        self.window_steps = 0
        self.last_compared: tuple[Step, str] | None = None
        self.steps_run = 0
        self.engine_steps = 0
        self.missed: list[Divergence] = []
        # Each request's cached tokens as the target first reported them,
        # whatever step that was: what a missed expectation cost.
        self.cached_tokens: dict[str, int] = {}
        # Residency metrics' eviction events compared (`kv_cache_metrics`).
        self.evictions_compared = 0

    def forget(self, names: list[str]) -> None:
        """Both sides may drop these ended requests: no later entry names
        them (a trace read entry by entry says when)."""
        for side in (self.model, self.real):
            forget = getattr(side, "forget", None)
            if forget is not None:
                forget(names)

    def divergence(
        self,
        step: Step,
        level: DivergenceLevel,
        what: str,
        expected: object,
        actual: object,
        note: str = "",
    ) -> Divergence:
        return Divergence(self.name, self.path, step, level, what, expected, actual, note)

    def on_model(self, step: Step, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except StepRefused as refusal:
            raise TraceError(self.path, step.index, refusal.field, refusal.message) from None
        except Exception as error:
            raise ModelBug(self.path, step, error) from error

    def on_real(self, step: Step, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except (TraceError, Diverged):
            raise
        except Exception as error:
            raise Diverged(
                self.divergence(step, "api", f"{what} raised", "no exception", one_line(error))
            ) from error

    def engine_step(self, event: EngineStep) -> None:
        self.steps_run += 1
        step = Step(event.op, event.index, req=event.req)
        if event.op == "arrive":
            self.arrive(event, step)
        elif event.op == "abort":
            assert event.req is not None
            name = event.req
            self.on_model(step, lambda: self.model.abort(name))
            if self.real is not None:
                real = self.real
                self.on_real(step, "abort", lambda: real.abort(name))
        elif event.op == "reset":
            self.reset(event, step)
        elif event.op in ("pause", "resume"):
            mode = event.mode
            self.on_model(step, lambda: self.model.pause(mode))
            if self.real is not None:
                real = self.real
                self.on_real(step, event.op, lambda: real.pause(mode))
        elif event.op == "chunk":
            self.chunk(event, step)
        else:
            self.engine_steps += 1
            self.step(event, step)

    def reset(self, event: EngineStep, step: Step) -> None:
        running, connector = event.running, event.connector
        modelled = self.on_model(step, lambda: self.model.reset_prefix_cache(running, connector))
        observed = modelled
        if self.real is not None:
            real = self.real
            observed = self.on_real(
                step, "reset_prefix_cache()", lambda: real.reset_prefix_cache(running, connector)
            )
        got = {"ok": observed[0], "waiting": observed[1]}
        if self.observe is not None:
            self.observe(event, dict(got))
        for key, want in event.expect.items():
            if want != got[key]:
                self.missed.append(self.divergence(step, "expect", key, want, got[key]))
        if self.real is None:
            return
        pairs = (
            ("reset_prefix_cache() reset it", modelled[0], observed[0]),
            ("waiting queue after the reset", modelled[1], observed[1]),
        )
        for what, expected, actual in pairs:
            if expected != actual:
                raise Diverged(self.divergence(step, "api", what, expected, actual))
        self.strict(step, "after the reset")

    def arrive(self, event: EngineStep, step: Step) -> None:
        assert event.req is not None
        name = event.req
        self.on_model(step, lambda: self.model.arrive(event.arrival()))
        if self.real is None:
            return
        tokens, inputs = self.model.prompt_tokens(name)
        self.add_to_real(
            step,
            name,
            tokens,
            inputs,
            event.max_tokens,
            event.follows,
            event.remote,
            resumable=event.resumable,
            priority=event.priority,
            skip_prefix_cache=event.skip_prefix_cache,
        )

    def add_to_real(
        self,
        step: Step,
        name: str,
        tokens: list[int],
        inputs: HashInputs,
        max_tokens: int,
        follows: str | None,
        remote: RemoteHit | None,
        *,
        resumable: bool = False,
        priority: int = 0,
        skip_prefix_cache: bool = False,
    ) -> None:
        """An arrival the model took, added to the real scheduler with the
        token ids the model resolved (a refusal is the trace's `TraceError`)."""
        real = self.real
        assert real is not None
        try:
            if remote is not None:
                real.script_external(name, remote.tokens, remote.load_async, remote.undecided)
            real.add_request(
                name,
                tokens,
                max_tokens,
                follows,
                inputs,
                resumable=resumable,
                priority=priority,
                skip_prefix_cache=skip_prefix_cache,
            )
        except StepRefused as refusal:
            raise TraceError(
                self.path,
                step.index,
                refusal.field,
                f"vLLM's Scheduler refuses it: {refusal.message}",
            ) from None
        except UnsupportedConfig as error:  # hash inputs the target does not model
            raise TraceError(
                self.path, step.index, error.field, f"vLLM's Scheduler refuses it: {error.message}"
            ) from None
        except Exception as error:
            raise Diverged(
                self.divergence(step, "api", "add_request raised", "no exception", one_line(error))
            ) from error

    def chunk(self, event: EngineStep, step: Step) -> None:
        """A session's next input chunk (or its end) sent to both: the real
        scheduler gets the token ids the model resolved the chunk to."""
        assert event.req is not None
        name = event.req
        if event.end:
            self.on_model(step, lambda: self.model.end_session(name))
        else:
            tokens = self.on_model(
                step, lambda: self.model.chunk(name, event.prompt, event.max_tokens)
            )
        real = self.real
        if real is None:
            return
        if event.end:
            self.on_real(step, "add_request (the session's end)", lambda: real.end_session(name))
        else:
            self.on_real(
                step,
                "add_request (the next input chunk)",
                lambda: real.add_chunk(name, tokens, event.max_tokens),
            )
        self.strict(step, "after the chunk")

    def step(self, event: EngineStep, step: Step) -> None:
        for name in event.stop:
            self.on_model(step, functools.partial(self.model.stop, name))
        for name, drafts in event.accept.items():
            self.on_model(step, functools.partial(self.model.accept, name, drafts))
        aborted = event.aborted
        modelled: EngineOutcome = self.on_model(step, lambda: self.model.step(aborted))
        self.judge_step(event, step, modelled)

    def judge_step(self, event: EngineStep, step: Step, modelled: EngineOutcome) -> ScheduledStep:
        """The engine step the model took (`modelled`) run on the real
        scheduler, checked against the entry's expectations and compared
        with the model's; what the target showed of it."""
        where = f"engine step {self.engine_steps}"
        observed: ScheduledStep
        if self.real is None:
            observed, finished, stats = modelled, modelled.finished, modelled.prefill_stats
        else:
            real = self.real
            observed, finished = self.real_step(event, step, real, modelled)
            stats = real.take_prefill_stats()
        # Drained every step, as the Scheduler's update drains them.
        modelled_cache_stats = self.model.take_prefix_cache_stats()
        observed_cache_stats = None if self.real is None else self.real.take_prefix_cache_stats()
        # The KV-cache events the step's update published (each run of
        # removals sorted: vLLM leaves their order within a block to a set).
        modelled_events = normalized(self.model.take_kv_events())
        observed_events = (
            modelled_events if self.real is None else normalized(self.real.take_kv_events())
        )
        for request, reported in stats.items():
            self.cached_tokens.setdefault(request, reported[0])
        self.expectations(event, step, observed, finished, stats, observed_events)
        if self.real is None:
            return observed
        pairs: list[tuple[str, object, object]] = [
            *step_differences(modelled, observed),
            ("finished", modelled.finished, finished),
            (
                "prefill stats at a first output (request: [cached tokens, prefix-cache writes])",
                modelled.prefill_stats,
                stats,
            ),
        ]
        if self.config.async_scheduling:
            pairs += [
                (
                    "batches in flight",
                    self.model.batches_in_flight(),
                    self.real.batches_in_flight(),
                ),
                (
                    "deferred frees (fence, request)",
                    self.model.deferred_frees(),
                    self.real.deferred_frees(),
                ),
            ]
        if self.config.kv_events:
            pairs.append(
                (
                    "KV-cache events published",
                    [e.exact() for e in modelled_events],
                    [e.exact() for e in observed_events],
                )
            )
        # What vLLM's engine reads for its load stats, logged or not.
        pairs.append(("KV-cache usage", self.model.kv_cache_usage(), self.real.kv_cache_usage()))
        if self.config.disable_log_stats:
            # Stats logging off: the update makes no stats to compare.
            pairs.append(("stats made with stats logging off", None, observed_cache_stats))
        elif observed_cache_stats is not None:
            pairs.append(
                (
                    "prefix-cache stats",
                    {k: modelled_cache_stats.get(k) for k in PREFIX_CACHE_STATS_KEYS},
                    observed_cache_stats,
                )
            )
        if self.config.kv_cache_metrics:
            evictions = self.real.take_evictions()
            self.evictions_compared += len(evictions)
            pairs.append(
                (
                    "residency eviction events (reuse gaps each)",
                    self.model.take_evictions(),
                    evictions,
                )
            )
        for what, expected, actual in pairs:
            if expected != actual:
                raise Diverged(self.divergence(step, "api", f"{where}: {what}", expected, actual))
        if self.config.async_scheduling and self.level == "strict":
            modelled_counts = self.model.output_accounting()
            observed_counts = self.real.output_accounting()
            if modelled_counts != observed_counts:
                raise Diverged(
                    self.divergence(
                        step,
                        "strict",
                        f"{where}: output accounting (request: [placeholders, tokens in flight, "
                        "stale tokens in flight])",
                        modelled_counts,
                        observed_counts,
                    )
                )
        self.strict(step, where)
        return observed

    def real_step(
        self, event: EngineStep, step: Step, real: SchedulerTarget, modelled: EngineOutcome
    ) -> tuple[ScheduledStep, list[str]]:
        """One engine step on the real scheduler, as vLLM's engine core runs
        it: `schedule()` then `update()` with the model's output for it; under
        async scheduling, a batch scheduled while the engine has requests,
        and the oldest batch's output processed (with the tokens the model
        sampled in that batch) only once `ASYNC_BATCHES` are in flight or
        nothing more was scheduled. (What it scheduled, what finished.)"""
        where = f"engine step {self.engine_steps}"
        observed = ScheduledStep()
        if not self.config.async_scheduling:
            observed = self.on_real(step, f"{where}: schedule()", real.schedule)
        elif real.has_requests():
            observed = self.on_real(step, f"{where}: schedule()", real.schedule)
            executed = bool(observed.scheduled)
            if real.batches_in_flight() < ASYNC_BATCHES and (executed or real.has_requests()):
                return observed, []
        elif not real.batches_in_flight():
            return observed, []
        for name in event.stop:
            real.stop(name)
        for name in event.aborted:
            # A client gone while the step ran: aborted before its output.
            self.on_real(step, "abort", functools.partial(real.abort, name))
        finished: list[str] = self.on_real(
            step,
            f"{where}: update_from_output()",
            lambda: real.update(modelled.sampled, loaded=modelled.loaded, failed=modelled.failed),
        )
        return observed, finished

    def strict(self, step: Step, where: str) -> None:
        """At level strict, the owned manager's view against the model's:
        what the entry touched, and the whole views when due (or the whole
        views, without step views)."""
        if self.level != "strict" or self.real is None:
            return
        if self.step_views is None:
            self.compare_whole(step, where)
            return
        model, real = self.step_views
        if self.window_start is None:
            self.window_start = (step, where)
        self.window_steps += 1
        self.last_compared = (step, where)
        blocks: set[int] = self.on_model(step, model.take_changed_blocks)
        # Reading vLLM's view can itself fail on what the build did (two
        # prefixes sharing one block hash): a divergence at that step.
        blocks |= self.on_real(step, f"{where}: the manager's state", real.take_changed_blocks)
        requests = self.on_model(step, model.take_touched_requests)
        ours: StepView = self.on_model(step, lambda: model.step_view(blocks, requests))
        theirs: StepView = self.on_real(
            step, f"{where}: the manager's state", lambda: real.step_view(blocks, requests)
        )
        for what, expected, actual in ours.differences(theirs):
            raise Diverged(self.divergence(step, "strict", f"{where}: {what}", expected, actual))
        if self.window_steps >= self.whole_view_every:
            self.whole_views_agree()

    def whole_views_agree(self) -> None:
        """With step views, the whole views compared (after the last entry,
        or when due); a difference names the window of entries since they
        last agreed."""
        last, start = self.last_compared, self.window_start
        if self.step_views is None or last is None or start is None:
            return
        step, where = last
        first, first_where = start
        window = (
            f"found by the whole-view comparison after {self.window_steps} engine entries, "
            f"from {first_where} at {first.where()} to {where} at {step.where()} "
            "(the views agreed before them)"
        )
        self.window_start, self.window_steps = None, 0
        self.compare_whole(step, where, window)

    def compare_whole(self, step: Step, where: str, note: str = "") -> None:
        """The owned manager's whole view against the model's."""
        real = self.real
        assert real is not None
        observed = self.on_real(step, f"{where}: the manager's state", real.snapshot)
        modelled = self.on_model(step, self.model.snapshot)
        for what, expected, actual in modelled.differences(observed):
            raise Diverged(
                self.divergence(step, "strict", f"{where}: {what}", expected, actual, note)
            )

    def expectations(
        self,
        event: EngineStep,
        step: Step,
        scheduled: ScheduledStep,
        finished: list[str],
        stats: dict[str, PrefillStats],
        events: list[KvEvent],
    ) -> None:
        observed: dict[str, object] = {
            "scheduled": scheduled.scheduled,
            "preempted": sorted(scheduled.preempted),
            "finished": finished,
            "events": [e.line() for e in events],
        }
        if self.observe is not None:
            reported = {r: s[0] for r, s in stats.items()}
            self.observe(
                event,
                {**observed, "cached_tokens": reported, "encoded": dict(scheduled.encoder_inputs)},
            )
        for key, want in event.expect.items():
            if key == "cached_tokens":
                got: object = {r: stats[r][0] if r in stats else NOT_REPORTED for r in want}
            elif key == "encoded":
                got = {r: scheduled.encoder_inputs.get(r, []) for r in want}
            elif key == "preempted":
                want = sorted(want)
                got = observed[key]
            else:
                got = observed[key]
            if want != got:
                self.missed.append(self.divergence(step, "expect", key, want, got))
