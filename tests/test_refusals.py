"""Refusal conformance: kvgate refuses exactly the align-mode configs vLLM refuses.

Two kinds of refusal (kvgate/vocabulary/config.py): `NotModelled`, kvgate's
own (vLLM may serve the config), and `RefusedByVllm`, vLLM's (the model
states the rule, the vLLM target leaves it to vLLM). The refusal traces of
the corpus (`expect_refused`) and a grid of configs around every boundary
of vLLM's rules check that the model's rule and vLLM's agree: a config one
side refuses and the other accepts, or refuses by another field, fails here.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import EXAMPLE_TRACE_CONFIG, hybrid_config, needs_vllm

from kvgate.conformance.refusal import ACCEPTED, judge_refusal, model_refusal, refusal_of
from kvgate.conformance.trace import Trace, TraceError, bundled_corpus, load_corpus, parse_trace
from kvgate.model import ModelTarget
from kvgate.model.scope import validate
from kvgate.vocabulary.config import (
    Config,
    GroupConfig,
    NotModelled,
    RefusedByVllm,
)

REFUSALS = [t for t in load_corpus(bundled_corpus()) if t.expect_refused is not None]
ATTENTION = GroupConfig("full_attention", 8)
MAMBA = GroupConfig("mamba_align", 32, speculative_blocks=3)


def ids(traces: list[Trace]) -> list[str]:
    return [t.name for t in traces]


def refusal_text(config: str, field: str, steps: str = "") -> str:
    return f"format: kvgate-trace/1\nname: r\n{config}expect_refused: {field}\n{steps}"


def retention_refusal(interval: int) -> str:
    """A refusal trace: the seed scenario with `retention_interval` at
    `interval`, which vLLM refuses by that field."""
    return refusal_text(
        EXAMPLE_TRACE_CONFIG.replace("retention_interval: 0", f"retention_interval: {interval}"),
        "retention_interval",
    )


def refuses_by_hash_unit(config: Config) -> Any:
    """A target that refuses every config by another field than the trace's."""
    raise RefusedByVllm("hash_unit", "a target that names another field")


def test_the_corpus_has_a_refusal_trace_for_each_of_vllms_rules() -> None:
    fields = {t.expect_refused for t in REFUSALS}
    assert fields == {
        "retention_interval",
        "long_prefill_token_threshold",
        "scheduler_block_size",
        "hash_unit",
        "kv_cache_metrics_sample",
    }


@pytest.mark.parametrize("trace", REFUSALS, ids=ids(REFUSALS))
def test_the_model_refuses_each_refusal_trace_by_its_field(trace: Trace) -> None:
    with pytest.raises(RefusedByVllm) as error:
        validate(trace.config)
    assert error.value.field == trace.expect_refused
    with pytest.raises(RefusedByVllm):
        ModelTarget(trace.config)
    assert judge_refusal(trace, ModelTarget).passed


@needs_vllm
@pytest.mark.parametrize("trace", REFUSALS, ids=ids(REFUSALS))
def test_vllm_refuses_each_refusal_trace_by_its_field(trace: Trace) -> None:
    from kvgate.impl.vllm_target import VllmTarget

    result = judge_refusal(trace, VllmTarget)
    assert result.passed, result.failures


def _grid() -> Iterator[Config]:
    """Configs on both sides of every boundary of vLLM's rules."""
    base = hybrid_config(ATTENTION, MAMBA, eagle=True)
    for scheduler, retention in itertools.product(
        (32, 64), (None, 0, -32, -1, 8, 16, 32, 48, 64, 96, 128)
    ):
        yield replace(base, scheduler_block_size=scheduler, retention_interval=retention)
    for max_model_len, threshold in itertools.product((1024,), (0, 1, 1023, 1024, 1025, 4096)):
        yield replace(base, max_model_len=max_model_len, long_prefill_token_threshold=threshold)
    for attention, mamba, unit, scheduler in itertools.product(
        (8, 12, 16), (32, 36, 48), (4, 8, 16, 64), (32, 48, 64, 96, 144)
    ):
        groups = (GroupConfig("full_attention", attention), replace(MAMBA, block_size=mamba))
        yield replace(base, groups=groups, hash_unit=unit, scheduler_block_size=scheduler)
    for unit, scheduler, caching in itertools.product((8, 32, 64), (32, 64), (True, False)):
        yield hybrid_config(
            GroupConfig("mamba_align", 32),
            hash_unit=unit,
            scheduler_block_size=scheduler,
            prefix_caching=caching,
        )
    # The residency metrics' sample rate, metrics on or off: vLLM's
    # ObservabilityConfig takes (0, 1]; kvgate models only 1.0.
    for metrics, sample in itertools.product((True, False), (-0.5, 0.0, 0.01, 0.5, 1.0, 1.5)):
        yield replace(base, kv_cache_metrics=metrics, kv_cache_metrics_sample=sample)
    # Two rules broken at once: which one each side names first.
    for retention, unit, threshold in itertools.product((0, 48), (8, 16), (0, 9000)):
        yield replace(
            base,
            groups=(GroupConfig("full_attention", 12), MAMBA),
            hash_unit=unit,
            scheduler_block_size=96,
            retention_interval=retention,
            long_prefill_token_threshold=threshold,
        )
    # Models kvgate does not model: vLLM's refusal still comes first.
    for shape, retention in itertools.product(
        ((ATTENTION,), (ATTENTION, ATTENTION, MAMBA), (MAMBA, MAMBA)), (None, 0, 8, 32, 48)
    ):
        yield replace(base, groups=shape, scheduler_block_size=32, retention_interval=retention)


GRID = list(_grid())


@needs_vllm
def test_the_models_rules_are_vllms_on_a_grid_around_every_boundary() -> None:
    from kvgate.impl.vllm_target import VllmTarget

    verdicts: Counter[str] = Counter()
    drifted: list[str] = []
    for config in GRID:
        model, _ = model_refusal(config)
        vllm, account, _ = refusal_of(VllmTarget, config)
        verdicts[str(vllm).split(":")[0]] += 1
        if model != vllm:
            drifted.append(f"{config}: model {model}, vLLM {account}")
    assert not drifted, "\n".join(drifted)
    # Both sides of the boundaries were reached: accepted, refused by each
    # of vLLM's fields, and refused by kvgate after vLLM built it.
    assert verdicts["None"] >= 30 and verdicts["not modelled"] >= 5, verdicts
    assert all(verdicts[t.expect_refused or ""] >= 3 for t in REFUSALS), verdicts


@needs_vllm
def test_what_kvgate_refuses_by_name_vllm_serves() -> None:
    """`NotModelled` is kvgate's claim about itself, not vLLM: two Mamba
    groups without attention, and (without prefix caching) a block that is
    not a multiple of the hash unit, are configs vLLM builds."""
    from kvgate.impl import _vllm_api
    from kvgate.impl.vllm_build import build_manager
    from kvgate.impl.vllm_target import VllmTarget

    two_mamba = hybrid_config(MAMBA, MAMBA, hash_unit=32)
    caching_off = hybrid_config(
        GroupConfig("full_attention", 12), MAMBA, scheduler_block_size=96, hash_unit=8
    )
    caching_off = replace(caching_off, prefix_caching=False)
    attention_only = replace(two_mamba, groups=(ATTENTION,), hash_unit=8, scheduler_block_size=8)
    sampled = hybrid_config(
        ATTENTION, MAMBA, eagle=True, kv_cache_metrics=True, kv_cache_metrics_sample=0.5
    )
    api = _vllm_api.load()
    for config, field in (
        (two_mamba, "groups"),
        (caching_off, "groups[0].block_size"),
        (attention_only, "groups"),
        (sampled, "kv_cache_metrics_sample"),
    ):
        with pytest.raises(NotModelled) as error:
            VllmTarget(config)
        assert error.value.field == field
        build_manager(api, config)  # vLLM itself builds it


def test_a_refusal_trace_the_target_accepts_fails_and_says_so() -> None:
    accepted = parse_trace(retention_refusal(32))
    result = judge_refusal(accepted, ModelTarget)
    assert not result.passed and result.steps_run == 0
    first = result.failures[0]
    assert first.level == "expect" and first.step.where() == "config"
    assert first.expected == "refused by retention_interval" and first.actual == ACCEPTED


def test_a_refusal_by_another_field_fails_and_a_drifted_model_is_named() -> None:
    trace = parse_trace(retention_refusal(48))

    def accepts(config: Config) -> Any:
        return ModelTarget(replace(config, retention_interval=0))

    wrong = judge_refusal(trace, refuses_by_hash_unit)
    assert [d.level for d in wrong.failures] == ["expect", "api"]
    assert str(wrong.failures[0].actual).startswith("refused by hash_unit")
    # A target that accepts while the model refuses: kvgate's rule and the
    # target's differ, shown against the model's verdict too.
    drift = judge_refusal(trace, accepts)
    assert [d.level for d in drift.failures] == ["expect", "api"]
    assert str(drift.failures[1].expected).startswith("refused by retention_interval")


def test_a_release_lacking_what_the_refused_config_needs_is_not_applicable() -> None:
    """A release that cannot build the config for a capability it lacks (a
    plain refusal, by another field) cannot show vLLM's refusal: the trace
    is not applicable to it. vLLM refusing by another field still fails."""
    from kvgate.conformance.verdict import Verdict, verdict
    from kvgate.targets import run_trace
    from kvgate.vocabulary.config import UnsupportedConfig

    trace = parse_trace(retention_refusal(48))

    def lacks_hashes(config: Config) -> Any:
        raise UnsupportedConfig("hash_unit", "this release has no such hashes")

    lacking = run_trace(trace, lacks_hashes, None, "strict", False)
    assert verdict(lacking) is Verdict.NOT_APPLICABLE
    assert "config.hash_unit" in str(getattr(lacking, "message", ""))
    other = run_trace(trace, refuses_by_hash_unit, None, "strict", False)
    assert verdict(other) is Verdict.DIVERGES


def test_the_gate_fails_an_accepted_refusal_trace(tmp_path: Path) -> None:
    path = tmp_path / "accepted.yaml"
    path.write_text(retention_refusal(64))
    run = subprocess.run(
        [sys.executable, "-m", "kvgate", "replay", "--target", "model", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert "FAIL r (refusal by retention_interval" in run.stdout
    assert "accepted (nothing replayed)" in run.stdout


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (refusal_text(EXAMPLE_TRACE_CONFIG, "colour"), "expect_refused"),
        (refusal_text(EXAMPLE_TRACE_CONFIG, "[retention_interval]"), "expect_refused"),
        (
            refusal_text(EXAMPLE_TRACE_CONFIG, "retention_interval", "steps: []\n"),
            "steps",
        ),
        # Without `expect_refused`, a config vLLM refuses is refused on reading.
        (
            "format: kvgate-trace/1\nname: r\n"
            + EXAMPLE_TRACE_CONFIG.replace("retention_interval: 0", "retention_interval: -32")
            + "steps:\n  - {op: arrive, req: A, prompt: [{fresh: 4}]}\n",
            "config.retention_interval",
        ),
    ],
)
def test_malformed_refusal_traces_are_named(text: str, field: str) -> None:
    with pytest.raises(TraceError) as error:
        parse_trace(text)
    assert error.value.field == field and "\n" not in str(error.value)


def test_kvgates_own_refusal_does_not_pass_a_refusal_trace() -> None:
    """A refusal trace states what vLLM refuses: kvgate refusing a config by
    name (not modelled) on both sides is no pass."""
    config = EXAMPLE_TRACE_CONFIG.replace("eagle: true", "eagle: false\n  hash_lookahead_tokens: 1")
    trace = parse_trace(refusal_text(config, "hash_lookahead_tokens"))
    result = judge_refusal(trace, ModelTarget)
    assert not result.passed
    assert str(result.failures[0].actual).startswith(
        "refused by kvgate, not modelled (hash_lookahead_tokens)"
    )


def test_refusal_traces_are_read_without_steps() -> None:
    for trace in REFUSALS:
        assert trace.steps == () and trace.primitives == ()


def test_exploration_breaks_a_share_of_configs_and_fails_a_refusal_divergence() -> None:
    """A lockstep target that accepts every retention interval (as vLLM
    would with its check dropped): a drawn config with a broken interval is
    a refusal divergence, shown as the config and saved as a refusal trace."""
    from kvgate.explore.mode import Mode
    from kvgate.explore.profiles import profile
    from kvgate.explore.runner import run_once
    from kvgate.explore.session import ALL_INVARIANTS, RefusalDivergence

    def lax(config: Config) -> Any:
        if config.retention_interval is not None and config.retention_interval < 0:
            config = replace(config, retention_interval=0)
        elif config.retention_interval:
            block = config.scheduler_block_size
            config = replace(
                config, retention_interval=-(-config.retention_interval // block) * block
            )
        return ModelTarget(config)

    mode = Mode(
        hold=False,
        invariants=ALL_INVARIANTS,
        lockstep=lax,
        refusals=True,
        stratum={"prefix_caching": False},
    )
    settings = profile("dev", max_examples=300, stateful_step_count=2, derandomize=True)
    failure = run_once(mode, settings)
    assert isinstance(failure, RefusalDivergence), failure
    assert failure.field == "retention_interval" and failure.steps == ()
    assert "model refused by retention_interval" in failure.message
    assert "target accepted (nothing replayed)" in failure.message
    drawn = mode.stats.knobs
    assert drawn["refused=retention_interval"] >= 1 and drawn["refused=none"] >= 10
    trace = parse_trace(failure.yaml())
    assert trace.expect_refused == "retention_interval"
    assert judge_refusal(trace, lax).failures[0].actual == ACCEPTED


def test_a_differential_run_checks_every_rule_breach_before_its_search() -> None:
    """`check_config_rules`: every breach of `knobs.rule_breaches` is checked
    whatever the search draws, the attention-only model with retention 0
    among them (vLLM builds it, its one retention value without a Mamba
    group; kvgate does not model it); a lockstep target that lets a
    negative interval through is a refusal divergence."""
    from kvgate.explore.knobs import rule_breaches
    from kvgate.explore.machine import check_config_rules
    from kvgate.explore.mode import Mode
    from kvgate.explore.session import ALL_INVARIANTS, RefusalDivergence

    breaches = rule_breaches()
    attention_only = [c for c in breaches if not c.mamba_group_ids]
    assert sorted(c.retention_interval or 0 for c in attention_only) == [0, 32]
    mode = Mode(hold=False, invariants=ALL_INVARIANTS, lockstep=ModelTarget, refusals=True)
    assert check_config_rules(mode) is None
    assert mode.stats.rule_breaches.total() == len(breaches)
    assert mode.stats.rule_breaches["not modelled: groups"] == 1

    def lax(config: Config) -> Any:
        if config.retention_interval is not None and config.retention_interval < 0:
            config = replace(config, retention_interval=0)
        return ModelTarget(config)

    mode = Mode(hold=False, invariants=ALL_INVARIANTS, lockstep=lax, refusals=True)
    failure = check_config_rules(mode)
    assert isinstance(failure, RefusalDivergence) and failure.field == "retention_interval"
    assert "target accepted (nothing replayed)" in failure.message
