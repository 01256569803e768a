"""Running a state machine through Hypothesis's public API, at both levels:
`run_state_machine_as_test` with the profile's settings, a seed given with
`hypothesis.seed`, and, from a machine's teardown, whether Hypothesis is
dropping the example part-way.

Hypothesis seeds a derandomized run (the `ci` profiles) from a digest of
what it runs: the source text of a class or function, or the name of an
object without source. The Scheduler-level machine is run through a named
`MachineFactory`, so a derandomized run's examples change when the machine's
draws change, not when the code around them is edited.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import cast

from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis.errors import StopTest
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kvgate.explore.profiles import draws_from_the_seed_alone


class MachineFactory:
    """A fresh machine per example, built by `build`; `name` names it to
    Hypothesis (and seeds a derandomized run)."""

    def __init__(self, name: str, build: Callable[[], RuleBasedStateMachine]) -> None:
        self.__name__ = name
        self.build = build

    def __call__(self) -> RuleBasedStateMachine:
        return self.build()


def run_machine(
    factory: type[RuleBasedStateMachine] | MachineFactory,
    settings: Settings,
    seed: int | None = None,
) -> None:
    """One Hypothesis run of the machine `factory` builds (a class or a
    `MachineFactory`), under `settings`, from `seed` if given (it overrides
    a derandomized profile). Raises what the machine raised, after
    Hypothesis shrank it."""
    if seed is not None:
        factory = hypothesis_seed(seed)(factory)
    with draws_from_the_seed_alone():
        # Hypothesis takes any callable returning a machine (its docstring:
        # "it can be a class or a function"); its annotation says a class.
        run_state_machine_as_test(cast(type[RuleBasedStateMachine], factory), settings=settings)


def example_cut_short() -> bool:
    """From a machine's teardown: Hypothesis is dropping this example
    part-way (its choice buffer overran, or a draw was invalid). It stops
    such an example by raising `StopTest` through the machine, and the
    teardown runs while that is in flight."""
    return isinstance(sys.exc_info()[1], StopTest)
