"""Under the priority policy, a victim dropped from the step keeps an
encoder-cache entry for an image that was never encoded.

Standalone reproduction: needs only vLLM (CPU is enough; no model weights,
no worker). The Scheduler of a tiny Qwen3-Next-class hybrid (one attention
layer, one gated-delta-net layer) in Mamba "align" mode, prefix caching on,
the priority policy, a 64-token step budget (32 per prefill chunk), and an
encoder budget and encoder cache of 64 embeddings, as a vision-language
hybrid's engine would size them. The Scheduler is built for a text model, so
the encoder cache is given that size after it is built.

  1. L (priority 1) sends 300 tokens with a 40-token image at 256 to 296.
  2. H (priority 0, more urgent) arrives and decodes beside L's chunks.
  3. L's chunk reaches the image: the Scheduler schedules it with the image
     (allocating the image's encoder-cache entry), then H's decode does not
     fit; the victim is L, already scheduled, so L's chunk and its image are
     dropped from the step and L is preempted. Nothing is encoded.
  4. H runs to its end; L runs again from its 256 cached tokens, and its
     chunks cover the image.

Expected: the image is encoded (scheduled as an encoder input) before, or in,
the step whose chunk covers it.
Actual (defect): the preemption left the entry in the encoder cache, so L's
chunk over the image schedules no encoder input; the image is never encoded,
and the worker is asked for an encoder output it never computed (in
production: a wrong output for L, or a failure in the model runner).
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
IMAGE_START, IMAGE_LENGTH, PROMPT = 256, 40, 300


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
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
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
                block_size=32, enable_prefix_caching=True, mamba_block_size=32
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=64,
                max_model_len=512,
                enable_chunked_prefill=True,
                long_prefill_token_threshold=32,
                is_encoder_decoder=False,
                policy="priority",
            ),
        )
    vllm_config.cache_config.num_gpu_blocks = 42
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
            ),
        ),
    ]
    kv_cache_config = KVCacheConfig(num_blocks=42, kv_cache_tensors=[], kv_cache_groups=groups)
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=32,
        hash_block_size=8,
    )
    # As a vision-language model's engine sizes them: 64 embeddings a step,
    # 64 in the encoder cache.
    scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=64)
    scheduler.max_num_encoder_input_tokens = 64
    return scheduler


def write_model(folder: str) -> None:
    """A tiny Qwen3-Next config.json (no weights)."""
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
    }
    with open(os.path.join(folder, "config.json"), "w") as out:
        json.dump(config, out)


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm
        from vllm.multimodal.inputs import (
            MultiModalFeatureSpec,
            MultiModalKwargsItem,
            PlaceholderRange,
        )
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.outputs import ModelRunnerOutput
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
    hasher = get_request_block_hasher(8, sha256)
    image = MultiModalFeatureSpec(
        data=MultiModalKwargsItem.dummy(),
        modality="image",
        identifier="image-l",
        mm_position=PlaceholderRange(offset=IMAGE_START, length=IMAGE_LENGTH),
        mm_hash="image-l",
    )

    def request(
        name: str, first: int, length: int, max_tokens: int, priority: int, **more: Any
    ) -> Request:
        return Request(
            request_id=name,
            prompt_token_ids=list(range(first, first + length)),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=hasher,
            priority=priority,
            **more,
        )

    encoded: list[str] = []  # images scheduled as encoder inputs, in order
    over_image: list[tuple[int, int, int]] = []  # (step, start, end) of L's chunks over the image

    def step(number: int) -> dict[str, int]:
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        for name, items in (output.scheduled_encoder_inputs or {}).items():
            encoded.extend(f"{name}'s item {i}" for i in items)
        if "L" in output.num_scheduled_tokens:
            # schedule() has advanced L's computed tokens past this chunk.
            end = scheduler.requests["L"].num_computed_tokens
            start = end - output.num_scheduled_tokens["L"]
            if start < IMAGE_START + IMAGE_LENGTH and end > IMAGE_START:
                over_image.append((number, start, end))
        scheduler.update_from_output(
            output,
            runner_output(
                ModelRunnerOutput,
                ids,
                [
                    [7]
                    if scheduler.requests[r].num_computed_tokens
                    >= scheduler.requests[r].num_prompt_tokens
                    else []
                    for r in ids
                ],
            ),
        )
        print(
            f"step {number} scheduled {dict(output.num_scheduled_tokens)}"
            + (
                f", preempted {sorted(output.preempted_req_ids)}"
                if output.preempted_req_ids
                else ""
            )
            + (
                f", encoded {list(output.scheduled_encoder_inputs)}"
                if output.scheduled_encoder_inputs
                else ""
            )
        )
        return dict(output.num_scheduled_tokens)

    scheduler.add_request(request("L", 1, PROMPT, 4, 1, mm_features=[image]))
    step(1)
    scheduler.add_request(request("H", 400, 12, 12, 0))
    number = 1
    while scheduler.has_unfinished_requests() and number < 40:
        number += 1
        step(number)
    print("expected: L's image is encoded by the step whose chunk covers it")
    chunks = ", ".join(f"step {n} ({a} to {b})" for n, a, b in over_image)
    print(
        f"actual:   L's chunks over the image ({IMAGE_START} to {IMAGE_START + IMAGE_LENGTH}): "
        f"{chunks}; "
        f"images encoded: {encoded or 'none'}"
    )
    return ABSENT if encoded else PRESENT


if __name__ == "__main__":
    sys.exit(main())
