"""The bundled corpus on both targets: the issue's acceptance, run for real.

Upstream traces (neither the hold nor the fork's retired-state retention)
must conform at strict level on the installed vLLM (0.33.0 upstream here)
and on the model. Hold-on traces conform on the model; on a build without
the hold, the gate must fail them on the trace's expectations (the lockstep
model running with the hold off) and say the target lacks it. Traces of the
fork's retention say so too; the one whose next turn needs the retained
state fails there.
"""

from __future__ import annotations

from contextlib import closing

import pytest

from kvgate.conformance.replay import HOLD_NOTE, RETIRE_NOTE, ReplayResult, replay
from kvgate.conformance.trace import Trace, bundled_corpus, load_corpus
from kvgate.invariants.predicates import check_snapshot
from kvgate.model import ModelTarget
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.target import Target, WatchedTarget

# Refusal traces (`expect_refused`) replay nothing: tests/test_refusals.py judges them.
CORPUS = [t for t in load_corpus(bundled_corpus()) if t.expect_refused is None]
HOLD_ON = [t for t in CORPUS if t.config.hold]
# The hold keeps sub-block states: without partial hits (a single group
# hashed at its block) it has nothing to take, and
# upstream runs such a hold-on trace exactly as the hold would.
HOLD_ACTS = [t for t in HOLD_ON if t.config.partial_hits]
HOLD_INERT = [t for t in HOLD_ON if not t.config.partial_hits and not t.config.retain_retired]
RETIRED = [t for t in CORPUS if t.config.retain_retired]
# What upstream vLLM 0.33.0 runs as it is.
HOLD_OFF = [t for t in CORPUS if not t.config.hold and not t.config.retain_retired]


def ids(traces: list[Trace]) -> list[str]:
    return [t.name for t in traces]


def test_the_corpus_covers_the_seed_in_both_arms_and_more() -> None:
    # Each seed scenario in both arms; some also as the fork's build (`.fork`).
    seeds = {t.name.split(".hold-")[0] for t in CORPUS if t.name.startswith("seed")}
    for scenario in seeds:
        assert {f"{scenario}.hold-on", f"{scenario}.hold-off"} <= set(ids(CORPUS))
    assert {s.split("-")[0] for s in seeds} == {f"seed{i}" for i in range(1, 6)}
    assert any(s.endswith(".fork") for s in seeds)
    own = [t for t in CORPUS if not t.name.startswith("seed")]
    assert len(own) >= 10


@pytest.mark.parametrize("trace", CORPUS, ids=ids(CORPUS))
def test_every_trace_conforms_on_the_model(trace: Trace) -> None:
    target = ModelTarget(trace.config)
    result = replay(trace, target, None, "strict")
    assert result.passed, result.divergence


def replay_on_vllm(trace: Trace) -> ReplayResult:
    from kvgate.impl.vllm_target import VllmTarget

    with closing(VllmTarget(trace.config)) as target:
        return replay(trace, target, ModelTarget, "strict")


def replay_on_upstream(trace: Trace, feature: str) -> ReplayResult:
    """The trace on the installed vLLM, which must lack `feature` (a
    `Capabilities` flag: the hold, retired-state retention); else skipped."""
    pytest.importorskip("vllm")
    result = replay_on_vllm(trace)
    if getattr(result.capabilities, feature):
        pytest.skip(f"the installed vLLM build has the {feature} feature")
    return result


@pytest.mark.parametrize("trace", HOLD_OFF, ids=ids(HOLD_OFF))
def test_hold_off_traces_conform_on_vllm_at_strict_level(trace: Trace) -> None:
    pytest.importorskip("vllm")
    result = replay_on_vllm(trace)
    assert result.passed, result.divergence
    assert result.notes == ()


@pytest.mark.parametrize("trace", HOLD_ACTS, ids=ids(HOLD_ACTS))
def test_hold_on_traces_fail_on_upstream_vllm_which_lacks_the_hold(trace: Trace) -> None:
    result = replay_on_upstream(trace, "hold")
    assert not result.passed
    assert HOLD_NOTE in result.notes
    # Every failure is the trace's own expectation: the target behaves exactly
    # like the model with the hold off.
    assert result.failures and all(d.level == "expect" for d in result.failures)


@pytest.mark.parametrize("trace", HOLD_INERT, ids=ids(HOLD_INERT))
def test_hold_on_traces_without_partial_hits_pass_on_upstream_vllm(trace: Trace) -> None:
    pytest.importorskip("vllm")
    result = replay_on_vllm(trace)
    assert result.passed, result.divergence
    if not result.capabilities.hold:
        assert HOLD_NOTE in result.notes


def test_some_hold_on_traces_are_outside_the_holds_scope() -> None:
    # A pure Mamba model, hashed at its block: the hold is inert there.
    assert {t.name for t in HOLD_INERT} >= {
        "pure-mamba-next-turn-siblings.hold-on",
        "pure-mamba-dense-resend.hold-on",
    }


@pytest.mark.parametrize("trace", RETIRED, ids=ids(RETIRED))
def test_retired_state_traces_say_upstream_keeps_none(trace: Trace) -> None:
    result = replay_on_upstream(trace, "retain_retired")
    assert RETIRE_NOTE in result.notes
    failures = result.failures
    assert all(d.level == "expect" for d in failures)
    if trace.name == "retired-state-held.fork.hold-off":
        # The next turn needed the retained state: upstream misses it.
        assert [(d.step.op, d.expected, d.actual) for d in failures if d.what == "hit"] == [
            ("lookup", 96, 0)
        ]


@pytest.mark.parametrize(
    "name", ["seed1-next-turn-after-burst.hold-on", "seed2-own-tail-survives-burst.hold-on"]
)
def test_next_turn_traces_show_the_total_miss_at_the_lookup(name: str) -> None:
    pytest.importorskip("vllm")
    [trace] = [t for t in HOLD_ON if t.name == name]
    result = replay_on_vllm(trace)
    misses = [d for d in result.failures if d.what == "hit"]
    first = misses[0]
    assert first.step.op == "lookup" and first.step.req == "A2"
    assert (first.expected, first.actual) == (168, 0)


class InvariantChecking:
    """After every step of a target, the snapshot invariants must hold."""

    def __init__(self) -> None:
        self.steps_checked = 0

    def __call__(self, step: Step, target: Target) -> None:
        violations = check_snapshot(target.snapshot())
        assert not violations, f"after {step.where()}: {[str(v) for v in violations]}"
        self.steps_checked += 1


@pytest.mark.parametrize("trace", CORPUS, ids=ids(CORPUS))
def test_snapshot_invariants_hold_after_every_step_on_the_model(trace: Trace) -> None:
    checking = InvariantChecking()
    target = WatchedTarget(ModelTarget(trace.config), checking)
    assert replay(trace, target, None, "api").passed
    assert checking.steps_checked > 10


@pytest.mark.parametrize("trace", HOLD_OFF, ids=ids(HOLD_OFF))
def test_snapshot_invariants_hold_after_every_step_on_vllm(trace: Trace) -> None:
    pytest.importorskip("vllm")
    from kvgate.impl.vllm_target import VllmTarget

    checking = InvariantChecking()
    with closing(WatchedTarget(VllmTarget(trace.config), checking)) as target:
        assert replay(trace, target, None, "api").passed
    assert checking.steps_checked > 10
