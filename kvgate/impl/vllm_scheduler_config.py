"""vLLM's config for a `Scheduler` built on CPU without weights, as vLLM's
engine resolves it from the user's flags: a tiny local hybrid model config
(a Qwen3-Next-class `config.json` written offline, no weights), the
`VllmConfig` with MTP drafts, LoRA and a KV connector where the trace asks
for them, the sizes the engine derives (blocks, hash unit, token budget,
sequence cap), the Scheduler class async scheduling picks, and the check
that what vLLM derived is what the trace says. `vllm_scheduler.py` drives
the Scheduler built from it."""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvgate.impl.vllm_build import scheduler_config
from kvgate.impl.vllm_errors import describe
from kvgate.impl.vllm_probe import model_runner as probed_runner
from kvgate.vocabulary.config import (
    Config,
    KvLoadFailurePolicy,
    ModelRunner,
    UnsupportedConfig,
)
from kvgate.vocabulary.scheduling import (
    ASYNC_BATCHES,
)


@functools.cache
def model_dir(mtp_layers: int = 1) -> Path:
    """A directory holding a tiny Qwen3-Next-class hybrid `config.json` with
    `mtp_layers` MTP modules.

    Named after the user and the file's content, and shared by every process
    that needs the same file: written once, never removed. (A folder per
    process, removed at exit, outlived every process that was killed or left
    through `os._exit`, as pytest-xdist's workers do.)"""
    config = hybrid_config(mtp_layers)
    digest = hashlib.sha256(config.to_json_string().encode()).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"kvgate-hybrid-model-{os.getuid()}-{digest}"
    if not _written_by_us(folder):
        staging = Path(tempfile.mkdtemp(prefix=f"{folder.name}.", dir=folder.parent))
        config.save_pretrained(staging)
        try:
            staging.rename(folder)
        except OSError:  # another process was first, or someone else's folder is there
            shutil.rmtree(staging, True)
    if _written_by_us(folder):
        return folder
    # Someone else's folder holds the name: this process's own, removed at exit.
    own = Path(tempfile.mkdtemp(prefix="kvgate-hybrid-model-"))
    atexit.register(shutil.rmtree, own, True)
    config.save_pretrained(own)
    return own


def _written_by_us(folder: Path) -> bool:
    """`folder` holds a config.json and only this user can have written it."""
    try:
        info = folder.lstat()
    except OSError:
        return False
    private = stat.S_ISDIR(info.st_mode) and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    return private and info.st_uid == os.getuid() and (folder / "config.json").is_file()


def hybrid_config(mtp_layers: int) -> Any:
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        # Long enough for any trace's max_model_len.
        max_position_embeddings=1 << 22,
        architectures=["Qwen3NextForCausalLM"],
    )
    # One MTP layer, as Qwen3-Next ships; more for a multi-module drafter
    # (vLLM's `use_multi_module_mtp` reads the count).
    config.num_nextn_predict_layers = mtp_layers
    return config


@dataclass(frozen=True)
class ConnectorSettings:
    """A KV connector for the Scheduler: kvgate's scripted one
    (`vllm_connector`), in this role, with this load-failure policy."""

    role: Literal["kv_both", "kv_consumer", "kv_producer"] = "kv_both"
    # vLLM's kv_load_failure_policy: "recompute" reloads or recomputes what a
    # failed load lost; "fail" ends the request with an error.
    load_failure_policy: KvLoadFailurePolicy = "recompute"
    # vLLM's `supports_divergent_local_hybrid_hits` (trace config
    # `kv_connector_divergent_hits`).
    divergent_hits: bool = False


def kv_transfer_config(settings: ConnectorSettings) -> Any:
    from vllm.config import KVTransferConfig

    from kvgate.impl import vllm_connector

    return KVTransferConfig(
        kv_connector=vllm_connector.CLASS_NAME,
        kv_connector_module_path=vllm_connector.MODULE,
        kv_role=settings.role,
        kv_load_failure_policy=settings.load_failure_policy,
        kv_connector_extra_config={vllm_connector.DIVERGENT_HITS: settings.divergent_hits},
    )


def vllm_config(
    config: Config, spec_tokens: int, max_num_seqs: int, connector: ConnectorSettings | None
) -> Any:
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        ModelConfig,
        ObservabilityConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    # A multi-module MTP drafter (lookahead hashes of K > 1 tokens) has a
    # module per draft token: vLLM then reads K prefill tokens ahead.
    mtp_layers = config.prefill_lookahead if config.prefill_lookahead > 1 else 1
    model = ModelConfig(
        model=str(model_dir(mtp_layers)),
        skip_tokenizer_init=True,
        max_model_len=config.max_model_len,
        dtype="float32",
    )
    # Async scheduling exactly as the trace says (vLLM's engine turns it on
    # by default where it can).
    scheduler = scheduler_config(config, max_num_seqs, async_scheduling=config.async_scheduling)
    # No Mamba cache mode is passed (vLLM deprecates the flag): the engine
    # config resolves it from prefix caching, which `check_mode` reads back.
    # The sizes a user may choose are passed as their engine flags would pass
    # them (with prefix caching: `--mamba-block-size`, `--prefix-match-unit`;
    # `--prefix-cache-retention-interval`), so vLLM's engine resolves every
    # size from them and `engine_sizes` reads its resolution back.
    cache = CacheConfig(
        block_size=config.scheduler_block_size,
        enable_prefix_caching=config.prefix_caching,
        enable_mamba_shared_prefix_checkpoint=config.shared_prefix_checkpoint,
        prefix_cache_retention_interval=config.retention_interval,
        **size_flags(config),
    )
    speculative = None
    if spec_tokens:
        # Legacy hashes (and, with eagle, the trailing-block drop) unless
        # the trace asks for lookahead hashes, which vLLM then derives. A
        # release without lookahead hashes has no switch for them: it keeps
        # legacy hashes (asked for lookahead ones, it is refused below).
        hashes: dict[str, bool] = {}
        has_switch = "disable_lookahead_block_hashes" in getattr(
            SpeculativeConfig, "__dataclass_fields__", {}
        )
        if config.hash_lookahead_tokens and not has_switch:
            raise UnsupportedConfig(
                "hash_lookahead_tokens",
                "this vLLM's SpeculativeConfig has no lookahead block hashes",
            )
        if has_switch:
            hashes["disable_lookahead_block_hashes"] = not config.hash_lookahead_tokens
        speculative = SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=spec_tokens,
            **hashes,
            disable_eagle_block_drop=not config.eagle,
            target_model_config=model,
            target_parallel_config=ParallelConfig(),
        )
    # vLLM checks, while it builds the engine config, that Triton can run
    # the model runner's kernels (on x86 CPUs 0.34.0 refuses the config
    # without it, 0.32.0 the v2 runner): the Scheduler under test is the one
    # a GPU engine builds, where Triton is present.
    with _triton_as_on_a_gpu():
        vllm_config = VllmConfig(
            model_config=model,
            lora_config=lora_config(config),
            cache_config=cache,
            scheduler_config=scheduler,
            speculative_config=speculative,
            kv_transfer_config=None if connector is None else kv_transfer_config(connector),
            # KV-cache events published as an engine with `--kv-events-config`
            # publishes them, through the publisher that sends nothing anywhere:
            # `VllmScheduler` captures each batch handed to it.
            kv_events_config=(
                KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                if config.kv_events
                else None
            ),
            # The residency metrics: the Scheduler builds their collector itself.
            observability_config=ObservabilityConfig(
                kv_cache_metrics=config.kv_cache_metrics,
                kv_cache_metrics_sample=config.kv_cache_metrics_sample,
            ),
        )
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    if config.async_scheduling:
        # vLLM's CPU platform turns async scheduling off (it gains nothing
        # there); the Scheduler under test is the one a GPU engine builds
        # with it on, so the setting is put back after the platform's say.
        vllm_config.scheduler_config.async_scheduling = True
    return vllm_config


def lora_config(config: Config) -> Any:
    """vLLM's LoRA config for `config.max_loras` (None for 0: no LoRA). Only
    its adapter limit matters to the Scheduler; the adapters themselves are
    never loaded (no weights run)."""
    if not config.max_loras:
        return None
    from vllm.config import LoRAConfig

    try:
        return LoRAConfig(max_loras=config.max_loras)
    except Exception as error:  # pydantic's validation: vLLM's refusal, in one line
        raise UnsupportedConfig(
            "max_loras", f"vLLM refuses its LoRA config: {describe(error)}"
        ) from error


def scheduler_class(vllm_config: Any, config: Config) -> Any:
    """The Scheduler class vLLM's engine builds for `vllm_config` (the async
    one under async scheduling), after checking the engine would keep the
    batches in flight the config says."""
    from vllm.v1.core.sched.scheduler import Scheduler

    chosen = getattr(vllm_config.scheduler_config, "get_scheduler_cls", None)
    in_flight = int(getattr(vllm_config, "max_concurrent_batches", 1))
    wanted = ASYNC_BATCHES if config.async_scheduling else 1
    if in_flight != wanted:
        raise UnsupportedConfig(
            "async_scheduling",
            f"vLLM's engine keeps {in_flight} batches in flight for it, not {wanted}",
        )
    return Scheduler if chosen is None else chosen()


@contextlib.contextmanager
def _triton_as_on_a_gpu() -> Iterator[None]:
    """vLLM's record that Triton can run (`HAS_TRITON`, in
    `vllm.triton_utils` and in the copy the engine config's module took)
    set while the engine config is built, as on a GPU host, and put back
    after. vLLM reads it then only to choose and check the model runner,
    whose kernels need Triton; the Scheduler's bookkeeping is CPU code and
    runs no kernel. A module without the record is left as it is."""
    import importlib

    saved: list[tuple[Any, bool]] = []
    for name in ("vllm.triton_utils", "vllm.config.vllm"):
        try:
            module: Any = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "HAS_TRITON", None) is False:
            saved.append((module, False))
            module.HAS_TRITON = True
    try:
        yield
    finally:
        for module, before in saved:
            module.HAS_TRITON = before


# vLLM's switch for the model runner: read whenever its config asks which
# one runs (building the config, then the Scheduler), from the environment.
MODEL_RUNNER_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"


@contextlib.contextmanager
def model_runner(config: Config) -> Iterator[None]:
    """The trace's model runner switched on for vLLM while it builds the
    Scheduler (as a deployment sets it), and the environment restored after."""
    before = os.environ.get(MODEL_RUNNER_SWITCH)
    os.environ[MODEL_RUNNER_SWITCH] = "1" if config.model_runner == "v2" else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[MODEL_RUNNER_SWITCH]
        else:
            os.environ[MODEL_RUNNER_SWITCH] = before


def check_mode(vllm_config: Any, config: Config) -> None:
    """The Mamba cache mode vLLM's engine config resolved (`align` with prefix
    caching, `none` without, in 0.33.0) must be the config's: the KV-cache
    spec is built with the config's mode, as the engine builds it with its own."""
    # A release without the setting has align mode only.
    resolved = str(getattr(vllm_config.cache_config, "mamba_cache_mode", "align"))
    if resolved != config.mamba_cache_mode:
        caching = "on" if config.prefix_caching else "off"
        raise UnsupportedConfig(
            "mamba_cache_mode",
            f"vLLM's engine runs Mamba in cache mode {resolved!r} with prefix caching "
            f"{caching}, not {config.mamba_cache_mode!r}",
        )


def size_flags(config: Config) -> dict[str, int]:
    """The engine flags that choose `config`'s Mamba block and hash unit, as
    a user would pass them: only with prefix caching (vLLM refuses
    `--mamba-block-size` without it; nothing is hashed then), and only the
    settings this vLLM's `CacheConfig` has."""
    if not config.prefix_caching:
        return {}
    from vllm.config import CacheConfig

    fields = getattr(CacheConfig, "__dataclass_fields__", {})
    flags: dict[str, int] = {}
    mamba = [config.groups[i].block_size for i in config.mamba_group_ids]
    if mamba and "mamba_block_size" in fields:
        flags["mamba_block_size"] = mamba[0]
    if "prefix_match_unit" in fields:
        flags["prefix_match_unit"] = config.hash_unit
    return flags


def engine_sizes(vllm_config: Any, kv_config: Any, config: Config, as_engine: bool) -> int:
    """The hash block vLLM's engine hands its Scheduler for `config`, after
    checking that every size the engine resolves (`resolve_kv_cache_block_sizes`
    where present, the engine config's Mamba block and retention) is the
    config's: a config production would run differently is refused by name.
    Without prefix caching nothing is hashed, so the model's unit (which
    sizes nothing it compares) stands beside the engine's hash block.
    `as_engine` off skips the Mamba block's check (see `VllmScheduler`)."""
    from vllm.v1.core import kv_cache_utils

    resolve = getattr(kv_cache_utils, "resolve_kv_cache_block_sizes", None)
    try:
        # A release without the resolution hands the Scheduler both as set.
        scheduler_block, hash_block = (
            (config.scheduler_block_size, config.hash_unit)
            if resolve is None
            else resolve(kv_config, vllm_config)
        )
    except ValueError as exc:
        raise UnsupportedConfig("hash_unit", f"vLLM's engine refuses it: {describe(exc)}") from exc
    if int(scheduler_block) != config.scheduler_block_size:
        raise UnsupportedConfig(
            "scheduler_block_size",
            f"vLLM's engine resolves {config.scheduler_block_size} to {scheduler_block} "
            "(the groups' lcm)",
        )
    if config.prefix_caching and int(hash_block) != config.hash_unit:
        raise UnsupportedConfig(
            "hash_unit",
            f"vLLM's engine resolves {config.hash_unit} to {hash_block}",
        )
    cache = vllm_config.cache_config
    mamba = {config.groups[i].block_size for i in config.mamba_group_ids}
    resolved_mamba = getattr(cache, "mamba_block_size", None)
    if as_engine and mamba and resolved_mamba is not None and {int(resolved_mamba)} != mamba:
        raise UnsupportedConfig(
            "groups",
            f"vLLM's engine resolves the Mamba block to {resolved_mamba}, not {sorted(mamba)[0]}",
        )
    resolved_retention = getattr(cache, "prefix_cache_retention_interval", 0)
    if resolved_retention != config.retention_interval:
        raise UnsupportedConfig(
            "retention_interval",
            f"vLLM's engine resolves it to {resolved_retention!r}, not "
            f"{config.retention_interval!r}",
        )
    return int(hash_block)


def _runner_for(scheduler: Any, config: Config) -> ModelRunner:
    """The model runner this Scheduler stands for, given the config's.

    Where the build lets the engine choose, the one it was built for. Where
    its v1 runner was removed, a trace for the v1 runner runs on the v2
    one: the two differ only in what the Scheduler hands the worker (a
    resumed request as a new one, the encoder inputs it holds), which is not
    compared, and the model plays both alike. A build with the v1 runner
    only cannot stand for the v2 one."""
    runner, chosen = probed_runner(scheduler)
    if not chosen and runner == "v2":
        return config.model_runner
    return runner


def check_derived(scheduler: Any, config: Config, spec_tokens: int, hash_block: int) -> None:
    """What vLLM derived from the settings must be what the config says."""
    manager = scheduler.kv_cache_manager
    coordinator = manager.coordinator
    sizes = tuple(int(m.block_size) for m in coordinator.single_type_managers)
    checks: tuple[tuple[str, object, object], ...] = (
        (
            "scheduler_block_size",
            int(scheduler.cache_config.block_size),
            config.scheduler_block_size,
        ),
        ("scheduler_block_size", int(scheduler.block_size), config.scheduler_block_size),
        ("hash_unit", int(scheduler.hash_block_size), hash_block),
        ("num_blocks", int(manager.block_pool.num_gpu_blocks), config.num_blocks),
        ("groups", sizes, tuple(g.block_size for g in config.groups)),
        ("eagle", bool(scheduler.use_eagle_block_drop), config.block_drop),
        (
            "max_num_scheduled_tokens",
            int(scheduler.max_num_scheduled_tokens),
            config.max_num_scheduled_tokens,
        ),
        (
            "long_prefill_token_threshold",
            int(scheduler.scheduler_config.long_prefill_token_threshold),
            config.long_prefill_token_threshold,
        ),
        (
            "long_prefill_token_threshold_adaptive",
            bool(getattr(scheduler, "adaptive_long_prefill_threshold", False)),
            config.long_prefill_token_threshold_adaptive,
        ),
        ("max_model_len", int(scheduler.max_model_len), config.max_model_len),
        (
            "prefill_schedule_interval",
            int(getattr(scheduler, "local_prefill_interval", 1)),
            config.prefill_schedule_interval,
        ),
        ("model_runner", _runner_for(scheduler, config), config.model_runner),
        (
            "scheduling_policy",
            # A release without policies serves requests first come, first served.
            str(getattr(getattr(scheduler, "policy", None), "value", "fcfs")),
            config.scheduling_policy,
        ),
        (
            "max_loras",
            # The adapter limit the waiting scan reads (0: no LoRA config).
            int(getattr(getattr(scheduler, "lora_config", None), "max_loras", 0) or 0),
            config.max_loras,
        ),
        # Drafts: K tokens and K lookahead slots, the trace's lookahead
        # hashes, and the prefill lookahead: K for a multi-module MTP
        # drafter, otherwise one token at most (0 and 1 act alike).
        ("eagle", int(scheduler.num_spec_tokens), spec_tokens),
        ("eagle", int(scheduler.num_lookahead_tokens), spec_tokens),
        (
            "hash_lookahead_tokens",
            # A release without lookahead hashes (0.32.0) hashes none.
            int(getattr(scheduler, "num_hash_lookahead_tokens", 0)),
            config.hash_lookahead_tokens,
        ),
        (
            "hash_lookahead_tokens",
            max(int(scheduler.num_prefill_lookahead), 1),
            max(config.prefill_lookahead, 1),
        ),
        (
            "shared_prefix_checkpoint",
            bool(scheduler.mamba_shared_prefix_checkpoint),
            config.shared_prefix_checkpoint_on,
        ),
        # Stats made each update, or none (`--disable-log-stats`).
        ("disable_log_stats", not scheduler.log_stats, config.disable_log_stats),
        # Every Mamba manager in the mode. (Whether the Scheduler then splits
        # for Mamba is its behaviour, not a setting: the lockstep judges it.)
        (
            "mamba_cache_mode",
            {
                str(m.mamba_cache_mode)
                for m in coordinator.single_type_managers
                if hasattr(m, "mamba_cache_mode")
            },
            {config.mamba_cache_mode},
        ),
    )
    for name, got, want in checks:
        if got != want:
            raise UnsupportedConfig(name, f"vLLM's Scheduler runs it as {got!r}, not {want!r}")
