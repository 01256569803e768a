"""What the driver keeps between ops and the hooks a target implements.

`ManagerCalls` holds the scheduler's state between trace ops (token ids,
each request's pending lookup, blocks put aside by `pop`), declares the
hooks a target implements where the model and vLLM differ, and makes the
manager calls both share (both managers have vLLM's `KVCacheManager`
interface). `OpDriver` (`op_driver.py`) runs the ops on top of it, and
`kv_loads.py` the KV connector's loads: both through this class alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from kvgate.vocabulary.config import Config
from kvgate.vocabulary.events import KvEvent
from kvgate.vocabulary.ops import LIVE, Phase
from kvgate.vocabulary.residency import Eviction
from kvgate.vocabulary.snapshot import Snapshot
from kvgate.vocabulary.target import Capabilities
from kvgate.vocabulary.tokens import NO_INPUTS, FreshTokens, HashInputs

R = TypeVar("R")  # the target's request object


@dataclass
class Pending(Generic[R]):
    """What the driver keeps for one request between ops."""

    request: R
    hit_blocks: Any = None  # the pending lookup's blocks (target-specific)
    hit: int = 0
    has_hit: bool = False
    # With a KV connector: the pending lookup's external tokens and whether
    # the connector loads them asynchronously; `loading` while such a load
    # is in flight (the Scheduler's WAITING_FOR_REMOTE_KVS); `after_load`
    # until the request's first allocation after its load completed (a
    # re-admission from the waiting queue).
    external: int = 0
    load_async: bool = False
    loading: bool = False
    after_load: bool = False
    skips_cache: bool = False
    # What a block-level load failure (`invalid_blocks`) reads: the local hit
    # of the async load in flight; and, until the request is scheduled
    # again, its last scheduled step's sync load: the local hit, the
    # computed tokens before the step, and whether the step sampled.
    load_hit: int = 0
    sync_load: tuple[int, int, bool] | None = None
    # Where it is in its life (`ops.Phase`), moved on by `ops.next_phase`.
    phase: Phase = "absent"


class ManagerCalls(ABC, Generic[R]):
    capabilities: Capabilities
    manager: Any  # the manager under test, with vLLM's `KVCacheManager` interface

    def __init__(self, config: Config) -> None:
        self.config = config
        self.fresh = FreshTokens()
        self.requests: dict[str, Pending[R]] = {}
        self.popped: dict[str, list[Any]] = {}
        # Copies' retained endpoints kept aside by `drain`s, oldest first.
        self.kept_retained: deque[list[Any]] = deque()
        # Requests whose output's re-cache waits for the next `drain`.
        self.deferred_recaches: list[str] = []

    def forget(self, names: list[str]) -> None:
        """Drop what is kept of each ended request of `names`: no later step
        names it (a trace read entry by entry says when)."""
        for name in names:
            pending = self.requests.get(name)
            if pending is not None and pending.phase == "ended" and name not in self.popped:
                del self.requests[name]
                self.forgotten(name)

    def forgotten(self, name: str) -> None:
        """A target's hook: `name` was dropped from `requests`."""

    # -- hooks a target implements ------------------------------------------------

    @abstractmethod
    def new_request(
        self,
        name: str,
        tokens: list[int],
        skip_prefix_cache: bool = False,
        inputs: HashInputs = NO_INPUTS,
        copied: tuple[R, int] | None = None,
    ) -> R:
        """A request; `tokens`: its prompt, a fresh list the request may keep
        (the driver uses it no more); `skip_prefix_cache`: it never reads the
        prefix cache (vLLM's `skip_reading_prefix_cache`, set by prompt
        logprobs or pooling);
        `inputs`: its salt, adapter and multimodal items (its block hashes
        cover them); `copied`: the request whose first tokens the prompt
        starts with, and how many (a prompt copying another's), which a
        target may reuse what it derived from."""

    @abstractmethod
    def prompt_tokens(self, request: R) -> list[int]: ...

    @abstractmethod
    def all_tokens(self, request: R) -> list[int]: ...

    @abstractmethod
    def num_computed(self, request: R) -> int: ...

    @abstractmethod
    def set_num_computed(self, request: R, n: int) -> None: ...

    @abstractmethod
    def set_in_flight(self, request: R, n: int) -> None:
        """The request's tokens a batch still in flight computes (vLLM's
        `num_in_flight_tokens`, which an allocation's release of skipped
        blocks leaves out)."""

    @abstractmethod
    def has_blocks(self, request: R) -> bool:
        """Whether the request holds blocks (its first allocation is done)."""

    @abstractmethod
    def append_output(self, request: R, tokens: list[int]) -> None: ...

    @abstractmethod
    def set_drafts(self, request: R, tokens: list[int]) -> None: ...

    @abstractmethod
    def mark(self, request: R, status: str) -> None:
        """Record "running" or "preempted" where the target keeps a status."""

    @abstractmethod
    def set_junction(self, request: R, position: int) -> None:
        """Store a lookup's shared-prefix junction on the request, where
        vLLM's `Scheduler` keeps it (`request.shared_prefix_boundary`)."""

    @abstractmethod
    def lookup(self, request: R) -> tuple[Any, int, int]:
        """`get_computed_blocks`: the hit's blocks, its length, the junction."""

    @abstractmethod
    def lookup_for_connector(self, request: R) -> tuple[Any, int, int, bool]:
        """`get_computed_blocks_for_connector`: the local hit a connector with
        divergent hybrid hits reads, its length, the junction, and whether a
        group lagged below it (`hit_diverged`)."""

    @abstractmethod
    def blocks_needed(
        self, request: R, hit_blocks: Any, hit: int, admission: bool, external: int = 0
    ) -> int: ...

    @abstractmethod
    def split(self, request: R, num_new: int, hit: int, external: int = 0) -> int: ...

    @abstractmethod
    def finalize_partial_tail_offloads(self, request: R) -> list[list[int]]:
        """`finalize_partial_tail_offloads`: the partial tails the request
        produced that a KV producer's connector may still offload when it
        ends, as [group, block id, tokens]; the request's tails are consumed."""

    @abstractmethod
    def take_boundary_offloads(self) -> list[list[Any]]:
        """`take_boundary_state_offloads`, drained: each Mamba state this step
        keyed, as [request, group, block id, tokens], grouped by request in
        the order the requests first appear (groups in order)."""

    @abstractmethod
    def take_copies(self) -> tuple[list[list[int]], list[Any]]:
        """This step's copies as [src, dst] ids, and their retained endpoints."""

    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @abstractmethod
    def record_prefix_cache_stats(self, request: R, hit: int) -> None:
        """Count an admitted lookup in the prefix-cache stats, as the scheduler
        does once `allocate_slots` admitted the request after its lookup."""

    @abstractmethod
    def make_prefix_cache_stats(self) -> dict[str, Any]:
        """The stats since the last call (the `stats` op's keys), reset; and
        `usage`, the pool's used fraction (KVCacheManager.usage), compared in
        lockstep but no `expect` key."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    @abstractmethod
    def take_events(self) -> list[KvEvent]:
        """The KV-cache events queued since the last call ([] when off)."""

    @abstractmethod
    def take_evictions(self) -> list[Eviction]:
        """Drain the residency metrics' eviction events queued since the last
        drain ([] without `kv_cache_metrics`)."""

    def stats_evictions(self) -> list[Eviction] | None:
        """The eviction events the Scheduler's `make_stats` drains: None when
        it makes no stats (`disable_log_stats`), which leaves them queued."""
        if self.config.disable_log_stats:
            return None
        return self.take_evictions()

    @abstractmethod
    def pool_clean(self) -> bool:
        """Every block but the null block free, at ref 0, referenced by nothing."""

    @abstractmethod
    def hold_positions(self) -> dict[str, dict[int, int]]:
        """{request: {group: held position}}; {} where the target has no hold."""

    @abstractmethod
    def state_ref(self, request: R, group: int, position: int) -> int | None:
        """The ref count of the block keyed in `group` at the request's prefix
        position `position`, or None when nothing is keyed there."""

    @abstractmethod
    def attention_cached(self, request: R) -> int:
        """How many of the request's prompt tokens the attention group has
        cached from the start, in whole attention blocks."""

    @abstractmethod
    def snapshot(self) -> Snapshot: ...

    def check_values(self, query: Mapping[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        if "pool_clean" in query:
            values["pool_clean"] = (
                self.pool_clean() and not any(self.popped.values()) and not self.kept_retained
            )
        if "free_blocks" in query:
            values["free_blocks"] = self.num_free_blocks()
        if "holds" in query:
            values["holds"] = self.hold_positions()
        if "ref" in query:
            values["ref"] = {
                req: {
                    group: {
                        pos: self.state_ref(self.requests[req].request, group, pos)
                        for pos in positions
                    }
                    for group, positions in groups.items()
                }
                for req, groups in query["ref"].items()
            }
        if "attention_cached" in query:
            values["attention_cached"] = {
                req: self.attention_cached(self.requests[req].request)
                for req in query["attention_cached"]
            }
        return values

    def num_live(self) -> int:
        """Requests the scheduler holds (waiting or running): arrived, not ended."""
        return sum(pending.phase in LIVE for pending in self.requests.values())

    def close(self) -> None:
        self.requests.clear()
        self.popped.clear()
        self.kept_retained.clear()

    # -- the hooks that are one call of the manager or its pool ---------------
    # Both targets' managers have vLLM's `KVCacheManager` interface (the
    # model keeps its names), so these are written once. Ids and counts are
    # made plain ints: vLLM may hand back numpy or torch scalars.

    def allocate_slots(
        self,
        request: R,
        num_new: int,
        hit: int,
        hit_blocks: Any,
        lookahead: int,
        full_sequence: bool = False,
        external: int = 0,
        delay_cache: bool = False,
        skip_zeroing: tuple[int, ...] = (),
        reserved: int = 0,
    ) -> bool:
        """`allocate_slots`; `full_sequence`: the scheduler's admission gate
        (`full_sequence_must_fit`), refusing unless the whole sequence fits.
        A KV connector's `external` tokens, an async load's `delay_cache`
        and `skip_zeroing` groups are passed only when set."""
        connector: dict[str, Any] = {}
        if external:
            connector["num_external_computed_tokens"] = external
        if delay_cache:
            connector["delay_cache_blocks"] = True
        if skip_zeroing:
            connector["skip_zeroing_group_ids"] = skip_zeroing
        if reserved:
            connector["reserved_blocks"] = reserved
        got = self.manager.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=hit,
            new_computed_blocks=hit_blocks,
            num_lookahead_tokens=lookahead,
            full_sequence_must_fit=full_sequence,
            **connector,
        )
        # vLLM answers with the new blocks or None, the model with a bool.
        return got is not None and got is not False

    def truncate_computed_blocks(self, blocks: Any, num_tokens: int) -> Any:
        """`truncate_computed_blocks`: a lookup's blocks cut at `num_tokens`."""
        return self.manager.truncate_computed_blocks(blocks, num_tokens)

    def cache_blocks(self, request: R, num_computed: int) -> None:
        """`KVCacheManager.cache_blocks`: key the request's states up to
        `num_computed` tokens (the scheduler's re-cache after a step)."""
        self.manager.cache_blocks(request, num_computed)

    def estimate_cached_tokens(self, request: R) -> int:
        """The prefix-cache tokens the request's blocks cover (the scheduler
        reports it in a finished prefill's stats)."""
        return int(self.manager.estimate_cached_tokens(request))

    def computed_block_ids(self, request: R, num_computed: int) -> list[list[int]]:
        """`get_block_ids_for_computed_tokens`: per group, the block ids that
        cover the request's computed tokens (the block table the scheduler
        hands a KV connector when the request ends)."""
        request_id = cast(Any, request).request_id
        ids = self.manager.get_block_ids_for_computed_tokens(request_id, num_computed)
        return [[int(i) for i in group] for group in ids]

    def take_new_block_ids(self) -> list[int]:
        """`take_new_block_ids`, drained: the attention blocks allocated since
        the last call, which the worker zeroes (a Mamba model needs it)."""
        return [int(i) for i in self.manager.take_new_block_ids()]

    def free(self, request: R) -> None:
        self.manager.free(request)

    def block_ids(self, request: R) -> list[int]:
        """`get_block_ids` of a single-group model: the request's table."""
        (ids,) = self.manager.get_block_ids(cast(Any, request).request_id)
        return [int(i) for i in ids]

    def evict_blocks(self, block_ids: list[int]) -> None:
        """`evict_blocks`: these blocks leave the prefix cache (ref kept)."""
        self.manager.evict_blocks(set(block_ids))

    def record_blocks_for_zeroing(self, request: R, start: int) -> None:
        """`record_blocks_for_zeroing`: the request's blocks from token
        `start` on are zeroed again before they are recomputed."""
        self.manager.record_blocks_for_zeroing(cast(Any, request).request_id, start)

    def remove_skipped_blocks(self, request: R, num_computed: int) -> None:
        """`remove_skipped_blocks`: free the blocks the request no longer
        needs below `num_computed` processed tokens."""
        ended = cast(Any, request)
        self.manager.remove_skipped_blocks(ended.request_id, num_computed, ended.num_prompt_tokens)

    def pop_blocks_for_free(self, request: R) -> list[Any]:
        return list(self.manager.pop_blocks_for_free(request))

    def free_blocks(self, blocks: list[Any]) -> None:
        self.manager.block_pool.free_blocks(blocks)

    def new_step_starts(self) -> None:
        self.manager.new_step_starts()

    def evict(self, n: int) -> None:
        """Take `n` free blocks (evicting cached states) and free them again."""
        pool = self.manager.block_pool
        pool.free_blocks(pool.get_new_blocks(n))
