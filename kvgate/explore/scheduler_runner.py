"""Run the Scheduler-level machine (`kvgate explore --scope scheduler`):
rounds of examples until one fails or the budget is spent; the first
failure, shrunk by Hypothesis, saved as a scheduler-level trace."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from hypothesis import settings as Settings

from kvgate.explore.failure import SchedulerExploreFailure
from kvgate.explore.machine_run import MachineFactory, run_machine
from kvgate.explore.mode import SchedulerMode, SchedulerStats
from kvgate.explore.runner import RunOutcome, run_rounds
from kvgate.explore.scheduler_machine import SchedulerMachine

# The Scheduler-level exploration's.
SchedulerOutcome = RunOutcome[SchedulerExploreFailure, SchedulerStats]


def machine_factory(mode: SchedulerMode, stats: SchedulerStats) -> MachineFactory:
    """The machines of `mode`, counting into `stats`; named by the arm
    (the name seeds a derandomized run)."""
    hold = "HoldOn" if mode.hold else "HoldOff"
    return MachineFactory(f"SchedulerLockstep{hold}", lambda: SchedulerMachine(mode, stats))


def explore_scheduler(
    mode: SchedulerMode,
    settings: Settings,
    *,
    out: Path | None = None,
    seed: int | None = None,
    seconds: float | None = None,
    on_round: Callable[[SchedulerStats], None] | None = None,
) -> SchedulerOutcome:
    """Rounds of `settings.max_examples` examples until one fails or, with
    `seconds`, the time is spent (one round otherwise); round k uses seed
    `seed + k` (without a seed, a derandomized profile draws the same
    examples every run). The first failure, shrunk by Hypothesis, is saved
    in `out` as a scheduler-level trace."""
    stats = SchedulerStats()

    def one_round(round_seed: int | None) -> SchedulerExploreFailure | None:
        failure: SchedulerExploreFailure | None = None
        try:
            run_machine(machine_factory(mode, stats), settings, round_seed)
        except SchedulerExploreFailure as found:
            failure = found
        if on_round is not None:
            on_round(stats)
        return failure

    failure, rounds = run_rounds(one_round, settings, seed, seconds, stats.started)
    saved = failure.save(out) if failure is not None and out is not None else None
    return SchedulerOutcome(failure, saved, stats, time.perf_counter() - stats.started, rounds)
