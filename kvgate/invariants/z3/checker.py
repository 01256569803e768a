"""Induction and bounded model checking over the encoding.

`prove` checks, for every property P (invariants and lemmas alike) and every
encoded op: `init => P`, and `I(s) and T_op(s, t) => P(t)` where I is the
conjunction of all properties. Both sides are tracked (`assert_and_track`):
each property of I by name, each transition clause by its name, so a proof's
unsat core lists the lemmas and transition parts it used, and a failed
check names the violated instance (`no_leak[b3]`) and the op.

Symmetry keeps each induction check small. Every property and every
transition is symmetric in the blocks (block ids matter to the manager only
through the free queue's order, which is abstracted away) and in the
requests (nothing depends on a request's index). So a step acts on request 0
(a step of request k is the same check with requests renamed), and the
post-state is checked at representative instances: block 1, request 0 (the
actor) and request 1 (a bystander), every group (groups allocate in order,
so Mamba groups are not interchangeable). The pre-state keeps every instance.

`bmc` searches for a run from `init` that violates a property, one op per
step, deepening until `depth`. It adds realizability constraints (see
`realizable`) so that a path it finds can be replayed as a concrete trace:
they only narrow the search and play no part in any proof.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

import z3

from kvgate.invariants.z3.properties import (
    PROPERTIES,
    PROPERTY_BY_NAME,
    Instance,
    Property,
    init,
)
from kvgate.invariants.z3.transitions import (
    ENCODED_OPS,
    Encoding,
    acts_on_request,
)
from kvgate.invariants.z3.vocabulary import (
    ABSENT,
    ATTENTION,
    Bounds,
    State,
    Values,
    any_of,
    count,
)
from kvgate.invariants.z3.vocabulary import (
    HOW as HOW_NUMBERS,
)

INIT = "init"
HOW_NAMES = {n: name for name, n in HOW_NUMBERS.items()}
# Ops that change no abstract state: a counterexample never needs them.
IDLE_OPS = ("step", "reserve", "events", "stats", "residency")
# Ops a counterexample search leaves out besides: `reset` only forgets keys
# of an idle pool, which no property's violation needs.
BMC_SKIPPED = (*IDLE_OPS, "reset")


@dataclass(frozen=True)
class Result:
    """One cell of the proof table: a property at `init` or across an op."""

    prop: str
    kind: str
    op: str
    proved: bool
    seconds: float
    used: tuple[str, ...] = ()  # the unsat core: properties and transition clauses
    violated: tuple[str, ...] = ()  # instances the counterexample breaks
    cti: Values | None = field(default=None, compare=False)  # its pre-state


def prove(
    bounds: Bounds,
    mutation: str = "clean",
    props: Sequence[str] | None = None,
    ops: Sequence[str] = ENCODED_OPS,
    jobs: int = 1,
    minimize_cores: bool = False,
    decided: Callable[[list[Result]], None] | None = None,
) -> list[Result]:
    """The whole table: `init` and every op, for every property (or `props`);
    `decided` gets each op's cells as soon as they are decided."""
    names = tuple(props) if props is not None else tuple(p.name for p in PROPERTIES)
    return proof_table(
        partial(_check_task, bounds, mutation, names, minimize_cores), names, ops, jobs, decided
    )


class Cell(Protocol):
    """A proof table's cell, bounded or unbounded: a property at `init` or an op."""

    @property
    def prop(self) -> str: ...

    @property
    def op(self) -> str: ...


CellT = TypeVar("CellT", bound=Cell)


def proof_table(
    check: Callable[[str], list[CellT]],
    names: Sequence[str],
    ops: Sequence[str],
    jobs: int,
    decided: Callable[[list[CellT]], None] | None = None,
) -> list[CellT]:
    """Both encodings' proof loop: `check(op)` (the cells of one op, or of
    `init`) for `init` and every op, on `jobs` worker processes, sorted by
    property (in `names`' order), then op. `decided` gets each op's cells
    as they come (in the order they finish), so a caller can show them."""
    columns = (INIT, *ops)
    chunks: list[list[CellT]] = []
    if jobs <= 1:
        for op in columns:
            chunks.append(check(op))
            if decided is not None:
                decided(chunks[-1])
    else:
        # Spawned, not forked: a forked child would inherit Z3's state
        # (and the caller's threads) mid-flight.
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=spawn) as pool:
            for future in as_completed([pool.submit(check, op) for op in columns]):
                chunks.append(future.result())
                if decided is not None:
                    decided(chunks[-1])
    order = {op: i for i, op in enumerate(columns)}
    rows = [r for chunk in chunks for r in chunk]
    return sorted(rows, key=lambda r: (list(names).index(r.prop), order[r.op]))


def _check_task(
    bounds: Bounds, mutation: str, names: tuple[str, ...], minimize: bool, op: str
) -> list[Result]:
    props = [PROPERTY_BY_NAME[n] for n in names]
    if op == INIT:
        return [check_init(bounds, p) for p in props]
    return check_op(Encoding(bounds, mutation), op, props, minimize)


def check_init(bounds: Bounds, prop: Property) -> Result:
    started = time.perf_counter()
    s = State(bounds, "s")
    solver = z3.Solver()
    solver.add(init(s))
    solver.add(prop.violated(s))
    sat = solver.check() == z3.sat
    violated = _violated(prop, s, solver.model()) if sat else ()
    return Result(prop.name, prop.kind, INIT, not sat, time.perf_counter() - started, (), violated)


def check_op(
    encoding: Encoding, op: str, props: Iterable[Property], minimize: bool = False
) -> list[Result]:
    """`I(s) and T_op(s, t) => P(t)` for each P, on one solver (push/pop per P)."""
    bounds = encoding.bounds
    s = State(bounds, "s")
    solver = z3.Solver()
    if minimize:
        solver.set("core.minimize", True)
    track(solver, ((f"pre {p.name}", p.holds(s)) for p in PROPERTIES))  # I(s)
    tx = encoding.build(op, s, 0 if acts_on_request(op) else None, "x")
    track(solver, tx.named())  # T_op(s, t)
    # The next state as expressions, not variables: the incremental solver
    # that tracking needs does not eliminate equalities by itself.
    t = tx.successor()
    out = []
    for prop in props:
        started = time.perf_counter()
        solver.push()
        solver.add(prop.violated(t, representative))
        sat = solver.check() == z3.sat
        if sat:
            model = solver.model()
            row = Result(
                prop.name,
                prop.kind,
                op,
                False,
                time.perf_counter() - started,
                (),
                _violated(prop, t, model),
                s.evaluate(model),
            )
        else:
            core = tuple(sorted(str(c) for c in solver.unsat_core()))
            row = Result(prop.name, prop.kind, op, True, time.perf_counter() - started, core)
        solver.pop()
        out.append(row)
    return out


def track(solver: Any, named: Iterable[tuple[str, Any]]) -> None:
    """Assert each formula under a tracking literal of its name, so an unsat
    core names the lemmas (`pre <name>`) and transition clauses a proof
    used. Both encodings' induction step; `named` may be lazy: Z3's search
    follows the order terms are created in, and each formula is then built
    just before its literal, as it always was."""
    for name, formula in named:
        solver.assert_and_track(formula, z3.Bool(name))


def representative(instance: Instance) -> bool:
    """One instance per symmetry class (see the module docstring)."""
    at = instance.at
    return at.get("b", 1) == 1 and at.get("r", 0) in (0, 1)


def _violated(prop: Property, s: State, model: Any) -> tuple[str, ...]:
    return tuple(i.name for i in _false_instances(prop, s, model))


def _false_instances(prop: Property, s: State, model: Any) -> list[Instance]:
    return [
        i
        for i in prop.instances(s, s.bounds)
        if z3.is_false(model.eval(i.expr, model_completion=True))
    ]


# -- bounded model checking ---------------------------------------------------------


@dataclass(frozen=True)
class AbstractStep:
    """One op of a counterexample run, with the states around it."""

    op: str
    req: int | None
    how: str | None
    pre: Values
    post: Values

    def __str__(self) -> str:
        who = "" if self.req is None else f" r{self.req}"
        how = "" if self.how is None else f" ({self.how})"
        return f"{self.op}{who}{how}"


@dataclass(frozen=True)
class Path:
    """A run from `init` whose last state violates `prop`."""

    bounds: Bounds
    mutation: str
    prop: str
    steps: tuple[AbstractStep, ...]
    violated: tuple[str, ...]
    victims: tuple[int, ...]  # the requests of the violated instances
    seconds: float

    def describe(self) -> str:
        return "; ".join(str(s) for s in self.steps)


def realizable(s: State) -> list[Any]:
    """What the concrete traces `counterexample` writes can show, as state
    constraints: Mamba groups of one spec act in lockstep (same hits,
    holds, tails), attention and Mamba agree on whether a hit is partial
    (the concrete geometry gives them one block size), and requests arrive
    in index order (a symmetry break)."""
    bounds = s.bounds
    out = []
    blocks = bounds.block_ids
    for r in bounds.request_ids:
        if r + 1 < bounds.requests:
            out.append(z3.Implies(s.phase[r] == ABSENT, s.phase[r + 1] == ABSENT))

        def hit(g: int, r: int = r) -> Any:
            return any_of(s.hit[r, g, b] for b in blocks)

        def partial(g: int, r: int = r) -> Any:
            return any_of(s.hit_source[r, g, b] for b in blocks)

        first = bounds.mamba_ids[0]
        out += [hit(ATTENTION) == hit(first), partial(ATTENTION) == partial(first)]
        for m in bounds.mamba_ids[1:]:
            out += [
                hit(m) == hit(first),
                partial(m) == partial(first),
                s.tailed[r, m] == s.tailed[r, first],
                any_of(s.pending_tail[r, m, b] for b in blocks)
                == any_of(s.pending_tail[r, first, b] for b in blocks),
                count(s.hold[r, m, b] for b in blocks)
                == count(s.hold[r, first, b] for b in blocks),
                any_of(s.checkpoint[r, m, b] for b in blocks)
                == any_of(s.checkpoint[r, first, b] for b in blocks),
            ]
    return out


def bmc(
    bounds: Bounds,
    prop: str,
    mutation: str = "clean",
    depth: int = 10,
    hold_on: bool = True,
    blocked: Sequence[Sequence[tuple[str, int | None]]] = (),
) -> Path | None:
    """The shortest realizable run (up to `depth` ops) violating `prop`.

    `blocked` lists op skeletons ((op, request) per step) not to return again,
    for a caller whose concretization of an earlier path failed.
    """
    started = time.perf_counter()
    encoding = Encoding(bounds, mutation, realizable=True)
    target = PROPERTY_BY_NAME[prop]
    ops = [op for op in ENCODED_OPS if op not in BMC_SKIPPED and op != "decode1"]
    moves = [(op, r) for op in ops for r in (bounds.request_ids if acts_on_request(op) else [None])]
    states = [State(bounds, "s0")]
    solver = z3.Solver()
    # The traces it writes run without the fork's retention (and without the
    # knobs `more_partial_states` stands for: the realizable encoding leaves
    # that switch out).
    solver.add(init(states[0]), states[0].hold_on == hold_on, z3.Not(states[0].retain_retired))
    selectors: list[dict[tuple[str, int | None], Any]] = []
    for k in range(1, depth + 1):
        pre, post = states[-1], State(bounds, f"s{k}")
        states.append(post)
        chosen = {}
        built = []
        for op, r in moves:
            tag = f"k{k}.{op}" + ("" if r is None else f".r{r}")
            sel = z3.Bool(f"{tag}.sel")
            chosen[op, r] = sel
            tx = encoding.build(op, pre, r, tag)
            solver.add(z3.Implies(sel, z3.And([c for _, c in tx.named()])))
            built.append((sel, tx))
        # One equation per variable, an If chain over the ops that change it:
        # far smaller than every op restating every unchanged variable.
        for name, key, var in pre.items():
            value = var
            for sel, tx in built:
                changed = tx.next[name][key]
                if not changed.eq(var):
                    value = z3.If(sel, changed, value)
            solver.add(post.field(name)[key] == value)
        solver.add(z3.PbEq([(sel, 1) for sel in chosen.values()], 1))
        solver.add(realizable(post))
        selectors.append(chosen)
        solver.push()
        for skeleton in blocked:
            if len(skeleton) == k:
                solver.add(z3.Not(z3.And([selectors[i][m] for i, m in enumerate(skeleton)])))
        solver.add(target.violated(post))
        if solver.check() == z3.sat:
            model = solver.model()
            steps = []
            for i in range(k):
                (op, r) = next(m for m, sel in selectors[i].items() if z3.is_true(model.eval(sel)))
                how = None
                if op == "free":
                    tag = f"k{i + 1}.{op}.r{r}"
                    how = HOW_NAMES[model.eval(z3.Int(f"{tag}.how")).as_long()]
                steps.append(
                    AbstractStep(
                        op, r, how, states[i].evaluate(model), states[i + 1].evaluate(model)
                    )
                )
            broken = _false_instances(target, post, model)
            return Path(
                bounds,
                mutation,
                prop,
                tuple(steps),
                tuple(i.name for i in broken),
                tuple(sorted({i.at["r"] for i in broken if "r" in i.at})),
                time.perf_counter() - started,
            )
        solver.pop()
    return None
