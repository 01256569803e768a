"""Behaviour that truly differs between vLLM releases, named and explained.

The strict view leaves out state no caller can observe (`snapshot.EXCLUSIONS`);
what remains and still differs between releases is a real difference, and the
gate still fails on it. Each one analysed is listed here with the trace that
shows it, the exact first divergence it causes there, what happens, and
whether it is a bug; the report adds that explanation to the failing trace
(`known:`), so a reader sees a named difference rather than a bare failure.
A divergence matches only exactly (trace, step, level, a key missing from
the same block), so nothing else is ever explained away.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.conformance.replay import Divergence


@dataclass(frozen=True)
class KnownDifference:
    name: str
    trace: str  # the corpus trace that shows it
    step: int  # the step index of its first divergence there
    what: str  # the divergence's `what`, up to the block id ("block ", "hashes")
    explanation: str  # what the release does differently
    verdict: str  # bug or not, and why


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
)


def explain(divergence: Divergence) -> KnownDifference | None:
    """The known difference this first divergence is, if it is exactly one."""
    for known in KNOWN:
        if (
            divergence.trace == known.trace
            and divergence.step.index == known.step
            and divergence.level == "strict"
            and divergence.what.startswith("block ")
            and divergence.what.endswith(known.what)
            and isinstance(divergence.expected, tuple)
            and isinstance(divergence.actual, tuple)
            and set(divergence.actual) < set(divergence.expected)
        ):
            return known
    return None
