"""vLLM's real `Scheduler` (v1, CPU, no weights) as a scheduler-level target.

`VllmScheduler` builds the installed vLLM's `Scheduler` for a trace config:
a `VllmConfig` from a tiny local hybrid model config (a Qwen3-Next-class
`config.json` written offline with transformers' own config class: two
layers, one Gated DeltaNet and one full attention; nothing is downloaded and
no weights exist), MTP speculative decoding with K draft tokens, the
scheduler's token budget and sequence cap, and the `KVCacheConfig` built
from the trace config exactly as the manager-level adapter builds it (same
groups, block sizes, hash unit, pool, retention). What vLLM derives from
those settings is then checked against the config (block sizes, unit, pool,
eagle drop, lookahead, the lookahead hashes): a mismatch is an
`UnsupportedConfig` naming the field, as is anything vLLM raises while
building it. Prefix caching off is built as the engine builds it: no Mamba
cache mode passed, the one vLLM's engine config resolves (`none`) read back
and required to be the trace's. Every size is built as the engine resolves
it: the user's choices passed as their flags would pass them (with prefix
caching, `--mamba-block-size` and `--prefix-match-unit`; the retention
interval), the scheduler and hash block from vLLM's own block-size
resolution, a config it resolves otherwise refused by name.

Each engine step is `schedule()`, then `update()` with fake model-runner
output (`ModelRunnerOutput`: the tokens each request sampled, every draft
rejected) and the next drafts (`update_draft_token_ids`). A wrapper on the
owned manager's `get_computed_blocks` (an instance attribute; the call
passes through unchanged) records each lookup's hit, and, before a
follow-up's lookup, how much of the turn it follows the attention group
still has cached. The manager's state is read through `vllm_view.ManagerView`.
With KV-cache events on (`config.kv_events`) the Scheduler publishes through
vLLM's null publisher, whose `publish` is wrapped the same way (an instance
attribute; each batch kept, then passed on unchanged).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shutil
import stat
import tempfile
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvgate.conformance.config import (
    Config,
    KvLoadFailurePolicy,
    ModelRunner,
    UnsupportedConfig,
)
from kvgate.conformance.events import KvEvent
from kvgate.conformance.scheduling import (
    ASYNC_BATCHES,
    COW_RETENTION,
    PREFIX_CACHE_STATS_KEYS,
    DeferredFree,
    PrefillStats,
    PrefixCacheStats,
    ScheduledStep,
)
from kvgate.conformance.snapshot import Snapshot
from kvgate.conformance.target import Capabilities, StepRefused
from kvgate.conformance.tokens import NO_INPUTS, HashInputs
from kvgate.impl import _vllm_api
from kvgate.impl.vllm_build import block_hasher, kv_cache_config, request_inputs, scheduler_config
from kvgate.impl.vllm_connector import ConnectorScript, ExternalHit
from kvgate.impl.vllm_errors import config_field, describe
from kvgate.impl.vllm_probe import (
    hold_source,
    holds_partial_tails,
    model_runner,
    retains_retired,
    takes_streaming_input,
)
from kvgate.impl.vllm_view import ManagerView

__all__ = ["ConnectorSettings", "VllmScheduler", "model_dir"]

# The draft token ids handed back after each step: never verified (every
# draft is rejected), so never part of a token sequence.
DRAFT_TOKEN = 0


@functools.cache
def model_dir(mtp_layers: int = 1) -> Path:
    """A directory holding a tiny Qwen3-Next-class hybrid `config.json` with
    `mtp_layers` MTP modules.

    Named after the user and the file's content, and shared by every process
    that needs the same file: written once, never removed. (A folder per
    process, removed at exit, outlived every process that was killed or left
    through `os._exit`, as pytest-xdist's workers do.)"""
    config = _hybrid_config(mtp_layers)
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


def _hybrid_config(mtp_layers: int) -> Any:
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


def _kv_transfer_config(settings: ConnectorSettings) -> Any:
    from vllm.config import KVTransferConfig

    from kvgate.impl import vllm_connector

    return KVTransferConfig(
        kv_connector=vllm_connector.CLASS_NAME,
        kv_connector_module_path=vllm_connector.MODULE,
        kv_role=settings.role,
        kv_load_failure_policy=settings.load_failure_policy,
        kv_connector_extra_config={vllm_connector.DIVERGENT_HITS: settings.divergent_hits},
    )


def _vllm_config(
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
    # config resolves it from prefix caching, which `_check_mode` reads back.
    # The sizes a user may choose are passed as their engine flags would pass
    # them (with prefix caching: `--mamba-block-size`, `--prefix-match-unit`;
    # `--prefix-cache-retention-interval`), so vLLM's engine resolves every
    # size from them and `_engine_sizes` reads its resolution back.
    cache = CacheConfig(
        block_size=config.scheduler_block_size,
        enable_prefix_caching=config.prefix_caching,
        enable_mamba_shared_prefix_checkpoint=config.shared_prefix_checkpoint,
        prefix_cache_retention_interval=config.retention_interval,
        **_size_flags(config),
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
            lora_config=_lora_config(config),
            cache_config=cache,
            scheduler_config=scheduler,
            speculative_config=speculative,
            kv_transfer_config=None if connector is None else _kv_transfer_config(connector),
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


def _lora_config(config: Config) -> Any:
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


def _scheduler_class(vllm_config: Any, config: Config) -> Any:
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
def _model_runner(config: Config) -> Iterator[None]:
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


def _check_mode(vllm_config: Any, config: Config) -> None:
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


def _size_flags(config: Config) -> dict[str, int]:
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


def _engine_sizes(vllm_config: Any, kv_config: Any, config: Config, as_engine: bool) -> int:
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
    runner, chosen = model_runner(scheduler)
    if not chosen and runner == "v2":
        return config.model_runner
    return runner


def _check_derived(scheduler: Any, config: Config, spec_tokens: int, hash_block: int) -> None:
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


def _size_encoder(scheduler: Any, config: Config) -> str:
    """Give the Scheduler, built for a text model, the encoder budget and
    encoder cache a multimodal model's engine would size from `config`, so
    requests with multimodal items run as on a vision-language hybrid.
    Probed on the Scheduler's own attributes: what the build lacks for it,
    or "" once done."""
    cache = getattr(scheduler, "encoder_cache_manager", None)
    if cache is None or not hasattr(scheduler, "max_num_encoder_input_tokens"):
        return "this vLLM's Scheduler has no encoder budget and encoder cache"
    try:
        sized = type(cache)(cache_size=config.encoder_cache_slots)
    except TypeError:
        return "this vLLM's encoder cache cannot be built with a size of its own"
    scheduler.encoder_cache_manager = sized
    scheduler.max_num_encoder_input_tokens = config.encoder_budget
    return ""


def _processed_item() -> Any:
    """An image's processed data as an engine hands it to the Scheduler
    with a new request (a one-byte stand-in: the Scheduler never reads it,
    but under the v2 model runner it tracks which requests' items the
    worker holds), or None where the build cannot make one."""
    from vllm.multimodal import inputs

    make = getattr(getattr(inputs, "MultiModalKwargsItem", None), "dummy", None)
    return make() if callable(make) else None


def _check_connector_support() -> None:
    from kvgate.impl.vllm_connector import missing_support

    missing = missing_support()
    if missing:
        raise UnsupportedConfig(
            "kv_connector",
            "this vLLM's Scheduler cannot take kvgate's scripted KV connector: it lacks "
            + ", ".join(missing),
        )


def _scripted_connector(scheduler: Any) -> ConnectorScript:
    """The script of the connector the Scheduler built (it must be ours)."""
    from kvgate.impl.vllm_connector import connector_class

    connector: Any = getattr(scheduler, "connector", None)
    if not isinstance(connector, connector_class()):
        raise UnsupportedConfig(
            "kv_connector",
            "this vLLM's Scheduler did not build the configured KV connector "
            f"(its connector: {type(connector).__name__})",
        )
    script: ConnectorScript = connector.script
    return script


class VllmScheduler:
    """The installed vLLM's `Scheduler`, driven one engine step at a time."""

    capabilities: Capabilities

    def __init__(
        self,
        config: Config,
        *,
        spec_tokens: int,
        max_num_seqs: int,
        plugin: str | None = None,
        connector: ConnectorSettings | None = None,
        engine_sizes: bool = True,
    ) -> None:
        """`engine_sizes` off runs a Mamba block vLLM's engine would not
        resolve for the config (one finer than max_model_len without prefix
        caching: the Scheduler accepts it), for a study of what the Scheduler
        does there; on (the default, and the `workload` command's), such a
        config is refused by name."""
        self.config = config
        self.spec_tokens = spec_tokens
        api, plugin_module = _vllm_api.load_with_hold(config.hold, config.retain_retired, plugin)
        self._api = api
        # Its model is a Qwen3-Next-class hybrid: a pure Mamba model would be
        # another model.
        if not config.has_attention:
            raise UnsupportedConfig(
                "groups", "the vllm-scheduler target runs a hybrid model: a full_attention group"
            )
        if spec_tokens == 0 and config.eagle:
            raise UnsupportedConfig("eagle", "the eagle drop needs draft tokens (spec > 0)")
        if connector is None and config.kv_connector:
            connector = ConnectorSettings(
                load_failure_policy=config.kv_load_failure_policy,
                divergent_hits=config.kv_connector_divergent_hits,
            )
        if connector is not None and config.hash_lookahead_tokens:
            # VllmConfig.num_hash_lookahead_tokens is 0 under any KV connector.
            raise UnsupportedConfig(
                "hash_lookahead_tokens",
                "vLLM keeps legacy block hashes (and the eagle drop) with a KV connector",
            )
        if connector is not None:
            _check_connector_support()
        try:
            from vllm.v1.structured_output import StructuredOutputManager

            with _model_runner(config):
                vllm_config = _vllm_config(config, spec_tokens, max_num_seqs, connector)
                _check_mode(vllm_config, config)
                scheduler_class = _scheduler_class(vllm_config, config)
                kv_config = kv_cache_config(api, config)
                hash_block = _engine_sizes(vllm_config, kv_config, config, engine_sizes)
                scheduler = scheduler_class(
                    vllm_config=vllm_config,
                    kv_cache_config=kv_config,
                    structured_output_manager=StructuredOutputManager(vllm_config),
                    block_size=config.scheduler_block_size,
                    hash_block_size=hash_block,
                    # Stats are made each update (the prefix-cache stats, and
                    # the residency metrics drained when they are on), as an
                    # engine logging stats does.
                    log_stats=not config.disable_log_stats,
                )
        except UnsupportedConfig:
            raise
        except Exception as exc:  # pydantic, ValueError or a bare assert
            message = describe(exc)
            raise UnsupportedConfig(
                config_field(message), f"vLLM's Scheduler rejects it: {message}"
            ) from exc
        _check_derived(scheduler, config, spec_tokens, hash_block)
        # What this build lacks to schedule encoder inputs ("": nothing).
        self._encoder_lacks = _size_encoder(scheduler, config)
        self._mm_data = _processed_item()
        if self._encoder_lacks and (config.encoder_compute_budget or config.encoder_cache_size):
            field = (
                "encoder_compute_budget" if config.encoder_compute_budget else "encoder_cache_size"
            )
            raise UnsupportedConfig(field, self._encoder_lacks)
        self._script: ConnectorScript | None = (
            None if connector is None else _scripted_connector(scheduler)
        )
        self._scheduler: Any = scheduler
        manager = scheduler.kv_cache_manager
        self._view = ManagerView(api, manager, config.hash_unit, config.hash_lookahead_tokens)
        self._hasher: Any = block_hasher(api, config)
        managers = self._view.managers
        hold = holds_partial_tails(api, managers, config.hold)
        self.capabilities = Capabilities(
            implementation=f"vllm {api.version} Scheduler",
            partial_hits=bool(getattr(manager.coordinator, "enable_partial_hash_hits", False)),
            hold=hold,
            hold_source=hold_source(managers, plugin, plugin_module) if hold else "",
            retain_retired=retains_retired(api, managers),
        )
        self.streaming_input = takes_streaming_input(api, scheduler)
        # The engine's pauses (`pause_generation`) set the Scheduler's state.
        self.pause_states = callable(getattr(scheduler, "set_pause_state", None))
        # The event batches the Scheduler published, not yet taken.
        self._published: list[Any] = []
        if config.kv_events:
            self._capture_published(scheduler)
        # Every request ever added, by name (finished ones too: a follow-up's
        # check reads the turn it follows).
        self._requests: dict[str, Any] = {}
        self._follows: dict[str, str] = {}
        # Streaming-input sessions: their tokens are rewritten at each chunk
        # (and their hashes recomputed at a lookup), which the view follows.
        self._sessions: set[str] = set()
        self._admitted: set[str] = set()
        # The scheduled batches whose output is not processed yet, oldest
        # first (one at a time without async scheduling).
        self._outputs: deque[Any] = deque()
        # Each deferred free's blocks as `pop_blocks_for_free` returned them,
        # by request (the Scheduler's queue holds the same lists).
        self._popped: list[tuple[str, Any]] = []
        # The reuse gaps of each eviction event the stats drained, not yet taken.
        self._evictions: list[int] = []
        # The prefix-cache stats the last update reported, not yet taken.
        self._prefix_cache_stats: PrefixCacheStats | None = None
        # The prefill stats the last update's outputs carried, not yet taken.
        self._prefill_stats: dict[str, PrefillStats] = {}
        self._step = ScheduledStep()
        # Requests a stop condition ends in the next update (`stop`).
        self._stopping: set[str] = set()
        # The admission's own local lookup: with a connector that restores
        # lagging Mamba states, the per-group one (which may fall back to, and
        # be followed by a reconciling, `get_computed_blocks`: not lookups of
        # their own).
        divergent = connector is not None and connector.divergent_hits
        name_of_lookup = "get_computed_blocks_for_connector" if divergent else "get_computed_blocks"
        lookup = getattr(manager, name_of_lookup)

        def observed_lookup(request: Any, *args: Any, **kwargs: Any) -> Any:
            name = request.request_id
            previous = self._follows.get(name)
            if previous is not None and name not in self._admitted:
                cached = self._view.attention_cached(self._requests[previous])
                self._step.checked[name] = cached
            result = lookup(request, *args, **kwargs)
            self._step.lookups.append((name, int(result[1])))
            return result

        setattr(manager, name_of_lookup, observed_lookup)
        pop_blocks = manager.pop_blocks_for_free

        def observed_pop(request: Any) -> Any:
            blocks = pop_blocks(request)
            self._popped.append((str(request.request_id), blocks))
            return blocks

        manager.pop_blocks_for_free = observed_pop
        session_update = getattr(scheduler, "_update_request_as_session", None)
        if self.streaming_input and session_update is not None:

            def observed_session_update(session: Any, update: Any) -> Any:
                # Index the session's hashes before its next chunk rewrites
                # its tokens: a hash the rewrite keeps may cover, in its
                # lookahead tokens, the sampled token the chunk drops.
                self._view.index_now(str(session.request_id))
                return session_update(session, update)

            scheduler._update_request_as_session = observed_session_update
        if self._script is not None:
            allocate = manager.allocate_slots

            def observed_allocation(request: Any, *args: Any, **kwargs: Any) -> Any:
                result = allocate(request, *args, **kwargs)
                # Only the waiting queue's calls pass the lookup's blocks.
                if result is not None and "new_computed_blocks" in kwargs:
                    self._step.taken.append(
                        (
                            str(request.request_id),
                            int(kwargs.get("num_new_computed_tokens", 0)),
                            int(kwargs.get("num_external_computed_tokens", 0)),
                            bool(kwargs.get("delay_cache_blocks", False)),
                        )
                    )
                return result

            manager.allocate_slots = observed_allocation

    def _capture_published(self, scheduler: Any) -> None:
        """Keep every KV event batch the Scheduler hands its publisher (an
        instance attribute over the publisher's `publish`, which still runs)."""
        publisher = scheduler.kv_event_publisher
        publish = publisher.publish

        def captured(batch: Any) -> Any:
            self._published.append(batch)
            return publish(batch)

        publisher.publish = captured

    @property
    def scheduler(self) -> Any:
        """The vLLM `Scheduler` under test."""
        return self._scheduler

    @property
    def connector_script(self) -> ConnectorScript:
        """The scripted KV connector's answers and record (a Scheduler built
        with `connector` only)."""
        if self._script is None:
            raise RuntimeError("this Scheduler was built without a KV connector")
        return self._script

    def add_request(
        self,
        name: str,
        tokens: list[int],
        max_tokens: int,
        follows: str | None,
        inputs: HashInputs = NO_INPUTS,
        resumable: bool = False,
        priority: int = 0,
        skip_prefix_cache: bool = False,
    ) -> None:
        # An adapter enters the hashes and, under `max_loras`, the waiting
        # scan; the engine refuses one without a LoRA config (so does the
        # trace reader, before anything runs).
        if inputs.lora and not self.config.max_loras:
            raise StepRefused(
                "lora", f"request {name!r}: adapter {inputs.lora!r} without a LoRA config"
            )
        if inputs.mm and self._encoder_lacks:
            raise UnsupportedConfig("mm", f"request {name!r}: {self._encoder_lacks}")
        if name in self._requests:
            raise StepRefused("req", f"request {name!r} already added")
        limit = self.config.max_model_len
        if len(tokens) + max_tokens > limit:
            # vLLM's input processing refuses it before the scheduler sees it.
            raise StepRefused(
                "prompt",
                f"{len(tokens)} prompt + {max_tokens} output tokens exceed max_model_len {limit}",
            )
        api = self._api
        # Under the priority policy ties go to the earlier arrival: requests
        # arrive one a time unit apart, in the trace's order (a clock could
        # read the same twice, and the request ids would then decide).
        ranked = (
            {"priority": priority, "arrival_time": float(len(self._requests))}
            if self.config.scheduling_policy == "priority"
            else {}
        )
        request = self._request(
            name,
            tokens,
            max_tokens,
            skip_prefix_cache,
            block_hasher=self._hasher,
            **ranked,
            **request_inputs(api, inputs, self._mm_data if inputs.mm else None),
            **({"resumable": True} if resumable else {}),
        )
        if resumable:
            self._sessions.add(name)
        self._requests[name] = request
        if follows is not None:
            self._follows[name] = follows
        self._view.track(name, request, inputs)
        self._scheduler.add_request(request)

    def add_chunk(self, name: str, tokens: list[int], max_tokens: int) -> None:
        """As vLLM's engine sends a session's next input chunk: a resumable
        request with the session's id, which the Scheduler takes at once if
        the session waits for input, and queues otherwise."""
        self._send_again(name, tokens, max_tokens, resumable=True)

    def end_session(self, name: str) -> None:
        """As vLLM's engine ends a session: the request id again, not resumable."""
        self._send_again(name, [], 1, resumable=False)

    def _send_again(self, name: str, tokens: list[int], max_tokens: int, resumable: bool) -> None:
        self._scheduler.add_request(self._request(name, tokens, max_tokens, resumable=resumable))
        self._view.rewritten(name)

    def _request(
        self,
        name: str,
        tokens: list[int],
        max_tokens: int,
        skip_prefix_cache: bool = False,
        **fields: Any,
    ) -> Any:
        """A vLLM `Request` as the engine hands it over: its own output
        length, never stopped early by an end-of-sequence token; one that
        skips the prefix cache says so as prompt logprobs would."""
        api = self._api
        return api.Request(
            request_id=name,
            prompt_token_ids=tokens,
            sampling_params=api.SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=True,
                skip_reading_prefix_cache=True if skip_prefix_cache else None,
                # As a router asking for a lookup's hits as events too.
                extra_args=(
                    {"kv_cache_report_mode": "full"} if self.config.kv_events_full else None
                ),
            ),
            pooling_params=None,
            **fields,
        )

    def schedule(self) -> ScheduledStep:
        self._step = step = ScheduledStep()
        running = {r.request_id for r in self._scheduler.running}
        output = self._scheduler.schedule()
        self._outputs.append(output)
        step.scheduled = [(str(r), int(n)) for r, n in output.num_scheduled_tokens.items()]
        step.preempted = sorted(str(r) for r in output.preempted_req_ids)
        for name, _ in step.lookups:
            if name in self._sessions:
                # With lookahead hashes the Scheduler recomputes a session's
                # hashes before its lookup.
                self._view.rewritten(name)
        hits = dict(step.lookups)
        # With a connector the hit an admission takes can be less than its
        # lookup's (a local sub-block tail superseded): the allocation's.
        hits.update((r, local) for r, local, _, _ in step.taken)
        step.admitted = [(r, hits.get(r, 0)) for r, _ in step.scheduled if r not in running]
        self._admitted.update(r for r, _ in step.admitted)
        step.copies = [
            [int(c.src_block_id), int(c.dst_block_id)] for c in (output.kv_cache_block_copies or ())
        ]
        step.encoder_inputs = {
            str(r): [int(i) for i in items]
            for r, items in (getattr(output, "scheduled_encoder_inputs", None) or {}).items()
            if items
        }
        if self._script is not None:
            queries = self._script.take_queries()
            step.connector_queries = [
                (q.request, q.presented, q.answered, q.load_async) for q in queries
            ]
        return step

    def script_external(self, name: str, tokens: int, load_async: bool, undecided: int = 0) -> None:
        self.connector_script.hits[name] = ExternalHit(tokens, load_async, undecided)

    def update(
        self,
        sampled: Mapping[str, list[int]],
        *,
        loaded: Collection[str] = (),
        failed: Collection[str] = (),
    ) -> list[str]:
        """As `SchedulerTarget.update`; with a connector, also the
        asynchronous loads the worker finished this step (`loaded`) and those
        that failed (`failed`), as its `KVConnectorOutput` reports them (a
        failed receive is also a finished one)."""
        from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput

        if not self._outputs:
            raise RuntimeError("update() without a schedule() before it")
        output = self._outputs.popleft()
        if (loaded or failed) and self._script is None:
            raise RuntimeError("KV loads reported to a Scheduler without a connector")
        ids = [str(r) for r in output.num_scheduled_tokens]
        for name in self._stopping:
            # The token it samples now is its last: vLLM's stop check ends it.
            request = self._requests[name]
            request.max_tokens = request.num_output_tokens + 1
        self._stopping.clear()
        kv_output = None
        if loaded or failed:
            kv_output = KVConnectorOutput(
                finished_recving={*loaded, *failed}, failed_recving=set(failed)
            )
        # Under async scheduling a request may have ended (aborted) while
        # this batch ran: only the ones this output finishes are reported.
        ended = {r for r in ids if self._requests[r].is_finished()}
        # Each request's index in the batch: a release whose output has no
        # such map reads it from the order of `req_ids`.
        indices: dict[str, Any] = {}
        if "req_id_to_index" in getattr(ModelRunnerOutput, "__dataclass_fields__", {}):
            indices["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
        runner_output = ModelRunnerOutput(
            req_ids=ids,
            sampled_token_ids=[list(sampled.get(r, ())) for r in ids],
            kv_connector_output=kv_output,
            **indices,
        )
        outputs = self._scheduler.update_from_output(output, runner_output)
        for engine_output in outputs.values():
            for output_of_request in engine_output.outputs:
                reported = output_of_request.prefill_stats
                if reported is not None:
                    self._prefill_stats[str(output_of_request.request_id)] = (
                        int(reported.num_cached_tokens),
                        int(reported.num_cache_creation_tokens),
                    )
            stats = engine_output.scheduler_stats
            if stats is not None:
                reported = stats.prefix_cache_stats
                self._prefix_cache_stats = {
                    key: getattr(reported, key) for key in PREFIX_CACHE_STATS_KEYS
                }
                self._evictions += [
                    len(e.reuse_gaps_seconds) for e in stats.kv_cache_eviction_events
                ]
        finished = [r for r in ids if r not in ended and self._requests[r].is_finished()]
        # The drafter proposes K tokens for every request that goes on (the
        # Scheduler drops them for a prefill chunk); under async scheduling
        # the engine leaves them to the worker.
        going_on = [r for r in ids if not self._requests[r].is_finished()]
        if going_on and self.spec_tokens and not self.config.async_scheduling:
            self._scheduler.update_draft_token_ids(
                DraftTokenIds(going_on, [[DRAFT_TOKEN] * self.spec_tokens for _ in going_on])
            )
        for r in ids:
            if r in self._sessions:
                # A session that stopped may have taken its next chunk.
                self._view.rewritten(r)
            else:
                self._view.touched(r)
        return finished

    def stop(self, name: str) -> None:
        self._stopping.add(name)

    def abort(self, name: str) -> None:
        from vllm.v1.request import RequestStatus

        self._scheduler.finish_requests(name, RequestStatus.FINISHED_ABORTED)

    def pause(self, mode: str) -> None:
        from vllm.v1.core.sched.interface import PauseState

        states = {
            "keep": PauseState.PAUSED_ALL,
            "wait": PauseState.PAUSED_NEW,
            "": PauseState.UNPAUSED,
        }
        self._scheduler.set_pause_state(states[mode])

    def reset_prefix_cache(self, running: bool, connector: bool = False) -> tuple[bool, list[str]]:
        ok = bool(
            self._scheduler.reset_prefix_cache(
                reset_running_requests=running, reset_connector=connector
            )
        )
        return ok, [str(r.request_id) for r in self._scheduler.waiting]

    def take_prefill_stats(self) -> dict[str, PrefillStats]:
        stats, self._prefill_stats = self._prefill_stats, {}
        return stats

    def take_prefix_cache_stats(self) -> PrefixCacheStats | None:
        stats, self._prefix_cache_stats = self._prefix_cache_stats, None
        return stats

    def take_evictions(self) -> list[int]:
        evictions, self._evictions = self._evictions, []
        return evictions

    def take_kv_events(self) -> list[KvEvent]:
        batches, self._published = self._published, []
        return self._view.kv_events(event for batch in batches for event in batch.events)

    def kv_cache_usage(self) -> float:
        return float(self._scheduler.get_kv_cache_usage())

    def has_requests(self) -> bool:
        return bool(self._scheduler.has_requests())

    def batches_in_flight(self) -> int:
        return len(self._outputs)

    def deferred_frees(self) -> list[DeferredFree]:
        """The Scheduler's `deferred_frees` (none in a release without them),
        each named by the request whose blocks it holds (a copy-on-write
        retention's by that name)."""
        owners = {id(blocks): name for name, blocks in self._popped}
        return [
            (int(fence), owners.get(id(blocks), COW_RETENTION))
            for fence, blocks in getattr(self._scheduler, "deferred_frees", ())
        ]

    def snapshot(self) -> Snapshot:
        owners = {id(blocks): name for name, blocks in self._popped}
        queued = getattr(self._scheduler, "deferred_frees", ())
        popped = {owners[id(b)]: b for _, b in queued if id(b) in owners}
        # Released lists are forgotten (their ids could be reused).
        self._popped = [(n, b) for n, b in self._popped if n in popped]
        return self._view.snapshot(popped)

    def close(self) -> None:
        self._outputs.clear()
        self._popped.clear()
        self._view.close()
        self._requests.clear()
        self._scheduler = None
