"""What the model covers, beside the model: the configs kvgate models
(`check_modelled`, refusing the rest by name as `NotModelled`), vLLM's own
refusals as the model states them (`vllm_rules`, `RefusedByVllm`), and the
one table of what kvgate does not model, which the trace reader refuses by
and the docs' "not modelled" lists are generated from
(`tests/docs_reference.py`):

- `SCHEDULER_LEVEL_ONLY`: config fields only a scheduler-level trace
  models (its engine steps); a manager-level trace that sets one is refused
  in one line naming the field, since its manager calls would be the same
  either way and the trace would claim what it does not check.
- `NOT_MODELLED`: vLLM settings no trace field stands for; every target
  runs with them off.

Every target refuses through these before it builds anything."""

from __future__ import annotations

from typing import Any

from kvgate.vocabulary.config import (
    KV_LOAD_FAILURE_POLICIES,
    MAMBA_CACHE_MODES,
    MODEL_RUNNERS,
    SCHEDULING_POLICIES,
    VLLM_DEFECT_ARMS,
    Config,
    NotModelled,
    RefusedByVllm,
)

# The vLLM release whose behaviour the model follows.
MODELLED_VLLM = "0.33.0"

# The fields whose values vLLM 0.33.0 fixes as a closed set: the field, its
# values, what the refusal calls them.
_CLOSED_CHOICES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("kv_load_failure_policy", KV_LOAD_FAILURE_POLICIES, "policies"),
    ("model_runner", MODEL_RUNNERS, "model runners"),
    ("scheduling_policy", SCHEDULING_POLICIES, "scheduling policies"),
)


def validate(config: Config) -> None:
    """The model side: refuse what vLLM refuses, as vLLM does (a user meets
    that refusal first, whatever kvgate models), then what kvgate does not
    model; the format's config space is what is left."""
    vllm_rules(config)
    check_modelled(config)


def check_modelled(config: Config) -> None:
    """Refuse, by name, what kvgate does not model (`NotModelled`)."""
    groups = config.groups
    if config.num_blocks < 2:
        raise NotModelled("num_blocks", "needs at least 2 blocks (one is the null block)")
    if config.hash_unit < 1:
        raise NotModelled("hash_unit", "must be >= 1")
    if config.scheduler_block_size < 1:
        raise NotModelled("scheduler_block_size", "must be >= 1")
    kinds = [g.kind for g in groups]
    if kinds.count("mamba_align") < 1:
        raise NotModelled("groups", "at least one mamba_align group is required")
    if kinds.count("full_attention") > 1:
        raise NotModelled("groups", "at most one full_attention group is supported")
    if not config.has_attention and len(groups) != 1:
        # vLLM's hybrid coordinator serves several Mamba groups without an
        # attention group (built and checked: it accepts them); a pure
        # Mamba model's layers share one group, and kvgate models only that.
        raise NotModelled(
            "groups",
            "without a full_attention group only one mamba_align group is modelled "
            "(a pure Mamba model's layers share one group)",
        )
    for i, g in enumerate(groups):
        where = f"groups[{i}]"
        if g.block_size < 1:
            raise NotModelled(f"{where}.block_size", "must be >= 1")
        if not config.prefix_caching and g.block_size % config.hash_unit:
            # vLLM's no-prefix-cache coordinator accepts it (it hashes
            # nothing); the model sizes its requests' keys by the unit.
            raise NotModelled(
                f"{where}.block_size",
                f"block_size {g.block_size} is not a multiple of hash_unit {config.hash_unit} "
                "(vLLM accepts it without prefix caching; kvgate does not model it)",
            )
        if g.speculative_blocks < 0:
            raise NotModelled(f"{where}.speculative_blocks", "must be >= 0")
        if g.kind == "full_attention" and g.speculative_blocks:
            raise NotModelled(
                f"{where}.speculative_blocks", "only mamba_align groups take speculative blocks"
            )
        if g.prefill_checkpoint_blocks < 0:
            raise NotModelled(f"{where}.prefill_checkpoint_blocks", "must be >= 0")
        if g.prefill_checkpoint_alignment is not None and g.prefill_checkpoint_alignment < 1:
            raise NotModelled(f"{where}.prefill_checkpoint_alignment", "must be >= 1")
        if g.kind == "full_attention" and (
            g.prefill_checkpoint_blocks or g.prefill_checkpoint_alignment is not None
        ):
            field = (
                "prefill_checkpoint_blocks"
                if g.prefill_checkpoint_blocks
                else "prefill_checkpoint_alignment"
            )
            raise NotModelled(
                f"{where}.{field}", "only mamba_align groups take prefill checkpoints"
            )
    if config.hash_lookahead_tokens and not config.eagle:
        raise NotModelled(
            "hash_lookahead_tokens", "lookahead block hashes need eagle: true (an EAGLE drafter)"
        )
    if config.kv_connector and config.hash_lookahead_tokens:
        # VllmConfig.num_hash_lookahead_tokens is 0 whenever a KV connector is
        # configured: production never runs the two together.
        raise NotModelled(
            "hash_lookahead_tokens",
            "vLLM keeps legacy block hashes (lookahead 0) under a KV connector, "
            "so kv_connector: true runs only with hash_lookahead_tokens 0",
        )
    if config.kv_connector_divergent_hits and not config.kv_connector:
        raise NotModelled(
            "kv_connector_divergent_hits", "needs kv_connector: true (it is the connector's)"
        )
    for field, values, what in _CLOSED_CHOICES:
        value = getattr(config, field)
        if value not in values:
            raise NotModelled(
                field, f"{value!r} is not one of {', '.join(values)} (vLLM 0.33.0's {what})"
            )
    if config.vllm_defects not in VLLM_DEFECT_ARMS:
        raise NotModelled(
            "vllm_defects",
            f"{config.vllm_defects!r} is not one of {', '.join(VLLM_DEFECT_ARMS)}",
        )
    if config.prefill_schedule_interval < 1:
        raise NotModelled(
            "prefill_schedule_interval",
            f"{config.prefill_schedule_interval} is below 1 (vLLM refuses it)",
        )
    if config.prefill_schedule_interval > 1 and (config.kv_connector or config.async_scheduling):
        raise NotModelled(
            "prefill_schedule_interval",
            "a prefill cadence is modelled without a KV connector and async scheduling",
        )
    if config.kv_load_failure_policy != "recompute" and not config.kv_connector:
        raise NotModelled(
            "kv_load_failure_policy", "needs kv_connector: true (it is the connector's)"
        )
    if config.kv_cache_metrics and config.kv_cache_metrics_sample != 1.0:
        # vLLM draws each block's sampling at random: not a function of the
        # history, so nothing a model could predict.
        raise NotModelled(
            "kv_cache_metrics_sample",
            f"{config.kv_cache_metrics_sample} is not 1.0 (vLLM samples blocks at random "
            "below 1.0; only every block sampled is modelled)",
        )
    if config.mamba_cache_mode not in MAMBA_CACHE_MODES:
        # vLLM 0.33.0 has no other mode (its CacheConfig's literal); a later
        # one (e.g. 'all') is not modelled until it is read and modelled.
        raise NotModelled(
            "mamba_cache_mode",
            f"{config.mamba_cache_mode!r} is not modelled (only align and none, "
            "vLLM 0.33.0's modes)",
        )
    if config.max_model_len < 1:
        raise NotModelled("max_model_len", "must be >= 1")
    if config.max_num_scheduled_tokens < 1:
        raise NotModelled("max_num_scheduled_tokens", "must be >= 1")


def vllm_rules(config: Config) -> None:
    """Refuse what vLLM 0.33.0 refuses (`RefusedByVllm`), naming the field
    vLLM's refusal concerns, in the order vLLM checks: the scheduler's config,
    then the coordinator's scheduler block, its retention interval, and the
    hybrid or unitary coordinator's hash unit. Each rule was found by
    building vLLM with the config; `tests/test_refusals.py` and the refusal
    traces check they still agree. A degenerate config (a size below 1, no
    group) is left to `check_modelled`."""
    sizes = (config.hash_unit, config.scheduler_block_size, *(g.block_size for g in config.groups))
    if not config.groups or min(sizes) < 1:
        return
    if config.long_prefill_token_threshold > config.max_model_len:
        # SchedulerConfig's own check.
        raise RefusedByVllm(
            "long_prefill_token_threshold",
            f"{config.long_prefill_token_threshold} is greater than max_model_len "
            f"{config.max_model_len}",
        )
    sample = config.kv_cache_metrics_sample
    if not 0 < sample <= 1:
        # ObservabilityConfig's own check (built after the SchedulerConfig),
        # whether the metrics are on or not.
        raise RefusedByVllm(
            "kv_cache_metrics_sample", f"{sample} is not in (0, 1] (a sampling rate)"
        )
    scheduler = config.scheduler_block_size
    # Every coordinator: the scheduler block is a multiple of the hash unit
    # and of every group's block.
    if scheduler % config.hash_unit:
        raise RefusedByVllm(
            "scheduler_block_size",
            f"{scheduler} is not a multiple of hash_unit {config.hash_unit}",
        )
    for i, g in enumerate(config.groups):
        if scheduler % g.block_size:
            raise RefusedByVllm(
                "scheduler_block_size",
                f"{scheduler} is not a multiple of group {i}'s block_size {g.block_size}",
            )
    if config.prefix_caching and config.eagle_group_ids and scheduler < config.prefill_lookahead:
        # The coordinator's own check: the tail a multi-module MTP drafter
        # reads ahead must fit in one scheduler block.
        raise RefusedByVllm(
            "scheduler_block_size",
            f"{scheduler} is smaller than the multi-module MTP drafter's lookahead "
            f"{config.prefill_lookahead} (hash_lookahead_tokens)",
        )
    retention = config.retention_interval
    if retention and not config.mamba_group_ids:
        # Retention acts on sliding-window and Mamba groups only.
        raise RefusedByVllm(
            "retention_interval",
            f"{retention} is set, but no group is a mamba_align group (only 0 or null is)",
        )
    # null (dense), or >= 0 and a multiple of the scheduler block (0: replay
    # boundaries only; more: periodic too).
    if retention is not None and (retention < 0 or retention % scheduler):
        raise RefusedByVllm(
            "retention_interval",
            f"{retention} is not null, or >= 0 and a multiple of scheduler_block_size {scheduler}",
        )
    if config.mamba_cache_mode == "none" and config.prefix_caching:
        # MambaManager asserts align mode under prefix caching (and the
        # engine config switches 'none' to 'align' when caching is on).
        raise RefusedByVllm(
            "mamba_cache_mode",
            "none with prefix_caching true (Mamba prefix caching requires align mode)",
        )
    if not config.prefix_caching:
        return  # the no-prefix-cache coordinator hashes nothing
    if len(config.groups) == 1 and config.hash_unit != config.groups[0].block_size:
        # The unitary coordinator (one group) hashes at its block.
        raise RefusedByVllm(
            "hash_unit",
            f"hash_unit {config.hash_unit} is not the single group's block_size "
            f"{config.groups[0].block_size} (a single group hashes at its own block)",
        )
    for i, g in enumerate(config.groups):
        if g.block_size % config.hash_unit:
            # The hybrid coordinator: every cacheable group's block.
            raise RefusedByVllm(
                "hash_unit",
                f"group {i}'s block_size {g.block_size} is not a multiple of "
                f"hash_unit {config.hash_unit}",
            )


# Config field -> why a manager-level trace may not set it.
SCHEDULER_LEVEL_ONLY: dict[str, str] = {
    "async_scheduling": (
        "async scheduling is modelled by scheduler-level traces (engine steps with two "
        "batches in flight); a manager-level trace's calls are the same either way, so it "
        "would check nothing of it: write the trace's steps as `engine` entries, or leave "
        "the field out"
    ),
}

# (what, its vLLM setting or where vLLM has it): every target runs without it.
NOT_MODELLED: tuple[tuple[str, str], ...] = (
    ("the KV-cache watermark", "`watermark`"),
    (
        "decode and prefill context parallelism",
        "`decode_context_parallel_size`, `prefill_context_parallel_size`",
    ),
    ("a KV connector's own stats", "the connector's `get_kv_connector_stats`"),
    ("deferred async KV loads", "a connector that defers its loads"),
    ("HiSparse", "`unpin_blocks`"),
    ("prompt embeddings as a hash input", "`prompt_embeds`"),
    ("a draft model whose attention spec differs from the target's", "its own KV spec"),
    ("several Mamba groups without an attention group", "the model's layers"),
)


# Under async scheduling (`async_scheduling`), what a scheduler-level trace
# may not ask for, and why: (what, the reason). Output placeholders, decodes
# past an output in flight, drafts and their acceptance, preemption, abort,
# stop conditions and prefix-cache resets with outputs in flight are modelled.
NOT_MODELLED_UNDER_ASYNC: tuple[tuple[str, str], ...] = (
    (
        "a pause (`pause`)",
        "vLLM's engine does not step its batch queue as usual while paused, which the "
        "scheduler model does not follow",
    ),
    (
        "an abort inside a step (`abort` on a `step`)",
        "with a batch always in flight, an abort between two engine steps is the same "
        "event: write it as its own `abort` entry",
    ),
    (
        "an asynchronous KV load (`remote_async`)",
        "the worker's load reports are not interleaved with the batch queue in the model",
    ),
    (
        "a streaming-input session (`resumable`)",
        "a session's stop and next chunk with its output still in flight are not modelled",
    ),
    (
        "encoder inputs (`mm`)",
        "the encoder cache's frees at each batch's update are not modelled with batches in flight",
    ),
    (
        "a prefix-cache reset's preemption of a request in flight with a KV connector",
        "vLLM defers such a request's free, which a reset's preemption would have to follow",
    ),
    (
        "the priority policy and a prefill cadence",
        "their victim choice and admission rules are modelled with one batch in flight",
    ),
    (
        "structured output",
        "no trace field stands for it; with it vLLM hands the drafts to the Scheduler "
        "under async scheduling",
    ),
)


def scheduler_level_only(config: Any) -> list[str]:
    """The `SCHEDULER_LEVEL_ONLY` fields `config` sets (to a value other
    than off)."""
    return [key for key in SCHEDULER_LEVEL_ONLY if getattr(config, key, False)]


def not_modelled_text() -> str:
    """The docs' list: what no trace can set, then the scheduler-level-only fields."""
    items = [f"{what} ({where})" for what, where in NOT_MODELLED]
    only = ", ".join(f"`{key}`" for key in SCHEDULER_LEVEL_ONLY)
    return (
        "A trace cannot set these, and every target runs with them off: "
        + "; ".join(items)
        + ". Settings that only change memory layout (`MambaSpec` shapes, dtypes, page "
        "size) do not affect the manager's decisions. A config outside what kvgate "
        "models is refused with one line naming the field, and the gate keeps whose "
        "refusal it is: vLLM's own (the target must refuse it too) or kvgate's "
        "(`NotModelled`: vLLM may serve it, kvgate cannot judge it). "
        f"Some fields only a scheduler-level trace models ({only}): a manager-level "
        "trace that sets one is refused in one line naming it. Under async scheduling "
        "a scheduler-level trace models output placeholders, decodes past an output in "
        "flight, drafts and their acceptance, and preemptions, aborts, stop conditions "
        "and prefix-cache resets with outputs in flight; it is refused in one line "
        "naming the field for "
        + "; ".join(f"{what} ({why})" for what, why in NOT_MODELLED_UNDER_ASYNC)
        + "."
    )
