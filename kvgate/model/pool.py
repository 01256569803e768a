"""The block pool: ref counts, the free queue and the prefix-cache hash map.

Free-queue order decides which cached state is evicted next, so it is
modelled exactly: blocks freed without a hash go to the head (reused first),
hashed ones to the tail (evicted last, LRU); `touch` takes a block out from
wherever it is; allocation pops from the head and drops the popped block's
hashes. Block 0 is the null block: never queued, its ref count not kept.

A hash key is `(group id, prefix key)`. A block has at most one primary key
(with the token position it covers) and any number of secondary ones (a
partial-tail entry registered on a block that already had a key).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from kvgate.model.request import Request
from kvgate.model.residency import Residency
from kvgate.vocabulary.events import KvEvent, event_extras
from kvgate.vocabulary.tokens import EventExtra, lora_adapter_id

HashKey = tuple[int, str]  # (group id, prefix key of kvgate.vocabulary.tokens)


class Block:
    __slots__ = ("block_id", "ref", "hash", "hash_tokens", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref = 0
        self.hash: HashKey | None = None  # the primary key
        self.hash_tokens: int | None = None  # tokens the primary key covers
        self.is_null = False

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref}, hash={self.hash})"


class FreeQueue:
    """A doubly linked list of block ids with O(1) removal from the middle."""

    _HEAD = -1
    _TAIL = -2

    def __init__(self, block_ids: Iterable[int]) -> None:
        self._next: dict[int, int] = {}
        self._prev: dict[int, int] = {}
        self._next[self._HEAD] = self._TAIL
        self._prev[self._TAIL] = self._HEAD
        self.size = 0  # ids queued
        self.append_all(block_ids)

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._prev and block_id >= 0

    def __iter__(self) -> Iterator[int]:
        node = self._next[self._HEAD]
        while node != self._TAIL:
            yield node
            node = self._next[node]

    def head(self, n: int) -> tuple[int, ...]:
        """The first `n` ids (fewer when the queue is shorter)."""
        ids: list[int] = []
        node = self._next[self._HEAD]
        while node != self._TAIL and len(ids) < n:
            ids.append(node)
            node = self._next[node]
        return tuple(ids)

    def tail(self, n: int) -> tuple[int, ...]:
        """The last `n` ids, in queue order."""
        ids: list[int] = []
        node = self._prev[self._TAIL]
        while node != self._HEAD and len(ids) < n:
            ids.append(node)
            node = self._prev[node]
        return tuple(reversed(ids))

    def _link_after(self, anchor: int, block_id: int) -> None:
        following = self._next[anchor]
        self._next[anchor] = block_id
        self._prev[block_id] = anchor
        self._next[block_id] = following
        self._prev[following] = block_id
        self.size += 1

    def remove(self, block_id: int) -> None:
        before, after = self._prev.pop(block_id), self._next.pop(block_id)
        self._next[before] = after
        self._prev[after] = before
        self.size -= 1

    def pop_head(self) -> int:
        head = self._next[self._HEAD]
        assert head != self._TAIL, "pop from an empty free queue"
        self.remove(head)
        return head

    def prepend_all(self, block_ids: Iterable[int]) -> None:
        anchor = self._HEAD
        for block_id in block_ids:
            self._link_after(anchor, block_id)
            anchor = block_id

    def append_all(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self._link_after(self._prev[self._TAIL], block_id)


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        hash_unit: int,
        events: bool = False,
        residency: bool = False,
        caching: bool = True,
    ) -> None:
        self.hash_unit = hash_unit
        # The KV-cache event queue (vLLM's enable_kv_cache_events); None: off.
        self.events: list[KvEvent] | None = [] if events else None
        # The residency metrics (vLLM's kv_cache_metrics); None: off.
        self.residency: Residency | None = Residency() if residency else None
        # Prefix caching on: a block handed out is first evicted from the
        # prefix cache (off, nothing is cached, and vLLM skips that call).
        self.caching = caching
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeQueue(range(num_blocks))
        self.null_block = self.blocks[self.free_queue.pop_head()]
        self.null_block.is_null = True
        # key -> blocks cached under it, oldest first (lookups take the first)
        self.cached: dict[HashKey, dict[int, Block]] = {}
        # block id -> its secondary keys
        self.secondary: dict[int, set[HashKey]] = {}
        # Ids of blocks whose ref or keys changed since `take_changed`, so a
        # snapshot of a large pool only re-reads those.
        self.changed: set[int] = set(range(num_blocks))
        # Times any block lost a key (an eviction, a key replaced, a reset):
        # a keying found done stays done while this count stands.
        self.keys_dropped = 0

    def take_changed(self) -> set[int]:
        changed, self.changed = self.changed, set()
        return changed

    # -- queries ---------------------------------------------------------

    def num_free(self) -> int:
        return self.free_queue.size

    def cached_block(self, prefix_key: str, group_ids: Sequence[int]) -> list[Block] | None:
        """The first block cached under `prefix_key` in each group, or None."""
        found = []
        for group_id in group_ids:
            entry = self.cached.get((group_id, prefix_key))
            if not entry:
                return None
            found.append(next(iter(entry.values())))
        return found

    def cached_prefix(self, keys: Iterable[str], group_id: int) -> list[Block]:
        """The first block cached under each of `keys` in `group_id`, in
        order, up to the first key with none (a left-to-right hit scan)."""
        found = []
        cached = self.cached
        for key in keys:
            entry = cached.get((group_id, key))
            if not entry:
                break
            found.append(next(iter(entry.values())))
        return found

    def keys_of(self, block: Block) -> list[HashKey]:
        primary = [block.hash] if block.hash is not None else []
        return primary + sorted(self.secondary.get(block.block_id, ()))

    # -- ref counts and the free queue ----------------------------------

    def get_new_blocks(self, n: int) -> list[Block]:
        if n > self.num_free():
            raise ValueError(f"cannot get {n} free blocks from the pool")
        taken = [self.blocks[self.free_queue.pop_head()] for _ in range(n)]
        for block in taken:
            if self.caching:
                self.evict_keys(block)  # reuse evicts the cached state
            assert block.ref == 0
            block.ref = 1
            self.changed.add(block.block_id)
            if self.residency is not None:
                self.residency.allocated(block.block_id)
        return taken

    def add_ref(self, block: Block) -> None:
        """One more ref on a block in use (a copy endpoint kept until it ran)."""
        assert block.ref > 0 and not block.is_null
        block.ref += 1
        self.changed.add(block.block_id)

    def touch(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            if block.is_null:
                continue
            if block.ref == 0:
                self.free_queue.remove(block.block_id)
            block.ref += 1
            self.changed.add(block.block_id)
            if self.residency is not None:
                self.residency.accessed(block.block_id)

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Drop one ref of each; blocks reaching 0 join the free queue.

        `ordered` is eviction priority, first evicted first: unhashed blocks
        go to the head in that order, hashed ones to the tail in that order.
        """
        to_head: list[int] = []
        to_tail: list[int] = []
        for block in ordered:
            if block.is_null:
                continue
            block.ref -= 1
            self.changed.add(block.block_id)
            if block.ref == 0:
                (to_head if block.hash is None else to_tail).append(block.block_id)
        self.free_queue.prepend_all(to_head)
        self.free_queue.append_all(to_tail)

    def reset_prefix_cache(self) -> bool:
        """Forget every key, if every block but the null block is free."""
        if self.num_free() != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.secondary.clear()
        self.keys_dropped += 1
        for block in self.blocks:
            block.hash = None
            block.hash_tokens = None
        self.changed.update(range(self.num_blocks))
        if self.residency is not None:
            self.residency.reset()
        if self.events is not None:
            self.events.append(KvEvent("cleared"))
        return True

    def take_events(self) -> list[KvEvent]:
        if self.events is None:
            return []
        taken, self.events = self.events, []
        return taken

    # -- the hash map -----------------------------------------------------

    def evict_keys(self, block: Block) -> None:
        """Evict `block` from the prefix cache (its keys go, with a
        `removed` event each); its ref count and place stay. Its residency
        ends here, keyed or not (vLLM's `_maybe_evict_cached_block`)."""
        if self.residency is not None:
            self.residency.evicted(block.block_id)
        self._removed(self.drop_keys(block))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Evict each of these blocks from the prefix cache, as `evict_keys`."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block {block_id} is not in the pool")
            self.evict_keys(self.blocks[block_id])

    def _removed(self, keys: Iterable[HashKey]) -> None:
        if self.events is not None:
            self.events.extend(KvEvent("removed", g, (k,)) for g, k in keys)

    def drop_keys(self, block: Block) -> list[HashKey]:
        """Remove every key pointing at `block`; return the ones removed."""
        keys = [block.hash] if block.hash is not None else []
        keys.extend(self.secondary.pop(block.block_id, ()))
        if keys:
            self.keys_dropped += 1
        removed = []
        for key in keys:
            entry = self.cached.get(key)
            if entry is not None and entry.pop(block.block_id, None) is not None:
                removed.append(key)
                if not entry:
                    del self.cached[key]
        block.hash = None
        block.hash_tokens = None
        self.changed.add(block.block_id)
        return removed

    def add_key(self, key: HashKey, block: Block, num_tokens: int | None) -> None:
        if block.hash == key:
            return
        entry = self.cached.setdefault(key, {})
        if block.block_id in entry:
            return
        if block.hash is None:
            block.hash, block.hash_tokens = key, num_tokens
        else:
            self.secondary.setdefault(block.block_id, set()).add(key)
        entry[block.block_id] = block
        self.changed.add(block.block_id)

    def cache_full_blocks(
        self,
        request: Request,
        table: Sequence[Block],
        num_cached: int,
        num_full: int,
        block_size: int,
        group_id: int,
        mask: Sequence[bool] | None,
    ) -> None:
        """Key `request`'s table blocks [num_cached, num_full) at their block
        boundaries."""
        if num_cached >= num_full:
            return
        keys = request.keys
        scale = block_size // self.hash_unit
        stored: list[str] = []
        windows: list[int] = []  # each stored block's start, for its event
        for i in range(num_cached, num_full):
            block = table[i]
            if block.is_null or (mask is not None and not mask[i - num_cached]):
                continue
            num_tokens = (i + 1) * block_size
            if block.hash is not None:
                # A partial entry on this block is promoted to the full one.
                assert block.hash_tokens is not None and block.hash_tokens < num_tokens
                self._removed(self.drop_keys(block))
            key = keys[(i + 1) * scale - 1]
            self.add_key((group_id, key), block, num_tokens)
            stored.append(key)
            windows.append(i * block_size)
        if self.events is not None:
            # One event per call, even when every block was skipped.
            self.events.append(
                stored_event(
                    request,
                    group_id,
                    tuple(stored),
                    keys[num_cached * scale - 1] if num_cached else None,
                    num_cached * block_size,
                    num_full * block_size,
                    block_size,
                    windows,
                )
            )

    def cache_partial_block(
        self,
        request: Request,
        block: Block,
        num_tokens: int,
        group_id: int,
        replace_existing: bool = False,
    ) -> HashKey | None:
        """Make `block` reachable from `request`'s hash-unit boundary
        `num_tokens`."""
        if block.is_null:
            return None
        keys = request.keys
        unit = self.hash_unit
        n = num_tokens // unit
        key = (group_id, keys[n - 1])
        already = block.hash == key or block.block_id in self.cached.get(key, ())
        if already and not replace_existing:
            return key  # keyed there already (a decode's re-cache, every step): nothing changes
        if replace_existing or (
            not already
            and block.hash is not None
            and block.hash_tokens is not None
            and block.hash_tokens < num_tokens
        ):
            self._removed(self.drop_keys(block))
            already = already and not replace_existing
        self.add_key(key, block, num_tokens)
        if self.events is not None and not already:
            parent = keys[n - 2] if n > 1 else None
            start = (n - 1) * unit
            self.events.append(
                stored_event(request, group_id, (key[1],), parent, start, n * unit, unit, [start])
            )
        return key

    def move_keys(self, source: Block, target: Block) -> None:
        """Re-point every key of `source` to `target` (a fresh, unhashed block)."""
        assert target.hash is None and target.block_id not in self.secondary
        num_tokens = source.hash_tokens
        for key in self.drop_keys(source):
            self.add_key(key, target, num_tokens)


def stored_event(
    request: Request,
    group_id: int,
    keys: tuple[str, ...],
    parent: str | None,
    start: int,
    end: int,
    block_size: int,
    windows: Sequence[int],
) -> KvEvent:
    """A BlockStored of `request`'s `keys` (blocks starting at `windows`, each
    `block_size` tokens), with what vLLM's event carries of its hash inputs:
    the adapter, each block's extra keys over its hashed window (the block
    and the hash lookahead tokens after it) and, with lookahead hashes, those
    tokens themselves (as many as exist)."""
    inputs = request.inputs
    lora = inputs.lora
    extra: tuple[EventExtra, ...] = ()
    if inputs:
        span = block_size + request.hash_lookahead
        extra = event_extras(inputs.event_extra(w, w + span) for w in windows)
    lookahead = None
    if request.hash_lookahead:
        tokens = request.all_token_ids
        lookahead = tuple(
            tuple(tokens[w + block_size : w + block_size + request.hash_lookahead]) for w in windows
        )
    return KvEvent(
        "stored",
        group_id,
        keys,
        parent,
        start,
        end,
        block_size,
        lora,
        lora_adapter_id(lora) if lora else 0,
        extra,
        lookahead,
    )
