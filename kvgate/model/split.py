"""The scheduler's align-mode chunk split: where a prefill chunk must end.

Mamba states are written at chunk ends, so a chunk ends on a block boundary
(except the prompt's last chunk), never runs past the last cacheable block
boundary, with sub-block hits stops at the prompt's partial-tail boundary so
that state is computed and keyed, and stops at the request's shared-prefix
junction (block-floored from the chunk's start; exact with the shared-prefix
checkpoint) so a sibling can resume there. When every Mamba group has a
prefill checkpoint block and the backend can export the prompt's checkpoint
from inside the final chunk, that chunk needs neither the block nor the
tail stop.
"""

from __future__ import annotations

from kvgate.model.mamba import checkpoint_position, prefill_checkpoint_valid
from kvgate.model.request import Request
from kvgate.vocabulary.config import Config


def chunk_tokens(config: Config, request: Request, num_new: int, num_new_hit: int) -> int:
    """How many of `num_new` tokens (starting after the hit) this chunk runs."""
    if not config.mamba_align_split:
        return num_new
    start = request.num_computed_tokens + num_new_hit
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    if start >= prefill_end:
        return num_new
    block = config.scheduler_block_size
    unit = config.hash_unit
    eagle = config.block_drop
    lookahead = config.hash_lookahead_tokens
    partial_hits = config.partial_hits and unit < block
    last_cacheable = checkpoint_position(request.num_tokens, block, eagle, lookahead)
    end = start + num_new
    checkpoint = checkpoint_position(prefill_end, unit if partial_hits else block, eagle, lookahead)
    internal_checkpoint = (
        config.prefill_checkpoints
        and end >= prefill_end
        and prefill_checkpoint_valid(
            start, end, checkpoint, unit, block, config.prefill_checkpoint_alignment
        )
    )
    if internal_checkpoint:
        last_cacheable = 0
    if end < prefill_end:
        # A block wider than any chunk may be advanced sub-block.
        widest = config.max_num_scheduled_tokens
        if config.long_prefill_token_threshold > 0:
            widest = min(widest, config.long_prefill_token_threshold)
        aligned = end // block * block
        if aligned > start or block <= widest:
            end = aligned
    tail = (
        checkpoint_position(request.num_prompt_tokens, unit, eagle, lookahead)
        if partial_hits and not internal_checkpoint
        else 0
    )
    junction = request.shared_prefix_boundary
    # Whole blocks from the start: a sub-block junction's state is not kept
    # apart, unless the shared-prefix checkpoint keys it (within the prompt).
    junction_stop = (
        junction
        if config.shared_prefix_checkpoint_on and junction <= request.num_prompt_tokens
        else start + (junction - start) // block * block
    )
    stops = (
        (start // block + 1) * block if start % block and not internal_checkpoint else 0,
        last_cacheable,
        tail if last_cacheable < tail < request.num_prompt_tokens else 0,
        junction_stop if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)
