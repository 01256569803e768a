"""The partial-tail checkpoint hold, overlaid at run time on upstream vLLM.

A vLLM general plugin (entry point group `vllm.general_plugins`, name
`kvgate_hold`): `install()` wraps a few methods of vLLM's `MambaManager` and
`KVCacheCoordinator` classes in this process; the installed package is never
modified on disk. vLLM calls the entry point, `register()`, in every process
of the environment kvgate is installed in, production serving included: it
installs nothing unless the user opted in, with the hold switch
(`VLLM_E2_MAMBA_RETAIN_CHECKPOINT=1`) or `KVGATE_HOLD_OVERLAY=1` set when
the process starts. Naming the plugin (`kvgate gate --plugin
kvgate.impl.hold_overlay`, `pytest -p kvgate.impl.hold_overlay_pytest`) is
opting in: it calls `install()`. What the wrappers add is the behaviour kvgate's model
specifies in `kvgate/model/hold.py`, called where `kvgate/model/mamba.py` and
`kvgate/model/coordinator.py` call it:

- a running request's CoW moves its partial tail's keys to a copy: holds on
  the source follow the keys to the copy, then the request holds the copy;
- a new request's partial-hit CoW: the request holds the hit source;
- a newer hold supersedes (and releases) the request's older one;
- full-sequence admission reserves one more block per Mamba group for a
  partial-tail hit when that group holds nothing for the request yet;
- with prefill checkpoint blocks, the prompt's partial tail lives in the
  checkpoint column, not the running block: when it leaves the table the
  request holds it (the table's ref becomes the hold's);
- `free` releases the holds after every group freed its table, in one
  `free_blocks` call in group order; `pop_blocks_for_free` puts them first in
  the returned list, so the scheduler's tail-first release frees them last.

With `KVGATE_RETAIN_RETIRED=1` as well (its own switch, read the same way)
it also adds the production fork's older retention (a trace's
`retain_retired`, `Holds.retire` in the model): of the keyed states that
leave a request's table behind its running one, the newest is held, and
admission reserves the block that costs.

The switch is `VLLM_E2_MAMBA_RETAIN_CHECKPOINT`, read from the environment by
each `MambaManager` when it is built, so one process can build managers with
the hold on and off. A manager built with it off (or not align-mode, or
without prefix caching) runs vLLM's own code unchanged: every wrapper passes
straight through. Each manager carries `_retain_checkpoint` (its switch) and
`_retained_checkpoints` ({request id: (held token position, block)}), the
names a patched vLLM build uses, so a kvgate adapter reads both alike.

Every ref, touch and free happens in the model's order. The wrappers run
their part right after vLLM's method returns; that is the model's order
because nothing between the model's hold calls and the end of vLLM's method
touches the pool (the copy block is already taken, and the source's
`ref_cnt += 1` commutes with a hold's touch/free of the same block, which
never brings it to 0).
"""

from __future__ import annotations

import functools
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvgate.impl._vllm_api import (
    HOLD_ATTR,
    RETAIN_SWITCH,
    RETIRE_ATTR,
    RETIRE_SWITCH,
    SWITCH_ON_VALUES,
)

__all__ = [
    "HOLD_SOURCE",
    "OPT_IN_SWITCH",
    "install",
    "is_registered",
    "register",
    "stats",
    "unregister",
]

# What a kvgate gate report shows as the hold implementation.
HOLD_SOURCE = "kvgate overlay (kvgate.impl.hold_overlay)"
# The per-manager switch, as a patched vLLM build names it.
SWITCH_ATTR = "_retain_checkpoint"
# vLLM logs under the "vllm" logger tree; a child gets its handler.
LOGGER_NAME = "vllm.plugins.kvgate_hold"
STARTUP_LINE = (
    "kvgate hold overlay on (%s=1): each request keeps its newest partial-tail "
    "Mamba state referenced until it is freed (hash unit %d < Mamba block %d)"
)
# What the wrappers wrap and read, probed before installing (never a version
# string): (class, method) -> parameters the wrapper passes by name;
# attributes the wrappers read on a Mamba manager or a block.
_WRAPPED: dict[tuple[str, str], tuple[str, ...]] = {
    ("MambaManager", "__init__"): ("kv_cache_spec", "block_pool"),
    ("MambaManager", "get_num_blocks_to_allocate"): (
        "request_id",
        "num_tokens",
        "new_computed_blocks",
        "total_computed_tokens",
        "num_local_computed_tokens",
        "num_tokens_main_model",
        "apply_admission_cap",
        "prefill_end",
    ),
    ("MambaManager", "allocate_new_blocks"): ("request_id", "num_tokens", "num_tokens_main_model"),
    ("MambaManager", "_remove_blocks_in_range"): ("request_id", "first_block", "last_block"),
    ("KVCacheCoordinator", "free"): ("request_id",),
    ("KVCacheCoordinator", "pop_blocks_for_free"): ("request_id",),
}
_MAMBA_READS = (
    "_partial_hit_reqs",
    "_allocated_block_reqs",
    "_pending_cow_copies",
    "_has_partial_local_hit",
    "mamba_cache_mode",
    "enable_caching",
)

Block = Any  # vllm.v1.core.kv_cache_utils.KVCacheBlock
Manager = Any  # vllm.v1.core.single_type_kv_cache_manager.MambaManager

_lock = threading.Lock()
# (class, method name) -> the original function, while registered.
_originals: dict[tuple[type, str], Callable[..., Any]] = {}
# (hash unit, block size) pairs whose startup line this process has logged.
_announced: set[tuple[int, int]] = set()
# What the overlay did in this process, for a test run's summary (a run that
# never took a hold did not exercise it): managers built with the hold on,
# holds taken, followed and released, admission blocks added.
stats: Counter[str] = Counter()


def switch_on(name: str = RETAIN_SWITCH) -> bool:
    """An environment switch, as a manager built now reads it."""
    return os.environ.get(name, "0").strip().lower() in SWITCH_ON_VALUES


def is_registered() -> bool:
    return bool(_originals)


# The overlay's two refusals, logged once at startup instead of installing
# (`kvgate hold-check` reads all three lines from a server's log).
NOT_INSTALLED_LINE = "kvgate hold overlay not installed: this vLLM build has %s itself"
REFUSED_LINE = "kvgate hold overlay refused: vLLM %s lacks %s"

# Set to 1, it installs the overlay from the entry point with the hold switch
# off (managers then run vLLM's own code until one is built with it on).
OPT_IN_SWITCH = "KVGATE_HOLD_OVERLAY"


def register() -> None:
    """The entry point, which vLLM calls in every process: install the
    overlay only if the user opted in (the hold switch or `OPT_IN_SWITCH`
    on), so that installing kvgate changes no serving process by itself."""
    if switch_on(RETAIN_SWITCH) or switch_on(OPT_IN_SWITCH):
        install()


def install() -> None:
    """Install the overlay in this process (idempotent).

    A vLLM build that already has the switch (a patched build) is left alone:
    its own hold runs, and overlaying a second one would double every ref.
    A build lacking what the wrappers wrap or read (`missing_internals`) is
    refused with one warning line naming what is missing; nothing is
    installed then, so a gate's hold-on traces fail on their expectations.
    """
    with _lock:
        if _originals:
            return
        from vllm import envs
        from vllm.logger import init_logger
        from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        logger = init_logger(LOGGER_NAME)
        if RETAIN_SWITCH in getattr(envs, "environment_variables", {}):
            logger.warning(NOT_INSTALLED_LINE, RETAIN_SWITCH)
            return
        missing = missing_internals()
        if missing:
            import vllm

            logger.warning(
                REFUSED_LINE,
                getattr(vllm, "__version__", "unknown"),
                ", ".join(missing),
            )
            return
        patches: dict[tuple[type, str], Callable[[Callable[..., Any]], Callable[..., Any]]] = {
            (MambaManager, "__init__"): functools.partial(_wrap_init, logger),
            (MambaManager, "get_num_blocks_to_allocate"): _wrap_blocks_needed,
            (MambaManager, "allocate_new_blocks"): _wrap_allocate,
            (MambaManager, "_remove_blocks_in_range"): _wrap_remove_range,
            (KVCacheCoordinator, "free"): _wrap_free,
            (KVCacheCoordinator, "pop_blocks_for_free"): _wrap_pop,
        }
        for (cls, name), wrap in patches.items():
            # The class's own function (all five are defined where patched),
            # so `unregister` puts back exactly what was there.
            original = cls.__dict__[name]
            wrapper = wrap(original)
            # Keep the name and docs but not the module, so `__module__` tells
            # who patched the class (the kvgate adapter reads it).
            functools.update_wrapper(
                wrapper, original, assigned=("__name__", "__qualname__", "__doc__")
            )
            wrapper.__module__ = __name__
            _originals[(cls, name)] = original
            setattr(cls, name, wrapper)


def missing_internals() -> list[str]:
    """What the overlay wraps or reads that the installed vLLM lacks, by name
    (empty: the overlay supports this build). Probes the classes and their
    signatures and sources; imports vLLM."""
    import inspect

    from vllm.v1.core import kv_cache_coordinator, kv_cache_utils, single_type_kv_cache_manager

    classes = {
        "MambaManager": getattr(single_type_kv_cache_manager, "MambaManager", None),
        "KVCacheCoordinator": getattr(kv_cache_coordinator, "KVCacheCoordinator", None),
    }
    missing: list[str] = []
    for (owner, method), params in _WRAPPED.items():
        cls = classes[owner]
        # Defined on the class itself: `unregister` must put back exactly that.
        function = None if cls is None else cls.__dict__.get(method)
        if function is None:
            missing.append(f"{owner}.{method}")
            continue
        have = inspect.signature(function).parameters
        missing.extend(f"{owner}.{method}({p})" for p in params if p not in have)
    mamba = classes["MambaManager"]
    if mamba is not None:
        # Instance attributes are set in __init__, here or in a base class.
        source = "".join(inspect.getsource(c) for c in mamba.__mro__ if c is not object)
        missing.extend(f"MambaManager.{a}" for a in _MAMBA_READS if f"self.{a}" not in source)
    if not hasattr(kv_cache_utils.KVCacheBlock, "block_hash_num_tokens"):
        missing.append("KVCacheBlock.block_hash_num_tokens")
    return missing


def unregister() -> None:
    """Put vLLM's own methods back (for tests and A/B runs in one process).

    Managers built while the overlay was installed keep their attributes but
    run vLLM's code from now on.
    """
    with _lock:
        for (cls, name), original in _originals.items():
            setattr(cls, name, original)
        _originals.clear()


# ----------------------------------------------------------------- the holds


def _enabled(manager: Manager) -> bool:
    """The partial-tail hold is on for this manager."""
    return bool(getattr(manager, SWITCH_ATTR, False))


def _retires(manager: Manager) -> bool:
    """Retired states are retained by this manager."""
    return bool(getattr(manager, RETIRE_ATTR, False))


def _holds(manager: Manager) -> dict[str, tuple[int, Block]]:
    holds: dict[str, tuple[int, Block]] = getattr(manager, HOLD_ATTR)
    return holds


def _hold(manager: Manager, request_id: str, block: Block) -> bool:
    """Give `block`'s keyed state a ref owned by the request, if it is newer
    (by keyed token position) than what the request holds in this group."""
    if block.is_null or block.block_hash is None:
        return False
    position = block.block_hash_num_tokens
    assert position is not None, "a keyed block knows the position it covers"
    holds = _holds(manager)
    current = holds.get(request_id)
    if current is not None and (current[1] is block or current[0] >= position):
        return False
    pool = manager.block_pool
    # Take the new ref before dropping the old: the newest state never
    # passes through the free queue.
    pool.touch([block])
    holds[request_id] = (int(position), block)
    stats["holds taken"] += 1
    if current is not None:
        pool.free_blocks([current[1]])
    return True


def _follow_moved_keys(manager: Manager, owner: str, source: Block, copy: Block) -> None:
    """The owner moved `source`'s keys to `copy` and keeps writing `source`:
    a hold another request has on `source` moves to `copy`, with the keys."""
    holds = _holds(manager)
    pool = manager.block_pool
    for request_id, (position, block) in list(holds.items()):
        if request_id != owner and block is source:
            pool.touch([copy])
            holds[request_id] = (position, copy)
            pool.free_blocks([source])
            stats["holds followed"] += 1


def _release(managers: Sequence[Manager], request_id: str) -> list[Block]:
    """Forget the request's holds, in group order; the caller frees them."""
    released: list[Block] = []
    for manager in managers:
        if _enabled(manager) or _retires(manager):
            entry = _holds(manager).pop(request_id, None)
            if entry is not None:
                released.append(entry[1])
                stats["holds released"] += 1
    return released


# -------------------------------------------------------------- the wrappers


def _wrap_init(logger: Any, original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Manager, kv_cache_spec: Any, block_pool: Any, **kwargs: Any) -> None:
        original(self, kv_cache_spec, block_pool, **kwargs)
        # Only align mode with prefix caching keys the states a hold keeps.
        align = self.mamba_cache_mode == "align" and bool(self.enable_caching)
        on = switch_on() and align
        setattr(self, SWITCH_ATTR, on)
        setattr(self, RETIRE_ATTR, switch_on(RETIRE_SWITCH) and align)
        setattr(self, HOLD_ATTR, {})
        stats["managers with the hold on"] += on
        unit, size = int(block_pool.hash_block_size), int(self.block_size)
        # Partial tails (and so holds) exist only below the block size.
        if on and unit < size and (unit, size) not in _announced:
            _announced.add((unit, size))
            logger.info(STARTUP_LINE, RETAIN_SWITCH, unit, size)

    return __init__


def _wrap_blocks_needed(original: Callable[..., int]) -> Callable[..., int]:
    def get_num_blocks_to_allocate(
        self: Manager,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Block],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        needed = original(
            self,
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )
        # `apply_admission_cap` marks the full-sequence admission count: the
        # blocks a request will hold outside its table, which the per-step
        # estimate never sees.
        if apply_admission_cap:
            extra = _admission_extra(
                self,
                request_id,
                new_computed_blocks,
                num_local_computed_tokens,
                num_tokens_main_model,
            )
            needed += extra
            stats["admission blocks added"] += extra
        return needed

    return get_num_blocks_to_allocate


def _admission_extra(
    manager: Manager,
    request_id: str,
    hit: Sequence[Block],
    num_local_computed_tokens: int,
    num_tokens: int,
) -> int:
    """`Holds.admission_extra`: for a partial-tail hit with the hold on (the
    held source and the moved tail coexist for a step), and with the hold on
    for a group keying sub-block states besides the prompt's tail (prefill
    checkpoint blocks, the shared-prefix checkpoint): a held one and a moved
    tail coexist; with retired states
    retained, for a prompt that will retire one unless a hit brings it, and
    for a prompt within a block whose own tail the hold keeps."""
    hold, retain_retired = _enabled(manager), _retires(manager)
    if not (hold or retain_retired) or request_id in _holds(manager):
        return 0
    if hold and manager._has_partial_local_hit(hit, num_local_computed_tokens):
        return 1
    block_size = int(manager.block_size)
    # A held sub-block state besides the prompt's tail (an exported
    # checkpoint, a junction's), beside a moved tail.
    sub_block = int(manager.block_pool.hash_block_size) < block_size
    more_partial_states = bool(getattr(manager, "has_prefill_checkpoint_blocks", False)) or bool(
        getattr(manager, "shared_prefix_checkpoint", False)
    )
    if hold and more_partial_states and sub_block:
        return 1
    if not retain_retired:
        return 0
    if num_tokens <= block_size:
        return int(hold and int(manager.block_pool.hash_block_size) < block_size)
    return 0 if any(not block.is_null for block in hit) else 1


def _retire(manager: Manager, request_id: str, retired: list[Block]) -> list[Block]:
    """`Holds.retire`: hold the newest keyed block among those leaving the
    table, if newer than the hold (its table ref becomes the hold's); the
    blocks to free: the rest, then a superseded hold. With the tail hold
    alone only a sub-block position counts: a prefill checkpoint block
    carrying the prompt's partial tail."""
    every_state = _retires(manager)
    block_size = int(manager.block_size)
    newest = None
    for block in retired:
        position = block.block_hash_num_tokens if block.block_hash is not None else None
        if position is None or (not every_state and position % block_size == 0):
            continue
        if newest is None or position > newest[0]:
            newest = (int(position), block)
    holds = _holds(manager)
    current = holds.get(request_id)
    if newest is None or (current is not None and current[0] >= newest[0]):
        return retired
    holds[request_id] = newest
    stats["retired states held"] += 1
    rest = [block for block in retired if block is not newest[1]]
    return rest + ([current[1]] if current is not None else [])


def _wrap_remove_range(original: Callable[..., None]) -> Callable[..., None]:
    def _remove_blocks_in_range(
        self: Manager, request_id: str, first_block: int, last_block: int
    ) -> None:
        if not (_retires(self) or _enabled(self)):
            return original(self, request_id, first_block, last_block)
        # vLLM frees what leaves the table in one `free_blocks` call; take
        # that list instead of freeing it, keep the newest state, free the rest.
        pool = self.block_pool
        leaving: list[Block] = []
        pool.free_blocks = leaving.extend  # an instance attribute, for this call only
        try:
            original(self, request_id, first_block, last_block)
        finally:
            del pool.free_blocks
        freed = _retire(self, request_id, leaving)
        if freed:
            pool.free_blocks(freed)
        return None

    return _remove_blocks_in_range


def _wrap_allocate(original: Callable[..., list[Block]]) -> Callable[..., list[Block]]:
    def allocate_new_blocks(
        self: Manager, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[Block]:
        if not _enabled(self):
            return original(self, request_id, num_tokens, num_tokens_main_model)
        # What vLLM's CoW branch will see, read before it consumes it.
        partial = self._partial_hit_reqs.get(request_id)
        running = request_id in self._allocated_block_reqs
        blocks = original(self, request_id, num_tokens, num_tokens_main_model)
        if partial is None:
            return blocks
        _, source = partial
        if running:
            # vLLM moved the tail's keys to a fresh copy and queued the copy
            # last; the request keeps writing `source`.
            queued_source, copy = self._pending_cow_copies[-1]
            assert queued_source is source, "the tail move queues (source, copy) last"
            _follow_moved_keys(self, request_id, source, copy)
            _hold(self, request_id, copy)
        else:
            # A first allocation redirected its table to a private copy; the
            # hit source still carries the keyed state it resumed from.
            _hold(self, request_id, source)
        return blocks

    return allocate_new_blocks


def _wrap_free(original: Callable[..., None]) -> Callable[..., None]:
    def free(self: Any, request_id: str) -> None:
        original(self, request_id)
        # Holds go last: the held state is the request's last block to age.
        held = _release(self.single_type_managers, request_id)
        if held:
            self.block_pool.free_blocks(held)

    return free


def _wrap_pop(original: Callable[..., list[Block]]) -> Callable[..., list[Block]]:
    def pop_blocks_for_free(self: Any, request_id: str) -> list[Block]:
        # First in the list, so the caller's reverse-order release frees them last.
        held = _release(self.single_type_managers, request_id)
        return held + original(self, request_id)

    return pop_blocks_for_free
