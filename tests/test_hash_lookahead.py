"""Lookahead block hashes (`hash_lookahead_tokens`), vLLM's default for an
EAGLE-family drafter: format and refusals, the keys, the model's hits against
the trailing-block drop, and the installed vLLM on the same traces."""

from __future__ import annotations

import contextlib
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import hybrid_config, needs_vllm, small_trace
from test_align_knobs import model_hits

from kvgate.conformance.replay import ReplayResult, replay
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import (
    TraceError,
    bundled_corpus,
    bundled_scheduler_corpus,
    load_corpus,
    parse_trace,
)
from kvgate.conformance.writer import config_dict
from kvgate.model import ModelTarget
from kvgate.model import scheduler as scheduler_model
from kvgate.model.mamba import checkpoint_position
from kvgate.model.scheduler import SchedulerModel
from kvgate.model.scope import validate
from kvgate.vocabulary.config import GroupConfig, UnsupportedConfig
from kvgate.vocabulary.tokens import prefix_keys

CORPUS = {t.name: t for t in load_corpus(bundled_corpus())}
LOOKAHEAD_TRACES = sorted(name for name in CORPUS if name.startswith("mtp-lookahead-"))


def trace_text(extra: str) -> str:
    return small_trace("lookahead", extra=extra)


def test_the_field_reads_and_writes_back_only_when_set() -> None:
    config = parse_trace(trace_text("  eagle: true\n  hash_lookahead_tokens: 1\n")).config
    assert config.hash_lookahead_tokens == 1 and config.eagle and not config.block_drop
    assert config_dict(config)["hash_lookahead_tokens"] == 1
    plain = parse_trace(trace_text("  eagle: true\n")).config
    assert plain.hash_lookahead_tokens == 0 and plain.block_drop
    assert "hash_lookahead_tokens" not in config_dict(plain)


@pytest.mark.parametrize(
    "extra",
    [
        "  hash_lookahead_tokens: 1\n",  # no eagle drafter
        "  eagle: false\n  hash_lookahead_tokens: 1\n",
        "  eagle: true\n  hash_lookahead_tokens: -1\n",
        "  eagle: true\n  hash_lookahead_tokens: yes\n",
    ],
)
def test_bad_values_are_one_line_errors_naming_the_field(extra: str) -> None:
    with pytest.raises(TraceError) as error:
        parse_trace(trace_text(extra), "lookahead.yaml")
    message = str(error.value)
    assert "hash_lookahead_tokens" in message and "\n" not in message
    assert "lookahead.yaml" in message


def test_a_multi_module_drafter_looks_ahead_as_far_as_it_hashes() -> None:
    """Lookahead hashes of K > 1 tokens are a multi-module MTP drafter's: its
    prefill lookahead is K, the manager re-prefills K - 1 tokens, and the
    shared-prefix checkpoint (which needs none re-prefilled) is off."""
    extra = "  eagle: true\n  hash_lookahead_tokens: {}\n  shared_prefix_checkpoint: true\n"
    for lookahead, prefill, reprefilled in ((0, 1, 0), (1, 1, 0), (2, 2, 1), (3, 3, 2)):
        text = trace_text(extra.format(lookahead))
        config = parse_trace(text).config
        assert (config.prefill_lookahead, config.reprefillable_tokens) == (prefill, reprefilled)
        assert config.shared_prefix_checkpoint_on == (reprefilled == 0 and config.partial_hits)
    assert replace(config, eagle=False, hash_lookahead_tokens=0).prefill_lookahead == 0


def test_a_key_covers_the_next_token_and_waits_for_it() -> None:
    tokens = list(range(100, 132))  # four units of 8
    other = tokens[:8] + [7] + tokens[9:]  # differs at the first token after unit 0
    assert prefix_keys(tokens, 8)[0] == prefix_keys(other, 8)[0]
    assert prefix_keys(tokens, 8, 1)[0] != prefix_keys(other, 8, 1)[0]
    # The last unit has no token after it yet: it has no key.
    assert len(prefix_keys(tokens, 8)) == 4 and len(prefix_keys(tokens, 8, 1)) == 3
    assert len(prefix_keys(tokens + [1], 8, 1)) == 4
    # The key still names the block's end.
    assert prefix_keys(tokens, 8, 1)[0].startswith("8:")


def test_the_checkpoint_leaves_the_lookahead_and_drops_nothing() -> None:
    assert checkpoint_position(700, 64, drop_eagle=True) == 576
    assert checkpoint_position(700, 64, drop_eagle=False, hash_lookahead=1) == 640
    # A prompt ending on a unit: its last unit's key needs a token it lacks.
    assert checkpoint_position(640, 64, drop_eagle=False, hash_lookahead=1) == 576


def test_the_corpus_has_lookahead_traces_in_both_hold_arms() -> None:
    assert {
        "mtp-lookahead-next-turn-after-burst.hold-on",
        "mtp-lookahead-next-turn-after-burst.hold-off",
        "mtp-lookahead-sibling-diverges-at-boundary",
    } <= set(LOOKAHEAD_TRACES)
    assert all(CORPUS[name].config.hash_lookahead_tokens == 1 for name in LOOKAHEAD_TRACES)


def test_lookahead_hashes_change_where_siblings_and_resends_resume() -> None:
    """B diverges right after the shared 640 tokens, C resends A's prompt: with
    lookahead hashes B's key at 640 sees its own next token (512: no state at
    576), C resumes at A's state (640); the drop gives 576 to both."""
    text = CORPUS["mtp-lookahead-sibling-diverges-at-boundary"].path.read_text()
    assert model_hits(text) == [0, 512, 640]
    drop = text.replace("hash_lookahead_tokens: 1", "hash_lookahead_tokens: 0")
    assert model_hits(drop) == [0, 576, 576]


def test_lookahead_follow_up_turn_resumes_a_unit_later_than_the_drop() -> None:
    text = CORPUS["mtp-lookahead-next-turn-after-burst.hold-on"].path.read_text()
    assert model_hits(text) == [0, 640, 1152]
    drop = text.replace("  hash_lookahead_tokens: 1\n", "")
    assert model_hits(drop) == [0, 576, 1088]


BASE = hybrid_config(
    GroupConfig("full_attention", 64),
    GroupConfig("mamba_align", 256, 3, 1, 64),
    num_blocks=64,
    eagle=True,
    hash_lookahead_tokens=1,
)


def test_the_model_refuses_lookahead_without_eagle() -> None:
    validate(BASE)
    with pytest.raises(UnsupportedConfig) as error:
        validate(replace(BASE, eagle=False))
    assert error.value.field == "hash_lookahead_tokens"


# On the installed vLLM the corpus traces run in test_corpus_gate (hold-off,
# strict, model in lockstep) and test_hold_overlay (hold-on, with the overlay).


@needs_vllm
def test_vllm_hashes_cover_the_lookahead_token() -> None:
    """vLLM built for the config hashes as the keys say: a request's block
    hashes stop one unit early and map onto the lookahead keys."""
    from kvgate.impl.vllm_target import VllmTarget

    target = VllmTarget(BASE)
    try:
        tokens = list(range(1000, 1128))  # two units
        request = target.new_request("R", tokens)
        assert len(request.block_hashes) == 1
        legacy = VllmTarget(replace(BASE, hash_lookahead_tokens=0))
        try:
            other = legacy.new_request("R", tokens)
            assert len(other.block_hashes) == 2
            assert request.block_hashes[0] != other.block_hashes[0]
        finally:
            legacy.close()
    finally:
        target.close()


def conforms_on_vllm(trace_name: str, fault: str = "") -> bool:
    """The bundled manager-level trace replays on the installed vLLM in strict
    lockstep with the model (with the named fault in effect, if any)."""
    from kvgate.impl.vllm_target import VllmTarget
    from kvgate.mutate.faults import BY_NAME
    from kvgate.mutate.inject import injected

    trace = CORPUS[trace_name]
    with contextlib.ExitStack() as stack:
        if fault:
            stack.enter_context(injected(BY_NAME[fault]))
        target = stack.enter_context(closing(VllmTarget(trace.config)))
        return replay(trace, target, ModelTarget, "strict").passed


@needs_vllm
def test_the_lookahead_fault_is_caught_by_the_sibling_trace() -> None:
    """With the hasher's off-by-one in effect, the sibling that diverges right
    at a block boundary no longer replays: its hash there is its sibling's."""
    assert conforms_on_vllm("mtp-lookahead-sibling-diverges-at-boundary")
    assert not conforms_on_vllm(
        "mtp-lookahead-sibling-diverges-at-boundary", "lookahead-hash-misses-next-token"
    )
    assert conforms_on_vllm("mtp-lookahead-sibling-diverges-at-boundary")


def test_attention_cached_stops_where_the_keys_do() -> None:
    """B resends A's 32-token prompt: its last unit has no key yet (it needs
    token 32), so the model's attention_cached reports the 24 tokens it can
    name (it indexed past the keys before)."""
    text = trace_text("  eagle: true\n  hash_lookahead_tokens: 1\n").replace(
        "{fresh: 70}", "{fresh: 32}"
    ) + (
        "  - {op: prefill, req: A}\n"
        "  - {op: decode, req: A, steps: 2}\n"
        "  - {op: arrive, req: B, prompt: [{prompt_of: A}]}\n"
        "  - {op: check, attention_cached: {B: 24}}\n"
    )
    trace = parse_trace(text)
    assert replay(trace, ModelTarget(trace.config), None, "strict").passed


@needs_vllm
@pytest.mark.parametrize("lookahead", [1, 0])
def test_the_real_scheduler_keeps_lockstep_with_lookahead_hashes(
    tmp_path: Path, lookahead: int
) -> None:
    """vLLM's own `Scheduler`, built with (or without) lookahead hashes as the
    config says (its derived num_hash_lookahead_tokens cross-checked), runs a
    small multi-turn workload in strict lockstep with the model."""
    from kvgate import targets
    from kvgate.workload.deployment import Deployment
    from kvgate.workload.lockstep import run_on_scheduler
    from kvgate.workload.plan import Workload, make_plan

    scale = 32
    deployment = Deployment(build="upstream").scaled(scale)
    workload = Workload(sessions=2, turns=2)
    config = replace(
        deployment.config(64 // scale, False, workload.sessions),
        hash_lookahead_tokens=lookahead,
    )
    assert config.eagle
    factory: Any = targets.target_factory("vllm-scheduler")
    real = factory(config, spec_tokens=deployment.spec_tokens, max_num_seqs=deployment.max_num_seqs)
    assert int(real.scheduler.num_hash_lookahead_tokens) == lookahead
    result = run_on_scheduler(
        config,
        make_plan(workload, scale),
        deployment.serving(workload.system_prompt),
        real=real,
        name="lookahead",
        out=tmp_path,
        about="test",
        level="strict",
    )
    assert result.replay.passed, result.replay.divergence


@needs_vllm
@pytest.mark.parametrize("trace_name", ["mtp2-prompt-tail-stop", "mtp3-prompt-tail-stop"])
def test_the_tail_stop_that_ignores_the_lookahead_is_caught(trace_name: str) -> None:
    """The split's prompt-tail stop differs from one that ignores the
    lookahead only when it is wider than one token: the multi-module traces
    replay on stock vLLM and diverge with the fault in effect."""
    assert conforms_on_vllm(trace_name)
    assert not conforms_on_vllm(trace_name, "sched-split-tail-ignores-lookahead")


@needs_vllm
def test_a_single_group_keys_only_what_the_drafter_cannot_prefill_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's unitary coordinator keys a pure Mamba request's computed tokens
    less the K - 1 a multi-module drafter may prefill again; a model keying
    them all diverges at the first chunk's blocks."""
    from kvgate.impl.vllm_target import VllmTarget
    from kvgate.vocabulary.config import Config

    trace = CORPUS["mtp2-single-group-keys-finalized"]

    def divergence() -> str:
        with closing(VllmTarget(trace.config)) as target:
            result = replay(trace, target, ModelTarget, "strict")
        return "" if result.passed else str(result.divergence and result.divergence.what)

    assert divergence() == ""
    monkeypatch.setattr(Config, "reprefillable_tokens", property(lambda self: 0))
    assert "hashes" in divergence()


@needs_vllm
@pytest.mark.parametrize("lookahead", [1, 2])
def test_vllm_turns_the_shared_prefix_checkpoint_off_for_a_multi_module_drafter(
    lookahead: int,
) -> None:
    from kvgate.impl.vllm_target import VllmTarget

    config = replace(BASE, hash_lookahead_tokens=lookahead, shared_prefix_checkpoint=True)
    with closing(VllmTarget(config)) as target:
        on = bool(target.manager.mamba_shared_prefix_checkpoint)
    assert on == config.shared_prefix_checkpoint_on == (lookahead == 1)


# -- a multi-module drafter on the Scheduler ----------------------------------

SCHEDULER_CORPUS = {t.name: t for t in load_corpus(bundled_scheduler_corpus())}


def run_scheduler(trace_name: str, real: bool) -> ReplayResult:
    """A scheduler-level trace on vLLM's real `Scheduler` in lockstep with the
    scheduler model (`real`), or on the model alone."""
    trace = SCHEDULER_CORPUS[trace_name]
    assert trace.scheduler is not None
    if not real:
        return replay_scheduler(trace, SchedulerModel, None, "strict")
    from kvgate.impl.vllm_scheduler import VllmScheduler

    scheduler = VllmScheduler(
        trace.config, spec_tokens=trace.scheduler.spec, max_num_seqs=trace.scheduler.max_num_seqs
    )
    try:
        return replay_scheduler(trace, SchedulerModel, scheduler, "strict")
    finally:
        scheduler.close()


def test_a_multi_module_drafter_drafts_as_many_tokens_as_it_hashes() -> None:
    config = SCHEDULER_CORPUS["sched-mtp2-prompt-tail-stop"].config
    SchedulerModel(config, spec=2, max_num_seqs=4)
    with pytest.raises(UnsupportedConfig) as refused:
        SchedulerModel(config, spec=3, max_num_seqs=4)
    assert refused.value.field == "hash_lookahead_tokens"


def test_a_scheduler_model_without_the_prefill_reservation_misses_the_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chunk ending two tokens before the prompt's end is cut back for a
    drafter reading three ahead; a model that does not cut it misses it."""
    assert run_scheduler("sched-mtp3-prefill-lookahead-cuts-chunk", real=False).passed
    monkeypatch.setattr(scheduler_model, "reserve_prefill_lookahead", lambda c, t, s, n: n)
    result = run_scheduler("sched-mtp3-prefill-lookahead-cuts-chunk", real=False)
    assert result.divergence is not None and result.divergence.what == "scheduled"


@needs_vllm
@pytest.mark.parametrize(
    "trace_name", ["sched-mtp2-prompt-tail-stop", "sched-mtp3-prompt-tail-stop"]
)
def test_the_real_schedulers_tail_stop_that_ignores_the_lookahead_diverges(
    trace_name: str,
) -> None:
    from kvgate.mutate.faults import BY_NAME
    from kvgate.mutate.inject import injected

    assert run_scheduler(trace_name, real=True).passed
    with injected(BY_NAME["sched-split-tail-ignores-lookahead"]):
        result = run_scheduler(trace_name, real=True)
    assert result.divergence is not None and result.divergence.what == "scheduled"


@needs_vllm
def test_the_real_scheduler_is_built_with_the_drafters_prefill_lookahead() -> None:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    trace = SCHEDULER_CORPUS["sched-mtp3-prefill-lookahead-cuts-chunk"]
    real = VllmScheduler(trace.config, spec_tokens=3, max_num_seqs=4)
    try:
        assert int(real.scheduler.num_prefill_lookahead) == 3
        assert int(real.scheduler.num_hash_lookahead_tokens) == 3
    finally:
        real.close()
    with pytest.raises(UnsupportedConfig) as refused:
        VllmScheduler(trace.config, spec_tokens=2, max_num_seqs=4)
    assert refused.value.field == "hash_lookahead_tokens"


@needs_vllm
def test_a_release_without_lookahead_hashes_refuses_them_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release whose SpeculativeConfig has no lookahead-hash switch (vLLM
    0.32.0) cannot run lookahead hashes: refused by the field, not a crash."""
    import vllm.config

    from kvgate.impl.vllm_scheduler import VllmScheduler

    without_switch = type("SpeculativeConfig", (), {"__dataclass_fields__": {}})
    monkeypatch.setattr(vllm.config, "SpeculativeConfig", without_switch)
    trace = SCHEDULER_CORPUS["sched-mtp2-prompt-tail-stop"]
    with pytest.raises(UnsupportedConfig) as refused:
        VllmScheduler(trace.config, spec_tokens=2, max_num_seqs=4)
    assert refused.value.field == "hash_lookahead_tokens"
    assert "no lookahead block hashes" in refused.value.message
