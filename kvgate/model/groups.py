"""Per-group managers: what every group does, and the full-attention group.

A group's table for a request is a list of blocks, one per `block_size`
tokens (null where a state is not kept). A prefix hit that ends inside a
block (a partial hit, finer than the block) shares that block with its
owner, so the request's first allocation redirects it to a private copy
(copy-on-write): the copy's endpoints stay referenced until `drain`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.model.idle import NO_LIMIT
from kvgate.model.pool import Block, BlockPool, HashKey
from kvgate.model.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_evictable(blocks: Sequence[Block]) -> int:
    """Blocks of a hit that sit in the free queue: taking them uses up free
    blocks as new ones do."""
    if not blocks:
        return 0  # a step with no hit, the common case: no scan
    return sum(1 for b in blocks if b.ref == 0 and not b.is_null)


class GroupManager:
    def __init__(self, pool: BlockPool, group_id: int, block_size: int) -> None:
        self.pool = pool
        self.group_id = group_id
        self.block_size = block_size
        self.use_eagle = False
        self.alignment = block_size  # the coordinator lowers it for fine hits
        self.tables: dict[str, list[Block]] = {}
        self.num_cached: dict[str, int] = {}  # table blocks already keyed
        self.partial_hits: dict[str, tuple[int, Block]] = {}  # (index, shared block)
        self.pending_copies: list[tuple[Block, Block]] = []  # (source, copy)

    def table(self, request_id: str) -> list[Block]:
        return self.tables.setdefault(request_id, [])

    def has_partial_hit(self, hit_blocks: Sequence[Block], num_local_computed: int) -> bool:
        return len(hit_blocks) > 0 and num_local_computed % self.block_size != 0

    def skipped_tokens(self, num_computed: int) -> int:
        return 0

    def idle_step(
        self,
        request: Request,
        num_processed: int,
        num_slots: int,
        num_tokens_main: int,
        query_start: int,
        prefill_end: int,
    ) -> bool:
        """Whether a step of the running request that adopts no hit, to
        these counts (those of `blocks_needed` and `allocate`), adds no block
        here and frees none (keying is `nothing_to_key`'s). False unless the
        kind can tell: the step then runs in full."""
        return False

    def nothing_to_key(self, request: Request, num_tokens: int) -> bool:
        """Whether keying the request up to `num_tokens` would change nothing
        here. False unless the kind can tell: the keying then runs."""
        return False

    def idle_limits(self, request: Request, num_target: int) -> tuple[int, int, int, int] | None:
        """After an idle step keying to `num_target`: how far the processed,
        slot, main-model and keying counts may grow (inclusive) with steps
        staying idle here, while the request's tables stand (see `idle.py`).
        None: no such bound is known; each step is then checked in full."""
        return None

    def add_hit_blocks(
        self,
        request_id: str,
        hit_blocks: Sequence[Block],
        num_local: int,
        num_external: int = 0,
    ) -> None:
        """Adopt a request's prefix hit: reference the blocks, pad skipped ones
        (skipped as of the whole computed prefix, a connector's tokens too)."""
        table = self.table(request_id)
        assert not table
        num_skipped = self.skipped_tokens(num_local + num_external) // self.block_size
        kept = list(hit_blocks[num_skipped:]) if num_skipped > 0 else list(hit_blocks)
        self.pool.touch(kept)
        table.extend([self.pool.null_block] * num_skipped)
        table.extend(kept)
        self.num_cached[request_id] = len(table)
        if self.has_partial_hit(kept, num_local):
            index = num_local // self.block_size
            self.partial_hits[request_id] = (index, kept[-1])
            self.num_cached[request_id] = index

    def allocate_external(
        self, request_id: str, num_local: int, num_external: int, record_for_zeroing: bool
    ) -> list[Block]:
        """Blocks for a KV connector's tokens after the local hit (taken after
        every group adopted its hit, so no group evicts another's hit). Only
        the tokens this group still needs get blocks: a Mamba group, only
        the last one's state."""
        total = num_local + num_external
        skipped = self.skipped_tokens(total)
        if skipped > 0:
            num_external = min(total - skipped, num_external)
        if num_external <= 0:
            return []
        table = self.table(request_id)
        blocks = self.pool.get_new_blocks(max(0, cdiv(total, self.block_size) - len(table)))
        table.extend(blocks)
        if record_for_zeroing:
            self.record_new_blocks(blocks)
        return blocks

    def record_new_blocks(self, blocks: Sequence[Block]) -> None:
        """Blocks the worker must zero before use: none for this group."""
        return None

    def apply_cow(self, request_id: str, index: int, source: Block, copy: Block) -> None:
        """Swap a shared partial block for the request's private copy.

        The source keeps the request's hit ref and the copy takes one more, so
        both survive until the copy has run (`drain` releases them).
        """
        table = self.tables[request_id]
        assert table[index] is source and not source.is_null and source.ref > 0
        table[index] = copy
        self.pending_copies.append((source, copy))
        self.pool.add_ref(copy)

    def retention_mask(
        self, start: int, end: int, retention: int | None, boundaries: Sequence[int]
    ) -> list[bool] | None:
        """Which of table blocks [start, end) get keyed; None: all of them."""
        return None

    def cache_full(
        self,
        request: Request,
        num_tokens: int,
        retention: int | None,
        boundaries: Sequence[int],
    ) -> None:
        """Key the request's blocks that `num_tokens` now fills."""
        rid = request.request_id
        num_cached = self.num_cached.get(rid, 0)
        num_hashed = len(request.keys) * self.pool.hash_unit
        num_full = min(num_tokens, num_hashed) // self.block_size
        if num_cached >= num_full:
            return
        # Sparse retention also keeps the state at the request's junction
        # and, with eagle, one block below it (a sibling diverging right after
        # the junction has no block past it to drop, so it resumes there).
        junction = request.shared_prefix_boundary
        if junction:
            extra = (junction, junction - self.block_size) if self.use_eagle else (junction,)
            boundaries = (*boundaries, *extra)
        mask = self.retention_mask(num_cached, num_full, retention, boundaries)
        self.pool.cache_full_blocks(
            request,
            self.tables[rid],
            num_cached,
            num_full,
            self.block_size,
            self.group_id,
            mask,
        )
        self.num_cached[rid] = num_full

    def pop_blocks(self, request_id: str) -> list[Block]:
        """Forget the request; its blocks in table order, leading nulls cut."""
        table = self.tables.pop(request_id, [])
        self.num_cached.pop(request_id, None)
        self.partial_hits.pop(request_id, None)
        first = next((i for i, b in enumerate(table) if not b.is_null), len(table))
        return table[first:]

    def free(self, request_id: str) -> None:
        # Tail first, so the tail of a chain is evicted before its head.
        self.pool.free_blocks(reversed(self.pop_blocks(request_id)))

    def take_pending_copies(self) -> list[tuple[Block, Block]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def new_step(self) -> None:
        return None


class FullAttentionManager(GroupManager):
    def __init__(self, pool: BlockPool, group_id: int, block_size: int) -> None:
        super().__init__(pool, group_id, block_size)
        # Blocks allocated since the scheduler last drained them: the worker
        # zeroes them before use (a model with Mamba layers needs it).
        self.new_block_ids: list[int] = []
        # Each request's prompt tail as last found settled (keyed, or never
        # to be): the pool's dropped keys and the request's rewrites then.
        self.prompt_tail_settled: dict[str, tuple[int, int]] = {}

    def pop_blocks(self, request_id: str) -> list[Block]:
        self.prompt_tail_settled.pop(request_id, None)
        return super().pop_blocks(request_id)

    def take_new_block_ids(self) -> list[int]:
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def record_new_blocks(self, blocks: Sequence[Block]) -> None:
        if blocks:
            self.new_block_ids.extend(b.block_id for b in blocks)

    def find_hit(
        self, keys: Sequence[str], max_length: int, drop_eagle: bool
    ) -> tuple[list[Block], int]:
        """Longest cached prefix: whole blocks left to right, then (fine
        alignment) the first partial block's boundaries high to low."""
        unit, size, alignment = self.pool.hash_unit, self.block_size, self.alignment
        fine = alignment < size and size % alignment == 0
        scale = size // unit
        # Each whole block's key: the last unit's of the block.
        num_whole = min(max_length // size, len(keys) // scale)
        hit = self.pool.cached_prefix(keys[scale - 1 : num_whole * scale : scale], self.group_id)
        hit_length = len(hit) * size
        if fine:
            units_per_block = size // alignment
            first = len(hit) * units_per_block
            last = min(first + units_per_block - 1, max_length // alignment, len(keys))
            for fine_index in range(last - 1, first - 1, -1):
                found = self.pool.cached_block(keys[fine_index], [self.group_id])
                if found:
                    hit.append(found[0])
                    hit_length = (fine_index + 1) * alignment
                    break
        if drop_eagle and hit_length > 0:
            hit_length -= min(alignment, size)
        hit_length -= hit_length % alignment
        del hit[cdiv(hit_length, size) :]
        return hit, hit_length

    def blocks_needed(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[Block],
        num_local_computed: int,
    ) -> int:
        required = cdiv(num_tokens, self.block_size)
        have = len(self.tables.get(request_id, ()))
        if request_id in self.num_cached:
            return max(required - have, 0)
        num_new = max(required - (len(hit_blocks) + have), 0)
        if self.has_partial_hit(hit_blocks, num_local_computed):
            num_new += 1  # the private copy of the shared partial block
        return num_new + num_evictable(hit_blocks)

    def allocate(self, request_id: str, num_tokens: int, num_tokens_main: int) -> list[Block]:
        new: list[Block] = []
        if request_id in self.partial_hits:
            index, source = self.partial_hits.pop(request_id)
            self.prompt_tail_settled.pop(request_id, None)  # the table's block changes
            copy = self.pool.get_new_blocks(1)[0]
            self.apply_cow(request_id, index, source, copy)
            new.append(copy)
        table = self.tables.setdefault(request_id, [])
        missing = cdiv(num_tokens, self.block_size) - len(table)
        if missing > 0:
            blocks = self.pool.get_new_blocks(missing)
            table.extend(blocks)
            new.extend(blocks)
        if new:
            self.record_new_blocks(new)
        return new

    def remove_skipped(self, request_id: str, num_processed: int) -> None:
        return None  # full attention keeps every block until the request ends

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
        table = self.tables.get(rid)
        return (
            table is not None
            and rid not in self.partial_hits
            and cdiv(num_slots, self.block_size) <= len(table)
        )

    def idle_limits(self, request: Request, num_target: int) -> tuple[int, int, int, int] | None:
        rid = request.request_id
        size = self.block_size
        max_keyed = (self.num_cached.get(rid, 0) + 1) * size - 1
        return NO_LIMIT, len(self.tables[rid]) * size, NO_LIMIT, max_keyed

    def nothing_to_key(self, request: Request, num_tokens: int) -> bool:
        # No block newly filled, and the prompt's tail settled (or none, the
        # block being the hash unit): `cache` would return at once.
        rid = request.request_id
        num_full = min(num_tokens, len(request.keys) * self.pool.hash_unit) // self.block_size
        if self.num_cached.get(rid, 0) < num_full:
            return False
        return self.block_size == self.pool.hash_unit or self.prompt_tail_settled.get(
            rid
        ) == self._tail_inputs(request)

    def _tail_inputs(self, request: Request) -> tuple[int, int]:
        """What a settled prompt tail can change with: the pool's dropped
        keys and the request's rewritten ones."""
        return self.pool.keys_dropped, request.keys_rewritten

    def cache(
        self,
        request: Request,
        num_tokens: int,
        retention: int | None,
        boundaries: Sequence[int],
    ) -> HashKey | None:
        self.cache_full(request, num_tokens, retention, boundaries)
        if self.block_size != self.pool.hash_unit:
            self._cache_prompt_tail(request, num_tokens)
        return None

    def _cache_prompt_tail(self, request: Request, num_tokens: int) -> None:
        """Key the prompt's last hash boundary when it ends inside a block.

        Every decode re-caches: once the boundary is the prompt's last (its
        key derived) and found keyed, or found inside no block, nothing
        changes until a block loses a key or the request's keys are
        rewritten, so until then this returns at once."""
        rid = request.request_id
        settled = self._tail_inputs(request)
        if self.prompt_tail_settled.get(rid) == settled:
            return
        unit = self.pool.hash_unit
        num_prompt = len(request.prompt)
        limit = num_prompt if self.use_eagle else num_prompt - 1
        last = limit // unit
        final = len(request.keys) >= last
        boundary = min(last, len(request.keys)) * unit
        if boundary == 0 or boundary % self.block_size == 0:
            if final:
                self.prompt_tail_settled[rid] = settled
            return
        if boundary > num_tokens:
            return
        table = self.tables[rid]
        index = boundary // self.block_size
        if index < len(table):
            self.pool.cache_partial_block(request, table[index], boundary, self.group_id)
            if final:
                # Read again: keying may have replaced a shorter key.
                self.prompt_tail_settled[rid] = self._tail_inputs(request)
