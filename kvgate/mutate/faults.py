"""The named faults of the campaign: realistic one-line bugs in vLLM's block manager.

Each fault is an exact one-line edit of one function of the installed vLLM
(`anchor` -> `replacement`, see `inject.py`), documented with what it
changes, why it is a bug someone could plausibly write (most are the
inverse of a comment or a guard standing right next to the line), and the
symptom to expect in production. Anchors are the only vLLM text kvgate
carries. Where a release only moved the line, a `Port` names the other
spelling; a build whose code holds neither reports that fault "not
applicable".

Areas: the block pool (free queue, hash map, ref counts), the Mamba align
paths (speculative blocks, state retirement, copy-on-write, same-step
deferral), the shared single-type manager (free and pop paths, admission
counts), the coordinator and `KVCacheManager` (fan-out, drain, admission,
lookup), and what a deployment reads besides scheduling (prefix-cache
reset, KV-cache events, the hit stats).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

_POOL = "vllm.v1.core.block_pool"
_SINGLE = "vllm.v1.core.single_type_kv_cache_manager"
_COORD = "vllm.v1.core.kv_cache_coordinator"
_MANAGER = "vllm.v1.core.kv_cache_manager"


@dataclass(frozen=True)
class Port:
    """The same fault where a release moved its line: another function or
    another spelling of it. Tried, in order, when the fault's own anchor is
    not in the installed code (a probe of the code, never of a version)."""

    module: str
    qualname: str
    anchor: str
    replacement: str
    where: str  # which code shape this port fits, for the campaign's listing


@dataclass(frozen=True)
class Fault:
    name: str
    area: str
    module: str
    qualname: str  # "Class.method" or "function", inside `module`
    anchor: str  # exact text, found once in the function's source, on one line
    replacement: str
    what: str
    why: str  # why it is realistic
    symptom: str  # what it does to a deployment
    ports: tuple[Port, ...] = ()
    # The strict view's exclusion (kvgate.conformance.snapshot.EXCLUSIONS)
    # under which this fault changes nothing a caller can observe: a gate
    # miss is then no miss, and the campaign lists it apart.
    equivalent_under: str = ""

    def sites(self) -> tuple[Port, ...]:
        """Where the fault may apply: its own anchor first, then its ports."""
        own = Port(self.module, self.qualname, self.anchor, self.replacement, "")
        return (own, *self.ports)


FAULTS: tuple[Fault, ...] = (
    # ---------------------------------------------------------------- block pool
    Fault(
        name="free-unhashed-to-tail",
        area="block pool",
        module=_POOL,
        qualname="BlockPool.free_blocks",
        anchor="blocks_to_evict_first.append(block)",
        replacement="blocks_to_evict_last.append(block)",
        what="free_blocks appends freed unhashed blocks to the free queue's tail",
        why="the two lists differ by one word; a refactor to 'FIFO for everything' does this",
        symptom="unhashed scratch blocks outlive cached ones in the queue, so the next "
        "allocation evicts cached prefixes first: hit rate drops, LIFO locality is lost",
    ),
    Fault(
        name="free-cached-to-head",
        area="block pool",
        module=_POOL,
        qualname="BlockPool.free_blocks",
        anchor="blocks_to_evict_last.append(block)",
        replacement="blocks_to_evict_first.append(block)",
        what="free_blocks prepends freed cached blocks to the free queue's head",
        why="the mirror image of the LIFO branch, one word apart",
        symptom="the freshest cached prefix is the first block evicted: a follow-up "
        "turn misses a prefix that was just finished",
    ),
    Fault(
        name="free-ref-off-by-one",
        area="block pool",
        module=_POOL,
        qualname="BlockPool.free_blocks",
        anchor="if block.ref_cnt == 0:",
        replacement="if block.ref_cnt <= 1:",
        ports=(
            Port(
                _POOL,
                "BlockPool.free_blocks",
                "if block.ref_cnt == 0 and not block.is_null:",
                "if block.ref_cnt <= 1 and not block.is_null:",
                "the null block tested inside the same condition",
            ),
        ),
        what="free_blocks tests the ref count as if before its decrement",
        why="a check moved below the decrement without adjusting the constant",
        symptom="a block two requests share is queued as free while one still uses it: "
        "it can be evicted and handed to a third request (freed while in use)",
    ),
    Fault(
        name="touch-keeps-free-queue",
        area="block pool",
        module=_POOL,
        qualname="BlockPool.touch",
        anchor="self.free_block_queue.remove(block)",
        replacement="pass",
        what="touch raises a cached block's ref count but leaves it in the free queue",
        why="the removal sits under a ref-0 guard that looks like an optimisation",
        symptom="a prefix hit stays evictable: the next allocation may hand the hit "
        "block to another request while the first one reads it; free counts over-report",
    ),
    Fault(
        name="reuse-keeps-hash",
        area="block pool",
        module=_POOL,
        qualname="BlockPool.get_new_blocks",
        anchor="self._maybe_evict_cached_block(block)",
        replacement="pass",
        ports=(
            Port(
                _POOL,
                "BlockPool.get_new_blocks",
                "if block.block_hash is not None:",
                "if block.block_hash is None:",
                "separate loops with and without a metrics collector: the one without",
            ),
        ),
        what="get_new_blocks reuses a cached block without evicting its hash",
        why="the eviction is a side call in a loop duplicated for the no-cache path",
        symptom="the hash map still points at a block now holding other tokens: a later "
        "lookup hits it and reads the wrong KV (silent wrong output)",
    ),
    Fault(
        name="evict-keeps-partial-keys",
        area="block pool",
        module=_POOL,
        qualname="BlockPool._remove_cached_block_hashes",
        anchor="self.cached_block_hashes_by_block.pop(block.block_id, ())",
        replacement="self.cached_block_hashes_by_block.get(block.block_id, ())",
        what="evicting a block reads its secondary (partial) keys with get instead of pop",
        why="get and pop take the same arguments here",
        symptom="an evicted block keeps a record of partial keys it no longer owns: a later "
        "CoW move onto it trips an assertion, and reset/eviction bookkeeping drifts",
    ),
    Fault(
        name="move-keeps-source-hash",
        area="block pool",
        module=_POOL,
        qualname="BlockPool.move_block_hashes",
        anchor="self._remove_cached_block_hashes(src_block)",
        replacement="filter(None, [src_block.block_hash])",
        what="move_block_hashes copies the source's key to the copy but leaves it on the source",
        why="'move' implemented as a copy: the removal is what the loop iterates over",
        symptom="a running request keeps writing into a block still keyed as a finished "
        "prefix state: a later hit may read the overwritten state",
    ),
    # ---------------------------------------------------------------- Mamba align
    Fault(
        name="mamba-spec-blocks-off-by-one",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.allocate_new_blocks",
        anchor="cdiv(num_tokens, self.block_size) + self.num_speculative_blocks",
        replacement="cdiv(num_tokens, self.block_size) + self.num_speculative_blocks - 1",
        what="Mamba allocation counts one speculative block too few",
        why="the running state block is easy to count as one of the speculative ones",
        symptom="the table is one block short of what admission reserved: state and "
        "draft blocks shift, a draft writes over the running state",
    ),
    Fault(
        name="mamba-pop-keeps-allocated",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.pop_blocks_for_free",
        anchor="self._allocated_block_reqs.discard(request_id)",
        replacement="pass",
        what="freeing a Mamba request leaves it marked as having allocated blocks",
        why="one of five parallel cleanups of per-request align state",
        symptom="a preempted request that comes back is treated as running: its first "
        "allocation relocates 'speculative' blocks that are hit states it shares",
    ),
    Fault(
        name="mamba-state-freed-early",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.remove_skipped_blocks",
        anchor="< cdiv(processed_computed_tokens, self.block_size) - 1",
        replacement="< cdiv(processed_computed_tokens, self.block_size)",
        what="remove_skipped_blocks frees the previous state block one step too early",
        why="the '- 1' looks like a stray off-by-one next to cdiv",
        symptom="the state the current step copies from is back in the free queue: "
        "a concurrent allocation can overwrite it mid-step",
    ),
    Fault(
        name="cow-forgets-extra-ref",
        area="mamba align",
        module=_SINGLE,
        qualname="SingleTypeKVCacheManager._apply_cow",
        anchor="cow_block.ref_cnt += 1",
        replacement="pass",
        what="a partial-hit CoW takes no extra ref on its destination block",
        why="the block is already in the request's table, so the extra ref looks redundant",
        symptom="draining the copy frees the request's own block: it sits in the free "
        "queue while in use and is handed to the next request (freed while in use)",
    ),
    Fault(
        name="running-cow-forgets-source-ref",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.allocate_new_blocks",
        anchor="source_block.ref_cnt += 1",
        replacement="pass",
        what="a running request's tail CoW takes no extra ref on the copy's source",
        why="the source stays in the request's table, so the ref looks redundant",
        symptom="the drain drops the request's own ref on its running state block: it is "
        "freed while the request still writes it",
    ),
    Fault(
        name="mamba-partial-hit-reserve-missing",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.get_num_blocks_to_allocate",
        anchor="num_new_blocks = max(num_new_blocks, 0) + 1",
        replacement="num_new_blocks = max(num_new_blocks, 0)",
        what="Mamba admission forgets the extra block a partial-hit CoW takes",
        why="the '+ 1' reads like an off-by-one; the CoW block is allocated elsewhere",
        symptom="admission under-counts by one: a request is admitted with the pool one "
        "block short and the allocation fails mid-step (over-admission)",
    ),
    Fault(
        name="same-step-deferral-removed",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.get_num_blocks_to_allocate",
        anchor="return self.block_pool.num_gpu_blocks + 1",
        replacement="pass",
        what="a hit on a Mamba state cached earlier in the same step is not deferred",
        why="returning 'pool size + 1' looks like a hack to remove",
        symptom="the request adopts a state the worker has not written yet this step: "
        "it resumes from garbage (silent wrong output)",
    ),
    Fault(
        name="relocate-keeps-old-slot",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager._relocate_speculative_block",
        anchor="req_blocks[block_idx] = self._null_block",
        replacement="pass",
        what="relocating a speculative block appends it but does not null its old slot",
        why="a move written as an append",
        symptom="the block sits twice in the table: freeing the request drops two refs "
        "for one, corrupting the count (negative refs, double queueing)",
    ),
    # ---------------------------------- Mamba align: prefill checkpoints, retention
    Fault(
        name="checkpoint-transient-keeps-keys",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager._cache_partial_tail_block",
        anchor="self.block_pool._maybe_evict_cached_block(checkpoint_block)",
        replacement="pass  # the transient checkpoint keeps its keys",
        what="a transient prefill checkpoint (neither the prompt's, retained, nor the "
        "junction) keeps the full-block key keyed on its column this step",
        why="the comment says the state is not reusable, and returning early looks "
        "like enough; the eviction of a key registered moments before is easy to drop",
        symptom="the column holds a mid-block state under a block-boundary key: a later "
        "request resumes from the wrong state (silently wrong output)",
    ),
    Fault(
        name="checkpoint-column-nulled",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.allocate_new_blocks",
        anchor="null_end = num_skipped_blocks - checkpoint_block",
        replacement="null_end = num_skipped_blocks",
        what="a checkpoint step nulls the checkpoint column like any skipped one",
        why="the null padding predates checkpoint blocks; the '- checkpoint_block' is "
        "the kind of term a merge drops",
        symptom="the exported checkpoint has no block: the prompt's reusable state is "
        "never keyed, and the next turn recomputes the whole prompt",
    ),
    Fault(
        name="checkpoint-block-not-counted",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.get_num_blocks_to_allocate",
        anchor="physical_block_cap = 1 + int(has_partial_hit) + checkpoint_block",
        replacement="physical_block_cap = 1 + int(has_partial_hit)",
        what="admission and the per-step estimate leave out the checkpoint block",
        why="the cap was written before checkpoint blocks; allocation counts the block "
        "itself, so the two drift apart unnoticed",
        symptom="a step admitted at the pool's edge cannot take its checkpoint block: "
        "the allocation fails after the scheduler committed to it",
    ),
    Fault(
        name="checkpoint-scratch-relocated",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.allocate_new_blocks",
        anchor="if block_idx < num_skipped_blocks - checkpoint_block:",
        replacement="if block_idx < num_skipped_blocks:",
        what="a running request's checkpoint step relocates the scratch block that "
        "should stay as the checkpoint column",
        why="the same bound as the null padding above it, without the checkpoint term",
        symptom="the checkpoint column is left null (or a block is asked for twice): "
        "the prompt's reusable state is lost after a resumed prefill",
    ),
    Fault(
        name="periodic-retention-off-by-one",
        area="mamba align",
        module=_SINGLE,
        qualname="MambaManager.reachable_block_mask",
        anchor="for i in range(first_boundary - start_block, len(mask), per_segment):",
        replacement="for i in range(first_boundary - start_block + 1, len(mask), per_segment):",
        what="periodic retention keeps the block after each interval's last one",
        why="block i ends at (i + 1) * block_size: the classic fencepost",
        symptom="siblings resume one block past the interval boundary's state, which "
        "is not kept: they miss the periodic checkpoint and recompute the prefix",
    ),
    # ------------------------------------------------------- single-type manager
    Fault(
        name="free-order-not-reversed",
        area="free path",
        module=_SINGLE,
        qualname="SingleTypeKVCacheManager.free",
        anchor="free_blocks(reversed(self.pop_blocks_for_free(request_id)))",
        replacement="free_blocks(self.pop_blocks_for_free(request_id))",
        what="free releases a request's blocks head first instead of tail first",
        why="the reversal is one wrapper call; the docstring promises it, tests rarely look",
        symptom="a finished prompt's first blocks are evicted before its tail: the "
        "shared prefix dies first and every later hit shrinks",
    ),
    Fault(
        name="pop-drops-null-trim",
        area="free path",
        module=_SINGLE,
        qualname="SingleTypeKVCacheManager.pop_blocks_for_free",
        anchor="return trim_null_head(req_blocks)",
        replacement="return req_blocks",
        what="pop_blocks_for_free returns the table with its leading null blocks",
        why="free_blocks skips null blocks anyway, so the trim looks unnecessary",
        symptom="deferred-free callers get null placeholders they must not free or "
        "count; a connector reading the list sees block 0 as the request's",
        # vLLM 0.32.0 returns exactly this list, and vLLM's only caller (the
        # scheduler's deferred free) hands it back to free_blocks, where a
        # null block is a no-op.
        equivalent_under="null-block-kept-aside",
    ),
    Fault(
        name="pop-keeps-partial-hit",
        area="free path",
        module=_SINGLE,
        qualname="SingleTypeKVCacheManager.pop_blocks_for_free",
        anchor="self._partial_hit_reqs.pop(request_id, None)",
        replacement="pass",
        what="freeing a request leaves its pending partial-hit CoW record behind",
        why="one of three parallel cleanups; the record is normally consumed at allocation",
        symptom="a preempted request that comes back replays a stale CoW redirect onto "
        "a block that is no longer its own",
    ),
    Fault(
        name="pop-keeps-cached-count",
        area="free path",
        module=_SINGLE,
        qualname="SingleTypeKVCacheManager.pop_blocks_for_free",
        anchor="self.num_cached_block.pop(request_id, None)",
        replacement="pass",
        what="freeing a request leaves its cached-block count behind",
        why="one of three parallel cleanups",
        symptom="a preempted request is treated as running on re-admission: its new "
        "prefix hit is refused by an assertion or its blocks are never re-keyed",
    ),
    Fault(
        name="hit-evictable-not-reserved",
        area="admission",
        module=_SINGLE,
        qualname="SingleTypeKVCacheManager.get_num_blocks_to_allocate",
        anchor="return num_new_blocks + num_evictable_blocks",
        replacement="return num_new_blocks",
        what="admission does not count hit blocks that sit in the free queue",
        why="hit blocks are 'already cached', so they look free of cost",
        symptom="touching the hits takes them out of the free queue after the check: a "
        "request is admitted with too few free blocks and allocation fails (over-admission)",
    ),
    Fault(
        name="attention-partial-hit-reserve-missing",
        area="admission",
        module=_SINGLE,
        qualname="SingleTypeKVCacheManager.get_num_blocks_to_allocate",
        anchor="num_new_blocks += 1",
        replacement="num_new_blocks += 0",
        what="attention admission forgets the extra block a partial-hit CoW takes",
        why="the CoW block is allocated in another method",
        symptom="admission under-counts by one on a sub-block hit (over-admission)",
    ),
    # ------------------------------------------------- coordinator and manager
    Fault(
        name="coordinator-free-skips-group",
        area="coordinator",
        module=_COORD,
        qualname="KVCacheCoordinator.free",
        anchor="for manager in self.single_type_managers:",
        replacement="for manager in self.single_type_managers[:-1]:",
        what="the coordinator's free skips the last KV-cache group",
        why="a slice left over from treating the last group as a draft/scratch group",
        symptom="every finished request leaks its last group's blocks (Mamba states): "
        "the pool drains until nothing is admitted",
    ),
    Fault(
        name="drain-releases-one-endpoint",
        area="manager",
        module=_MANAGER,
        qualname="KVCacheManager.take_kv_cache_block_copies",
        anchor="[block for pair in pending_copies for block in pair]",
        replacement="[pair[1] for pair in pending_copies]",
        what="the copy drain hands back only each copy's destination to release",
        why="only the destination looks 'retained' for the copy",
        symptom="each CoW leaks one ref on its source block: the block is never freed",
    ),
    Fault(
        name="admission-off-by-one",
        area="admission",
        module=_MANAGER,
        qualname="KVCacheManager.allocate_slots",
        anchor="if required_blocks > available_blocks:",
        replacement="if required_blocks > available_blocks + 1:",
        what="allocate_slots admits a request that needs one block more than is free",
        why="counting the null block as allocatable is a classic off-by-one",
        symptom="allocation raises mid-step instead of refusing, after the hits were "
        "already touched (the engine crashes, or leaks the touched hits)",
    ),
    Fault(
        name="lookup-hits-last-token",
        area="manager",
        module=_MANAGER,
        qualname="KVCacheManager.get_computed_blocks",
        anchor="max_cache_hit_length = request.num_tokens - 1",
        replacement="max_cache_hit_length = request.num_tokens",
        ports=(
            Port(
                "vllm.v1.request",
                "Request.get_max_cache_hit_length",
                "limits = (self.num_tokens - 1, self.prefix_cache_hit_limit, bound)",
                "limits = (self.num_tokens, self.prefix_cache_hit_limit, bound)",
                "the bound computed by the request (with its prefix-cache hit limit)",
            ),
        ),
        what="a lookup may hit the whole prompt, last token included",
        why="the '- 1' looks like an off-by-one; the comment that explains it is above",
        symptom="a fully cached prompt schedules no token to compute: no logits for "
        "the next token (or an allocation of zero tokens)",
    ),
    Fault(
        name="eagle-drop-skipped",
        area="coordinator",
        module=_COORD,
        qualname="HybridKVCacheCoordinator.find_longest_cache_hit",
        anchor="drop_eagle_block = use_eagle and idx not in eagle_verified",
        replacement="drop_eagle_block = use_eagle and idx in eagle_verified",
        what="the first lookup pass skips the EAGLE last-block drop",
        why="a dropped 'not'",
        symptom="the hit includes the block whose KV holds the next prefill token: the "
        "drafting head reads polluted state (wrong drafts, lower acceptance)",
    ),
    Fault(
        name="lookahead-hash-misses-next-token",
        area="block pool",
        module="vllm.v1.core.kv_cache_utils",
        qualname="get_request_block_hasher",
        anchor="extra_keys = (extra_keys, request.all_token_ids[end_token_idx])",
        replacement="extra_keys = (extra_keys, request.all_token_ids[end_token_idx - 1])",
        what="a lookahead block hash (L = 1) covers the block's own last token, not the next",
        why="an off-by-one: end_token_idx is exclusive, and 'the token at the block's end' "
        "reads as its last",
        symptom="a sibling that diverges right after a block boundary hits that block: the "
        "drafting head reads KV built with another request's next token (wrong drafts, "
        "lower acceptance), the pollution lookahead hashes exist to prevent",
    ),
    # ------------------------------------------- reset, events, hit stats
    Fault(
        name="reset-while-in-use",
        area="reset",
        module=_POOL,
        qualname="BlockPool.reset_prefix_cache",
        anchor="if num_used_blocks != 1:",
        replacement="if num_used_blocks < 1:",
        what="reset_prefix_cache proceeds while blocks are still in use",
        why="'the null block is always used' read as 'at least one block is used'",
        symptom="a reset under load forgets the keys of running requests' blocks; "
        "requests in flight lose their cached prefix and the caller is told it worked",
    ),
    Fault(
        name="reset-stats-unflagged",
        area="hit stats",
        module=_MANAGER,
        qualname="KVCacheManager.reset_prefix_cache",
        anchor="self.prefix_cache_stats.reset = True",
        replacement="self.prefix_cache_stats.reset = False",
        what="a successful reset does not flag the hit stats",
        why="the flag's default restated instead of set",
        symptom="the hit-rate metric never restarts at a reset: dashboards average the "
        "old weights' hits into the new ones",
    ),
    Fault(
        name="reset-no-cleared-event",
        area="events",
        module=_POOL,
        qualname="BlockPool.reset_prefix_cache",
        anchor="if self.enable_kv_cache_events:",
        replacement="if not self.enable_kv_cache_events:",
        what="a reset queues no AllBlocksCleared event when events are on",
        why="a flipped guard",
        symptom="a cache-aware router keeps routing to prefixes this replica forgot",
    ),
    Fault(
        name="stored-event-wrong-parent",
        area="events",
        module=_POOL,
        qualname="BlockPool.cache_full_blocks",
        anchor="block_hashes[num_cached_blocks - 1]",
        replacement="block_hashes[num_cached_blocks]",
        what="a BlockStored event names the first new block as its own parent",
        why="the classic off-by-one of 'the block before the new ones'",
        symptom="an event consumer cannot chain a chunked prefill's blocks: its prefix "
        "tree breaks at every chunk boundary",
    ),
    Fault(
        name="stored-event-whole-prefix",
        area="events",
        module=_POOL,
        qualname="BlockPool.cache_full_blocks",
        anchor="start_token_idx = num_cached_blocks * block_size",
        replacement="start_token_idx = 0",
        what="a BlockStored event carries the tokens from the prompt's start",
        why="the token range copied from the first-chunk case",
        symptom="events carry tokens of blocks stored earlier: a consumer keying on "
        "tokens mislabels every later chunk",
    ),
    Fault(
        name="eviction-no-removed-event",
        area="events",
        module=_POOL,
        qualname="BlockPool._emit_block_removed_events",
        anchor="if not self.enable_kv_cache_events:",
        replacement="if self.enable_kv_cache_events:",
        what="evicting a cached block queues no BlockRemoved event when events are on",
        why="a flipped guard",
        symptom="a router believes evicted prefixes are still cached here and routes "
        "requests to a replica that misses them",
    ),
    Fault(
        name="events-not-cleared-on-take",
        area="events",
        module=_POOL,
        qualname="BlockPool.take_events",
        anchor="self.kv_event_queue = []",
        replacement="self.kv_event_queue = events",
        what="taking the events leaves them queued",
        why="the swap written as keeping the same list",
        symptom="every event is published again at each step, and the queue grows without bound",
    ),
    Fault(
        name="hit-report-mode-inverted",
        area="events",
        module=_MANAGER,
        qualname="KVCacheManager.get_computed_blocks",
        anchor='and getattr(request, "kv_cache_report_mode", "incremental") == "full"',
        replacement='and getattr(request, "kv_cache_report_mode", "incremental") != "full"',
        what="lookups report their hit as BlockStored events for every request but "
        "those that asked for it",
        why="a flipped comparison",
        symptom="incremental consumers see every reused prefix re-announced as newly "
        "stored; a late-joining consumer never learns the prefixes it asked for",
    ),
    Fault(
        name="stats-preempted-as-new",
        area="hit stats",
        module=_MANAGER,
        qualname="KVCacheManager.record_prefix_cache_stats",
        anchor="preempted=request.num_preemptions > 0,",
        replacement="preempted=request.num_preemptions > 1,",
        what="a request admitted again after its first preemption counts as new",
        why="an off-by-one on the preemption count",
        symptom="a re-admitted request's replayed output inflates the new-request hit "
        "rate: the metric reports hits that are recomputation savings",
    ),
    Fault(
        name="stats-queries-prompt-only",
        area="hit stats",
        module=_MANAGER,
        qualname="KVCacheManager.record_prefix_cache_stats",
        anchor="num_tokens=request.num_tokens,",
        replacement="num_tokens=request.num_prompt_tokens,",
        what="queries count only the prompt, not the output a resumed request replays",
        why="'the tokens queried' read as 'the prompt'",
        symptom="the preempted hit rate exceeds what was queried (it can pass 100 %)",
    ),
    Fault(
        name="stats-never-restart",
        area="hit stats",
        module=_MANAGER,
        qualname="KVCacheManager.make_prefix_cache_stats",
        anchor="self.prefix_cache_stats = PrefixCacheStats()",
        replacement="self.prefix_cache_stats = stats",
        what="taking the stats does not start a new interval",
        why="the hand-off kept the same object",
        symptom="each logging interval counts every earlier one again: the hit "
        "counters grow quadratically",
    ),
    # ------------------------------------------ what the scheduler reads back
    Fault(
        name="admission-gate-chunk-only",
        area="sched reads",
        module=_MANAGER,
        qualname="KVCacheManager.allocate_slots",
        anchor="full_num_tokens = min(request.num_tokens, self.max_model_len)",
        replacement="full_num_tokens = min("
        "total_computed_tokens + num_new_tokens, self.max_model_len)",
        what="the full-sequence admission gate counts only this chunk's tokens",
        why="'the tokens the request needs now' read for 'the whole sequence'",
        symptom="with scheduler_reserve_full_isl (the default) requests are admitted "
        "whose prompt cannot fit: they are preempted mid-prefill and thrash",
    ),
    Fault(
        name="offload-boundary-from-call",
        area="sched reads",
        module=_SINGLE,
        qualname="MambaManager.cache_blocks",
        anchor="block.block_hash_num_tokens,",
        replacement="num_tokens,",
        what="a boundary-state hand-off names the tokens cached so far, not the "
        "state's own boundary",
        why="the call's `num_tokens` is in scope and reads like the boundary",
        symptom="a connector offloads a Mamba state under the wrong prefix length: a "
        "later hit on it resumes from a state of another position",
    ),
    Fault(
        name="zeroing-guard-inverted",
        area="sched reads",
        module=_SINGLE,
        qualname="SingleTypeKVCacheManager.allocate_new_blocks",
        anchor="if self._record_new_block_ids:",
        replacement="if not self._record_new_block_ids:",
        what="new attention blocks are not listed for zeroing (a hybrid model's are "
        "exactly the ones that need it)",
        why="a flipped guard",
        symptom="the worker reads a reused block's stale bytes (a Mamba page's state "
        "reinterpreted as KV): NaN/Inf in attention",
    ),
    Fault(
        name="cached-tokens-longest-group",
        area="sched reads",
        module=_MANAGER,
        qualname="KVCacheManager.estimate_cached_tokens",
        anchor="else min(cached_tokens, group_cached_tokens)",
        replacement="else max(cached_tokens, group_cached_tokens)",
        what="a finished prefill's cached tokens take the group that cached the most",
        why="min and max swapped",
        symptom="prefill stats report attention's cached prefix although Mamba has no "
        "state there: the cache looks to save work it does not",
    ),
    # ------------------------------------ a single group; prefix caching off
    Fault(
        name="unitary-lookup-ignores-cap",
        area="coordinator",
        module=_COORD,
        qualname="UnitaryKVCacheCoordinator.find_longest_cache_hit",
        anchor="max_length=max_cache_hit_length,",
        replacement="max_length=len(block_hashes) * self.block_size,",
        what="the single-group lookup (a pure Mamba model) matches every hashed block, "
        "ignoring the caller's cap of the prompt minus its last token",
        why="the single-group path is a thin wrapper; deriving the bound from the "
        "hashes it is handed looks equivalent",
        symptom="a resend of a block-aligned prompt hits all of it: no token is left "
        "to compute for the logits (the scheduler schedules 0 tokens or fails)",
    ),
    Fault(
        name="no-caching-lookup-enabled",
        area="hit stats",
        module=_MANAGER,
        qualname="KVCacheManager.prefix_cache_lookup_enabled",
        anchor="return self.enable_caching and not request.skip_reading_prefix_cache",
        replacement="return not request.skip_reading_prefix_cache",
        what="with prefix caching off, every request still counts as a prefix-cache lookup",
        why="the per-request skip flag reads as the whole condition; the global switch is dropped",
        symptom="a deployment with --no-enable-prefix-caching reports a 0 % hit rate "
        "over every prompt token instead of no lookups",
    ),
)

BY_NAME: dict[str, Fault] = {f.name: f for f in FAULTS}


def select(names: Iterable[str] | None) -> list[Fault]:
    """The named faults, in table order; every fault when `names` is None."""
    if names is None:
        return list(FAULTS)
    wanted = list(dict.fromkeys(names))
    unknown = [n for n in wanted if n not in BY_NAME]
    if unknown:
        raise KeyError(f"unknown fault(s): {', '.join(unknown)} (see `kvgate mutate --list`)")
    return [f for f in FAULTS if f.name in wanted]
