"""What a Scheduler-level divergence is: a vLLM defect found already (the
machine drops the example and explores on), or a finding, told in one line."""

from __future__ import annotations

from kvgate.conformance.replay import Divergence

# How the summary counts the examples dropped at vLLM 0.33.0's exact-fit
# defect: an admission with a KV connector's tokens whose state block does
# not fit raises in `schedule()`, where the model leaves the request waiting.
KNOWN_DEFECT = "known vLLM defect (connector admission at an exact fit)"


def is_exact_fit_defect(divergence: Divergence, model_left_one_waiting: bool) -> bool:
    """`divergence` is that defect: vLLM's `schedule()` ran out of blocks in
    a step where the model left such an admission waiting."""
    return (
        model_left_one_waiting
        and divergence.what.endswith(": schedule() raised")
        and str(divergence.actual).startswith("ValueError: Cannot get")
    )


def describe(divergence: Divergence) -> str:
    """A divergence in one line: where, what, the model's and vLLM's value."""
    return (
        f"{divergence.step.where()}: {divergence.what}: kvgate's model "
        f"{divergence.expected!r}, vLLM's Scheduler {divergence.actual!r}"
    )
