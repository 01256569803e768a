"""Run the state machine: until a budget is spent or a failure is found.

A failure comes back shrunk twice: by Hypothesis (the rule sequence), then
by `session.shrink` (single recorded steps), and is saved as a version-1
trace whose expect/check values show it on replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Generic, TypeVar

from hypothesis import settings as Settings

from kvgate.explore.machine import check_config_rules, machine_class
from kvgate.explore.machine_run import run_machine
from kvgate.explore.mode import Mode, Stats
from kvgate.explore.session import ALL_INVARIANTS, HOLD_ONLY_INVARIANTS, ExploreFailure, Session
from kvgate.explore.session import shrink as shrink_trace
from kvgate.vocabulary.config import Config

FailureT = TypeVar("FailureT")
StatsT = TypeVar("StatsT")


@dataclass
class RunOutcome(Generic[FailureT, StatsT]):
    """How an exploration ended, at either level: its shrunk failure (None
    when the budget ran out first), the trace saved for it, what it
    exercised, how long it took and in how many rounds."""

    failure: FailureT | None
    saved: Path | None
    stats: StatsT
    seconds: float
    rounds: int

    @property
    def passed(self) -> bool:
        return self.failure is None


# The manager-level exploration's.
Outcome = RunOutcome[ExploreFailure, Stats]


def model_mode(hold: bool, check_hold_only: bool = True, retain_retired: bool = False) -> Mode:
    """The model alone; with the hold off the hold-only invariants are
    checked too (that is how the known total miss is found) unless told not
    to. `retire`: the fork's retention of retired states too."""
    invariants = (
        ALL_INVARIANTS
        if (hold or check_hold_only)
        else tuple(i for i in ALL_INVARIANTS if i not in HOLD_ONLY_INVARIANTS)
    )
    return Mode(hold=hold, invariants=tuple(invariants), retain_retired=retain_retired)


def run_once(mode: Mode, settings: Settings, seed: int | None = None) -> ExploreFailure | None:
    """One Hypothesis run of the machine; the (Hypothesis-shrunk) failure, if any."""
    try:
        run_machine(machine_class(mode), settings, seed)
    except ExploreFailure as failure:
        return failure
    return None


def run_rounds(
    run_round: Callable[[int | None], FailureT | None],
    settings: Settings,
    seed: int | None,
    seconds: float | None,
    started: float,
) -> tuple[FailureT | None, int]:
    """Rounds at either level until one returns a failure or, with `seconds`,
    the time since `started` is spent (one round otherwise, and one under a
    derandomized profile, which draws the same examples every round). Round
    k runs with seed `seed + k`. The failure, if any, and how many rounds ran."""
    failure: FailureT | None = None
    rounds = 0
    while failure is None:
        failure = run_round(None if seed is None else seed + rounds)
        rounds += 1
        if seconds is None or time.perf_counter() - started >= seconds or settings.derandomize:
            break
    return failure, rounds


def explore(
    mode: Mode,
    settings: Settings,
    *,
    out: Path | None = None,
    seed: int | None = None,
    seconds: float | None = None,
    on_example: Callable[[Stats], None] | None = None,
    shrink: bool = True,
) -> Outcome:
    """Run rounds of `settings.max_examples` examples until one fails or, with
    `seconds`, the time is spent (one round otherwise). Round k uses seed
    `seed + k` (a derandomized profile ignores it). `shrink=False` skips the
    trace shrinker (Hypothesis's own shrinking is the settings' phase)."""
    mode.stats.on_example = on_example
    mode.stats.started_cpu = time.process_time()
    started = mode.stats.started = time.perf_counter()
    failure: ExploreFailure | None = None
    if mode.refusals and mode.lockstep is not None:
        failure = check_config_rules(mode)
    rounds = 0
    if failure is None:
        one_round = partial(run_once, mode, settings)
        failure, rounds = run_rounds(one_round, settings, seed, seconds, started)
    saved = None
    if failure is not None and shrink:
        failure = shrink_trace(failure, session_factory(mode))
    if failure is not None and out is not None:
        saved = failure.save(out)
    return Outcome(failure, saved, mode.stats, time.perf_counter() - started, rounds)


def session_factory(mode: Mode) -> Callable[[Config], Session]:
    """Fresh sessions for re-running a recorded trace in the same mode."""

    def make(config: Config) -> Session:
        return Session(mode.apply(config), mode.invariants, mode.lockstep)

    return make
