"""The proof for every pool size: each invariant and lemma of
`unbounded_properties.py` checked inductive over each op of
`unbounded_transitions.py`.

`prove_unbounded` checks `init => P` and `I(s) and T_op(s, t) => P(t)` for
every property P and op, I the conjunction of all of them, each tracked by
name so an unsat core lists what a proof used. A failed check yields a
finite model (Z3 picks a universe for each sort): the counterexample to
induction, whose sizes the table shows; the trace comes from bounded model
checking from `init` (see `command.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import z3

from kvgate.invariants.z3.checker import INIT, proof_table, track
from kvgate.invariants.z3.transitions import ENCODED_OPS, acts_on_request
from kvgate.invariants.z3.unbounded_properties import (
    UPROPERTIES,
    UPROPERTY_BY_NAME,
    UProperty,
    uinit,
)
from kvgate.invariants.z3.unbounded_transitions import UEncoding
from kvgate.invariants.z3.unbounded_vocabulary import BLOCK, COPY, REQ, UState


@dataclass(frozen=True)
class UResult:
    prop: str
    kind: str
    op: str
    proved: bool
    seconds: float
    used: tuple[str, ...] = ()  # the unsat core
    sizes: tuple[int, int, int] | None = None  # a counterexample's blocks, requests, copies
    unknown: str = ""  # why the solver gave up, if it did


def _solver() -> Any:
    solver = z3.Solver()
    solver.set("timeout", 60_000)
    return solver


def _sizes(model: Any) -> tuple[int, int, int]:
    def size(sort: Any) -> int:
        universe = model.get_universe(sort)
        return len(universe) if universe is not None else 1

    return size(BLOCK), size(REQ), size(COPY)


def check_uinit(groups: int, prop: UProperty) -> UResult:
    started = time.perf_counter()
    s = UState(groups, "s")
    solver = _solver()
    solver.add(uinit(s), z3.Not(prop.holds(s)))
    verdict = solver.check()
    sizes = _sizes(solver.model()) if verdict == z3.sat else None
    return UResult(
        prop.name,
        prop.kind,
        INIT,
        verdict == z3.unsat,
        time.perf_counter() - started,
        sizes=sizes,
        unknown=solver.reason_unknown() if verdict == z3.unknown else "",
    )


def _each_violation(
    solver: Any, props: Iterable[UProperty], violation: Callable[[UProperty], Any]
) -> Iterator[tuple[UProperty, Any, float, tuple[str, ...]]]:
    """For each property, whether its `violation` is satisfiable beside what
    the solver holds (pre-state and transition): yields the property, Z3's
    verdict, the seconds it took and, when unsat, the core's names. Yielded
    inside the property's push, so the caller may read `solver.model()`."""
    for prop in props:
        started = time.perf_counter()
        solver.push()
        solver.add(violation(prop))
        verdict = solver.check()
        seconds = time.perf_counter() - started
        core = tuple(sorted(str(c) for c in solver.unsat_core())) if verdict == z3.unsat else ()
        yield prop, verdict, seconds, core
        solver.pop()


def check_uop(groups: int, mutation: str, op: str, props: Sequence[UProperty]) -> list[UResult]:
    """`I(s) and T_op(s, t) => P(t)` for each P, on one solver (push/pop)."""
    encoding = UEncoding(groups, mutation)
    s = UState(groups, "s")
    solver = _solver()
    track(solver, ((f"pre {p.name}", p.holds(s)) for p in UPROPERTIES))  # I(s)
    r = z3.Const("r", REQ) if acts_on_request(op) else None
    tx = encoding.build(op, s, r, "x")
    track(solver, tx.named())  # T_op(s, t)
    t = tx.view()
    out = []
    for prop, verdict, seconds, core in _each_violation(
        solver, props, lambda prop: z3.Not(prop.holds(t))
    ):
        if verdict == z3.unsat:
            out.append(UResult(prop.name, prop.kind, op, True, seconds, core))
        elif verdict == z3.sat:
            out.append(
                UResult(prop.name, prop.kind, op, False, seconds, sizes=_sizes(solver.model()))
            )
        else:
            out.append(
                UResult(prop.name, prop.kind, op, False, seconds, unknown=solver.reason_unknown())
            )
    return out


def _task(groups: int, mutation: str, names: tuple[str, ...], op: str) -> list[UResult]:
    props = [UPROPERTY_BY_NAME[n] for n in names]
    if op == INIT:
        return [check_uinit(groups, p) for p in props]
    return check_uop(groups, mutation, op, props)


def prove_unbounded(
    groups: int = 3,
    mutation: str = "clean",
    props: Sequence[str] | None = None,
    ops: Sequence[str] = ENCODED_OPS,
    jobs: int = 1,
    decided: Callable[[list[UResult]], None] | None = None,
) -> list[UResult]:
    """The whole table for every pool size: `init` and every op, every
    property; `decided` gets each op's cells as soon as they are decided."""
    names = tuple(props) if props is not None else tuple(p.name for p in UPROPERTIES)
    return proof_table(partial(_task, groups, mutation, names), names, ops, jobs, decided)
