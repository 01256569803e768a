"""KV-cache residency metrics (vLLM's `--kv-cache-metrics`) as both targets
report them, and as a trace expects them.

With `kv_cache_metrics` on, vLLM's block pool reports to a metrics collector
every block it hands out (`get_new_blocks`: a new residency starts), every
prefix hit on a block (`touch`: one access) and every block it takes back
for reuse while caching is on (`_maybe_evict_cached_block`, hashed or not:
the residency ends). An ended residency is an eviction event carrying the
block's lifetime, its idle time before the eviction and the gaps between its
last (at most four) accesses; the Scheduler drains the events into the
metrics users graph. The times are wall clock; which residencies end, in
which order, and how many reuse gaps each carries are functions of the
manager's history, and that is what is compared:

- `evicted`: events drained;
- `reuse_gaps`: how many of them carry 0, 1, 2 and 3 reuse gaps (a list of
  four counts, the histogram's shape);
- `evictions` (lockstep only): one line per event, in drain order,
  `block <id> gaps <n>`.

Only sample rate 1.0 is modelled: below it vLLM samples blocks at random.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# vLLM keeps a block's last four access times, so an event carries at most
# three reuse gaps (the gaps between consecutive kept accesses).
KEPT_ACCESSES = 4
MAX_REUSE_GAPS = KEPT_ACCESSES - 1


def reuse_gaps(accesses: int) -> int:
    """The reuse gaps an eviction event carries for a block accessed
    `accesses` times since it was handed out (its allocation is no access)."""
    return max(0, min(accesses, KEPT_ACCESSES) - 1)


@dataclass(frozen=True)
class Eviction:
    """One eviction event: the block whose residency ended, its reuse gaps.
    `flaw` names a timing that cannot be (a target's own sanity check of
    the wall-clock values it does not compare); empty when sound."""

    block_id: int
    reuse_gaps: int
    flaw: str = ""

    def line(self) -> str:
        text = f"block {self.block_id} gaps {self.reuse_gaps}"
        return f"{text} ({self.flaw})" if self.flaw else text


def report(evictions: Sequence[Eviction]) -> dict[str, Any]:
    """The `residency` op's values for the events drained."""
    # Four counts; longer only if a target reports more gaps than vLLM keeps.
    width = max([MAX_REUSE_GAPS, *(e.reuse_gaps for e in evictions)]) + 1
    histogram = [0] * width
    for eviction in evictions:
        histogram[eviction.reuse_gaps] += 1
    return {
        "evicted": len(evictions),
        "reuse_gaps": histogram,
        "evictions": [e.line() for e in evictions],
    }
