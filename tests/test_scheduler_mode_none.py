"""vLLM's real `Scheduler` without prefix caching: Mamba cache mode `none`.

`--no-enable-prefix-caching` on a hybrid: vLLM's engine config resolves the
Mamba cache mode to `none` and its block to max_model_len; the real-Scheduler
target builds the Scheduler that way (the mode read back from vLLM's own
resolution) and the workload runs beside kvgate's scheduler model in strict
lockstep, for the three deployment families. At a Mamba block finer than
max_model_len (the Scheduler accepts it, the engine would not pick it) the
modes differ at the scheduler level: no align split, drafts counted into
each request's blocks, states below the running one freed newest first. A
scheduler model that kept align mode's books there diverges.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import EXAMPLE_CONFIG, needs_vllm

from kvgate import cli, targets
from kvgate.conformance.trace import load_trace
from kvgate.vocabulary.config import Config, GroupConfig, UnsupportedConfig
from kvgate.workload.deployment import Deployment, Serving
from kvgate.workload.lockstep import SchedulerArm, run_on_scheduler
from kvgate.workload.plan import Session, Turn, Workload, make_plan

pytestmark = needs_vllm

SCALE = 32
UNIT = 64 // SCALE
WORKLOAD = Workload(sessions=4, turns=3)

# The families' Mamba groups (the Scheduler's model stays a GDN hybrid: the
# family is its KV-cache spec) and whether they serve with MTP drafts.
FAMILIES: dict[str, tuple[dict[str, Any], bool]] = {
    "gdn-triton": ({}, True),
    "gdn-flashinfer": ({"prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 64}, True),
    # Nemotron-H-style: no drafter.
    "mamba2": ({"prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}, False),
}


def _scheduler() -> Any:
    return targets.target_factory("vllm-scheduler")


def _deployment(drafts: bool = True) -> Deployment:
    return Deployment(
        build="upstream", prefix_caching=False, spec_tokens=3 if drafts else 0, eagle=drafts
    ).scaled(SCALE)


def _with_mamba(config: Config, **fields: Any) -> Config:
    attention, mamba = config.groups
    mamba = replace(mamba, **fields)
    return replace(config, groups=(attention, mamba), scheduler_block_size=mamba.block_size)


def _lockstep(
    config: Config,
    deployment: Deployment,
    tmp_path: Path,
    *,
    books: Config | None = None,
    level: Any = "strict",
    engine_sizes: bool = True,
) -> SchedulerArm:
    """The workload on the real Scheduler built for `config`, beside the
    scheduler model keeping `books` (default: `config`)."""
    real = _scheduler()(
        config, spec_tokens=deployment.spec_tokens, max_num_seqs=16, engine_sizes=engine_sizes
    )
    return run_on_scheduler(
        books or config,
        make_plan(WORKLOAD, SCALE),
        deployment.serving(WORKLOAD.system_prompt),
        real=real,
        name="mode-none",
        out=tmp_path,
        about="test",
        level=level,
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_keeps_lockstep_without_prefix_caching(family: str, tmp_path: Path) -> None:
    fields, drafts = FAMILIES[family]
    deployment = _deployment(drafts)
    config = _with_mamba(deployment.config(UNIT, False, WORKLOAD.sessions), **fields)
    assert (config.prefix_caching, config.mamba_cache_mode) == (False, "none")
    # The engine's Mamba block without caching.
    assert config.groups[1].block_size == config.max_model_len == config.scheduler_block_size
    result = _lockstep(config, deployment, tmp_path)
    assert result.replay.passed, result.replay.divergence
    assert result.replay.level == "strict"
    assert len(result.counts.follow_ups) == WORKLOAD.sessions * (WORKLOAD.turns - 1)
    # Nothing is cached, so no follow-up is admitted with a hit.
    assert all(f.hit == 0 for f in result.counts.follow_ups)


FINE_BLOCK = 4096 // SCALE


def test_a_finer_block_frees_states_and_align_books_diverge(tmp_path: Path) -> None:
    deployment = _deployment()
    config = _with_mamba(deployment.config(UNIT, False, WORKLOAD.sessions), block_size=FINE_BLOCK)
    # A block the engine would not resolve: refused by default, run on request.
    with pytest.raises(UnsupportedConfig, match="Mamba block"):
        _lockstep(config, deployment, tmp_path / "refused")
    passed = _lockstep(config, deployment, tmp_path / "none", engine_sizes=False)
    assert passed.replay.passed, passed.replay.divergence
    # The same Scheduler beside a model keeping align mode's books (its
    # split, its counts) diverges at api level at the first step: the blocks
    # align mode books show in the pool's usage before the real Scheduler
    # runs a chunk whole where align mode stops it at a Mamba block boundary.
    align = replace(config, mamba_cache_mode="align")
    drifted = _lockstep(
        config, deployment, tmp_path / "align", books=align, level="api", engine_sizes=False
    )
    divergence = drifted.replay.divergence
    assert divergence is not None
    assert divergence.what == "engine step 1: KV-cache usage", divergence.what


def test_preemption_and_resumption_keep_lockstep_in_mode_none(tmp_path: Path) -> None:
    """A pool that fits two of three turns: a running turn is preempted and
    prefilled again, its Mamba states (32-token blocks) freed below the
    running one as it goes."""
    config = replace(
        EXAMPLE_CONFIG,
        num_blocks=40,
        groups=(
            GroupConfig("full_attention", 8),
            GroupConfig("mamba_align", 32, speculative_blocks=2),
        ),
        hold=False,
        max_model_len=512,
        max_num_scheduled_tokens=48,
        prefix_caching=False,
        mamba_cache_mode="none",
    )
    sessions = tuple(
        Session(i, (Turn(fresh=70 + 13 * i, output=60, delay=i), Turn(20, 30, 3))) for i in range(3)
    )
    # 32-token states below max_model_len: not the engine's block, run as given.
    real = _scheduler()(config, spec_tokens=2, max_num_seqs=16, engine_sizes=False)
    result = run_on_scheduler(
        config,
        sessions,
        Serving(0, 2, 16),
        real=real,
        name="preempted",
        out=tmp_path,
        about="test",
        level="strict",
    )
    assert result.replay.passed, result.replay.divergence
    ops = Counter(s.how for s in load_trace(result.path).steps if s.op == "free")
    assert ops["preempt"] >= 1 and ops["finish"] == 6


def test_the_workload_command_runs_without_prefix_caching(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = [
        "workload", "--target", "vllm-scheduler", "--no-enable-prefix-caching",
        "--scale", str(SCALE), "--sessions", "2", "--turns", "2", "--units", "4096",
        "--hold", "on,off", "--build", "fork", "--level", "strict", "--out", str(tmp_path),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "cache mode none" in out
    assert "not run: vllm 0.33.0 Scheduler holds nothing without prefix caching" in out
    configs = [load_trace(p).config for p in tmp_path.glob("*.yaml")]
    assert sorted(c.hold for c in configs) == [False, True]
    # The fork's retention holds nothing without caching either: not asked.
    for config in configs:
        assert (config.prefix_caching, config.mamba_cache_mode, config.retain_retired) == (
            False,
            "none",
            False,
        )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        # Align books without caching: the engine runs mode none instead.
        ({"mamba_cache_mode": "align"}, "mamba_cache_mode"),
        # A scheduler block the engine would not resolve (not the groups' lcm).
        ({"scheduler_block_size": 8192, "max_model_len": 8192}, "scheduler_block_size"),
    ],
)
def test_what_the_engine_would_not_build_is_refused_by_name(
    change: dict[str, Any], field: str
) -> None:
    config = replace(_deployment().config(UNIT, False, 2), **change)
    with pytest.raises(UnsupportedConfig) as error:
        _scheduler()(config, spec_tokens=3, max_num_seqs=16)
    assert error.value.field == field
    assert "\n" not in str(error.value)


def test_the_real_scheduler_reads_back_mode_none() -> None:
    real = _scheduler()(_deployment().config(UNIT, False, 2), spec_tokens=3, max_num_seqs=16)
    try:
        scheduler = real.scheduler
        assert scheduler.cache_config.mamba_cache_mode == "none"
        assert not scheduler.need_mamba_block_aligned_split
        modes = [
            getattr(m, "mamba_cache_mode", None)
            for m in scheduler.kv_cache_manager.coordinator.single_type_managers
        ]
        assert modes[1:] == ["none"]
    finally:
        real.close()
