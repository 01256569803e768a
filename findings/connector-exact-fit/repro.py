"""An admission with a KV connector's tokens at an exact fit stops the engine.

Standalone reproduction: needs only vLLM (CPU is enough; no model weights,
no worker). The Scheduler of a tiny Qwen3-Next-class hybrid (one attention
layer, one gated-delta-net layer) in Mamba "align" mode, prefix caching on,
with a KV connector defined below whose external store holds the first
64 tokens of N's 68-token prompt (loaded synchronously).

  1. F (120 tokens) runs and keeps its blocks: 16 in the pool, 1 free.
  2. N arrives. The Scheduler counts the blocks N needs
     (`get_num_blocks_to_allocate`) without the Mamba block that the
     connector's tokens' state takes first; the count equals the free blocks,
     so N is admitted, and its allocation needs one block more.

Expected: N waits for blocks (or is admitted with blocks that exist).
Actual (defect): `schedule()` raises `ValueError: Cannot get N free blocks
from the pool`; in an engine the exception ends the engine core.
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
CONNECTOR = "ReproExternalConnector"
NUM_BLOCKS = 16  # the KV-cache pool, in blocks
FILLER = 120  # F's prompt
NEW = 68  # N's prompt
# Requests whose first tokens the external store holds (loaded synchronously).
EXTERNAL = {"N": 64}


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


def connector_class() -> type:
    """A scheduler-side KV connector: the store holds EXTERNAL's prefixes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        SupportsHMA,
    )

    class ReproExternalConnector(KVConnectorBase_V1, SupportsHMA):
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            held = EXTERNAL.get(request.request_id, 0)
            return max(0, held - num_computed_tokens), False  # loaded synchronously

        def update_state_after_alloc(
            self, request: Any, blocks: Any, num_external_tokens: int
        ) -> None:
            pass

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

        def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
            return False, None

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            raise NotImplementedError("scheduler side only")

        def wait_for_layer_load(self, layer_name: str) -> None:
            raise NotImplementedError("scheduler side only")

        def save_kv_layer(
            self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
        ) -> None:
            raise NotImplementedError("scheduler side only")

        def wait_for_save(self) -> None:
            raise NotImplementedError("scheduler side only")

    return ReproExternalConnector


def __getattr__(name: str) -> Any:
    # vLLM's connector factory looks the class up in this module by name.
    if name == CONNECTOR:
        return connector_class()
    raise AttributeError(name)


def build_scheduler(model_dir: str) -> Any:
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
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
                max_num_batched_tokens=512,
                max_model_len=512,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector=CONNECTOR,
                kv_connector_module_path=__name__,
                kv_role="kv_both",
            ),
        )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    groups = [
        KVCacheGroupSpec(
            ["attention"],
            FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32),
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
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=32,
        hash_block_size=16,
    )


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
    hasher = get_request_block_hasher(16, sha256)
    pool = scheduler.kv_cache_manager.block_pool

    def request(name: str, first: int, length: int) -> Request:
        return Request(
            request_id=name,
            prompt_token_ids=list(range(first, first + length)),
            sampling_params=SamplingParams(max_tokens=64, ignore_eos=True),
            pooling_params=None,
            block_hasher=hasher,
        )

    def step(number: int) -> None:
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
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
            f"step {number} scheduled {dict(output.num_scheduled_tokens)}; "
            f"free blocks {pool.get_num_free_blocks()}"
        )

    scheduler.add_request(request("F", 1, FILLER))
    for number in range(1, 4):
        step(number)
    scheduler.add_request(request("N", 500, NEW))
    print("expected: N waits for blocks, or is admitted with blocks that exist")
    try:
        step(4)
    except ValueError as error:
        print(f"actual:   schedule() raised ValueError: {error}")
        return PRESENT
    print(f"actual:   N is {scheduler.requests['N'].status.name}")
    return ABSENT


if __name__ == "__main__":
    sys.exit(main())
