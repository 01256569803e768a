"""The fault campaign's faults of async scheduling with drafts: each applies
to the installed vLLM, and a bundled scheduler-level trace catches it.

The classes are the fault table's areas `in flight` (output placeholders and
blocks a batch in flight still holds), `draft hits` (the EAGLE/MTP margin
between attention and Mamba groups), `draft frees` (what rejected drafts give
back) and `align split` (the split near the prompt's end with the EAGLE block
drop). Each fault here replays one trace on vLLM's real Scheduler, unmutated
and mutated, so the whole file takes seconds; `kvgate mutate --target vllm`
runs every trace against every fault.
"""

from __future__ import annotations

import functools

import pytest
from configs import needs_vllm

from kvgate.conformance.trace import Trace, bundled_corpus
from kvgate.mutate.faults import BY_NAME, DRAFT_AREAS, FAULTS
from kvgate.mutate.inject import NotApplicable, at_site, injected
from kvgate.mutate.stages import TraceOutcome

# Each fault of the classes (`DRAFT_AREAS`) and a bundled scheduler-level
# trace that catches it: a deployment's scenario, not one written for the fault.
CAUGHT_BY = {
    "async-preempt-keeps-placeholders": "sched-mtp-async-preempted-with-output-in-flight",
    "async-free-on-optimistic-count": "sched-async-abort-frees-after-batch",
    "async-no-placeholder-for-prompt": "sched-mtp-async-drafts-around-a-mamba-block-boundary",
    "async-rejected-kept-as-placeholders": "sched-mtp-async-drafts-around-a-mamba-block-boundary",
    "rejected-drafts-kept-as-computed": "sched-mtp-async-drafts-around-a-mamba-block-boundary",
    "eagle-cache-margin-on-every-group": "sched-mtp2-prompt-tail-stop",
    "sched-split-tail-without-eagle-drop": "sched-mtp-accepted-drafts",
}


def test_every_fault_of_the_draft_classes_names_the_trace_that_catches_it() -> None:
    in_classes = {f.name for f in FAULTS if f.area in DRAFT_AREAS}
    assert in_classes == set(CAUGHT_BY)
    assert {BY_NAME[name].area for name in CAUGHT_BY} == set(DRAFT_AREAS)


@functools.cache
def _trace(name: str) -> Trace:
    from kvgate.mutate.stages import _scheduler_corpus

    [trace] = [t for t in _scheduler_corpus(bundled_corpus()) if t.name == name]
    return trace


@functools.cache
def _replayed(name: str) -> TraceOutcome:
    from kvgate.mutate.stages import _replay_on_scheduler

    return _replay_on_scheduler(_trace(name), "strict")


@needs_vllm
@pytest.mark.parametrize("fault", sorted(CAUGHT_BY))
def test_the_fault_applies_and_the_gate_catches_it(fault: str) -> None:
    from kvgate.mutate.stages import _replay_on_scheduler

    try:
        located = at_site(BY_NAME[fault])
    except NotApplicable as why:
        pytest.skip(f"{fault}: not applicable to the installed vLLM ({why})")
    trace = CAUGHT_BY[fault]
    stock = _replayed(trace)
    assert stock.passed, stock.failure
    with injected(located):
        mutated = _replay_on_scheduler(_trace(trace), "strict")
    assert mutated.built and not mutated.passed, f"{trace} passes with {fault}"
    assert mutated.failure
