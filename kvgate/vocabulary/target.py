"""What a replay needs from a target: apply one primitive op, show its state.

Targets: the executable model (`kvgate.model.ModelTarget`) and the real vLLM
`KVCacheManager` (`kvgate.impl.vllm_target.VllmTarget`). Both implement the op
semantics of the trace format's table, one manager call per op.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.snapshot import Snapshot, StepView


@dataclass(frozen=True)
class Capabilities:
    """What the implementation behind a target can do."""

    implementation: str  # e.g. "kvgate model", "vllm 0.33.0"
    partial_hits: bool  # sub-block (hash-unit) Mamba hits with CoW
    hold: bool  # the partial-tail checkpoint hold (trace field `retain_checkpoint`)
    hold_source: str = ""  # which hold implementation ran, when `hold`
    retain_retired: bool = False  # the fork's retention of retired states (`retain_retired`)
    # The vLLM release whose behaviour this is: the installed vLLM's version,
    # or the release the model follows; empty when none is built.
    release: str = ""


class StepRefused(Exception):
    """The trace asks for something this state cannot do (an invalid trace).

    Raised before the target changes anything; `field` names the step field.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class Target(Protocol):
    capabilities: Capabilities

    def apply(self, step: Step) -> dict[str, Any]:
        """Run one primitive op (never `check`).

        Returns what the manager's callers saw: the op's `expect` keys that
        apply (`hit`; `ok`, `tokens`; `blocks`, `step_blocks`; `copies` as a
        list of [src, dst] ids) and always `free_blocks`.

        `allocate` also reports `prompt_done`: True when, after the call, every
        token of the request is computed (num_computed_tokens >= num_tokens,
        output tokens of a preempted request included). It is not a manager
        observation and is never compared; the replayer reads it to know when
        a `prefill` macro's allocate loop ends.
        """
        ...

    def check_values(self, query: Mapping[str, Any]) -> dict[str, Any]:
        """The values a `check` step compares, for the keys in `query`.

        `pool_clean`, `free_blocks`, `holds` ({req: {group: pos}}), and the
        parametrised `ref` ({R: {G: {P: ref or None}}}) and `attention_cached`
        ({R: tokens}) answered for the requests and positions `query` names.
        A key missing from the answer is one this target cannot observe: a
        replay refuses it by name instead of passing it.
        """
        ...

    def snapshot(self) -> Snapshot: ...

    def close(self) -> None: ...


class WatchedTarget:
    """A target that calls `after_step(step, target)` after every op it runs:
    to take a snapshot each step, or check invariants on it."""

    def __init__(self, inner: Target, after_step: Callable[[Step, Target], None]) -> None:
        self.inner = inner
        self.after_step = after_step
        self.capabilities = inner.capabilities

    def apply(self, step: Step) -> dict[str, Any]:
        observed = self.inner.apply(step)
        self.after_step(step, self.inner)
        return observed

    def check_values(self, query: Mapping[str, Any]) -> dict[str, Any]:
        return self.inner.check_values(query)

    def snapshot(self) -> Snapshot:
        return self.inner.snapshot()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # The inner target's step views and `forget`, when it has them.
        if name in ("take_changed_blocks", "step_view", "forget"):
            return getattr(self.inner, name)
        raise AttributeError(name)


class StepViewing(Protocol):
    """A target whose strict view can be read a step at a time (`StepView`):
    the lockstep then compares what each step touched, and the whole view at
    intervals. A target without these methods is compared whole every step."""

    def take_changed_blocks(self) -> set[int]:
        """Ids of the blocks whose ref count, keys or place in the free queue
        this target changed since the last call, as far as it can tell
        cheaply (the lockstep adds the other side's)."""
        ...

    def step_view(self, blocks: Collection[int], requests: Collection[str]) -> StepView:
        """The strict view of `blocks` and `requests` (see `StepView`)."""
        ...


def step_viewing(target: object) -> StepViewing | None:
    """`target` as a `StepViewing` one, if it is."""
    if hasattr(target, "take_changed_blocks") and hasattr(target, "step_view"):
        return target
    return None
