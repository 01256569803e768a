"""kvgate: a conformance gate for vLLM's hybrid (attention + Mamba) KV-cache manager."""

# The package's version (pyproject.toml reads it from here).
__version__ = "0.1.0"
# The vLLM releases the gate was run on (scripts/vllm-matrix.sh's default
# releases); the package metadata's `vllm` extra states the same range.
CHECKED_VLLM: tuple[str, ...] = ("0.32.0", "0.33.0", "0.34.0")
