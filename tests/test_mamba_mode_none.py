"""Mamba cache mode `none`: what `--no-enable-prefix-caching` runs.

The model's `MambaNoneManager` against vLLM's `MambaManager` built with
`mamba_cache_mode="none"`, in lockstep at strict level: the corpus traces of
the three families (at the engine's Mamba block, max_model_len, where the
two modes count alike), and a Mamba block finer than max_model_len (the
manager accepts it; the engine does not), where drafts get slots and states
below the running one are freed. A model that ran align mode instead must
diverge from vLLM there.
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import replace
from typing import cast

import pytest
from configs import needs_vllm, trace_config, trace_text

from kvgate.conformance.replay import ReplayResult, replay
from kvgate.conformance.trace import Trace, TraceError, bundled_corpus, load_corpus, parse_trace
from kvgate.conformance.writer import dump_trace
from kvgate.model import ModelTarget
from kvgate.model.scope import validate
from kvgate.vocabulary.config import (
    Config,
    MambaCacheMode,
    NotModelled,
    RefusedByVllm,
    UnsupportedConfig,
)

CORPUS = {t.name: t for t in load_corpus(bundled_corpus())}
MODE_NONE = [
    "mode-none-gdn-triton",
    "mode-none-gdn-flashinfer",
    "mode-none-mamba2",
]

# A GDN-style hybrid whose Mamba block (32) is finer than its prompts, so
# each step frees the states below the running one.
FINE_BLOCK = trace_text(
    """\
    - {op: arrive, req: A, prompt: [{fresh: 150}]}
    - {op: prefill, req: A, lookahead: 2}
    - {op: decode, req: A, steps: 4, spec: 2}
    - {op: arrive, req: B, prompt: [{prompt_of: A}, {fresh: 40}]}
    - {op: prefill, req: B, lookahead: 2}
    - {op: free, req: B, how: preempt}
    - {op: evict, blocks: 4}
    - {op: prefill, req: B, lookahead: 2}
    - {op: decode, req: B, steps: 3, spec: 2}
    - {op: free, req: A, how: finish}
    - {op: free, req: B, how: abort}
    - {op: drain}
    - {op: check, pool_clean: true}
    """,
    trace_config(
        speculative_blocks=2,
        extra="  prefix_caching: false\n  mamba_cache_mode: none\n  max_num_scheduled_tokens: 48\n",
    ),
    "mode-none-fine-block",
)


def as_align(config: Config) -> ModelTarget:
    """A model that ignores the mode: the drift the test must catch."""
    return ModelTarget(replace(config, mamba_cache_mode="align"))


def on_vllm(trace: Trace, model: type[ModelTarget] | object = ModelTarget) -> ReplayResult:
    from kvgate.impl.vllm_target import VllmTarget

    with closing(VllmTarget(trace.config)) as target:
        managers = target.manager.coordinator.single_type_managers
        assert [getattr(m, "mamba_cache_mode", None) for m in managers][1:] == ["none"]
        return replay(trace, target, model, "strict")  # type: ignore[arg-type]


@needs_vllm
@pytest.mark.parametrize("name", MODE_NONE)
def test_the_families_conform_in_mode_none(name: str) -> None:
    # At the engine's Mamba block (max_model_len) a request's count is 1 +
    # speculative blocks in either mode and nothing lies below its state:
    # these traces reach vLLM's non-align paths, the fine block below tells
    # the modes apart.
    result = on_vllm(CORPUS[name])
    assert result.passed, result.divergence


@needs_vllm
def test_states_below_the_running_one_are_freed_as_vllm_frees_them() -> None:
    trace = parse_trace(FINE_BLOCK, "fine.yaml")
    result = on_vllm(trace)
    assert result.passed, result.divergence
    assert not on_vllm(trace, as_align).passed


def test_the_mode_reads_and_writes_back_and_defaults_to_align() -> None:
    trace = parse_trace(FINE_BLOCK, "fine.yaml")
    assert trace.config.mamba_cache_mode == "none"
    text = dump_trace("again", trace.config, list(trace.steps))
    assert "mamba_cache_mode: none" in text
    assert parse_trace(text, "again.yaml").config == trace.config
    align = replace(trace.config, mamba_cache_mode="align", prefix_caching=True)
    assert "mamba_cache_mode" not in dump_trace("x", align, [])


def test_mode_none_with_caching_is_vllms_refusal_and_other_modes_are_not_modelled() -> None:
    none = parse_trace(FINE_BLOCK, "fine.yaml").config
    with pytest.raises(RefusedByVllm) as refused:
        validate(replace(none, prefix_caching=True))
    assert refused.value.field == "mamba_cache_mode"
    with pytest.raises(NotModelled) as not_modelled:
        # A mode outside the type, as a trace may spell one (the reader reads any string).
        validate(replace(none, mamba_cache_mode=cast(MambaCacheMode, "all")))
    assert not_modelled.value.field == "mamba_cache_mode"
    with pytest.raises(TraceError) as error:
        parse_trace(FINE_BLOCK.replace("mamba_cache_mode: none", "mamba_cache_mode: 0"), "x.yaml")
    assert "config.mamba_cache_mode" in str(error.value) and "\n" not in str(error.value)


@needs_vllm
def test_vllm_refuses_mode_none_with_caching_on_the_same_field() -> None:
    from kvgate.impl.vllm_target import VllmTarget

    config = replace(parse_trace(FINE_BLOCK, "fine.yaml").config, prefix_caching=True)
    with pytest.raises(UnsupportedConfig) as error:
        VllmTarget(config)
    assert isinstance(error.value, RefusedByVllm)
    assert error.value.field == "mamba_cache_mode"
