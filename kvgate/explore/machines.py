"""Exploration's Hypothesis state machines, for your own test suite.

    from kvgate.explore import KVManagerMachine, profile

    KVManagerMachine.TestCase.settings = profile("ci")
    TestKVManager = KVManagerMachine.TestCase

`KVManagerMachine` explores kvgate's model of vLLM's hybrid KV-cache manager
with the hold on, checking every invariant after every step;
`VllmLockstepMachine` drives the installed vLLM's manager in lockstep with
the model (hold off, as upstream vLLM; vLLM is imported when an example
first runs) and fails on the first difference. Each machine's
`TestCase.settings` starts as the `dev` profile (seconds); `profile(name)`
gives `dev`, `ci` or `nightly` (`kvgate.explore.profiles`), with any
setting overridden. A failure is raised with the trace of steps that shows
it.
"""

from __future__ import annotations

from kvgate.explore.differential import differential_mode
from kvgate.explore.machine import ExploreMachine, machine_class
from kvgate.explore.mode import Mode
from kvgate.explore.profiles import profile
from kvgate.explore.runner import model_mode

__all__ = ["DEFAULT_PROFILE", "KVManagerMachine", "VllmLockstepMachine", "profile"]

# The profile a machine's TestCase runs with until told otherwise.
DEFAULT_PROFILE = "dev"


def _public(name: str, mode: Mode, doc: str) -> type[ExploreMachine]:
    machine = machine_class(mode)
    machine.__name__ = machine.__qualname__ = name
    machine.__doc__ = doc
    machine.__module__ = "kvgate.explore"
    machine.TestCase.settings = profile(DEFAULT_PROFILE)
    return machine


KVManagerMachine = _public(
    "KVManagerMachine",
    model_mode(hold=True),
    "kvgate's model of the hybrid KV-cache manager, hold on, every invariant checked.",
)
VllmLockstepMachine = _public(
    "VllmLockstepMachine",
    differential_mode(),
    "The installed vLLM's KV-cache manager in lockstep with kvgate's model (hold off).",
)
