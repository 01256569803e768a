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

from contextlib import closing
from dataclasses import replace

import pytest

from kvgate.explore.knobs import SEED_CONFIG
from kvgate.explore.session import ALL_INVARIANTS, ExploreFailure, Session, follow_up, fresh


def _hit(session: Session, req: str) -> int:
    """The hit of a lookup of `req`."""
    hit = session.run("lookup", req=req)["hit"]
    assert isinstance(hit, int)
    return hit


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
    config = replace(SEED_CONFIG, hold=hold, retain_retired=retired)
    with closing(Session(config, ALL_INVARIANTS)) as session:
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
        return _hit(session, "F")


def test_a_block_aligned_tail_is_no_pin_the_held_source_is() -> None:
    assert _block_aligned_resume(hold=True) == 48


def test_the_fork_retention_keeps_the_whole_block_tail_too() -> None:
    assert _block_aligned_resume(hold=True, retired=True) == 64


def test_without_the_hold_the_same_run_is_a_total_miss() -> None:
    with pytest.raises(ExploreFailure) as failure:
        _block_aligned_resume(hold=False)
    assert failure.value.invariant == "no_total_miss"
    assert failure.value.witness.expect == {"hit": 48}


# The hold lets go of a pinned state in two ways the seed's patch specifies,
# and the tracker follows both (found by the matrix campaign, model and
# vLLM with the overlay agreeing): preemption releases the hold (every free
# path does), and a newer state the hold takes supersedes the older one.


def _run(session: Session, steps: list[tuple[str, dict[str, object]]]) -> None:
    for op, fields in steps:
        session.run(op, **fields)


def _decoded(req: str, steps: int, spec: int = 0) -> list[tuple[str, dict[str, object]]]:
    return [s for _ in range(steps) for s in (("decode1", {"req": req, "spec": spec}),
                                             ("drain", {}))]  # fmt: skip


def _preempted_then_follow_up(
    hold: bool, evict_while_running: bool = False, prompt: int = 65, lookahead: int = 0
) -> int:
    """R0 (tail at 56) decodes, is preempted and re-admitted at the
    whole-block state 64 (no partial hit: it holds nothing in its new
    life); a burst evicts its old tail; its follow-up looks up."""
    config = replace(
        SEED_CONFIG, hold=hold, retention_interval=None, hash_lookahead_tokens=lookahead
    )
    with closing(Session(config, ALL_INVARIANTS)) as session:
        session.run("arrive", req="R0", prompt=fresh(prompt))
        _prefill(session, "R0")
        _run(session, _decoded("R0", 7))
        if evict_while_running:  # the seed's bug: the tail lost while R0 runs
            session.run("evict", blocks="all")
        session.run("free", req="R0", how="preempt")
        _prefill(session, "R0")
        _run(session, _decoded("R0", 1, spec=3))
        session.run("arrive", req="R2", prompt=follow_up("R0", 1))
        session.run("evict", blocks="all")
        return _hit(session, "R2")


# Eagle's drop, and lookahead hashes (the earlier finding with
# `hash_lookahead_tokens` 1: a preempted request re-admitted, then a burst).
@pytest.mark.parametrize(("prompt", "lookahead"), [(65, 0), (64, 1)])
def test_a_pin_still_cached_at_preemption_is_released_with_the_hold(
    prompt: int, lookahead: int
) -> None:
    # Before: R0's first-life tail (56) counted as pinned after re-admission.
    assert _preempted_then_follow_up(hold=True, prompt=prompt, lookahead=lookahead) == 0


def test_a_pin_lost_while_running_still_fires_after_preemption() -> None:
    with pytest.raises(ExploreFailure) as failure:
        _preempted_then_follow_up(hold=False, evict_while_running=True)
    assert failure.value.invariant == "no_total_miss"


def _superseded_by_a_retired_state() -> int:
    """Eagle, a block-aligned prompt (32): the moved tail (24) is held, then
    the fork's retention retires the whole-block state 32 and the hold takes
    it instead; a burst evicts 24. The follow-up (35 tokens) can reach 32
    only once attention caches 40 (eagle's drop): it resumes at 0."""
    config = replace(SEED_CONFIG, hold=True, retain_retired=True, retention_interval=None)
    with closing(Session(config, ALL_INVARIANTS)) as session:
        session.run("arrive", req="R0", prompt=fresh(32))
        _prefill(session, "R0")
        _run(session, [("decode1", {"req": "R0"}), ("drain", {})])
        session.run("decode1", req="R0", spec=3)
        assert {pos for pos, _ in session.last.holds["R0"].values()} == {32}
        session.run("arrive", req="R1", prompt=follow_up("R0", 1))
        session.run("evict", blocks="all")
        return _hit(session, "R1")


def test_a_pin_superseded_by_the_hold_is_released_with_it() -> None:
    # Before: the tail at 24 still counted as pinned once the hold held 32.
    assert _superseded_by_a_retired_state() == 0


def test_a_follow_up_keyed_apart_by_a_hash_input_owes_nothing_to_its_parent() -> None:
    """F opens with A's tokens but under a tenant's salt: A's pinned state at
    48 was never F's to resume from. G (the same tenant, same prefix) cached
    attention for F's prompt and left salted states F hits (32, below 48):
    no violation (exploration found the parent's pin wrongly applied once
    requests drew hash inputs)."""
    config = replace(SEED_CONFIG, hold=True)
    with closing(Session(config, ALL_INVARIANTS)) as session:
        session.run("arrive", req="A", prompt=fresh(60))  # tail at 48, pinned
        _prefill(session, "A")
        _decode(session, "A", 1)
        _run(session, [("free", {"req": "A", "how": "finish"}), ("drain", {})])
        session.run("arrive", req="G", prompt=follow_up("A", 11), cache_salt="tenant")
        _prefill(session, "G")
        _decode(session, "G", 1)
        _run(session, [("free", {"req": "G", "how": "finish"}), ("drain", {})])
        session.run("arrive", req="F", prompt=follow_up("A", 11), cache_salt="tenant")
        assert _hit(session, "F") == 32
        assert session.attention_cached("F") >= 48
