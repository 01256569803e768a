"""Print the block sizes a real vLLM engine gives its Scheduler for a hybrid model.

Runs a tiny Qwen3-Next (three Gated DeltaNet layers, one full-attention layer,
MoE feed-forward, dummy weights) offline on CPU with prefix caching in align
mode, and prints the KV-cache groups the workers reported, the cache config
the Scheduler was built with, and the chunks it scheduled for one long prompt.

Usage (with a vLLM CPU build installed in the interpreter running it):

    python scripts/served_block_sizes.py [--block-size N] [--mamba-block-size N]
        [--prefix-match-unit N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def write_model(directory: Path) -> None:
    # The same tiny model the served end-to-end test serves (eos: token 1).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from served_e2e import tiny_qwen3_next

    tiny_qwen3_next(eos_token_id=1).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--mamba-block-size", type=int, default=None)
    parser.add_argument("--prefix-match-unit", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import vllm
    from vllm import LLM, SamplingParams

    model = Path(tempfile.mkdtemp(prefix="tiny-qwen3-next-"))
    write_model(model)
    engine_args: dict[str, Any] = dict(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enable_prefix_caching=True,
        mamba_cache_mode="align",
        max_model_len=2048,
        max_num_seqs=4,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks_override=64,
        enforce_eager=True,
        seed=0,
    )
    if args.block_size is not None:
        engine_args["block_size"] = args.block_size
    if args.mamba_block_size is not None:
        engine_args["mamba_block_size"] = args.mamba_block_size
    if args.prefix_match_unit is not None:
        engine_args["prefix_match_unit"] = args.prefix_match_unit
    llm = LLM(**engine_args)
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    cache = scheduler.cache_config
    kv = scheduler.kv_cache_config
    groups = [
        {
            "spec": type(g.kv_cache_spec).__name__,
            "block_size": g.kv_cache_spec.block_size,
            "page_size_bytes": g.kv_cache_spec.page_size_bytes,
            "layers": list(g.layer_names),
        }
        for g in kv.kv_cache_groups
    ]
    chunks: list[int] = []
    schedule = scheduler.schedule

    def recording_schedule(*a: Any, **k: Any) -> Any:
        out = schedule(*a, **k)
        chunks.extend(out.num_scheduled_tokens.values())
        return out

    scheduler.schedule = recording_schedule
    prompt = [2 + (i * 7) % 500 for i in range(args.prompt_tokens)]
    llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=1, temperature=0.0),
        use_tqdm=False,
    )
    report = {
        "vllm": vllm.__version__,
        "asked": {
            "block_size": args.block_size,
            "mamba_block_size": args.mamba_block_size,
            "prefix_match_unit": args.prefix_match_unit,
        },
        "kv_cache_groups": groups,
        "kv_cache_config.hash_block_size": getattr(kv, "hash_block_size", None),
        "scheduler.cache_config.block_size (align split reads)": cache.block_size,
        "scheduler.cache_config.mamba_block_size": cache.mamba_block_size,
        "scheduler.cache_config.prefix_match_unit": cache.prefix_match_unit,
        "scheduler.cache_config.hash_block_size": cache.hash_block_size,
        "scheduler.block_size": scheduler.block_size,
        "scheduler.hash_block_size": getattr(scheduler, "hash_block_size", None),
        "prompt_tokens": args.prompt_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "scheduled_chunks": chunks,
    }
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
