"""The blocks vLLM's worker serves a hybrid model with, computed on CPU.

Once the model is loaded, vLLM's worker runs its platform's
`update_block_size_for_backend`: the attention block is raised until one
attention page holds a Mamba state page (in multiples of the attention
backend's kernel block), and in align mode the Mamba block is set to the
attention block, overriding `--mamba-block-size`; the prefix-match unit
alone stays finer. That function reads two things only a built model has:
the attention backend of its attention layers, and the prefill checkpoint
alignment its Mamba layers' kernels declare. Everything else it reads (the
Mamba state's shapes and dtypes, the attention page a token takes) comes
from the model's config. So kvgate runs vLLM's own function on a copy of
the resolved config, with the backend taken from `--attention-backend` or
assumed (FlashAttention on a CUDA GPU unless the operator names another),
and the checkpoint alignment assumed (none, unless the operator gives one).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvgate.errors import InputError
from kvgate.impl.vllm_errors import describe

__all__ = ["ASSUMED_BACKEND", "ServedBlocks", "served_blocks"]

# The backend vLLM usually picks for a hybrid's attention layers on a CUDA
# GPU; its kernels take any multiple of 16 tokens, as FlashInfer's smallest
# kernel block is 16 (FlashInfer itself is not importable without a GPU build).
ASSUMED_BACKEND = "FLASH_ATTN"
# vLLM's CPU attention backend: the worker of a CPU build (the served CPU
# probe) runs the CPU platform's own update.
CPU_BACKEND = "CPU_ATTN"


@dataclass(frozen=True)
class ServedBlocks:
    """The worker's block update for one resolved config, and what it read."""

    attention_block: int
    mamba_block: int
    configured_attention_block: int
    configured_mamba_block: int
    mamba_page_bytes: int
    attention_page_bytes_per_token: int
    # The Mamba page padded to the attention page (None: equal already).
    mamba_page_padded: int | None
    backend: str
    backend_source: str
    kernel_block: int
    checkpoint_alignment: int | None
    checkpoint_source: str

    def describe(self) -> str:
        """Where the served blocks came from, in one sentence."""
        checkpoint = (
            "no prefill checkpoint alignment"
            if self.checkpoint_alignment is None
            else f"prefill checkpoints aligned to {self.checkpoint_alignment} tokens"
        )
        return (
            "the worker's update once the model is loaded (Platform."
            "update_block_size_for_backend, run by kvgate on CPU): a Mamba state page "
            f"of {self.mamba_page_bytes} bytes (the Mamba layers' state shapes and dtypes), "
            f"{self.attention_page_bytes_per_token} bytes of attention page a token, "
            f"{self.backend}'s kernel block {self.kernel_block} (the attention backend above), "
            f"{checkpoint} ({self.checkpoint_source})"
        )


def _backend_class(name: str, source: str) -> Any:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        return AttentionBackendEnum[name].get_class()
    except KeyError:
        known = ", ".join(member.name for member in AttentionBackendEnum)
        raise InputError(
            f"attention backend {name!r} ({source}): not one of vLLM's ({known})"
        ) from None
    except Exception as error:  # noqa: BLE001 (its kernels' import, on this machine)
        raise InputError(
            f"attention backend {name} ({source}): its class cannot be imported on this "
            f"machine ({describe(error)}); pass kvgate's --assume-attention-backend with one "
            f"that has the same kernel block sizes ({ASSUMED_BACKEND}: any multiple of 16)"
        ) from None


def _platform(backend_name: str, backend: Any) -> Any:
    """The platform class whose update the serving worker runs, finding
    `backend` as its attention layers' (no layer is built here)."""
    from vllm.platforms.interface import Platform

    base: Any = Platform
    if backend_name == CPU_BACKEND:
        from vllm.platforms.cpu import CpuPlatform

        base = CpuPlatform

    class ServingPlatform(base):  # type: ignore[misc]
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config: Any) -> list[Any]:
            return [backend]

    return ServingPlatform


@contextlib.contextmanager
def _checkpoint_alignment(alignment: int | None) -> Iterator[None]:
    """The Mamba layers' prefill checkpoint alignment as the built layers
    would declare it, while vLLM's update reads it."""
    from vllm.model_executor.layers.mamba import abstract

    original = abstract.get_mamba_prefill_checkpoint_alignment

    def declared(vllm_config: Any) -> int | None:
        return alignment

    abstract.get_mamba_prefill_checkpoint_alignment = declared
    try:
        yield
    finally:
        abstract.get_mamba_prefill_checkpoint_alignment = original


def _pages(vllm_config: Any, backend: Any) -> tuple[int, int]:
    """(Mamba state page bytes, attention page bytes a token), as vLLM's
    update computes them, for the report."""
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.models import ModelRegistry
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    dtype = (
        model.dtype if cache.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    )
    attention = FullAttentionSpec(
        block_size=1,
        num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
        head_size=model.get_head_size(),
        dtype=dtype,
    )
    with set_current_vllm_config(vllm_config):
        per_token = int(backend.customize_spec(attention).page_size_bytes)
    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    if hasattr(model_cls, "get_mamba_specs_from_config"):
        page = max(s.page_size_bytes for s in model_cls.get_mamba_specs_from_config(vllm_config))
    else:
        page = MambaSpec(
            shapes=model_cls.get_mamba_state_shape_from_config(vllm_config),
            dtypes=model_cls.get_mamba_state_dtype_from_config(vllm_config),
            block_size=-1,
        ).page_size_bytes
    return int(page), per_token


def _kernel_block(vllm_config: Any, backend: Any) -> int:
    from vllm.config.vllm import set_current_vllm_config
    from vllm.v1.attention.backend import MultipleOf

    with set_current_vllm_config(vllm_config):
        sizes = backend.get_supported_kernel_block_sizes()
    return min(s.base if isinstance(s, MultipleOf) else int(s) for s in sizes)


def served_blocks(
    vllm_config: Any,
    assumed_backend: str | None = None,
    checkpoint_alignment: int | None = None,
    cpu_ssm_dtype: str | None = None,
) -> ServedBlocks:
    """The attention and Mamba blocks the serving worker runs a hybrid
    model's resolved `vllm_config` with. The backend is the command line's
    `--attention-backend`, else `assumed_backend`, else FlashAttention on a
    CUDA GPU; `checkpoint_alignment` is the Mamba layers' (None: none);
    `cpu_ssm_dtype` the SSM state dtype vLLM's CPU platform sets, which a
    worker on the CPU backend stores its states in."""
    chosen = vllm_config.attention_config.backend
    if chosen is not None:
        name, source = str(chosen.name), "--attention-backend"
    elif assumed_backend is not None:
        name = assumed_backend.upper()
        source = "kvgate's --assume-attention-backend (what the serving machine runs)"
    else:
        name = ASSUMED_BACKEND
        source = (
            "kvgate's assumption: FlashAttention, as on a CUDA GPU "
            "(--assume-attention-backend names another)"
        )
    checkpoint_source = (
        "kvgate's --assume-checkpoint-alignment (what the serving model's kernels declare)"
        if checkpoint_alignment is not None
        else "kvgate's assumption: the Mamba layers' prefill kernels declare none, as Triton "
        "GDN and Mamba2 kernels do (GDN on FlashInfer declares 64: "
        "--assume-checkpoint-alignment)"
    )
    backend = _backend_class(name, source)
    cache = vllm_config.cache_config
    # vLLM's update edits the cache config in place: it runs on a copy.
    served = copy.copy(vllm_config)
    served.cache_config = copy.copy(cache)
    if name == CPU_BACKEND and cpu_ssm_dtype is not None:
        served.cache_config.mamba_ssm_cache_dtype = cpu_ssm_dtype
    try:
        with _checkpoint_alignment(checkpoint_alignment):
            _platform(name, backend).update_block_size_for_backend(served)
        mamba_page, per_token = _pages(served, backend)
        kernel = _kernel_block(vllm_config, backend)
    except InputError:
        raise
    except Exception as error:  # vLLM's refusal of the served blocks, in one line
        raise InputError(
            f"serve command line: vLLM's worker would refuse its blocks with {name}: "
            f"{describe(error)}"
        ) from None
    out = served.cache_config
    return ServedBlocks(
        attention_block=int(out.block_size),
        mamba_block=int(out.mamba_block_size or out.block_size),
        configured_attention_block=int(cache.block_size),
        configured_mamba_block=int(cache.mamba_block_size or cache.block_size),
        mamba_page_bytes=mamba_page,
        attention_page_bytes_per_token=per_token,
        mamba_page_padded=out.mamba_page_size_padded,
        backend=name,
        backend_source=source,
        kernel_block=kernel,
        checkpoint_alignment=checkpoint_alignment,
        checkpoint_source=checkpoint_source,
    )
