"""The coordinator: fans each manager call out to the groups, and finds the
prefix hit every group agrees on.

A hybrid hit is only as long as its shortest group: attention may have the
whole prefix cached while Mamba has no state at or below it, and then the
hit is 0 (the "total miss").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvgate.model.groups import FullAttentionManager, cdiv
from kvgate.model.hold import Holds
from kvgate.model.idle import NO_LIMIT, IdleWindow
from kvgate.model.mamba import MambaManager, MambaNoneManager
from kvgate.model.pool import Block, BlockPool
from kvgate.model.request import Request
from kvgate.vocabulary.config import Config, GroupConfig

GroupManagerT = FullAttentionManager | MambaManager
HitBlocks = tuple[list[Block], ...]


@dataclass
class _LookupGroup:
    """Groups looked up together: the attention group, or Mamba groups with
    equal specs (they share keys, so one lookup serves them all)."""

    group_ids: list[int]
    is_attention: bool
    use_eagle: bool


@lru_cache(maxsize=4096)  # read at every re-cache of every request
def replay_boundaries(num_prompt: int, scheduler_block: int, eagle: bool) -> tuple[int, ...]:
    """Where a later request replaying this prompt can resume: a resend stops
    one token short; with eagle, a sibling stops one block below the last
    whole block, and so does a resend."""
    if not eagle:
        return (num_prompt - 1,)
    resend = (num_prompt - 1) // scheduler_block * scheduler_block
    extension = num_prompt // scheduler_block * scheduler_block
    return tuple(sorted({max(resend - scheduler_block, 0), max(extension - scheduler_block, 0)}))


class Coordinator:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.pool = BlockPool(
            config.num_blocks,
            config.hash_unit,
            events=config.kv_events,
            residency=config.kv_cache_metrics,
            caching=config.prefix_caching,
        )
        # Without prefix caching no state is keyed, so nothing can be held.
        caching = config.prefix_caching
        self.holds = Holds(self.pool, config.hold and caching, config.retain_retired and caching)
        self.scheduler_block = config.scheduler_block_size
        self.managers: list[GroupManagerT] = []
        for group_id, group in enumerate(config.groups):
            if group.kind == "full_attention":
                self.managers.append(FullAttentionManager(self.pool, group_id, group.block_size))
            else:
                mamba_class = (
                    MambaNoneManager if config.mamba_cache_mode == "none" else MambaManager
                )
                mamba = mamba_class(
                    self.pool,
                    group_id,
                    group.block_size,
                    group.speculative_blocks,
                    self.holds,
                    group.prefill_checkpoint_blocks,
                    group.prefill_checkpoint_alignment,
                )
                mamba.drop_eagle_checkpoint = config.block_drop
                mamba.hash_lookahead = config.hash_lookahead_tokens
                mamba.shared_prefix_checkpoint = config.shared_prefix_checkpoint_on
                self.managers.append(mamba)
        self.partial_hits = config.partial_hits
        # Read on every step: derived from the (frozen) config once.
        self.block_drop = config.block_drop
        self.reprefillable_tokens = config.reprefillable_tokens
        self.caching = config.prefix_caching
        self.retention_interval = config.retention_interval
        self.single_group = len(config.groups) == 1
        self.mambas = [m for m in self.managers if isinstance(m, MambaManager)]
        # Full attention keeps every block until the request ends: only the
        # Mamba groups free skipped blocks.
        self.releasing: list[GroupManagerT] = list(self.mambas)
        self.alignment = config.hash_unit if self.partial_hits else self.scheduler_block
        # Running requests' idle windows (see `idle.py`), and whether a
        # prompt tail's keying can change with the pool's dropped keys.
        self.idle_windows: dict[str, IdleWindow] = {}
        self.tails_follow_dropped_keys = any(
            isinstance(m, FullAttentionManager) and m.block_size != config.hash_unit
            for m in self.managers
        )
        lookup_groups: list[_LookupGroup] = []
        specs: dict[GroupConfig, _LookupGroup] = {}
        # Only the drafter's groups drop (its attention layers' groups; all
        # groups when none holds one); lookahead hashes prove the boundary
        # token, so then none drops.
        drop_group_ids = set(config.drop_group_ids)
        for group_id, group in enumerate(config.groups):
            self.managers[group_id].alignment = self.alignment
            spec = group  # equal specs (every field) share one lookup
            if spec in specs:
                # One lookup for the spec: it drops if any member does.
                specs[spec].group_ids.append(group_id)
                specs[spec].use_eagle |= group_id in drop_group_ids
            else:
                specs[spec] = _LookupGroup(
                    [group_id], group.kind == "full_attention", group_id in drop_group_ids
                )
                lookup_groups.append(specs[spec])
        # Each group caches as its lookup group drops (any member's drop).
        for lookup in lookup_groups:
            for group_id in lookup.group_ids:
                self.managers[group_id].use_eagle = lookup.use_eagle
        # Attention first: its left-to-right scan bounds the others.
        self.lookup_groups = sorted(lookup_groups, key=lambda g: not g.is_attention)

    # -- lookup -------------------------------------------------------------

    def find_hit(self, keys: Sequence[str], max_length: int) -> tuple[HitBlocks, int, int]:
        """The longest prefix every group has: shrink the candidate length
        until no group lowers it (one pass for attention plus one Mamba spec).

        Also the shared-prefix junction: the longest length any lookup group
        reached on its turn (attention's, in practice: it goes first and the
        others only shrink the candidate), when it exceeds the agreed hit;
        else 0. A prefix attention has cached and Mamba has no state for is
        where a sibling could resume if that state were kept.
        """
        unit = self.config.hash_unit
        hit_length = max_length
        longest = 0
        blocks_by_group: list[list[Block] | None] = [None] * len(self.managers)
        length_by_group = [0] * len(self.managers)
        simple = len(self.lookup_groups) == 2 and self.lookup_groups[0].is_attention
        eagle_verified: set[int] = set()
        while True:
            current = hit_length
            for index, group in enumerate(self.lookup_groups):
                first = group.group_ids[0]
                manager = self.managers[first]
                if group.is_attention and blocks_by_group[first] is not None:
                    # Attention hits are downward closed: trim, don't re-look.
                    current = min(current, length_by_group[first])
                    continue
                drop_eagle = group.use_eagle and index not in eagle_verified
                if isinstance(manager, FullAttentionManager):
                    limit = current
                    if drop_eagle:
                        # Match one drop unit past the candidate, then drop it.
                        size = manager.block_size
                        margin = unit if self.partial_hits and size > unit else size
                        limit = min(current + margin, len(keys) * unit)
                    found, new_length = manager.find_hit(keys, limit, drop_eagle)
                    per_group = [found]
                else:
                    per_group, new_length = manager.find_hit(keys, current, group.group_ids)
                if drop_eagle:
                    eagle_verified.add(index)
                elif new_length < current:
                    eagle_verified.clear()
                current = new_length
                for group_id, found_blocks in zip(group.group_ids, per_group, strict=True):
                    blocks_by_group[group_id] = found_blocks
                    length_by_group[group_id] = new_length
                longest = max(longest, current)
            if current >= hit_length:
                break
            hit_length = current
            if simple:
                break
        for group in self.lookup_groups:
            if group.is_attention:
                size = self.managers[group.group_ids[0]].block_size
                for group_id in group.group_ids:
                    trimmed = blocks_by_group[group_id]
                    if trimmed is not None:
                        del trimmed[cdiv(hit_length, size) :]
        junction = longest if longest > hit_length else 0
        return tuple(b if b is not None else [] for b in blocks_by_group), hit_length, junction

    def find_hit_per_group(
        self, keys: Sequence[str], max_length: int
    ) -> tuple[HitBlocks, tuple[int, ...]]:
        """Each lookup group's own longest hit, none shortening another's
        candidate (what a KV connector's per-group local lookup reads)."""
        unit = self.config.hash_unit
        blocks_by_group: list[list[Block]] = [[] for _ in self.managers]
        length_by_group = [0] * len(self.managers)
        for group in self.lookup_groups:
            manager = self.managers[group.group_ids[0]]
            if isinstance(manager, FullAttentionManager):
                limit = max_length
                if group.use_eagle:
                    size = manager.block_size
                    margin = unit if self.partial_hits and size > unit else size
                    limit = min(max_length + margin, len(keys) * unit)
                found, length = manager.find_hit(keys, limit, group.use_eagle)
                per_group = [found]
            else:
                per_group, length = manager.find_hit(keys, max_length, group.group_ids)
            for group_id, found_blocks in zip(group.group_ids, per_group, strict=True):
                blocks_by_group[group_id] = found_blocks
                length_by_group[group_id] = length
        return tuple(blocks_by_group), tuple(length_by_group)

    def truncate_hit(self, hit_blocks: HitBlocks, num_tokens: int) -> HitBlocks:
        """A hit's blocks cut at `num_tokens` (a multiple of every group's
        block); a Mamba group's hit may already end below it. No ref changes."""
        truncated: list[list[Block]] = []
        for manager, blocks in zip(self.managers, hit_blocks, strict=True):
            assert num_tokens % manager.block_size == 0
            count = num_tokens // manager.block_size
            if isinstance(manager, MambaManager):
                count = min(count, len(blocks))
            else:
                assert count <= len(blocks)
            truncated.append(list(blocks[:count]))
        return tuple(truncated)

    # -- allocation ---------------------------------------------------------

    def blocks_needed(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: HitBlocks,
        num_local_computed: int,
        num_tokens_main: int,
        admission: bool,
        prefill_end: int = 0,
        total_computed: int | None = None,
    ) -> int:
        """Blocks the groups need; `prefill_end` is where the request's
        prefill ends, which only sparse retention (0) reads: a prefill
        checkpoint is then taken only on the chunk reaching it.
        `total_computed`: the computed prefix with a connector's tokens
        (default: the local one), where a Mamba step's query starts."""
        if total_computed is None:
            total_computed = num_local_computed
        total = 0
        prefill_end = self._checkpoint_prefill_end(prefill_end)
        for manager, hit in zip(self.managers, hit_blocks, strict=True):
            if isinstance(manager, MambaManager):
                total += manager.blocks_needed(
                    request_id,
                    num_tokens if manager.counts_draft_slots else num_tokens_main,
                    hit,
                    num_local_computed,
                    total_computed,
                    prefill_end,
                    not admission,  # the per-step count records this step's checkpoint
                )
                if admission:
                    total += self.holds.admission_extra(
                        manager.group_id,
                        request_id,
                        partial_hit=manager.has_partial_hit(hit, num_local_computed),
                        num_tokens=num_tokens_main,
                        block_size=manager.block_size,
                        hit_has_block=any(not b.is_null for b in hit),
                        more_partial_states=(
                            manager.has_prefill_checkpoints or manager.shared_prefix_checkpoint
                        ),
                    )
            else:
                total += manager.blocks_needed(request_id, num_tokens, hit, num_local_computed)
        return total

    def _checkpoint_prefill_end(self, prefill_end: int) -> int:
        # Only sparse retention (interval 0) keeps prefill checkpoints to the
        # chunk reaching the prefill's end; otherwise any chunk may take one.
        return 0 if self.retention_interval != 0 else prefill_end

    def add_hit_blocks(
        self,
        request_id: str,
        hit_blocks: HitBlocks,
        num_local: int,
        num_external: int = 0,
        skip_zeroing: Sequence[int] = (),
    ) -> None:
        """Adopt the hit in every group, then (a KV connector's tokens) give
        every group its blocks for the external tokens, zeroed unless the
        group is in `skip_zeroing` (an async load writes them)."""
        if any(request_id in m.num_cached for m in self.managers):
            return  # a running request takes no new hit
        self.idle_windows.pop(request_id, None)
        for manager, hit in zip(self.managers, hit_blocks, strict=True):
            manager.add_hit_blocks(request_id, hit, num_local, num_external)
        if num_external > 0:
            for manager in self.managers:
                manager.allocate_external(
                    request_id, num_local, num_external, manager.group_id not in skip_zeroing
                )

    def allocate(self, request_id: str, num_tokens: int, num_tokens_main: int) -> None:
        self.idle_windows.pop(request_id, None)
        for manager in self.managers:
            manager.allocate(request_id, num_tokens, num_tokens_main)

    def remove_skipped(self, request_id: str, num_processed: int) -> None:
        for manager in self.releasing:
            manager.remove_skipped(request_id, num_processed)

    def cache_targets(self, request: Request, num_computed: int) -> list[int]:
        """How far each group keys the request when `num_computed` of its
        tokens are computed."""
        if self.single_group:
            # A single group (vLLM's unitary coordinator) keys only finalized
            # tokens: a multi-module MTP drafter may prefill its last K - 1
            # again. (The hybrid coordinator subtracts them only where the
            # drop acts, which lookahead hashes of K > 1 turn off.)
            num_computed = max(0, num_computed - self.reprefillable_tokens)
        cacheable = num_computed  # aligned to the scheduler's block, without partial hits
        if not self.partial_hits:
            cacheable = num_computed // self.scheduler_block * self.scheduler_block
        targets = []
        for manager in self.managers:
            num_tokens = cacheable
            if manager.use_eagle and cacheable > 0:
                # Eagle matches one block past the aligned boundary, then drops it.
                num_tokens = min(num_computed, cacheable + manager.block_size)
            targets.append(num_tokens)
        return targets

    def cache(self, request: Request, num_computed: int) -> None:
        if not self.caching:
            return  # vLLM's manager skips caching altogether
        window = self.idle_windows.get(request.request_id)
        if window is not None and window.covers_keying(
            num_computed, request.keys_rewritten, self.pool.keys_dropped
        ):
            return
        boundaries: tuple[int, ...] | None = None
        for manager, num_tokens in zip(
            self.managers, self.cache_targets(request, num_computed), strict=True
        ):
            if manager.nothing_to_key(request, num_tokens):
                continue
            if boundaries is None:
                self.idle_windows.pop(request.request_id, None)
                boundaries = replay_boundaries(
                    len(request.prompt), self.scheduler_block, self.block_drop
                )
            manager.cache(request, num_tokens, self.retention_interval, boundaries)

    def in_idle_window(
        self,
        request: Request,
        num_processed: int,
        num_slots: int,
        num_tokens_main: int,
        num_keyed: int,
    ) -> bool:
        """Whether the request's idle window (see `idle.py`) covers a step
        to these counts (`allocate_slots`'s); a window it no longer covers
        is dropped."""
        window = self.idle_windows.get(request.request_id)
        if window is None:
            return False
        if window.covers(
            num_processed,
            num_slots,
            num_tokens_main,
            num_keyed,
            request.keys_rewritten,
            self.pool.keys_dropped,
        ):
            return True
        del self.idle_windows[request.request_id]
        return False

    def step_is_idle(
        self,
        request: Request,
        num_processed: int,
        num_slots: int,
        num_tokens_main: int,
        query_start: int,
        prefill_end: int,
        num_keyed: int,
    ) -> bool:
        """Whether a step of the running request that adopts no hit changes
        nothing: no group adds, frees or keys a block (most decodes), each
        group checking in full. The counts are `allocate_slots`'s:
        `remove_skipped`'s, `blocks_needed`'s and `cache`'s. An idle step
        opens a window (`in_idle_window`) later steps are checked against
        first."""
        prefill_end = self._checkpoint_prefill_end(prefill_end)
        for manager in self.managers:
            if not manager.idle_step(
                request, num_processed, num_slots, num_tokens_main, query_start, prefill_end
            ):
                return False
        targets = (
            self.cache_targets(request, num_keyed)
            if self.caching
            else [NO_LIMIT] * len(self.managers)  # nothing is ever keyed
        )
        if self.caching and not all(
            manager.nothing_to_key(request, num_tokens)
            for manager, num_tokens in zip(self.managers, targets, strict=True)
        ):
            return False
        self._open_idle_window(request, num_keyed, targets)
        return True

    def _open_idle_window(self, request: Request, num_keyed: int, targets: list[int]) -> None:
        """The window an idle step opens, if every group can bound it. A
        group keys no further than the request's computed tokens, so a
        bound on its keying target bounds `num_keyed` too."""
        limits = []
        for manager, num_target in zip(self.managers, targets, strict=True):
            found = manager.idle_limits(request, num_target)
            if found is None:
                return
            limits.append(found)
        max_processed, max_slots, max_main, max_keyed = (
            min(column) for column in zip(*limits, strict=True)
        )
        self.idle_windows[request.request_id] = IdleWindow(
            max_processed,
            max_slots,
            max_main,
            num_keyed,
            max_keyed if self.caching else NO_LIMIT,
            request.keys_rewritten,
            self.pool.keys_dropped if self.tails_follow_dropped_keys else None,
        )

    # -- ending a request ---------------------------------------------------

    def free(self, request_id: str) -> None:
        self.idle_windows.pop(request_id, None)
        for manager in self.managers:
            manager.free(request_id)
        # Holds go last, so the held state is the last of the request's
        # blocks to be evicted.
        self.pool.free_blocks(self.holds.release(request_id))

    def pop_blocks(self, request_id: str) -> list[Block]:
        """The request's blocks for a deferred free, in allocation order.

        Holds come first: the caller frees in reverse order, so they are
        released last, as on every other free path.
        """
        self.idle_windows.pop(request_id, None)
        blocks = self.holds.release(request_id)
        for manager in self.managers:
            blocks.extend(manager.pop_blocks(request_id))
        return blocks

    def take_pending_copies(self) -> list[tuple[int, Block, Block]]:
        copies: list[tuple[int, Block, Block]] = []
        for manager in self.managers:
            copies.extend((manager.group_id, s, d) for s, d in manager.take_pending_copies())
        return copies

    def take_boundary_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Each request's drained hand-offs as (group, block id, tokens)."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self.mambas:
            for rid, group_id, block, tokens in manager.take_offloads():
                offloads.setdefault(rid, []).append((group_id, block.block_id, tokens))
        return offloads

    def finalize_partial_tails(self, request_id: str, num_computed: int) -> list[list[int]]:
        tails: list[list[int]] = []
        for manager in self.mambas:
            tail = manager.finalize_partial_tail(request_id, num_computed)
            if tail is not None:
                tails.append([manager.group_id, *tail])
        return tails

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """The groups whose new blocks the worker zeroes (attention) queue
        the request's blocks from `start_token` (block-aligned) on again."""
        for manager in self.managers:
            if isinstance(manager, FullAttentionManager):
                assert start_token % manager.block_size == 0
                table = manager.tables.get(request_id, [])
                manager.record_new_blocks(table[start_token // manager.block_size :])

    def take_new_block_ids(self) -> list[int]:
        ids: list[int] = []
        for manager in self.managers:
            if isinstance(manager, FullAttentionManager):
                ids.extend(manager.take_new_block_ids())
        return ids

    def estimate_cached_tokens(self, request_id: str) -> int:
        """The shortest, over the groups, of the longest prefix a block of the
        request's table is keyed at."""
        cached: int | None = None
        for manager in self.managers:
            table = manager.tables.get(request_id, [])
            longest = max((b.hash_tokens or 0 for b in table), default=0)
            cached = longest if cached is None else min(cached, longest)
        return cached or 0

    def computed_block_ids(self, request_id: str, num_computed: int) -> list[list[int]]:
        """Per group, the table's block ids covering `num_computed` tokens:
        attention cut to them, a Mamba table whole."""
        ids: list[list[int]] = []
        for manager in self.managers:
            table = [b.block_id for b in manager.tables.get(request_id, [])]
            if isinstance(manager, FullAttentionManager):
                table = table[: cdiv(num_computed, manager.block_size)]
            ids.append(table)
        return ids

    def new_step(self) -> None:
        for manager in self.managers:
            manager.new_step()
