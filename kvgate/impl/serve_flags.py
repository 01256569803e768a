"""A `vllm serve` command line resolved as vLLM's engine resolves it, on CPU.

The command line is parsed by vLLM's own serve parser and resolved by its
own `EngineArgs.create_engine_config`, with the model's local `config.json`
(no weights, no tokenizer, no hub). What the engine decides only on its
serving machine is said so by name rather than guessed: the pool size (GPU
memory), the prefill checkpoint columns (the Mamba layers' kernels, known
once the layers are built), the model runner (Triton). The blocks a
hybrid's worker serves are computed as that worker does
(`served_blocks.py`), on a stated attention backend. One decision of this
machine's platform is set aside: vLLM's CPU platform turns async scheduling
off (it gains nothing there), and a GPU engine does not, so the value vLLM
resolved before the platform's say is the one kept and everything derived
after it sees that value, as on the serving machine. Likewise the SSM
state's dtype, which the CPU platform stores in float32 for its GDN
kernels: kept as a GPU resolves it, unless the served blocks are asked for
vLLM's CPU backend.

`resolve` returns every resolved setting with the vLLM setting it came
from, the settings kvgate cannot model, and a kvgate trace `Config` when
the pool size is known.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.errors import InputError
from kvgate.impl.served_blocks import ServedBlocks, served_blocks
from kvgate.impl.vllm_errors import describe
from kvgate.model.scope import check_modelled
from kvgate.vocabulary.config import Config, GroupConfig, UnsupportedConfig

__all__ = ["Deployment", "Setting", "resolve", "serve_args"]

# Words a command line copied whole starts with; dropped before parsing.
_SERVE_PREFIX = ("vllm", "serve")


@dataclass(frozen=True)
class Setting:
    """One resolved setting: its name, its value, and the vLLM setting
    (flag or config attribute) it came from."""

    name: str
    value: str
    source: str


@dataclass
class Deployment:
    """A serve command line as vLLM's engine resolves it."""

    settings: list[Setting] = field(default_factory=list)
    # Settings kvgate cannot model, by name, each with why.
    unmodelled: list[tuple[str, str]] = field(default_factory=list)
    # What the engine decides only on the serving machine, by name.
    unresolved: list[tuple[str, str]] = field(default_factory=list)
    # The trace config, or why there is none.
    config: Config | None = None
    config_missing: str = ""
    # The resolved values by name, for a caller that checks them.
    values: dict[str, Any] = field(default_factory=dict)
    # The worker's block update for a hybrid (None for a single layer kind).
    served: ServedBlocks | None = None

    def add(self, name: str, value: Any, source: str) -> None:
        self.values[name] = value
        shown = value if isinstance(value, str) else json.dumps(value)
        self.settings.append(Setting(name, shown, source))


def serve_args(words: list[str]) -> list[str]:
    """The serve command line without a leading `--`, `vllm` or `serve`."""
    rest = list(words)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    for word in _SERVE_PREFIX:
        if rest[:1] == [word]:
            rest = rest[1:]
    if not rest:
        raise InputError("deployment: no serve command line given (MODEL-DIR [FLAG...])")
    return rest


def model_path(argv: Sequence[str]) -> Path:
    """The model directory of a serve command line: its first positional
    argument or `--model`; it must hold a `config.json`."""
    path: str | None = None
    for index, word in enumerate(argv):
        if word == "--model" and index + 1 < len(argv):
            path = argv[index + 1]
        elif word.startswith("--model="):
            path = word.split("=", 1)[1]
    if path is None and argv and not argv[0].startswith("-"):
        path = argv[0]
    if path is None:
        raise InputError(
            "serve command line: no model given (a local directory holding config.json)"
        )
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise InputError(
            f"serve command line: model {path!r} is not a local directory holding config.json "
            "(kvgate reads the model's config only: no weights, no hub)"
        )
    return folder


def _parse(argv: Sequence[str]) -> Any:
    """vLLM's own serve parser on `argv`; its refusal as one line."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = parser.parse_args(list(argv))
    except SystemExit as stop:
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit {stop.code}"
        raise InputError(f"serve command line: vLLM's serve parser refuses it: {why}") from None
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    return args


@contextlib.contextmanager
def _gpu_async_decision(seen: dict[str, Any]) -> Iterator[None]:
    """vLLM's CPU platform's overrides of async scheduling and of the SSM
    state's dtype (float32 for its GDN kernels) set aside while the engine
    config resolves: what vLLM decided before the platform's say stays (a
    GPU engine keeps it), and `seen["platform"]` and `seen["cpu_ssm_dtype"]`
    record what the platform would have set."""
    from vllm.platforms import current_platform

    original = current_platform.check_and_update_config

    def check_and_update_config(vllm_config: Any) -> None:
        scheduler = vllm_config.scheduler_config
        cache = vllm_config.cache_config
        before = scheduler.async_scheduling
        ssm_dtype = cache.mamba_ssm_cache_dtype
        original(vllm_config)
        seen["platform"] = scheduler.async_scheduling
        seen["cpu_ssm_dtype"] = cache.mamba_ssm_cache_dtype
        scheduler.async_scheduling = before
        cache.mamba_ssm_cache_dtype = ssm_dtype

    current_platform.check_and_update_config = check_and_update_config
    try:
        yield
    finally:
        del current_platform.check_and_update_config


def engine_config(argv: Sequence[str]) -> tuple[Any, Any, dict[str, Any]]:
    """(vLLM's resolved `VllmConfig`, the parsed flags, what the platform set
    aside) for a serve command line."""
    model_path(argv)
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    args = _parse(argv)
    # The directory holds the model's config only: no tokenizer to load.
    args.skip_tokenizer_init = True
    seen: dict[str, Any] = {}
    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
        with _gpu_async_decision(seen):
            vllm_config = engine_args.create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER
            )
    except InputError:
        raise
    except Exception as error:  # vLLM's refusal of the deployment, in one line
        raise InputError(f"serve command line: vLLM refuses it: {describe(error)}") from None
    return vllm_config, args, seen


def _layer_kinds(vllm_config: Any) -> tuple[bool, bool]:
    """(has attention layers, has Mamba layers) of the served model."""
    model = vllm_config.model_config
    hybrid = bool(getattr(model, "is_hybrid", False))
    attention_free = bool(getattr(model, "is_attention_free", False))
    return (not attention_free, hybrid or attention_free)


def _hash_unit(vllm_config: Any, groups: tuple[GroupConfig, ...]) -> tuple[int, int]:
    """(scheduler block, hash unit) as vLLM's engine resolves them for these
    groups (`resolve_kv_cache_block_sizes`)."""
    from vllm.v1.core import kv_cache_utils

    from kvgate.impl import _vllm_api
    from kvgate.impl.vllm_build import group_spec

    api = _vllm_api.load()
    mode = str(vllm_config.cache_config.mamba_cache_mode)
    kv_config = api.KVCacheConfig(
        num_blocks=1,
        kv_cache_tensors=[],
        kv_cache_groups=[
            api.KVCacheGroupSpec([f"layer{i}"], group_spec(api, i, g, mode))
            for i, g in enumerate(groups)
        ],
    )
    try:
        scheduler_block, hash_block = kv_cache_utils.resolve_kv_cache_block_sizes(
            kv_config, vllm_config
        )
    except ValueError as error:
        raise InputError(
            f"serve command line: vLLM's engine refuses it: {describe(error)}"
        ) from None
    return int(scheduler_block), int(hash_block)


def resolve(
    argv: Sequence[str],
    num_blocks: int | None = None,
    assumed_backend: str | None = None,
    checkpoint_alignment: int | None = None,
) -> Deployment:
    """The deployment a serve command line resolves to; `num_blocks` is the
    pool size for the trace config when the command line does not fix it
    (`--num-gpu-blocks-override`); `assumed_backend` and
    `checkpoint_alignment` are what the serving machine's worker reads from
    its built layers (`served_blocks`)."""
    vllm_config, args, seen = engine_config(argv)
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    model = vllm_config.model_config
    spec = vllm_config.speculative_config
    out = Deployment()

    architecture = (getattr(model, "architectures", None) or ["unknown"])[0]
    out.add("model", f"{model.model} ({architecture})", "the model's config.json")
    caching = bool(cache.enable_prefix_caching)
    out.add(
        "prefix caching", caching, "--enable-prefix-caching (CacheConfig.enable_prefix_caching)"
    )
    has_attention, has_mamba = _layer_kinds(vllm_config)
    mode = str(getattr(cache, "mamba_cache_mode", "align")) if has_mamba else "none"
    out.add(
        "mamba cache mode",
        mode,
        "--enable-prefix-caching (CacheConfig.mamba_cache_mode; "
        "--mamba-cache-mode is deprecated and has no effect)",
    )
    drafts = int(spec.num_speculative_tokens) if spec is not None else 0
    attention_block = int(cache.block_size)
    mamba_block = int(cache.mamba_block_size or cache.block_size) if has_mamba else 0
    attention_source = "--block-size (CacheConfig.block_size)"
    mamba_source = "--mamba-block-size (CacheConfig.mamba_block_size)"
    if has_attention and has_mamba:
        served = served_blocks(
            vllm_config, assumed_backend, checkpoint_alignment, seen.get("cpu_ssm_dtype")
        )
        out.served = served
        out.add("attention backend", served.backend, served.backend_source)
        attention_block, mamba_block = served.attention_block, served.mamba_block
        configured = (
            f"--block-size {served.configured_attention_block}"
            if cache.user_specified_block_size
            else f"vLLM's default block {served.configured_attention_block} (no --block-size)"
        )
        attention_source = (
            configured
            + (
                " raised by "
                if attention_block != served.configured_attention_block
                else " kept by "
            )
            + served.describe()
        )
        if mode == "align":
            mamba_source = "set to the attention block by the same update in align mode" + (
                f" (--mamba-block-size {served.configured_mamba_block} is overridden)"
                if served.configured_mamba_block != mamba_block
                else ""
            )
    speculative_blocks = drafts if has_mamba and not getattr(cache, "use_replayssm", False) else 0
    groups: list[GroupConfig] = []
    if has_attention:
        groups.append(GroupConfig("full_attention", attention_block))
    if has_mamba:
        # The trace format's Mamba group kind; its mode is `mamba_cache_mode`.
        groups.append(GroupConfig("mamba_align", mamba_block, speculative_blocks))
    out.add(
        "groups",
        ", ".join(
            f"{g.kind} block {g.block_size}"
            + (f" (speculative blocks {g.speculative_blocks})" if g.speculative_blocks else "")
            for g in groups
        ),
        "the model's layer types; the blocks as served (below); speculative blocks: MambaSpec."
        "num_speculative_blocks from --speculative-config num_speculative_tokens",
    )
    if has_attention:
        out.add("attention block", attention_block, attention_source)
    if has_mamba:
        out.add("mamba block", mamba_block, mamba_source)
    scheduler_block, hash_unit = _hash_unit(vllm_config, tuple(groups)) if groups else (0, 0)
    out.add(
        "hash unit",
        hash_unit,
        "--prefix-match-unit (CacheConfig.prefix_match_unit), resolved by "
        "resolve_kv_cache_block_sizes: the prefix-match unit",
    )
    out.add(
        "scheduler block",
        scheduler_block,
        "resolve_kv_cache_block_sizes: the groups' least common multiple",
    )
    method = str(spec.method) if spec is not None else "none"
    out.add("drafts", drafts, "--speculative-config num_speculative_tokens")
    out.add("draft method", method, "--speculative-config method")
    prefill_lookahead = int(vllm_config.num_prefill_lookahead_tokens)
    multi = bool(spec is not None and spec.use_multi_module_mtp())
    out.add(
        "prefill lookahead",
        prefill_lookahead,
        "VllmConfig.num_prefill_lookahead_tokens: the draft count for a "
        "multi-module MTP drafter, 1 for one draft layer reused"
        + (" (multi-module MTP here)" if multi else ""),
    )
    hash_lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0))
    out.add(
        "hash lookahead",
        hash_lookahead,
        "VllmConfig.num_hash_lookahead_tokens (lookahead block hashes; 0: legacy hashes)",
    )
    out.add(
        "lookahead slots",
        int(vllm_config.num_lookahead_tokens)
        if hasattr(vllm_config, "num_lookahead_tokens")
        else drafts,
        "VllmConfig.num_lookahead_tokens (decode slots for draft tokens)",
    )
    async_on = bool(scheduler.async_scheduling)
    given = getattr(args, "async_scheduling", None)
    async_source = (
        "--async-scheduling"
        if given
        else "--no-async-scheduling"
        if given is False
        else "vLLM's default (on unless an incompatible setting turns it off)"
    )
    if seen.get("platform") is not None and seen["platform"] != async_on:
        async_source += "; this machine's CPU platform would turn it off, set aside"
    out.add("async scheduling", async_on, async_source + " (SchedulerConfig.async_scheduling)")
    # The Scheduler's budget: the scheduled-token cap where vLLM sets one
    # (draft slots take their share), else the batched-token budget.
    budget = scheduler.max_num_scheduled_tokens
    budget = int(scheduler.max_num_batched_tokens if budget is None else budget)
    out.add(
        "token budget",
        budget,
        "--max-num-batched-tokens (SchedulerConfig.max_num_scheduled_tokens, "
        "after the draft slots' share)",
    )
    out.add("max_num_seqs", int(scheduler.max_num_seqs), "--max-num-seqs")
    parallel = vllm_config.parallel_config
    out.add("GPUs", int(parallel.tensor_parallel_size), "--tensor-parallel-size")
    out.add(
        "GPU memory utilization",
        float(cache.gpu_memory_utilization),
        "--gpu-memory-utilization (CacheConfig.gpu_memory_utilization)",
    )
    layers = int(model.get_num_layers(parallel))
    attention_layers = int(model.get_num_layers_by_block_type(parallel, "attention"))
    out.values["attention layers"] = attention_layers
    out.values["mamba layers"] = layers - attention_layers if has_mamba else 0
    out.add(
        "layers",
        f"{layers}: {attention_layers} attention, {out.values['mamba layers']} Mamba",
        "the model's config.json (ModelConfig.get_num_layers_by_block_type)",
    )
    out.add("max_model_len", int(model.max_model_len), "--max-model-len (else the model's config)")
    transfer = vllm_config.kv_transfer_config
    connector = "none" if transfer is None else (f"{transfer.kv_connector} ({transfer.kv_role})")
    out.add("KV connector", connector, "--kv-transfer-config kv_connector, kv_role")
    retention = getattr(cache, "prefix_cache_retention_interval", None)
    out.add(
        "retention interval",
        retention,
        "--prefix-cache-retention-interval (CacheConfig.prefix_cache_retention_interval)",
    )
    shared = bool(getattr(cache, "enable_mamba_shared_prefix_checkpoint", False))
    out.add(
        "shared-prefix checkpoint",
        shared,
        "--enable-mamba-shared-prefix-checkpoint",
    )
    out.add("scheduling policy", str(scheduler.policy), "--scheduling-policy")
    lora = vllm_config.lora_config
    max_loras = int(lora.max_loras) if lora is not None else 0
    out.add("max_loras", max_loras, "--enable-lora --max-loras")
    threshold = int(scheduler.long_prefill_token_threshold)
    out.add("long prefill threshold", threshold, "--long-prefill-token-threshold")
    events = vllm_config.kv_events_config
    kv_events = bool(events is not None and events.enable_kv_cache_events)
    out.add("KV-cache events", kv_events, "--kv-events-config enable_kv_cache_events")
    log_stats = not bool(getattr(args, "disable_log_stats", False))
    out.add("stats logging", log_stats, "--disable-log-stats")

    _unresolved(out, vllm_config, has_mamba)
    _unmodelled(out, vllm_config, transfer)

    pool = cache.num_gpu_blocks_override or num_blocks
    if pool is None:
        out.config_missing = (
            "the pool size: vLLM sizes it at startup from the serving GPU's memory; "
            "pass --num-gpu-blocks-override in the serve command line or kvgate's --num-blocks"
        )
        return out
    config = Config(
        num_blocks=int(pool),
        hash_unit=hash_unit,
        groups=tuple(groups),
        eagle=bool(spec is not None and spec.use_eagle()),
        retention_interval=retention,
        hold=False,
        scheduler_block_size=scheduler_block,
        max_model_len=int(model.max_model_len),
        max_num_scheduled_tokens=budget,
        long_prefill_token_threshold=threshold,
        shared_prefix_checkpoint=shared,
        kv_events=kv_events,
        reserve_full_sequence=bool(getattr(scheduler, "scheduler_reserve_full_isl", False)),
        disable_log_stats=not log_stats,
        hash_lookahead_tokens=hash_lookahead,
        prefix_caching=caching,
        mamba_cache_mode=mode,  # type: ignore[arg-type]
        kv_connector=transfer is not None,
        async_scheduling=async_on,
        scheduling_policy=str(scheduler.policy),  # type: ignore[arg-type]
        max_loras=max_loras,
    )
    try:
        check_modelled(config)
    except UnsupportedConfig as refused:
        out.unmodelled.append((refused.field, refused.message))
    out.config = config
    return out


def _unresolved(out: Deployment, vllm_config: Any, has_mamba: bool) -> None:
    cache = vllm_config.cache_config
    if cache.num_gpu_blocks_override is None:
        out.unresolved.append(
            (
                "pool size",
                "vLLM sizes the KV-cache pool at startup from the serving GPU's memory "
                f"(--gpu-memory-utilization {cache.gpu_memory_utilization}, the weights)",
            )
        )
    if has_mamba:
        out.unresolved.append(
            (
                "prefill checkpoints",
                "MambaSpec.num_prefill_checkpoint_blocks and prefill_checkpoint_alignment "
                "are set by the model's Mamba layers and their kernels once built on the "
                "serving GPU",
            )
        )
    out.unresolved.append(
        (
            "model runner",
            "VLLM_USE_V2_MODEL_RUNNER: vLLM picks the v2 runner on a GPU with Triton",
        )
    )


# Settings kvgate's model does not cover: (name, read from the config, why).
def _unmodelled(out: Deployment, vllm_config: Any, transfer: Any) -> None:
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    checks: tuple[tuple[str, bool, str], ...] = (
        (
            "model",
            not _layer_kinds(vllm_config)[1],
            "vLLM serves this model without Mamba layers: kvgate models hybrid and Mamba models",
        ),
        (
            "decode_context_parallel_size",
            int(getattr(parallel, "decode_context_parallel_size", 1)) > 1,
            "attention blocks scaled across ranks",
        ),
        (
            "pipeline_parallel_size",
            int(getattr(parallel, "pipeline_parallel_size", 1)) > 1,
            "more batches in flight than async scheduling's two",
        ),
        (
            "kv_offloading_size",
            bool(getattr(cache, "kv_offloading_size", None)),
            "the CPU offloading tier",
        ),
        (
            "kv_sharing_fast_prefill",
            bool(getattr(cache, "kv_sharing_fast_prefill", False)),
            "cross-layer KV sharing",
        ),
        ("sliding_window", bool(getattr(cache, "sliding_window", None)), "sliding-window groups"),
        ("use_replayssm", bool(getattr(cache, "use_replayssm", False)), "ReplaySSM's checkpoints"),
        (
            "disable_hybrid_kv_cache_manager",
            bool(vllm_config.scheduler_config.disable_hybrid_kv_cache_manager),
            "one group per layer kind is what kvgate models",
        ),
        (
            "kv_connector",
            transfer is not None,
            "the connector's own transfers: kvgate models the Scheduler's side of a "
            "connector's answers, not this connector's implementation",
        ),
    )
    out.unmodelled.extend((name, why) for name, on, why in checks if on)
