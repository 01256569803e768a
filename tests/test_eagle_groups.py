"""Which KV cache groups are the EAGLE/MTP drafter's, as production plans them.

vLLM's engine planning flags the groups holding a draft layer
(`is_eagle_group`); the coordinator falls back to flagging every group only
when none is flagged. kvgate derives the flags from the config
(`Config.eagle_group_ids`) and both vLLM targets build them; these tests pin
that derivation on vLLM's own planning and show the gate tells it apart from
the fallback.
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from configs import needs_vllm

from kvgate.conformance.replay import replay
from kvgate.conformance.trace import Trace, bundled_corpus, load_corpus
from kvgate.model import ModelTarget

CORPUS = {t.name: t for t in load_corpus(bundled_corpus())}
FAMILIES = ("gdn-triton", "gdn-flashinfer", "mamba2")


def _planning_config() -> Any:
    """The parts of a `VllmConfig` vLLM's group planning reads: an EAGLE-family
    drafter with the trailing-block drop, the default builder, uniform pages."""
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="mtp", use_eagle_block_drop=lambda: True),
        num_prefill_lookahead_tokens=1,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        model_config=SimpleNamespace(supports_kv_cache_grouping=False, max_model_len=4096),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: SimpleNamespace(is_block_outermost=True)
        ),
    )


def _hybrid_with_drafter(checkpoint_blocks: int, alignment: int | None) -> dict[str, Any]:
    """Layer specs of a hybrid (6 Mamba layers, every fourth layer attention,
    all with one page size) plus one drafter attention layer shaped like the
    target's, as an MTP head or an EAGLE layer is."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    block = 64

    def attention(draft: bool) -> Any:
        return FullAttentionSpec(
            block_size=block, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, is_draft=draft
        )

    page = attention(False).page_size_bytes
    mamba = MambaSpec(
        block_size=block,
        shapes=((16,),),
        dtypes=(torch.bfloat16,),
        page_size_padded=page,
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=checkpoint_blocks,
        prefill_checkpoint_alignment=alignment,
    )
    specs: dict[str, Any] = {
        f"model.layers.{i}": attention(False) if i % 4 == 3 else mamba for i in range(8)
    }
    specs["model.mtp.layers.0"] = attention(True)
    return specs


@needs_vllm
@pytest.mark.parametrize(
    ("family", "checkpoint_blocks", "alignment"),
    [("gdn-triton", 0, None), ("gdn-flashinfer", 1, 64), ("mamba2", 1, 1)],
)
def test_vllm_planning_flags_the_drafters_attention_group_only(
    family: str, checkpoint_blocks: int, alignment: int | None
) -> None:
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    specs = _hybrid_with_drafter(checkpoint_blocks, alignment)
    groups = get_global_kv_cache_groups(_planning_config(), [specs])
    is_attention = {id(g): isinstance(g.kv_cache_spec, FullAttentionSpec) for g in groups}
    flagged = {is_attention[id(g)] for g in groups if g.is_eagle_group}
    unflagged = {is_attention[id(g)] for g in groups if not g.is_eagle_group}
    # The drafter's layer joined the target's attention group (equal specs:
    # `is_draft` is not compared), which alone is flagged.
    assert flagged == {True} and unflagged == {False}
    # kvgate derives the same: the attention group, never a Mamba group.
    config = CORPUS[f"{family}-eagle-drafter-groups.hold-off"].config
    assert config.eagle_group_ids == tuple(
        i for i, g in enumerate(config.groups) if g.kind == "full_attention"
    )
    # Lookahead hashes keep the flags (the shared-prefix checkpoint reads
    # them) and turn the drop off.
    lookahead = replace(config, hash_lookahead_tokens=1)
    assert lookahead.eagle_group_ids == config.eagle_group_ids and not lookahead.drop_group_ids


def _conforms(trace: Trace) -> bool:
    from kvgate.impl.vllm_target import VllmTarget

    with closing(VllmTarget(trace.config)) as target:
        return replay(trace, target, ModelTarget, "strict").passed


def _build_without_drafter_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's targets build their groups with no `is_eagle_group` (kvgate's
    build before stop 23): vLLM then flags every group, Mamba included."""
    from kvgate.impl import vllm_build

    production = vllm_build.kv_cache_config

    def unflagged(api: Any, config: Any) -> Any:
        built = production(api, config)
        for group in built.kv_cache_groups:
            group.is_eagle_group = False
        return built

    monkeypatch.setattr(vllm_build, "kv_cache_config", unflagged)


@needs_vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_the_drafter_group_traces_tell_production_from_the_fallback(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built as production flags the groups, vLLM conforms; built unflagged
    (vLLM then flags every group) or with the coordinator ignoring the flags,
    the sibling diverging right after the junction hits a block lower and the
    trace fails."""
    from kvgate.mutate.faults import BY_NAME
    from kvgate.mutate.inject import injected

    trace = CORPUS[f"{family}-eagle-drafter-groups.hold-off"]
    assert _conforms(trace)
    with injected(BY_NAME["eagle-drop-on-every-group"]):
        assert not _conforms(trace)

    _build_without_drafter_flags(monkeypatch)
    assert not _conforms(trace)


@needs_vllm
def test_lookahead_hashes_keep_the_flags_and_the_shared_prefix_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lookahead hashes turn the drop off, not the flags: vLLM keeps the
    shared-prefix checkpoint on, S3 resumes at the junction. Built without
    the flags, vLLM turns the knob off and the trace fails."""

    trace = CORPUS["gdn-triton-shared-prefix-checkpoint-lookahead.hold-off"]
    assert trace.config.hash_lookahead_tokens and trace.config.shared_prefix_checkpoint_on
    assert _conforms(trace)
    _build_without_drafter_flags(monkeypatch)
    assert not _conforms(trace)
