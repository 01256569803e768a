"""Invariants over a request's life: what one snapshot cannot show.

Each tracker watches every primitive step (the step, what the target
reported, the snapshots before and after) and returns the violations it
finds, each with a `Witness`: the `expect`/`check` values that make the
violation visible when the run is replayed as a trace.

Both trackers read only what the trace format exposes (snapshots, reported
values, `check` values), so they run on any target; the explorer runs them
on the model.

`NoTotalMiss` (no total miss)
    A request P "pins" a Mamba state when it takes part in a copy-on-write:
    the hit source it resumed from (a sub-block hit), or its own partial tail
    moved into a copy block -- sub-block states only: a whole-block key its
    own chunk puts on the copy (a prompt tail on a block boundary) is none,
    the hold does not take it (see README, "Exploring": the decision on
    block-aligned tails). Let h be the newest position P pinned in every
    Mamba group. A follow-up F (prompt `{all_of: P}` + new text) looks up
    while attention still has F's prompt cached through h plus the unit eagle
    drops (rounded up to whole attention blocks): then F's hit is at least h.
    Excused: the state at h went missing while P was not resident (ended,
    preempted, or popped): LRU may evict it then. With the hold on, P holds
    exactly that state while resident, so this holds; with the hold off the
    post-copy release leaves it in the free queue and a burst evicts it while
    P still runs -- the seed's total miss.

`ReservationCoversTailSwap`
    R is the `reserve` op's `blocks` (the full-sequence admission count, with
    the cap) right before the request's admitting allocation, S its
    `step_blocks` (the same count without the admission extras). While the
    request is resident, for each Mamba group count the blocks it pins
    outside its own block table -- its hold and the endpoints of copies it
    queued -- that nothing else references (those it alone keeps out of the
    free queue). Upstream a request has at most one copy in flight per group,
    so that count is at most one per group. Whatever the hold adds beyond it
    must be reserved: the sum over Mamba groups never exceeds
    `mamba groups + (R - S)`. At an allocation the count includes holds that
    allocation released, since a superseded hold is released only after the
    new blocks are taken (the tail swap: held hit source and moved tail at
    once). True for the hold with its +1 per group for a sub-block hit;
    violated by the hold without it. Absolute peaks are no invariant here:
    vLLM 0.33.0's admission count leaves out the state block kept for one
    step behind the running one and a fresh prompt's tail copy, so a
    request's total can pass R with the hold off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvgate.invariants.predicates import Violation
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.snapshot import Snapshot


@dataclass(frozen=True)
class Witness:
    """How a replay shows a violation.

    `expect` is merged into the `expect` of the recorded step at position
    `step` (None: no step's); `check` (if any) is a `check` step to insert
    right after the step the violation was found at.
    """

    step: int | None = None
    expect: Mapping[str, Any] = field(default_factory=dict)
    check: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finding:
    violation: Violation
    witness: Witness


@dataclass(frozen=True)
class Event:
    """One primitive step as the trackers see it."""

    position: int  # index of the step in the recorded run
    step: Step
    observed: Mapping[str, Any]
    before: Snapshot
    after: Snapshot


class World(Protocol):
    """What the trackers may ask about requests (answered by the explorer)."""

    config: Config

    def parent(self, request: str) -> str | None:
        """The request whose `all_of` opens this one's prompt, if any."""

    def prefix_names(self, request: str, group: int) -> dict[str, int]:
        """Hash names (`g<group>/<key>`) of the request's prefix -> position."""

    def attention_cached(self, request: str) -> int: ...


ALLOCATING_OPS = ("allocate", "decode1")
RELEASING_OPS = ("free", "pop")


def own_copies(before: Snapshot, after: Snapshot) -> set[tuple[int, int, int]]:
    """Copies queued by the step between two snapshots."""
    return set(after.pending_copies) - set(before.pending_copies)


_NAMES: dict[int, tuple[Snapshot, frozenset[str]]] = {}


def hash_names(snapshot: Snapshot) -> frozenset[str]:
    """Every hash name in the snapshot (memoized: each snapshot is read as
    one step's `after` and the next step's `before`)."""
    cached = _NAMES.get(id(snapshot))
    if cached is not None and cached[0] is snapshot:
        return cached[1]
    names = frozenset(name for view in snapshot.blocks for name in view.hashes)
    if len(_NAMES) > 8:
        _NAMES.clear()
    _NAMES[id(snapshot)] = (snapshot, names)
    return names


class NoTotalMiss:
    name = "no_total_miss"

    def __init__(self, world: World) -> None:
        self.world = world
        mamba = world.config.mamba_group_ids
        self.mamba = mamba
        # request -> group -> {position: hash name} of the states it pinned
        self.pinned: dict[str, dict[int, dict[int, str]]] = {}
        self.resident: set[str] = set()
        # request -> the newest common position whose state went missing
        # while the request was not resident (LRU may evict it then)
        self.excused: dict[str, int] = {}

    def newest(self, request: str) -> tuple[int, dict[int, str]] | None:
        """(h, {group: hash name at h}) for the newest position pinned in
        every Mamba group."""
        by_group = self.pinned.get(request)
        if by_group is None or any(g not in by_group for g in self.mamba):
            return None
        common = set.intersection(*(set(by_group[g]) for g in self.mamba))
        if not common:
            return None
        h = max(common)
        return h, {g: by_group[g][h] for g in self.mamba}

    def observe(self, event: Event) -> list[Finding]:
        step, req = event.step, event.step.req
        out: list[Finding] = []
        before, after = hash_names(event.before), hash_names(event.after)
        if step.op in ALLOCATING_OPS and req is not None and event.observed.get("ok"):
            self.resident.add(req)
            self.record_copies(req, own_copies(event.before, event.after), event.after)
        elif step.op in RELEASING_OPS and req is not None:
            if step.how == "preempt":
                self.release_on_preemption(req, after)
            self.resident.discard(req)
        elif step.op == "lookup" and req is not None:
            found = self.check_lookup(event, req)
            if found is not None:
                out.append(found)
        self.follow_supersession(event.after)
        for request in self.pinned:
            newest = self.newest(request)
            if newest is None or request in self.resident:
                continue
            # Lost at this very step, with the request not resident: excused.
            # (Lost earlier, while it was resident, is never excused.)
            h, keys = newest
            names = keys.values()
            if all(n in before for n in names) and any(n not in after for n in names):
                self.excused[request] = h
        return out

    def release_on_preemption(self, request: str, after: frozenset[str]) -> None:
        """Preemption releases the request's hold (the seed's patch: every
        free path does); once re-admitted it holds only what its new life
        pins. So a pin still cached now is no promise any more: dropped.
        One already lost while the request was resident stays (the
        follow-up's miss is the hold's fault)."""
        newest = self.newest(request)
        if newest is not None and any(n not in after for n in newest[1].values()):
            return
        self.pinned.pop(request, None)
        self.excused.pop(request, None)

    def follow_supersession(self, after: Snapshot) -> None:
        """The hold keeps one state per group, the newest position: a newer
        one it takes (a moved tail, or with the fork's retention a retired
        whole-block state) releases the older (the seed's patch: "the newest
        position supersedes and releases the older one"). Pins below the
        position a request's hold now holds are dropped with it."""
        for request, groups in after.holds.items():
            pins = self.pinned.get(request)
            if pins is None:
                continue
            for group, (position, _) in groups.items():
                kept = pins.get(group)
                if kept is not None:
                    pins[group] = {p: n for p, n in kept.items() if p >= position}

    def record_copies(
        self, request: str, copies: set[tuple[int, int, int]], after: Snapshot
    ) -> None:
        for group, src, dst in copies:
            if group not in self.mamba:
                continue
            prefix = self.world.prefix_names(request, group)
            block_size = self.world.config.groups[group].block_size
            for block_id in (src, dst):
                for name in after.blocks[block_id].hashes:
                    position = prefix.get(name)
                    # Sub-block states only: the hit source and the moved
                    # partial tail. A whole-block key the request's own
                    # chunk put on its copy (a block-aligned prompt tail)
                    # is no pin: the hold does not take it (the seed keeps
                    # the hit source for a block-aligned prompt) and LRU
                    # may evict it once it leaves the table.
                    if position is not None and position % block_size:
                        self.pinned.setdefault(request, {}).setdefault(group, {})[position] = name

    def check_lookup(self, event: Event, follow_up: str) -> Finding | None:
        parent = self.world.parent(follow_up)
        if parent is None:
            return None
        newest = self.newest(parent)
        if newest is None:
            return None
        h, keys = newest
        if self.excused.get(parent) == h:
            return None
        if any(self.world.prefix_names(follow_up, g).get(name) != h for g, name in keys.items()):
            # The follow-up's prefix is not the parent's up to h: another
            # hash input (a salt, an adapter, an image) keys it apart, so the
            # pinned state was never its to resume from.
            return None
        config = self.world.config
        attention = next((g for g in config.groups if g.kind == "full_attention"), None)
        if attention is None:
            # A pure Mamba model keys no sub-block state, so nothing is pinned.
            return None
        margin = config.hash_unit if config.block_drop else 0
        needed = -(-(h + margin) // attention.block_size) * attention.block_size
        cached = self.world.attention_cached(follow_up)
        hit = event.observed.get("hit")
        if isinstance(hit, int):
            # With a KV connector the request resumes past its local hit by
            # the tokens the connector loads (which may replace a local tail).
            hit += int(event.observed.get("external") or 0)
        if cached < needed or not isinstance(hit, int) or hit >= h:
            return None
        where = "resident" if parent in self.resident else "ended or waiting"
        message = (
            f"{follow_up}'s lookup hit {hit}, below {h}: its parent {parent} ({where}) "
            f"pinned the state at {h} ({', '.join(sorted(keys.values()))}) and attention "
            f"still caches {cached} tokens of {follow_up}'s prompt"
        )
        return Finding(
            Violation(self.name, message),
            Witness(
                step=event.position,
                expect={"hit": h},
                check={"attention_cached": {follow_up: cached}},
            ),
        )


@dataclass
class _Admission:
    reserve_position: int
    blocks: int
    step_blocks: int
    peak: int = 0


class ReservationCoversTailSwap:
    name = "reservation_covers_tail_swap"

    def __init__(self, world: World) -> None:
        self.world = world
        self.mamba = world.config.mamba_group_ids
        self.reserved: dict[str, _Admission] = {}  # reserve seen, not yet admitted
        self.resident: dict[str, _Admission] = {}
        self.copies: dict[tuple[int, int, int], str] = {}  # pending copy -> who queued it

    def observe(self, event: Event) -> list[Finding]:
        step, req = event.step, event.step.req
        if step.op == "reserve" and req is not None and req not in self.resident:
            blocks, step_blocks = event.observed.get("blocks"), event.observed.get("step_blocks")
            if isinstance(blocks, int) and isinstance(step_blocks, int):
                self.reserved[req] = _Admission(event.position, blocks, step_blocks)
        allocating = (
            step.op in ALLOCATING_OPS and req is not None and event.observed.get("ok") is True
        )
        if allocating and req is not None and req not in self.resident:
            admission = self.reserved.pop(req, None)
            if admission is not None:
                self.resident[req] = admission
        if allocating and req is not None:
            for copy in own_copies(event.before, event.after):
                self.copies[copy] = req
        live_copies = set(event.after.pending_copies)
        self.copies = {c: r for c, r in self.copies.items() if c in live_copies}
        if step.op in RELEASING_OPS and req is not None:
            # Freed: what it still pins (copies in flight) is the drain's.
            self.resident.pop(req, None)
            self.reserved.pop(req, None)

        out: list[Finding] = []
        for request, admission in self.resident.items():
            superseded: set[int] = set()
            if allocating and request == req:
                superseded = self.superseded_holds(request, event)
            pinned = self.pinned(request, event.after) | superseded
            allowed = len(self.mamba) + admission.blocks - admission.step_blocks
            admission.peak = max(admission.peak, len(pinned))
            if len(pinned) > allowed:
                out.append(self.finding(request, admission, pinned, allowed, event))
        return out

    def own_refs(self, request: str, snapshot: Snapshot) -> Counter[int]:
        refs: Counter[int] = Counter()
        for ids in snapshot.tables.get(request, ()):
            refs.update(i for i in ids if i != 0)
        refs.update(block_id for _, block_id in snapshot.holds.get(request, {}).values())
        for copy, owner in self.copies.items():
            if owner == request and copy in snapshot.pending_copies:
                refs.update(copy[1:])
        return refs

    def pinned(self, request: str, snapshot: Snapshot) -> set[int]:
        """Blocks the request alone keeps, outside its table, in Mamba groups."""
        refs = self.own_refs(request, snapshot)
        tables = snapshot.tables.get(request, ())
        out: set[int] = set()
        for group in self.mamba:
            candidates: set[int] = set()
            held = snapshot.holds.get(request, {}).get(group)
            if held is not None:
                candidates.add(held[1])
            for copy, owner in self.copies.items():
                if owner == request and copy[0] == group and copy in snapshot.pending_copies:
                    candidates.update(copy[1:])
            table = set(tables[group]) if group < len(tables) else set()
            out.update(
                b for b in candidates - table if b != 0 and snapshot.blocks[b].ref == refs[b]
            )
        return out

    def superseded_holds(self, request: str, event: Event) -> set[int]:
        """Holds this allocation released: still held while it took blocks."""
        before = event.before
        still = set(self.own_refs(request, event.after))
        refs = self.own_refs(request, before)
        return {
            block_id
            for _, block_id in before.holds.get(request, {}).values()
            if block_id not in still and before.blocks[block_id].ref == refs[block_id]
        }

    def finding(
        self,
        request: str,
        admission: _Admission,
        pinned: set[int],
        allowed: int,
        event: Event,
    ) -> Finding:
        extra = admission.blocks - admission.step_blocks
        message = (
            f"{request} was admitted with blocks {admission.blocks} (step_blocks "
            f"{admission.step_blocks}, so {extra} reserved beyond the per-step count) but "
            f"alone pins {len(pinned)} blocks outside its table at {event.step.where()}: "
            f"{sorted(pinned)}; allowed {allowed} ({len(self.mamba)} in-flight copy per "
            f"Mamba group + {extra})"
        )
        covering = admission.step_blocks + len(pinned) - len(self.mamba)
        return Finding(
            Violation(self.name, message),
            Witness(
                step=admission.reserve_position,
                expect={"blocks": covering, "step_blocks": admission.step_blocks},
            ),
        )


Tracker = NoTotalMiss | ReservationCoversTailSwap
TRACKERS: tuple[type[Tracker], ...] = (NoTotalMiss, ReservationCoversTailSwap)
