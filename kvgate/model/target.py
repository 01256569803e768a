"""The model as a replay target."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvgate.driver.op_driver import OpDriver
from kvgate.model.manager import KVCacheManager
from kvgate.model.pool import HashKey
from kvgate.model.request import Request
from kvgate.model.scope import MODELLED_VLLM
from kvgate.model.split import chunk_tokens
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.events import KvEvent
from kvgate.vocabulary.residency import Eviction
from kvgate.vocabulary.snapshot import (
    NULL_BLOCK,
    BlockView,
    Snapshot,
    StepView,
    kept_aside,
    null_view,
    table_ends,
    tail_length,
)
from kvgate.vocabulary.target import Capabilities
from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs


def hash_name(key: HashKey) -> str:
    return f"g{key[0]}/{key[1]}"


class ModelTarget(OpDriver[Request]):
    manager: KVCacheManager

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.manager = KVCacheManager(config)
        self.pool = self.manager.block_pool
        self._views = [BlockView(0)] * self.pool.num_blocks
        # The pool's changed blocks, as the two readers of them have yet to
        # see them: the whole view's cache, and the step views.
        self._stale_views: set[int] = set()
        self._step_changed: set[int] = set()
        # None for a pure Mamba model (no attention group caches anything).
        self.attention_group: int | None = next(
            (i for i, g in enumerate(config.groups) if g.kind == "full_attention"), None
        )
        hold = config.hold
        self.capabilities = Capabilities(
            implementation="kvgate model",
            partial_hits=config.partial_hits,
            hold=hold,
            hold_source="kvgate model" if hold else "",
            retain_retired=config.retain_retired,
            release=MODELLED_VLLM,
        )

    # -- requests -------------------------------------------------------------

    def new_request(
        self,
        name: str,
        tokens: list[int],
        skip_prefix_cache: bool = False,
        inputs: HashInputs = NO_INPUTS,
        copied: tuple[Request, int] | None = None,
    ) -> Request:
        # A long prompt copied from another request is mostly hashed already.
        known = [] if copied is None else copied[0].copied_keys(copied[1], inputs)
        request = Request(
            name,
            tokens,
            self.config.hash_unit,
            self.config.hash_lookahead_tokens,
            inputs,
            known,
            owned=True,
        )
        request.skip_reading_prefix_cache = skip_prefix_cache
        return request

    def prompt_tokens(self, request: Request) -> list[int]:
        return request.prompt

    def all_tokens(self, request: Request) -> list[int]:
        return request.all_token_ids

    def num_computed(self, request: Request) -> int:
        return request.num_computed_tokens

    def set_num_computed(self, request: Request, n: int) -> None:
        request.num_computed_tokens = n

    def set_in_flight(self, request: Request, n: int) -> None:
        request.num_in_flight_tokens = n

    def has_blocks(self, request: Request) -> bool:
        return any(m.tables.get(request.request_id) for m in self.manager.coordinator.managers)

    def append_output(self, request: Request, tokens: list[int]) -> None:
        request.append_output(tokens)

    def set_drafts(self, request: Request, tokens: list[int]) -> None:
        request.spec_token_ids = tokens

    def mark(self, request: Request, status: str) -> None:
        # No other status is kept: no watermark is modelled.
        if status == "preempted":
            request.num_preemptions += 1

    # -- manager calls ----------------------------------------------------------

    def set_junction(self, request: Request, position: int) -> None:
        request.shared_prefix_boundary = position

    def lookup(self, request: Request) -> tuple[Any, int, int]:
        return self.manager.get_computed_blocks(request)

    def lookup_for_connector(self, request: Request) -> tuple[Any, int, int, bool]:
        return self.manager.get_computed_blocks_for_connector(request)

    def blocks_needed(
        self, request: Request, hit_blocks: Any, hit: int, admission: bool, external: int = 0
    ) -> int:
        return self.manager.get_num_blocks_to_allocate(
            request, hit_blocks, hit, admission, external
        )

    def split(self, request: Request, num_new: int, hit: int, external: int = 0) -> int:
        # The split starts after every computed token, the connector's too.
        return chunk_tokens(self.config, request, num_new, hit + external)

    def take_boundary_offloads(self) -> list[list[Any]]:
        offloads = self.manager.take_boundary_state_offloads()
        return [[rid, *entry] for rid, entries in offloads.items() for entry in entries]

    def finalize_partial_tail_offloads(self, request: Request) -> list[list[int]]:
        return self.manager.finalize_partial_tail_offloads(request)

    def take_copies(self) -> tuple[list[list[int]], list[Any]]:
        copies, retained = self.manager.take_kv_cache_block_copies()
        return [[s, d] for _, s, d in copies], list(retained)

    def num_free_blocks(self) -> int:
        return self.pool.num_free()

    def record_prefix_cache_stats(self, request: Request, hit: int) -> None:
        self.manager.record_prefix_cache_stats(request, hit)

    def make_prefix_cache_stats(self) -> dict[str, Any]:
        return {**self.manager.make_prefix_cache_stats(), "usage": self.manager.usage}

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def take_events(self) -> list[KvEvent]:
        return self.pool.take_events()

    def take_evictions(self) -> list[Eviction]:
        residency = self.pool.residency
        return [] if residency is None else residency.drain()

    # -- observation ------------------------------------------------------------

    def pool_clean(self) -> bool:
        coordinator = self.manager.coordinator
        return (
            self.pool.num_free() == self.pool.num_blocks - 1
            and all(b.ref == 0 for b in self.pool.blocks[1:])
            and not any(any(t) for m in coordinator.managers for t in m.tables.values())
            and not any(m.pending_copies for m in coordinator.managers)
            and not any(coordinator.holds.by_group.values())
        )

    def hold_positions(self) -> dict[str, dict[int, int]]:
        holds = self.manager.coordinator.holds.as_positions()
        return {r: {g: pos for g, (pos, _) in hs.items()} for r, hs in holds.items()}

    def state_ref(self, request: Request, group: int, position: int) -> int | None:
        unit = self.config.hash_unit
        if position % unit or position // unit > len(request.keys):
            return None
        found = self.pool.cached_block(request.keys[position // unit - 1], [group])
        return found[0].ref if found else None

    def attention_cached(self, request: Request, num_tokens: int | None = None) -> int:
        """`num_tokens`: count only the keys the request's first `num_tokens`
        tokens complete (the Scheduler's view mid-step, before the tokens
        this step samples, which the model appends as it schedules)."""
        if self.attention_group is None:
            return 0
        attention = self.manager.coordinator.managers[self.attention_group]
        size = attention.block_size
        unit = self.config.hash_unit
        keyed = len(request.keys)
        if num_tokens is not None:
            keyed = min(keyed, max(0, (num_tokens - self.config.hash_lookahead_tokens) // unit))
        # Only blocks with a key (with lookahead hashes, the prompt's last
        # block may have none yet).
        usable = min(request.num_prompt_tokens, keyed * unit)
        scale = size // unit
        block_keys = request.keys[scale - 1 : usable // size * scale : scale]
        return len(self.pool.cached_prefix(block_keys, attention.group_id)) * size

    def _drain_changed(self) -> None:
        changed = self.pool.take_changed()
        self._stale_views |= changed
        self._step_changed |= changed

    def _block_view(self, block_id: int) -> BlockView:
        block = self.pool.blocks[block_id]
        primary = block.hash
        secondary = self.pool.secondary.get(block_id)
        if secondary:
            return BlockView(block.ref, tuple(map(hash_name, self.pool.keys_of(block))))
        return BlockView(block.ref, () if primary is None else (hash_name(primary),))

    def _block_views(self) -> tuple[BlockView, ...]:
        """Every block's view, re-reading only the blocks changed since the last."""
        self._drain_changed()
        for block_id in self._stale_views:
            self._views[block_id] = self._block_view(block_id)
        self._stale_views = set()
        return tuple(self._views)

    def take_changed_blocks(self) -> set[int]:
        self._drain_changed()
        changed, self._step_changed = self._step_changed, set()
        return changed

    def step_view(self, blocks: Collection[int], requests: Collection[str]) -> StepView:
        coordinator = self.manager.coordinator
        managers = coordinator.managers
        pool = self.pool
        reach = len(blocks) + 1
        keep = tail_length(len(blocks))
        tables = {}
        for rid in requests:
            ends = []
            for m in managers:
                table = m.tables.get(rid, [])
                ends.append((len(table), tuple([b.block_id for b in table[-keep:]])))
            tables[rid] = table_ends(ends)
        return StepView(
            blocks={
                i: null_view(self._block_view(i)) if i == NULL_BLOCK else self._block_view(i)
                for i in blocks
                if 0 <= i < pool.num_blocks
            },
            num_free=pool.num_free(),
            free_head=pool.free_queue.head(reach),
            free_tail=pool.free_queue.tail(reach),
            tables=tables,
            holds=coordinator.holds.as_positions(),
            pending_copies=tuple(
                (m.group_id, s.block_id, d.block_id) for m in managers for s, d in m.pending_copies
            ),
            popped={
                r: kept_aside(b.block_id for b in self.popped[r]) if r in self.popped else None
                for r in requests
            },
        )

    def snapshot(self) -> Snapshot:
        coordinator = self.manager.coordinator
        managers = coordinator.managers
        tables = {}
        for rid in {r for m in managers for r in m.tables}:
            per_group = tuple(tuple(b.block_id for b in m.tables.get(rid, [])) for m in managers)
            if any(per_group):
                tables[rid] = per_group
        return Snapshot(
            free_queue=tuple(self.pool.free_queue),
            blocks=self._block_views(),
            tables=tables,
            holds=coordinator.holds.as_positions(),
            pending_copies=tuple(
                (m.group_id, s.block_id, d.block_id) for m in managers for s, d in m.pending_copies
            ),
            popped={r: kept_aside(b.block_id for b in bs) for r, bs in self.popped.items()},
        )
