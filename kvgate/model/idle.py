"""Idle steps: a running request's steps that add, free and key no block.

Most decodes are idle: a block fills every `block_size` tokens, so between
two boundaries `allocate_slots` and the output's re-cache find nothing to do
in any group. The coordinator proves one step idle in full (each group's
`idle_step` and `nothing_to_key`), then asks the groups how far the counts
can grow before anything could change (`idle_limits`). Until they pass those
limits, or the request's tables change, later steps are idle at the cost of
a few comparisons.

Why a window stays true while it is kept: every limit bounds a count from
above, and each group's idleness holds for smaller counts too (the prompt's
tail, the one exception, is bounded from below by the keyed count the window
starts at: counts only grow while a request runs). Steps that allocate,
adopt a hit, key a block or free the request drop the window; releasing
skipped states keeps it, since that only moves a group further from its
next change.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_LIMIT = 1 << 62


@dataclass(frozen=True, slots=True)
class IdleWindow:
    """The counts (inclusive) a request's steps stay idle within, and what
    else must stand: its keys not rewritten, and where a prompt's tail can
    change with dropped keys, the pool's count of them."""

    max_processed: int
    max_slots: int
    max_tokens_main: int
    min_keyed: int
    max_keyed: int
    keys_rewritten: int
    keys_dropped: int | None

    def covers(
        self,
        num_processed: int,
        num_slots: int,
        num_tokens_main: int,
        num_keyed: int,
        keys_rewritten: int,
        keys_dropped: int,
    ) -> bool:
        return (
            num_processed <= self.max_processed
            and num_slots <= self.max_slots
            and num_tokens_main <= self.max_tokens_main
            and self.min_keyed <= num_keyed <= self.max_keyed
            and keys_rewritten == self.keys_rewritten
            and (self.keys_dropped is None or keys_dropped == self.keys_dropped)
        )

    def covers_keying(self, num_keyed: int, keys_rewritten: int, keys_dropped: int) -> bool:
        """Whether keying the request to `num_keyed` computed tokens is idle."""
        return (
            self.min_keyed <= num_keyed <= self.max_keyed
            and keys_rewritten == self.keys_rewritten
            and (self.keys_dropped is None or keys_dropped == self.keys_dropped)
        )
