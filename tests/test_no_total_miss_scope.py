"""`no_total_miss` covers what the hold guarantees: sub-block states.

P resumes at A's partial tail (48, inside a 32-token Mamba block) and its
own prompt tail lands on a block boundary (64). The hold keeps the hit
source (48), as the seed's patch specifies for a block-aligned prompt; the
whole-block state at 64 leaves P's table and LRU may evict it. After a
burst, P's follow-up resumes at 48: no total miss, and no violation. With
the hold off the same run misses to 0 and the invariant fires; with the
fork's retention the retired whole-block state is held and it resumes at 64.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvgate.explore.knobs import SEED_CONFIG
from kvgate.explore.session import ALL_INVARIANTS, ExploreFailure, Session, follow_up, fresh


def _prefill(session: Session, req: str) -> None:
    session.run("lookup", req=req)
    session.run("reserve", req=req)
    while session.requests[req].phase != "decoding":
        session.run("allocate", req=req, tokens="auto", lookahead=0)
        session.run("step")
        session.run("drain")


def _decode(session: Session, req: str, steps: int) -> None:
    for _ in range(steps):
        session.run("decode1", req=req, spec=3)
        session.run("step")
        session.run("drain")


def _block_aligned_resume(hold: bool, retired: bool = False) -> int:
    """The follow-up's hit (raises ExploreFailure on a violation)."""
    config = replace(SEED_CONFIG, hold=hold, hold_retired=retired)
    session = Session(config, ALL_INVARIANTS)
    try:
        session.run("arrive", req="A", prompt=fresh(60))  # tail at 48: mid-block
        _prefill(session, "A")
        _decode(session, "A", 1)
        session.run("free", req="A", how="finish")
        session.run("drain")
        session.run("arrive", req="P", prompt=follow_up("A", 11))  # tail at 64: a boundary
        assert session.run("lookup", req="P")["hit"] == 48
        session.run("reserve", req="P")
        while session.requests["P"].phase != "decoding":
            session.run("allocate", req="P", tokens="auto", lookahead=0)
            session.run("step")
            session.run("drain")
        _decode(session, "P", 2)
        session.run("evict", blocks="all")
        session.run("arrive", req="F", prompt=follow_up("P", 9))
        hit = session.run("lookup", req="F")["hit"]
        assert isinstance(hit, int)
        return hit
    finally:
        session.close()


def test_a_block_aligned_tail_is_no_pin_the_held_source_is() -> None:
    assert _block_aligned_resume(hold=True) == 48


def test_the_fork_retention_keeps_the_whole_block_tail_too() -> None:
    assert _block_aligned_resume(hold=True, retired=True) == 64


def test_without_the_hold_the_same_run_is_a_total_miss() -> None:
    with pytest.raises(ExploreFailure) as failure:
        _block_aligned_resume(hold=False)
    assert failure.value.invariant == "no_total_miss"
    assert failure.value.witness.expect == {"hit": 48}
