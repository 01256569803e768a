"""A prompt one token short of a Mamba block's end never finishes its prefill.

Standalone reproduction: needs only vLLM (CPU is enough; no model weights,
no worker). The Scheduler of a tiny Qwen3-Next-class hybrid (one attention
layer, one gated-delta-net layer) in Mamba "align" mode, prefix caching on,
with a 2-module MTP drafter: the prefix hashes read 2 tokens ahead.

  1. A sends 33 tokens and finishes (its 24-token prefix is now cached).
  2. B sends the same 33 tokens: it hits A's 24 cached tokens and computes 7,
     to token 31, leaving 2 prompt tokens for its last chunk.
  3. B's next chunk must end at the Mamba block's end (32), which would leave
     1 prompt token, fewer than the 2 the drafter reads, so the chunk is cut
     to nothing: B is passed over at every step and never finishes.

Expected: B's prefill completes within a few steps.
Exit codes: 10 the defect is present, 0 it is absent (fixed),
77 this vLLM cannot run the reproduction here (reason printed).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

PRESENT, ABSENT, CANNOT_RUN = 10, 0, 77
STEPS = 20  # steps B is given to finish once admitted


@contextlib.contextmanager
def triton_as_on_a_gpu() -> Iterator[None]:
    """Some vLLM releases refuse, while the engine config is built, an x86
    CPU without Triton, which only the model runner's kernels need. This
    reproduction runs the Scheduler alone (CPU bookkeeping, no kernel), so
    vLLM's record that Triton is importable (`HAS_TRITON`, wherever a module
    holds it) reads True while the config is built, as on a GPU host, and
    is put back after. A release without the record is left as it is."""
    import importlib

    flipped = []
    for name in ("vllm.triton_utils", "vllm.config.vllm"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "HAS_TRITON", None) is False:
            module.HAS_TRITON = True
            flipped.append(module)
    try:
        yield
    finally:
        for module in flipped:
            module.HAS_TRITON = False


def runner_output(output_class: Any, ids: list[str], sampled: list[list[int]]) -> Any:
    """The model runner's output for one step. Releases whose output names
    each request's row (`req_id_to_index`) get it; others take the rows in
    `req_ids` order alone."""
    rows: dict[str, Any] = {}
    if "req_id_to_index" in getattr(output_class, "__dataclass_fields__", {}):
        rows["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return output_class(req_ids=ids, sampled_token_ids=sampled, **rows)


def build_scheduler(model_dir: str) -> Any:
    import torch
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    # The model's config is read (and its architecture inspected) before
    # Triton is recorded present, so vLLM inspects it as this machine runs it.
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, max_model_len=512)
    with triton_as_on_a_gpu():
        vllm_config = VllmConfig(
            model_config=model,
            cache_config=CacheConfig(
                block_size=32,
                enable_prefix_caching=True,
                mamba_block_size=32,
                prefix_match_unit=8,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=8192,
                max_model_len=512,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            speculative_config=SpeculativeConfig(
                method="mtp",
                num_speculative_tokens=2,
                target_model_config=model,
                target_parallel_config=ParallelConfig(),
            ),
        )
    vllm_config.cache_config.num_gpu_blocks = 32
    groups = [
        KVCacheGroupSpec(
            ["attention"],
            FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=1, dtype=torch.float32),
        ),
        KVCacheGroupSpec(
            ["linear_attention"],
            MambaSpec(
                block_size=32,
                shapes=((1, 1),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
                num_speculative_blocks=3,
                num_prefill_checkpoint_blocks=1,
                prefill_checkpoint_alignment=1,
            ),
        ),
    ]
    kv_cache_config = KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=groups)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=32,
        hash_block_size=8,
    )


def write_model(folder: str) -> None:
    """A tiny Qwen3-Next config.json with 2 MTP modules (no weights)."""
    config = {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "max_position_embeddings": 4096,
        "num_nextn_predict_layers": 2,
    }
    with open(os.path.join(folder, "config.json"), "w") as out:
        json.dump(config, out)


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
        from vllm.v1.request import Request
    except Exception as error:  # noqa: BLE001 - any import failure means "cannot run here"
        print(f"could not run here: importing vLLM failed: {type(error).__name__}: {error}")
        return CANNOT_RUN
    print(f"vLLM {vllm.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        write_model(folder)
        try:
            scheduler = build_scheduler(folder)
        except Exception as error:  # noqa: BLE001
            print(
                "could not run here: building the Scheduler failed: "
                f"{type(error).__name__}: {error}"
            )
            return CANNOT_RUN
    init_none_hash(sha256)
    try:
        hasher = get_request_block_hasher(8, sha256, num_hash_lookahead_tokens=2)
    except TypeError as error:
        print(f"could not run here: this vLLM has no lookahead block hashes ({error})")
        return CANNOT_RUN
    prompt = list(range(1, 34))  # 33 tokens

    def request(name: str) -> Request:
        return Request(
            request_id=name,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
            pooling_params=None,
            block_hasher=hasher,
        )

    def step() -> dict[str, int]:
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        finished_prefill = [
            r for r in ids if scheduler.requests[r].num_computed_tokens >= len(prompt)
        ]
        scheduler.update_from_output(
            output,
            runner_output(
                ModelRunnerOutput,
                ids,
                [[7] if r in finished_prefill else [] for r in ids],
            ),
        )
        going_on = [r for r in ids if r in scheduler.requests]
        if going_on:
            scheduler.update_draft_token_ids(DraftTokenIds(going_on, [[0, 0] for _ in going_on]))
        return dict(output.num_scheduled_tokens)

    scheduler.add_request(request("A"))
    scheduler.add_request(request("B"))
    print(f"step 1 scheduled {step()}")  # A's whole prompt; B waits on A's states
    b = scheduler.requests["B"]
    for number in range(2, 2 + STEPS):
        scheduled = step()
        if number <= 4:
            print(f"step {number} scheduled {scheduled}; B has computed {b.num_computed_tokens}")
        if b.is_finished():
            break
    print(f"expected: B ({len(prompt)} prompt tokens) completes its prefill and finishes")
    if b.is_finished():
        print("actual:   B finished")
        return ABSENT
    print(
        f"actual:   after {STEPS} steps B is stuck at {b.num_computed_tokens} computed tokens, "
        "scheduled nothing at every step"
    )
    return PRESENT


if __name__ == "__main__":
    sys.exit(main())
