"""Behaviour that truly differs between vLLM releases, named and explained.

The strict view leaves out state no caller can observe (`snapshot.EXCLUSIONS`);
what remains and still differs between releases is a real difference, and the
gate still fails on it. Each one analysed is listed here with the trace that
shows it, the exact first divergence it causes there, what happens, and
whether it is a bug; the report adds that explanation to the failing trace
(`known:`), so a reader sees a named difference rather than a bare failure.
A divergence matches only exactly (trace, step, level, and either keys missing
from the same block or the same expected and actual values), so nothing else
is ever explained away; an explained difference keeps its verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.conformance.replay import Divergence


@dataclass(frozen=True)
class KnownDifference:
    name: str
    trace: str  # the corpus trace that shows it
    step: int  # the step index of its first divergence there
    # The divergence's `what`: at level strict, its end after a block id
    # ("hashes" for "block 17 hashes", or "engine step 3: block 12 hashes"),
    # where the release keys fewer entries than the model; at another level,
    # the whole `what`, with `expected` and `actual` as they must be.
    what: str
    explanation: str  # what the release does differently
    verdict: str  # bug or not, and why
    level: str = "strict"
    expected: object = None
    actual: object = None


KNOWN: tuple[KnownDifference, ...] = (
    KnownDifference(
        name="junction-eagle-peek",
        trace="abort-mid-prefill",
        step=15,
        what="hashes",
        explanation="under sparse retention with eagle on and every group flagged as the "
        "drafter's (vLLM's fallback, which the gate built before it flagged only the "
        "attention group as production does), vLLM 0.33.0 and 0.34.0 also key the Mamba "
        "state one block below a request's shared-prefix junction; vLLM 0.32.0 keys only "
        "the junction's state, as all three do with production's flags",
        verdict="a 0.32.0 bug only where every group is flagged (lost prefix hits, no "
        "wrong output); with production's flags no release keys that state, so the "
        "corpus no longer shows it",
    ),
    KnownDifference(
        name="accepted-drafts-keyed-late",
        trace="sched-mtp-accepted-drafts",
        step=3,
        what="hashes",
        explanation="with draft tokens, vLLM 0.33.0 and 0.34.0 key the blocks that a "
        "step's accepted drafts fill once the Scheduler has processed that step's output; "
        "vLLM 0.32.0 keys them only at the request's next allocation, so a lookup made in "
        "between misses them, and the blocks filled in a request's last step are never keyed",
        verdict="a 0.32.0 bug (lost prefix hits, no wrong output), fixed in 0.33.0, whose "
        "Scheduler keys a running request's full blocks after each output when drafts or "
        "output placeholders are in play",
    ),
    KnownDifference(
        name="priority-self-preemption-ends-scan",
        trace="sched-priority-preempts-lowest-running",
        step=8,
        level="expect",
        what="scheduled",
        expected=[("H", 1)],
        actual=[],
        explanation="under the priority policy, when a running request's allocation fails "
        "and it is itself the lowest-priority running request, it preempts itself; vLLM "
        "0.32.0 then ends the step's scan of the running requests, so the higher-priority "
        "ones after it are not scheduled in that step (here an empty step while H could "
        "run); vLLM 0.33.0 and 0.34.0 go on to them",
        verdict="a 0.32.0 bug (a step lost for the higher-priority requests, no wrong "
        "output), fixed in 0.33.0, whose Scheduler goes on scanning after such a "
        "self-preemption under the priority policy only",
    ),
    KnownDifference(
        name="rekeyed-hit-holds-back-siblings",
        trace="sched-first-turns-resume-from-one-cached-prefix",
        step=5,
        level="expect",
        what="scheduled",
        expected=[("W", 1), ("S1", 10), ("S2", 20)],
        actual=[("W", 1), ("S1", 10)],
        explanation="in Mamba cache mode align, a request admitted with a prefix-cache hit "
        "that ends at its prompt's last whole block keys that block's Mamba state again; "
        "vLLM 0.32.0 then counts the block as cached in this step even though an earlier "
        "step keyed it, so a request waiting in the same step whose hit ends on that block "
        "is refused its allocation as if the pool were full, which also ends the step's "
        "scan of the waiting queue; vLLM 0.33.0 leaves a block already keyed at that "
        "position alone and admits both",
        verdict="a 0.32.0 bug (a step's delay for requests resuming from a shared cached "
        "prefix, such as a system prompt, no wrong output), fixed in 0.33.0",
    ),
)


def explain(divergence: Divergence) -> KnownDifference | None:
    """The known difference this first divergence is, if it is exactly one."""
    for known in KNOWN:
        if (
            divergence.trace == known.trace
            and divergence.step.index == known.step
            and divergence.level == known.level
            and (
                _fewer_keys(divergence, known)
                if known.level == "strict"
                else _exact(divergence, known)
            )
        ):
            return known
    return None


def _fewer_keys(divergence: Divergence, known: KnownDifference) -> bool:
    """A block's keys, of which the release has a strict subset of the model's."""
    _, _, block = divergence.what.rpartition(": ")
    return (
        block.startswith("block ")
        and block.endswith(known.what)
        and isinstance(divergence.expected, tuple)
        and isinstance(divergence.actual, tuple)
        and set(divergence.actual) < set(divergence.expected)
    )


def _exact(divergence: Divergence, known: KnownDifference) -> bool:
    return (
        divergence.what == known.what
        and divergence.expected == known.expected
        and divergence.actual == known.actual
    )
