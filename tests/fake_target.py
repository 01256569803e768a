"""A toy target for testing the replayer, the report and the command line.

It is not a KV-cache manager: each allocate takes one block and computes up to
`CHUNK` tokens, a follow-up request (one whose prompt starts from another's)
hits `FOLLOW_UP_HIT` tokens only while the hold is on, and nothing is cached.
Subclasses each break one thing, so a test can tell which comparison caught it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from configs import trace_config, trace_text

from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.snapshot import BlockView, Snapshot
from kvgate.vocabulary.target import Capabilities, StepRefused

CHUNK = 64
FOLLOW_UP_HIT = 8


def fake_trace_text(steps: str, name: str, *, hold: bool = False, num_blocks: int = 96) -> str:
    """A trace whose config these targets run, with `steps` (YAML list items)."""
    return trace_text(steps, trace_config(num_blocks, hold=hold), name)


@dataclass
class _Request:
    prompt: int
    tokens: int
    follow_up: bool
    computed: int = 0
    hit: int = 0
    blocks: int = 0


class FakeTarget:
    has_hold = True

    def __init__(self, config: Config) -> None:
        self.config = config
        self.capabilities = Capabilities("fake", config.partial_hits, self.has_hold)
        self.free = config.num_blocks - 1
        self.requests: dict[str, _Request] = {}
        self.popped: dict[str, int] = {}
        self.seen: list[str] = []  # step.where() of every step applied
        self.closed = False

    def apply(self, step: Step) -> dict[str, Any]:
        self.seen.append(step.where())
        result: dict[str, Any] = getattr(self, f"_{step.op}")(step)
        result["free_blocks"] = self.free
        return result

    def _arrive(self, step: Step) -> dict[str, Any]:
        length = 0
        for segment in step.prompt:
            if segment.kind == "fresh":
                length += segment.count
            elif segment.kind == "tokens":
                length += len(segment.token_ids)
            else:
                assert segment.req is not None
                source = self.requests[segment.req]
                length += source.tokens if segment.kind == "all_of" else source.prompt
        follow_up = any(s.kind in ("all_of", "prompt_of") for s in step.prompt)
        assert step.req is not None
        self.requests[step.req] = _Request(length, length, follow_up)
        return {}

    def _lookup(self, step: Step) -> dict[str, Any]:
        request = self._request(step)
        hold_on = self.config.hold and self.has_hold
        request.hit = FOLLOW_UP_HIT if request.follow_up and hold_on else 0
        return {"hit": request.hit}

    def _reserve(self, step: Step) -> dict[str, Any]:
        return {"blocks": 1, "step_blocks": 1}

    def _allocate(self, step: Step) -> dict[str, Any]:
        request = self._request(step)
        hit = request.hit if request.blocks == 0 else 0
        start = request.computed + hit
        n = min(request.tokens - start, CHUNK) if step.tokens == "auto" else step.tokens
        assert n is not None
        ok = self.allocate_block()
        if ok:
            request.blocks += 1
            request.computed = start + n
            request.hit = 0
        return {"ok": ok, "tokens": n, "prompt_done": request.computed >= request.tokens}

    def allocate_block(self) -> bool:
        if self.free < 1:
            return False
        self.free -= 1
        return True

    def _decode1(self, step: Step) -> dict[str, Any]:
        request = self._request(step)
        if request.computed == request.tokens:
            request.tokens += 1
        request.computed += 1
        request.tokens += 1
        return {"ok": True}

    def _step(self, step: Step) -> dict[str, Any]:
        return {}

    def _drain(self, step: Step) -> dict[str, Any]:
        return {"copies": []}

    def _free(self, step: Step) -> dict[str, Any]:
        request = self._request(step)
        self.free += request.blocks
        request.blocks = 0
        if step.how == "preempt":
            request.computed = 0
        return {}

    def _pop(self, step: Step) -> dict[str, Any]:
        request = self._request(step)
        self.popped[step.req or ""] = request.blocks
        request.blocks = 0
        return {}

    def _release(self, step: Step) -> dict[str, Any]:
        self.free += self.popped.pop(step.req or "")
        return {}

    def _evict(self, step: Step) -> dict[str, Any]:
        n = self.free if step.blocks == "all" else step.blocks
        assert isinstance(n, int)
        if n > self.free:
            raise StepRefused("blocks", f"{n} blocks asked, {self.free} free")
        return {}

    def _request(self, step: Step) -> _Request:
        assert step.req is not None
        return self.requests[step.req]

    def check_values(self, query: Mapping[str, Any]) -> dict[str, Any]:
        values = {
            "pool_clean": self.free == self.config.num_blocks - 1,
            "free_blocks": self.free,
            "holds": {},
        }
        return {k: v for k, v in values.items() if k in query}

    def snapshot(self) -> Snapshot:
        used = self.config.num_blocks - 1 - self.free
        return Snapshot(
            free_queue=tuple(range(used + 1, self.config.num_blocks)),
            blocks=tuple(BlockView(0) for _ in range(self.config.num_blocks)),
            tables={r: ((q.blocks,),) for r, q in self.requests.items() if q.blocks},
            holds={},
            pending_copies=(),
            popped={r: (n,) for r, n in self.popped.items()},
        )

    def close(self) -> None:
        self.closed = True


class HoldlessFake(FakeTarget):
    """A build without the hold: follow-ups never hit."""

    has_hold = False


class LeakyFake(FakeTarget):
    """Forgets to return one block when a request is freed (seen at level api)."""

    def _free(self, step: Step) -> dict[str, Any]:
        result = super()._free(step)
        self.free -= 1
        return result


class ReversedQueueFake(FakeTarget):
    """Hands out the same number of blocks in another order (seen only at strict)."""

    def snapshot(self) -> Snapshot:
        snapshot = super().snapshot()
        return Snapshot(
            free_queue=snapshot.free_queue[::-1],
            blocks=snapshot.blocks,
            tables=snapshot.tables,
            holds=snapshot.holds,
            pending_copies=snapshot.pending_copies,
            popped=snapshot.popped,
        )


class RaisingFake(FakeTarget):
    """Crashes inside the manager on the first decode step."""

    def _decode1(self, step: Step) -> dict[str, Any]:
        raise RuntimeError("boom in decode\nsecond line of the message")


class StingyFake(FakeTarget):
    """Refuses every allocation, though blocks are free."""

    def allocate_block(self) -> bool:
        return False


class RefusingFake(FakeTarget):
    """Refuses a burst the model runs."""

    def _evict(self, step: Step) -> dict[str, Any]:
        raise StepRefused("blocks", "this target refuses every burst")


class PluginFake(FakeTarget):
    """Takes a plugin, as VllmTarget does, and says which hold ran."""

    def __init__(self, config: Config, plugin: str | None = None) -> None:
        super().__init__(config)
        self.capabilities = Capabilities("fake", config.partial_hits, True, f"plugin {plugin}")


class GroupsRefusedFake(FakeTarget):
    """Refuses every config, as a target does for one outside its space."""

    def __init__(self, config: Config) -> None:
        raise UnsupportedConfig("groups", "this target runs no Mamba groups")


class IntOkFake(FakeTarget):
    """Says `ok` with 1 and 0 instead of true and false."""

    def _allocate(self, step: Step) -> dict[str, Any]:
        result = super()._allocate(step)
        result["ok"] = int(result["ok"])
        return result


class SilentFake(FakeTarget):
    """Leaves `prompt_done` out of its allocate results."""

    def _allocate(self, step: Step) -> dict[str, Any]:
        result = super()._allocate(step)
        del result["prompt_done"]
        return result


class IdleFake(FakeTarget):
    """Allocates successfully but computes nothing."""

    def _allocate(self, step: Step) -> dict[str, Any]:
        return {"ok": True, "tokens": 0, "prompt_done": False}
