"""kvgate's model of vLLM's `Scheduler`, played over the model manager.

`SchedulerModel` schedules requests one engine step at a time as
`Scheduler.schedule()` does, writing every manager call as a trace step on
the model (`ModelTarget`, the oracle) through a `StepWriter`:

1. running requests in admission order, within the step's token budget: a
   decoding request runs `decode1` (1 + K tokens, fewer drafts when the
   budget left is short, the full lookahead kept), a prefilling one the next
   chunk of its prompt, cut by the align-mode split (`allocate auto` when
   the budget left does not bind, else the split's count written out, so a
   trace never depends on a target's budget arithmetic). When an allocation
   fails, the last running request is preempted (`preempt`: `free
   preempt`, back to the front of the waiting queue), down to the failing
   request itself. Under the priority policy the waiting queue is kept in
   (priority, arrival) order and the victim is the running request last in
   that order: one already scheduled this step is unscheduled first (its
   tokens back in the budget, its run undone), and a failing request that
   preempts itself lets the scan go on to the next;
2. if nothing was preempted, waiting requests in order (`admit`): `lookup`,
   `reserve` and the full-sequence admission gate (`admission_fits`), the
   first chunk; the first that does not fit ends admission. A first chunk
   of one token is padded to a speculative step (`allocate pad`) where the
   Scheduler pads it;
3. `step` and `drain`, then `free finish` of requests that generated their
   output (`step` runs all three and reports the step's `StepDecisions`).

With a KV connector each request's external hit (`RemoteHit`, set on the
request after it arrives) is carried by every lookup; an async load's
allocation (with the blocks the Scheduler keeps for in-flight prefills,
`allocate reserved`) puts the request in a queue of waiting requests that
hold blocks, scanned first; the worker reports the load done (or failed)
some steps later, and the scan then completes it (`allocate`, or `allocate
complete_only` when nothing runs) or, failed, looks it up again (`lookup
load_failed`); under load-failure policy `fail` (config
`kv_load_failure_policy`) a failed load ends its request instead (`free
abort load_failed`, after the step's finishes), one failure reported a step.

A chunk that computes every token of its request samples the step's output
token (`allocate sample 1`), as vLLM's `Scheduler` appends it after the step;
the model's drafts are rejected (one token per decode step) unless a step
accepts some (`accept`: `decode1 accepted`).

The workload's generator (`workload.generator.SessionRun`) and the
scheduler-level lockstep drive it; the steps it writes, each with what the
oracle observed in its `expect`, are a fixed trace any target replays.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any, Literal

from kvgate.driver.op_driver import chunk_offer, reserve_prefill_lookahead
from kvgate.model.async_batches import AsyncBatches, AsyncNotModelled
from kvgate.model.connector_loads import ConnectorLoads
from kvgate.model.encoder_cache import EncoderCache, EncoderPlan
from kvgate.model.request import Request
from kvgate.model.scheduler_state import (
    SKIP,
    Batch,
    Chunk,
    LiveRequest,
    SchedulerStuck,
    StepDecisions,
    StepWriter,
    admission_fits,
)
from kvgate.model.sessions import StreamingSessions
from kvgate.model.split import chunk_tokens
from kvgate.model.target import ModelTarget
from kvgate.vocabulary.config import Config, NotModelled
from kvgate.vocabulary.events import KvEvent
from kvgate.vocabulary.scheduling import (
    COW_RETENTION,
    Arrival,
    DeferredFree,
    NextStep,
    PrefixCacheStats,
    RemoteHit,
)
from kvgate.vocabulary.snapshot import Snapshot, StepView
from kvgate.vocabulary.target import Capabilities, StepRefused
from kvgate.vocabulary.tokens import HashInputs


class SchedulerModel(AsyncBatches, ConnectorLoads, StreamingSessions):
    """vLLM's `Scheduler` over the model manager, one engine step at a time."""

    def __init__(self, config: Config, spec: int, max_num_seqs: int) -> None:
        if config.prefill_lookahead > 1 and spec != config.prefill_lookahead:
            # vLLM's multi-module MTP drafter reads as many prefill tokens
            # ahead, and hashes as many, as it drafts.
            raise NotModelled(
                "hash_lookahead_tokens",
                f"{config.hash_lookahead_tokens} (a multi-module MTP drafter) needs spec "
                f"{config.hash_lookahead_tokens}, not {spec}",
            )
        self.config = config
        self.spec = spec
        self.max_num_seqs = max_num_seqs
        self.by_priority = config.scheduling_policy == "priority"
        if self.by_priority and (config.kv_connector or config.async_scheduling):
            raise NotModelled(
                "scheduling_policy",
                "the priority policy is modelled without a KV connector and async scheduling",
            )
        if self.by_priority and config.hash_lookahead_tokens:
            # Undoing a victim's run would also have to undo the re-caching
            # its sampled token allowed.
            raise NotModelled(
                "scheduling_policy",
                "the priority policy is modelled without lookahead block hashes",
            )
        self.arrivals = 0
        # The engine's pause (`pause`): "" running, "keep" or "wait".
        self.paused = ""
        # Async scheduling: the engine schedules the next batch while the
        # last one runs, so up to `ASYNC_BATCHES` batches are in flight.
        async_scheduling = self.async_scheduling = config.async_scheduling
        self.in_flight: deque[Batch] = deque()
        self.batches_scheduled = 0
        self.batches_processed = 0
        # With a consumer KV connector (kvgate's runs `kv_both`) and batches
        # in flight, vLLM's Scheduler defers freeing a request's blocks while
        # a batch that may still write them runs: (fence, request) in order,
        # each released once the engine has processed `fence` non-empty
        # batches; `sched_seq` and `processed_seq` count those batches.
        self.defer_block_free = async_scheduling and config.kv_connector
        self.deferred: deque[DeferredFree] = deque()
        self.sched_seq = 0
        self.processed_seq = 0
        # A request ended since the last `schedule()` (vLLM's
        # `finished_req_ids`, which keeps the engine scheduling).
        self._ended_since_schedule = False
        self._output_processed = False  # the last engine step processed a batch's output
        self.writer = StepWriter(ModelTarget(config))
        # Requests no later entry names, kept while a live request needs them.
        self._forgettable: set[str] = set()
        self.waiting: deque[LiveRequest] = deque()
        self.running: list[LiveRequest] = []
        # With a KV connector: waiting requests that hold blocks (an async
        # load in flight, or done but not yet admitted), which vLLM's
        # Scheduler keeps in a queue of their own (`kv_holding_waiting`) and
        # scans first.
        self.holding: deque[LiveRequest] = deque()
        # Requests aborted while their async load was in flight: they keep
        # their blocks until the worker reports the load.
        self.aborted_loads: list[LiveRequest] = []
        self.engine_step = 0
        self.num_eligible = 0  # waiting + running when this step began
        # Requests a prefix-cache reset preempted between steps: vLLM's
        # Scheduler reports them with the next step's preemptions.
        self._reset_preempted: list[str] = []
        # The running requests still in their prompt when this step began.
        self._prefilling_at_step_start: set[str] = set()
        # Each live request's tokens when this step began (what vLLM's
        # Scheduler has of it until the step's output is processed).
        self._tokens_at_step_start: dict[str, int] = {}
        # Drafts the model runner accepts in the next step, by request (`accept`);
        # under async scheduling, in the batch the next step schedules.
        self._accept: dict[str, int] = {}
        self._start_batch()
        self._running_scheduled = False
        self._prefill_scheduled = False
        # The prefill cadence (`prefill_schedule_interval`): the non-empty
        # steps so far, the last one that carried prefill, and whether the
        # last step that admitted prefills left requests waiting (then the
        # cadence holds nothing back).
        self.num_executed_steps = 0
        self.last_prefill_step = -config.prefill_schedule_interval
        self.prefill_capacity_bound = False
        # Requests' multimodal items: the encoder cache, the step's encoder
        # budget left, the plan of the chunk last cut (`_chunk`), and the
        # items each request scheduled this step encodes.
        self.encoder = EncoderCache(config.encoder_cache_slots)
        self.encoder_budget = 0
        self._encoder_plan: EncoderPlan | None = None
        self._encoded: dict[str, list[int]] = {}

    @property
    def capabilities(self) -> Capabilities:
        return self.oracle.capabilities

    def arrive(self, arrival: Arrival) -> LiveRequest:
        """A request arrives (`arrive`) and waits at the end of the queue
        (under the priority policy, at its place); its `remote`: what a KV
        connector's external store holds of it; `resumable`: a
        streaming-input session; `mm`: its multimodal items; `lora`: its
        LoRA adapter (under `config.max_loras`)."""
        name, prompt, max_tokens = arrival.name, arrival.prompt, arrival.max_tokens
        remote, resumable, mm, lora = arrival.remote, arrival.resumable, arrival.mm, arrival.lora
        if lora and not self.config.max_loras:
            raise StepRefused(
                "lora", f"{name}'s adapter {lora!r} needs config.max_loras of 1 or more"
            )
        if self.by_priority and resumable:
            # A session's stops move it between queues.
            raise StepRefused(
                "config.scheduling_policy",
                f"{name}'s streaming-input session under the priority policy is not modelled",
            )
        if self.async_scheduling and remote is not None and remote.load_async:
            raise AsyncNotModelled(
                f"{name}'s asynchronous KV load under async scheduling is not modelled"
            )
        if self.async_scheduling and mm:
            raise AsyncNotModelled(f"{name}'s encoder inputs under async scheduling")
        # Written only when set: a trace without it reads as before.
        skips = {"skip_prefix_cache": True} if arrival.skip_prefix_cache else {}
        self.writer.run(
            "arrive",
            req=name,
            prompt=prompt,
            cache_salt=arrival.cache_salt,
            lora=lora,
            mm=mm,
            **skips,
        )
        live = LiveRequest(
            name,
            self.oracle.requests[name].request,
            max_tokens,
            arrival.follows,
            remote=remote,
            resumable=resumable,
            rank=(arrival.priority, self.arrivals),
        )
        self.arrivals += 1
        self.waiting.append(live)
        self._order_waiting()
        return live

    def preview_next_step(self) -> NextStep:
        """What the next engine step will do, found by taking it on a copy
        (preemption, the token budget and the batch queue decide it): the
        drafts each request decodes with in the batch it schedules (a
        step's `accept` must name exactly those decodes) and, under async
        scheduling, the requests sampling in the batch whose output it
        processes (only those can meet a stop condition in it). Raises
        what the step would raise."""
        probe = copy.deepcopy(self)
        scheduled, processed = probe.batches_scheduled, probe.batches_processed
        decisions = probe.step()
        if self.async_scheduling:
            drafts = probe.decode_drafts() if probe.batches_scheduled != scheduled else {}
            # A batch the step processes at once (none in flight before) ran nothing.
            output = probe.batches_processed != processed and bool(self.in_flight)
            return NextStep(drafts, set(self.in_flight[0].samples) if output else set())
        # A decode computes its sampled token and its drafts; a prefill
        # (admitted or resumed in this step) has none.
        decoding = {live.name for live in self.running if live.decoding}
        drafts = {
            name: tokens - 1
            for name, tokens in decisions.scheduled
            if name in decoding and tokens > 1
        }
        return NextStep(drafts, set())

    def step(self, aborted: tuple[str, ...] = ()) -> StepDecisions:
        """One engine step: `schedule`, the worker's load reports, `step` and
        `drain`, the output each scheduled request sampled, then `free
        finish` of the requests that generated their output (and, under
        load-failure policy `fail`, `free abort` of those whose load failed).
        `aborted`: requests the client aborts after the `schedule()`, before
        the output is processed (their output is skipped). Under async
        scheduling, the engine's step with two batches in flight
        (`_async_step`)."""
        if self.async_scheduling:
            if aborted:
                raise AsyncNotModelled("an abort inside a step under async scheduling")
            return self._async_step()
        decisions = StepDecisions()
        finished, sampled = self._schedule_batch(decisions)
        for name in aborted:
            self.abort(name)
        unused = next(iter(self._accept), None)
        if unused is not None:
            self._accept.clear()
            raise StepRefused("accept", f"{unused} does not decode with drafts in this step")
        decisions.loaded, decisions.failed = self.reported_loads()
        self._process_output(decisions, sampled, finished)
        self.engine_step += 1
        return decisions

    def _schedule_batch(
        self, decisions: StepDecisions
    ) -> tuple[list[LiveRequest], dict[str, list[int]]]:
        """`step`, `schedule` and `drain`: the requests the batch completes
        and the tokens each scheduled request samples in it."""
        writer = self.writer
        outputs = {live.name: len(live.request.output) for live in self._live()}
        # vLLM's Scheduler starts each `schedule()` with `new_step_starts`:
        # the states the last output's re-cache keyed are not this step's.
        writer.run("step")
        finished = self.schedule(decisions)
        # The copies run with this batch: with deferred frees their endpoints
        # wait until it is done (the next non-empty batch's number).
        keep = {"keep_retained": True} if self.defer_block_free else {}
        decisions.copies = writer.run("drain", **keep)["copies"]
        if decisions.copies and self.defer_block_free:
            self.deferred.append((self.sched_seq + 1, COW_RETENTION))
        by_name = {live.name: live for live in self._live()}
        sampled = {
            name: list(by_name[name].request.output[outputs[name] :])
            for name, _ in decisions.scheduled
        }
        return finished, sampled

    def _process_output(
        self,
        decisions: StepDecisions,
        sampled: dict[str, list[int]],
        finished: list[LiveRequest],
        batch: int = 0,
    ) -> None:
        """A batch's output processed (`batch`: its number under async
        scheduling): what each request sampled (a request ended meanwhile
        skipped, and a preempted one's dropped output), first outputs'
        prefill stats, then the finishes' frees (a preempted request whose
        delivered token ends it among them; and, under `fail`, the failed
        loads')."""
        writer = self.writer
        by_name = {live.name: live for live in self._live()}
        for name, tokens in sampled.items():
            live = by_name.get(name)
            if live is None or live.is_finished:
                continue
            stale = self._stale_output(live, batch)
            if stale and live.drop_stale_output:
                continue
            decisions.sampled[name] = tokens
            # The items whose tokens are computed go back to the encoder
            # cache, then, when it finishes, all it still holds.
            self.encoder.release_computed(
                name, live.request.inputs.mm, live.request.num_computed_tokens
            )
            if live in finished:
                self.encoder.release_all(name)
            if tokens and not live.prefill_stats_reported:
                live.prefill_stats_reported = True
                decisions.prefill_stats[name] = self._prefill_stats(live, stale)
        # Under `fail`, a failed load ends its request with an error once
        # the step's finishes are freed (vLLM frees its blocks with the
        # worker's report).
        errored = [
            live
            for live in self.holding
            if live.load_failed and self.config.kv_load_failure_policy == "fail"
        ]
        for live in errored:
            self.holding.remove(live)
        # Sessions that stopped and go on: back in the queue of waiting
        # requests holding blocks, in output order, after the step's frees.
        continuing: list[LiveRequest] = []
        for live in finished:
            if live.is_finished or (self._stale_output(live, batch) and live.drop_stale_output):
                continue
            if live in self.running:
                self.running.remove(live)
            else:
                # Preempted while this batch ran: the token it delivers ends
                # it where it waits.
                self.waiting.remove(live)
            if live.resumable and self._stop_session(live):
                continuing.append(live)
                continue
            self._end(live, "finish")
            decisions.finished.append(live.name)
        self.holding.extend(continuing)
        for live in errored:
            writer.run("free", req=live.name, how="abort", load_failed=True)
            live.finish("error")
            self._ended_since_schedule = True
            decisions.errored.append(live.name)
        # An aborted request's load the worker reported: its blocks freed last.
        for live in [live for live in self.aborted_loads if live.load_reported]:
            self.aborted_loads.remove(live)
            writer.run("free", req=live.name, how="abort")

    def _end(self, live: LiveRequest, how: Literal["finish", "abort"]) -> None:
        """Free an ended request's blocks (`free`), or, while a batch that
        may still write them is in flight, keep them aside (`pop`) until
        that batch's output is processed (`release`)."""
        live.finish(how)
        self._ended_since_schedule = True
        self.encoder.release_all(live.name)
        if self._free_deferred(live):
            self.writer.run("pop", req=live.name, **self._in_flight_field(live))
            self.deferred.append((self.sched_seq, live.name))
        else:
            self.writer.run("free", req=live.name, how=how)

    def _prefill_stats(self, live: LiveRequest, preempted: bool) -> tuple[int, int]:
        """A request's prefill stats as its first output reports them: the
        tokens it was admitted with, and what its prefill added to the
        prefix cache (the cache's estimate past them, within its prompt).
        The estimate is read with the output where it differs from the one
        the prefill's allocation left: under lookahead hashes, and for a
        request preempted (`preempted`) while the batch ran."""
        cached = live.cached_at_admission or 0
        if self.config.hash_lookahead_tokens or preempted or self.async_scheduling:
            # Lookahead hashes: the output's re-cache keys the prompt's last
            # block (its lookahead token is the one sampled), at the drain.
            # Preempted: its blocks are freed, so the estimate finds none.
            live.cache_estimate = int(self.oracle.estimate_cached_tokens(live.request))
        estimate = min(live.cache_estimate, live.request.num_prompt_tokens)
        return cached, max(0, estimate - cached)

    def stop(self, name: str) -> None:
        """`name` finishes with the token it samples in the next step (a stop
        condition); only its finish moves: the step schedules it as before.
        Under async scheduling: with the last token it gets in the output
        the next step processes (`OutputPlaceholders._settle`)."""
        for queue in (self.running, self.waiting, self.holding):
            for live in queue:
                if live.name == name:
                    live.stops_at_next_token = True

    def abort(self, name: str) -> None:
        """The client aborts `name` between engine steps (`free abort`);
        a request that already finished is left alone. One whose async KV
        load is still in flight keeps its blocks until the worker reports
        that load (vLLM's Scheduler frees them with the report)."""
        for queue in (self.running, self.waiting, self.holding):
            for live in queue:
                if live.name == name:
                    queue.remove(live)
                    if live.load_in_flight:
                        live.finish("abort")
                        self._ended_since_schedule = True
                        self.aborted_loads.append(live)
                        return
                    self._end(live, "abort")
                    return
        # Already finished: vLLM's Scheduler ignores the abort, and so does it.

    def pause(self, mode: str) -> None:
        """The engine pauses (`keep`: the Scheduler schedules nothing;
        `wait`: what runs goes on, and of the waiting requests only those
        holding KV blocks are admitted) or, with "", resumes."""
        if mode and self.async_scheduling:
            raise AsyncNotModelled("a pause under async scheduling is not modelled")
        self.paused = mode

    def reset_prefix_cache(self, running: bool, connector: bool = False) -> tuple[bool, list[str]]:
        """The Scheduler's prefix-cache reset between steps (`reset`): with
        `running`, every running request preempted first, the last first, so
        they wait in their running order, and the next step reports them
        preempted; with `connector`, the KV connector's cache is reset too,
        and its store forgets every request it held; (whether it reset, the
        waiting queue after)."""
        if connector:
            # An aborted request's load is in flight until it is reported.
            in_flight = [r for r in self._live() if r.load_in_flight] + [
                r for r in self.aborted_loads if not r.load_reported
            ]
            loading = next((r.name for r in in_flight), None)
            if loading is not None:
                raise StepRefused(
                    "connector",
                    f"a connector reset while {loading}'s asynchronous KV load is in flight "
                    "is not modelled",
                )
            for request in (*self._live(), *self.aborted_loads):
                request.remote = None
        if running:
            holder = self.blocks_held_off_the_running_queue()
            if holder is not None:
                if self.config.vllm_defects == "fixed":
                    # A fixed vLLM sees the cache cannot reset and says so
                    # before preempting anyone.
                    return False, [live.name for live in self.waiting]
                # vLLM's Scheduler preempts every running request, finds the
                # cache still in use and raises ("not supported yet").
                raise StepRefused(
                    "running",
                    f"a reset that preempts the running requests while {holder} is not "
                    "supported: vLLM's Scheduler raises, as those blocks keep the cache "
                    "from resetting",
                )
            while self.running:
                victim = self.running[-1]
                # vLLM drops a reset's victims' output in flight: they may
                # run again in the next step.
                self._preempt(victim, drop_stale=True)
                self._reset_preempted.append(victim.name)
        ok = bool(self.writer.run("reset")["ok"])
        return ok, [live.name for live in self.waiting]

    def blocks_held_off_the_running_queue(self) -> str | None:
        """What holds KV blocks outside the running queue, in words (None
        when nothing does): a reset can free every block only by preempting
        the running requests, never these."""
        for live in self.holding:
            if live.waiting_for_streaming_req:
                return f"streaming-input session {live.name} is paused holding its blocks"
            if live.load_in_flight:
                return f"{live.name}'s asynchronous KV load is in flight"
            return f"{live.name} holds the blocks of its finished KV load"
        if self.aborted_loads:
            return f"aborted {self.aborted_loads[0].name}'s asynchronous KV load is in flight"
        if self.deferred:
            return f"the free of {self.deferred[0][1]} waits for a batch in flight"
        return None

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The manager's prefix-cache stats since the last call, as the
        Scheduler's update drains them (empty when stats are not logged, or
        when the last engine step processed no batch's output: they wait
        for the next one that does)."""
        if self.async_scheduling and not self._output_processed:
            return {}
        return self.oracle.manager.make_prefix_cache_stats()

    def take_kv_events(self) -> list[KvEvent]:
        """The pool's KV-cache events queued since the last update that
        processed an output, as the Scheduler's update takes them from its
        manager and publishes them (under async scheduling, a step that
        processed no output leaves them queued for the next one that does)."""
        if self.async_scheduling and not self._output_processed:
            return []
        return self.oracle.take_events()

    def kv_cache_usage(self) -> float:
        return self.oracle.manager.usage

    def take_evictions(self) -> list[int]:
        return [eviction.reuse_gaps for eviction in self.oracle.stats_evictions() or []]

    def prompt_tokens(self, name: str) -> tuple[list[int], HashInputs]:
        request = self.oracle.requests[name].request
        return list(request.all_token_ids), request.inputs

    def snapshot(self) -> Snapshot:
        return self.oracle.snapshot()

    def forget(self, names: list[str]) -> None:
        """Drop what is kept of each ended request of `names` (no later
        entry names it): its tokens, on the oracle. One a request not yet
        admitted follows is kept until that request's first admission has
        checked it (and dropped at a later call)."""
        self._forgettable.update(names)
        if not self._forgettable:
            return
        lives = (*self._live(), *self.aborted_loads)
        needed = {r.name for r in lives}
        needed |= {r.follows for r in lives if r.follows is not None and not r.ever_admitted}
        dropped = [n for n in self._forgettable if n not in needed]
        self._forgettable.difference_update(dropped)
        self.oracle.forget(dropped)

    # -- the strict view a step at a time (`StepViewing`) --------------------

    def take_changed_blocks(self) -> set[int]:
        return self.oracle.take_changed_blocks()

    def take_touched_requests(self) -> set[str]:
        """The requests the manager calls since the last call named."""
        return self.writer.take_touched()

    def step_view(self, blocks: Collection[int], requests: Collection[str]) -> StepView:
        return self.oracle.step_view(blocks, requests)

    def schedule(self, decisions: StepDecisions) -> list[LiveRequest]:
        """One scheduler step's allocations, recorded in `decisions`; the
        requests that generated their whole output."""
        # Paused with `keep`, vLLM's Scheduler gives the step no budget.
        budget = 0 if self.paused == "keep" else self.config.max_num_scheduled_tokens
        finished: list[LiveRequest] = []
        preempted = False
        self.encoder_budget = self.config.encoder_budget
        self._encoded = decisions.encoder_inputs
        self._tokens_at_step_start = {
            live.name: len(live.request.all_token_ids) for live in self._live()
        }
        decisions.preempted.extend(self._reset_preempted)
        self._reset_preempted.clear()
        # What vLLM's Scheduler counts, once per step, to decide whether
        # `long_prefill_token_threshold` applies: its own queues. The oracle's
        # live requests may also hold requests never scheduled (a shared
        # system prompt's holder).
        self.num_eligible = len(self.waiting) + len(self.holding) + len(self.running)
        for live in (*self.running, *self.holding):
            # A load reported failed has nothing computed for the Scheduler.
            failed = live.load_failed
            live.sched_computed = 0 if failed else live.request.num_computed_tokens
            live.sched_outputs = len(live.request.output)
        # The running requests still in their prompt: vLLM's Scheduler counts
        # them in-flight prefills for the whole scan, even once this step's
        # chunk completes the prompt (it updates the set after the scan).
        self._prefilling_at_step_start = {live.name for live in self.running if not live.decoding}
        index = 0
        # Whether a running request ran a prefill chunk this step (vLLM's
        # `prefill_scheduled`, which the waiting scan's padding reads).
        prefill_scheduled = False
        defer = self._defers_prefills()
        while index < len(self.running) and budget > 0:
            live = self.running[index]
            request = live.request
            outputs = len(request.output)
            prefilling = not live.decoding
            if defer and prefilling:
                index += 1  # its next chunk waits for the cadence
                continue
            if live.decoding and self.async_scheduling:
                # Past its prompt under async scheduling: on its output
                # placeholders, unless its batches in flight reach max_tokens.
                planned = (
                    None
                    if self._reaches_max_tokens(live)
                    else (self._placeholder_decode(live, budget))
                )
                if planned is None:
                    index += 1
                    continue
                cost, run = planned
            elif live.decoding:
                # vLLM schedules what the budget leaves of 1 + K: fewer drafts.
                drafts = min(self.spec, budget - 1)
                cost = 1 + drafts
                run = self._decode(live, drafts)
            else:
                chunk = self._chunk(request, 0, budget)
                if chunk is None or chunk == SKIP:
                    index += 1
                    continue
                cost = chunk[1]
                run = self._allocate(live, chunk)
            ok = run()
            victim = None
            while not ok:
                # vLLM preempts the last running request (by priority under
                # that policy), the failing one included, and retries.
                victim = self.victim()
                if self._free_deferred(victim):
                    # Its blocks would only join the deferred frees, which
                    # helps no allocation now: vLLM's Scheduler preempts
                    # nothing and ends the running scan.
                    break
                if self.running.index(victim) < index:
                    # Scheduled earlier in this step (the priority policy only).
                    budget += self._unschedule(victim, decisions, finished)
                    index -= 1
                self.preempt(decisions, victim)
                preempted = True
                if victim is live:
                    if not self.running and not self.holding:
                        # Alone, it outgrew the whole pool: re-admitted (its
                        # prompt fits), it reaches the same point again, for
                        # ever (vLLM's Scheduler loops the same way).
                        raise SchedulerStuck(
                            f"{live.name} cannot run on a pool of {self.config.num_blocks} "
                            "blocks: alone, its sequence outgrows the pool and it preempts itself"
                        )
                    break
                ok = run()
            if not ok and self.by_priority and victim is live:
                # It was the lowest: those after it rank higher and may fit in
                # the blocks it freed (the index already points at the next).
                continue
            if not ok:
                break
            budget -= cost
            index += 1
            decisions.scheduled.append((live.name, cost))
            prefill_scheduled |= prefilling
            if self.async_scheduling:
                self._placed(live, cost)
                continue
            live.decoding = len(request.output) > outputs  # it sampled
            if len(request.output) >= live.max_tokens or (
                live.stops_at_next_token and live.decoding
            ):
                finished.append(live)
        if preempted or self.paused == "keep":
            # vLLM admits nothing in a step that preempted, nor while paused so.
            self._cadence_after(decisions, prefill_scheduled, admitted_prefill=False)
            return finished
        # Requests the scan passed over that hold blocks: back at the head of
        # their queue after the scan, in scan order.
        skipped: list[LiveRequest] = []
        # Waiting requests the scan passed over without blocks (their chunk
        # cut to nothing): back at the head of the waiting queue, in order.
        passed_over: list[LiveRequest] = []
        # Whether the running loop scheduled anything (the padding reads it).
        self._running_scheduled = bool(decisions.scheduled)
        self._prefill_scheduled = prefill_scheduled
        admitted_prefill = False
        # Paused sessions keep their running slots through the scan.
        paused = self.paused_sessions()
        # Under a LoRA config: the adapters of the running requests, scheduled
        # in this step or not (each may join a later batch), and of those the
        # scan admits.
        adapters = self._running_adapters()
        while budget > 0 and len(self.running) + paused < self.max_num_seqs:
            # Paused with `wait`: only the requests that hold blocks.
            queue = self.holding if self.holding or self.paused else self.waiting
            if not queue:
                break
            live = queue[0]
            if live.load_in_flight or live.waiting_for_streaming_req:
                # Its KV is not here yet, or it waits for its next input chunk.
                live.counted_deferred = True
                skipped.append(queue.popleft())
                continue
            if self._over_lora_limit(live, adapters):
                # Before any lookup: it keeps its place, counted deferred.
                # vLLM's Scheduler has by then completed a reported load.
                if live.load_failed:
                    raise StepRefused(
                        "lora",
                        f"{live.name}'s failed asynchronous KV load, held back by the LoRA "
                        "adapter limit, is not modelled",
                    )
                if live.waiting_for_remote_kvs:
                    self._complete_load(live)
                live.counted_deferred = True
                (skipped if queue is self.holding else passed_over).append(queue.popleft())
                continue
            outputs = len(live.request.output)
            computed = live.request.num_computed_tokens
            # Read before the admission, which may also sample its first token.
            tokens_at_admission = live.request.num_tokens
            admitted = self.admit(live, decisions, budget, skipped, defer)
            if isinstance(admitted, int):
                # An admission with more than its last token to compute.
                hit = decisions.admitted[-1][1]
                admitted_prefill |= computed + hit < tokens_at_admission - 1
            if admitted is None:
                break
            if admitted == "loading":
                live.counted_deferred = True
                skipped.append(queue.popleft())
                continue
            if admitted == "skipped":
                live.counted_deferred = True
                passed_over.append(queue.popleft())
                continue
            queue.popleft()
            self.running.append(live)
            if live.request.inputs.lora:
                adapters.add(live.request.inputs.lora)
            live.admit()
            live.ever_admitted = True
            live.holds_blocks = live.counted_deferred = False
            budget -= admitted
            if self.async_scheduling:
                self._placed(live, admitted)
                continue
            live.decoding = len(live.request.output) > outputs  # it sampled
            if len(live.request.output) >= live.max_tokens or (
                live.stops_at_next_token and live.decoding
            ):
                finished.append(live)
        self.holding.extendleft(reversed(skipped))
        self.waiting.extendleft(reversed(passed_over))
        self._order_waiting()
        if not defer:
            # Requests still waiting after a release, besides those a scan
            # passed over since their last admission (vLLM counts those
            # deferred, in this step's scan or an earlier one): the cadence
            # holds none back.
            deferred = sum(live.counted_deferred for live in (*self.waiting, *self.holding))
            waiting_left = len(self.waiting) + len(self.holding) - deferred
            self.prefill_capacity_bound = waiting_left > 0
        self._cadence_after(decisions, prefill_scheduled, admitted_prefill)
        return finished

    def _running_adapters(self) -> set[str]:
        """The LoRA adapters of the running requests (none without a LoRA
        config)."""
        if not self.config.max_loras:
            return set()
        return {live.request.inputs.lora for live in self.running if live.request.inputs.lora}

    def _over_lora_limit(self, live: LiveRequest, adapters: set[str]) -> bool:
        """Whether admitting `live` would bring in one adapter more than
        `config.max_loras`: the running requests already hold that many, and
        its adapter is not one of them."""
        lora = live.request.inputs.lora
        limit = self.config.max_loras
        return bool(lora and limit) and len(adapters) >= limit and lora not in adapters

    def _defers_prefills(self) -> bool:
        """Whether this step's prefill compute waits for the cadence: an
        interval is set, the last release drained the waiting queue, fewer
        than the interval's executed steps have passed since the last step
        that carried prefill (this one counted), and a request decodes."""
        interval = self.config.prefill_schedule_interval
        return (
            interval > 1
            and not self.prefill_capacity_bound
            and self.num_executed_steps + 1 - self.last_prefill_step < interval
            and any(live.decoding for live in self.running)
        )

    def _cadence_after(
        self, decisions: StepDecisions, prefill_scheduled: bool, admitted_prefill: bool
    ) -> None:
        """Count a step that scheduled anything, and stamp one that carried
        prefill (a running request's chunk or an admission's)."""
        if decisions.scheduled:
            self.num_executed_steps += 1
        if self.config.prefill_schedule_interval > 1 and (prefill_scheduled or admitted_prefill):
            self.last_prefill_step = self.num_executed_steps

    def victim(self) -> LiveRequest:
        """The running request a failed allocation preempts: the last one,
        or under the priority policy the last in (priority, arrival) order."""
        if self.by_priority:
            return max(self.running, key=lambda live: live.rank)
        return self.running[-1]

    def preempt(self, decisions: StepDecisions, victim: LiveRequest) -> None:
        """Preempt running request `victim` (`free preempt`): back to the
        front of the waiting queue, its prefill to run again."""
        self._preempt(victim)
        decisions.preempted.append(victim.name)

    def _preempt(self, victim: LiveRequest, drop_stale: bool = False) -> None:
        """A running request freed (`free preempt`) and put back at the front
        of the waiting queue (under the priority policy, at its place): a
        step's preemption and a reset's (`drop_stale`: the output of its
        batches in flight is dropped rather than delivered)."""
        self.running.remove(victim)
        self._refuse_preempting_in_flight(victim)
        # An undrained dropped share stays dropped: its positions run again.
        victim.drop_stale_output = drop_stale or (victim.drop_stale_output and self._stale(victim))
        victim.stale_until = victim.last_batch if self._in_flight(victim) else 0
        # Its placeholders go (the stale output moves no counter).
        victim.placeholders = victim.placeholder_drafts = 0
        self.writer.run("free", req=victim.name, how="preempt")
        self.encoder.release_all(victim.name)
        self.waiting.appendleft(victim)
        self._order_waiting()
        victim.decoding = False
        victim.preempt()

    def _order_waiting(self) -> None:
        """Under the priority policy vLLM's waiting queue is a heap served
        in (priority, arrival) order, wherever a request is put back."""
        if self.by_priority:
            self.waiting = deque(sorted(self.waiting, key=lambda live: live.rank))

    def _unschedule(
        self, victim: LiveRequest, decisions: StepDecisions, finished: list[LiveRequest]
    ) -> int:
        """Undo `victim`'s run this step before it is preempted (the priority
        policy's victim may have been scheduled earlier in the step): the
        Scheduler drops it from the step and takes its tokens back into the
        budget; it never ran, so it sampled nothing and its computed tokens
        are the step's first; the items it was to encode go back to the
        step's encoder budget (its preemption then frees what it holds in
        the encoder cache). The tokens given back."""
        (entry,) = [e for e in decisions.scheduled if e[0] == victim.name]
        decisions.scheduled.remove(entry)
        items = victim.request.inputs.mm
        encoded = self._encoded.pop(victim.name, [])
        self.encoder_budget += sum(items[index].length for index in encoded)
        if self.config.vllm_defects == "fixed":
            # vLLM keeps these entries cached though never encoded; fixed, it
            # uncaches them, so the victim's chunk encodes them when it runs.
            for index in encoded:
                self.encoder.forget(victim.name, index)
        if victim in finished:
            finished.remove(victim)
        request = victim.request
        request.truncate_output(victim.sched_outputs)
        self.oracle.set_num_computed(request, victim.sched_computed)
        return entry[1]

    def admit(
        self,
        live: LiveRequest,
        decisions: StepDecisions,
        budget: int,
        skipped: list[LiveRequest],
        defer: bool = False,
    ) -> int | Literal["loading", "skipped"] | None:
        """Admit `live`, the head of its waiting queue, within `budget`: the
        tokens its first chunk runs (it is scheduled); "loading" when it now
        waits for its async KV load, holding blocks; None when it does not
        fit, or when it has more than its last token to compute and `defer`
        (the prefill cadence holds it back, after its lookup): the scan
        stops; "skipped" when the prefill lookahead leaves its chunk nothing
        (the scan goes on past it). `skipped`: the requests holding blocks
        this scan passed over."""
        # The scan reaching a failed load frees its blocks and looks it up
        # again right away (`lookup load_failed`), asking the connector
        # again: its retry loads.
        load_failed = live.load_failed
        if load_failed:
            live.end_remote_wait()
            live.holds_blocks = live.load_failed = False
            live.retried_load = True
            if live.remote is not None:
                live.remote = replace(live.remote, fails=False)
        if live.holds_blocks:
            admitted = self._admit_loaded(live, budget, defer)
            if admitted is None:
                return None
            hit, cost = 0, admitted
            if self.config.kv_connector:
                decisions.taken.append((live.name, 0, 0, False))
        else:
            if not live.ever_admitted and live.follows is not None:
                # Recorded for the manager-level trace, whose decode appends
                # the token it samples as it runs; the Scheduler sees the
                # request as this step found it.
                self.writer.check({"attention_cached": {live.follows: 0}})
                followed = self.oracle.requests[live.follows].request
                decisions.checked[live.name] = self.oracle.attention_cached(
                    followed, self._tokens_at_step_start.get(live.follows)
                )
            if live.resumable and self.config.hash_lookahead_tokens:
                live.request.rehash()
            looked_up = self._lookup(live, decisions, load_failed)
            if looked_up is None:
                return "skipped"  # the connector cannot answer yet
            hit, external, load_async = looked_up
            computed = live.request.num_computed_tokens + hit + external
            if defer and not load_async and computed < live.request.num_tokens - 1:
                return None
            need = self.writer.run("reserve", req=live.name)["blocks"]
            if not admission_fits(need, self.oracle.num_free_blocks()):
                if live.request.inputs.mm:
                    # vLLM's gate is in the allocation, after the chunk's
                    # encoder scheduling, whose holds a refusal gives back.
                    chunk = self._admission_chunk(live, hit + external, budget)
                    self._encoder_plan = None
                    if chunk == SKIP:
                        return "skipped"
                    if chunk is not None:
                        self.encoder.release_all(live.name)
                return None
            reserved = self._reserved_blocks(skipped) if load_async else 0
            live.sched_computed = live.request.num_computed_tokens + hit + external
            if load_async:
                # The load's blocks, nothing to compute: it waits for its KV,
                # keeping the in-flight prefills' blocks free.
                fields = {"reserved": reserved} if reserved else {}
                result = self.writer.run("allocate", req=live.name, tokens="auto", **fields)
                if not result["ok"]:
                    return None
                decisions.taken.append((live.name, hit, external, True))
                self._set_prefill_stats(live, hit + external)
                live.wait_for_remote_kvs()
                live.load_reported, live.holds_blocks = False, True
                live.load_started = self.engine_step
                return "loading"
            chunk = self._admission_chunk(live, hit + external, budget)
            if chunk == SKIP:
                return "skipped"
            if chunk is None:
                return None
            if not self._allocate(live, chunk, hit + external)():
                self.encoder.release_all(live.name)
                return None
            self._set_prefill_stats(live, hit + external)
            if self.config.kv_connector:
                decisions.taken.append((live.name, hit, external, False))
            cost = chunk[1]
        decisions.scheduled.append((live.name, cost))
        decisions.admitted.append((live.name, hit))
        return cost

    def _set_prefill_stats(self, live: LiveRequest, cached: int) -> None:
        """vLLM's Scheduler sets a request's prefill stats when it first
        admits it, a preempted one's not again."""
        if live.request.num_preemptions == 0:
            live.cached_at_admission = cached

    def _lookup(
        self, live: LiveRequest, decisions: StepDecisions, load_failed: bool = False
    ) -> tuple[int, int, bool] | None:
        """The admission's lookup: (local hit taken, external tokens, loaded
        asynchronously). With a KV connector the lookup carries what the
        external store holds (and whether the request's load just failed),
        and the question the Scheduler then puts to the connector is
        recorded; None when the connector answers "not yet" (the Scheduler
        passes over the request, admitting nothing of it this step)."""
        if not self.config.kv_connector:
            hit = int(self.writer.run("lookup", req=live.name)["hit"])
            decisions.lookups.append((live.name, hit))
            return hit, 0, False
        remote = live.remote or RemoteHit(0, False, 0)
        failed = {"load_failed": True} if load_failed else {}
        # An undecided connector's "not yet" loads nothing: the lookup is the
        # local one alone, and the next step looks the request up again.
        undecided = remote.undecided > 0
        result = self.writer.run(
            "lookup",
            req=live.name,
            remote_hit=0 if undecided else remote.tokens,
            remote_async=remote.load_async and not undecided,
            **failed,
        )
        local = int(result["local_hit"])
        decisions.lookups.append((live.name, local))
        presented = local - local % self.config.scheduler_block_size
        if undecided:
            live.remote = replace(remote, undecided=remote.undecided - 1)
            decisions.connector_queries.append((live.name, presented, None, False))
            return None
        answered = max(0, remote.tokens - presented)
        decisions.connector_queries.append(
            (live.name, presented, answered, remote.load_async and answered > 0)
        )
        external = int(result["external"])
        return int(result["hit"]), external, remote.load_async and external > 0

    def _admission_chunk(
        self, live: LiveRequest, hit: int, budget: int
    ) -> Chunk | Literal["skip"] | None:
        """The chunk of a request admitted from the waiting queue, `hit`
        tokens past its computed ones. With drafts, vLLM's Scheduler pads a
        chunk of one token to a whole speculative step (1 + K rows, the K
        placeholder drafts rejected) unless a running request ran a prefill
        chunk this step, or it is a first admission with nothing computed
        and no running request scheduled, or the rows would pass
        max_model_len; it admits nothing more when the budget cannot take
        the padded step, and drops the padding when the align-mode split
        cuts it. None: nothing to run (the scan stops)."""
        request = live.request
        computed = request.num_computed_tokens + hit
        padded = 1 + self.spec
        self._encoder_plan = None
        if (
            self.spec
            and request.num_tokens - computed == 1
            and not self._prefill_scheduled
            and (self._running_scheduled or computed > 0)
            and computed + padded + 1 <= self.config.max_model_len
        ):
            if padded > budget:
                return None
            offered = chunk_offer(self.config, padded, budget, self.num_eligible)
            if (
                chunk_tokens(self.config, request, offered, hit) == padded
                and self._plan_encoder(request, computed, padded) == padded
            ):
                return "auto", padded, self.spec
        return self._chunk(request, hit, budget)

    def _chunk(self, request: Request, hit: int, budget: int) -> Chunk | Literal["skip"] | None:
        """The next prefill chunk within `budget`: (as written, tokens run,
        padding rows); None when the split leaves nothing to run this step,
        `SKIP` when the prefill lookahead does."""
        self._encoder_plan = None
        start = request.num_computed_tokens + hit
        remaining = request.num_tokens - start
        offered = chunk_offer(self.config, remaining, budget, self.num_eligible)
        tokens = chunk_tokens(self.config, request, offered, hit)
        if tokens <= 0:
            return None
        tokens = self._plan_encoder(request, start, tokens)
        if tokens <= 0:
            return SKIP  # the encoder cannot run what the chunk starts with
        tokens = reserve_prefill_lookahead(self.config, request.num_tokens, start, tokens)
        if (
            tokens <= 0
            and self.config.vllm_defects == "fixed"
            and remaining <= budget
            and self._plan_encoder(request, start, remaining) == remaining
        ):
            # vLLM cuts the chunk to nothing at every step; fixed, it runs the
            # prompt to its end (its last chunk may end inside a block).
            tokens = remaining
        if tokens <= 0:
            return SKIP
        # `auto` is the replayer's chunk: the full budget, the threshold by the
        # trace's live requests. Written only when it is this chunk.
        most = self.config.max_num_scheduled_tokens
        full = chunk_offer(self.config, remaining, most, self.num_eligible)
        replayed = chunk_offer(self.config, remaining, most, self.writer.oracle.num_live())
        replayed_split = chunk_tokens(self.config, request, replayed, hit)
        replayed_tokens = reserve_prefill_lookahead(
            self.config, request.num_tokens, start, replayed_split
        )
        auto = offered == full and replayed_tokens == tokens
        return ("auto" if auto else tokens), tokens, 0

    def _plan_encoder(self, request: Request, start: int, tokens: int) -> int:
        """The chunk of `tokens` from `start` as the encoder leaves it (its
        plan kept for `_allocate`): cut before the first item over it that
        the step's encoder budget or the encoder cache cannot take."""
        items = request.inputs.mm
        self._encoder_plan = None
        if not items:
            return tokens
        plan = self.encoder.plan(
            request.request_id,
            items,
            start,
            tokens,
            self.encoder_budget,
            # The drafter reads the prefill tokens past the chunk (vLLM's
            # `num_prefill_lookahead_tokens`): at least the next one whenever
            # a drafter runs, with or without the eagle block drop.
            shift=max(self.config.prefill_lookahead, int(self.spec > 0)),
        )
        self._encoder_plan = plan
        return plan.tokens

    def _allocate(self, live: LiveRequest, chunk: Chunk, hit: int = 0) -> Callable[[], bool]:
        written, tokens, pad = chunk
        request = live.request
        plan, self._encoder_plan = self._encoder_plan, None
        # The chunk that computes every token samples the step's output token
        # (under async scheduling it comes with the batch's update instead).
        completes = request.num_computed_tokens + hit + tokens - pad >= request.num_tokens
        sample = int(completes and not self.async_scheduling)
        # Written only when padded: a trace without padding reads as before.
        extra = {"pad": pad} if pad else {}
        # The output's re-cache (with lookahead hashes) once the step is done.
        if sample and self.config.hash_lookahead_tokens:
            extra["defer_recache"] = True

        def run() -> bool:
            result = self.writer.run(
                "allocate",
                req=live.name,
                tokens=written,
                lookahead=self.spec,
                sample=sample,
                **extra,
                **self._in_flight_field(live),
            )
            if "cached_tokens" in result:  # the chunk completed the request's tokens
                live.cache_estimate = int(result["cached_tokens"])
            if result["ok"] and pad and self.async_scheduling:
                self._pad_computed(live, pad)
            if result["ok"] and plan is not None:
                # Scheduled: its items encoded, the encoder budget spent.
                self.encoder.commit(live.name, request.inputs.mm, plan)
                self.encoder_budget = plan.budget_left
                if plan.encode:
                    self._encoded[live.name] = list(plan.encode)
            return bool(result["ok"])

        return run

    def _decode(self, live: LiveRequest, drafts: int) -> Callable[[], bool]:
        # Written only when the budget cut the drafts short.
        lookahead = self.spec if drafts < self.spec else 0
        accepted = self._accept.get(live.name, 0)
        if accepted > drafts:
            raise StepRefused(
                "accept",
                f"{live.name} decodes with {drafts} drafts in this step (the token budget cut "
                f"them), fewer than the {accepted} accepted",
            )
        outputs = len(live.request.output) + 1 + accepted
        if accepted and outputs > live.max_tokens:
            # vLLM's Scheduler would drop the tokens past max_tokens.
            raise StepRefused(
                "accept",
                f"{live.name} would have {outputs} output tokens, past its max_tokens "
                f"{live.max_tokens}",
            )
        # Written only when the model runner accepts some.
        accepting: dict[str, Any] = {"accepted": accepted} if accepted else {}
        if drafts or self.config.hash_lookahead_tokens:
            # The output's re-cache once the step is done.
            accepting["defer_recache"] = True

        def run() -> bool:
            result = self.writer.run(
                "decode1", req=live.name, spec=drafts, lookahead=lookahead, **accepting
            )
            if result["ok"]:
                self._accept.pop(live.name, None)
            return bool(result["ok"])

        return run

    def accept(self, name: str, drafts: int) -> None:
        """`name` decodes in the next step and the model runner accepts the
        first `drafts` of its draft tokens: its computed tokens advance past
        them, and it outputs them and one token of its own."""
        self._accept[name] = drafts
