"""The executable model of vLLM's hybrid KV-cache manager (pure Python)."""

from kvgate.model.target import ModelTarget

__all__ = ["ModelTarget"]
