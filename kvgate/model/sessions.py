"""Streaming-input sessions in kvgate's scheduler model (vLLM's
`resumable` requests): a session that stops keeps its blocks and takes its
next input chunk, or waits for it; its end finishes it."""

from __future__ import annotations

from kvgate.model.scheduler_state import (
    LiveRequest,
    SchedulerState,
)
from kvgate.vocabulary.ops import Segment
from kvgate.vocabulary.target import StepRefused


class StreamingSessions(SchedulerState):
    """Streaming-input sessions: their chunks, stops and end."""

    def chunk(self, name: str, prompt: tuple[Segment, ...], max_tokens: int) -> list[int]:
        """Session `name`'s next input chunk arrives (its token ids are
        returned): a paused session takes it at once, one still running
        queues it for its next stop."""
        live = self._session(name)
        tokens = self.oracle.resolve(prompt)
        if live.waiting_for_streaming_req:
            self._take_chunk(live, tokens, max_tokens)
        else:
            live.chunks.append((tokens, max_tokens))
        return tokens

    def end_session(self, name: str) -> None:
        """Session `name` ends: a paused one at once (vLLM aborts it, `free
        abort`), one still running at its next stop (a plain finish)."""
        live = self._session(name)
        if live.waiting_for_streaming_req:
            self.holding.remove(live)
            self._end(live, "abort")
        else:
            live.chunks.append(None)

    def _session(self, name: str) -> LiveRequest:
        for live in self._live():
            if live.name == name and live.resumable:
                return live
        raise StepRefused("req", f"{name!r} is no streaming-input session still open")

    def _take_chunk(self, live: LiveRequest, tokens: list[int], max_tokens: int) -> None:
        """A stopped session takes its next input chunk: its tokens rewritten
        as vLLM's Scheduler rewrites them (`Request.continue_session`), its
        blocks kept; it waits to resume from its computed tokens."""
        request = live.request
        total = request.num_tokens - 1 + len(tokens)
        if total + max_tokens > self.config.max_model_len:
            raise StepRefused(
                "max_tokens",
                f"{live.name}'s session of {total:,} tokens + {max_tokens:,} output tokens, "
                f"more than config.max_model_len {self.config.max_model_len:,}",
            )
        # Not a manager call: vLLM's Scheduler rewrites the request between
        # manager calls, and the manager's state (blocks, references, keyed
        # blocks) is unchanged by it. The manager steps written from here on
        # therefore replay only beside this rewrite, not as a manager-level
        # trace of their own (the workload, which saves them, sends no chunks).
        request.continue_session(tokens)
        # Its new prompt tokens are to compute: it is prefilling again.
        self.oracle.requests[live.name].phase = "running"
        live.max_tokens = max_tokens
        live.decoding = live.stops_at_next_token = False
        live.take_streaming_req()

    def _stop_session(self, live: LiveRequest) -> bool:
        """A session stopped (its output generated, or a stop condition): it
        keeps its blocks and takes its next queued chunk, or waits for one;
        False when the chunk queued next is its end (it finishes, with its
        stop's status)."""
        if live.chunks and live.chunks[0] is None:
            live.chunks.popleft()
            return False
        live.stops_at_next_token = live.decoding = False
        if live.chunks:
            queued = live.chunks.popleft()
            assert queued is not None
            self._take_chunk(live, *queued)
        else:
            # vLLM's Scheduler counts it deferred from now on.
            live.counted_deferred = True
            live.wait_for_streaming_req()
        live.holds_blocks = True
        return True

    def paused_sessions(self) -> int:
        """Sessions waiting for their next input chunk: each keeps a running
        slot of the model runner (vLLM counts them against max_num_seqs)."""
        return sum(live.waiting_for_streaming_req for live in self.holding)
