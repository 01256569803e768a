"""The abstraction function: a concrete model state in the Z3 vocabulary.

`observe` reads a `ModelTarget` (the executable model behind the op driver)
and returns the value of every non-ghost field of `vocabulary.FIELDS`. Ghost
fields have no concrete counterpart; `Drift` carries them along a run,
taking each step's ghost values from the Z3 model that admitted the step.

`Drift` is the check that the proofs are about the machine the gate
replays: each concrete step must be admitted by the op's transition
relation, `T(alpha(s), alpha(s'))` satisfiable with every observed value
fixed, and every abstract state reached must satisfy every proved property.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import z3

from kvgate.invariants.z3.properties import PROPERTIES, init
from kvgate.invariants.z3.transitions import Encoding, acts_on_request
from kvgate.invariants.z3.vocabulary import (
    ABSENT,
    ENDED,
    FIELDS,
    POPPED,
    RUNNING,
    WAITING,
    Bounds,
    State,
    Values,
)
from kvgate.model.mamba import MambaManager
from kvgate.model.mutations import superseded_holds
from kvgate.model.target import ModelTarget
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import LIVE
from kvgate.vocabulary.tokens import key_position

GHOSTS = tuple(f.name for f in FIELDS if f.ghost)
FIELD_NAMES = tuple(f.name for f in FIELDS)


def bounds_of(config: Config, requests: int) -> Bounds:
    return Bounds(blocks=config.num_blocks, requests=requests, groups=len(config.groups))


def observe(target: ModelTarget, names: Mapping[str, int], bounds: Bounds) -> Values:
    """The non-ghost fields of `target`'s state; `names` numbers requests
    (every request the target knows must have a number)."""
    if set(target.requests) - set(names):
        raise ValueError(f"unnumbered requests: {sorted(set(target.requests) - set(names))}")
    pool = target.pool
    coordinator = target.manager.coordinator
    managers = coordinator.managers
    out: Values = {f.name: {} for f in FIELDS if not f.ghost}
    out["hold_on"][()] = target.config.hold
    out["retain_retired"][()] = target.config.retain_retired
    for m in bounds.mamba_ids:
        mamba = managers[m]
        out["more_partial_states"][m] = (
            isinstance(mamba, MambaManager)
            and (mamba.has_prefill_checkpoints or mamba.shared_prefix_checkpoint)
            and pool.hash_unit < mamba.block_size
        )
    copy_ends = {b: 0 for b in bounds.block_ids}
    # `block_group` is a ghost only for a block nothing uses: a used or keyed
    # block's group is observed (its keys', its table's, its pending copy's,
    # its hold's).
    out["block_group"] = {}
    for manager in managers:
        for src, dst in manager.pending_copies:
            copy_ends[src.block_id] += 1
            copy_ends[dst.block_id] += 1
            out["block_group"][src.block_id] = out["block_group"][dst.block_id] = manager.group_id
        for table in manager.tables.values():
            out["block_group"].update(
                (blk.block_id, manager.group_id) for blk in table if not blk.is_null
            )
    for group_id, by_request in coordinator.holds.by_group.items():
        out["block_group"].update((h.block.block_id, group_id) for h in by_request.values())
    for b in bounds.block_ids:
        block = pool.blocks[b]
        out["ref"][b] = block.ref
        out["free"][b] = b in pool.free_queue
        keys = pool.keys_of(block)
        out["keyed"][b] = bool(keys)
        if keys:
            out["block_group"][b] = keys[0][0]
        out["tail_keyed"][b] = any(
            key_position(prefix) % managers[group].block_size for group, prefix in keys
        )
        out["copy_ends"][b] = copy_ends[b]
    by_number = {r: name for name, r in names.items()}
    for r in bounds.request_ids:
        # A request slot no request has taken yet reads as absent.
        name = by_number.get(r, "")
        pending = target.requests.get(name) if name else None
        live = pending is not None and pending.phase in LIVE
        rid = name
        if pending is None:
            phase = ABSENT
        elif name in target.popped:
            phase = POPPED
        elif pending.phase not in LIVE:
            phase = ENDED
        else:
            phase = RUNNING if target.has_blocks(pending.request) else WAITING
        out["phase"][r] = phase
        out["has_hit"][r] = live and pending is not None and pending.has_hit
        hits, sources = _lookup(target, pending.hit_blocks if live and pending else None, pending)
        popped: dict[int, int] = {}
        for block in target.popped.get(name, []):
            if not block.is_null:
                popped[block.block_id] = popped.get(block.block_id, 0) + 1
        for b in bounds.block_ids:
            out["popped"][r, b] = popped.get(b, 0)
        for g in bounds.group_ids:
            in_table = {blk.block_id for blk in managers[g].tables.get(rid, []) if not blk.is_null}
            for b in bounds.block_ids:
                out["table"][r, g, b] = b in in_table
                out["hit"][r, g, b] = b in hits.get(g, ())
                out["hit_source"][r, g, b] = sources.get(g) == b
        for m in bounds.mamba_ids:
            mamba = managers[m]
            tail = mamba.partial_hits.get(rid) if isinstance(mamba, MambaManager) else None
            held = coordinator.holds.held(m, rid)
            holding = {held.block.block_id} if held is not None else set()
            # A mutated model may keep holds outside the map (see there).
            holding |= {
                blk.block_id for blk in superseded_holds(coordinator.holds).get((m, rid), [])
            }
            for b in bounds.block_ids:
                out["pending_tail"][r, m, b] = tail is not None and tail[1].block_id == b
                out["hold"][r, m, b] = b in holding
    return out


def _lookup(
    target: ModelTarget, hit_blocks: Any, pending: Any
) -> tuple[dict[int, set[int]], dict[int, int]]:
    """The blocks a first allocation would adopt from a pending lookup, per
    group, and each group's partial-hit source (as `add_hit_blocks` picks them)."""
    hits: dict[int, set[int]] = {}
    sources: dict[int, int] = {}
    if hit_blocks is None:
        return hits, sources
    num_local = pending.hit  # a first allocation: nothing computed yet
    for g, manager in enumerate(target.manager.coordinator.managers):
        found = list(hit_blocks[g])
        skipped = manager.skipped_tokens(num_local) // manager.block_size
        kept = [b for b in (found[skipped:] if skipped > 0 else found) if not b.is_null]
        hits[g] = {b.block_id for b in kept}
        if manager.has_partial_hit(kept, num_local):
            sources[g] = kept[-1].block_id
    return hits, sources


def init_ghosts(bounds: Bounds) -> Values:
    """The ghost fields of a fresh manager (`properties.init`'s values)."""
    s = State(bounds, "init")
    solver = z3.Solver()
    solver.add(init(s))
    for b in bounds.block_ids:
        solver.add(s.block_group[b] == 0)  # never taken: any group; pick the first
    assert solver.check() == z3.sat
    values = s.evaluate(solver.model())
    return {name: values[name] for name in GHOSTS}


@dataclass(frozen=True)
class Verdict:
    """A concrete step against the encoding."""

    not_admitted: tuple[str, ...]  # why T rejects it (an unsat core), or ()
    violated: tuple[str, ...]  # property instances false after it

    @property
    def ok(self) -> bool:
        return not self.not_admitted and not self.violated


@dataclass
class Drift:
    """Checks a concrete run step by step against the encoding."""

    bounds: Bounds
    mutation: str = "clean"
    ghosts: Values = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.ghosts:
            self.ghosts = init_ghosts(self.bounds)

    def step(self, op: str, r: int | None, pre: Values, post: Values) -> Verdict:
        """Check one concrete step: is it admitted, and does every proved
        property hold in the abstract state it reaches?"""
        solver, s, t, props = self._solver(op, r)
        # Observed values win over carried ghosts (`block_group` is partly observed).
        known = {name: {**self.ghosts.get(name, {}), **pre.get(name, {})} for name in FIELD_NAMES}
        fixed = s.literals(known) + t.literals(post)
        if solver.check(*fixed) != z3.sat:
            return Verdict(tuple(sorted(str(c) for c in solver.unsat_core())), ())
        model = solver.model()
        self.ghosts = t.evaluate(model, GHOSTS)
        violated: tuple[str, ...] = ()
        if not z3.is_true(model.eval(props, model_completion=True)):
            violated = tuple(
                i.name
                for prop in PROPERTIES
                for i in prop.instances(t, self.bounds)
                if z3.is_false(model.eval(i.expr, model_completion=True))
            )
        return Verdict((), violated)

    def _solver(self, op: str, r: int | None) -> tuple[Any, State, State, Any]:
        return _transition_solver(self.mutation, self.bounds, op, r)


@functools.lru_cache(maxsize=256)
def _transition_solver(
    mutation: str, bounds: Bounds, op: str, r: int | None
) -> tuple[Any, State, State, Any]:
    """One solver per transition, kept across runs: a step only adds
    assumptions (the observed values), so the solver is reusable."""
    s, t = State(bounds, "s"), State(bounds, "t")
    solver = z3.Solver()
    for name, clause in Encoding(bounds, mutation).transition(op, s, t, r, "x"):
        solver.assert_and_track(clause, z3.Bool(name))
    props = z3.And([p.holds(t) for p in PROPERTIES])
    return solver, s, t, props


def acting(op: str, req: str | None, names: Mapping[str, int]) -> int | None:
    """The request a step of `op` acts on, as the encoding numbers it."""
    return names[req] if acts_on_request(op) and req is not None else None
