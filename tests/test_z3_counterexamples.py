"""Every mutated transition fails its check, and its counterexample is a trace
that replays and shows the violation.

For each mutation (`kvgate.model.mutations`: the model's patch and the
encoding's hooks it breaks): induction fails somewhere; bounded model
checking from `init` finds a run violating the mutation's target invariant;
that run, written as a version-1 trace, passes on the clean model and fails
its expectations on the mutated model. The upstream-like ones (vLLM 0.33.0
has neither the hold nor its admission extra) fail the same expectations, at
the same steps, on the installed vLLM, which otherwise stays in lockstep
with the model at strict level.

The searches run once for the module, two at a time.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from contextlib import closing
from pathlib import Path

import pytest
from configs import needs_vllm

from kvgate.conformance.replay import ReplayResult, replay
from kvgate.conformance.trace import Trace, load_trace
from kvgate.invariants.z3.abstraction import Drift, acting, bounds_of, observe
from kvgate.invariants.z3.checker import prove
from kvgate.invariants.z3.command import DEFAULT_DEPTH
from kvgate.invariants.z3.counterexample import GEOMETRIES, Found, Geometry, find
from kvgate.invariants.z3.transitions import MUTATIONS
from kvgate.invariants.z3.vocabulary import Bounds
from kvgate.model.mutations import MUTATIONS as MODEL_MUTATIONS
from kvgate.model.mutations import mutated
from kvgate.model.target import ModelTarget

UPSTREAM = [m for m in MUTATIONS if MODEL_MUTATIONS[m].upstream]
INDUCTION = Bounds(blocks=4, requests=2, groups=2)  # small: the failure shows already


def search(job: tuple[str, Path]) -> Found:
    mutation, directory = job
    return find(Bounds(), mutation, MODEL_MUTATIONS[mutation].target, directory, DEFAULT_DEPTH)


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[bool, Found]]:
    """Per mutation: whether induction breaks, and the counterexample search.

    Each search runs in a fresh spawned process: Z3's search order follows
    the order its terms were created in, so a search that ran after other
    checks in the same process can take minutes instead of seconds."""
    directory = tmp_path_factory.mktemp("counterexamples")
    workers = min(2, os.cpu_count() or 1)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=spawn, max_tasks_per_child=1) as pool:
        searches = list(pool.map(search, [(m, directory) for m in MUTATIONS]))
    broken = [any(not r.proved for r in prove(INDUCTION, m)) for m in MUTATIONS]
    return dict(zip(MUTATIONS, zip(broken, searches, strict=True), strict=True))


def trace_of(found: dict[str, tuple[bool, Found]], mutation: str) -> Trace:
    broken, example = found[mutation]
    assert broken, f"{mutation}: every induction check passed"
    assert example.file is not None, f"{mutation}: {example.note}"
    return load_trace(example.file)


def misses(result: ReplayResult) -> list[tuple[int, str]]:
    """Where a replay missed the trace's own values: (step, what)."""
    failures = result.failures
    assert all(d.level == "expect" for d in failures), failures
    return [(d.step.index, d.what) for d in failures]


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_counterexample_shows_the_violation_on_the_model(
    found: dict[str, tuple[bool, Found]], mutation: str
) -> None:
    trace = trace_of(found, mutation)
    assert misses(replay(trace, ModelTarget(trace.config), None, "api")) == []
    with mutated(mutation):
        missed = misses(replay(trace, ModelTarget(trace.config), None, "api"))
    assert missed, f"{trace.path} passes on the mutated model"
    # What it misses is evidence: a check, a lookup's hit, an admission count.
    assert all(what.startswith("check ") or what in ("hit", "blocks") for _, what in missed)


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_clean_model_runs_the_counterexample_inside_the_proofs(
    found: dict[str, tuple[bool, Found]], mutation: str
) -> None:
    """The clean model's run of each counterexample (holds, moved tails,
    follows, deferred frees) is admitted by the clean encoding and keeps
    every proved property."""
    trace = trace_of(found, mutation)
    names = {s.req: i for i, s in enumerate(s for s in trace.steps if s.op == "arrive") if s.req}
    bounds = bounds_of(trace.config, len(names))
    target, drift = ModelTarget(trace.config), Drift(bounds)
    for step in trace.primitives:
        if step.op == "check":
            continue
        before = observe(target, names, bounds)
        target.apply(step)
        verdict = drift.step(
            step.op, acting(step.op, step.req, names), before, observe(target, names, bounds)
        )
        assert verdict.ok, (step.where(), verdict)


@needs_vllm
@pytest.mark.parametrize("mutation", UPSTREAM)
def test_upstream_counterexample_fails_the_same_way_on_vllm(
    found: dict[str, tuple[bool, Found]], mutation: str
) -> None:
    from kvgate.impl.vllm_target import VllmTarget

    trace = trace_of(found, mutation)
    with mutated(mutation):
        on_model = misses(replay(trace, ModelTarget(trace.config), None, "api"))
    with closing(VllmTarget(trace.config)) as target:
        on_vllm = replay(trace, target, ModelTarget, "strict")
    assert not target.capabilities.hold  # the installed 0.33.0, no overlay
    # vLLM stays in lockstep with the (hold-off) model at strict level and
    # misses exactly the mutated model's expectations, and maybe more: the
    # mutation disables one part of the hold, vLLM lacks all of it.
    assert set(on_model) <= set(misses(on_vllm))


@pytest.mark.parametrize("geometry", GEOMETRIES[1:], ids=str)
def test_counterexamples_at_other_geometries(tmp_path: Path, geometry: Geometry) -> None:
    """Bounded model checking's paths concretize at more than one geometry
    (a coarser hash unit and block, eagle's drop): the trace runs at it,
    passes on the clean model and fails on the mutated one."""
    found = find(
        Bounds(), "abort_keeps_hold", "no_leak", tmp_path, DEFAULT_DEPTH, geometries=(geometry,)
    )
    assert found.file is not None, found.note
    trace = load_trace(found.file)
    assert (trace.config.hash_unit, trace.config.eagle) == (
        geometry.hash_unit,
        geometry.eagle,
    )
    assert trace.config.groups[1].block_size == geometry.block
    assert misses(replay(trace, ModelTarget(trace.config), None, "api")) == []
    with mutated("abort_keeps_hold"):
        assert misses(replay(trace, ModelTarget(trace.config), None, "api"))
