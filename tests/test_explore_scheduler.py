"""Exploration at the Scheduler level: engine steps on kvgate's scheduler
model and vLLM 0.33.0's real `Scheduler`, in strict lockstep.

The ci profile is clean on stock vLLM, and finds from scratch a Scheduler
fault of the campaign's applied in this process; the trace it saves replays
as a divergence on vLLM with the fault, and conforms without it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from configs import EXAMPLE_CONFIG, needs_vllm
from hypothesis import Phase

from kvgate import cli
from kvgate.conformance.trace import load_trace
from kvgate.conformance.writer import save_engine_trace
from kvgate.explore.profiles import profile
from kvgate.explore.scheduler_machine import SchedulerMode, explore_scheduler
from kvgate.mutate.faults import BY_NAME
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


@needs_vllm
def test_scheduler_ci_profile_is_clean_on_stock_vllm(tmp_path: Path) -> None:
    outcome = explore_scheduler(SchedulerMode(), profile("ci", "scheduler"), out=tmp_path)
    assert outcome.failure is None, str(outcome.failure)
    assert list(tmp_path.iterdir()) == []
    ops = outcome.stats.ops
    # Every prompt shape, aborts of running requests, resets of both kinds
    # with requests running, and pool pressure were reached.
    assert all(ops[f"arrive:{shape}"] for shape in ("fresh", "shared", "next_turn"))
    assert ops["arrive:salted"] and ops["arrive:image"]
    assert ops["abort:prefill"] + ops["abort:decode"]
    assert ops["reset:running:busy"] and ops["reset:kept:busy"]
    assert ops["arrive:remote:sync"] and ops["arrive:remote:async"]
    assert ops["engine:async"]  # two batches in flight
    # The priority policy, with requests of more than one priority.
    assert ops["engine:priority"] and ops["arrive:priority:1"] + ops["arrive:priority:2"]
    # LoRA adapters, some held back by the engine's adapter limit.
    assert ops["arrive:lora"] and ops["step:lora:held_back"]
    # Streaming-input sessions, each kind of chunk.
    assert ops["arrive:session"] and ops["chunk:paused"] and ops["chunk:queued"]
    # Engines publishing KV-cache events (stores and removals; lookups' hits
    # too), and engines with stats logging off.
    assert ops["engine:kv_events:on"] and ops["engine:kv_events:full"]
    assert ops["engine:stats_off"]
    assert outcome.stats.preemptions
    assert len(outcome.stats.families) >= 5


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
