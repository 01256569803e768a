"""A pure Mamba model (one `mamba_align` group: vLLM's unitary coordinator)
and prefix caching off (vLLM's no-prefix-cache coordinator): the format's
refusals, the model against the installed vLLM's real coordinators, and a
short differential exploration of each."""

from __future__ import annotations

from contextlib import closing
from dataclasses import replace
from pathlib import Path

import pytest
from configs import hybrid_config, needs_vllm
from hypothesis import Phase

from kvgate.conformance.replay import replay
from kvgate.conformance.trace import TraceError, bundled_corpus, load_corpus, parse_trace
from kvgate.conformance.writer import dump_trace
from kvgate.explore.differential import differential_mode
from kvgate.explore.profiles import profile
from kvgate.explore.runner import explore
from kvgate.model import ModelTarget
from kvgate.vocabulary.config import Config, GroupConfig, UnsupportedConfig

CORPUS = {t.name: t for t in load_corpus(bundled_corpus())}

TEXT = """\
format: kvgate-trace/1
name: single
config:
  num_blocks: 16
  hash_unit: {unit}
  retention_interval: 0
{extra}  groups:
{groups}steps:
  - {{op: arrive, req: A, prompt: [{{fresh: 70}}]}}
  - {{op: prefill, req: A}}
"""
MAMBA = "    - {kind: mamba_align, block_size: 32}\n"
ATTENTION = "    - {kind: full_attention, block_size: 8}\n"


def text(unit: int = 32, groups: str = MAMBA, extra: str = "") -> str:
    return TEXT.format(unit=unit, groups=groups, extra=extra)


def test_a_single_mamba_group_and_caching_off_read_and_write_back() -> None:
    trace = parse_trace(text(extra="  prefix_caching: false\n"), "single.yaml")
    assert not trace.config.has_attention and not trace.config.prefix_caching
    again = parse_trace(dump_trace("single", trace.config, list(trace.steps)), "again.yaml")
    assert again.config == trace.config
    # Caching on is the default, and is not written.
    on = parse_trace(text(), "on.yaml").config
    assert on.prefix_caching and "prefix_caching" not in dump_trace("x", on, [])


@pytest.mark.parametrize(
    ("trace_text", "field"),
    [
        # The unitary coordinator asserts its hash unit is its block.
        (text(unit=16), "hash_unit"),
        # Two Mamba groups and no attention: vLLM's hybrid coordinator
        # builds them; kvgate does not model them (tests/test_refusals.py).
        (text(groups=MAMBA + MAMBA), "groups"),
        # An attention block (8) finer than the hash unit (32): vLLM refuses
        # the scheduler block first, before kvgate's own refusal of a model
        # without a Mamba group.
        (text(groups=ATTENTION), "scheduler_block_size"),
        (text(groups=ATTENTION, unit=8), "groups"),
        (text(groups=ATTENTION + ATTENTION + MAMBA, unit=8), "groups"),
        (text(extra="  prefix_caching: 0\n"), "config.prefix_caching"),
    ],
)
def test_refused_configs_are_one_line_errors(trace_text: str, field: str) -> None:
    with pytest.raises(TraceError) as error:
        parse_trace(trace_text, "single.yaml")
    message = str(error.value)
    assert field in message and "\n" not in message and "single.yaml" in message


def test_caching_off_lifts_the_hash_unit_check() -> None:
    # vLLM then sizes a pure Mamba block freely (to max_model_len); no hash.
    trace = parse_trace(text(unit=16, extra="  prefix_caching: false\n"), "off.yaml")
    assert not trace.config.partial_hits


def test_the_model_neither_hits_nor_keys_nor_holds_with_caching_off() -> None:
    trace = CORPUS["prefix-caching-off"]
    config = replace(trace.config, hold=True, retain_retired=True)
    target = ModelTarget(config)
    assert [s.op for s in trace.steps[-2:]] == ["reset", "check"]
    # Up to the final reset (which would forget keys anyway).
    result = replay(replace(trace, config=config, steps=trace.steps[:-2]), target, None, "strict")
    assert result.passed, result.divergence
    snapshot = target.snapshot()
    # Every request ended; with caching its states would stay keyed here.
    assert all(not view.hashes for view in snapshot.blocks) and snapshot.holds == {}


@needs_vllm
@pytest.mark.parametrize(
    ("name", "coordinator"),
    [
        ("pure-mamba-next-turn-siblings.hold-off", "UnitaryKVCacheCoordinator"),
        ("pure-mamba-dense-resend.hold-off", "UnitaryKVCacheCoordinator"),
        ("prefix-caching-off", "KVCacheCoordinatorNoPrefixCache"),
        ("prefix-caching-off-pure-mamba", "KVCacheCoordinatorNoPrefixCache"),
    ],
)
def test_the_model_conforms_with_vllms_own_coordinator_for_it(name: str, coordinator: str) -> None:
    from kvgate.impl.vllm_target import VllmTarget

    trace = CORPUS[name]
    with closing(VllmTarget(trace.config)) as target:
        assert type(target.manager.coordinator).__name__ == coordinator
        result = replay(trace, target, ModelTarget, "strict")
    assert result.passed, result.divergence


@needs_vllm
@pytest.mark.parametrize(
    ("config", "field"),
    [
        (
            hybrid_config(GroupConfig("mamba_align", 32), num_blocks=16),
            "groups",
        ),
        (
            hybrid_config(
                GroupConfig("full_attention", 8),
                GroupConfig("mamba_align", 32),
                num_blocks=64,
                prefix_caching=False,
            ),
            # Align mode without caching: vLLM's engine runs Mamba in mode none.
            "mamba_cache_mode",
        ),
    ],
)
def test_the_scheduler_target_refuses_them_by_name(config: Config, field: str) -> None:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    with pytest.raises(UnsupportedConfig) as error:
        VllmScheduler(config, spec_tokens=0, max_num_seqs=4)
    assert error.value.field == field and "\n" not in error.value.message


@needs_vllm
@pytest.mark.parametrize(
    "stratum", [{"pure_mamba": True, "mamba_groups": 1}, {"prefix_caching": False}]
)
def test_differential_exploration_of_each(stratum: dict[str, object], tmp_path: Path) -> None:
    mode = replace(differential_mode(), stratum=stratum)
    settings = profile("ci", max_examples=40, phases=(Phase.explicit, Phase.generate, Phase.target))
    outcome = explore(mode, settings, out=tmp_path, shrink=False)
    assert outcome.failure is None, outcome.failure.summary()
    knob, value = next(iter(stratum.items()))
    assert outcome.stats.knobs[f"{knob}={value}"] > 0
    assert outcome.stats.knobs[f"{knob}={not value}"] == 0
