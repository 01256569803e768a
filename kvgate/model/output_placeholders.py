"""Output placeholders: what vLLM's `AsyncScheduler` schedules past an
output still in flight, and how a batch's output settles it.

Under async scheduling the Scheduler does not wait for a batch's output
before it schedules the next: a request's computed tokens advance at the
schedule by everything scheduled (prompt chunks, the decode's token, its
drafts), and its output tokens not yet delivered are counted as
placeholders (vLLM's `num_output_placeholders`: one for a batch that
completes the prompt, 1 + the drafts for a decode). A decode asks for the
tokens it knows, its placeholders and the placeholder drafts the last
schedule set (vLLM's `spec_token_ids` of -1s), less its computed tokens.

When the batch's output is processed: the drafts the model runner rejected
roll back the computed tokens and the placeholders; the sampled tokens (the
accepted drafts and one of its own) are appended one at a time, each
checked for a stop (`max_tokens`, `max_model_len`; a stop condition the
trace names is met at the last of them), the tokens past a stop trimmed
and taken back from the computed ones; the
placeholders drop by every token returned; then the request is re-cached up
to the tokens whose batches are processed (`cache_blocks(computed -
in_flight)`). A preempted request's output from before its preemption is
stale: its tokens are delivered, no counter moves. The manager sees the
optimistic counts as vLLM's does: an allocation caches only up to the
request's finalized tokens, and the release of skipped blocks counts only
processed ones (`Request.num_in_flight_tokens`)."""

from __future__ import annotations

from collections.abc import Callable

from kvgate.model.scheduler_state import Batch, LiveRequest, SchedulerState, StepDecisions
from kvgate.vocabulary.scheduling import OutputAccounting
from kvgate.vocabulary.target import StepRefused


class OutputPlaceholders(SchedulerState):
    """The placeholder arithmetic of vLLM's `AsyncScheduler`, per request."""

    # Filled while a batch is scheduled, then kept on its `Batch`.
    _batch_samples: set[str]
    _batch_drafts: dict[str, int]
    _batch_accepted: dict[str, int]
    # Drafts the model runner accepts in the batch this step schedules (`accept`).
    _accept: dict[str, int]
    # Drafts each request's allocation this step scheduled (a decode's, or a
    # padded admission's rows), read once it is placed in the batch.
    _scheduled_drafts: dict[str, int]

    def _start_batch(self) -> None:
        self._batch_samples, self._batch_drafts, self._batch_accepted = set(), {}, {}
        self._scheduled_drafts = {}

    def _take_batch(self) -> tuple[set[str], dict[str, int], dict[str, int]]:
        """What the batch just scheduled samples, its drafts and their
        acceptance; an `accept` for a request that decodes with no drafts in
        it is the trace's error."""
        unused = next(iter(self._accept), None)
        if unused is not None:
            self._accept.clear()
            raise StepRefused(
                "accept", f"{unused} does not decode with drafts in the batch this step schedules"
            )
        return self._batch_samples, self._batch_drafts, self._batch_accepted

    def _in_flight_tokens(self, live: LiveRequest) -> int:
        """`live`'s tokens in the batches in flight (vLLM's
        `num_in_flight_tokens`, a stale share included)."""
        return sum(
            n for batch in self.in_flight for name, n in batch.scheduled if name == live.name
        )

    @staticmethod
    def _stale_output(live: LiveRequest, batch: int) -> bool:
        """Batch number `batch`'s output for `live` is stale: the batch was
        in flight when `live` was preempted (numbers start at 1; without
        async scheduling no batch is in flight at a preemption)."""
        return 0 < batch <= live.stale_until

    def _stale_tokens(self, live: LiveRequest) -> int:
        """Its in-flight tokens whose output is stale (vLLM's
        `num_stale_output_tokens`)."""
        return sum(
            n
            for batch in self.in_flight
            if batch.number <= live.stale_until
            for name, n in batch.scheduled
            if name == live.name
        )

    def output_accounting(self) -> dict[str, OutputAccounting]:
        """Per live request with any: (output placeholders, tokens in
        flight, stale tokens in flight)."""
        counts = {
            live.name: (live.placeholders, self._in_flight_tokens(live), self._stale_tokens(live))
            for live in self._live()
        }
        return {name: c for name, c in counts.items() if any(c)}

    def _reaches_max_tokens(self, live: LiveRequest) -> bool:
        """vLLM skips a request whose batches in flight reach its
        `max_tokens` even if every draft in them is rejected."""
        request = live.request
        return (
            live.placeholders > 0
            and request.num_computed_tokens + 2 - live.placeholders
            >= request.num_prompt_tokens + live.max_tokens
        )

    def _placeholder_decode(
        self, live: LiveRequest, budget: int
    ) -> tuple[int, Callable[[], bool]] | None:
        """A running request past its prompt, scheduled on its placeholders:
        (tokens, the allocation), or None when it gets nothing this step."""
        request = live.request
        computed = request.num_computed_tokens
        wanted = request.num_tokens + live.placeholder_drafts + live.placeholders - computed
        tokens = min(wanted, budget, self.config.max_model_len - computed - 1)
        if tokens <= 0:
            return None
        # The placeholder drafts the tokens reach past the known and placeholder ones.
        past = tokens + computed - request.num_tokens - live.placeholders
        drafts = max(0, min(live.placeholder_drafts, past))

        def run() -> bool:
            request.num_in_flight_tokens = self._in_flight_tokens(live)
            ok = self.oracle.allocate_slots(request, tokens, 0, None, self.spec)
            if ok:
                request.num_computed_tokens += tokens
                self._scheduled_drafts[live.name] = drafts
            return ok

        return tokens, run

    def _placed(self, live: LiveRequest, tokens: int) -> None:
        """`live` scheduled `tokens` in this batch (its computed tokens
        already advanced, a padded admission's rows but its first token
        still to add): vLLM's after-schedule bookkeeping."""
        request = live.request
        drafts = self._scheduled_drafts.pop(live.name, 0)
        request.num_in_flight_tokens = self._in_flight_tokens(live) + tokens
        prefill_chunk = request.num_computed_tokens < request.num_tokens + live.placeholders
        live.decoding = not prefill_chunk
        live.placeholder_drafts = 0
        if not prefill_chunk:
            live.placeholders += 1 + drafts
            live.placeholder_drafts = self.spec
            self._batch_samples.add(live.name)
        if drafts:
            self._batch_drafts[live.name] = drafts
            accepted = self._accept.pop(live.name, 0)
            if accepted > drafts:
                raise StepRefused(
                    "accept",
                    f"{live.name} decodes with {drafts} drafts in the batch this step schedules, "
                    f"fewer than the {accepted} accepted",
                )
            self._batch_accepted[live.name] = accepted

    def _pad_computed(self, live: LiveRequest, pad: int) -> None:
        """A padded admission's rows count as computed at the schedule, as
        the decode's drafts do (the rejected ones roll back at the update)."""
        live.request.num_computed_tokens += pad
        self._scheduled_drafts[live.name] = pad

    def _settle(self, decisions: StepDecisions, batch: Batch) -> None:
        """Process `batch`'s output (see the module's docstring), then the
        finishes and what else an output brings (`_process_output`)."""
        by_name = {live.name: live for live in self._live()}
        for each in self._live():
            each.request.num_in_flight_tokens = self._in_flight_tokens(each)
        stopping = [live for live in self._live() if live.stops_at_next_token]
        for stops in stopping:
            if stops.name not in batch.samples:
                raise StepRefused(
                    "stop",
                    f"{stops.name} samples nothing in the batch whose output this step processes "
                    "(under async scheduling a stop applies to that batch)",
                )
        sampled: dict[str, list[int]] = {}
        finished: list[LiveRequest] = []
        for name, _ in batch.scheduled:
            sampled[name] = []
            found = by_name.get(name)
            if found is None or found.is_finished or name not in batch.samples:
                continue
            live = found
            stale = self._stale_output(live, batch.number)
            if stale and live.drop_stale_output:
                continue
            request = live.request
            drafts = batch.drafts.get(name, 0)
            accepted = batch.accepted.get(name, 0)
            if drafts and not stale:
                rejected = drafts - accepted
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= rejected
                if live.placeholders > 0:
                    live.placeholders -= rejected
            had_placeholders = live.placeholders > 0
            running = live in self.running
            returned = self.oracle.fresh.take(1 + accepted)
            kept: list[int] = []
            stopped = False
            for token in returned:
                kept.append(token)
                outputs = len(request.output) + len(kept)
                # A stop condition (`stop`) is met at the last token returned.
                if (
                    (live.stops_at_next_token and len(kept) == len(returned))
                    or outputs >= live.max_tokens
                    or request.num_tokens + len(kept) >= self.config.max_model_len
                ):
                    stopped = True
                    break
            if not stale:
                request.num_computed_tokens -= len(returned) - len(kept)
                if live.placeholders > 0:
                    live.placeholders -= len(returned)
            self.oracle.append_output(request, kept)
            if not stale and running and (had_placeholders or self.spec > 0):
                self.oracle.cache_blocks(
                    request, request.num_computed_tokens - request.num_in_flight_tokens
                )
            sampled[name] = returned  # the model runner's output, before the trim
            if stopped:
                finished.append(live)
        self._process_output(decisions, sampled, finished, batch.number)
        for stops in stopping:
            stops.stops_at_next_token = False
