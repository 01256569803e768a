"""Property: no hostile input breaks the command line's contract (issue 13).

Hypothesis draws a kind of hostile input and a `random.Random` that shapes
it (`hostile_inputs.make_variant`: malformed, absurd or impossible traces,
special files, several traces at once, hostile flags of every command) and
runs it in this process. Whatever it is, the run ends with exit 0, 1 or 2
(3 would be a bug in kvgate's model), no traceback, errors of one line,
no raw control character, no verdict line that no trace owns, no pass of
an impossible step, JUnit XML that parses, and the process's memory under
`MEMORY_BOUND`. The longer campaign is `scripts/fuzz-input.py`; set
KVGATE_FUZZ_EXAMPLES to run more examples here.
"""

from __future__ import annotations

import os
import random
import resource
import tempfile
from pathlib import Path

from hostile_inputs import MUTATORS, make_variant, run_variant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "100"))
# The whole test process's resident high-water mark (vLLM, loaded by other
# tests, included); a variant that read /dev/zero or expanded 10**7 decode
# steps would pass it.
MEMORY_BOUND_MIB = 4096


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(kind=st.sampled_from(sorted(MUTATORS)), rng=st.randoms(use_true_random=False))
def test_hostile_input_ends_in_a_defined_exit_and_one_line(kind: str, rng: random.Random) -> None:
    variant = make_variant(rng, kind, refusals_only=True)
    with tempfile.TemporaryDirectory(prefix="kvgate-fuzz-") as workdir:
        outcome = run_variant(variant, Path(workdir))
    assert not outcome.problems, (
        variant.kind,
        variant.argv,
        outcome.problems,
        outcome.out[-400:],
        outcome.err[-400:],
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 < MEMORY_BOUND_MIB
