"""Exploration campaigns: the config matrix, split across processes or a Ray cluster.

A campaign is every cell of the matrix -- each config stratum (one value
per stratum knob of `knobs.KNOBS`) x each hold arm x each available target
that runs the arm (the model: every arm; upstream vLLM: hold off; vLLM with
kvgate's hold overlay: the hold arms) -- explored for a budget of
examples. A cell splits into shards, each with its own seed (shard k of a
campaign seeded s runs seed s + k); a shard is the unit of work, run in a
worker process (`--jobs N`, a process pool) or as a Ray task (`--ray
ADDRESS`). Every failure a shard finds is shrunk, saved as a version-1
trace, replayed on the cell's target, and keyed by the replay's first
divergence (op, level, what): the summary counts distinct failures by that
key.

Resumable: the campaign log (`campaign.jsonl` in the output directory)
holds the plan and one line per finished shard, written as each finishes.
Run the same command on the same directory again and the shards already
logged are skipped; a different plan there is refused. Hypothesis's example
database is not used (a shard is reproduced from its seed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvgate import workers
from kvgate.conformance.replay import one_line
from kvgate.errors import InputError
from kvgate.explore.knobs import build, strata, stratum_name
from kvgate.explore.mode import Mode
from kvgate.explore.session import ExploreFailure
from kvgate.vocabulary.config import UnsupportedConfig

TargetName = Literal["model", "vllm", "vllm+overlay"]
TARGET_NAMES: tuple[TargetName, ...] = ("model", "vllm", "vllm+overlay")
LOG = "campaign.jsonl"


@dataclass(frozen=True)
class Arm:
    """How the hold is configured: off (upstream), on, on with retired states."""

    name: str
    hold: bool
    retain_retired: bool


ARMS = (Arm("off", False, False), Arm("on", True, False), Arm("on+retired", True, True))
ARM_NAMES = tuple(a.name for a in ARMS)


def arm(name: str) -> Arm:
    return next(a for a in ARMS if a.name == name)


# The hold arms each target runs: upstream vLLM has no hold (its hold-off
# arm); the overlay gives it one (the hold arms); the model runs all three.
TARGET_ARMS: dict[TargetName, tuple[str, ...]] = {
    "model": ARM_NAMES,
    "vllm": ("off",),
    "vllm+overlay": ("on", "on+retired"),
}


def available_targets(
    wanted: Sequence[TargetName] = TARGET_NAMES,
) -> tuple[tuple[TargetName, ...], dict[TargetName, str]]:
    """Which of `wanted` run here, probed, and why each other one does not:
    vLLM when it imports and builds a hybrid manager
    (`impl.vllm_probe.probe`); its overlay when, besides, the overlay finds
    every internal it wraps (`hold_overlay.missing_internals`). Imports
    vLLM only when a vLLM target is wanted."""
    why_not: dict[TargetName, str] = {}
    if any(t != "model" for t in wanted):
        if importlib.util.find_spec("vllm") is None:
            why_not["vllm"] = "vLLM is not installed"
        else:
            from kvgate.impl.vllm_probe import probe

            found = probe()
            if found.get("vllm") is None or "error" in found:
                why_not["vllm"] = f"vLLM does not build a manager here: {found.get('error')}"
        if "vllm" in why_not:
            why_not["vllm+overlay"] = why_not["vllm"]
        elif "vllm+overlay" in wanted:
            from kvgate.impl.hold_overlay import missing_internals

            missing = missing_internals()
            if missing:
                why_not["vllm+overlay"] = f"the overlay lacks {', '.join(missing)}"
    return tuple(t for t in wanted if t not in why_not), {
        t: why for t, why in why_not.items() if t in wanted
    }


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: a config stratum, a hold arm and a target."""

    stratum: tuple[tuple[str, Any], ...]
    arm: str
    target: TargetName

    @property
    def name(self) -> str:
        return f"{self.target} hold {self.arm} {stratum_name(dict(self.stratum))}"


@dataclass(frozen=True)
class Shard:
    """A cell's share of examples under one seed: the unit of work a job runs."""

    cell: Cell
    seed: int
    examples: int

    @property
    def key(self) -> str:
        return f"{self.cell.name} seed {self.seed}"


@dataclass(frozen=True)
class Plan:
    """What a campaign runs: its cells, each in `shards` shards."""

    cells: tuple[Cell, ...]
    profile: str
    examples: int  # per cell
    shards: int  # per cell
    seed: int

    def shard_list(self) -> list[Shard]:
        per = max(1, math.ceil(self.examples / self.shards))
        return [Shard(cell, self.seed + k, per) for cell in self.cells for k in range(self.shards)]

    def fingerprint(self) -> str:
        text = json.dumps(
            [self.profile, self.examples, self.shards, self.seed, [c.name for c in self.cells]]
        )
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def matrix(
    targets: Sequence[TargetName] | None = None,
    arms: Sequence[str] | None = None,
    all_strata: bool = True,
) -> tuple[Cell, ...]:
    """The cells: every stratum (or the seed's config alone) x arms x
    targets, each target with the arms it runs (`TARGET_ARMS`)."""
    rows: Iterable[dict[str, Any]] = strata() if all_strata else [{}]
    return tuple(
        Cell(tuple(stratum.items()), arm_name, target)
        for stratum in rows
        for target in (targets or available_targets()[0])
        for arm_name in (arms or ARM_NAMES)
        if arm_name in TARGET_ARMS[target]
    )


# ------------------------------------------------------------------ a shard


@dataclass(frozen=True)
class FailureRecord:
    op: str
    level: str
    what: str
    found: str  # the explorer's own one-line report
    trace: str  # where the shrunk trace was saved

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.op, self.level, self.what)


@dataclass(frozen=True)
class ShardResult:
    key: str
    cell: str
    target: str
    arm: str
    examples: int
    steps: int
    seconds: float
    failure: FailureRecord | None = None
    skipped: str = ""  # why the cell cannot run (a config its target refuses)
    error: str = ""  # the shard itself broke
    # CPU seconds the shard took in its worker (a worker's start-up excluded).
    cpu_seconds: float = 0.0


def mode_for(cell: Cell) -> Mode:
    """The explorer's mode for a cell (vLLM imported only for a vLLM cell)."""
    from kvgate.explore.runner import model_mode

    hold = arm(cell.arm)
    if cell.arm not in TARGET_ARMS[cell.target]:
        raise ValueError(f"{cell.name}: target {cell.target} does not run hold {cell.arm}")
    if cell.target == "model":
        mode = model_mode(hold=hold.hold, retain_retired=hold.retain_retired)
    else:
        from kvgate.explore.differential import differential_mode, overlay_differential_mode

        mode = overlay_differential_mode(hold.retain_retired) if hold.hold else differential_mode()
    mode.stratum = dict(cell.stratum)
    return mode


def _refusal(cell: Cell, mode: Mode) -> str:
    """Why the cell's target cannot run its stratum's config ("" if it can)."""
    config = mode.apply(build(dict(cell.stratum)))
    try:
        if mode.lockstep is not None:
            mode.lockstep(config).close()
    except UnsupportedConfig as error:
        return f"{error.field}: {error.message}"
    return ""


def first_divergence(failure: ExploreFailure, trace: Path, cell: Cell) -> tuple[str, str, str]:
    """(op, level, what) of the saved trace's first failure, replayed on
    the cell's target (in lockstep with the model for vLLM)."""
    from kvgate.conformance.replay import replay
    from kvgate.conformance.trace import load_trace
    from kvgate.model import ModelTarget

    loaded = load_trace(trace)
    mode = mode_for(cell)
    if mode.lockstep is None:
        target: Any = ModelTarget(loaded.config)
        result = replay(loaded, target, None, "api")
    else:
        target = mode.lockstep(loaded.config)
        result = replay(loaded, target, ModelTarget, "strict")
    target.close()
    if result.failures:
        first = result.failures[0]
        return (first.step.op, first.level, first.what)
    # Not shown by its replay: keyed by what the explorer saw.
    return (failure.steps[-1].op if failure.steps else "-", failure.kind, failure.invariant)


def run_shard(shard: Shard, profile_name: str, out: str) -> ShardResult:
    """Explore one shard (in a worker); its failure saved and keyed."""
    from kvgate.explore.profiles import profile
    from kvgate.explore.runner import explore

    cell = shard.cell
    started = time.perf_counter()
    started_cpu = time.process_time()

    def result(**fields: Any) -> ShardResult:
        return ShardResult(
            key=shard.key,
            cell=cell.name,
            target=cell.target,
            arm=cell.arm,
            seconds=time.perf_counter() - started,
            cpu_seconds=time.process_time() - started_cpu,
            **{"examples": 0, "steps": 0, **fields},
        )

    try:
        mode = mode_for(cell)
        refused = _refusal(cell, mode)
        if refused:
            return result(skipped=refused)
        settings = profile(profile_name, max_examples=shard.examples, derandomize=False)
        outcome = explore(mode, settings, out=Path(out) / "traces", seed=shard.seed)
    except Exception as error:  # reported in the summary, never lost
        return result(error=one_line(error))
    record = None
    if outcome.failure is not None and outcome.saved is not None:
        op, level, what = first_divergence(outcome.failure, outcome.saved, cell)
        found = f"{outcome.failure.kind} {outcome.failure.invariant}: {outcome.failure.message}"
        record = FailureRecord(op, level, what, " ".join(found.split()), str(outcome.saved))
    return result(examples=outcome.stats.examples, steps=outcome.stats.steps, failure=record)


# ------------------------------------------------------------------ the log


def _result_from_json(data: dict[str, Any]) -> ShardResult:
    failure = data.pop("failure")
    return ShardResult(**data, failure=None if failure is None else FailureRecord(**failure))


@dataclass
class CampaignLog:
    """The campaign's plan and its finished shards, one JSON line each."""

    path: Path
    done: dict[str, ShardResult] = field(default_factory=dict)
    resumed: int = 0

    @classmethod
    def open(cls, out: Path, plan: Plan) -> CampaignLog:
        path = out / LOG
        log = cls(path)
        if path.exists():
            lines = path.read_text().splitlines()
            header = json.loads(lines[0]) if lines else {}
            if header.get("plan") != plan.fingerprint():
                raise InputError(
                    f"--out {out}: {LOG} holds another campaign's plan "
                    f"({header.get('plan')}, this one {plan.fingerprint()}); use another directory"
                )
            for line in lines[1:]:
                try:
                    shard = _result_from_json(json.loads(line))
                except (ValueError, TypeError):
                    continue  # a line cut short when the campaign was stopped
                log.done[shard.key] = shard
            log.resumed = len(log.done)
        else:
            out.mkdir(parents=True, exist_ok=True)
            header = {"plan": plan.fingerprint(), "cells": len(plan.cells)}
            path.write_text(json.dumps(header) + "\n")
        return log

    def add(self, result: ShardResult) -> None:
        self.done[result.key] = result
        with self.path.open("a") as handle:
            handle.write(json.dumps(asdict(result)) + "\n")


# ------------------------------------------------------------------ engines

Engine = Callable[[Sequence[Shard], str, str], Iterable[ShardResult]]


def in_processes(jobs: int) -> Engine:
    """Shards in a pool of `jobs` worker processes (`workers.in_processes`),
    yielded as they finish."""
    return _engine(workers.in_processes(jobs, WORKER_PRELOAD))


# What every worker needs before its first shard, imported once by the
# fork server: each worker forks from it warm instead of importing
# Hypothesis, the model and the explorer itself (vLLM is left to the vLLM
# cells' workers).
WORKER_PRELOAD = ("kvgate.explore.runner", "kvgate.explore.profiles", "kvgate.explore.campaign")


def on_ray(address: str) -> Engine:
    """Shards as Ray tasks on the cluster at `address` (`workers.on_ray`:
    `local` or `local:N` starts a local cluster of N worker CPUs). Every
    node needs kvgate (and vLLM for vLLM cells) importable."""
    return _engine(workers.on_ray(address))


def _engine(pool: workers.Pool[ShardResult]) -> Engine:
    def run(shards: Sequence[Shard], profile_name: str, out: str) -> Iterator[ShardResult]:
        tasks = [(shard, profile_name, out) for shard in shards]
        for _, result in pool(run_shard, tasks):
            yield result

    return run


# ------------------------------------------------------------------ a campaign


@dataclass
class CampaignResult:
    plan: Plan
    results: list[ShardResult]
    resumed: int  # shards read back from the log instead of run
    seconds: float  # this run's wall time (resumed shards excluded)

    def distinct(self) -> dict[tuple[str, str, str], list[ShardResult]]:
        found: dict[tuple[str, str, str], list[ShardResult]] = {}
        for result in self.results:
            if result.failure is not None:
                found.setdefault(result.failure.key, []).append(result)
        return found


def run_campaign(
    plan: Plan,
    out: Path,
    engine: Engine,
    on_result: Callable[[ShardResult, int, int], None] | None = None,
) -> CampaignResult:
    """Every shard of `plan` not already in `out`'s log, on `engine`."""
    log = CampaignLog.open(out, plan)
    shards = plan.shard_list()
    todo = [s for s in shards if s.key not in log.done]
    started = time.perf_counter()
    for result in engine(todo, plan.profile, str(out)):
        log.add(result)
        if on_result is not None:
            on_result(result, len(log.done), len(shards))
    ordered = [log.done[s.key] for s in shards if s.key in log.done]
    return CampaignResult(plan, ordered, log.resumed, time.perf_counter() - started)


def summary_lines(result: CampaignResult) -> list[str]:
    """One table (target x arm: configs, examples, failures, distinct failures),
    then each distinct failure with where it was seen and one trace."""
    rows: dict[tuple[str, str], list[ShardResult]] = {}
    for shard in result.results:
        rows.setdefault((shard.target, shard.arm), []).append(shard)
    lines = [
        f"{'target':<12} {'hold':<11} {'configs':>8} {'n/a':>4} {'examples':>9} "
        f"{'failing':>8} {'distinct':>9} {'errors':>7}"
    ]
    total_examples = 0
    for (target, arm_name), shards in rows.items():
        cells = {s.cell for s in shards}
        skipped = {s.cell for s in shards if s.skipped}
        examples = sum(s.examples for s in shards)
        total_examples += examples
        failing = {s.cell for s in shards if s.failure is not None}
        distinct = {s.failure.key for s in shards if s.failure is not None}
        errors = sum(1 for s in shards if s.error)
        lines.append(
            f"{target:<12} {arm_name:<11} {len(cells) - len(skipped):>8} {len(skipped):>4} "
            f"{examples:>9} {len(failing):>8} {len(distinct):>9} {errors:>7}"
        )
    distinct_failures = result.distinct()
    lines.append(
        f"{len({s.cell for s in result.results})} cells, {len(result.results)} shards, "
        f"{total_examples} examples, {len(distinct_failures)} distinct failure(s)"
    )
    for (op, level, what), seen in distinct_failures.items():
        where = sorted({s.cell for s in seen})
        first = seen[0].failure
        assert first is not None
        lines.append(f"  {op} / {level} / {what}: {len(where)} cell(s), e.g. {where[0]}")
        lines.append(f"    {first.found[:110]}")
        lines.append(f"    trace: {first.trace}")
    for shard in result.results:
        if shard.error:
            lines.append(f"  error in {shard.key}: {shard.error[:110]}")
    refused = sorted({(s.cell, s.skipped) for s in result.results if s.skipped})
    if refused:
        lines.append(f"  not run ({len(refused)} cells: the target refuses the config), e.g.")
        lines.append(f"    {refused[0][0]}: {refused[0][1]}")
    return lines
