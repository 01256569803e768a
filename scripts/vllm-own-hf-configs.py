"""Write config-only Hugging Face cache entries for the models vLLM's own
core tests name, so those tests build their configs offline.

    python scripts/vllm-own-hf-configs.py HUB_CACHE_DIR

Each entry is one `config.json`, built from transformers' own config class for
that architecture (its defaults, with the published sizes where a class's
defaults describe another size). No weights and no tokenizer: the tests that
need either fail in the baseline run and are left out of every comparison.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A fixed revision: the cache needs one, and nothing here is downloaded.
REVISION = "0" * 40


def opt_125m() -> Any:
    from transformers import OPTConfig

    return OPTConfig(architectures=["OPTForCausalLM"])


def opt_350m() -> Any:
    from transformers import OPTConfig

    return OPTConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        ffn_dim=4096,
        num_attention_heads=16,
        word_embed_proj_dim=512,
        architectures=["OPTForCausalLM"],
    )


def llava() -> Any:
    from transformers import LlavaConfig

    return LlavaConfig(architectures=["LlavaForConditionalGeneration"])


def qwen25_vl() -> Any:
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(architectures=["Qwen2_5_VLForConditionalGeneration"])


def qwen3_next() -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"])


MODELS: dict[str, Callable[[], Any]] = {
    "facebook/opt-125m": opt_125m,
    "facebook/opt-350m": opt_350m,
    "llava-hf/llava-1.5-7b-hf": llava,
    "Qwen/Qwen2.5-VL-3B-Instruct": qwen25_vl,
    "Qwen/Qwen3-Next-80B-A3B-Instruct": qwen3_next,
}


def write(hub: Path) -> None:
    for repo, make in MODELS.items():
        entry = hub / ("models--" + repo.replace("/", "--"))
        snapshot = entry / "snapshots" / REVISION
        if (snapshot / "config.json").exists():
            continue
        snapshot.mkdir(parents=True, exist_ok=True)
        make().save_pretrained(snapshot)
        (entry / "refs").mkdir(exist_ok=True)
        (entry / "refs" / "main").write_text(REVISION)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: vllm-own-hf-configs.py HUB_CACHE_DIR")
    write(Path(sys.argv[1]))
