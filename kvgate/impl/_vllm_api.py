"""Lazy access to the installed vLLM, for the vLLM target.

Importing vLLM takes many seconds, so nothing here imports it at module
import time: `load()` does, once per process, and hands back the handful of
names the adapter uses. The partial-tail hold switch and the optional
overlay plugin are handled here too, because both must act before vLLM reads
its environment or builds a manager.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

# The environment switch of the patched vLLM builds that hold a request's
# newest hashed Mamba state (MambaManager._retained_checkpoints).
RETAIN_SWITCH = "VLLM_E2_MAMBA_RETAIN_CHECKPOINT"
# kvgate's overlay also offers the fork's older retention of retired states
# (a trace's `retain_retired`) under a switch of its own.
RETIRE_SWITCH = "KVGATE_RETAIN_RETIRED"
RETIRE_ATTR = "_kvgate_retain_retired"
# The attribute such a build gives every MambaManager instance.
HOLD_ATTR = "_retained_checkpoints"
# The values that turn a switch on, as the overlay reads them.
SWITCH_ON_VALUES = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class VllmApi:
    """The vLLM names the adapter needs (all typed Any: vLLM is untyped here)."""

    version: str
    location: str
    torch: Any
    envs: Any
    KVCacheConfig: Any
    KVCacheGroupSpec: Any
    FullAttentionSpec: Any
    MambaSpec: Any
    KVCacheManager: Any
    MambaManager: Any
    Request: Any
    RequestStatus: Any
    SamplingParams: Any
    Scheduler: Any
    sha256: Any
    init_none_hash: Any
    get_request_block_hasher: Any
    get_block_hash: Any
    get_group_id: Any
    make_block_hash_with_group_id: Any
    # KV-cache event classes (vllm.distributed.kv_events).
    BlockStored: Any
    BlockRemoved: Any
    AllBlocksCleared: Any
    # A request's hash inputs: its LoRA adapter, its multimodal items.
    LoRARequest: Any
    MultiModalFeatureSpec: Any
    PlaceholderRange: Any


@functools.cache
def load() -> VllmApi:
    """Import vLLM (CPU) once and return the names the adapter uses."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    import vllm
    from vllm import envs
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        get_block_hash,
        get_group_id,
        get_request_block_hasher,
        init_none_hash,
        make_block_hash_with_group_id,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.request import Request, RequestStatus

    return VllmApi(
        version=str(getattr(vllm, "__version__", "unknown")),
        location=os.path.dirname(str(getattr(vllm, "__file__", ""))),
        torch=torch,
        envs=envs,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        FullAttentionSpec=FullAttentionSpec,
        MambaSpec=MambaSpec,
        KVCacheManager=KVCacheManager,
        MambaManager=MambaManager,
        Request=Request,
        RequestStatus=RequestStatus,
        SamplingParams=SamplingParams,
        Scheduler=Scheduler,
        sha256=sha256,
        init_none_hash=init_none_hash,
        get_request_block_hasher=get_request_block_hasher,
        get_block_hash=get_block_hash,
        get_group_id=get_group_id,
        make_block_hash_with_group_id=make_block_hash_with_group_id,
        BlockStored=BlockStored,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=AllBlocksCleared,
        LoRARequest=LoRARequest,
        MultiModalFeatureSpec=MultiModalFeatureSpec,
        PlaceholderRange=PlaceholderRange,
    )


def set_retain_switch(on: bool, retain_retired: bool = False) -> None:
    """Set the hold switch (and the overlay's retired-state switch) for the
    next manager built in this process.

    Safe before vLLM is imported (nothing is read yet) and after (vLLM's
    environment cache, when enabled, is dropped so the new value is seen).
    """
    _write(RETAIN_SWITCH, "1" if on else "0")
    _write(RETIRE_SWITCH, "1" if retain_retired else "0")
    clear_env_cache()


# What kvgate last wrote to a switch, and the value it found there before:
# the environment a serving process started here would see.
_written: dict[str, str] = {}
_found: dict[str, str | None] = {}


def _write(name: str, value: str) -> None:
    current = os.environ.get(name)
    if _written.get(name) != current:  # the user's value (set since kvgate's last write)
        _found[name] = current
    os.environ[name] = value
    _written[name] = value


def serving_value(name: str) -> str | None:
    """A switch as the user set it, kvgate's own writes set aside."""
    current = os.environ.get(name)
    if name in _written and _written[name] == current:
        return _found.get(name)
    return current


def serving_switch_on(name: str) -> bool:
    """A switch is on in the environment a serving process would start in."""
    return (serving_value(name) or "0").strip().lower() in SWITCH_ON_VALUES


@contextlib.contextmanager
def _serving_environment() -> Iterator[None]:
    """The switches as the user set them, while vLLM's plugin loader runs."""
    names = (RETAIN_SWITCH, RETIRE_SWITCH)
    saved = {name: os.environ.get(name) for name in names}
    for name in names:
        value = serving_value(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    clear_env_cache()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        clear_env_cache()


def clear_env_cache() -> None:
    """Drop vllm.envs' memoized values, if vLLM is loaded and caches them."""
    import sys

    envs = sys.modules.get("vllm.envs")
    if envs is None:
        return
    getter = getattr(envs, "__getattr__", None)
    cache_clear = getattr(getter, "cache_clear", None)
    if callable(cache_clear):
        cache_clear()


_registered: dict[str, ModuleType | None] = {}

# `--plugin` names this to run vLLM's own loader instead of importing a module.
ENTRY_POINTS = "entry-points"


def register_plugin(name: str) -> ModuleType | None:
    """Load plugin `name` once per process; its module, when one was named.

    A plugin is an ordinary importable module; `register()` (optional, no
    arguments) may patch vLLM classes, e.g. to overlay a hold on an upstream
    build. Naming a plugin opts in to it: its `install()` runs instead when
    it has one (an entry point's `register()` may install only on request).
    A plugin may set `HOLD_SOURCE` (str) to name the hold it provides.
    `ENTRY_POINTS` runs vLLM's own loader (`vllm.plugins.load_general_plugins`:
    the `vllm.general_plugins` entry points, filtered by `VLLM_PLUGINS`), as a
    vLLM engine does at startup; no single module is named then (None).

    A plugin that says whether it is installed (`is_registered()`) and was
    uninstalled since (its `unregister()`, e.g. by a test restoring vLLM) is
    installed again: whether it is installed is the plugin's own state, never
    a stale record here.
    """
    if name in _registered:
        loaded = _registered[name]
        is_registered = getattr(loaded, "is_registered", None)
        register = _installer(loaded)
        if callable(is_registered) and register is not None and not is_registered():
            register()
        return loaded
    module: ModuleType | None
    if name == ENTRY_POINTS:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        module = None
    else:
        module = importlib.import_module(name)
        register = _installer(module)
        if register is not None:
            register()
    _registered[name] = module
    return module


def _installer(module: ModuleType | None) -> Callable[[], object] | None:
    """What installs a plugin named explicitly: `install`, else `register`."""
    for attribute in ("install", "register"):
        function = getattr(module, attribute, None)
        if callable(function):
            return cast(Callable[[], object], function)
    return None


def load_with_hold(
    hold: bool, retain_retired: bool, plugin: str | None
) -> tuple[VllmApi, ModuleType | None]:
    """vLLM with the hold switch as a config asks (set before vLLM reads its
    environment, vLLM's env cache dropped after), `plugin` registered:
    (the API, the plugin's module or None).

    With `ENTRY_POINTS` the hold is exactly a serving process's in this
    environment: vLLM's loader runs with the switches as the user set them
    (so kvgate's entry point installs the overlay only if a server started
    here would), and a trace's hold is on only where the user's switch is."""
    if plugin == ENTRY_POINTS:
        serving_hold = serving_switch_on(RETAIN_SWITCH)
        serving_retire = serving_switch_on(RETIRE_SWITCH)
        with _serving_environment():
            load()
            register_plugin(plugin)
        hold, retain_retired = hold and serving_hold, retain_retired and serving_retire
    set_retain_switch(hold, retain_retired)
    api = load()
    clear_env_cache()
    plugin_module = register_plugin(plugin) if plugin else None
    api.init_none_hash(api.sha256)
    return api, plugin_module
