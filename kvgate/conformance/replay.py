"""Replay a trace on a target, in lockstep with the model, up to the first divergence.

Each primitive step runs on the model first, then on the target. The target's
observation is compared with the step's `expect` values (level `expect`),
then with the model's observation (level `api`), then, at `strict`, the two
snapshots. A mismatch with the model ends the replay as a `Divergence`. A
mismatch with the trace's own values does not desynchronise anything, so the
replay records it and goes on: a report then shows the first failure and
every later expectation the target missed (the seed's total miss at the
next turn's lookup, say, after an earlier structural check).

A target that raises while it runs a step has diverged at that step: the
replay reports the exception's one-line summary instead of crashing. A step
the target refuses (`StepRefused`) is the trace's fault, a `TraceError`,
unless the model ran the very same step: then the target diverged. The
model raising is neither: it is kvgate's own bug, a `ModelBug`, and never
blamed on the target (the model is the lockstep side, or the target itself
under `--target model`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from kvgate.conformance.collector import few_young_collections
from kvgate.conformance.compare import (
    NOT_REPORTED,
    PROMPT_DONE,
    same,
    same_check,
    snapshot_difference,
    step_difference,
    step_view_difference,
)
from kvgate.conformance.macros import prefill_steps
from kvgate.conformance.trace import Trace, TraceError
from kvgate.errors import EXIT_KVGATE_BUG, KvgateError
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.target import Capabilities, StepRefused, StepViewing, Target, step_viewing

Level = Literal["api", "strict"]
LEVELS: tuple[Level, ...] = ("api", "strict")
# At level strict, how many primitive steps apart the whole views are
# compared (and always after the last step); in between, each step compares
# the view of what it touched, when both sides can show one (`StepView`).
WHOLE_VIEW_EVERY = 1000
# Where a divergence was seen: against the trace's own values, or the model's.
DivergenceLevel = Literal["expect", "api", "strict"]

TargetFactory = Callable[[Config], Target]
# Told each primitive step's observation and each `check` step's values, as
# the target reported them (`kvgate bless` writes them into the trace).
Observer = Callable[[Step, Mapping[str, Any]], None]

HOLD_NOTE = (
    "target lacks the hold: lockstep model runs with the hold off; "
    "the trace's expectations still apply"
)
RETIRE_NOTE = (
    "target does not retain retired states: lockstep model runs without; "
    "the trace's expectations still apply"
)


@dataclass(frozen=True)
class Divergence:
    """The first place a target stopped conforming.

    `expected` comes from the trace at level `expect` and from the model at
    levels `api` and `strict`; `actual` always comes from the target.
    """

    trace: str
    path: Path
    step: Step
    level: DivergenceLevel
    what: str
    expected: object
    actual: object
    note: str = ""


@dataclass(frozen=True)
class ReplayResult:
    trace: Trace
    level: Level
    capabilities: Capabilities
    steps_run: int  # primitive and check steps run, the diverging one included
    seconds: float
    divergence: Divergence | None
    notes: tuple[str, ...] = ()
    # Later failures (expectations missed after the first failure, or the
    # lockstep divergence that ended a replay that had already missed one).
    also: tuple[Divergence, ...] = ()
    # The divergence that ended the replay early (None: every step ran).
    stopped: Divergence | None = None
    # A Scheduler-level replay: each request's cached tokens as the target
    # first reported them, at whichever step it did.
    cached_tokens: Mapping[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.divergence is None

    @property
    def failures(self) -> tuple[Divergence, ...]:
        """The first failure, then every later one (empty when it passed)."""
        return (self.divergence, *self.also) if self.divergence is not None else ()


def replay(
    trace: Trace,
    target: Target,
    model: TargetFactory | None,
    level: Level,
    *,
    target_is_model: bool = False,
    observe: Observer | None = None,
    whole_view_every: int = WHOLE_VIEW_EVERY,
) -> ReplayResult:
    """Replay `trace` on `target`, with a lockstep model built by `model` if given.

    The caller owns `target` (builds and closes it); the model is built here,
    because what it is built from depends on the target: a target without the
    hold gets a lockstep model with the hold off, so the two stay comparable,
    while the trace's own expectations still judge the target.

    Raises `TraceError` when the trace asks for something it may not (a
    refused step, a `check` key the target cannot observe) or the model
    refuses its config, and `ModelBug` when the model raises (with
    `target_is_model`, the target is the model: its exceptions are that too).
    `observe`, if given, is told what the target reported at every step.
    `whole_view_every`: at level strict, the whole views are compared every
    that many primitive steps and after the last (1: every step); the steps
    in between compare what they touched. A difference the whole view finds
    is named at the step it was found, its note naming the window of steps
    since the views last agreed.
    """
    if whole_view_every < 1:
        raise ValueError(f"whole_view_every must be at least 1, not {whole_view_every}")
    if trace.read_again is not None:
        # Its steps are still in its file: replaying none would pass it.
        raise ValueError(f"{trace.path}: read the trace whole first (corpora.whole)")
    if trace.scheduler_level:
        # Its engine steps are no manager calls: replaying none would pass it.
        raise TraceError(
            trace.path,
            None,
            "engine",
            "a scheduler-level trace replays on a whole scheduler (kvgate gate, kvgate replay), "
            "not on a manager target",
        )
    started = time.perf_counter()
    notes: list[str] = []
    lockstep: Target | None = None
    if model is not None:
        config = trace.config
        if config.hold and not target.capabilities.hold:
            config = replace(config, hold=False)
            notes.append(HOLD_NOTE)
        if config.retain_retired and not target.capabilities.retain_retired:
            config = replace(config, retain_retired=False)
            notes.append(RETIRE_NOTE)
        try:
            lockstep = model(config)
        except UnsupportedConfig as error:
            raise TraceError.unsupported(trace.path, error) from None
    run = _Lockstep(trace, target, lockstep, level, target_is_model, observe, whole_view_every)
    failures: list[Divergence] = run.missed
    stopped: Divergence | None = None
    try:
        with few_young_collections():
            run.all_steps()
            run.whole_views_agree()
    except Diverged as diverged:
        stopped = diverged.divergence
        failures = [*run.missed, stopped]
    finally:
        if lockstep is not None:
            lockstep.close()
    return ReplayResult(
        trace=trace,
        level=level,
        capabilities=target.capabilities,
        steps_run=run.steps_run,
        seconds=time.perf_counter() - started,
        divergence=failures[0] if failures else None,
        notes=tuple(notes),
        also=tuple(failures[1:]),
        stopped=stopped,
    )


class ModelBug(KvgateError):
    """The model raised while replaying a step: a bug in kvgate, not in the
    target and not in the trace (which was validated before it ran)."""

    exit_code = EXIT_KVGATE_BUG

    def __init__(self, path: Path, step: Step, error: BaseException) -> None:
        self.path = path
        self.step = step
        super().__init__(
            f"{path}: {step.where()}: the kvgate model raised {one_line(error)}; "
            "this is a bug in kvgate, not in the target: please report it with this trace"
        )


@dataclass(frozen=True)
class TraceRunError:
    """A trace that got no verdict on the target: refused while it ran (the
    trace's fault, or a config the target cannot run), or stopped by a bug in
    kvgate's model. `message` is one line naming the file, step and field.
    `config_refused`: the target would not build the trace's config at all
    (the trace is not applicable to it)."""

    trace: Trace
    message: str
    bug: bool
    seconds: float = 0.0
    config_refused: bool = False

    @property
    def passed(self) -> bool:
        return False


# What one trace's run comes to: a verdict, or an error instead of one.
Outcome = ReplayResult | TraceRunError


class Diverged(Exception):
    """Unwinds a replay from wherever the first divergence is found."""

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence.what)
        self.divergence = divergence


T = TypeVar("T")


class _Lockstep:
    def __init__(
        self,
        trace: Trace,
        target: Target,
        model: Target | None,
        level: Level,
        target_is_model: bool = False,
        observe: Observer | None = None,
        whole_view_every: int = WHOLE_VIEW_EVERY,
    ) -> None:
        self.trace = trace
        self.observe = observe
        self.target_is_model = target_is_model
        self.target = target
        self.model = model
        self.level = level
        self.steps_run = 0
        self.missed: list[Divergence] = []  # expectations missed so far
        self.whole_view_every = whole_view_every
        # Step views, when both sides show them (else the whole view every step).
        self.step_views: tuple[StepViewing, StepViewing] | None = None
        if level == "strict" and model is not None and whole_view_every > 1:
            ours, theirs = step_viewing(model), step_viewing(target)
            if ours is not None and theirs is not None:
                self.step_views = (ours, theirs)
        # The primitive steps since the whole views last agreed: the first
        # one's place and how many.
        self.window_start: Step | None = None
        self.window_steps = 0
        self.last_step: Step | None = None

    def miss(self, step: Step, what: str, expected: object, actual: object) -> None:
        self.missed.append(
            Divergence(self.trace.name, self.trace.path, step, "expect", what, expected, actual)
        )

    def all_steps(self) -> None:
        stream = self.trace.stream
        steps = self.trace.primitives if stream is None else stream.primitives(self.forget)
        for step in steps:
            if step.op == "prefill":
                self.prefill(step)
            elif step.op == "check":
                self.check(step)
            else:
                self.primitive(step)

    def forget(self, names: list[str]) -> None:
        """Both sides may drop these ended requests: no later step names them."""
        for side in (self.model, self.target):
            forget = getattr(side, "forget", None)
            if forget is not None:
                forget(names)

    def diverged(
        self,
        step: Step,
        level: DivergenceLevel,
        what: str,
        expected: object,
        actual: object,
        note: str = "",
    ) -> Diverged:
        return Diverged(
            Divergence(self.trace.name, self.trace.path, step, level, what, expected, actual, note)
        )

    # -- one primitive -----------------------------------------------------

    def primitive(self, step: Step) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Run one primitive op on both sides and compare; both observations."""
        self.steps_run += 1
        modeled = None if self.model is None else self.apply(self.model, "model", step)
        observed = self.apply(self.target, "target", step)
        if self.observe is not None:
            self.observe(step, observed)
        for key, want in step.expect.items():
            got = observed.get(key, NOT_REPORTED)
            if not same(want, got):
                self.miss(step, key, want, got)
        if modeled is not None:
            model = self.model
            assert model is not None
            views = (
                (
                    lambda: self.guarded(step, "model", model.snapshot),
                    lambda: self.guarded(step, "target", self.target.snapshot),
                )
                if self.level == "strict" and self.step_views is None
                else None
            )
            found = step_difference(step.op, modeled, observed, views)
            if found is not None:
                level, difference = found
                raise self.diverged(step, level, *difference)
            if self.step_views is not None:
                self.compare_step_views(step)
        return observed, modeled

    # -- strict views a step at a time ------------------------------------------

    def compare_step_views(self, step: Step) -> None:
        """What `step` touched, on both sides; the whole views when due."""
        assert self.step_views is not None
        model, target = self.step_views
        if self.window_start is None:
            self.window_start = step
        self.window_steps += 1
        self.last_step = step
        blocks = self.guarded(step, "model", model.take_changed_blocks)
        blocks |= self.guarded(step, "target", target.take_changed_blocks)
        requests = () if step.req is None else (step.req,)
        ours = self.guarded(step, "model", lambda: model.step_view(blocks, requests))
        theirs = self.guarded(step, "target", lambda: target.step_view(blocks, requests))
        difference = step_view_difference(ours, theirs)
        if difference is not None:
            raise self.diverged(step, "strict", *difference)
        if self.window_steps >= self.whole_view_every:
            self.whole_views_agree()

    def whole_views_agree(self) -> None:
        """Compare the whole views (after the last step, or when due)."""
        step, start = self.last_step, self.window_start
        if self.step_views is None or step is None or start is None:
            return
        model = self.model
        assert model is not None
        difference = snapshot_difference(
            self.guarded(step, "model", model.snapshot),
            self.guarded(step, "target", self.target.snapshot),
        )
        window = (
            f"found by the whole-view comparison after {self.window_steps} steps, "
            f"from {start.where()} to {step.where()} (the views agreed before them)"
        )
        self.window_start, self.window_steps = None, 0
        if difference is not None:
            raise self.diverged(step, "strict", *difference, window)

    def apply(self, side: Target, who: str, step: Step) -> dict[str, Any]:
        try:
            return side.apply(step)
        except StepRefused as refused:
            if who == "target" and self.model is not None:
                # The model ran this step, so the trace was fine: the target diverged.
                raise self.diverged(
                    step,
                    "api",
                    "refused",
                    "the step runs (the model ran it)",
                    f"{refused.field}: {refused.message}",
                    "the target refused the step",
                ) from None
            at = f" (at {step.where()})" if step.origin else ""
            raise TraceError(
                self.trace.path, step.index, refused.field, refused.message + at
            ) from None
        except Exception as error:
            raise self.raised(step, who, error) from None

    def guarded(self, step: Step, who: str, call: Callable[[], T]) -> T:
        """A read of a side's state: an exception there is a divergence too."""
        try:
            return call()
        except Exception as error:
            raise self.raised(step, who, error) from None

    def raised(self, step: Step, who: str, error: Exception) -> Exception:
        if who == "model" or self.target_is_model:
            return ModelBug(self.trace.path, step, error)
        return self.diverged(
            step, "api", "exception", "no exception", one_line(error), f"raised by the {who}"
        )

    # -- macros and checks --------------------------------------------------

    def prefill(self, macro: Step) -> None:
        """`prefill`: lookup, then allocate/step/drain until the target says done.

        Every allocate advances by at least one token, so a prompt that fits
        in max_model_len is done within that many rounds; going past it, or
        an allocate that fails or moves nothing, means the prefill is stuck.
        """
        steps = prefill_steps(macro)
        self.primitive(next(steps))  # the lookup
        for round_no, allocate in enumerate(steps, start=1):
            observed, modeled = self.primitive(allocate)
            if observed.get("ok") is not True:
                raise self.stalled(allocate, observed)
            done = observed.get(PROMPT_DONE, NOT_REPORTED)
            if not isinstance(done, bool):
                raise self.diverged(
                    allocate, "api", PROMPT_DONE, "true or false", done, "allocate must report it"
                )
            if modeled is not None and modeled.get(PROMPT_DONE) != done:
                raise self.diverged(
                    allocate,
                    "api",
                    PROMPT_DONE,
                    modeled.get(PROMPT_DONE, NOT_REPORTED),
                    done,
                    "the model and the target disagree on whether the prompt is computed",
                )
            # An async KV load's allocation computes nothing (`loading`); the
            # next round completes the load.
            idle = observed.get("tokens") == 0 and observed.get("loading") is not True
            if not done and (idle or round_no >= self.trace.config.max_model_len):
                raise self.stalled(allocate, observed)
            self.primitive(steps.send(done))  # step
            self.primitive(next(steps))  # drain

    def stalled(self, allocate: Step, observed: Mapping[str, Any]) -> Diverged:
        return self.diverged(
            allocate,
            "expect",
            "prefill stalled",
            "the prompt gets computed",
            f"ok {observed.get('ok')}, tokens {observed.get('tokens')}",
            "the prefill's allocate loop cannot finish the prompt",
        )

    def check(self, step: Step) -> None:
        self.steps_run += 1
        values = self.guarded(step, "target", lambda: self.target.check_values(step.check))
        if self.observe is not None:
            self.observe(step, values)
        for key, want in step.check.items():
            if key not in values:
                raise TraceError(
                    self.trace.path,
                    step.index,
                    key,
                    f"not observable on {self.target.capabilities.implementation}: "
                    "the target does not report it",
                )
            got = values[key]
            if not same_check(key, want, got):
                self.miss(step, f"check {key}", want, got)


def one_line(error: BaseException) -> str:
    """`TypeName: first line of the message`."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
