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
from collections.abc import Callable
from typing import cast

from kvgate.conformance.config import UnsupportedConfig
from kvgate.conformance.replay import TargetFactory, one_line
from kvgate.conformance.target import Target
from kvgate.conformance.trace import Trace, TraceError
from kvgate.errors import InputError

# Where each target lives, as "module:factory", imported only when chosen.
TARGETS: dict[str, str] = {
    "model": "kvgate.model:ModelTarget",
    "vllm": "kvgate.impl.vllm_target:VllmTarget",
}
# The target every other one is compared with, step by step.
LOCKSTEP_MODEL = "model"
# Scheduler-level targets (`conformance.scheduling.SchedulerTarget`): a whole
# scheduler owning its manager, run beside kvgate's scheduler model.
SCHEDULER_TARGETS: dict[str, str] = {
    "vllm-scheduler": "kvgate.impl.vllm_scheduler:VllmScheduler",
}


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
