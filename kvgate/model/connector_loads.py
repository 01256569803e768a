"""A KV connector's loads in kvgate's scheduler model, as vLLM's Scheduler
handles them: which loads the worker reports in a step, a loaded request's
admission (its load completed first), and the blocks an async load's
admission keeps free for the prefills in flight."""

from __future__ import annotations

from kvgate.model.scheduler_state import (
    SKIP,
    LiveRequest,
    SchedulerState,
    admission_fits,
)


class ConnectorLoads(SchedulerState):
    """A KV connector's loads, from the report to the admission."""

    def loading(self) -> bool:
        """An async KV load is in flight (progress even when nothing runs)."""
        return any(live.waiting_for_remote_kvs for live in self.holding)

    def _loads_in_flight(self) -> list[LiveRequest]:
        """The requests whose asynchronous KV load the worker has not
        reported yet: those waiting for it, then those aborted meanwhile
        (an aborted request stays in `aborted_loads` until its load is
        reported)."""
        waiting = [live for live in self.holding if live.load_in_flight]
        return waiting + [live for live in self.aborted_loads if not live.load_reported]

    def _admit_loaded(self, live: LiveRequest, budget: int, defer: bool) -> int | None:
        """Admit a request that holds blocks, without a lookup. When the scan
        first reaches it after the worker reported its load, the Scheduler
        completes the load (its blocks keyed; a load of every token leaves the
        last to compute) whatever follows: an `allocate complete_only` does
        that. Then, as any admission, it passes the full-sequence gate and
        allocates its chunk, unless `defer` (the prefill cadence) holds back
        a request with more than its last token to compute. The tokens run,
        or None when nothing runs (the scan stops; the request stays waiting
        with its blocks)."""
        if live.waiting_for_remote_kvs:
            self._complete_load(live)
        if defer and live.request.num_computed_tokens < live.request.num_tokens - 1:
            return None
        live.sched_computed = live.request.num_computed_tokens
        chunk = self._admission_chunk(live, 0, budget)
        # (Never a skip: a request holding blocks has a KV connector, whose
        # legacy hashes rule out a multi-module drafter's lookahead.)
        if chunk is None or chunk == SKIP:
            return None
        need = self.writer.run("reserve", req=live.name)["blocks"]
        if (
            not admission_fits(need, self.oracle.num_free_blocks())
            or not self._allocate(live, chunk)()
        ):
            self._encoder_plan = None
            self.encoder.release_all(live.name)
            return None
        return chunk[1]

    def _complete_load(self, live: LiveRequest) -> None:
        """The Scheduler completes a load the worker reported when its scan
        first reaches the request, whatever it then decides: its blocks
        keyed, and a load of every token leaves the last to compute (an
        `allocate complete_only`)."""
        self.writer.run("allocate", req=live.name, tokens="auto", complete_only=True)
        live.end_remote_wait()

    def _reserved_blocks(self, skipped: list[LiveRequest]) -> int:
        """The free blocks vLLM's Scheduler keeps when it admits an async KV
        load: what each in-flight prefill (a running request still in its
        prompt when the step began, even if this step's chunk completes it,
        or a waiting one holding blocks) needs to finish, from the
        computed tokens the Scheduler holds for it, plus a speculative step's
        attention blocks."""
        slots = 2 * self.spec + 1 if self.spec else 0  # 1 + K drafts + K lookahead
        manager = self.writer.oracle.manager
        # Waiting requests holding blocks, the ones this scan passed over too.
        holding = [*skipped, *self.holding]
        prefilling = self._prefilling_at_step_start
        inflight = [
            live for live in self.running if not live.decoding or live.name in prefilling
        ] + holding
        # Each as the Scheduler holds it during the scan: a token this step
        # sampled is not in its sequence yet.
        tokens = self._tokens_at_step_start
        reserved = sum(
            manager.blocks_to_finish(live.request, live.sched_computed, tokens[live.name], slots)
            for live in inflight
        )
        return reserved + sum(
            -(-slots // group.block_size)
            for group in self.config.groups
            if group.kind != "mamba_align"
        )

    def reported_loads(self) -> tuple[list[str], list[str]]:
        """The async loads the worker reports in this engine step's output,
        each `delay` steps after the step that started it: (finished,
        failed)."""
        loaded: list[str] = []
        failed: list[str] = []
        # Under `fail` vLLM's Scheduler frees each failed request's blocks in
        # the order of the worker's set of finished receives, which no model
        # can know: the worker reports one failure a step (a later one waits).
        one_failure = self.config.kv_load_failure_policy == "fail"
        # Likewise the blocks of aborted requests whose loads are reported:
        # one a step.
        aborted = 0
        for live in self._loads_in_flight():
            remote = live.remote
            if (
                remote is not None
                and self.engine_step - live.load_started >= remote.delay
                and not (remote.fails and one_failure and failed and not live.is_finished)
                and not (live.is_finished and aborted)
            ):
                live.load_reported = True
                live.load_failed = remote.fails
                aborted += live.is_finished
                (failed if remote.fails else loaded).append(live.name)
        return loaded, failed
