"""Exploration at the Scheduler level: engine steps on kvgate's scheduler
model and vLLM 0.33.0's real `Scheduler`, in strict lockstep.

The ci profile is clean on stock vLLM and reaches a list of behaviours, and
finds from scratch a Scheduler fault of the campaign's applied in this
process (the trace it saves replays as a divergence on vLLM with the fault,
and conforms without it), and a fault of the campaign's of each class async
scheduling with drafts brings.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from configs import EXAMPLE_CONFIG, needs_vllm
from hypothesis import Phase

from kvgate import cli
from kvgate.conformance.trace import load_trace
from kvgate.conformance.writer import save_engine_trace
from kvgate.explore.mode import SchedulerMode, SchedulerStats
from kvgate.explore.profiles import profile
from kvgate.explore.scheduler_runner import SchedulerOutcome, explore_scheduler
from kvgate.mutate.faults import BY_NAME, DRAFT_AREAS, FAULTS
from kvgate.mutate.inject import injected
from kvgate.vocabulary.config import GroupConfig
from kvgate.vocabulary.ops import Segment
from kvgate.vocabulary.scheduling import EngineSettings, EngineStep

# A fault in the Scheduler's align-mode split (the prompt's last chunk
# floored to a block boundary): found in the ci profile's first examples.
PLANTED = "sched-split-aligns-last-chunk"


def test_an_explored_history_is_a_scheduler_level_trace(tmp_path: Path) -> None:
    """The writer's `engine` list reads back as the same engine steps; a run
    of plain steps is written as one entry."""
    # The example config with a smaller pool, no drafts, the hold off.
    config = replace(
        EXAMPLE_CONFIG,
        num_blocks=48,
        groups=(GroupConfig("full_attention", 8), GroupConfig("mamba_align", 32)),
        eagle=False,
        hold=False,
        max_model_len=512,
    )
    events = [
        EngineStep("arrive", 0, req="A", prompt=(Segment("fresh", count=40),), max_tokens=3),
        EngineStep("step", 1),
        EngineStep("step", 2),
        EngineStep(
            "arrive",
            3,
            req="B",
            prompt=(Segment("all_of", req="A"), Segment("fresh", count=5)),
            max_tokens=2,
            cache_salt="tenant-b",
            follows="A",
        ),
        EngineStep("reset", 4, running=True),
        EngineStep("abort", 5, req="A"),
        EngineStep("step", 6),
    ]
    path = save_engine_trace(tmp_path, "written", config, EngineSettings(0, 2), events)
    assert "{op: step, steps: 2}" in path.read_text()
    trace = load_trace(path)
    assert trace.scheduler == EngineSettings(0, 2)
    assert trace.config == config
    got = [
        (e.op, e.req, e.prompt, e.max_tokens, e.cache_salt, e.follows, e.running)
        for e in trace.engine
    ]
    want = [
        (e.op, e.req, e.prompt, e.max_tokens, e.cache_salt, e.follows, e.running) for e in events
    ]
    assert got == want


# What the ci profile must reach on stock vLLM: each behaviour by the counts
# that show it (reached when any is above 0), then pool pressure and breadth.
BEHAVIOURS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("a fresh prompt", ("arrive:fresh",)),
    ("a prompt sharing an earlier one", ("arrive:shared",)),
    ("a conversation's next turn", ("arrive:next_turn",)),
    ("another tenant's cache salt", ("arrive:salted",)),
    ("an image", ("arrive:image",)),
    ("an abort of a running request", ("abort:prefill", "abort:decode")),
    ("a reset preempting running requests", ("reset:running:busy",)),
    ("a reset keeping running requests", ("reset:kept:busy",)),
    ("a KV connector's synchronous hit", ("arrive:remote:sync",)),
    ("a KV connector's asynchronous hit", ("arrive:remote:async",)),
    ("two batches in flight (async scheduling)", ("engine:async",)),
    ("the priority policy", ("engine:priority",)),
    ("a request of priority above 0", ("arrive:priority:1", "arrive:priority:2")),
    ("a LoRA adapter", ("arrive:lora",)),
    ("an adapter held back by the engine's limit", ("step:lora:held_back",)),
    ("a streaming-input session", ("arrive:session",)),
    ("a chunk sent to a paused session", ("chunk:paused",)),
    ("a chunk queued while its session runs", ("chunk:queued",)),
    ("KV-cache events of stores and removals", ("engine:kv_events:on",)),
    ("KV-cache events with lookups' hits", ("engine:kv_events:full",)),
    ("stats logging off", ("engine:stats_off",)),
    ("a decode past its output in flight", ("step:decode_past_in_flight",)),
    ("drafts accepted in flight", ("step:drafts_accepted",)),
    ("a stop condition under async scheduling", ("step:stop:async",)),
    ("drafts accepted without async scheduling", ("step:drafts_accepted:sync",)),
    ("a stop met at an accepted draft's step", ("step:stop:accepting",)),
    ("rejected drafts taken back at their batch's update", ("step:drafts_rejected",)),
    (
        "a preemption with an output in flight",
        ("step:preempted_in_flight", "reset:preempted_in_flight"),
    ),
)
PREEMPTION = "a preemption"
FAMILIES = 5
BREADTH = f"{FAMILIES} deployment families"


def unreached(stats: SchedulerStats) -> list[str]:
    """The behaviours a run did not reach."""
    missing = [name for name, keys in BEHAVIOURS if not any(stats.ops[k] for k in keys)]
    if not stats.preemptions:
        missing.append(PREEMPTION)
    if len(stats.families) < FAMILIES:
        missing.append(BREADTH)
    return missing


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[SchedulerOutcome, Path]:
    """The ci profile on stock vLLM, run once for the tests below, and the
    folder it would save a failure in."""
    out = tmp_path_factory.mktemp("explored")
    return explore_scheduler(SchedulerMode(), profile("ci", "scheduler"), out=out), out


@needs_vllm
def test_scheduler_ci_profile_is_clean_on_stock_vllm(ci_run: tuple[SchedulerOutcome, Path]) -> None:
    outcome, out = ci_run
    assert outcome.failure is None, str(outcome.failure)
    assert list(out.iterdir()) == []


@needs_vllm
def test_scheduler_ci_profile_reaches_every_behaviour(
    ci_run: tuple[SchedulerOutcome, Path],
) -> None:
    assert unreached(ci_run[0].stats) == []


@needs_vllm
def test_a_behaviour_the_run_did_not_reach_is_named(ci_run: tuple[SchedulerOutcome, Path]) -> None:
    """Each behaviour's check can fail: with its counts taken out of the
    run's, exactly it is named."""
    stats = ci_run[0].stats
    for name, keys in BEHAVIOURS:
        ops = Counter({k: v for k, v in stats.ops.items() if k not in keys})
        assert unreached(replace(stats, ops=ops)) == [name]
    assert unreached(replace(stats, preemptions=0)) == [PREEMPTION]
    fewer = Counter(dict(list(stats.families.items())[: FAMILIES - 1]))
    assert unreached(replace(stats, families=fewer)) == [BREADTH]


@needs_vllm
def test_scheduler_ci_profile_finds_a_planted_scheduler_fault(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without Hypothesis's shrinking (seconds, not a minute): the trace
    # saved is the first failing history, which replays just as well.
    settings = profile("ci", "scheduler", phases=(Phase.explicit, Phase.generate))
    with injected(BY_NAME[PLANTED]):
        outcome = explore_scheduler(SchedulerMode(), settings, out=tmp_path)
        assert outcome.failure is not None
        assert outcome.failure.kind == "divergence"
        assert outcome.saved is not None
        capsys.readouterr()
        assert cli.main(["replay", str(outcome.saved), "--target", "vllm"]) == 1
        shown = capsys.readouterr().out
    assert outcome.failure.name in shown
    assert "DIVERGE" in shown or "FAIL" in shown
    # The divergence is the fault's: on stock vLLM the same trace conforms.
    assert cli.main(["replay", str(outcome.saved), "--target", "vllm"]) == 0


# Every fault of the classes async scheduling with drafts brings (the fault
# table's `DRAFT_AREAS`): each is found within seconds, the preemption one
# after about a hundred examples.
DRAFT_FAULTS = [f.name for f in FAULTS if f.area in DRAFT_AREAS]


def test_the_planted_faults_cover_every_draft_class() -> None:
    assert {BY_NAME[name].area for name in DRAFT_FAULTS} == set(DRAFT_AREAS)


@needs_vllm
@pytest.mark.parametrize("name", DRAFT_FAULTS)
def test_scheduler_ci_profile_finds_a_fault_of_async_scheduling_with_drafts(name: str) -> None:
    """The ci profile, on vLLM with the campaign's fault in effect in this
    process, finds it from scratch: a divergence in the per-request output
    accounting, in what a step schedules or in what the manager caches.
    Without shrinking (the first failing history is enough to show it is
    found)."""
    settings = profile("ci", "scheduler", phases=(Phase.explicit, Phase.generate))
    with injected(BY_NAME[name]):
        outcome = explore_scheduler(SchedulerMode(), settings)
    assert outcome.failure is not None, name
    assert outcome.failure.kind == "divergence", str(outcome.failure)
    print(
        f"{name} ({BY_NAME[name].area}): found at example "
        f"{outcome.stats.examples + outcome.stats.discarded}, {outcome.seconds:.1f} s"
    )


def test_scheduler_scope_refuses_what_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, named in (
        (["--target", "model"], "--target model"),
        (["--jobs", "2"], "--jobs"),
        (["--hold", "on"], "--hold on"),
        (["--retired", "on"], "--retired on"),
    ):
        assert cli.main(["explore", "--scope", "scheduler", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0], err
