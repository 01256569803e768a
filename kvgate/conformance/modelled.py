"""What kvgate does not model, in the one table the trace reader refuses by
and the docs' "not modelled" lists are generated from
(`tests/docs_reference.py`).

Two kinds:

- `SCHEDULER_LEVEL_ONLY`: config fields only a scheduler-level trace
  models (its engine steps); a manager-level trace that sets one is refused
  in one line naming the field, since its manager calls would be the same
  either way and the trace would claim what it does not check.
- `NOT_MODELLED`: vLLM settings no trace field stands for; every target
  runs with them off (a config kvgate cannot judge otherwise is refused by
  name when it is built: `config.NotModelled`).
"""

from __future__ import annotations

from typing import Any

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
        "trace that sets one is refused in one line naming it."
    )
