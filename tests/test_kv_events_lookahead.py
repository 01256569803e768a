"""KV-cache events under lookahead block hashes, and the full-report crash.

With lookahead hashes (an EAGLE/MTP drafter's default) every BlockStored
also lists, per block, the tokens after it that its key covers; the model
produces them and the lockstep comparison compares them. A full-report
lookup whose Mamba hit list runs past the request's keys makes vLLM 0.33.0
raise IndexError; the model refuses that lookup by name.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from configs import needs_vllm, trace_config, trace_text
from hypothesis import Phase

from kvgate.conformance.replay import replay
from kvgate.conformance.trace import Trace, TraceError, bundled_corpus, load_corpus, parse_trace
from kvgate.explore import knobs
from kvgate.explore.differential import differential_mode
from kvgate.explore.profiles import profile
from kvgate.explore.runner import explore
from kvgate.model import ModelTarget
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.events import KvEvent
from kvgate.vocabulary.tokens import FIRST_FRESH_TOKEN, key_position

FAMILIES = ("gdn-triton", "gdn-flashinfer", "mamba2")

# A Mamba sub-block hit (80, inside the block 64-96) on a request of 90
# tokens: its last key is at 88, the hit list's copy source ends at 96.
CRASH_TRACE = trace_text(
    """\
    - {op: arrive, req: A0, prompt: [{fresh: 90}]}
    - {op: prefill, req: A0, lookahead: 2}
    - {op: free, req: A0, how: finish}
    - {op: drain}
    - {op: arrive, req: A1, prompt: [{prompt_of: A0}]}
    - {op: lookup, req: A1}
    """,
    trace_config(
        40,
        speculative_blocks=2,
        extra="  scheduler_block_size: 32\n  kv_events: true\n  kv_events_full: true\n",
    ),
    "full-report-past-the-keys",
)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_reports_full_hits_with_lookahead_hashes_in_both_arms(family: str) -> None:
    traces = {t.name: t for t in load_corpus(bundled_corpus())}
    for arm in ("on", "off"):
        trace = traces[f"{family}-kv-events-full-lookahead.hold-{arm}"]
        config = trace.config
        assert config.kv_events_full and config.hash_lookahead_tokens == 1
        assert config.hold == (arm == "on")
        assert any(s.op == "events" and s.expect.get("events") for s in trace.steps)


class RecordingModel(ModelTarget):
    """The model as a target, keeping every event it reports."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.seen: list[KvEvent] = []

    def take_events(self) -> list[KvEvent]:
        events = super().take_events()
        self.seen += events
        return events


def corpus_trace(name: str) -> Trace:
    return next(t for t in load_corpus(bundled_corpus()) if t.name == name)


def test_the_model_lists_the_token_after_each_stored_block() -> None:
    trace = corpus_trace("gdn-triton-kv-events-full-lookahead.hold-on")
    model = RecordingModel(trace.config)
    result = replay(trace, model, None, "strict", target_is_model=True)
    assert result.divergence is None
    stored = [e for e in model.seen if e.kind == "stored" and e.keys]
    assert stored
    prompt = trace.steps[0].prompt[0].count  # A0's fresh tokens: 1000, 1001, ...
    checked = 0
    for event in stored:
        assert event.lookahead is not None and len(event.lookahead) == len(event.keys)
        for key, after in zip(event.keys, event.lookahead, strict=True):
            end = key_position(key)
            if end < prompt:  # inside A0's prompt: the token there is known
                assert after == (FIRST_FRESH_TOKEN + end,)
                checked += 1
        assert " lookahead " in event.exact()
    assert checked > 10


def test_without_lookahead_hashes_events_carry_no_lookahead() -> None:
    trace = corpus_trace("kv-events-full-report")
    model = RecordingModel(trace.config)
    assert replay(trace, model, None, "strict", target_is_model=True).divergence is None
    assert model.seen and all(e.lookahead is None for e in model.seen)
    assert all(" lookahead " not in e.exact() for e in model.seen)


def test_a_full_report_past_the_request_keys_is_refused_by_name(tmp_path: Path) -> None:
    trace = parse_trace(CRASH_TRACE, tmp_path / "crash.yaml")
    with pytest.raises(TraceError) as refused:
        replay(trace, ModelTarget(trace.config), None, "strict", target_is_model=True)
    message = str(refused.value)
    assert "kv_events_full" in message and "IndexError" in message and "step 5" in message
    assert "\n" not in message
    # Without the full report the same history runs.
    plain = parse_trace(CRASH_TRACE.replace("kv_events_full: true", "kv_events_full: false"))
    result = replay(plain, ModelTarget(plain.config), None, "strict", target_is_model=True)
    assert result.divergence is None


def test_exploration_draws_full_reports_with_lookahead_hashes() -> None:
    config = knobs.build({"kv_events": "full", "hash_lookahead_tokens": 1})
    assert config.kv_events and config.kv_events_full and config.hash_lookahead_tokens == 1
    assert not knobs.build({"kv_events": True}).kv_events_full


@needs_vllm
def test_vllm_raises_on_the_full_report_the_model_refuses(tmp_path: Path) -> None:
    from kvgate.impl.vllm_target import VllmTarget

    trace = parse_trace(CRASH_TRACE, tmp_path / "crash.yaml")
    target = VllmTarget(trace.config)
    try:
        result = replay(trace, target, None, "api")
    finally:
        target.close()
    divergence = result.divergence
    assert divergence is not None and divergence.step.op == "lookup"
    assert "IndexError" in str(divergence.actual)


@needs_vllm
def test_differential_exploration_of_full_reports_with_lookahead_hashes(tmp_path: Path) -> None:
    mode = replace(differential_mode(), stratum={"kv_events": "full", "hash_lookahead_tokens": 1})
    settings = profile("ci", max_examples=30, phases=(Phase.explicit, Phase.generate, Phase.target))
    outcome = explore(mode, settings, out=tmp_path, shrink=False)
    assert outcome.failure is None, outcome.failure.summary()
    assert outcome.stats.knobs["kv_events_full_with_lookahead_hashes=True"] > 0
    assert outcome.stats.ops["events"] > 0


def test_the_summary_counts_examples_dropped_at_the_crash() -> None:
    from io import StringIO

    from kvgate.explore.command import write_summary
    from kvgate.explore.mode import Stats
    from kvgate.explore.runner import Outcome

    stats = Stats(discarded=5, rejected_lookups=2)
    out = StringIO()
    write_summary(out, Outcome(None, None, stats, 1.0, 1))
    first = out.getvalue().splitlines()[0]
    assert "5 dropped part-way by Hypothesis, 2 of them at a kv_events_full lookup" in first
    out = StringIO()
    write_summary(out, Outcome(None, None, Stats(discarded=5), 1.0, 1))
    assert "kv_events_full" not in out.getvalue().splitlines()[0]
