"""The target registry: every implementation a trace can run on, by name.

A target is imported only when chosen, so `--target model` never imports
vLLM. The commands (`gate`, `replay`, `workload`, `mutate`) all look targets
up here; nothing below the command line imports `kvgate.cli`. Exploration
builds its lockstep vLLM target itself (`explore/differential.py`): it drives
the `OpDriver` interface, not only a `Target`'s.
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import cast

from kvgate.conformance.corpora import whole
from kvgate.conformance.refusal import judge_refusal, refused_for_lacking
from kvgate.conformance.replay import (
    WHOLE_VIEW_EVERY,
    Level,
    ModelBug,
    Outcome,
    TargetFactory,
    TraceRunError,
    one_line,
    replay,
)
from kvgate.conformance.scheduler_replay import SchedulerModelFactory, replay_scheduler
from kvgate.conformance.trace import Trace, TraceError
from kvgate.errors import InputError
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.scheduling import EngineStep, SchedulerTarget
from kvgate.vocabulary.target import Target

# Where each target lives, as "module:factory", imported only when chosen.
TARGETS: dict[str, str] = {
    "model": "kvgate.model:ModelTarget",
    "vllm": "kvgate.impl.vllm_target:VllmTarget",
}
# The target every other one is compared with, step by step.
LOCKSTEP_MODEL = "model"
# Scheduler-level targets (`vocabulary.scheduling.SchedulerTarget`): a whole
# scheduler owning its manager, run beside kvgate's scheduler model.
SCHEDULER_TARGETS: dict[str, str] = {
    "vllm-scheduler": "kvgate.impl.vllm_scheduler:VllmScheduler",
}
# kvgate's scheduler model, which scheduler-level traces replay in lockstep.
SCHEDULER_MODEL = "kvgate.model.scheduler:SchedulerModel"
# The scheduler each manager target's scheduler-level traces replay on.
SCHEDULER_OF = {"vllm": "vllm-scheduler"}


def target_factory(name: str) -> TargetFactory:
    """The factory registered as `name` (in `TARGETS` or `SCHEDULER_TARGETS`),
    imported now; InputError if it cannot be."""
    module_name, _, attribute = {**TARGETS, **SCHEDULER_TARGETS}[name].partition(":")
    if name.startswith("vllm"):
        # vLLM picks its platform when first imported; kvgate drives it on CPU.
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise InputError(f"--target {name}: not available here ({one_line(error)})") from None
    return cast(TargetFactory, factory)


def plugin_factory(name: str, plugin: str | None) -> TargetFactory:
    """`target_factory(name)` with `--plugin` bound to it: a vLLM plugin
    module, or 'entry-points' for vLLM's own loader (only `vllm` loads one)."""
    if plugin is not None and name != "vllm":
        raise InputError("--plugin: only --target vllm loads plugins")
    factory = target_factory(name)
    if plugin is None:
        return factory
    # VllmTarget(config, plugin=...): the one target that loads plugins.
    return functools.partial(cast(Callable[..., Target], factory), plugin=plugin)


def build_target(factory: TargetFactory, trace: Trace) -> Target:
    """A target for `trace`'s config; a config it cannot run is the trace's error."""
    try:
        return factory(trace.config)
    except UnsupportedConfig as error:
        raise TraceError.unsupported(trace.path, error) from None


def gate_factories(
    target_name: str, plugin: str | None = None
) -> tuple[TargetFactory, TargetFactory | None]:
    """The factory of the target a gate runs (`plugin_factory`), and the
    lockstep model's (None when the target is the model itself)."""
    factory = plugin_factory(target_name, plugin)
    model = None if target_name == LOCKSTEP_MODEL else target_factory(LOCKSTEP_MODEL)
    return factory, model


def run_trace(
    trace: Trace,
    factory: TargetFactory,
    model: TargetFactory | None,
    level: Level,
    target_is_model: bool,
    excluded: list[str] | None = None,
    whole_view_every: int = WHOLE_VIEW_EVERY,
) -> Outcome:
    """One trace's verdict, or the error that kept it from getting one;
    `excluded` gets the strict-view exclusions that hid the target's raw state;
    `whole_view_every`: how often a strict lockstep compares whole views.
    A trace a corpus kept as its head is read again for the run, and the
    outcome names the head: nothing of the body outlives the run."""
    started = time.perf_counter()
    try:
        held = whole(trace)
    except TraceError as error:
        return TraceRunError(trace, str(error), bug=False)
    outcome = _run_trace(
        held, factory, model, level, target_is_model, excluded, whole_view_every, started
    )
    return replace(outcome, trace=trace)


def _run_trace(
    trace: Trace,
    factory: TargetFactory,
    model: TargetFactory | None,
    level: Level,
    target_is_model: bool,
    excluded: list[str] | None,
    whole_view_every: int,
    started: float,
) -> Outcome:
    if trace.expect_refused is not None:
        return refused_for_lacking(factory, trace) or judge_refusal(trace, factory, level)
    try:
        target = build_target(factory, trace)
    except TraceError as error:
        # The target will not run this config at all: not applicable to it.
        seconds = time.perf_counter() - started
        return TraceRunError(trace, str(error), bug=False, seconds=seconds, config_refused=True)
    try:
        try:
            result = replay(
                trace,
                target,
                model,
                level,
                target_is_model=target_is_model,
                whole_view_every=whole_view_every,
            )
            if excluded is not None:
                excluded.extend(getattr(target, "exclusions_applied", ()))
            return result
        finally:
            target.close()
    except TraceError as error:
        return TraceRunError(trace, str(error), bug=False, seconds=time.perf_counter() - started)
    except ModelBug as bug:
        return TraceRunError(trace, str(bug), bug=True, seconds=time.perf_counter() - started)


def scheduler_factories(
    target_name: str, plugin: str | None
) -> tuple[SchedulerModelFactory, Callable[[Config, int, int], SchedulerTarget] | None]:
    """For scheduler-level traces on `target_name`: kvgate's scheduler model
    and the real scheduler's factory, (config, spec, max_num_seqs) each
    (None on the model: the model is the target), `plugin` loaded by the
    real one as `--plugin` asks."""
    module_name, _, attribute = SCHEDULER_MODEL.partition(":")
    model = cast(SchedulerModelFactory, getattr(importlib.import_module(module_name), attribute))
    scheduler = SCHEDULER_OF.get(target_name)
    if scheduler is None:
        return model, None
    factory = cast(Callable[..., SchedulerTarget], target_factory(scheduler))

    def build(config: Config, spec: int, max_num_seqs: int) -> SchedulerTarget:
        return factory(config, spec_tokens=spec, max_num_seqs=max_num_seqs, plugin=plugin)

    return model, build


def _lacking(target: SchedulerTarget, trace: Trace) -> tuple[int, str, str] | None:
    """What of `trace` the real scheduler cannot run (the trace is then not
    applicable to it), as (step, field, why); None when it runs all of it.
    A streamed trace's entries are read for it only from a build that
    lacks something."""
    if not target.pause_states:
        first = _first(trace, lambda e: e.op == "pause")
        if first is not None:
            return first, "mode", "this vLLM's Scheduler has no pause states"
    if not target.streaming_input:
        first = _first(trace, lambda e: e.resumable)
        if first is not None:
            return first, "resumable", "this vLLM's Scheduler takes no streaming-input sessions"
    return None


def _first(trace: Trace, which: Callable[[EngineStep], bool]) -> int | None:
    """The index of `trace`'s first engine entry that is `which`, read from
    its file when the trace is streamed; None when there is none."""
    entries = trace.engine if trace.stream is None else trace.stream.engine()
    return next((e.index for e in entries if which(e)), None)


def run_scheduler_trace(
    trace: Trace,
    model: SchedulerModelFactory,
    real: Callable[[Config, int, int], SchedulerTarget] | None,
    level: Level,
    whole_view_every: int = WHOLE_VIEW_EVERY,
) -> Outcome:
    """A scheduler-level trace's verdict (`scheduler_replay`), on the real
    scheduler `real` builds in lockstep with the model, or on the model
    alone; the error that kept it from one otherwise. `whole_view_every`:
    how often a strict lockstep compares whole views. A trace a corpus kept
    as its head is read again for the run, as by `run_trace`."""
    started = time.perf_counter()
    try:
        held = whole(trace)
    except TraceError as error:
        return TraceRunError(trace, str(error), bug=False)
    outcome = _run_scheduler_trace(held, model, real, level, whole_view_every, started)
    return replace(outcome, trace=trace)


def _run_scheduler_trace(
    trace: Trace,
    model: SchedulerModelFactory,
    real: Callable[[Config, int, int], SchedulerTarget] | None,
    level: Level,
    whole_view_every: int,
    started: float,
) -> Outcome:
    assert trace.scheduler is not None
    target = None
    try:
        if real is not None:
            try:
                target = real(trace.config, trace.scheduler.spec, trace.scheduler.max_num_seqs)
            except UnsupportedConfig as error:
                seconds = time.perf_counter() - started
                message = str(TraceError.unsupported(trace.path, error))
                return TraceRunError(
                    trace, message, bug=False, seconds=seconds, config_refused=True
                )
            lacking = target is not None and _lacking(target, trace)
            if lacking:
                return TraceRunError(
                    trace,
                    str(TraceError(trace.path, *lacking)),
                    bug=False,
                    seconds=time.perf_counter() - started,
                    config_refused=True,
                )
        return replay_scheduler(trace, model, target, level, whole_view_every=whole_view_every)
    except TraceError as error:
        return TraceRunError(trace, str(error), bug=False, seconds=time.perf_counter() - started)
    except ModelBug as bug:
        return TraceRunError(trace, str(bug), bug=True, seconds=time.perf_counter() - started)
    finally:
        if target is not None:
            target.close()
