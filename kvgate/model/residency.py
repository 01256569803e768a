"""The residency metrics collector (vLLM's `KVCacheMetricsCollector` at
sample rate 1.0), without its clock: per block handed out, how many
accesses it had since; per residency ended, an eviction event.

The pool reports to it where vLLM's pool reports to vLLM's: each block it
hands out (a new residency, replacing any untaken one), each prefix hit on a
block, each block it evicts from the prefix cache (an event only for a block
with a residency, which ends). A successful prefix-cache reset forgets every
residency and every event not yet drained.
"""

from __future__ import annotations

from kvgate.vocabulary.residency import Eviction, reuse_gaps


class Residency:
    def __init__(self) -> None:
        # block id -> accesses since it was handed out
        self.accesses: dict[int, int] = {}
        self.events: list[Eviction] = []

    def allocated(self, block_id: int) -> None:
        self.accesses[block_id] = 0

    def accessed(self, block_id: int) -> None:
        if block_id in self.accesses:
            self.accesses[block_id] += 1

    def evicted(self, block_id: int) -> None:
        accesses = self.accesses.pop(block_id, None)
        if accesses is not None:
            self.events.append(Eviction(block_id, reuse_gaps(accesses)))

    def reset(self) -> None:
        self.accesses.clear()
        self.events.clear()

    def drain(self) -> list[Eviction]:
        events, self.events = self.events, []
        return events
