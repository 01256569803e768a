"""The align-mode knobs: prefill checkpoint blocks, retention intervals, the
shared-prefix checkpoint. Format and refusals, the corpus's deployment
families, and the knobs' effects on the model and on the installed vLLM."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
from configs import hybrid_config, needs_vllm, small_trace

from kvgate.conformance.replay import replay
from kvgate.conformance.trace import Trace, TraceError, bundled_corpus, load_corpus, parse_trace
from kvgate.conformance.writer import config_dict
from kvgate.model import ModelTarget
from kvgate.model.request import Request
from kvgate.model.scope import validate
from kvgate.vocabulary.config import GroupConfig, UnsupportedConfig

CORPUS = {t.name: t for t in load_corpus(bundled_corpus())}


def trace_text(retention: str = "0", mamba: str = "", extra: str = "") -> str:
    return small_trace("knobs", retention, mamba, extra)


def test_the_knobs_read_and_write_back() -> None:
    text = trace_text(
        retention="64",
        mamba=", prefill_checkpoint_blocks: 1, prefill_checkpoint_alignment: 1",
        extra="  shared_prefix_checkpoint: true\n",
    )
    config = parse_trace(text).config
    mamba = config.groups[1]
    assert (mamba.prefill_checkpoint_blocks, mamba.prefill_checkpoint_alignment) == (1, 1)
    assert config.retention_interval == 64 and config.shared_prefix_checkpoint
    written = config_dict(config)
    assert written["shared_prefix_checkpoint"] is True
    assert written["groups"][1]["prefill_checkpoint_alignment"] == 1
    # Off, nothing is written: older traces read back unchanged.
    plain = config_dict(parse_trace(trace_text()).config)
    assert "shared_prefix_checkpoint" not in plain
    assert "prefill_checkpoint_blocks" not in plain["groups"][1]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (trace_text(retention="48"), "retention_interval"),
        (trace_text(retention="-32"), "retention_interval"),
        (
            trace_text(mamba=", prefill_checkpoint_blocks: 1, prefill_checkpoint_alignment: 0"),
            "config.groups[1].prefill_checkpoint_alignment",
        ),
        (trace_text(mamba=", prefill_checkpoint_blocks: -1"), "prefill_checkpoint_blocks"),
        (
            trace_text(mamba=", prefill_checkpoint_alignment: yes"),
            "config.groups[1].prefill_checkpoint_alignment",
        ),
        (trace_text(extra="  shared_prefix_checkpoint: 1\n"), "config.shared_prefix_checkpoint"),
        (
            trace_text().replace(
                "{kind: full_attention, block_size: 8}",
                "{kind: full_attention, block_size: 8, prefill_checkpoint_blocks: 1}",
            ),
            "groups[0].prefill_checkpoint_blocks",
        ),
    ],
)
def test_bad_knob_values_are_one_line_errors_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(TraceError) as error:
        parse_trace(text, "knobs.yaml")
    message = str(error.value)
    assert field in message and "\n" not in message and "knobs.yaml" in message


FAMILIES = {
    # name prefix: (checkpoint blocks, alignment) of every Mamba group
    "gdn-triton-": (0, None),
    "gdn-flashinfer-": (1, 64),
    "mamba2-": (1, 1),
}


def family_traces(prefix: str) -> list[Trace]:
    return [t for name, t in CORPUS.items() if name.startswith(prefix)]


@pytest.mark.parametrize("prefix", list(FAMILIES))
def test_each_deployment_family_is_in_the_corpus_in_both_arms(prefix: str) -> None:
    traces = family_traces(prefix)
    scenarios = {t.name.rsplit(".hold-", 1)[0] for t in traces}
    assert scenarios
    for scenario in scenarios:
        assert {f"{scenario}.hold-on", f"{scenario}.hold-off"} <= set(CORPUS)
    for trace in traces:
        config = trace.config
        for group_id in config.mamba_group_ids:
            group = config.groups[group_id]
            assert (group.prefill_checkpoint_blocks, group.prefill_checkpoint_alignment) == (
                FAMILIES[prefix]
            )


def test_the_corpus_has_periodic_retention_and_shared_prefix_siblings() -> None:
    configs = [t.config for t in CORPUS.values()]
    assert any((c.retention_interval or 0) > c.scheduler_block_size for c in configs)
    assert any(c.shared_prefix_checkpoint_on for c in configs)
    assert any("siblings" in name for name in CORPUS)


def model_hits(text: str) -> list[int]:
    """The hits a trace's lookups get on the model, its expectations dropped."""
    trace = parse_trace(re.sub(r", expect: \{hit: \d+\}", "", text))
    hits: list[int] = []

    class Recording(ModelTarget):
        def lookup(self, request: Request) -> tuple[Any, int, int]:
            found = super().lookup(request)
            hits.append(found[1])
            return found

    result = replay(trace, Recording(trace.config), None, "strict")
    assert result.passed, result.divergence
    return hits


def corpus_text(name: str) -> str:
    return CORPUS[name].path.read_text()


def test_retention_modes_decide_where_a_sibling_resumes() -> None:
    """S2 shares S1's system prompt: the periodic state (128) survives sparse
    retention only with an interval; dense keeps every chunk end (192)."""
    text = corpus_text("gdn-triton-siblings-periodic-retention.hold-on")
    hits = {
        mode: model_hits(text.replace("retention_interval: 128", f"retention_interval: {mode}"))[1]
        for mode in ("0", "128", "null")
    }
    assert hits == {"0": 0, "128": 128, "null": 192}


def test_the_shared_prefix_checkpoint_keys_the_exact_junction() -> None:
    text = corpus_text("gdn-triton-shared-prefix-checkpoint.hold-on")
    on = model_hits(text)
    off = model_hits(
        text.replace("shared_prefix_checkpoint: true", "shared_prefix_checkpoint: false")
    )
    assert on[2] == 200 and off[2] == 192  # S3, the sibling after the junction


def test_internal_checkpoints_run_a_prompt_in_one_chunk() -> None:
    """With a checkpoint block and a valid export, the final chunk needs no
    stop at the last cacheable block (128) nor at the prompt's tail (144)."""
    chunks: list[list[int]] = []
    for mamba in ("", ", prefill_checkpoint_blocks: 1, prefill_checkpoint_alignment: 1"):
        text = trace_text(mamba=mamba).replace("{fresh: 70}", "{fresh: 150}")
        trace = parse_trace(text + "  - {op: prefill, req: A}\n")
        sizes: list[int] = []
        chunks.append(sizes)

        class Splits(ModelTarget):
            record = sizes

            def split(self, request: Request, num_new: int, hit: int, external: int = 0) -> int:
                n = super().split(request, num_new, hit, external)
                self.record.append(n)
                return n

        assert replay(trace, Splits(trace.config), None, "strict").passed
    assert chunks == [[128, 16, 6], [150]]


@needs_vllm
def test_vllm_accepts_the_retention_intervals_the_model_accepts() -> None:
    from kvgate.impl.vllm_target import VllmTarget

    base = hybrid_config(
        GroupConfig("full_attention", 8),
        GroupConfig("mamba_align", 32, 0, 1, 64),
        eagle=True,
        retention_interval=96,
        shared_prefix_checkpoint=True,
    )
    validate(base)
    VllmTarget(base).close()
    bad = replace(base, retention_interval=48)
    with pytest.raises(UnsupportedConfig) as model:
        validate(bad)
    with pytest.raises(UnsupportedConfig) as vllm:
        VllmTarget(bad)
    assert model.value.field == vllm.value.field == "retention_interval"
