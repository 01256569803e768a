"""Print the blocks vLLM's worker serves a hybrid model with, from its real layers.

Resolves the settings with vLLM's own `EngineArgs`, builds the model's real
layers on PyTorch's meta device (no weights, no memory, no compiled kernels),
and runs the platform's `update_block_size_for_backend` on them, as the
worker does once the model is loaded. The attention backend and the Mamba
layers' prefill checkpoint alignment are what those layers report on this
machine (CPU here). Each argument is one JSON object of `EngineArgs`
settings, the model (a local directory holding config.json) among them;
prints one JSON object for each.

Usage (VLLM_TARGET_DEVICE=cpu, vLLM importable):

    python scripts/worker_block_update.py '{"model": "DIR", "block_size": 64, ...}' ...
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def served(settings: dict[str, Any], distributed: list[bool]) -> dict[str, Any]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform

    config = EngineArgs(skip_tokenizer_init=True, **settings).create_engine_config()
    with set_current_vllm_config(config):
        if not distributed:
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
            distributed.append(True)
        model_cls, _ = ModelRegistry.resolve_model_cls(
            config.model_config.architecture, model_config=config.model_config
        )
        with torch.device("meta"):
            model_cls(vllm_config=config, prefix="")
    backends = [b.get_name() for b in current_platform._find_non_ssm_backends(config)]
    current_platform.update_block_size_for_backend(config)
    cache = config.cache_config
    return {
        "settings": settings,
        "attention_backends": backends,
        "block_size": cache.block_size,
        "mamba_block_size": cache.mamba_block_size,
        "prefix_match_unit": cache.prefix_match_unit,
        "mamba_page_size_padded": cache.mamba_page_size_padded,
    }


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    distributed: list[bool] = []
    for line in sys.argv[1:]:
        print(json.dumps(served(json.loads(line), distributed)), flush=True)


if __name__ == "__main__":
    main()
