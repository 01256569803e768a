"""What the installed vLLM build offers, probed on its objects.

Never a version string: whether the Mamba managers carry the hold (and the
build's own switch), whether kvgate's overlay retains retired states, which
module implemented the hold, and `probe()`, the summary a gate report's
header prints.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from kvgate.impl import _vllm_api
from kvgate.impl._vllm_api import HOLD_ATTR, RETAIN_SWITCH, VllmApi
from kvgate.impl.vllm_build import build_manager
from kvgate.impl.vllm_errors import describe
from kvgate.vocabulary.config import Config, GroupConfig, ModelRunner

__all__ = [
    "hold_source",
    "holds_partial_tails",
    "model_runner",
    "probe",
    "retains_retired",
    "takes_streaming_input",
]


def is_mamba(api: VllmApi, manager: Any) -> bool:
    return isinstance(getattr(manager, "kv_cache_spec", None), api.MambaSpec)


def holds_partial_tails(api: VllmApi, managers: Sequence[Any], switch: bool) -> bool:
    """Whether this build holds partial-tail checkpoints, switch included.

    Probed on the managers themselves: a Mamba manager carrying the hold map,
    with the build's own switch flag when it exposes one.
    """
    return any(
        hasattr(m, HOLD_ATTR) and bool(getattr(m, "_retain_checkpoint", switch))
        for m in managers
        if is_mamba(api, m)
    )


def retains_retired(api: VllmApi, managers: Sequence[Any]) -> bool:
    """Whether kvgate's overlay retains retired states on these managers."""
    return any(bool(getattr(m, _vllm_api.RETIRE_ATTR, False)) for m in managers if is_mamba(api, m))


def takes_streaming_input(api: VllmApi, scheduler: Any) -> bool:
    """Whether this build's Scheduler takes streaming-input sessions: its
    requests can be resumable, and the Scheduler keeps a stopped one waiting
    for its next input chunk (the counter of such sessions)."""
    try:
        parameters = inspect.signature(api.Request).parameters
    except (TypeError, ValueError):
        return False
    return "resumable" in parameters and hasattr(scheduler, "num_waiting_for_streaming_input")


def model_runner(scheduler: Any) -> tuple[ModelRunner, bool]:
    """The model runner this Scheduler was built for (`v1` or `v2`), and
    whether the build lets the engine choose it.

    Probed on the Scheduler: a build with both runners carries the engine's
    choice (`use_v2_model_runner`); a build with one runner carries none, and
    keeps the record of last step's requests only where that one is the v1
    runner (which alone is handed them again); a build without it, whose v1
    runner was removed, hands the worker what the v2 runner takes."""
    choice = getattr(scheduler, "use_v2_model_runner", None)
    if choice is not None:
        return ("v2" if choice else "v1"), True
    return ("v1" if hasattr(scheduler, "prev_step_scheduled_req_ids") else "v2"), False


def hold_source(managers: Sequence[Any], plugin: str | None, module: ModuleType | None) -> str:
    """Which implementation of the hold ran: a plugin's overlay, or the vLLM build's.

    The plugin module's `HOLD_SOURCE` when it declares one; else the module
    that patched the managers' class, found by the patched methods'
    `__module__` (so an overlay loaded through vLLM's entry points, or earlier
    in this process, is named too), by its `HOLD_SOURCE` or as `plugin NAME`.
    """
    if module is not None:
        declared = getattr(module, "HOLD_SOURCE", None)
        if isinstance(declared, str) and declared:
            return declared
    patcher = _patching_module(managers)
    if patcher is not None:
        declared = getattr(sys.modules.get(patcher), "HOLD_SOURCE", None)
        if isinstance(declared, str) and declared:
            return declared
        return f"plugin {plugin if module is not None else patcher}"
    return f"vllm build ({RETAIN_SWITCH})"


def _patching_module(managers: Sequence[Any]) -> str | None:
    """The module outside vLLM that replaced a manager class's hold-path method."""
    for m in managers:
        for attr in ("__init__", "allocate_new_blocks", "pop_blocks_for_free"):
            name = str(getattr(getattr(type(m), attr, None), "__module__", "vllm"))
            if not name.startswith("vllm"):
                return name
    return None


_PROBE_CONFIG = Config(
    num_blocks=16,
    hash_unit=8,
    groups=(
        GroupConfig("full_attention", 8),
        GroupConfig("mamba_align", 32),
    ),
    eagle=False,
    retention_interval=None,
    hold=True,
    scheduler_block_size=32,
)


def probe() -> dict[str, Any]:
    """What the installed vLLM offers, for a gate report's header.

    Keys: `vllm` (version, or None when it cannot be imported, with `error`),
    `location`, `partial_hits` (sub-block Mamba hits on a hybrid config),
    `hold` (the partial-tail checkpoint hold exists; probed on a small manager
    built with the switch on), `hold_switch` (its environment variable),
    `deferred_free` (`KVCacheManager.pop_blocks_for_free`).
    """
    try:
        api = _vllm_api.load()
    except Exception as exc:
        return {"vllm": None, "error": describe(exc)}
    info: dict[str, Any] = {
        "vllm": api.version,
        "location": api.location,
        "partial_hits": False,
        "hold": False,
        "hold_switch": RETAIN_SWITCH,
        "deferred_free": callable(getattr(api.KVCacheManager, "pop_blocks_for_free", None)),
    }
    previous = os.environ.get(RETAIN_SWITCH)
    try:
        _vllm_api.set_retain_switch(True)
        manager = build_manager(api, _PROBE_CONFIG)
        managers = tuple(manager.coordinator.single_type_managers)
        info["partial_hits"] = bool(getattr(manager.coordinator, "enable_partial_hash_hits", False))
        info["hold"] = holds_partial_tails(api, managers, True)
    except Exception as exc:
        info["error"] = describe(exc)
    finally:
        if previous is None:
            os.environ.pop(RETAIN_SWITCH, None)
        else:
            os.environ[RETAIN_SWITCH] = previous
        _vllm_api.clear_env_cache()
    return info
