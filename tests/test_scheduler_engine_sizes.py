"""The real-Scheduler target builds every size as vLLM's engine resolves it.

With prefix caching on, the hash unit and the Mamba block are the user's
choice in vLLM (`--prefix-match-unit`, `--mamba-block-size`): the target
passes them as those flags would and reads back what the engine resolves
(`resolve_kv_cache_block_sizes`, the engine config's Mamba block and
retention). A config whose sizes the engine resolves otherwise, or refuses,
is refused by name, in one line.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm

from kvgate import targets
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.workload.deployment import Deployment

pytestmark = needs_vllm

SCALE = 64
UNIT = 4


def _config() -> Config:
    # Attention and Mamba blocks of 64, as a worker serves them in align
    # mode, on a hash unit of 4.
    return Deployment(build="upstream").scaled(SCALE).config(UNIT, False, 2)


def _build(config: Config) -> Any:
    factory: Any = targets.target_factory("vllm-scheduler")
    return factory(config, spec_tokens=3, max_num_seqs=16)


def test_sizes_are_passed_as_the_engine_flags_and_read_back() -> None:
    config = _config()
    real = _build(config)
    try:
        scheduler = real.scheduler
        cache = scheduler.cache_config
        assert (cache.prefix_match_unit, cache.mamba_block_size) == (UNIT, 64)
        assert cache.prefix_cache_retention_interval == config.retention_interval
        assert (scheduler.hash_block_size, scheduler.block_size) == (UNIT, 64)
    finally:
        real.close()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        # Not the groups' lcm: the engine's Scheduler block is 64.
        ({"scheduler_block_size": 128}, "scheduler_block_size"),
        # A hash unit the blocks (64) do not divide by: the engine refuses
        # the --prefix-match-unit.
        ({"hash_unit": 48}, "hash_unit"),
        # Not a multiple of the Scheduler block: the engine refuses it.
        ({"retention_interval": 32}, "retention_interval"),
    ],
)
def test_sizes_the_engine_resolves_otherwise_are_refused_by_name(
    change: dict[str, Any], field: str
) -> None:
    with pytest.raises(UnsupportedConfig) as error:
        _build(replace(_config(), **change))
    assert error.value.field == field
    assert "\n" not in str(error.value)


def test_two_mamba_blocks_are_refused_by_name() -> None:
    """vLLM's engine has one Mamba block size for every Mamba layer."""
    config = _config()
    attention, mamba = config.groups
    config = replace(
        config, groups=(attention, mamba, replace(mamba, block_size=32)), scheduler_block_size=64
    )
    with pytest.raises(UnsupportedConfig) as error:
        _build(config)
    assert error.value.field == "groups"


# Corpus traces whose sizes vLLM's engine would not resolve, on purpose:
# manager-level unit traces the manager-level target runs as given (the
# sizes are the manager's inputs there). Prefix caching off at a Mamba block
# below max_model_len (the engine takes `--mamba-block-size` only with
# prefix caching): mode none's frees show only below it.
MODE_NONE_FINER_BLOCK = {"prefix-caching-off.yaml", "residency-metrics-caching-off.yaml"}
# Two Mamba block sizes: the engine has one for every Mamba layer.
TWO_MAMBA_BLOCKS = {"two-mamba-specs.yaml"}


def _engine_resolves_otherwise(config: Config) -> str:
    """What vLLM's engine would resolve differently for `config` with the
    flags a user may pass (`--prefix-match-unit` as the hash unit with
    prefix caching, `--mamba-block-size` likewise), "" if nothing."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    from kvgate.impl import _vllm_api
    from kvgate.impl.vllm_build import kv_cache_config

    cache = SimpleNamespace(
        block_size=config.scheduler_block_size,
        enable_prefix_caching=config.prefix_caching,
        prefix_match_unit=config.hash_unit if config.prefix_caching else None,
    )
    engine = SimpleNamespace(
        cache_config=cache,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        kv_transfer_config=object() if config.kv_connector else None,
    )
    try:
        scheduler_block, hash_block = resolve_kv_cache_block_sizes(
            kv_cache_config(_vllm_api.load(), config), engine
        )
    except ValueError:
        return "refused"
    mamba = {config.groups[i].block_size for i in config.mamba_group_ids}
    if scheduler_block != config.scheduler_block_size:
        return "scheduler_block_size"
    if config.prefix_caching and hash_block != config.hash_unit:
        return "hash_unit"
    if len(mamba) > 1:
        return "two mamba blocks"
    if not config.prefix_caching and mamba and mamba != {config.max_model_len}:
        return "mode none block"
    return ""


def test_the_corpus_uses_engine_sizes_but_where_documented() -> None:
    from kvgate.conformance.trace import load_trace

    corpus = Path(__file__).parents[1] / "kvgate" / "conformance" / "corpus"
    differs = {}
    for path in sorted(corpus.glob("*.yaml")):
        trace = load_trace(path)
        what = _engine_resolves_otherwise(trace.config)
        if what:
            differs[path.name] = what
    # Refusal traces are refused by the manager (or the model) anyway.
    unlike = {name for name in differs if not name.startswith("refuse-")}
    assert unlike == MODE_NONE_FINER_BLOCK | TWO_MAMBA_BLOCKS, differs
    assert {differs[n] for n in MODE_NONE_FINER_BLOCK} == {"mode none block"}
    assert differs["two-mamba-specs.yaml"] == "two mamba blocks"
