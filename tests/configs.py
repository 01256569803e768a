"""The configs and trace headers several test files share.

The seed's first scenario, docs/trace-format.md's example: a 96-block pool,
hash unit 8, one full-attention group of 8-token blocks and one align-mode
Mamba group of 32-token blocks with 3 speculative blocks, eagle on. (Not
exploration's starting config, `kvgate.explore.knobs.SEED_CONFIG`, a
32-block pool.) Tests that need a variant derive it with
`dataclasses.replace`.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from typing import Any

import pytest

from kvgate.vocabulary.config import Config, GroupConfig

# The seed scenario as a `Config`, the hold on.
EXAMPLE_CONFIG = Config(
    num_blocks=96,
    hash_unit=8,
    groups=(
        GroupConfig("full_attention", 8),
        GroupConfig("mamba_align", 32, speculative_blocks=3),
    ),
    eagle=True,
    retention_interval=0,
    hold=True,
    scheduler_block_size=32,
)


def trace_config(
    num_blocks: int = 96, *, speculative_blocks: int = 3, hold: bool = False, extra: str = ""
) -> str:
    """The seed scenario as a trace's `config` block, with another pool size,
    speculative blocks or hold; `extra` adds config keys (indented lines)."""
    return (
        f"config:\n  num_blocks: {num_blocks}\n  hash_unit: 8\n  eagle: true\n"
        f"  retention_interval: 0\n  retain_checkpoint: {'true' if hold else 'false'}\n"
        f"{extra}  groups:\n    - {{kind: full_attention, block_size: 8}}\n"
        f"    - {{kind: mamba_align, block_size: 32, speculative_blocks: {speculative_blocks}}}\n"
    )


# The seed scenario as a trace's `config` block, the hold off.
EXAMPLE_TRACE_CONFIG = trace_config()


def trace_text(
    steps: str,
    config: str = EXAMPLE_TRACE_CONFIG,
    name: str = "t",
    head: str = "format: kvgate-trace/1\n",
) -> str:
    """A trace document: `head`, `name`, `config`, then the `steps` block."""
    return f"{head}name: {name}\n{config}steps:\n" + textwrap.indent(textwrap.dedent(steps), "  ")


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)

# A small two-group trace (64 blocks, hash unit 8, attention blocks of 8,
# Mamba blocks of 32) with one arrival, for tests of one config knob:
# `extra` adds config keys, `mamba` keys of the Mamba group.
SMALL_TRACE = """\
format: kvgate-trace/1
name: {name}
config:
  num_blocks: 64
  hash_unit: 8
  retention_interval: {retention}
{extra}  groups:
    - {{kind: full_attention, block_size: 8}}
    - {{kind: mamba_align, block_size: 32{mamba}}}
steps:
  - {{op: arrive, req: A, prompt: [{{fresh: 70}}]}}
"""


def small_trace(name: str, retention: str = "0", mamba: str = "", extra: str = "") -> str:
    """`SMALL_TRACE` with its blanks filled."""
    return SMALL_TRACE.format(name=name, retention=retention, mamba=mamba, extra=extra)


def hybrid_config(
    *groups: GroupConfig,
    num_blocks: int = 32,
    eagle: bool = False,
    retention_interval: int | None = 0,
    hold: bool = False,
    **fields: Any,
) -> Config:
    """A config over `groups`, the attention group first. Unless `fields`
    say otherwise, the hash unit is the attention block and the scheduler
    block the largest Mamba block (what vLLM derives for such a model)."""
    fields.setdefault("hash_unit", groups[0].block_size)
    fields.setdefault(
        "scheduler_block_size", max(g.block_size for g in groups if g.kind == "mamba_align")
    )
    return Config(
        num_blocks=num_blocks,
        groups=groups,
        eagle=eagle,
        retention_interval=retention_interval,
        hold=hold,
        **fields,
    )


# The head of a small scheduler-level trace (64 blocks, hash unit 8,
# attention blocks of 8, Mamba blocks of 32, no drafter, 4 sequences) up
# to its `engine:` line; the engine entries follow.
SMALL_SCHEDULER_TRACE_HEAD = """\
format: kvgate-trace/1
name: {name}
config:
  num_blocks: 64
  hash_unit: 8
  eagle: false
  retention_interval: 0
  max_model_len: 512
  groups:
    - {{kind: full_attention, block_size: 8}}
    - {{kind: mamba_align, block_size: 32}}
scheduler: {{spec: 0, max_num_seqs: 4}}
engine:
"""


# The block flags of the seed's kind of serve command line: prefix caching,
# attention blocks of 64, Mamba blocks of 256, prefixes matched every 64
# tokens; and its drafter, MTP proposing 3 drafts.
SEED_BLOCK_FLAGS = (
    "--enable-prefix-caching",
    "--block-size",
    "64",
    "--mamba-block-size",
    "256",
    "--prefix-match-unit",
    "64",
)
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
