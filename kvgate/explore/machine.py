"""A Hypothesis state machine over the trace ops, run on the model: the
basic rules (`rules.py`) and the scenario rules (`scenarios.py`) in one
class, subclassed per `Mode` (`mode.py`).

The basic rules are the trace format's ops as a scheduler issues them; each
hands `kvgate.vocabulary.ops.Step`s to a `Session`, which applies them (to
vLLM too in differential mode), records them and checks every invariant
after each, so a failure is a trace. The scenario rules string those ops
into the situations that break managers like this one.

Swarm testing: each example enables a random subset of the rules
(Hypothesis's stateful engine does that itself: it draws feature flags that
switch rules off per example) and of the config features (`knobs.KNOBS`,
drawn here), so an example dwells on a few kinds of step and config instead
of averaging over all of them. And
`hypothesis.target` steers generation toward the quantities bugs here need:
how far below a Mamba block boundary a follow-up resumes, how many blocks
requests hold or keep in flight, how close the free queue comes to empty.

Hypothesis collects a machine's rules by name from the whole class, so which
module a rule is written in does not change what an example draws.
"""

from __future__ import annotations

from kvgate.conformance.refusal import model_refusal, refusal_of
from kvgate.explore.knobs import rule_breaches
from kvgate.explore.mode import Mode
from kvgate.explore.scenarios import ScenarioRules
from kvgate.explore.session import RefusalDivergence


def check_config_rules(mode: Mode) -> RefusalDivergence | None:
    """Every config of `knobs.rule_breaches` (one of vLLM's config rules
    broken, or a model kvgate does not cover): the model and the lockstep
    target must refuse it alike. The search draws such configs too, one in
    `knobs.REFUSAL_ODDS`, but which rules depends on its draws."""
    assert mode.lockstep is not None, "a differential mode"
    for breach in rule_breaches():
        config = mode.apply(breach)
        refused, account = model_refusal(config)
        other, other_account, _ = refusal_of(mode.lockstep, config)
        if other != refused:
            return RefusalDivergence(config, account, other_account, refused or other or "")
        mode.stats.rule_breaches[refused or "accepted"] += 1
    return None


class ExploreMachine(ScenarioRules):
    """The basic rules and the scenario rules. Subclassed per `Mode` by
    `machine_class`; not run directly."""


def machine_class(mode: Mode) -> type[ExploreMachine]:
    """The machine for `mode` (a subclass: Hypothesis runs classes)."""
    hold = "HoldOn" if mode.hold else "HoldOff"
    kind = "Differential" if mode.lockstep is not None else "Model"
    return type(f"Explore{kind}{hold}", (ExploreMachine,), {"mode": mode})
