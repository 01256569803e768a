"""The manager as the scheduler calls it: lookup, admission counts,
allocation, the free paths and the copy hand-off.

Method names follow the real `KVCacheManager` so the op driver
(`kvgate.driver.op_driver`) drives both the same way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from kvgate.model.coordinator import Coordinator, HitBlocks
from kvgate.model.pool import Block, stored_event
from kvgate.model.request import Request
from kvgate.model.scope import validate
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.events import KvEvent
from kvgate.vocabulary.target import StepRefused


@dataclass
class PrefixCacheStats:
    """What a user's hit-rate metric reads: lookups counted at admission, a
    request admitted again after a preemption counted apart."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    def __init__(self, config: Config) -> None:
        validate(config)
        self.config = config
        self.coordinator = Coordinator(config)
        self.block_pool = self.coordinator.pool
        self.prefix_cache_stats = PrefixCacheStats()
        # Admissions with a KV connector's tokens the model left waiting
        # because their state block did not fit (`_external_admission_fits`),
        # where vLLM 0.33.0 raises instead: exploration tells that defect
        # apart by it.
        self.external_admissions_refused = 0

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.config.disable_log_stats or not self.lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            request.num_tokens, num_hits, preempted=request.num_preemptions > 0
        )

    def lookup_enabled(self, request: Request) -> bool:
        """The request reads the prefix cache: caching on, and not skipped."""
        return self.config.prefix_caching and not request.skip_reading_prefix_cache

    def make_prefix_cache_stats(self) -> dict[str, int | bool]:
        """The stats since the last call, as the `stats` op reports them; reset.
        Nothing when stats are not logged."""
        if self.config.disable_log_stats:
            return {}
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        # Its fields are plain numbers: `asdict`'s deep copy, every engine
        # step, would only cost.
        return dict(vars(stats))

    @property
    def usage(self) -> float:
        """The used fraction of the pool, the null block left out."""
        total = self.block_pool.num_blocks - 1
        if not total:
            return 0
        return 1.0 - (self.block_pool.num_free() / total)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached state; refused while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def get_computed_blocks(self, request: Request) -> tuple[HitBlocks | None, int, int]:
        """The agreed prefix hit (None for blocks when no group has any), and
        the shared-prefix junction (0: the groups agree).

        At most `num_tokens - 1` tokens hit: the last one is recomputed for
        its logits. The caller stores the junction on the request. A request
        that skips reading the cache finds nothing.
        """
        if not self.lookup_enabled(request):
            return None, 0, 0
        blocks, hit, junction = self.coordinator.find_hit(request.keys, request.num_tokens - 1)
        if hit > 0 and self.config.kv_events_full:
            self._report_hit(request, blocks)
        return (blocks if any(blocks) else None), hit, junction

    def get_computed_blocks_for_connector(
        self, request: Request
    ) -> tuple[HitBlocks | None, int, int, bool]:
        """The local lookup a KV connector that takes divergent hybrid hits
        reads: attention's own hit as the local prefix (the connector brings
        the rest, Mamba's state included), and whether a group lagged below
        it. No junction. Only a hybrid with caching looks up per group; a
        lagging group that hit past attention, or any other model, gets the
        agreed hit."""
        if not (self.config.has_attention and self.config.prefix_caching):
            return (*self.get_computed_blocks(request), False)
        if not self.lookup_enabled(request):
            return None, 0, 0, False
        blocks, hits = self.coordinator.find_hit_per_group(request.keys, request.num_tokens - 1)
        attention = next(i for i, g in enumerate(self.config.groups) if g.kind == "full_attention")
        if any(hit > hits[attention] for hit in hits):
            return (*self.get_computed_blocks(request), False)
        num_local = hits[attention]
        return (blocks if any(blocks) else None), num_local, 0, min(hits) < num_local

    def truncate_computed_blocks(
        self, blocks: HitBlocks | None, num_computed_tokens: int
    ) -> HitBlocks | None:
        """A lookup's blocks cut at an aligned length; nothing else changes."""
        if blocks is None:
            return None
        truncated = self.coordinator.truncate_hit(blocks, num_computed_tokens)
        return truncated if any(truncated) else None

    def _report_hit(self, request: Request, blocks: HitBlocks) -> None:
        """With `kv_cache_report_mode: full`, a hit is reported as one
        BlockStored per group that hit: the prefix its blocks cover, from 0.

        A Mamba sub-block hit's list ends with its copy source's whole block,
        whose key the request may not have yet (its tokens stop inside that
        block): vLLM 0.33.0 then raises IndexError reading that key, so the
        lookup is refused by name, before anything changed."""
        events = self.block_pool.events
        if events is None:
            return
        unit = self.config.hash_unit
        reported: list[KvEvent] = []
        for group_id, group_blocks in enumerate(blocks):
            if not group_blocks:
                continue
            size = self.config.groups[group_id].block_size
            n = len(group_blocks)
            if n * size // unit > len(request.keys):
                raise StepRefused(
                    "kv_events_full",
                    f"group {group_id}'s hit list runs to token {n * size}, past the "
                    f"request's last key ({len(request.keys) * unit}): vLLM 0.33.0 raises "
                    "IndexError reporting it (kv_cache_report_mode full)",
                )
            keys = tuple(request.keys[(i + 1) * size // unit - 1] for i in range(n))
            windows = [i * size for i in range(n)]
            reported.append(stored_event(request, group_id, keys, None, 0, n * size, size, windows))
        events.extend(reported)

    def get_num_blocks_to_allocate(
        self,
        request: Request,
        hit_blocks: HitBlocks | None,
        hit: int,
        admission: bool,
        external: int = 0,
    ) -> int:
        """Blocks the whole sequence needs after the hit and a connector's
        `external` tokens (the admission count with `admission`, else the
        per-step estimate)."""
        num_tokens = min(request.num_tokens, self.config.max_model_len)
        computed = request.num_computed_tokens + hit
        return self.coordinator.blocks_needed(
            request.request_id,
            num_tokens,
            hit_blocks or self._no_hit(),
            computed,
            num_tokens,
            admission,
            prefill_end=self._prefill_end(request),
            total_computed=computed + external,
        )

    def blocks_to_finish(
        self, request: Request, num_computed: int, num_tokens: int, slots: int
    ) -> int:
        """Blocks `request` still needs to hold its whole sequence (its
        first `num_tokens` tokens, as the Scheduler's scan has them, capped
        at max_model_len, plus `slots` speculative slots) from `num_computed`
        tokens, admission cap on: what vLLM's Scheduler keeps free for each
        in-flight prefill when it admits an async KV load
        (`_request_remaining_blocks`)."""
        capped = min(num_tokens, self.config.max_model_len)
        return self.coordinator.blocks_needed(
            request.request_id,
            capped + slots,
            self._no_hit(),
            num_computed,
            capped,
            True,
            prefill_end=self._prefill_end(request, num_tokens),
            total_computed=num_computed,
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: HitBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        skip_zeroing_group_ids: tuple[int, ...] = (),
        reserved_blocks: int = 0,
    ) -> bool:
        """Give the request slots for `num_new_tokens` more tokens (plus
        lookahead for drafts); False, changing nothing, if the pool is short
        (with `full_sequence_must_fit`, short of the whole sequence's blocks).

        A KV connector's `num_external_computed_tokens` follow the local hit:
        each group gets blocks for them. `delay_cache_blocks` (an async load)
        keys nothing now; the groups in `skip_zeroing_group_ids` do not have
        their new external blocks zeroed (the load writes them).
        `reserved_blocks` free blocks must stay free after this step's
        allocation (the admission gate does not count them), as vLLM keeps
        in-flight prefills' blocks from an async load."""
        external = num_external_computed_tokens
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and external == 0:
            raise ValueError("num_new_tokens must be > 0 when no computed tokens are adopted")
        max_len = self.config.max_model_len
        coordinator = self.coordinator
        rid = request.request_id
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local + external, max_len)
        num_tokens_main = total_computed + num_new_tokens
        num_need_slot = min(num_tokens_main + num_lookahead_tokens, max_len)
        num_processed = max(0, total_computed - request.num_in_flight_tokens)
        num_keyed = min(total_computed + num_new_tokens, request.num_tokens)
        # A step of a running request adopting no hit, with nothing reserved.
        plain_step = (
            new_computed_blocks is None
            and num_new_computed_tokens == 0
            and external == 0
            and not full_sequence_must_fit
            and not delay_cache_blocks
            and reserved_blocks == 0
        )
        # Most decodes: the full path below would add, free and key nothing,
        # and with nothing reserved the count fits. Within the request's idle
        # window that is a few comparisons; otherwise the groups check in full.
        if plain_step and coordinator.in_idle_window(
            request, num_processed, num_need_slot, num_tokens_main, num_keyed
        ):
            return True
        prefill_end = self._prefill_end(request)
        if plain_step and coordinator.step_is_idle(
            request,
            num_processed,
            num_need_slot,
            num_tokens_main,
            num_local + external,
            prefill_end,
            num_keyed,
        ):
            return True
        hit_blocks = new_computed_blocks or self._no_hit()
        # The admission gate: the whole sequence's count, admission cap on.
        if full_sequence_must_fit:
            num_full = min(request.num_tokens, max_len)
            needed = coordinator.blocks_needed(
                rid, num_full, hit_blocks, num_local, num_full, True, prefill_end, total_computed
            )
            if needed > self.block_pool.num_free():
                return False
        # States behind the processed prefix (the computed one less what a
        # batch in flight computes) are freed even if this fails.
        coordinator.remove_skipped(rid, num_processed)
        needed = coordinator.blocks_needed(
            rid,
            num_need_slot,
            hit_blocks,
            num_local,
            num_tokens_main,
            False,
            prefill_end,
            num_local + external,
        )
        if needed > self.block_pool.num_free() - reserved_blocks:
            return False
        if external > 0 and not self._external_admission_fits(
            request,
            hit_blocks,
            num_local,
            external,
            num_need_slot,
            num_tokens_main,
            reserved_blocks,
        ):
            self.external_admissions_refused += 1
            return False
        if new_computed_blocks is not None or external > 0:
            coordinator.add_hit_blocks(rid, hit_blocks, num_local, external, skip_zeroing_group_ids)
        coordinator.allocate(rid, num_need_slot, num_tokens_main)
        if delay_cache_blocks:
            return True  # keyed once the load completes (`cache_blocks`)
        # Draft tokens are never keyed: cache only up to the request's tokens.
        coordinator.cache(request, num_keyed)
        return True

    def _external_admission_fits(
        self,
        request: Request,
        hit_blocks: HitBlocks,
        num_local: int,
        external: int,
        num_need_slot: int,
        num_tokens_main: int,
        reserved: int,
    ) -> bool:
        """Whether an admission with a KV connector's tokens gets every block
        it takes. The count above is vLLM's (`get_num_blocks_to_allocate`),
        which caps a new request's Mamba blocks at one step's without the
        block the external tokens' state takes first; at an exact fit vLLM's
        allocation then runs out of blocks and raises. The model admits only
        what it can allocate: it runs the allocation on a copy when the
        margin is too thin to be sure."""
        rid = request.request_id
        counted = self.coordinator.blocks_needed(
            rid,
            num_need_slot,
            hit_blocks,
            num_local,
            num_tokens_main,
            False,
            self._prefill_end(request),
            total_computed=num_local + external,
        )
        # Each group takes at most one block for the external tokens' state
        # past vLLM's count.
        if self.block_pool.num_free() - reserved - counted >= len(self.coordinator.managers):
            return True
        probe, probe_hit = copy.deepcopy((self.coordinator, hit_blocks))
        try:
            probe.add_hit_blocks(rid, probe_hit, num_local, external)
            probe.allocate(rid, num_need_slot, num_tokens_main)
        except ValueError:
            return False
        return probe.pool.num_free() >= reserved

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Free the states the request no longer needs below that many
        processed tokens (`num_prompt_tokens` only matters to a window kind
        the model does not have)."""
        self.coordinator.remove_skipped(request_id, processed_computed_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.coordinator.cache(request, num_computed_tokens)

    def estimate_cached_tokens(self, request: Request) -> int:
        return self.coordinator.estimate_cached_tokens(request.request_id)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> list[list[int]]:
        return self.coordinator.computed_block_ids(request_id, num_computed_tokens)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return self.coordinator.take_boundary_offloads()

    def take_new_block_ids(self) -> list[int]:
        return self.coordinator.take_new_block_ids()

    def finalize_partial_tail_offloads(self, request: Request) -> list[list[int]]:
        # No step is ever in flight here (no async scheduling).
        return self.coordinator.finalize_partial_tails(
            request.request_id, request.num_computed_tokens
        )

    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block tables' ids, per group."""
        return tuple(
            [b.block_id for b in manager.tables.get(request_id, [])]
            for manager in self.coordinator.managers
        )

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop these blocks from the prefix cache (a KV connector's failed
        blocks); they keep their refs and their place."""
        self.block_pool.evict_blocks(block_ids)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Queue the request's blocks from `start_token` on for zeroing
        again (a failed load left them unwritten)."""
        self.coordinator.record_blocks_for_zeroing(request_id, start_token)

    def pop_blocks_for_free(self, request: Request) -> list[Block]:
        return self.coordinator.pop_blocks(request.request_id)

    def take_kv_cache_block_copies(self) -> tuple[list[tuple[int, int, int]], list[Block]]:
        """This step's copies as (group, src id, dst id), and their retained
        endpoints, which the caller frees once the copies have run."""
        pending = self.coordinator.take_pending_copies()
        copies = [(g, s.block_id, d.block_id) for g, s, d in pending]
        retained = [b for _, s, d in pending for b in (s, d)]
        return copies, retained

    def new_step_starts(self) -> None:
        self.coordinator.new_step()

    @staticmethod
    def _prefill_end(request: Request, num_tokens: int | None = None) -> int:
        # The scheduler's: a resumed request replays its output as prefill
        # (`num_tokens`: the request's tokens as the scan has them).
        tokens = len(request.all_token_ids) if num_tokens is None else num_tokens
        return max(len(request.prompt), tokens - 1)

    def _no_hit(self) -> HitBlocks:
        return tuple([[] for _ in self.coordinator.managers])
