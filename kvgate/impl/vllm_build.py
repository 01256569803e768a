"""Building vLLM's manager objects for a trace's config.

What `Config` says becomes vLLM's `SchedulerConfig` (built for its own
validation: the manager reads none of it), `KVCacheConfig` (pool, groups,
retention) and a `KVCacheManager`, plus the attributes `Scheduler._mamba_block_aligned_split`
reads, so the split can be called without a scheduler. Anything vLLM refuses
while building becomes `RefusedByVllm` naming the trace field: the configs
vLLM refuses are left to vLLM here (`model.scope.vllm_rules` is only the model's
statement of them), so the gate exercises vLLM's own validation.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from types import SimpleNamespace
from typing import Any

from kvgate.impl._vllm_api import VllmApi
from kvgate.impl.vllm_errors import config_field, describe
from kvgate.impl.vllm_residency import metrics_collector
from kvgate.vocabulary.config import Config, GroupConfig, RefusedByVllm, UnsupportedConfig
from kvgate.vocabulary.tokens import HashInputs, lora_adapter_id

__all__ = [
    "block_hasher",
    "request_inputs",
    "build_manager",
    "kv_cache_config",
    "scheduler_config",
    "split_context",
]


def _lookahead_kwargs(config: Config, *callables: Any) -> dict[str, Any]:
    """`num_hash_lookahead_tokens` for `config`'s lookahead hashes, passed only
    when set, after probing that every one of `callables` takes it."""
    lookahead = config.hash_lookahead_tokens
    if not lookahead:
        return {}
    for fn in callables:
        if "num_hash_lookahead_tokens" not in inspect.signature(fn).parameters:
            raise UnsupportedConfig(
                "hash_lookahead_tokens",
                f"this vLLM's {getattr(fn, '__name__', fn)} has no lookahead block hashes",
            )
    return {"num_hash_lookahead_tokens": lookahead}


def _prefill_lookahead_kwargs(api: VllmApi, config: Config) -> dict[str, Any]:
    """`num_prefill_lookahead` as vLLM's Scheduler hands it to its manager
    for a multi-module MTP drafter (lookahead hashes of K > 1 tokens),
    after probing that the manager takes it. (A lookahead of 0 or 1 changes
    nothing in the manager, so it is passed only above 1.)"""
    lookahead = config.prefill_lookahead
    if lookahead <= 1:
        return {}
    if "num_prefill_lookahead" not in inspect.signature(api.KVCacheManager).parameters:
        raise UnsupportedConfig(
            "hash_lookahead_tokens",
            "this vLLM's KVCacheManager has no multi-module MTP prefill lookahead",
        )
    return {"num_prefill_lookahead": lookahead}


def block_hasher(api: VllmApi, config: Config) -> Any:
    """The request block hasher `config`'s scheduler would hand each request
    (none without prefix caching: vLLM's engine then hashes nothing)."""
    if not config.prefix_caching:
        return None
    # Read from its module at each build, not from the names `load` cached, so
    # an in-process edit of it (the fault campaign's) is what runs.
    module = importlib.import_module(api.get_request_block_hasher.__module__)
    make = module.get_request_block_hasher
    return make(config.hash_unit, api.sha256, **_lookahead_kwargs(config, make))


def request_inputs(api: VllmApi, inputs: HashInputs, mm_data: Any = None) -> dict[str, Any]:
    """The `Request` arguments that carry `inputs`, as the engine builds them:
    the salt as given; the adapter as a `LoRARequest` with its stable id
    (`tokens.lora_adapter_id`) and a path of its own (the hash covers the
    path too); each item as an image's `MultiModalFeatureSpec`, its
    identifier and mm hash the trace's id, its processed data `mm_data`
    (None: already in the encoder cache, as the manager never reads it).
    """
    args: dict[str, Any] = {}
    if inputs.cache_salt:
        args["cache_salt"] = inputs.cache_salt
    if inputs.lora:
        args["lora_request"] = api.LoRARequest(
            lora_name=inputs.lora,
            lora_int_id=lora_adapter_id(inputs.lora),
            lora_path=f"/kvgate/lora/{inputs.lora}",
        )
    if inputs.mm:
        args["mm_features"] = [
            api.MultiModalFeatureSpec(
                data=mm_data,
                modality="image",
                identifier=item.identifier,
                mm_position=api.PlaceholderRange(offset=item.offset, length=item.length),
                mm_hash=item.identifier,
            )
            for item in inputs.mm
        ]
    return args


def group_spec(api: VllmApi, index: int, group: GroupConfig, mamba_cache_mode: str) -> Any:
    float32 = api.torch.float32
    if group.kind == "full_attention":
        return api.FullAttentionSpec(
            block_size=group.block_size, num_kv_heads=1, head_size=1, dtype=float32
        )
    if group.kind == "mamba_align":
        # The checkpoint fields only when set: a build without them still
        # runs every trace that leaves them off (and refuses the others).
        checkpoints: dict[str, Any] = {}
        if group.prefill_checkpoint_blocks:
            checkpoints["num_prefill_checkpoint_blocks"] = group.prefill_checkpoint_blocks
        if group.prefill_checkpoint_alignment is not None:
            checkpoints["prefill_checkpoint_alignment"] = group.prefill_checkpoint_alignment
        return api.MambaSpec(
            block_size=group.block_size,
            shapes=((1, 1),),
            dtypes=(float32,),
            mamba_cache_mode=mamba_cache_mode,
            num_speculative_blocks=group.speculative_blocks,
            **checkpoints,
        )
    raise UnsupportedConfig(f"groups[{index}].kind", f"unknown group kind {group.kind!r}")


def kv_cache_config(api: VllmApi, config: Config) -> Any:
    """vLLM's `KVCacheConfig` for `config`: its pool, groups and retention."""
    groups = [
        api.KVCacheGroupSpec([f"layer{i}"], group_spec(api, i, g, config.mamba_cache_mode))
        for i, g in enumerate(config.groups)
    ]
    # The drafter's groups, flagged as vLLM's engine planning flags them;
    # left unflagged, vLLM's fallback would give every group the drop.
    flagged = set(config.eagle_group_ids) if config.eagle and config.has_attention else set()
    if flagged:
        if "is_eagle_group" not in {f.name for f in dataclasses.fields(api.KVCacheGroupSpec)}:
            raise UnsupportedConfig("eagle", "this vLLM's KVCacheGroupSpec has no is_eagle_group")
        for group_id, group in enumerate(groups):
            group.is_eagle_group = group_id in flagged
    return api.KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=config.retention_interval,
    )


def scheduler_config(
    config: Config, max_num_seqs: int | None = None, async_scheduling: bool | None = None
) -> Any:
    """vLLM's `SchedulerConfig` for `config` (chunked prefill on, as align mode
    runs). `max_num_seqs` only sizes the engine; by default the fewest
    sequences that fill the token budget (fewer draw vLLM's warning).
    `async_scheduling` set: the engine's async scheduling on or off (None:
    the engine's own choice)."""
    from vllm.config import SchedulerConfig

    settings: dict[str, bool] = {}
    fields = getattr(SchedulerConfig, "__dataclass_fields__", {})
    if async_scheduling is not None:
        if "async_scheduling" in fields:
            settings["async_scheduling"] = async_scheduling
        elif async_scheduling:
            raise UnsupportedConfig(
                "async_scheduling", "this vLLM's SchedulerConfig has no async scheduling"
            )
    if config.scheduling_policy != "fcfs" and "policy" not in fields:
        raise UnsupportedConfig(
            "scheduling_policy", "this vLLM's SchedulerConfig has no scheduling policies"
        )
    if max_num_seqs is None:
        max_num_seqs = -(-config.max_num_scheduled_tokens // max(1, config.max_model_len))
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=config.max_num_scheduled_tokens,
        max_model_len=config.max_model_len,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        is_encoder_decoder=False,
        # Only when set, as for the adaptive threshold below.
        **(
            {"prefill_schedule_interval": config.prefill_schedule_interval}
            if config.prefill_schedule_interval > 1
            else {}
        ),
        # Only when set: a release without the setting still runs the rest.
        **(
            {"long_prefill_token_threshold_adaptive": True}
            if config.long_prefill_token_threshold_adaptive
            else {}
        ),
        **settings,
        # Only when set: a release without the setting still runs fcfs traces.
        **({"policy": config.scheduling_policy} if config.scheduling_policy != "fcfs" else {}),
    )


def build_manager(api: VllmApi, config: Config) -> Any:
    """A `KVCacheManager` for `config`, as the op semantics prescribe, after
    the `SchedulerConfig` the engine would build first.

    Anything vLLM raises while building them becomes `RefusedByVllm`.
    """
    try:
        scheduler_config(config)
        # What the Scheduler builds from its ObservabilityConfig (which
        # validates the sample rate) and hands its manager.
        collector = metrics_collector(config)
        if (
            collector is not None
            and "metrics_collector" not in inspect.signature(api.KVCacheManager).parameters
        ):
            raise UnsupportedConfig(
                "kv_cache_metrics", "this vLLM's KVCacheManager takes no metrics collector"
            )
        return api.KVCacheManager(
            kv_cache_config(api, config),
            max_model_len=config.max_model_len,
            # What the Scheduler passes: one batch in flight of its budget.
            max_in_flight_tokens=config.max_num_scheduled_tokens,
            scheduler_block_size=config.scheduler_block_size,
            hash_block_size=config.hash_unit,
            enable_caching=config.prefix_caching,
            # vLLM's scheduler clears the drop when lookahead hashes are on.
            use_eagle=config.block_drop,
            **_lookahead_kwargs(config, api.KVCacheManager),
            **_prefill_lookahead_kwargs(api, config),
            log_stats=not config.disable_log_stats,
            enable_kv_cache_events=config.kv_events,
            **({"metrics_collector": collector} if collector is not None else {}),
            **(
                {"enable_mamba_shared_prefix_checkpoint": True}
                if config.shared_prefix_checkpoint
                else {}
            ),
        )
    except UnsupportedConfig:
        raise
    except Exception as exc:  # vLLM rejects with ValueError or a bare assert
        message = describe(exc)
        raise RefusedByVllm(config_field(message), f"vLLM rejects it: {message}") from exc


def split_context(config: Config, coordinator: Any, manager: Any) -> SimpleNamespace:
    """`self` for `Scheduler._mamba_block_aligned_split`: the attributes it reads,
    as a scheduler built for `config` would hold them."""
    partial = bool(getattr(coordinator, "enable_partial_hash_hits", False))
    below_block = partial and config.hash_unit < config.scheduler_block_size
    return SimpleNamespace(
        block_size=config.scheduler_block_size,
        cache_config=SimpleNamespace(block_size=config.scheduler_block_size),
        hash_block_size=config.hash_unit,
        mamba_partial_cache_hit=below_block,
        use_eagle_block_drop=config.block_drop,
        num_hash_lookahead_tokens=config.hash_lookahead_tokens,
        max_num_scheduled_tokens=config.max_num_scheduled_tokens,
        scheduler_config=SimpleNamespace(
            long_prefill_token_threshold=config.long_prefill_token_threshold
        ),
        mamba_has_prefill_checkpoint_blocks=config.prefill_checkpoints,
        mamba_prefill_checkpoint_alignment=config.prefill_checkpoint_alignment,
        mamba_shared_prefix_checkpoint=(
            below_block and bool(getattr(manager, "mamba_shared_prefix_checkpoint", False))
        ),
    )
