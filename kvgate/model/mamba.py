"""The align-mode Mamba group.

A Mamba request needs only its latest state, so its table is mostly null: a
running state block, `speculative_blocks` scratch blocks for drafts, and for
one step the block the previous state is copied from. States are keyed at
block boundaries (all of them under dense retention; under sparse retention
only the replay boundaries), plus the prompt's partial-tail boundary when the
hash unit is finer than the block.

The partial tail lives on the request's running block, which the next chunk
overwrites; so that chunk moves the tail's keys to a fresh block and queues a
copy into it (the "moved tail"). Upstream releases that block once the copy
has run, leaving the request's only reusable state in the free queue; with
the hold switch on the request holds it (see `hold.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.model.groups import GroupManager, cdiv, num_evictable
from kvgate.model.hold import Holds
from kvgate.model.idle import NO_LIMIT
from kvgate.model.pool import Block, BlockPool, HashKey
from kvgate.model.request import Request


def checkpoint_position(
    num_tokens: int, unit: int, drop_eagle: bool, hash_lookahead: int = 0
) -> int:
    """The last reusable state boundary of a prefill of `num_tokens`.

    One token is left for the logits; eagle's dropped unit already leaves it.
    With lookahead hashes the boundary also needs its L tokens after it (its
    key covers them), which leave the logits' token too.
    """
    limit = num_tokens if drop_eagle else num_tokens - max(1, hash_lookahead)
    position = limit // unit * unit
    if drop_eagle:
        position -= unit
    return max(position, 0)


def prefill_checkpoint_valid(
    query_start: int,
    query_end: int,
    position: int,
    unit: int,
    block_size: int,
    alignment: int | None,
) -> bool:
    """Whether a backend can export the state at `position` from inside the
    query [query_start, query_end) into a prefill checkpoint block.

    The checkpoint column (the block before the query's last) must lie past
    the column the query starts from, the position strictly inside the query
    at least a unit past its start, on the backend's grid (`alignment`).
    """
    if alignment is None:
        return False
    start_column = (query_start - 1) // block_size
    checkpoint_column = cdiv(query_end, block_size) - 2
    return (
        query_start % unit == 0
        and checkpoint_column > start_column
        and query_start + unit <= position
        and query_start < position < query_end
        and (position - query_start) % alignment == 0
    )


class MambaManager(GroupManager):
    # Align mode counts only the main model's tokens: drafts get no states.
    counts_draft_slots = False

    def __init__(
        self,
        pool: BlockPool,
        group_id: int,
        block_size: int,
        speculative_blocks: int,
        holds: Holds,
        prefill_checkpoint_blocks: int = 0,
        prefill_checkpoint_alignment: int | None = None,
    ) -> None:
        super().__init__(pool, group_id, block_size)
        self.speculative_blocks = speculative_blocks
        # Prefill checkpoint blocks: one spare column per step, before the
        # running one, that the backend exports a prefill's reusable state
        # into from inside the chunk (their number beyond one only sizes
        # memory). request id -> (checkpoint position, column) this step.
        self.has_prefill_checkpoints = prefill_checkpoint_blocks > 0
        self.prefill_checkpoint_alignment = prefill_checkpoint_alignment
        self.checkpoints: dict[str, tuple[int, int]] = {}
        # `enable_mamba_shared_prefix_checkpoint`, as the manager narrows it.
        self.shared_prefix_checkpoint = False
        self.drop_eagle_checkpoint = False
        self.hash_lookahead = 0  # the config's hash_lookahead_tokens
        self.holds = holds
        self.cached_this_step: set[HashKey] = set()
        self.last_state_index: dict[str, int] = {}
        self.num_retired: dict[str, int] = {}
        self.allocated: set[str] = set()  # requests past their first allocation
        # Boundary-state hand-offs the scheduler drains every step (for a KV
        # connector): (request, group, block, tokens) per state keyed, and
        # the request whose partial tail sits on its running block, with the
        # tail's position (its copy is handed off once made).
        self.pending_offloads: list[tuple[str, int, Block, int]] = []
        self.producer_tails: dict[str, tuple[Block, int]] = {}

    # -- lookup -------------------------------------------------------------

    def find_hit(
        self, keys: Sequence[str], max_length: int, group_ids: Sequence[int]
    ) -> tuple[list[list[Block]], int]:
        """The newest cached state at or below `max_length` (right to left).

        Returns per group in `group_ids` the hit as a table: nulls, then the
        state block.
        """
        unit, size, alignment = self.pool.hash_unit, self.block_size, self.alignment
        scale = size // unit
        if alignment < size and size % alignment == 0:
            # Most boundaries hold no state: skip those the first group lacks
            # without building the hit.
            cached, first_group = self.pool.cached, group_ids[0]
            for fine_index in range(min(max_length // unit, len(keys)) - 1, -1, -1):
                if (first_group, keys[fine_index]) not in cached:
                    continue
                found = self.pool.cached_block(keys[fine_index], group_ids)
                if found:
                    index = fine_index // scale
                    return [[self.pool.null_block] * index + [b] for b in found], (
                        fine_index + 1
                    ) * unit
            return [[] for _ in group_ids], 0
        for i in range(max_length // size - 1, -1, -1):
            if (i + 1) * scale > len(keys):
                continue
            found = self.pool.cached_block(keys[(i + 1) * scale - 1], group_ids)
            if not found:
                continue
            if size != alignment and (i + 1) * size % alignment != 0:
                continue
            return [[self.pool.null_block] * i + [b] for b in found], (i + 1) * size
        return [[] for _ in group_ids], 0

    # -- admission and allocation ----------------------------------------------

    def skipped_tokens(self, num_computed: int) -> int:
        return num_computed - 1  # only the latest state matters

    def needs_internal_checkpoint(
        self, request_id: str, query_start: int, query_end: int, position: int, prefill_end: int
    ) -> bool:
        """This step exports a prefill checkpoint into a spare column: the
        query reaches the prefill end (any chunk when `prefill_end` is 0), the
        backend can export there, and the column holds no state of its own."""
        column = cdiv(query_end, self.block_size) - 2
        table = self.table(request_id)
        return (
            self.has_prefill_checkpoints
            and query_end >= prefill_end
            and prefill_checkpoint_valid(
                query_start,
                query_end,
                position,
                self.pool.hash_unit,
                self.block_size,
                self.prefill_checkpoint_alignment,
            )
            and column >= 0
            and (
                column >= len(table)
                or table[column].is_null
                or (request_id in self.allocated and column >= len(table) - self.speculative_blocks)
            )
        )

    def step_checkpoint(
        self, request_id: str, num_tokens_main: int, query_start: int, prefill_end: int
    ) -> int:
        """Where this step exports a prefill checkpoint (0: none)."""
        if not self.has_prefill_checkpoints:
            return 0
        position = checkpoint_position(
            num_tokens_main, self.alignment, self.drop_eagle_checkpoint, self.hash_lookahead
        )
        if not self.needs_internal_checkpoint(
            request_id, query_start, num_tokens_main, position, prefill_end
        ):
            return 0
        return position

    def idle_step(
        self,
        request: Request,
        num_processed: int,
        num_slots: int,
        num_tokens_main: int,
        query_start: int,
        prefill_end: int,
    ) -> bool:
        rid = request.request_id
        if rid not in self.allocated or rid in self.partial_hits or rid in self.checkpoints:
            return False
        table = self.tables[rid]
        size = self.block_size
        # `remove_skipped` frees nothing: no state newly below the latest,
        # and the block the previous step copied from already released.
        if num_processed > 1 and self.num_retired.get(rid, 0) < min(
            (num_processed - 1) // size, len(table)
        ):
            return False
        previous = self.last_state_index.get(rid)
        if (
            previous is not None
            and previous < cdiv(num_processed, size) - 1
            and not table[previous].is_null
        ):
            return False
        # Neither the count nor the allocation adds a block, and no
        # prefill checkpoint is taken.
        counted = num_slots if self.counts_draft_slots else num_tokens_main
        if cdiv(max(counted, num_tokens_main), size) + self.speculative_blocks > len(table):
            return False
        return self.step_checkpoint(rid, counted, query_start, prefill_end) == 0

    def idle_limits(self, request: Request, num_target: int) -> tuple[int, int, int, int] | None:
        if self.has_prefill_checkpoints or num_target <= request.num_prompt_tokens:
            return None  # a checkpoint or the prompt's tail may come at any count
        rid = request.request_id
        table = self.tables[rid]
        size = self.block_size
        # Nothing newly below the latest state, nor past the block copied from.
        max_processed = (self.num_retired.get(rid, 0) + 1) * size
        previous = self.last_state_index.get(rid)
        if previous is not None and not table[previous].is_null:
            max_processed = min(max_processed, (previous + 1) * size)
        max_counted = (len(table) - self.speculative_blocks) * size
        max_slots = max_counted if self.counts_draft_slots else NO_LIMIT
        max_keyed = (self.num_cached.get(rid, 0) + 1) * size - 1
        return max_processed, max_slots, max_counted, max_keyed

    def nothing_to_key(self, request: Request, num_tokens: int) -> bool:
        # Most decodes: no block filled, no checkpoint this step and no
        # prompt tail or junction reached (what `cache_full` and
        # `_cache_prompt_tail` would find, found without them).
        rid = request.request_id
        if rid not in self.tables or rid in self.checkpoints:
            return False
        num_full = min(num_tokens, len(request.keys) * self.pool.hash_unit) // self.block_size
        if self.num_cached.get(rid, 0) < num_full:
            return False
        return not self._prompt_tail_due(request, num_tokens)

    def _prompt_tail_due(self, request: Request, num_tokens: int) -> bool:
        """Whether keying to `num_tokens` reaches the prompt's partial-tail
        boundary (or, with the knob, the shared-prefix junction)."""
        unit = self.pool.hash_unit
        if num_tokens <= 0 or num_tokens % unit or num_tokens > request.num_prompt_tokens:
            return False  # both lie on the hash grid, within the prompt
        tail = checkpoint_position(
            request.num_prompt_tokens, unit, self.drop_eagle_checkpoint, self.hash_lookahead
        )
        junction = request.shared_prefix_boundary
        at_junction = (
            self.shared_prefix_checkpoint
            and num_tokens == junction
            and request.num_computed_tokens < num_tokens
        )
        return num_tokens == tail or at_junction

    def blocks_needed(
        self,
        request_id: str,
        num_tokens_main: int,
        hit_blocks: Sequence[Block],
        num_local_computed: int,
        query_start: int = 0,
        prefill_end: int = 0,
        record: bool = False,
    ) -> int:
        if hit_blocks and hit_blocks[-1].hash in self.cached_this_step:
            # A state keyed this step is filled by this step's forward: defer
            # the request by asking for more than the pool has.
            return self.pool.num_blocks + 1
        # Draft tokens need no Mamba slots: only the main model's tokens count.
        required = cdiv(num_tokens_main, self.block_size) + self.speculative_blocks
        num_new = required - len(hit_blocks) - len(self.tables.setdefault(request_id, []))
        partial = request_id in self.partial_hits or (
            len(hit_blocks) > 0 and self.has_partial_hit(hit_blocks, num_local_computed)
        )
        if partial:
            num_new = max(num_new, 0) + 1
        position = self.step_checkpoint(request_id, num_tokens_main, query_start, prefill_end)
        if record:
            # The per-step count decides this step's checkpoint; allocation
            # and keying read it.
            if position > 0:
                column = cdiv(num_tokens_main, self.block_size) - 2
                self.checkpoints[request_id] = (position, column)
            else:
                self.checkpoints.pop(request_id, None)
        if num_new > 0:
            cap = 1 + int(partial) + int(position > 0)
            if request_id not in self.allocated:
                cap += self.speculative_blocks
            num_new = min(num_new, cap)
        return num_new + num_evictable(hit_blocks) if hit_blocks else num_new

    def allocate(self, request_id: str, num_tokens: int, num_tokens_main: int) -> list[Block]:
        table = self.tables.setdefault(request_id, [])
        required = cdiv(num_tokens_main, self.block_size) + self.speculative_blocks
        partial = self.partial_hits.get(request_id)
        checkpoint = int(request_id in self.checkpoints)
        if required <= len(table) and partial is None and not checkpoint:
            self.allocated.add(request_id)
            return []
        prev_len = len(table)
        running = request_id in self.allocated
        # The state to copy from this step: the running block (the last
        # before the scratch blocks), or a new request's hit state.
        if running:
            self.last_state_index[request_id] = prev_len - 1 - self.speculative_blocks
        elif prev_len > 0:
            self.last_state_index[request_id] = prev_len - 1
        num_skipped = required - self.speculative_blocks - 1
        # A checkpoint step keeps the column before the running one for the
        # exported state: not nulled, and a scratch block there stays.
        if prev_len < num_skipped:
            table.extend([self.pool.null_block] * (num_skipped - checkpoint - prev_len))
        if running:
            # Scratch blocks the table moves past are reused at its new end.
            for index in range(prev_len - self.speculative_blocks, prev_len):
                if index >= num_skipped - checkpoint:
                    break
                block = table[index]
                assert not block.is_null and block.ref == 1 and block.hash is None
                table.append(block)
                table[index] = self.pool.null_block
        num_new = max(required - len(table), 0) + (1 if partial is not None else 0)
        new_blocks = self.pool.get_new_blocks(num_new)
        returned = table[prev_len:]
        if partial is not None:
            index, source = partial
            copy, new_blocks = new_blocks[0], new_blocks[1:]
            if running:
                # The producer keeps writing `source` (its table is append
                # only), so the cached tail moves to the copy instead.
                assert table[index] is source
                self.pool.move_keys(source, copy)
                self.holds.follow_moved_keys(self.group_id, request_id, source, copy)
                self.pending_copies.append((source, copy))
                self.pool.add_ref(source)
                tail = self.producer_tails.pop(request_id, None)
                if tail is not None:
                    assert tail[0] is source
                    self.pending_offloads.append((request_id, self.group_id, copy, tail[1]))
                if copy.hash is not None:
                    self.cached_this_step.add(copy.hash)
                self.holds.hold(self.group_id, request_id, copy)
            else:
                self.apply_cow(request_id, index, source, copy)
                returned = [copy, *returned]
                self.holds.hold(self.group_id, request_id, source)
        table.extend(new_blocks)
        self.allocated.add(request_id)
        self.partial_hits.pop(request_id, None)
        return [*returned, *new_blocks]

    def remove_skipped(self, request_id: str, num_processed: int) -> None:
        """Free states no longer needed: all below the latest, and the block
        the previous step copied from."""
        table = self.tables.setdefault(request_id, [])
        if num_processed - 1 > 0:
            last = min((num_processed - 1) // self.block_size, len(table))
            first = self.num_retired.get(request_id, 0)
            if first < last:
                freed = []
                for i in range(last - 1, first - 1, -1):
                    if not table[i].is_null:
                        freed.append(table[i])
                        table[i] = self.pool.null_block
                freed = self.holds.retire(self.group_id, request_id, freed, self.block_size)
                if freed:
                    self.pool.free_blocks(freed)
                self.num_retired[request_id] = last
        previous = self.last_state_index.get(request_id)
        if (
            previous is not None
            and previous < cdiv(num_processed, self.block_size) - 1
            and not table[previous].is_null
        ):
            self.pool.free_blocks([table[previous]])
            table[previous] = self.pool.null_block

    # -- keying states ------------------------------------------------------

    def retention_mask(
        self, start: int, end: int, retention: int | None, boundaries: Sequence[int]
    ) -> list[bool] | None:
        """Which table blocks [start, end) get keyed: all (dense, None), or
        under sparse retention (0) only those ending on a replay boundary, and
        with a positive interval also the last block of each interval."""
        if retention is None:
            return None
        mask = [False] * (end - start)
        if retention > 0:
            per_interval = retention // self.block_size
            if per_interval <= 1:
                return None  # every block ends an interval
            first = (start + per_interval) // per_interval * per_interval - 1
            for i in range(first - start, len(mask), per_interval):
                mask[i] = True
        for boundary in boundaries:
            index = boundary // self.alignment * self.alignment // self.block_size - 1
            if start <= index < end:
                mask[index - start] = True
        return mask

    def cache(
        self,
        request: Request,
        num_tokens: int,
        retention: int | None,
        boundaries: Sequence[int],
    ) -> HashKey | None:
        if self.nothing_to_key(request, num_tokens):
            return None
        rid = request.request_id
        before = self.num_cached.get(rid, 0)
        self.cache_full(request, num_tokens, retention, boundaries)
        after = self.num_cached.get(rid, 0)
        tail_key = self._cache_prompt_tail(request, num_tokens, retention)
        if tail_key is not None:
            self.cached_this_step.add(tail_key)
        table = self.tables[rid]
        for block in table[before:after] if after > before else ():
            if not block.is_null and block.hash is not None:
                self.cached_this_step.add(block.hash)
                assert block.hash_tokens is not None
                self.pending_offloads.append((rid, self.group_id, block, block.hash_tokens))
        return tail_key

    def _cache_checkpoint(
        self, request: Request, position: int, column: int, retention: int | None
    ) -> HashKey | None:
        """Key this step's exported prefill checkpoint at its position, if it
        is reusable: the prompt's checkpoint, a state retention keeps, or the
        shared-prefix junction. Otherwise the state is transient and the
        block's keys (a full-block key keyed this step included) go."""
        table = self.tables[request.request_id]
        block = table[column]
        prompt_checkpoint = position == checkpoint_position(
            request.num_prompt_tokens,
            self.alignment,
            self.drop_eagle_checkpoint,
            self.hash_lookahead,
        )
        retained = False
        if position % self.block_size == 0:
            index = position // self.block_size - 1
            mask = self.retention_mask(index, index + 1, retention, ())
            retained = mask is None or mask[0]
        if not prompt_checkpoint and not retained and position != request.shared_prefix_boundary:
            self.pool.evict_keys(block)
            return None
        if block.hash_tokens == position:
            return None
        return self.pool.cache_partial_block(
            request, block, position, self.group_id, replace_existing=True
        )

    def _cache_prompt_tail(
        self, request: Request, num_tokens: int, retention: int | None
    ) -> HashKey | None:
        """Key the prompt's partial tail (or, with the knob, the shared-prefix
        junction) on the running block, once reached; or this step's prefill
        checkpoint on its own block."""
        checkpoint = self.checkpoints.get(request.request_id)
        if checkpoint is not None:
            return self._cache_checkpoint(request, *checkpoint, retention)
        if not self._prompt_tail_due(request, num_tokens):
            return None
        index = cdiv(num_tokens, self.block_size) - 1
        table = self.tables[request.request_id]
        if index >= len(table) or table[index].is_null:
            return None
        source = table[index]
        if source.hash_tokens == num_tokens:
            return None  # already keyed here (by a hit or an earlier step)
        key = self.pool.cache_partial_block(request, source, num_tokens, self.group_id)
        if key is not None and num_tokens % self.block_size:
            # The next chunk overwrites this block: it must move the key.
            self.partial_hits[request.request_id] = (index, source)
            self.num_cached[request.request_id] = index
            self.producer_tails[request.request_id] = (source, num_tokens)
        return key

    # -- ending a request ---------------------------------------------------

    def pop_blocks(self, request_id: str) -> list[Block]:
        self.allocated.discard(request_id)
        self.checkpoints.pop(request_id, None)
        self.last_state_index.pop(request_id, None)
        self.num_retired.pop(request_id, None)
        self.producer_tails.pop(request_id, None)
        # Its blocks go back to the pool: its hand-offs not yet drained go too.
        self.pending_offloads = [o for o in self.pending_offloads if o[0] != request_id]
        return super().pop_blocks(request_id)

    def finalize_partial_tail(self, request_id: str, num_computed: int) -> tuple[int, int] | None:
        """The request's partial tail, if its running block still holds that
        state (nothing computed past it): (block id, tokens). Consumed."""
        tail = self.producer_tails.pop(request_id, None)
        if tail is None or num_computed != tail[1]:
            return None
        return tail[0].block_id, tail[1]

    def take_offloads(self) -> list[tuple[str, int, Block, int]]:
        offloads, self.pending_offloads = self.pending_offloads, []
        return offloads

    def new_step(self) -> None:
        self.cached_this_step.clear()


class MambaNoneManager(MambaManager):
    """A Mamba group in cache mode `none` (vLLM's engine config without
    prefix caching): no state is ever keyed, so a request's table is sized
    like attention's, by all its tokens (drafts included) plus
    `speculative_blocks` blocks, and every block below the one holding the
    last computed token's state is freed, newest first, stopping at the
    first already-null block."""

    # The admission and step counts take the draft slots too.
    counts_draft_slots = True

    # Its counts and frees are its own: every step runs in full.
    idle_step = GroupManager.idle_step
    idle_limits = GroupManager.idle_limits

    def blocks_needed(
        self,
        request_id: str,
        num_tokens_main: int,
        hit_blocks: Sequence[Block],
        num_local_computed: int,
        query_start: int = 0,
        prefill_end: int = 0,
        record: bool = False,
    ) -> int:
        # Here `num_tokens_main` is every token needing a slot (the
        # coordinator passes drafts too: `counts_draft_slots`).
        spare = self.block_size * self.speculative_blocks
        required = cdiv(num_tokens_main + spare, self.block_size)
        have = len(self.tables.get(request_id, ()))
        if request_id in self.num_cached:
            return max(required - have, 0)
        # A request's first count: states below the computed prefix (a
        # connector's tokens included, `query_start`) are skipped.
        num_skipped = self.skipped_tokens(query_start) // self.block_size
        num_new = max(required - max(num_skipped, len(hit_blocks) + have), 0)
        kept = hit_blocks[max(0, num_skipped - have) :]
        if self.has_partial_hit(hit_blocks, num_local_computed):
            num_new += 1
        return num_new + num_evictable(kept)

    def allocate(self, request_id: str, num_tokens: int, num_tokens_main: int) -> list[Block]:
        table = self.table(request_id)
        missing = cdiv(num_tokens + self.block_size * self.speculative_blocks, self.block_size)
        missing -= len(table)
        if missing <= 0:
            return []
        blocks = self.pool.get_new_blocks(missing)
        table.extend(blocks)
        return blocks

    def remove_skipped(self, request_id: str, num_processed: int) -> None:
        skipped = self.skipped_tokens(num_processed)
        if skipped <= 0:
            return
        table = self.table(request_id)
        last = min(skipped // self.block_size, len(table))
        freed: list[Block] = []
        # Newest first; an earlier call nulled everything below a null.
        for i in range(last - 1, -1, -1):
            if table[i].is_null:
                break
            freed.append(table[i])
            table[i] = self.pool.null_block
        if freed:
            self.pool.free_blocks(freed)
