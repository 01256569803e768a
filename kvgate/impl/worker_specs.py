"""The KV-cache specs a real vLLM worker reports for kvgate's hybrid model.

In align mode (prefix caching on), vLLM's worker sizes the attention block
first (raised until an attention page holds a Mamba state) and then sets the
Mamba block to it, overriding a `--mamba-block-size` the user passed; the
prefix-match unit alone may be finer. Its full-attention and Mamba layers
then report one block size, which the engine core hands its Scheduler as
`cache_config.block_size`. A config whose groups differ there is one no
worker reports, so an engine built from it is no production engine.
"""

from __future__ import annotations

from kvgate.vocabulary.config import Config, UnsupportedConfig


def check_worker_blocks(config: Config) -> None:
    """Refuse, naming `groups`, an align-mode hybrid whose attention and
    Mamba groups do not share one block size."""
    if config.mamba_cache_mode != "align" or not config.has_attention:
        return
    sizes = sorted({g.block_size for g in config.groups})
    if len(sizes) > 1:
        raise UnsupportedConfig(
            "groups",
            f"block sizes {sizes}: in align mode vLLM's worker reports its attention "
            "and Mamba layers at one block size (the Mamba block is set to the "
            "attention block; only the hash unit may be finer)",
        )
