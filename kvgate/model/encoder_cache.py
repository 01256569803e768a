"""The Scheduler's encoder side: which multimodal items a step encodes, and
the encoder cache that keeps their outputs.

A request's items (`HashInputs.mm`) are placeholders in its prompt. Before
a chunk computes tokens over an item, the encoder must have encoded it, in
this step or before (its output still cached). An item is encoded whole,
within the step's encoder budget and with room in the cache; when it cannot
be, the chunk stops right before it (or, when the request's computed tokens
are already past its start, nothing runs). The cache counts encoder
embeddings (an item's length: kvgate's items are embeddings throughout),
shares an item by its id between requests, and makes an item no request
holds evictable, evicting the oldest such item when it needs room.

A request holds its items from their encoding (or a cache hit) until the
tokens over them are computed (after the step's output), and gives back
every item when it is preempted, finished or aborted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvgate.vocabulary.tokens import MmItem


@dataclass
class EncoderPlan:
    """What a chunk's encoder scheduling decided, applied only once the chunk
    is allocated: the items it encodes and the cache hits among items
    this step encodes for it already, by index; the chunk's tokens after the
    cut; the step's encoder budget left after them."""

    encode: list[int]
    repeated: list[int]
    tokens: int
    budget_left: int


@dataclass
class EncoderCache:
    """The encoder cache, in encoder embeddings."""

    size: int
    free: int = field(init=False)
    # Free plus what evicting the items nobody holds would free.
    reclaimable: int = field(init=False)
    # item id -> the requests holding it
    holders: dict[str, set[str]] = field(default_factory=dict)
    # item id -> its embeddings, while cached
    lengths: dict[str, int] = field(default_factory=dict)
    # request -> {item index: item id} of the items it holds
    held: dict[str, dict[int, str]] = field(default_factory=dict)
    # items nobody holds, in the order they became so (evicted first to last)
    evictable: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.free = self.reclaimable = self.size

    def hit(self, req: str, index: int, item: MmItem) -> bool:
        """`req` holds the cached item `item` (its `index`-th); False when
        it is not cached."""
        holders = self.holders.get(item.identifier)
        if holders is None:
            return False
        if not holders:
            self.reclaimable -= self.evictable.pop(item.identifier)
        holders.add(req)
        self.held.setdefault(req, {})[index] = item.identifier
        return True

    def fits(self, length: int, budget: int, planned: int) -> bool:
        """An item of `length` embeddings can be encoded within the step's
        `budget` left, next to the `planned` embeddings this chunk encodes
        already; evicts what it needs to make room."""
        if length > budget:
            return False
        need = length + planned
        if need > self.reclaimable:
            return False
        while need > self.free:
            identifier, freed = self.evictable.popitem(last=False)
            del self.holders[identifier]
            del self.lengths[identifier]
            self.free += freed
        return True

    def store(self, req: str, index: int, item: MmItem) -> None:
        """`req`'s item encoded this step: its output takes its room."""
        self.holders.setdefault(item.identifier, set()).add(req)
        self.lengths.setdefault(item.identifier, item.length)
        self.held.setdefault(req, {})[index] = item.identifier
        self.free -= item.length
        self.reclaimable -= item.length

    def release(self, req: str, index: int) -> None:
        """`req` no longer needs its `index`-th item. The item becomes
        evictable once nobody holds it (a request holding the same item at
        another index still does)."""
        held = self.held.get(req, {})
        identifier = held.pop(index, None)
        if identifier is None:
            return
        if not held:
            del self.held[req]
        holders = self.holders.get(identifier)
        if not holders or identifier in held.values():
            return
        holders.discard(req)
        if not holders:
            self.evictable[identifier] = self.lengths[identifier]
            self.reclaimable += self.lengths[identifier]

    def forget(self, req: str, index: int) -> None:
        """`req`'s `index`-th item, stored for a chunk that then never ran,
        given back and uncached once nobody holds it: its encoder output was
        never computed, so no later chunk may find it cached."""
        identifier = self.held.get(req, {}).get(index)
        self.release(req, index)
        if identifier is not None and identifier in self.evictable:
            self.free += self.evictable.pop(identifier)
            del self.holders[identifier]
            del self.lengths[identifier]

    def release_all(self, req: str) -> None:
        """Every item `req` holds given back (preempted, finished, aborted)."""
        for index in sorted(self.held.get(req, {})):
            self.release(req, index)

    def release_computed(self, req: str, items: tuple[MmItem, ...], computed: int) -> None:
        """After a step's output: the items whose tokens are all computed."""
        for index in sorted(self.held.get(req, {})):
            if items[index].end <= computed:
                self.release(req, index)

    def holds(self) -> dict[str, list[int]]:
        """Each request's held items, by index (for tests and reports)."""
        return {req: sorted(held) for req, held in self.held.items()}

    def plan(
        self,
        req: str,
        items: tuple[MmItem, ...],
        computed: int,
        tokens: int,
        budget: int,
        shift: int = 0,
    ) -> EncoderPlan:
        """The encoder scheduling of a chunk of `tokens` from `computed`: the
        items over its window (the chunk and the `shift` tokens a drafter
        reads past it), in order, each a cache hit, a repeat of an item this
        chunk encodes already, or encoded; the first that cannot be cuts the
        chunk before it."""
        plan = EncoderPlan([], [], tokens, budget)
        if tokens == 0 or not items:
            return plan
        end = computed + tokens + shift
        planned: Counter[str] = Counter()
        embeddings = 0
        for index, item in enumerate(items):
            if item.end <= computed:
                continue
            if item.offset >= end:
                break
            if item.identifier in planned:
                plan.repeated.append(index)
                continue
            if self.hit(req, index, item):
                continue
            if not self.fits(item.length, plan.budget_left, embeddings):
                plan.tokens = min(tokens, item.offset - computed) if computed < item.offset else 0
                break
            planned[item.identifier] += 1
            embeddings += item.length
            plan.budget_left -= item.length
            plan.encode.append(index)
        return plan

    def commit(self, req: str, items: tuple[MmItem, ...], plan: EncoderPlan) -> None:
        """A chunk was allocated: its planned items stored, its repeats held."""
        for index in plan.encode:
            self.store(req, index, items[index])
        for index in plan.repeated:
            self.hit(req, index, items[index])
