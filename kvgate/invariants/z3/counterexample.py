"""A bounded-model-checking counterexample as a replayable trace (format 1).

A `checker.Path` is a run of the abstract machine: ops, acting requests and
the states between them, but no tokens. `concretize` turns it into trace
steps for a concrete geometry (`trace_config`: one block size for attention
and every Mamba group, so a hit is partial in every group or in none;
sparse retention; the hold switch on), trying each of `GEOMETRIES` in turn
until one reproduces the path: hash unit 8 under 32-token blocks, then
16 under 64, then 8 under 32 with eagle's drop (a path some geometry cannot
show, another may):

- each abstract op becomes its trace op: `allocate` is `allocate {tokens:
  auto}` while the prompt is not computed and `decode1` after, each followed
  by `step` (as the scheduler ends a step); `evict` is `evict: all`;
- a request arrives right before its first op, and its prompt is the prompt
  of the request whose keyed state its lookup hits (`all_of`), if any, plus
  `fresh` tokens;
- the lengths of those `fresh` segments are searched (request by request,
  backtracking) until, after every step, every request has the shape the
  abstract state gives it (phase, pending lookup, hit and partial hit per
  group, pending tail move and number of holds per Mamba group), on the
  mutated model;
- the run is then checked against the mutated encoding with
  `abstraction.Drift` (every step admitted, ghosts carried along) and must
  violate the target property at the path's last step.

The trace carries the evidence as expectations the mutated model fails, each
taken from the clean model replaying the same steps: `expect` on every
lookup's hit and every allocate's `ok`, a `reserve` before each admitting
allocate, `check`s right after the violation (holds, free blocks, the ref
of the state a request holds), and an epilogue: for `no_total_miss`, a burst
evicts every free block, the request finishes and its next turn looks up
(the total miss); otherwise every request ends and the pool must be clean.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path as FilePath
from typing import Any

from kvgate.conformance.writer import save_trace
from kvgate.invariants.z3.abstraction import Drift, acting, observe
from kvgate.invariants.z3.checker import AbstractStep, Path, bmc
from kvgate.invariants.z3.vocabulary import (
    ATTENTION,
    Bounds,
    Values,
)
from kvgate.model.mutations import mutated
from kvgate.model.target import ModelTarget
from kvgate.vocabulary.config import Config, GroupConfig
from kvgate.vocabulary.ops import LIVE, Segment, Step
from kvgate.vocabulary.target import StepRefused

NEXT_TURN = "next"  # the follow-up request of the no-total-miss epilogue


@dataclass(frozen=True)
class Geometry:
    """The token geometry a counterexample trace runs at."""

    hash_unit: int
    block: int
    eagle: bool

    @property
    def fresh_lengths(self) -> range:
        """The `fresh` suffix lengths tried, shortest first: up to a block
        and a half, so a prompt can end inside its second block."""
        return range(1, self.block * 3 // 2 + 1)

    def __str__(self) -> str:
        return f"unit {self.hash_unit}, block {self.block}" + (", eagle" if self.eagle else "")


GEOMETRIES = (Geometry(8, 32, False), Geometry(16, 64, False), Geometry(8, 32, True))


def trace_config(bounds: Bounds, geometry: Geometry = GEOMETRIES[0]) -> Config:
    return Config(
        num_blocks=bounds.blocks,
        hash_unit=geometry.hash_unit,
        groups=(
            GroupConfig("full_attention", geometry.block),
            *[GroupConfig("mamba_align", geometry.block) for _ in bounds.mamba_ids],
        ),
        eagle=geometry.eagle,
        retention_interval=0,
        hold=True,
        scheduler_block_size=geometry.block,
    )


def request_name(r: int) -> str:
    return f"R{r}"


Shape = tuple[Any, ...]


def shape(values: Values, bounds: Bounds, r: int) -> Shape:
    """What a step must reproduce about request `r` (block ids aside)."""
    blocks = bounds.block_ids

    def some(name: str, *idx: int) -> bool:
        return any(values[name][(*idx, b)] for b in blocks)

    return (
        values["phase"][r],
        values["has_hit"][r],
        tuple((some("hit", r, g), some("hit_source", r, g)) for g in bounds.group_ids),
        tuple(
            (some("pending_tail", r, m), sum(bool(values["hold"][r, m, b]) for b in blocks))
            for m in bounds.mamba_ids
        ),
    )


@dataclass
class Run:
    """Concrete steps emitted so far, with what they matched."""

    steps: list[Step] = field(default_factory=list)
    matched: int = 0  # abstract steps reproduced


class Concretizer:
    """Searches concrete steps that reproduce a path on the (mutated) model."""

    def __init__(self, path: Path, mutation: str, geometry: Geometry = GEOMETRIES[0]) -> None:
        self.path = path
        self.mutation = mutation
        self.bounds = path.bounds
        self.geometry = geometry
        self.config = trace_config(self.bounds, geometry)
        self.names = {request_name(r): r for r in self.bounds.request_ids}
        self.first_use = _first_uses(path.steps)
        self.base = {r: _resumes_from(path.steps, r) for r in self.first_use}
        self.order = sorted(self.first_use, key=self.first_use.__getitem__)

    def model(self) -> AbstractContextManager[None]:
        return mutated(self.mutation) if self.mutation != "clean" else nullcontext()

    def search(self) -> Run | None:
        """Fresh lengths for each request, in arrival order, backtracking."""
        return self._search({})

    def _search(self, lengths: dict[int, int]) -> Run | None:
        todo = [r for r in self.order if r not in lengths]
        if not todo:
            run = self.simulate(lengths)
            return run if run.matched == len(self.path.steps) else None
        r = todo[0]
        later = [self.first_use[q] for q in todo[1:]]
        horizon = min(later) if later else len(self.path.steps)
        for n in self.geometry.fresh_lengths:
            trial = {**lengths, r: n}
            if self.simulate(trial).matched >= horizon:
                found = self._search(trial)
                if found is not None:
                    return found
        return None

    def simulate(self, lengths: dict[int, int]) -> Run:
        """Emit and run concrete steps until a request without a length
        arrives or a step's shape differs from the path's."""
        run = Run()
        with self.model():
            target = ModelTarget(self.config)
            for i, abstract in enumerate(self.path.steps):
                r = abstract.req
                if r is not None and self.first_use.get(r) == i:
                    if r not in lengths:
                        return run
                    arrive = Step("arrive", 0, req=request_name(r), prompt=self._prompt(r, lengths))
                    if not _apply(target, arrive):
                        return run
                    run.steps.append(arrive)
                if abstract.op == "arrive":
                    run.matched = i + 1  # placed at the request's first use
                    continue
                concrete = self._step(target, abstract)
                if concrete is None or not _apply(target, concrete):
                    return run
                run.steps.append(concrete)
                post = observe(target, self.names, self.bounds)
                if any(
                    shape(post, self.bounds, q) != shape(abstract.post, self.bounds, q)
                    for q in self.bounds.request_ids
                ):
                    return run
                if concrete.op in ("allocate", "decode1"):
                    tick = Step("step", 0)
                    _apply(target, tick)
                    run.steps.append(tick)
                run.matched = i + 1
        return run

    def _prompt(self, r: int, lengths: dict[int, int]) -> tuple[Segment, ...]:
        base = self.base[r]
        fresh = Segment("fresh", count=lengths[r])
        if base is None or base == r:
            return (fresh,)
        return (Segment("all_of", req=request_name(base)), fresh)

    def _step(self, target: ModelTarget, abstract: AbstractStep) -> Step | None:
        name = None if abstract.req is None else request_name(abstract.req)
        op = abstract.op
        if op in ("allocate", "decode1"):
            assert name is not None
            pending = target.requests.get(name)
            if pending is None:
                return None
            request = pending.request
            if request.num_computed_tokens < request.num_tokens:
                return Step("allocate", 0, req=name, tokens="auto")
            return Step("decode1", 0, req=name)
        if op == "evict":
            return Step("evict", 0, blocks="all")
        if op == "free":
            return Step("free", 0, req=name, how=abstract.how)
        return Step(op, 0, req=name)


def _apply(target: ModelTarget, step: Step) -> bool:
    try:
        target.apply(step)
    except StepRefused:
        return False
    return True


def _first_uses(steps: Sequence[AbstractStep]) -> dict[int, int]:
    """Each request's first op other than `arrive` (where it arrives)."""
    out: dict[int, int] = {}
    for i, step in enumerate(steps):
        if step.req is not None and step.op != "arrive":
            out.setdefault(step.req, i)
    return out


def _resumes_from(steps: Sequence[AbstractStep], r: int) -> int | None:
    """The request whose state `r`'s first hitting lookup found: the one
    whose op put the key on the Mamba block it hit (a moved tail carries the
    keys its own request put on its tail block)."""
    for i, step in enumerate(steps):
        if step.op != "lookup" or step.req != r:
            continue
        hits = [b for (q, g, b), v in step.post["hit"].items() if q == r and g != ATTENTION and v]
        if hits:
            return _keyer(steps[:i], hits[0])
    return None


def _keyer(steps: Sequence[AbstractStep], block: int) -> int | None:
    for step in reversed(steps):
        if step.post["keyed"][block] and not step.pre["keyed"][block]:
            return step.req
    return None


# -- the trace: witnesses and epilogue ------------------------------------------------


@dataclass
class Clean:
    """The clean model replaying the same steps: the values a trace expects."""

    config: Config
    target: ModelTarget = field(init=False)

    def __post_init__(self) -> None:
        self.target = ModelTarget(self.config)

    def apply(self, step: Step) -> dict[str, Any]:
        return self.target.apply(step)

    def holds(self) -> dict[str, dict[int, int]]:
        return {r: g for r, g in self.target.hold_positions().items() if g}


def build_steps(concretizer: Concretizer, run: Run) -> list[Step]:
    """The run's steps with expectations, checks and the epilogue."""
    clean = Clean(concretizer.config)
    out: list[Step] = []
    admitted: set[str] = set()
    held_before: dict[str, dict[int, int]] = {}

    def emit(step: Step, **expect: Any) -> dict[str, Any]:
        seen = clean.apply(step) if step.op != "check" else {}
        keep = {k: seen[k] for k in expect if k in seen}
        out.append(replace(step, index=len(out), expect=keep))
        return seen

    for step in run.steps:
        if step.op != "step":  # the holds before the path's last op
            held_before = clean.holds()
        if step.op == "lookup":
            emit(step, hit=True)
        elif step.op == "allocate" and step.req not in admitted:
            emit(Step("reserve", 0, req=step.req), blocks=True, step_blocks=True)
            admitted.add(step.req or "")
            emit(step, ok=True)
        elif step.op in ("allocate", "decode1"):
            emit(step, ok=True)
        else:
            emit(step)
        if step.op == "free" and step.how == "preempt":
            admitted.discard(step.req or "")
    out += _witness(concretizer, clean, held_before, len(out))
    out += _epilogue(concretizer, clean, len(out))
    return out


def _witness(
    concretizer: Concretizer, clean: Clean, held_before: dict[str, dict[int, int]], at: int
) -> list[Step]:
    """`check`s right after the violation, in the clean model's values."""
    query: dict[str, Any] = {"free_blocks": 0, "holds": {}}
    refs: dict[str, dict[int, dict[int, int | None]]] = {}
    target = clean.target
    for r in concretizer.path.victims:
        name = request_name(r)
        pending = target.requests.get(name)
        if pending is None:
            continue
        # The states it held before the violating op and holds now.
        for holds in (held_before, clean.holds()):
            for group, position in holds.get(name, {}).items():
                refs.setdefault(name, {}).setdefault(group, {})[position] = None
    if refs:
        query["ref"] = refs
    values = target.check_values(query)
    check = {"free_blocks": values["free_blocks"], "holds": clean.holds()}
    if refs:
        check["ref"] = values["ref"]
    return [Step("check", at, check=check)]


def _epilogue(concretizer: Concretizer, clean: Clean, at: int) -> list[Step]:
    path = concretizer.path
    target = clean.target
    steps: list[Step] = []

    def add(step: Step, **expect: Any) -> None:
        seen = clean.apply(step)
        steps.append(replace(step, index=at + len(steps), expect={k: seen[k] for k in expect}))

    live = [n for n, p in target.requests.items() if p.phase in LIVE]
    if path.prop == "no_total_miss":
        victim = request_name(path.victims[0])
        add(Step("evict", 0, blocks="all"))
        add(Step("free", 0, req=victim, how="finish"))
        add(Step("drain", 0))
        fresh = Segment("fresh", count=concretizer.geometry.hash_unit)
        add(Step("arrive", 0, req=NEXT_TURN, prompt=(Segment("all_of", req=victim), fresh)))
        add(Step("lookup", 0, req=NEXT_TURN), hit=True)
        return steps
    for name in live:
        add(Step("free", 0, req=name, how="finish"))
    for name in list(target.popped):
        add(Step("release", 0, req=name))
    add(Step("drain", 0))
    values = target.check_values({"pool_clean": True, "free_blocks": 0})
    steps.append(Step("check", at + len(steps), check=values))
    return steps


# -- the whole way, from a path to a saved trace -----------------------------------------


@dataclass(frozen=True)
class Counterexample:
    path: Path
    steps: tuple[Step, ...]
    config: Config


class NotConcretized(Exception):
    """No concrete trace reproduces the path (its shape, or its violation)."""


def concretize(
    path: Path, mutation: str, geometries: Sequence[Geometry] = GEOMETRIES
) -> Counterexample:
    """The path as a trace at the first geometry that reproduces it."""
    why = []
    for geometry in geometries:
        concretizer = Concretizer(path, mutation, geometry)
        run = concretizer.search()
        if run is None:
            why.append(f"no fresh lengths reproduce {path.describe()} at {geometry}")
            continue
        if not violates(concretizer, run):
            why.append(f"{path.describe()}: the concrete run keeps {path.prop} at {geometry}")
            continue
        steps = build_steps(concretizer, run)
        return Counterexample(path, tuple(steps), concretizer.config)
    raise NotConcretized("; ".join(why))


def violates(concretizer: Concretizer, run: Run) -> bool:
    """Whether the mutated model's concrete run, abstracted and checked with
    the mutated encoding step by step, reaches a violation of the path's
    property at its end (and every step is admitted)."""
    path = concretizer.path
    bounds = concretizer.bounds
    drift = Drift(bounds, mutation=concretizer.mutation)
    names = concretizer.names
    with concretizer.model():
        target = ModelTarget(concretizer.config)
        verdict_violated: tuple[str, ...] = ()
        for step in run.steps:
            pre = observe(target, names, bounds)
            target.apply(step)
            post = observe(target, names, bounds)
            verdict = drift.step(step.op, acting(step.op, step.req, names), pre, post)
            if verdict.not_admitted:
                raise NotConcretized(
                    f"the mutated encoding does not admit {step.op}: {verdict.not_admitted}"
                )
            verdict_violated = verdict.violated
    return any(v.startswith(f"{path.prop}[") for v in verdict_violated)


def search_bounds(bounds: Bounds) -> Bounds:
    """Where bounded model checking looks first: two requests and one Mamba
    group (the traces give Mamba groups one spec, so they act in lockstep
    and a second one only takes blocks), the same pool."""
    return Bounds(bounds.blocks, min(bounds.requests, 2), min(bounds.groups, 2))


@dataclass(frozen=True)
class Found:
    """What the search for a counterexample to `prop` came to."""

    prop: str
    file: FilePath | None  # the trace, when one was written
    note: str  # how it went, in a few words
    path: Path | None = None


def find(
    bounds: Bounds,
    mutation: str,
    prop: str,
    directory: FilePath,
    depth: int,
    attempts: int = 3,
    geometries: Sequence[Geometry] = GEOMETRIES,
) -> Found:
    """Bounded model checking for `prop` (reduced bounds first, then the
    full ones), each path concretized at the first geometry; a path no
    concrete run reproduces is blocked and the search goes on, `attempts`
    times per bound; then the same at the next geometry."""
    tried: list[str] = []
    for geometry in geometries:
        if tried and all(t.startswith("no run of") for t in tried):
            break  # no path at all: no geometry can help
        for where in dict.fromkeys([search_bounds(bounds), bounds]):
            blocked: list[tuple[tuple[str, int | None], ...]] = []
            for _ in range(attempts):
                path = bmc(where, prop, mutation, depth, blocked=blocked)
                if path is None:
                    tried.append(f"no run of <= {depth} ops at {where}")
                    break
                try:
                    example = concretize(path, mutation, (geometry,))
                except NotConcretized as error:
                    tried.append(str(error))
                    blocked.append(tuple((s.op, s.req) for s in path.steps))
                    continue
                file = write(example, directory)
                return Found(prop, file, f"{len(path.steps)} ops at {where}, {geometry}", path)
    return Found(prop, None, "; ".join(tried))


def write(counterexample: Counterexample, directory: FilePath) -> FilePath:
    path = counterexample.path
    name = f"{path.mutation}.{path.prop}"
    about = (
        f"Counterexample to {path.prop} under mutation {path.mutation}, found by bounded "
        f"model checking at {path.bounds}: {path.describe()}. Expectations come from the "
        f"clean model; the mutated manager fails them."
    )
    return save_trace(directory, name, counterexample.config, counterexample.steps, about)
