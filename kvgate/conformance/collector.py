"""How kvgate runs Python's cyclic garbage collector while it reads and
replays traces.

Both build many objects that live as long as the run and sit in no cycle:
a trace's steps, a request's token lists (tens of thousands of items, each
visited whenever the list is scanned), a pool's blocks. CPython's collector
scans the youngest objects every 700 allocations and moves survivors up a
generation at a time, so each long-lived object is scanned again and again
for nothing. Reading turns the collector off and moves what it built to the
oldest generation at once; replaying lets far more allocations pass between
young collections. Both restore the collector as they found it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Allocations between young collections while replaying (CPython's default
# is 700): a replay's garbage is almost all freed by reference counting.
REPLAY_YOUNG_THRESHOLD = 100_000


def _move_to_oldest() -> None:
    """Every tracked object to the oldest generation, unscanned (frozen,
    then unfrozen: CPython's one way to move them), which only a full
    collection scans. Nothing frozen by others is touched."""
    if not gc.get_freeze_count():
        gc.freeze()
        gc.unfreeze()


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """Reading: no collection at all, then what was built moved to the
    oldest generation."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            _move_to_oldest()
            gc.enable()


@contextmanager
def few_young_collections() -> Iterator[None]:
    """Replaying: young collections once every `REPLAY_YOUNG_THRESHOLD`
    allocations, the older generations' thresholds unchanged; at the end,
    what the replay built moved to the oldest generation, rather than
    scanned all at once by the young collection the restored threshold
    would start."""
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, REPLAY_YOUNG_THRESHOLD), middle, old)
    try:
        yield
    finally:
        _move_to_oldest()
        gc.set_threshold(young, middle, old)
