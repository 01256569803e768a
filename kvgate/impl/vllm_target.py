"""The real vLLM `KVCacheManager` (v1, CPU) as a kvgate target.

`VllmTarget` drives the installed vLLM one manager call per primitive op, as
the op semantics of trace format version 1 define them. The op flow itself
(pending lookups, token bookkeeping, refusals, `prompt_done`) is the shared
`OpDriver`'s, exactly as for the model; this module supplies the vLLM calls
behind its hooks; `vllm_view.ManagerView` shows the manager's state as a
`Snapshot` keyed like the model's (prefix keys instead of vLLM's digests).

vLLM is imported lazily, by the first `VllmTarget` or `probe()`, never when
this module is imported. An exception vLLM raises inside an op propagates
unchanged (the replayer reports it as a divergence).

Beyond the `Target` protocol: `token_ids(req)`, `num_computed_tokens(req)`
and `manager` (the vLLM `KVCacheManager` itself), for tests and debugging.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType, SimpleNamespace
from typing import Any

from kvgate.conformance.config import Config, GroupConfig, UnsupportedConfig
from kvgate.conformance.driver import OpDriver
from kvgate.conformance.events import KvEvent
from kvgate.conformance.ops import STATS_KEYS
from kvgate.conformance.snapshot import Snapshot
from kvgate.conformance.target import Capabilities
from kvgate.conformance.tokens import key_position
from kvgate.impl import _vllm_api
from kvgate.impl._vllm_api import HOLD_ATTR, RETAIN_SWITCH, VllmApi
from kvgate.impl.vllm_view import ManagerView

__all__ = ["VllmTarget", "probe"]


class VllmTarget(OpDriver[Any]):
    """The installed vLLM's `KVCacheManager`, driven per the trace format.

    The op flow (pending lookups, refusals, token bookkeeping) is the shared
    `OpDriver`'s, as for the model; this class supplies the vLLM calls.
    """

    capabilities: Capabilities

    def __init__(self, config: Config, plugin: str | None = None) -> None:
        super().__init__(config)
        self.plugin = plugin
        # The switch must be in the environment before vLLM reads it: set it
        # before the (first) import, and drop vLLM's env cache after it.
        _vllm_api.set_retain_switch(config.hold, config.hold_retired)
        api = _vllm_api.load()
        _vllm_api.clear_env_cache()
        plugin_module = _vllm_api.register_plugin(plugin) if plugin else None
        api.init_none_hash(api.sha256)
        self._api: VllmApi = api

        manager = _build_manager(api, config)
        self._manager: Any = manager
        self._coordinator: Any = manager.coordinator
        self._pool: Any = manager.block_pool
        self._view = ManagerView(api, manager, config.hash_unit)
        self._managers: tuple[Any, ...] = self._view.managers
        self._group_ids: tuple[int, ...] = self._view.group_ids
        self._hasher: Any = api.get_request_block_hasher(config.hash_unit, api.sha256)

        partial = bool(getattr(self._coordinator, "enable_partial_hash_hits", False))
        # `self` for Scheduler._mamba_block_aligned_split: the attributes it reads.
        self._split_self = SimpleNamespace(
            block_size=config.scheduler_block_size,
            cache_config=SimpleNamespace(block_size=config.scheduler_block_size),
            hash_block_size=config.hash_unit,
            mamba_partial_cache_hit=partial and config.hash_unit < config.scheduler_block_size,
            use_eagle_block_drop=config.eagle,
            num_hash_lookahead_tokens=0,
            max_num_scheduled_tokens=config.max_num_scheduled_tokens,
            scheduler_config=SimpleNamespace(
                long_prefill_token_threshold=config.long_prefill_token_threshold
            ),
            mamba_has_prefill_checkpoint_blocks=config.prefill_checkpoints,
            mamba_prefill_checkpoint_alignment=config.prefill_checkpoint_alignment,
            mamba_shared_prefix_checkpoint=(
                partial
                and config.hash_unit < config.scheduler_block_size
                and bool(getattr(manager, "mamba_shared_prefix_checkpoint", False))
            ),
        )
        hold = _holds_partial_tails(api, self._managers, config.hold)
        self.capabilities = Capabilities(
            implementation=f"vllm {api.version}",
            partial_hits=partial,
            hold=hold,
            hold_source=_hold_source(self._managers, plugin, plugin_module) if hold else "",
            retire=_retains_retired(api, self._managers),
        )

    # ---------------------------------------------------------------- extras

    @property
    def manager(self) -> Any:
        """The vLLM `KVCacheManager` under test."""
        return self._manager

    def token_ids(self, req: str) -> list[int]:
        """Request `req`'s prompt and output so far."""
        return list(self.requests[req].request.all_token_ids)

    def num_computed_tokens(self, req: str) -> int:
        return int(self.requests[req].request.num_computed_tokens)

    @property
    def exclusions_applied(self) -> frozenset[str]:
        """The strict view's exclusions (`snapshot.EXCLUSIONS`) that hid raw
        state of this manager so far: named differences for the report."""
        return frozenset(self._view.exclusions_applied)

    def close(self) -> None:
        super().close()
        self._manager = self._coordinator = self._pool = None
        self._managers = ()
        self._view.close()

    # -------------------------------------------------------------- requests

    def new_request(self, name: str, tokens: list[int]) -> Any:
        request = self._api.Request(
            request_id=name,
            prompt_token_ids=tokens,
            sampling_params=self._api.SamplingParams(
                max_tokens=self.config.max_model_len,
                extra_args=(
                    {"kv_cache_report_mode": "full"} if self.config.kv_events_full else None
                ),
            ),
            pooling_params=None,
            block_hasher=self._hasher,
        )
        self._view.track(name, request)
        return request

    def prompt_tokens(self, request: Any) -> list[int]:
        return request.prompt_token_ids  # type: ignore[no-any-return]

    def all_tokens(self, request: Any) -> list[int]:
        # vLLM's read-only view: no copy of a long prompt per call.
        return request.all_token_ids  # type: ignore[no-any-return]

    def num_computed(self, request: Any) -> int:
        return int(request.num_computed_tokens)

    def set_num_computed(self, request: Any, n: int) -> None:
        request.num_computed_tokens = n

    def has_blocks(self, request: Any) -> bool:
        # `.get`: the tables are defaultdicts; a lookup must not create one.
        rid = request.request_id
        return any(m.req_to_blocks.get(rid) for m in self._managers)

    def append_output(self, request: Any, tokens: list[int]) -> None:
        request.append_output_token_ids(tokens)
        self._view.touched(request.request_id)

    def set_drafts(self, request: Any, tokens: list[int]) -> None:
        request.spec_token_ids = tokens

    def mark(self, request: Any, status: str) -> None:
        statuses = self._api.RequestStatus
        request.status = statuses.PREEMPTED if status == "preempted" else statuses.RUNNING
        if status == "preempted":
            request.num_preemptions += 1  # as Scheduler._preempt_request counts it

    # --------------------------------------------------------- manager calls

    def set_junction(self, request: Any, position: int) -> None:
        request.shared_prefix_boundary = position

    def lookup(self, request: Any) -> tuple[Any, int, int]:
        blocks, hit, junction = self._manager.get_computed_blocks(request)
        return blocks, int(hit), int(junction)

    def blocks_needed(self, request: Any, hit_blocks: Any, hit: int, admission: bool) -> int:
        if hit_blocks is None:
            hit_blocks = self._manager.empty_kv_cache_blocks
        n = min(request.num_tokens, self.config.max_model_len)
        computed = request.num_computed_tokens + hit
        return int(
            self._coordinator.get_num_blocks_to_allocate(
                request_id=request.request_id,
                num_tokens=n,
                new_computed_blocks=hit_blocks.blocks,
                num_encoder_tokens=0,
                total_computed_tokens=computed,
                num_local_computed_tokens=computed,
                num_tokens_main_model=n,
                apply_admission_cap=admission,
                prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1),
            )
        )

    def split(self, request: Any, num_new: int, hit: int) -> int:
        split = self._api.Scheduler._mamba_block_aligned_split
        return int(split(self._split_self, request, num_new, hit))

    def allocate_slots(
        self, request: Any, num_new: int, hit: int, hit_blocks: Any, lookahead: int
    ) -> bool:
        got = self._manager.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=hit,
            new_computed_blocks=hit_blocks,
            num_lookahead_tokens=lookahead,
        )
        return got is not None

    def free(self, request: Any) -> None:
        self._manager.free(request)

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        return list(self._manager.pop_blocks_for_free(request))

    def free_blocks(self, blocks: list[Any]) -> None:
        self._pool.free_blocks(blocks)

    def take_copies(self) -> tuple[list[list[int]], list[Any]]:
        copies, retained = self._manager.take_kv_cache_block_copies()
        return [[int(c.src_block_id), int(c.dst_block_id)] for c in copies], list(retained)

    def new_step_starts(self) -> None:
        self._manager.new_step_starts()

    def num_free_blocks(self) -> int:
        return int(self._pool.get_num_free_blocks())

    def evict(self, n: int) -> None:
        self._pool.free_blocks(self._pool.get_new_blocks(n))

    # ----------------------------------------------------------- observation

    def record_prefix_cache_stats(self, request: Any, hit: int) -> None:
        self._manager.record_prefix_cache_stats(request, hit)

    def make_prefix_cache_stats(self) -> dict[str, Any]:
        stats = self._manager.make_prefix_cache_stats()
        return {**{key: getattr(stats, key) for key in STATS_KEYS}, "usage": self._manager.usage}

    def reset_prefix_cache(self) -> bool:
        return bool(self._manager.reset_prefix_cache())

    def take_events(self) -> list[KvEvent]:
        api, view = self._api, self._view
        events: list[KvEvent] = []
        for event in self._manager.take_events():
            if isinstance(event, api.AllBlocksCleared):
                events.append(KvEvent("cleared"))
            elif isinstance(event, api.BlockRemoved):
                events.extend(
                    KvEvent("removed", int(event.group_idx), (view.prefix_key(h),))
                    for h in event.block_hashes
                )
            elif isinstance(event, api.BlockStored):
                parent = event.parent_block_hash
                parent_key = None if parent is None else view.prefix_key(parent)
                start = 0 if parent_key is None else key_position(parent_key)
                events.append(
                    KvEvent(
                        "stored",
                        int(event.group_idx),
                        tuple(view.prefix_key(h) for h in event.block_hashes),
                        parent_key,
                        start,
                        start + len(event.token_ids),
                        int(event.block_size),
                    )
                )
            else:
                raise RuntimeError(f"unknown KV-cache event {type(event).__name__}")
        return events

    def pool_clean(self) -> bool:
        pool = self._pool
        if pool.get_num_free_blocks() != len(pool.blocks) - 1:
            return False
        if any(b.ref_cnt for b in pool.blocks if not b.is_null):
            return False
        if self._view.holds() or self._view.pending_copies():
            return False
        if any(not b.is_null for blocks in self.popped.values() for b in blocks):
            return False
        return not any(
            not b.is_null
            for m in self._managers
            for blocks in m.req_to_blocks.values()
            for b in blocks
        )

    def hold_positions(self) -> dict[str, dict[int, int]]:
        return {
            req: {gid: pos for gid, (pos, _) in groups.items()}
            for req, groups in self._view.holds().items()
        }

    def state_ref(self, request: Any, group: int, position: int) -> int | None:
        # The block a lookup would hit there: vLLM's own hash map.
        unit = self.config.hash_unit
        hashes = request.block_hashes
        if position <= 0 or position % unit or position // unit > len(hashes):
            return None
        key = self._api.make_block_hash_with_group_id(hashes[position // unit - 1], group)
        block = self._pool.cached_block_hash_to_block.get_one_block(key)
        return None if block is None else int(block.ref_cnt)

    def attention_cached(self, request: Any) -> int:
        return self._view.attention_cached(request)

    def snapshot(self) -> Snapshot:
        return self._view.snapshot(self.popped)


# ---------------------------------------------------------------- helpers


def _group_spec(api: VllmApi, index: int, group: GroupConfig) -> Any:
    float32 = api.torch.float32
    if group.kind == "full_attention":
        return api.FullAttentionSpec(
            block_size=group.block_size, num_kv_heads=1, head_size=1, dtype=float32
        )
    if group.kind == "mamba_align":
        # The checkpoint fields only when set: a build without them still
        # runs every trace that leaves them off (and refuses the others).
        checkpoints: dict[str, Any] = {}
        if group.prefill_checkpoint_blocks:
            checkpoints["num_prefill_checkpoint_blocks"] = group.prefill_checkpoint_blocks
        if group.prefill_checkpoint_alignment is not None:
            checkpoints["prefill_checkpoint_alignment"] = group.prefill_checkpoint_alignment
        return api.MambaSpec(
            block_size=group.block_size,
            shapes=((1, 1),),
            dtypes=(float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=group.speculative_blocks,
            **checkpoints,
        )
    raise UnsupportedConfig(f"groups[{index}].kind", f"unknown group kind {group.kind!r}")


def kv_cache_config(api: VllmApi, config: Config) -> Any:
    """vLLM's `KVCacheConfig` for `config`: its pool, groups and retention."""
    groups = [
        api.KVCacheGroupSpec([f"layer{i}"], _group_spec(api, i, g))
        for i, g in enumerate(config.groups)
    ]
    return api.KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=config.retention_interval,
    )


def _build_manager(api: VllmApi, config: Config) -> Any:
    """A `KVCacheManager` for `config`, as the op semantics prescribe.

    Anything vLLM raises while building it becomes `UnsupportedConfig`.
    """
    try:
        return api.KVCacheManager(
            kv_cache_config(api, config),
            max_model_len=config.max_model_len,
            scheduler_block_size=config.scheduler_block_size,
            hash_block_size=config.hash_unit,
            enable_caching=True,
            use_eagle=config.eagle,
            log_stats=True,
            enable_kv_cache_events=config.kv_events,
            **(
                {"enable_mamba_shared_prefix_checkpoint": True}
                if config.shared_prefix_checkpoint
                else {}
            ),
        )
    except UnsupportedConfig:
        raise
    except Exception as exc:  # vLLM rejects with ValueError or a bare assert
        message = _describe(exc)
        raise UnsupportedConfig(_config_field(message), f"vLLM rejects it: {message}") from exc


def _describe(exc: BaseException) -> str:
    """One line: the exception, or for a bare assert the failing source line."""
    text = " ".join(str(exc).split())
    if not text:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            where = f"{os.path.basename(last.filename)}:{last.lineno}"
            text = f"at {where}: {' '.join((last.line or '').split())}"
    text = f"{type(exc).__name__} {text}".strip()
    return text if len(text) <= 240 else text[:237] + "..."


_FIELD_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"retention", "retention_interval"),
    (r"shared_prefix", "shared_prefix_checkpoint"),
    (r"scheduler_block_size", "scheduler_block_size"),
    (r"hash_block_size|hash", "hash_unit"),
    (r"num_gpu_blocks|num_blocks", "num_blocks"),
    (r"max_model_len", "max_model_len"),
    (r"eagle|speculative", "eagle"),
)


def _config_field(message: str) -> str:
    for pattern, name in _FIELD_PATTERNS:
        if re.search(pattern, message):
            return name
    return "groups"


def _is_mamba(api: VllmApi, manager: Any) -> bool:
    return isinstance(getattr(manager, "kv_cache_spec", None), api.MambaSpec)


def _holds_partial_tails(api: VllmApi, managers: Sequence[Any], switch: bool) -> bool:
    """Whether this build holds partial-tail checkpoints, switch included.

    Probed on the managers themselves: a Mamba manager carrying the hold map,
    with the build's own switch flag when it exposes one.
    """
    return any(
        hasattr(m, HOLD_ATTR) and bool(getattr(m, "_retain_checkpoint", switch))
        for m in managers
        if _is_mamba(api, m)
    )


def _retains_retired(api: VllmApi, managers: Sequence[Any]) -> bool:
    """Whether kvgate's overlay retains retired states on these managers."""
    return any(
        bool(getattr(m, _vllm_api.RETIRE_ATTR, False)) for m in managers if _is_mamba(api, m)
    )


def _hold_source(managers: Sequence[Any], plugin: str | None, module: ModuleType | None) -> str:
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
        return {"vllm": None, "error": _describe(exc)}
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
        manager = _build_manager(api, _PROBE_CONFIG)
        managers = tuple(manager.coordinator.single_type_managers)
        info["partial_hits"] = bool(getattr(manager.coordinator, "enable_partial_hash_hits", False))
        info["hold"] = _holds_partial_tails(api, managers, True)
    except Exception as exc:
        info["error"] = _describe(exc)
    finally:
        if previous is None:
            os.environ.pop(RETAIN_SWITCH, None)
        else:
            os.environ[RETAIN_SWITCH] = previous
        _vllm_api.clear_env_cache()
    return info
