"""Differential exploration: the model and vLLM 0.33.0 in lockstep (strict).

Skipped only when vLLM is not installed.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest
from configs import needs_vllm
from conftest import Found
from hypothesis import Phase

from kvgate.conformance.replay import replay
from kvgate.conformance.trace import load_trace
from kvgate.explore.differential import (
    differential_mode,
    overlay_differential_mode,
    vllm_target,
)
from kvgate.explore.hash_inputs import MODES
from kvgate.explore.profiles import profile
from kvgate.explore.runner import explore
from kvgate.model import ModelTarget
from kvgate.model.pool import BlockPool
from kvgate.vocabulary.ops import FREE_HOW, PRIMITIVE_OPS

pytestmark = needs_vllm


def test_differential_ci_profile_no_divergence_and_every_op(tmp_path: Path) -> None:
    outcome = explore(differential_mode(), profile("ci"), out=tmp_path)
    assert outcome.failure is None, outcome.failure and outcome.failure.summary()
    ops = outcome.stats.ops
    assert [op for op in PRIMITIVE_OPS if not ops[op]] == []
    assert [how for how in FREE_HOW if not ops[f"free:{how}"]] == []
    # Requests arrived with each hash input, some varying their parent's,
    # and every hash-input mode was drawn.
    assert [k for k in ("cache_salt", "lora", "mm", "varied") if not ops[f"arrive:{k}"]] == []
    assert [m for m in MODES if not outcome.stats.knobs[f"hash_inputs={m}"]] == []
    # The residency metrics were drawn and their eviction events compared.
    assert outcome.stats.knobs["kv_cache_metrics=True"] > 0
    assert ops["residency:evicted"] > 0


def test_overlay_differential_ci_profile_hold_on_no_divergence(hold_overlay_plugin: str) -> None:
    """vLLM 0.33.0 with kvgate's hold overlay, hold on, against the hold-on
    model: no divergence and no invariant broken in the ci profile."""
    settings = profile("ci", phases=(Phase.explicit, Phase.generate, Phase.target))
    outcome = explore(overlay_differential_mode(), settings, shrink=False)
    failure = outcome.failure
    assert failure is None, failure.summary()
    assert [op for op in PRIMITIVE_OPS if not outcome.stats.ops[op]] == []


def test_the_saved_total_miss_replays_on_vllm_with_the_same_miss(total_miss: Found) -> None:
    """Found on the model alone (hold off); vLLM 0.33.0 misses the same way,
    and agrees with the model at every step of the replay (strict)."""
    trace = load_trace(total_miss.saved)
    lookup = next(s for s in trace.steps if "hit" in s.expect)
    with closing(vllm_target(trace.config)) as target:
        result = replay(trace, target, ModelTarget, "strict")
    failures = result.failures
    # Only the trace's own demand fails: the lookup's hit, 0 on vLLM too.
    assert [(d.level, d.step.op, d.what, d.actual) for d in failures] == [
        ("expect", "lookup", "hit", 0)
    ]
    assert failures[0].expected == lookup.expect["hit"] > 0


def test_a_model_bug_is_a_divergence_saved_as_a_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted model bug (hashed blocks freed to the head of the free
    queue) is found, and its saved trace diverges when replayed on vLLM."""
    original = BlockPool.free_blocks

    def wrong_order(self: BlockPool, ordered: object) -> None:
        blocks = list(ordered)  # type: ignore[call-overload]
        original(self, blocks)
        hashed = [b.block_id for b in blocks if b.ref == 0 and b.hash is not None]
        for block_id in hashed:
            self.free_queue.remove(block_id)
        self.free_queue.prepend_all(hashed)

    monkeypatch.setattr(BlockPool, "free_blocks", wrong_order)
    search = profile("dev", max_examples=500, phases=(Phase.explicit, Phase.generate))
    outcome = explore(differential_mode(), search, out=tmp_path, seed=0)
    assert outcome.failure is not None and outcome.failure.kind == "divergence"
    assert outcome.saved is not None
    trace = load_trace(outcome.saved)
    with closing(vllm_target(trace.config)) as target:
        result = replay(trace, target, ModelTarget, "strict")
    assert result.divergence is not None
