"""Multimodal requests in scheduler-level traces: the reader's checks of
`mm`, the encoder cache model, and drifts the bundled multimodal traces
catch on the model and on vLLM's real `Scheduler`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import yaml
from configs import SMALL_SCHEDULER_TRACE_HEAD, needs_vllm
from scheduler_runs import first_failure, read_error, run_model, run_vllm, trace_of

from kvgate.conformance.replay import ReplayResult
from kvgate.conformance.trace import (
    Trace,
    parse_trace,
)
from kvgate.model.encoder_cache import EncoderCache
from kvgate.vocabulary.scheduling import SchedulerTarget
from kvgate.vocabulary.tokens import NO_INPUTS, HashInputs, MmItem, extend_prefix_keys

CUTS_CHUNK = "sched-mm-encoder-budget-cuts-chunk"
OTHER_IMAGE = "sched-mm-same-tokens-other-image"
PREEMPTED = "sched-mm-preempted-gives-back-image"


# -- the reader ---------------------------------------------------------------

VALID = (
    SMALL_SCHEDULER_TRACE_HEAD.format(name="small")
    + """\
  - {op: arrive, req: A, prompt: [{fresh: 40}], max_tokens: 2,
     mm: [{offset: 8, length: 16, id: cat}]}
  - {op: step, expect: {scheduled: [[A, 40]], encoded: {A: [0]}}}
  - {op: arrive, req: B, prompt: [{prompt_of: A}], max_tokens: 2,
     mm: [{offset: 8, length: 16, id: dog}]}
  - {op: step}
"""
)


def edited(edit: Callable[[dict[str, Any]], None]) -> str:
    doc = yaml.safe_load(VALID)
    edit(doc)
    return str(yaml.safe_dump(doc, sort_keys=False))


def arrival_mm(index: int, *items: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["engine"][index]["mm"] = list(items)

    return edit


def item(offset: int, length: int, identifier: str = "cat") -> dict[str, Any]:
    return {"offset": offset, "length": length, "id": identifier}


def async_config(doc: dict[str, Any]) -> None:
    doc["config"]["async_scheduling"] = True


def encoded(value: object) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["engine"][1]["expect"]["encoded"] = value

    return edit


# (an edit of the valid trace, the engine entry it names, the field)
MALFORMED: dict[str, tuple[Callable[[dict[str, Any]], None], int, str]] = {
    "overlapping items": (arrival_mm(0, item(0, 16), item(8, 8, "dog")), 0, "mm[1].offset"),
    "past the prompt": (arrival_mm(0, item(32, 16)), 0, "mm[0]"),
    "empty item": (arrival_mm(0, item(8, 0)), 0, "mm[0].length"),
    "not a list": (lambda doc: doc["engine"][0].update(mm="cat"), 0, "mm"),
    "one id, two lengths": (arrival_mm(2, item(8, 8, "cat")), 2, "mm[0].length"),
    "under async scheduling": (async_config, 0, "mm"),
    "of a streaming-input session": (
        lambda doc: doc["engine"][0].update(resumable=True),
        0,
        "mm",
    ),
    "encoded not indices": (encoded({"A": "all"}), 1, "expect.encoded"),
    "encoded unknown request": (encoded({"Z": [0]}), 1, "expect.encoded"),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_a_malformed_arrival_item_is_one_error_naming_step_and_field(case: str) -> None:
    edit, step, field = MALFORMED[case]
    error = read_error(edited(edit))
    assert (error.step_index, error.field) == (step, field), str(error)


def test_arrival_items_and_encoder_sizes_read_and_write_back() -> None:
    doc = yaml.safe_load(VALID)
    doc["config"]["encoder_compute_budget"] = 32
    trace = parse_trace(yaml.safe_dump(doc))
    assert trace.engine[0].mm == (MmItem(8, 16, "cat"),)
    assert trace.config.encoder_budget == 32
    # Left out, the cache holds the token budget's worth, as vLLM's default.
    assert trace.config.encoder_cache_slots == trace.config.max_num_scheduled_tokens
    from kvgate.conformance.writer import dump_engine_trace

    assert trace.scheduler is not None
    again = parse_trace(
        dump_engine_trace(trace.name, trace.config, trace.scheduler, trace.engine, None)
    )
    assert again.engine == trace.engine and again.config == trace.config


# -- the encoder cache model --------------------------------------------------

CAT, DOG, COW = MmItem(0, 40, "cat"), MmItem(50, 40, "dog"), MmItem(100, 40, "cow")


def test_a_chunk_stops_before_the_first_item_the_budget_cannot_encode() -> None:
    cache = EncoderCache(size=1000)
    plan = cache.plan("A", (CAT, DOG), computed=0, tokens=120, budget=60)
    assert (plan.encode, plan.tokens, plan.budget_left) == ([0], 50, 20)
    # Already past the item's start, nothing can run.
    assert cache.plan("B", (CAT, DOG), computed=60, tokens=50, budget=10).tokens == 0


def test_a_cached_item_is_a_hit_and_the_oldest_unheld_item_is_evicted() -> None:
    cache = EncoderCache(size=80)
    for req, items in (("A", (CAT,)), ("B", (DOG,))):
        plan = cache.plan(req, items, 0, 200, 1000)
        cache.commit(req, items, plan)
        cache.release_all(req)
    # Both fit, neither held: cat is a hit and becomes held again.
    plan = cache.plan("C", (CAT,), 0, 100, 1000)
    assert plan.encode == [] and cache.holds() == {"C": [0]}
    # Cow needs room: dog, the only item nobody holds, goes.
    plan = cache.plan("D", (COW,), 0, 200, 1000)
    assert plan.encode == [0] and "dog" not in cache.lengths and "cat" in cache.lengths


def test_an_item_a_request_repeats_stays_held_until_its_last_occurrence() -> None:
    cache = EncoderCache(size=100)
    items = (MmItem(0, 10, "cat"), MmItem(20, 10, "cat"))
    plan = cache.plan("A", items, 0, 40, 100)
    assert (plan.encode, plan.repeated) == ([0], [1])
    cache.commit("A", items, plan)
    cache.release("A", 0)
    assert not cache.evictable and cache.holders["cat"] == {"A"}
    cache.release("A", 1)
    assert list(cache.evictable) == ["cat"] and cache.reclaimable == 100


# -- the bundled traces and drifts --------------------------------------------


@pytest.fixture
def blind_to_images(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The model's requests hash their tokens without their images."""

    def without_images(
        keys: list[str],
        tokens: Sequence[int],
        unit: int,
        lookahead: int = 0,
        inputs: HashInputs = NO_INPUTS,
    ) -> None:
        extend_prefix_keys(
            keys, tokens, unit, lookahead, HashInputs(inputs.cache_salt, inputs.lora)
        )

    monkeypatch.setattr("kvgate.model.request.extend_prefix_keys", without_images)
    yield


def test_a_model_blind_to_images_shares_blocks_past_another_image(blind_to_images: None) -> None:
    trace = trace_of(OTHER_IMAGE)
    index, level, what = first_failure(run_model(trace))
    # B, another image, would share A's whole prefix.
    b_first = next(e for e in trace.engine if e.op == "step" and e.index > 3)
    assert (index, level, what) == (b_first.index, "expect", "scheduled")


def test_a_model_without_an_encoder_budget_misses_the_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(EncoderCache, "fits", lambda self, length, budget, planned: True)
    trace = trace_of(CUTS_CHUNK)
    assert first_failure(run_model(trace)) == (1, "expect", "scheduled")


def run_edited(trace: Trace, edit: Callable[[Any], None]) -> ReplayResult:
    """`trace` on vLLM's Scheduler with `edit` made to vLLM's own object."""

    def edited(real: Any) -> SchedulerTarget:
        edit(real.scheduler)
        target: SchedulerTarget = real
        return target

    return run_vllm(trace, edited)


@needs_vllm
def test_a_scheduler_without_its_encoder_budget_diverges_at_the_cut() -> None:
    def unbounded(scheduler: Any) -> None:
        scheduler.max_num_encoder_input_tokens = 10**6

    result = run_edited(trace_of(CUTS_CHUNK), unbounded)
    # The trace's own expectation misses, and the lockstep names the step.
    assert first_failure(result) == (1, "expect", "scheduled")
    [lockstep] = [d for d in result.also if d.level == "api"]
    assert (lockstep.step.index, lockstep.what) == (1, "engine step 1: scheduled (request, tokens)")


@needs_vllm
def test_a_scheduler_whose_encoder_cache_never_hits_diverges_on_the_encoded_items(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    monkeypatch.setattr(EncoderCacheManager, "check_and_update_cache", lambda *args: False)
    trace = trace_of(PREEMPTED)
    index, level, what = first_failure(run_vllm(trace))
    resumed = [e for e in trace.engine if e.expect.get("encoded") == {}][0]
    assert (index, level) == (resumed.index, "api")
    assert what.endswith("encoder inputs scheduled (request: items)"), what
