"""Trace ops as manager calls: the scheduler's part, written once.

`OpDriver` turns each primitive op into the manager calls the trace format's
table names, and keeps what the scheduler keeps between them: token ids, each
request's pending lookup, the blocks put aside by `pop`. A target supplies
the manager behind it (`manager`, with vLLM's `KVCacheManager` interface,
which the model keeps) and implements the abstract hooks where the two
differ; the model and the real vLLM manager therefore see exactly the same
call sequence.
"""

from __future__ import annotations

from typing import Any, TypeVar

from kvgate.driver import kv_loads
from kvgate.driver.manager_calls import ManagerCalls, Pending
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.events import normalized
from kvgate.vocabulary.ops import ACTIONS, Segment, Step, next_phase, out_of_phase
from kvgate.vocabulary.residency import report as residency_report
from kvgate.vocabulary.target import StepRefused

R = TypeVar("R")  # the target's request object


def chunk_offer(config: Config, remaining: int, budget: int, num_live: int) -> int:
    """The prefill tokens vLLM's `Scheduler.schedule` hands its align-mode
    split: what is left, cut to `long_prefill_token_threshold` unless the
    request is the only one the scheduler holds (the adaptive threshold no
    lower than an equal share of the budget), then to the token budget."""
    threshold = config.long_prefill_token_threshold if num_live > 1 else 0
    if threshold > 0 and config.long_prefill_token_threshold_adaptive:
        threshold = max(threshold, config.max_num_scheduled_tokens // num_live)
    if 0 < threshold < remaining:
        remaining = threshold
    return min(remaining, budget)


def reserve_prefill_lookahead(config: Config, num_tokens: int, start: int, num_new: int) -> int:
    """A prefill chunk of `num_new` tokens from `start` as vLLM's `Scheduler`
    cuts it back for a multi-module MTP drafter, which reads the next K
    prefill tokens past a chunk (`_reserve_prefill_lookahead`): the chunk
    either reaches the request's `num_tokens` or leaves at least K of them.
    (A lookahead of 0 or 1 never cuts.)"""
    left = num_tokens - start - num_new
    if 0 < left < config.prefill_lookahead:
        num_new -= config.prefill_lookahead - left
    return max(num_new, 0)


class NothingToRun(StepRefused):
    """An `allocate` of `auto` tokens of which vLLM's `Scheduler` would run
    none this step (a multi-module MTP drafter's prefill lookahead cuts the
    chunk to nothing): it passes the request over, allocating nothing."""

    def __init__(self) -> None:
        super().__init__(
            "tokens", "auto: the drafter's prefill lookahead leaves nothing to run this step"
        )


class OpDriver(ManagerCalls[R]):
    """The trace's primitive ops as manager calls, each as vLLM's Scheduler makes them."""

    # -- the ops ------------------------------------------------------------------

    def apply(self, step: Step) -> dict[str, Any]:
        handler = getattr(self, f"_op_{step.op}", None)
        if handler is None:
            raise StepRefused("op", f"{step.op!r} is not a primitive op")
        result: dict[str, Any] = handler(step)
        pending = self.requests.get(step.req) if step.req is not None else None
        if pending is not None and ACTIONS[step.op].valid_in:
            pending.phase = next_phase(step.op, pending.phase, step.how, result)
        result["free_blocks"] = self.num_free_blocks()
        return result

    def _pending(self, step: Step) -> Pending[R]:
        assert step.req is not None
        pending = self.requests.get(step.req)
        if pending is None or pending.phase not in ACTIONS[step.op].valid_in:
            phase = "absent" if pending is None else pending.phase
            raise StepRefused("req", out_of_phase(step.op, step.req, phase))
        return pending

    def resolve(self, segments: tuple[Segment, ...]) -> list[int]:
        """A prompt's segments as this target's token ids (`fresh` ones taken now)."""
        return self._resolve(segments)[0]

    def _resolve(self, segments: tuple[Segment, ...]) -> tuple[list[int], tuple[R, int] | None]:
        """`resolve`, and the request the prompt's first segment copies with
        the number of tokens copied (None: it copies none)."""
        tokens: list[int] = []
        copied: tuple[R, int] | None = None
        for segment in segments:
            if segment.kind == "fresh":
                tokens.extend(self.fresh.ids(segment.count))
            elif segment.kind == "tokens":
                tokens += segment.token_ids
            else:
                assert segment.req is not None
                source = self.requests.get(segment.req)
                if source is None:
                    raise StepRefused("prompt", f"no request {segment.req!r} to copy")
                if segment.kind == "all_of":
                    tokens += self.all_tokens(source.request)
                else:
                    tokens += self.prompt_tokens(source.request)
                if segment is segments[0]:
                    copied = (source.request, len(tokens))
        return tokens, copied

    def _op_arrive(self, step: Step) -> dict[str, Any]:
        assert step.req is not None
        if step.req in self.requests:
            raise StepRefused("req", f"request {step.req!r} already arrived")
        tokens, copied = self._resolve(step.prompt)
        if not tokens:
            raise StepRefused("prompt", "the prompt is empty")
        if len(tokens) > self.config.max_model_len:
            # The engine refuses such a prompt before any manager sees it.
            raise StepRefused(
                "prompt",
                f"{len(tokens):,} tokens, more than config.max_model_len "
                f"{self.config.max_model_len:,}",
            )
        inputs = step.hash_inputs
        if inputs.mm and inputs.mm[-1].end > len(tokens):
            last = inputs.mm[-1]
            raise StepRefused(
                f"mm[{len(inputs.mm) - 1}]",
                f"placeholder {last.offset}..{last.end} ends past the prompt "
                f"({len(tokens):,} tokens)",
            )
        pending = Pending(
            self.new_request(step.req, tokens, step.skip_prefix_cache, inputs, copied)
        )
        pending.skips_cache = step.skip_prefix_cache
        self.requests[step.req] = pending
        return {}

    def _op_lookup(self, step: Step) -> dict[str, Any]:
        pending = self._pending(step)
        request = pending.request
        if step.load_failed:
            kv_loads.fail_load(self, pending)
        kv_loads.refuse_while_loading(pending, step)
        external, load_async, diverged = 0, False, False
        if self.config.kv_connector and self.config.kv_connector_divergent_hits:
            blocks, hit, junction, diverged = self.lookup_for_connector(request)
        else:
            blocks, hit, junction = self.lookup(request)
        local_hit = hit
        if self.config.kv_connector:
            blocks, hit, junction, external, load_async = kv_loads.connector_answer(
                self, step, pending, blocks, hit, junction, diverged
            )
        pending.hit_blocks, pending.hit, pending.has_hit = blocks, hit, True
        pending.external, pending.load_async = external, load_async
        # The Scheduler stores it at every lookup, admitted or not; the split
        # and the Mamba groups' retention mask read it until the next lookup.
        self.set_junction(request, junction)
        return {"hit": hit, "junction": junction, "local_hit": local_hit, "external": external}

    def _hit_for_allocation(self, pending: Pending[R]) -> tuple[Any, int, int]:
        """The pending lookup (hit blocks, hit, external tokens) applies to
        the request's first allocation only."""
        if pending.has_hit and not self.has_blocks(pending.request):
            return pending.hit_blocks, pending.hit, pending.external
        return None, 0, 0

    def _op_reserve(self, step: Step) -> dict[str, Any]:
        pending = self._pending(step)
        blocks, hit, external = self._hit_for_allocation(pending)
        return {
            "blocks": self.blocks_needed(pending.request, blocks, hit, True, external),
            "step_blocks": self.blocks_needed(pending.request, blocks, hit, False, external),
        }

    def _op_allocate(self, step: Step) -> dict[str, Any]:
        pending = self._pending(step)
        request = pending.request
        if step.complete_only and not pending.loading:
            raise StepRefused("complete_only", f"{step.req!r} has no KV load in flight")
        sync_load, pending.sync_load = pending.sync_load, None
        if step.invalid_blocks and pending.loading:
            # Policy recompute: the load completes with its valid blocks only.
            kv_loads.complete_partial_load(self, pending, step.invalid_blocks)
        elif step.invalid_blocks:
            # Policy recompute: the request is rescheduled from its last
            # valid block (`_update_requests_with_invalid_blocks`).
            kv_loads.truncate_at_invalid(self, pending, sync_load, step.invalid_blocks)
        if pending.loading:
            kv_loads.complete_load(self, pending)
            if step.complete_only:
                # vLLM's scan reached the reported load and completed it, then
                # had nothing to run for the request this step.
                return {"ok": False, "tokens": 0, "prompt_done": False}
        blocks, hit, external = self._hit_for_allocation(pending)
        admitting = pending.has_hit and not self.has_blocks(request)
        if admitting and pending.load_async:
            return kv_loads.allocate_async_load(self, step, pending, blocks)
        start = self.num_computed(request) + hit + external
        total = len(self.all_tokens(request))
        if step.tokens == "auto":
            offered = chunk_offer(
                self.config, total - start, self.config.max_num_scheduled_tokens, self.num_live()
            )
            if offered <= 0:
                raise StepRefused("tokens", "auto: nothing is left to compute")
            num_new = self.split(request, offered, hit, external)
            if num_new > 0:
                num_new = reserve_prefill_lookahead(self.config, total, start, num_new)
                if num_new == 0:
                    raise NothingToRun()
        else:
            assert isinstance(step.tokens, int)
            num_new = step.tokens
            if num_new > total - start:
                # A scheduler never schedules past the tokens a request has.
                raise StepRefused(
                    "tokens", f"{num_new:,} asked, {max(total - start, 0):,} left to compute"
                )
        if step.pad and num_new != 1:
            raise StepRefused("pad", f"pads a one-token chunk only, not {num_new:,} tokens")
        self.set_in_flight(request, step.in_flight)
        ok = self.allocate_slots(
            request,
            # The padded rows are slots too; only the chunk's token computes.
            num_new + step.pad,
            hit,
            blocks,
            step.lookahead,
            # Every admission from the waiting queue: after a lookup, or
            # after the request's KV load completed.
            full_sequence=(admitting or pending.after_load) and self.config.reserve_full_sequence,
            external=external,
            reserved=step.reserved,
        )
        if ok:
            if admitting:
                self.record_prefix_cache_stats(request, hit)
            if admitting and external:
                pending.sync_load = (hit, start, bool(step.sample) and start + num_new >= total)
            self.set_num_computed(request, start + num_new)
            pending.has_hit, pending.hit_blocks, pending.hit = False, None, 0
            pending.external, pending.load_async, pending.after_load = 0, False, False
            self.mark(request, "running")
        done = self.num_computed(request) >= len(self.all_tokens(request))
        if ok and done and step.sample:
            # The chunk that computes every token samples the step's output
            # (as vLLM's Scheduler appends it after the step): the next decode
            # finds it already appended.
            self.append_output(request, self.fresh.take(step.sample))
            if self.config.hash_lookahead_tokens:
                # Lookahead hashes come with an EAGLE drafter, so the Scheduler
                # runs with drafts and `update_from_output` re-caches once the
                # output is in: the prompt's last block gets its key then.
                self._recache(step, request)
        result: dict[str, Any] = {"ok": ok, "tokens": num_new, "prompt_done": done}
        if ok and done:
            # The chunk that completes the prefill emits the first output;
            # the scheduler then reports the tokens the prefix cache covered.
            result["cached_tokens"] = self.estimate_cached_tokens(request)
        return result

    def _op_decode1(self, step: Step) -> dict[str, Any]:
        pending = self._pending(step)
        pending.sync_load = None
        kv_loads.refuse_while_loading(pending, step)
        request = pending.request
        if self.num_computed(request) >= len(self.all_tokens(request)):
            # The token the last chunk sampled.
            self.append_output(request, self.fresh.take(1))
        drafts = self.fresh.take(step.spec)
        self.set_drafts(request, drafts)
        # The scheduler reserves its full lookahead even when the budget cut
        # the drafts short.
        lookahead = max(step.spec, step.lookahead)
        ok = self.allocate_slots(request, 1 + step.spec, 0, None, lookahead)
        self.set_drafts(request, [])
        if ok:
            # The rejected drafts are taken back from the computed tokens; the
            # accepted ones are output, then the token sampled after them.
            accepted = drafts[: step.accepted]
            self.set_num_computed(request, self.num_computed(request) + 1 + len(accepted))
            self.append_output(request, [*accepted, *self.fresh.take(1)])
            if step.spec or self.config.hash_lookahead_tokens:
                # With drafts (lookahead hashes imply a drafter), `update_from_output`
                # re-caches the request up to its computed tokens once the
                # step's output is in.
                self._recache(step, request)
        return {"ok": ok}

    def _forget_recache(self, step: Step) -> None:
        """A request that frees its blocks before the step's output is in
        (preempted in the step) is not re-cached by it."""
        if step.req in self.deferred_recaches:
            self.deferred_recaches.remove(step.req)

    def _recache(self, step: Step, request: R) -> None:
        """The output's re-cache of `request`: now, or at the step's drain."""
        if step.defer_recache:
            assert step.req is not None
            self.deferred_recaches.append(step.req)
        else:
            self.cache_blocks(request, self.num_computed(request))

    def _op_step(self, step: Step) -> dict[str, Any]:
        self.new_step_starts()
        return {}

    def _op_drain(self, step: Step) -> dict[str, Any]:
        # What `Scheduler.schedule` drains at its end, in its order: the
        # boundary-state hand-offs, the copies, the blocks to zero.
        if step.release_retained:
            if not self.kept_retained:
                raise StepRefused("release_retained", "no copies' endpoints are kept aside")
            self.free_blocks(self.kept_retained.popleft())
        offloads = self.take_boundary_offloads()
        copies, retained = self.take_copies()
        if step.keep_retained and retained:
            # A batch in flight may still run the copies: vLLM's Scheduler
            # frees their endpoints once it is done.
            self.kept_retained.append(retained)
        else:
            self.free_blocks(retained)
        zeroed = self.take_new_block_ids()
        # The step's output comes in after what `schedule` drains: the
        # re-caches deferred to it, for requests still holding their blocks.
        for name in self.deferred_recaches:
            request = self.requests[name].request
            self.cache_blocks(request, self.num_computed(request))
        self.deferred_recaches.clear()
        return {"copies": copies, "offloads": offloads, "zeroed": zeroed}

    def _op_free(self, step: Step) -> dict[str, Any]:
        pending = self._pending(step)
        if step.how == "preempt":
            # Only a running request is preempted; a loading one waits.
            kv_loads.refuse_while_loading(pending, step, "how")
        if step.load_failed and not pending.loading:
            # Policy fail: the Scheduler fails a request whose async load the
            # worker reported failed (`failed_recving`), and only such one.
            raise StepRefused("load_failed", "the request has no KV load in flight")
        sync_load, pending.sync_load = pending.sync_load, None
        if step.invalid_blocks and pending.loading:
            # Policy fail, an async load: not cached yet, so nothing to evict.
            first, _ = kv_loads.invalid_block_start(
                self,
                pending,
                pending.load_hit,
                self.num_computed(pending.request),
                step.invalid_blocks,
            )
            self.set_num_computed(pending.request, first * self.config.scheduler_block_size)
        elif step.invalid_blocks:
            # Policy fail, a sync load: its blocks were keyed when allocated,
            # so the failed block and every later one of the request leave
            # the prefix cache (`evict_blocks`); they stay allocated.
            self.evict_blocks(
                kv_loads.truncate_at_invalid(self, pending, sync_load, step.invalid_blocks)
            )
        # A request failed for its load ends as any ended request does: the
        # Scheduler's error finish (`finish_requests`) frees what it no longer
        # needs below its computed tokens (its hit and the external tokens:
        # under fail nothing resets them), hands the connector its blocks,
        # and frees them once the worker reports the load done, in the same
        # output; it counts nothing in the prefix-cache stats.
        result = {} if step.how == "preempt" else self._request_ends(pending)
        self._forget_recache(step)
        self.free(pending.request)
        if step.how == "preempt":
            # Back to waiting with nothing computed; the output stays.
            self.set_num_computed(pending.request, 0)
            self.set_drafts(pending.request, [])
            pending.has_hit, pending.hit_blocks, pending.hit = False, None, 0
            pending.external, pending.load_async, pending.after_load = 0, False, False
            self.mark(pending.request, "preempted")
        return result

    def _request_ends(self, pending: Pending[R], in_flight: int = 0) -> dict[str, Any]:
        """What the Scheduler does for a request that ends, before its blocks
        are freed or kept aside: hands a KV producer's connector its partial
        tails, then its computed blocks (`_connector_finished`). `in_flight`:
        its tokens a batch still in flight computes (not processed yet)."""
        result: dict[str, Any] = {
            "partial_tail_offloads": self.finalize_partial_tail_offloads(pending.request)
        }
        if self.config.kv_connector:
            # With a connector the Scheduler frees what the request no
            # longer needs before handing the connector its blocks
            # (`_connector_finished`); without one it frees them all at once.
            processed = max(0, self.num_computed(pending.request) - in_flight)
            self.remove_skipped_blocks(pending.request, processed)
        result["computed_block_ids"] = self.computed_block_ids(
            pending.request, self.num_computed(pending.request)
        )
        return result

    def _op_pop(self, step: Step) -> dict[str, Any]:
        pending = self._pending(step)
        assert step.req is not None
        # vLLM's Scheduler defers a free only with a KV connector, for a
        # request that ends, after what every ending does.
        result = self._request_ends(pending, step.in_flight) if self.config.kv_connector else {}
        self._forget_recache(step)
        self.popped[step.req] = self.pop_blocks_for_free(pending.request)
        return result

    def _op_release(self, step: Step) -> dict[str, Any]:
        assert step.req is not None
        if step.req not in self.popped:
            raise StepRefused("req", f"nothing popped for {step.req!r}")
        # Tail first, as the scheduler frees a request's blocks.
        self.free_blocks(list(reversed(self.popped.pop(step.req))))
        return {}

    def _op_reset(self, step: Step) -> dict[str, Any]:
        return {"ok": self.reset_prefix_cache()}

    def _op_events(self, step: Step) -> dict[str, Any]:
        events = normalized(self.take_events())
        # `events` is what a trace expects; `event_keys` (full keys, parents
        # included) is what the lockstep comparison reads besides.
        return {"events": [e.line() for e in events], "event_keys": [e.exact() for e in events]}

    def _op_stats(self, step: Step) -> dict[str, Any]:
        return self.make_prefix_cache_stats()

    def _op_residency(self, step: Step) -> dict[str, Any]:
        evictions = self.stats_evictions()
        return {} if evictions is None else residency_report(evictions)

    def _op_evict(self, step: Step) -> dict[str, Any]:
        free = self.num_free_blocks()
        n = free if step.blocks == "all" else step.blocks
        assert isinstance(n, int)
        if n > free:
            raise StepRefused("blocks", f"{n} blocks asked, {free} free")
        self.evict(n)
        return {}
