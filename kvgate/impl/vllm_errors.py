"""vLLM's refusals as kvgate's one-line errors.

vLLM rejects a config with a `ValueError`, or with a bare `assert` whose
message is empty; the gate reports either as one line naming the trace field
it concerns, found from the message by pattern.
"""

from __future__ import annotations

import os
import re
import traceback

__all__ = ["config_field", "describe"]


def describe(exc: BaseException) -> str:
    """One line: the exception, or for a bare assert the failing source line."""
    text = " ".join(str(exc).split())
    if not text:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            last = frames[-1]
            where = f"{os.path.basename(last.filename)}:{last.lineno}"
            text = f"at {where}: {' '.join((last.line or '').split())}"
    text = f"{type(exc).__name__} {text}".strip()
    return text if len(text) <= 240 else text[:237] + "..."


_FIELD_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"kv_cache_metrics_sample", "kv_cache_metrics_sample"),
    # A LoRA config vLLM will not build (the model's or the platform's say).
    (r"(?i)lora", "max_loras"),
    (r"mamba_cache_mode", "mamba_cache_mode"),
    (r"retention", "retention_interval"),
    (r"long_prefill_token_threshold", "long_prefill_token_threshold"),
    (r"shared_prefix", "shared_prefix_checkpoint"),
    (r"scheduler_block_size", "scheduler_block_size"),
    (r"hash_block_size|hash", "hash_unit"),
    (r"num_gpu_blocks|num_blocks", "num_blocks"),
    (r"max_model_len", "max_model_len"),
    (r"eagle|speculative", "eagle"),
)


def config_field(message: str) -> str:
    for pattern, name in _FIELD_PATTERNS:
        if re.search(pattern, message):
            return name
    return "groups"
