"""`kvgate gate --jobs N` and `kvgate replay --jobs N`: traces run N at a time.

The traces of a corpus are independent: each builds its own targets from
its own config, so they can run in any order, in any process. A recording's
parts are not: each part replays after the parts before it, on the pool and
prefix cache they leave, so a recording is one task, replayed through its
last part (as `conformance/trace.read_corpus` and the gate read it).

Each trace runs as the gate runs it in one process (`run_one`: the targets'
factories built once per process, vLLM's log lines captured for the trace),
in worker processes from the pool kvgate has (`workers.py`), or as Ray
tasks on a cluster whose nodes all read the traces' files (`--ray`). The outcomes
come back with their captured lines and are reported in the traces' order:
the report and the exit code are those of `--jobs 1`, which runs every
trace in this process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate import workers
from kvgate.conformance.replay import Level, Outcome
from kvgate.conformance.trace import Trace
from kvgate.output import CapturedLogs, VllmLogs, installed
from kvgate.targets import (
    LOCKSTEP_MODEL,
    gate_factories,
    run_scheduler_trace,
    run_trace,
    scheduler_factories,
)

# What a worker imports once, in the fork server, before its first trace
# (vLLM is left to the workers: its import logs, and a worker counts it).
PRELOAD = ("kvgate.replay_jobs", "kvgate.model")


@dataclass(frozen=True)
class GateSettings:
    """How every trace of a run is run (picklable: it goes to the workers)."""

    target: str
    plugin: str | None
    level: Level
    whole_view_every: int
    verbosity: int


@dataclass(frozen=True)
class TraceRun:
    """One trace's run: its outcome, the strict-view exclusions that hid the
    target's raw state, vLLM's records while it ran, and (from a worker)
    every record the worker counted for it, to add to the run's summary."""

    outcome: Outcome
    excluded: tuple[str, ...]
    logs: CapturedLogs
    counted: dict[str, Counter[str]] = field(default_factory=dict)


# A worker's factories, by kind and settings (built for its first trace).
_FACTORIES: dict[tuple[str, str, str | None], Any] = {}


def run_one(trace: Trace, settings: GateSettings, worker: bool = False) -> TraceRun:
    """`trace` run as the gate runs it, in this process (`worker`: a worker
    process of `run_all`, whose vLLM records go back with the run)."""
    logs = _worker_logs(settings) if worker else installed() or VllmLogs(settings.verbosity)
    excluded: list[str] = []
    kind = "refusal traces" if trace.expect_refused is not None else "traces"
    with logs.unit(kind) as captured:
        if trace.scheduler_level:
            model, real = _factories(settings, True, worker)
            outcome = run_scheduler_trace(
                trace, model, real, settings.level, settings.whole_view_every
            )
        else:
            factory, lockstep = _factories(settings, False, worker)
            outcome = run_trace(
                trace,
                factory,
                lockstep,
                settings.level,
                settings.target == LOCKSTEP_MODEL,
                excluded,
                settings.whole_view_every,
            )
    counted = dict(logs.counted) if worker else {}
    return TraceRun(outcome, tuple(excluded), captured, counted)


def _worker_logs(settings: GateSettings) -> VllmLogs:
    """The worker's handler of vLLM's records, installed for its first trace
    (vLLM imported then, its import's records the parent's to count: it
    imported vLLM too), counting afresh for each trace."""
    logs = installed()
    if logs is None:
        logs = VllmLogs(settings.verbosity).install()
        if settings.target != LOCKSTEP_MODEL:
            from kvgate.impl import _vllm_api

            _vllm_api.load()
    logs.restart_count()
    return logs


def _factories(settings: GateSettings, scheduler: bool, worker: bool) -> Any:
    """The targets' factories: a worker's kept for its later traces; in this
    process looked up for each trace (the registry may have changed)."""
    make = scheduler_factories if scheduler else gate_factories
    if not worker:
        return make(settings.target, settings.plugin)
    key = ("scheduler" if scheduler else "manager", settings.target, settings.plugin)
    if key not in _FACTORIES:
        _FACTORIES[key] = make(settings.target, settings.plugin)
    return _FACTORIES[key]


def run_all(
    traces: Sequence[Trace], settings: GateSettings, jobs: int, ray: str | None = None
) -> Iterator[TraceRun]:
    """Each trace's run, in the traces' order, `jobs` at a time, or as Ray
    tasks on the cluster at `ray` (every node reads the traces' files)."""
    pool = workers.on_ray(ray) if ray is not None else workers.in_processes(jobs, PRELOAD)
    tasks = [(trace, settings, ray is not None or jobs > 1) for trace in traces]
    yield from workers.in_order(pool(run_one, tasks))
