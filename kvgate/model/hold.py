"""The partial-tail checkpoint hold (the patched behaviour; off = upstream).

With a hash unit finer than the Mamba block, a request that resumed at a
partial tail keys no block-boundary state of its own: its only reusable
state is its own tail, moved into a copy block that no table references. The
hold gives that block a ref owned by the request until the request is freed,
so concurrent allocation cannot evict it:

- a running request holds the copy its tail keys moved to;
- a new request holds the hit source it copied from (it may stop before
  reaching its own tail);
- only the newest position is held: a newer one releases the older;
- when a producer moves its keys to a copy, holds on the source follow them;
- admission reserves one more block per Mamba group for a partial-tail hit
  (the held source and the moved tail coexist for a step);
- every free path releases the holds last, after the request's blocks;
- with prefill checkpoint blocks the prompt's partial tail is exported into
  a spare column instead of the running block, so no copy moves it: it
  leaves the table at the next step, and the hold takes it then (`retire`,
  sub-block positions only: the states the hold is about).

`retire` is the production fork's older retention (config `retain_retired`),
which the same hold map carries: of the keyed states that leave a request's
table behind its running one, the newest is held (its table ref becomes the
hold's) if newer than the request's hold, which it then supersedes.
"""

from __future__ import annotations

from typing import NamedTuple

from kvgate.model.pool import Block, BlockPool


class Held(NamedTuple):
    """A request's hold in one Mamba group: the held block and the token
    position of the state it keeps (a newer position supersedes it)."""

    position: int
    block: Block


class Holds:
    def __init__(self, pool: BlockPool, enabled: bool, retain_retired: bool = False) -> None:
        self.pool = pool
        self.enabled = enabled
        self.retain_retired = retain_retired
        # group id -> request id -> its hold there
        self.by_group: dict[int, dict[str, Held]] = {}

    def held(self, group_id: int, request_id: str) -> Held | None:
        return self.by_group.get(group_id, {}).get(request_id)

    def hold(self, group_id: int, request_id: str, block: Block) -> bool:
        """Hold `block`'s keyed state for the request, if newer than its hold."""
        if not self.enabled or block.is_null or block.hash is None:
            return False
        assert block.hash_tokens is not None
        position = block.hash_tokens
        holds = self.by_group.setdefault(group_id, {})
        current = holds.get(request_id)
        if current is not None and (current.block is block or current.position >= position):
            return False
        self.pool.touch([block])
        holds[request_id] = Held(position, block)
        if current is not None:
            self.pool.free_blocks([current.block])
        return True

    def retire(
        self, group_id: int, request_id: str, retired: list[Block], block_size: int
    ) -> list[Block]:
        """Blocks leaving the request's table: hold the newest keyed one if
        it is newer than the hold; return the blocks the caller frees (the
        rest, then a superseded hold). With the tail hold alone, only a
        partial tail (a sub-block position: a prefill checkpoint's) counts."""
        if not (self.retain_retired or self.enabled):
            return retired
        newest: Block | None = None
        for block in retired:
            position = block.hash_tokens
            if position is None or (not self.retain_retired and position % block_size == 0):
                continue
            if newest is None or position > (newest.hash_tokens or 0):
                newest = block
        if newest is None or newest.hash_tokens is None:
            return retired
        holds = self.by_group.setdefault(group_id, {})
        current = holds.get(request_id)
        if current is not None and current.position >= newest.hash_tokens:
            return retired
        holds[request_id] = Held(newest.hash_tokens, newest)  # the table's ref, now the hold's
        rest = [block for block in retired if block is not newest]
        return rest + ([current.block] if current is not None else [])

    def follow_moved_keys(self, group_id: int, owner: str, source: Block, copy: Block) -> None:
        """Other requests holding `source` now hold `copy`, where its keys went."""
        holds = self.by_group.get(group_id, {})
        for request_id, (position, block) in list(holds.items()):
            if request_id != owner and block is source:
                self.pool.touch([copy])
                holds[request_id] = Held(position, copy)
                self.pool.free_blocks([source])

    def release(self, request_id: str) -> list[Block]:
        """Forget the request's holds (group order); the caller frees them."""
        released = []
        for group_id in sorted(self.by_group):
            entry = self.by_group[group_id].pop(request_id, None)
            if entry is not None:
                released.append(entry.block)
        return released

    def admission_extra(
        self,
        group_id: int,
        request_id: str,
        partial_hit: bool,
        num_tokens: int,
        block_size: int,
        hit_has_block: bool,
        more_partial_states: bool = False,
    ) -> int:
        """The extra block admission reserves in one group for a block the
        request will hold outside its table (none once it holds one):

        - the tail hold, for a partial-tail hit: the held source and the
          moved tail coexist for one step;
        - the tail hold where a request keys sub-block states besides its
          prompt's tail (`more_partial_states`: prefill checkpoint blocks, or
          the shared-prefix checkpoint), with a unit finer than the block: a
          held one and a moved tail may coexist for one step;
        - with retired states retained too (the fork), for a prompt that will
          retire one (longer than a block) unless a hit brings the block it
          holds; a prompt within one block retires none, but with the tail
          hold and a unit finer than the block its own tail is held.
        """
        if self.held(group_id, request_id):
            return 0
        if self.enabled and partial_hit:
            return 1
        if self.enabled and more_partial_states and self.pool.hash_unit < block_size:
            return 1
        if not self.retain_retired:
            return 0
        if num_tokens <= block_size:
            return int(self.enabled and self.pool.hash_unit < block_size)
        return 0 if hit_has_block else 1

    def as_positions(self) -> dict[str, dict[int, tuple[int, int]]]:
        """{request: {group: (position, block id)}}."""
        out: dict[str, dict[int, tuple[int, int]]] = {}
        for group_id in sorted(self.by_group):
            for request_id, held in self.by_group[group_id].items():
                out.setdefault(request_id, {})[group_id] = (held.position, held.block.block_id)
        return out
