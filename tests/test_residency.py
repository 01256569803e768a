"""KV-cache residency metrics (`kv_cache_metrics`, the `residency` op).

The model predicts which residencies end, in which order, with how many
reuse gaps; vLLM's collector (the one its Scheduler builds) reports the
same through the pool's real calls. The corpus's residency traces run on
both in `test_corpus_gate`; here: the rule for reuse gaps, the reading of
the config, what is reported where the Scheduler drains nothing, and the
wall-clock checks the vLLM side makes on values it does not compare.
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from configs import EXAMPLE_TRACE_CONFIG, hybrid_config, needs_vllm

from kvgate.conformance.trace import TraceError, parse_trace
from kvgate.model import ModelTarget
from kvgate.model.residency import Residency
from kvgate.model.scope import validate
from kvgate.vocabulary.config import GroupConfig, NotModelled
from kvgate.vocabulary.ops import Segment, Step
from kvgate.vocabulary.residency import Eviction, report, reuse_gaps

CONFIG = hybrid_config(
    GroupConfig("full_attention", 8),
    GroupConfig("mamba_align", 32, speculative_blocks=3),
    num_blocks=40,
    eagle=True,
    hash_unit=8,
    kv_cache_metrics=True,
)


def test_an_event_carries_at_most_three_reuse_gaps() -> None:
    # vLLM keeps a block's last four access times; its allocation is none.
    assert [reuse_gaps(n) for n in range(7)] == [0, 0, 1, 2, 3, 3, 3]


def test_a_residency_starts_at_each_hand_out_and_a_reset_drops_the_undrained() -> None:
    residency = Residency()
    residency.evicted(3)  # never handed out: no residency ends
    residency.allocated(3)
    for _ in range(3):
        residency.accessed(3)
    residency.accessed(4)  # no residency: not counted anywhere
    residency.allocated(4)
    residency.evicted(3)
    residency.evicted(3)  # already ended
    assert residency.drain() == [Eviction(3, 2)]
    residency.allocated(5)
    residency.evicted(4)
    residency.reset()
    residency.evicted(5)
    assert residency.drain() == []


def test_the_report_is_the_histogram_and_the_lines() -> None:
    evictions = [Eviction(7, 0), Eviction(2, 3), Eviction(9, 0)]
    assert report(evictions) == {
        "evicted": 3,
        "reuse_gaps": [2, 0, 0, 1],
        "evictions": ["block 7 gaps 0", "block 2 gaps 3", "block 9 gaps 0"],
    }
    # More gaps than vLLM keeps (a broken collector) widen the histogram
    # instead of hiding in its last bucket.
    assert report([Eviction(1, 5, "x")])["reuse_gaps"] == [0, 0, 0, 0, 0, 1]
    assert report([Eviction(1, 5, "x")])["evictions"] == ["block 1 gaps 5 (x)"]


def test_only_every_block_sampled_is_modelled() -> None:
    with pytest.raises(NotModelled) as error:
        validate(replace(CONFIG, kv_cache_metrics_sample=0.5))
    assert error.value.field == "kv_cache_metrics_sample"
    # Off, the rate samples nothing: any rate vLLM takes reads.
    validate(replace(CONFIG, kv_cache_metrics=False, kv_cache_metrics_sample=0.5))


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("kv_cache_metrics: 1", "config.kv_cache_metrics"),
        ("kv_cache_metrics_sample: high", "config.kv_cache_metrics_sample"),
        ("kv_cache_metrics_sample: true", "config.kv_cache_metrics_sample"),
    ],
)
def test_a_malformed_metrics_config_is_named(line: str, field: str) -> None:
    text = f"format: kvgate-trace/1\nname: t\n{EXAMPLE_TRACE_CONFIG}  {line}\nsteps: []\n"
    with pytest.raises(TraceError) as error:
        parse_trace(text)
    assert error.value.field == field


def test_a_malformed_residency_expectation_is_named() -> None:
    steps = "steps:\n  - {op: residency, expect: {reuse_gaps: [1, -1]}}\n"
    text = f"format: kvgate-trace/1\nname: t\n{EXAMPLE_TRACE_CONFIG}{steps}"
    with pytest.raises(TraceError) as error:
        parse_trace(text)
    assert (error.value.step_index, error.value.field) == (0, "expect.reuse_gaps")


def _burst_history(target: Any) -> list[dict[str, Any]]:
    """A prompt cached, two siblings hitting it, two bursts: the residency
    op's reports."""
    reports = []
    prompt = (Segment("fresh", count=96),)
    target.apply(Step("arrive", 0, req="P", prompt=prompt))
    for name in ("P", "S1", "S2"):
        if name != "P":
            sibling = (Segment("prompt_of", req="P"), Segment("fresh", count=20))
            target.apply(Step("arrive", 0, req=name, prompt=sibling))
        target.apply(Step("lookup", 0, req=name))
        for _ in range(4):  # the prefill macro's chunks
            allocated = target.apply(Step("allocate", 0, req=name, tokens="auto", lookahead=3))
            target.apply(Step("step", 0))
            target.apply(Step("drain", 0))
            if allocated["prompt_done"]:
                break
        target.apply(Step("free", 0, req=name, how="finish"))
        target.apply(Step("drain", 0))
    for _ in range(2):
        target.apply(Step("evict", 0, blocks="all"))
        reports.append(target.apply(Step("residency", 0)))
    return reports


def test_the_model_reports_nothing_where_the_scheduler_makes_no_stats() -> None:
    with closing(ModelTarget(CONFIG)) as on:
        reports = _burst_history(on)
    assert reports[0]["evicted"] > 0 and reports[0]["reuse_gaps"][1] > 0, reports
    assert reports[1]["evicted"] == CONFIG.num_blocks - 1
    with closing(ModelTarget(replace(CONFIG, disable_log_stats=True))) as silent:
        assert _burst_history(silent) == [{"free_blocks": CONFIG.num_blocks - 1}] * 2
    with closing(ModelTarget(replace(CONFIG, kv_cache_metrics=False))) as off:
        assert [r["evicted"] for r in _burst_history(off)] == [0, 0]


@needs_vllm
@pytest.mark.parametrize(
    "config",
    [CONFIG, replace(CONFIG, disable_log_stats=True), replace(CONFIG, kv_cache_metrics=False)],
    ids=["on", "no-stats", "off"],
)
def test_vllm_reports_what_the_model_predicts(config: Any) -> None:
    from kvgate.impl.vllm_target import VllmTarget

    with closing(ModelTarget(config)) as model, closing(VllmTarget(config)) as vllm:
        assert _burst_history(vllm) == _burst_history(model)


@needs_vllm
def test_vllm_gets_the_collector_its_scheduler_builds() -> None:
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    from kvgate.impl.vllm_target import VllmTarget

    with closing(VllmTarget(CONFIG)) as target:
        collector = target.manager.metrics_collector
        assert isinstance(collector, KVCacheMetricsCollector)
        assert collector.sample_rate == 1.0
        assert target.manager.block_pool.metrics_collector is collector
    with closing(VllmTarget(replace(CONFIG, kv_cache_metrics=False))) as off:
        assert off.manager.block_pool.metrics_collector is None


@needs_vllm
def test_times_that_cannot_be_are_a_flaw_in_the_line() -> None:
    from vllm.v1.metrics.stats import KVCacheEvictionEvent

    from kvgate.impl.vllm_residency import take_evictions

    def drained(*events: Any) -> Any:
        return SimpleNamespace(evicted_block_ids=[4] * len(events), drain_events=lambda: events)

    sound = KVCacheEvictionEvent(lifetime_seconds=2.0, idle_seconds=0.5, reuse_gaps_seconds=(1.0,))
    assert take_evictions(drained(sound)) == [Eviction(4, 1)]
    # The idle time is read after the lifetime: past it is a descheduled
    # process, not a flaw.
    assert take_evictions(drained(replace(sound, idle_seconds=3.0))) == [Eviction(4, 1)]
    gaps_too_long = replace(sound, reuse_gaps_seconds=(1.5, 1.0))
    negative_gap = replace(sound, reuse_gaps_seconds=(-1.0,))
    negative_idle = replace(sound, idle_seconds=-1.0)
    flawed = take_evictions(drained(gaps_too_long, negative_gap, negative_idle))
    assert [e.reuse_gaps for e in flawed] == [2, 1, 1]
    assert all(e.flaw for e in flawed), flawed
