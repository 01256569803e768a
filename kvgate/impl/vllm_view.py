"""A vLLM `KVCacheManager`'s state as kvgate's strict `Snapshot`.

Shared by every target that owns a real manager: the manager-level adapter
(`vllm_target.VllmTarget`) and the real `Scheduler` (`vllm_scheduler`). The
view keys vLLM's block hashes by kvgate prefix keys (a chained digest of the
tokens, `vocabulary.tokens`), so a snapshot compares directly with the
model's: it keeps a hash -> prefix key index over every request it tracks,
extended lazily as their tokens grow.

Requests are tracked by name; a caller marks a request `touched` whenever
its tokens may have grown (the index is brought up to date at the next
snapshot). Nothing here calls the manager in a way that changes it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import ne
from typing import Any

from kvgate.impl._vllm_api import HOLD_ATTR, VllmApi
from kvgate.vocabulary.events import KvEvent, event_extras
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
from kvgate.vocabulary.tokens import (
    NO_INPUTS,
    EventExtra,
    HashInputs,
    extend_prefix_keys,
    key_position,
)

__all__ = ["ManagerView", "block_ids"]


@dataclass(eq=False)
class _Keys:
    """A request's prefix keys, and how far its vLLM hashes are indexed."""

    request: Any  # vllm.v1.request.Request
    # Its salt, adapter and multimodal items, as the trace gave them.
    inputs: HashInputs = NO_INPUTS
    # keys[i] names the prefix tokens[: (i + 1) * hash_unit] (covering the
    # hash lookahead tokens after it).
    keys: list[str] = field(default_factory=list)
    # request.block_hashes[:mapped] are entered in the hash index.
    mapped: int = 0


@dataclass(frozen=True)
class _Views:
    """The pool as the last snapshot saw it, indexed by block id."""

    refs: list[int]
    primary: list[Any]  # BlockHashWithGroupId | None
    secondary: dict[int, frozenset[Any]]
    views: list[BlockView]


_LOW_64 = (1 << 64) - 1


def block_ids(blocks: Sequence[Any]) -> tuple[int, ...]:
    return tuple(b.block_id for b in blocks)


class ManagerView:
    """Reads one vLLM `KVCacheManager` as a `Snapshot`."""

    def __init__(self, api: VllmApi, manager: Any, hash_unit: int, hash_lookahead: int = 0) -> None:
        self._api = api
        self._hash_unit = hash_unit
        # The trace's hash_lookahead_tokens: vLLM's hashes and the keys both
        # cover that many tokens past each block, so they stay index-aligned.
        self._hash_lookahead = hash_lookahead
        self._manager: Any = manager
        self._pool: Any = manager.block_pool
        self._managers: tuple[Any, ...] = tuple(manager.coordinator.single_type_managers)
        self.group_ids: tuple[int, ...] = tuple(int(m.kv_cache_group_id) for m in self._managers)
        # Per request name: its prefix keys; the names whose tokens grew since
        # the hash index last saw them.
        self._keys: dict[str, _Keys] = {}
        self._dirty: set[str] = set()
        # vLLM BlockHash (bytes) -> prefix key; BlockHashWithGroupId -> name.
        self._key_of: dict[bytes, str] = {}
        self._names: dict[Any, str] = {}
        # The same index by the 64-bit ints KV-cache events carry.
        self._key_of_int: dict[int, str] = {}
        self._last_views: _Views | None = None
        self._forgotten = 0
        # The strict view's exclusions that hid something here (the raw
        # state differed from the view): what the gate names as differences.
        self.exclusions_applied: set[str] = set()
        # Ids of the blocks the pool's own calls changed since the step view
        # last asked (`take_changed_blocks`); every block at first.
        self._changed: set[int] = set(range(len(self._pool.blocks)))
        self._watch_pool()

    @property
    def managers(self) -> tuple[Any, ...]:
        """The single-type managers, in group order."""
        return self._managers

    def track(self, name: str, request: Any, inputs: HashInputs = NO_INPUTS) -> None:
        """Index `request`'s hashes under `name` from now on; `inputs`: what
        it was given besides its tokens that its hashes cover."""
        self._keys[name] = _Keys(request, inputs)
        self._dirty.add(name)

    def rewritten(self, name: str) -> None:
        """`name`'s tokens were rewritten (a streaming-input session took its
        next chunk; a session's hashes recomputed at its lookup): its keys
        are kept up to its first vLLM hash that no longer names them, and
        re-derived past it from its tokens, chained over the last one kept,
        as vLLM's hasher chains over the hashes it kept."""
        entry = self._keys[name]
        hashes = entry.request.block_hashes
        kept = 0
        while (
            kept < min(len(hashes), len(entry.keys), entry.mapped)
            and self._key_of.get(bytes(hashes[kept])) == entry.keys[kept]
        ):
            kept += 1
        del entry.keys[kept:]
        entry.mapped = kept
        self._dirty.add(name)

    def touched(self, name: str) -> None:
        """`name`'s tokens may have grown: re-index it at the next snapshot."""
        self._dirty.add(name)

    def forget(self, name: str) -> None:
        """Stop tracking `name` (ended, named by no later step); now and then
        the hash index keeps only what the pool and the tracked requests
        still hold, so it follows them rather than the history's length."""
        if self._keys.pop(name, None) is None:
            return
        self._dirty.discard(name)
        self._forgotten += 1
        # KV-cache events name hashes of blocks already evicted: kept whole.
        if self._forgotten % 64 == 0 and not getattr(self._pool, "enable_kv_cache_events", True):
            self._prune_index()

    def _prune_index(self) -> None:
        get_hash = self._api.get_block_hash
        held: set[bytes] = set()
        for block in self._pool.blocks:
            if block.block_hash is not None:
                held.add(bytes(get_hash(block.block_hash)))
        for hashes in self._pool.cached_block_hashes_by_block.values():
            held.update(bytes(get_hash(h)) for h in hashes)
        for entry in self._keys.values():
            held.update(bytes(h) for h in entry.request.block_hashes[: entry.mapped])
        self._key_of = {h: k for h, k in self._key_of.items() if h in held}
        self._key_of_int = {}
        self._names = {}

    def index_now(self, name: str) -> None:
        """Index `name`'s hashes now, from its tokens as they are (before a
        rewrite changes them)."""
        self._dirty.add(name)
        self._sync_index()

    def close(self) -> None:
        self._managers = ()
        self._manager = self._pool = None
        self._keys.clear()
        self._dirty.clear()
        self._key_of.clear()
        self._key_of_int.clear()
        self._names.clear()
        self._last_views = None

    # ------------------------------------------------------- changed blocks

    def _watch_pool(self) -> None:
        """Note the blocks each of the pool's calls that change a block's
        ref count, keys or place in the free queue is given or returns.

        Instance attributes over the pool's methods, each calling the class's
        method as it is at call time (a plugin's patch still applies). The
        single-type managers' own writes (a copy-on-write's extra ref) are
        not seen here: the other side's changes and the whole view's
        comparison at intervals cover them."""
        pool = self._pool
        cls = type(pool)
        changed = self._changed

        def note(block: Any) -> None:
            changed.add(block.block_id)

        def get_new_blocks(num_blocks: int) -> Any:
            blocks = cls.get_new_blocks(pool, num_blocks)
            changed.update(b.block_id for b in blocks)
            return blocks

        def touch(blocks: Any) -> None:
            blocks = list(blocks)
            changed.update(b.block_id for b in blocks)
            cls.touch(pool, blocks)

        def free_blocks(ordered_blocks: Any) -> None:
            blocks = list(ordered_blocks)
            changed.update(b.block_id for b in blocks)
            cls.free_blocks(pool, blocks)

        def remove_hashes(block: Any, *args: Any, **kwargs: Any) -> Any:
            note(block)
            return cls._remove_cached_block_hashes(pool, block, *args, **kwargs)

        def insert_hash(key: Any, block: Any, *args: Any, **kwargs: Any) -> Any:
            note(block)
            return cls._insert_block_hash(pool, key, block, *args, **kwargs)

        def reset_prefix_cache(*args: Any, **kwargs: Any) -> Any:
            changed.update(range(len(pool.blocks)))
            return cls.reset_prefix_cache(pool, *args, **kwargs)

        watched = {
            "get_new_blocks": get_new_blocks,
            "touch": touch,
            "free_blocks": free_blocks,
            "_remove_cached_block_hashes": remove_hashes,
            "_insert_block_hash": insert_hash,
            "reset_prefix_cache": reset_prefix_cache,
        }
        for name, wrapper in watched.items():
            if callable(getattr(cls, name, None)):
                setattr(pool, name, wrapper)
            else:
                # A build without this call: no step view's list is complete.
                changed.update(range(len(pool.blocks)))

    def take_changed_blocks(self) -> set[int]:
        taken = set(self._changed)
        self._changed.clear()
        return taken

    def step_view(
        self, popped: Mapping[str, Sequence[Any]], blocks: Collection[int], requests: Iterable[str]
    ) -> StepView:
        """The strict view of `blocks` and `requests` (`StepView`); the hash
        index is brought up to date only when a block's hash is new to it."""
        pool = self._pool
        all_blocks = pool.blocks
        secondary = pool.cached_block_hashes_by_block
        views: dict[int, BlockView] = {}
        names_of = self._names
        name = self._name
        for bid in blocks:
            if not 0 <= bid < len(all_blocks):
                continue
            block = all_blocks[bid]
            primary = block.block_hash
            names: tuple[str, ...] = (
                () if primary is None else (names_of.get(primary) or name(primary),)
            )
            extra = secondary.get(bid)
            if extra:
                names += tuple(sorted(name(h) for h in extra))
            view = BlockView(int(block.ref_cnt), names)
            views[bid] = null_view(view) if bid == NULL_BLOCK else view
        reach = len(blocks) + 1
        keep = tail_length(len(blocks))
        tables = {}
        for rid in requests:
            ends = []
            for m in self._managers:
                table = m.req_to_blocks.get(rid) or ()
                ends.append((len(table), tuple([b.block_id for b in table[-keep:]])))
            tables[rid] = table_ends(ends)
        queue = pool.free_block_queue
        head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
        forward: list[int] = []
        block = head.next_free_block
        while block is not None and block is not tail and len(forward) < reach:
            forward.append(block.block_id)
            block = block.next_free_block
        backward: list[int] = []
        block = tail.prev_free_block
        while block is not None and block is not head and len(backward) < reach:
            backward.append(block.block_id)
            block = block.prev_free_block
        backward.reverse()
        return StepView(
            blocks=views,
            num_free=int(queue.num_free_blocks),
            free_head=tuple(forward),
            free_tail=tuple(backward),
            tables=tables,
            holds=self.holds(),
            pending_copies=self.pending_copies(),
            popped={
                rid: kept_aside(block_ids(popped[rid])) if rid in popped else None
                for rid in requests
            },
        )

    # ------------------------------------------------------------- the view

    def snapshot(self, popped: Mapping[str, Sequence[Any]]) -> Snapshot:
        """The manager's strict view; `popped`: blocks kept aside per request.

        The abstraction of `kvgate.vocabulary.snapshot.EXCLUSIONS`: the null
        block without its ref count, popped lists without null entries.
        """
        self._sync_index()
        views = self._block_views()
        kept = {req: block_ids(blocks) for req, blocks in popped.items()}
        if views[NULL_BLOCK].ref:
            self.exclusions_applied.add("null-block-ref")
        if any(NULL_BLOCK in ids for ids in kept.values()):
            self.exclusions_applied.add("null-block-kept-aside")
        return Snapshot(
            free_queue=tuple(self.free_queue_ids()),
            blocks=views[:NULL_BLOCK] + (null_view(views[NULL_BLOCK]),) + views[NULL_BLOCK + 1 :],
            tables=self.tables(),
            holds=self.holds(),
            pending_copies=self.pending_copies(),
            popped={req: kept_aside(ids) for req, ids in kept.items()},
        )

    def free_queue_ids(self) -> list[int]:
        """The free queue, head first. A queue whose links loop back (a block
        queued twice by a faulty free) ends at the first block seen again,
        listed twice: a queue no valid pool has, and a walk that ends."""
        queue = self._pool.free_block_queue
        tail = queue.fake_free_list_tail
        ids: list[int] = []
        seen: set[int] = set()
        block = queue.fake_free_list_head.next_free_block
        while block is not None and block is not tail:
            ids.append(block.block_id)
            if block.block_id in seen:
                break
            seen.add(block.block_id)
            block = block.next_free_block
        return ids

    def tables(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        managers = self._managers
        rids = dict.fromkeys(rid for m in managers for rid in m.req_to_blocks)
        tables: dict[str, tuple[tuple[int, ...], ...]] = {}
        for rid in rids:
            # Read through `get_block_ids`, the call whose answer the
            # scheduler sends a worker as the request's block table.
            per_group = tuple(tuple(ids) for ids in self._manager.get_block_ids(rid))
            if any(per_group):
                tables[str(rid)] = per_group
        return tables

    def holds(self) -> dict[str, dict[int, tuple[int, int]]]:
        """{request: {group: (held position, block id)}}."""
        holds: dict[str, dict[int, tuple[int, int]]] = {}
        for gid, m in zip(self.group_ids, self._managers, strict=True):
            held = getattr(m, HOLD_ATTR, None)
            if not held:
                continue
            for rid, (position, block) in held.items():
                holds.setdefault(str(rid), {})[gid] = (int(position), int(block.block_id))
        return holds

    def attention_cached(self, request: Any) -> int:
        """Prompt tokens of `request` the attention groups have cached from its
        start, in whole attention blocks, in every full-attention group at
        once (the coordinator's phase-1 scan)."""
        attention = [
            (gid, m)
            for gid, m in zip(self.group_ids, self._managers, strict=True)
            if isinstance(m.kv_cache_spec, self._api.FullAttentionSpec)
        ]
        if not attention:
            return 0
        groups = [gid for gid, _ in attention]
        block_size = int(attention[0][1].block_size)
        per_block = block_size // self._hash_unit
        hashes = request.block_hashes
        usable = min(request.num_prompt_tokens // block_size, len(hashes) // per_block)
        cached = 0
        while cached < usable:
            if self._pool.get_cached_block(hashes[(cached + 1) * per_block - 1], groups) is None:
                break
            cached += 1
        return cached * block_size

    def pending_copies(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(
            (gid, int(src.block_id), int(dst.block_id))
            for gid, m in zip(self.group_ids, self._managers, strict=True)
            for src, dst in getattr(m, "_pending_cow_copies", ())
        )

    # ------------------------------------------------------------ hash index

    def prefix_key(self, block_hash: Any) -> str:
        """The prefix key of a KV-cache event's hash: vLLM's bytes, or (with
        VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default) their low 64 bits."""
        self._sync_index()
        if isinstance(block_hash, int):
            if len(self._key_of_int) != len(self._key_of):
                self._key_of_int = {
                    int.from_bytes(h, "big") & _LOW_64: k for h, k in self._key_of.items()
                }
            key = self._key_of_int.get(block_hash)
        else:
            key = self._key_of.get(bytes(block_hash))
        if key is None:
            raise RuntimeError(f"event hash {block_hash!r} names no prefix of this trace")
        return key

    def kv_events(self, raw: Iterable[Any]) -> list[KvEvent]:
        """vLLM's KV-cache events (`BlockStored`, `BlockRemoved`,
        `AllBlocksCleared`), in order, as `KvEvent`s over prefix keys."""
        api = self._api
        events: list[KvEvent] = []
        for event in raw:
            if isinstance(event, api.AllBlocksCleared):
                events.append(KvEvent("cleared"))
            elif isinstance(event, api.BlockRemoved):
                events.extend(
                    KvEvent("removed", int(event.group_idx), (self.prefix_key(h),))
                    for h in event.block_hashes
                )
            elif isinstance(event, api.BlockStored):
                parent = event.parent_block_hash
                parent_key = None if parent is None else self.prefix_key(parent)
                start = 0 if parent_key is None else key_position(parent_key)
                events.append(
                    KvEvent(
                        "stored",
                        int(event.group_idx),
                        tuple(self.prefix_key(h) for h in event.block_hashes),
                        parent_key,
                        start,
                        start + len(event.token_ids),
                        int(event.block_size),
                        str(event.lora_name or ""),
                        int(event.lora_id or 0),
                        event_extras(_event_extra(e) for e in event.extra_keys or ()),
                        _lookahead_tokens(event),
                    )
                )
            else:
                raise RuntimeError(f"unknown KV-cache event {type(event).__name__}")
        return events

    def _sync_index(self) -> None:
        """Enter every new request-level hash into the hash -> key index."""
        unit = self._hash_unit
        key_of = self._key_of
        for rid in self._dirty:
            entry = self._keys[rid]
            hashes = entry.request.block_hashes
            n = len(hashes)
            if entry.mapped >= n:
                continue
            keys = entry.keys
            if len(keys) < n:
                extend_prefix_keys(
                    keys, entry.request.all_token_ids, unit, self._hash_lookahead, entry.inputs
                )
            if len(keys) < n:
                raise RuntimeError(f"{rid}: {n} block hashes but {len(keys)} prefix keys")
            for i in range(entry.mapped, n):
                known = key_of.setdefault(bytes(hashes[i]), keys[i])
                if known != keys[i]:
                    raise RuntimeError(
                        f"{rid}: vLLM hashes its prefix {keys[i]} as it hashes another "
                        f"prefix, {known}: two prefixes share one block hash"
                    )
            entry.mapped = n
        self._dirty.clear()

    def _name(self, hash_with_group: Any) -> str:
        """`g<group>/<prefix key>` for a vLLM BlockHashWithGroupId."""
        name = self._names.get(hash_with_group)
        if name is None:
            api = self._api
            block_hash = bytes(api.get_block_hash(hash_with_group))
            key = self._key_of.get(block_hash)
            if key is None and self._dirty:
                # A hash of tokens grown since the index last saw them.
                self._sync_index()
                key = self._key_of.get(block_hash)
            if key is None:
                raise RuntimeError(
                    f"block hash {bytes(hash_with_group).hex()[:16]}... is no prefix of "
                    "any request in this run"
                )
            name = f"g{int(api.get_group_id(hash_with_group))}/{key}"
            self._names[hash_with_group] = name
        return name

    def _block_views(self) -> tuple[BlockView, ...]:
        """Every block's ref count and hash names.

        Only blocks whose ref count or hashes changed since the last snapshot
        get a new view; finding them is a few C-level passes over the pool.
        """
        blocks = self._pool.blocks
        refs = [b.ref_cnt for b in blocks]
        primary = [b.block_hash for b in blocks]
        secondary = {
            bid: frozenset(hashes)
            for bid, hashes in self._pool.cached_block_hashes_by_block.items()
            if hashes
        }
        last = self._last_views
        if last is None:
            changed: Iterable[int] = range(len(blocks))
            views: list[BlockView] = [BlockView(0)] * len(blocks)
        else:
            views = list(last.views)
            dirty: set[int] = set()
            if refs != last.refs:
                dirty.update(compress(range(len(refs)), map(ne, refs, last.refs)))
            if primary != last.primary:
                dirty.update(compress(range(len(primary)), map(ne, primary, last.primary)))
            if secondary != last.secondary:
                dirty.update(
                    bid
                    for bid in secondary.keys() | last.secondary.keys()
                    if secondary.get(bid) != last.secondary.get(bid)
                )
            changed = dirty
        for bid in changed:
            names: tuple[str, ...] = () if primary[bid] is None else (self._name(primary[bid]),)
            extra = secondary.get(bid)
            if extra:
                names += tuple(sorted(self._name(h) for h in extra))
            views[bid] = BlockView(int(refs[bid]), names)
        self._last_views = _Views(refs, primary, secondary, views)
        return tuple(views)


def _lookahead_tokens(event: Any) -> tuple[tuple[int, ...], ...] | None:
    """A BlockStored's `lookahead_token_ids` (None without lookahead hashes,
    or on a vLLM whose events do not carry them)."""
    lookahead = getattr(event, "lookahead_token_ids", None)
    if lookahead is None:
        return None
    return tuple(tuple(int(t) for t in tokens) for tokens in lookahead)


def _event_extra(entry: Any) -> EventExtra:
    """One block's extra keys as a BlockStored carries them (untagged: a bare
    adapter name or salt, an (identifier, offset) pair per item)."""
    if entry is None:
        return None
    return tuple(k if isinstance(k, str) else (str(k[0]), int(k[1])) for k in entry)
