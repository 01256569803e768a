"""The real vLLM `KVCacheManager` (v1, CPU) as a kvgate target.

`VllmTarget` drives the installed vLLM one manager call per primitive op, as
the op semantics of trace format version 1 define them. The op flow itself
(pending lookups, token bookkeeping, refusals, `prompt_done`) is the shared
`OpDriver`'s, exactly as for the model; this module supplies the vLLM calls
behind its hooks. Its neighbours do the rest, one job each: `vllm_build`
turns the trace's config into vLLM's objects, `vllm_errors` turns vLLM's
refusals into one-line errors, `vllm_probe` finds what the build offers, and
`vllm_view.ManagerView` shows the manager's state as a `Snapshot` keyed like
the model's (prefix keys instead of vLLM's digests).

vLLM is imported lazily, by the first `VllmTarget` or `probe()`, never when
this module is imported. An exception vLLM raises inside an op propagates
unchanged (the replayer reports it as a divergence).

Beyond the `Target` protocol: `token_ids(req)`, `num_computed_tokens(req)`
and `manager` (the vLLM `KVCacheManager` itself), for tests and debugging.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvgate.driver.op_driver import OpDriver
from kvgate.impl import _vllm_api
from kvgate.impl._vllm_api import VllmApi
from kvgate.impl.vllm_build import block_hasher, build_manager, request_inputs, split_context
from kvgate.impl.vllm_probe import hold_source, holds_partial_tails, retains_retired
from kvgate.impl.vllm_residency import take_evictions
from kvgate.impl.vllm_view import ManagerView
from kvgate.model.scope import check_modelled
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.events import KvEvent
from kvgate.vocabulary.ops import STATS_KEYS
from kvgate.vocabulary.residency import Eviction
from kvgate.vocabulary.snapshot import Snapshot, StepView
from kvgate.vocabulary.target import Capabilities
from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs

__all__ = ["VllmTarget"]


class VllmTarget(OpDriver[Any]):
    """The installed vLLM's `KVCacheManager`, driven per the trace format.

    The op flow (pending lookups, refusals, token bookkeeping) is the shared
    `OpDriver`'s, as for the model; this class supplies the vLLM calls.
    """

    capabilities: Capabilities

    def __init__(self, config: Config, plugin: str | None = None) -> None:
        super().__init__(config)
        self.plugin = plugin
        api, plugin_module = _vllm_api.load_with_hold(config.hold, config.retain_retired, plugin)
        self._api: VllmApi = api

        # What vLLM refuses is left to vLLM's own objects; of what it builds,
        # kvgate refuses by name what it does not model (as `validate` does).
        manager = build_manager(api, config)
        check_modelled(config)
        self.manager = manager
        self._coordinator: Any = manager.coordinator
        self._pool: Any = manager.block_pool
        self._view = ManagerView(api, manager, config.hash_unit, config.hash_lookahead_tokens)
        self.managers: tuple[Any, ...] = self._view.managers
        self._group_ids: tuple[int, ...] = self._view.group_ids
        self._hasher: Any = block_hasher(api, config)

        partial = bool(getattr(self._coordinator, "enable_partial_hash_hits", False))
        self._split_self = split_context(config, self._coordinator, manager)
        hold = holds_partial_tails(api, self.managers, config.hold)
        self.capabilities = Capabilities(
            implementation=f"vllm {api.version}",
            partial_hits=partial,
            hold=hold,
            hold_source=hold_source(self.managers, plugin, plugin_module) if hold else "",
            retain_retired=retains_retired(api, self.managers),
            release=api.version,
        )

    # ---------------------------------------------------------------- extras

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
        self.manager = self._coordinator = self._pool = None
        self.managers = ()
        self._view.close()

    # -------------------------------------------------------------- requests

    def new_request(
        self,
        name: str,
        tokens: list[int],
        skip_prefix_cache: bool = False,
        inputs: HashInputs = NO_INPUTS,
        copied: tuple[Any, int] | None = None,
    ) -> Any:
        # vLLM's request hashes its whole prompt itself: `copied` is not read.
        request = self._api.Request(
            request_id=name,
            prompt_token_ids=tokens,
            sampling_params=self._api.SamplingParams(
                max_tokens=self.config.max_model_len,
                # None: vLLM derives it (from prompt logprobs), as for a user's.
                skip_reading_prefix_cache=True if skip_prefix_cache else None,
                extra_args=(
                    {"kv_cache_report_mode": "full"} if self.config.kv_events_full else None
                ),
            ),
            pooling_params=None,
            block_hasher=self._hasher,
            # vLLM's own hasher folds them into the hashes from here on.
            **request_inputs(self._api, inputs),
        )
        self._view.track(name, request, inputs)
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

    def set_in_flight(self, request: Any, n: int) -> None:
        # A release without the attribute frees on the optimistic count.
        if hasattr(request, "num_in_flight_tokens"):
            request.num_in_flight_tokens = n

    def has_blocks(self, request: Any) -> bool:
        # `.get`: the tables are defaultdicts; a lookup must not create one.
        rid = request.request_id
        return any(m.req_to_blocks.get(rid) for m in self.managers)

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
        blocks, hit, junction = self.manager.get_computed_blocks(request)
        return blocks, int(hit), int(junction)

    def lookup_for_connector(self, request: Any) -> tuple[Any, int, int, bool]:
        blocks, hit, junction, diverged = self.manager.get_computed_blocks_for_connector(request)
        return blocks, int(hit), int(junction), bool(diverged)

    def blocks_needed(
        self, request: Any, hit_blocks: Any, hit: int, admission: bool, external: int = 0
    ) -> int:
        if hit_blocks is None:
            hit_blocks = self.manager.empty_kv_cache_blocks
        n = min(request.num_tokens, self.config.max_model_len)
        computed = request.num_computed_tokens + hit
        return int(
            self._coordinator.get_num_blocks_to_allocate(
                request_id=request.request_id,
                num_tokens=n,
                new_computed_blocks=hit_blocks.blocks,
                num_encoder_tokens=0,
                total_computed_tokens=computed + external,
                num_local_computed_tokens=computed,
                num_tokens_main_model=n,
                apply_admission_cap=admission,
                prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1),
            )
        )

    def split(self, request: Any, num_new: int, hit: int, external: int = 0) -> int:
        if not self.config.mamba_align_split:
            return num_new  # the Scheduler calls its split only in align mode
        split = self._api.Scheduler._mamba_block_aligned_split
        return int(split(self._split_self, request, num_new, hit, external))

    def take_boundary_offloads(self) -> list[list[Any]]:
        offloads = self.manager.take_boundary_state_offloads()
        return [
            [str(rid), int(group), int(block), int(tokens)]
            for rid, entries in offloads.items()
            for group, block, tokens in entries
        ]

    def finalize_partial_tail_offloads(self, request: Any) -> list[list[int]]:
        tails = self.manager.finalize_partial_tail_offloads(request)
        return [[int(group), int(block), int(tokens)] for group, block, tokens in tails]

    def take_copies(self) -> tuple[list[list[int]], list[Any]]:
        copies, retained = self.manager.take_kv_cache_block_copies()
        return [[int(c.src_block_id), int(c.dst_block_id)] for c in copies], list(retained)

    def num_free_blocks(self) -> int:
        return int(self._pool.get_num_free_blocks())

    # ----------------------------------------------------------- observation

    def record_prefix_cache_stats(self, request: Any, hit: int) -> None:
        self.manager.record_prefix_cache_stats(request, hit)

    def make_prefix_cache_stats(self) -> dict[str, Any]:
        stats = self.manager.make_prefix_cache_stats()
        if stats is None:  # log_stats off: the manager keeps none
            return {"usage": self.manager.usage}
        return {**{key: getattr(stats, key) for key in STATS_KEYS}, "usage": self.manager.usage}

    def reset_prefix_cache(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    def take_events(self) -> list[KvEvent]:
        return self._view.kv_events(self.manager.take_events())

    def take_evictions(self) -> list[Eviction]:
        return take_evictions(getattr(self.manager, "metrics_collector", None))

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
            for m in self.managers
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

    def forgotten(self, name: str) -> None:
        self._view.forget(name)

    def take_changed_blocks(self) -> set[int]:
        return self._view.take_changed_blocks()

    def step_view(self, blocks: Collection[int], requests: Collection[str]) -> StepView:
        return self._view.step_view(self.popped, blocks, requests)
