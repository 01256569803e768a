"""The model's two arms at the known vLLM defects (trace field `vllm_defects`):
`follow` behaves as vLLM 0.33.0 does, `fixed` as a vLLM that fixed them
would. Each finding's own trace (findings/) replayed on kvgate's scheduler
model alone under both arms, so the arms differ exactly where the finding
says; and the field's reading and refusal. Model only: milliseconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import parse_trace
from kvgate.conformance.trace_error import TraceError
from kvgate.conformance.writer import dump_engine_trace
from kvgate.model.encoder_cache import EncoderCache
from kvgate.model.scheduler import SchedulerModel
from kvgate.vocabulary.config import NotModelled
from kvgate.vocabulary.scheduling import EngineStep
from kvgate.vocabulary.tokens import MmItem

FINDINGS = Path(__file__).resolve().parent.parent / "findings"


def finding_trace(slug: str, arm: str | None) -> str:
    """The finding's trace, with `vllm_defects: ARM` when given."""
    text = (FINDINGS / slug / "trace.yaml").read_text(encoding="utf-8")
    assert "\nconfig:\n" in text
    return (
        text if arm is None else text.replace("\nconfig:\n", f"\nconfig:\n  vllm_defects: {arm}\n")
    )


def reports(text: str) -> tuple[Any, list[tuple[str, dict[str, Any]]]]:
    """The model-alone replay's result and what it reported at each step and reset."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def observe(event: EngineStep, got: dict[str, Any]) -> None:
        seen.append((event.op, got))

    result = replay_scheduler(parse_trace(text), SchedulerModel, None, "strict", observe)
    return result, seen


def test_the_default_arm_is_vllms_and_reads_back() -> None:
    assert parse_trace(finding_trace("prefill-never-completes", None)).config.vllm_defects == (
        "follow"
    )
    fixed = parse_trace(finding_trace("prefill-never-completes", "fixed"))
    assert fixed.config.vllm_defects == "fixed"
    assert fixed.scheduler is not None
    written = dump_engine_trace(fixed.name, fixed.config, fixed.scheduler, fixed.engine)
    assert "vllm_defects: fixed" in written
    assert "vllm_defects" not in dump_engine_trace(
        fixed.name,
        parse_trace(finding_trace("prefill-never-completes", None)).config,
        fixed.scheduler,
        fixed.engine,
    )


def test_an_unknown_arm_is_refused_by_name() -> None:
    with pytest.raises((TraceError, NotModelled), match="vllm_defects"):
        parse_trace(finding_trace("prefill-never-completes", "mended"))


def test_prefill_fixed_runs_the_prompt_to_its_end() -> None:
    """vLLM passes B over at every step (the trace expects nothing
    scheduled); fixed, B's 2 last prompt tokens run past the block's end."""
    follow, _ = reports(finding_trace("prefill-never-completes", "follow"))
    assert follow.divergence is None
    fixed, _ = reports(finding_trace("prefill-never-completes", "fixed"))
    assert fixed.divergence is not None
    assert fixed.divergence.what == "scheduled"
    assert fixed.divergence.actual == [("B", 2)]


def test_reset_fixed_returns_false_without_preempting() -> None:
    """vLLM preempts A then raises: the model refuses that reset, naming
    its `running`; fixed, the reset says it could not, and A runs on."""
    with pytest.raises(TraceError, match="running"):
        reports(finding_trace("reset-during-async-load", "follow"))
    fixed, seen = reports(finding_trace("reset-during-async-load", "fixed"))
    assert fixed.divergence is None
    ((_, reset),) = [(op, got) for op, got in seen if op == "reset"]
    assert reset.get("ok") is False, reset
    assert "A" not in reset.get("waiting", []), reset


def test_victim_image_fixed_is_encoded_when_it_runs_again() -> None:
    """vLLM's victim finds its never-encoded image cached and encodes
    nothing; fixed, a later chunk of the victim encodes it."""

    def encoded(text: str) -> list[dict[str, Any]]:
        _, seen = reports(text)
        return [got["encoded"] for op, got in seen if op == "step" and got.get("encoded")]

    step = "  - {op: step, steps: 5}\n"
    follow = finding_trace("victim-image-never-encoded", "follow")
    assert step in follow
    follow = follow.replace(step, "  - {op: step}\n" * 5)
    fixed = follow.replace("vllm_defects: follow", "vllm_defects: fixed")
    before = encoded(follow)
    after = encoded(fixed)
    assert after.count({"L": [0]}) == before.count({"L": [0]}) + 1, (before, after)


def test_forgetting_an_item_uncaches_it_unless_another_holds_it() -> None:
    cache = EncoderCache(100)
    cat = MmItem(offset=0, length=30, identifier="cat")
    cache.store("A", 0, cat)
    cache.forget("A", 0)
    assert not cache.hit("B", 0, cat)
    assert cache.free == cache.reclaimable == 100
    cache.store("A", 0, cat)
    assert cache.hit("B", 0, cat)
    cache.forget("A", 0)
    assert cache.holders["cat"] == {"B"} and cache.free == 70
