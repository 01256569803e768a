"""The unbounded encoding: every invariant proved for every pool size, every
mutation failing it too, and its transitions neither vacuous nor looser
than the manager.

The default run proves the whole table with one attention and one Mamba
group and checks each mutation's known failing cell; `KVGATE_FULL_PROOFS=1`
runs the whole table at three groups and every mutation's whole table
through `kvgate prove --unbounded` (minutes).
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import z3

from kvgate import cli
from kvgate.conformance.trace import load_trace
from kvgate.invariants.z3.properties import INVARIANTS
from kvgate.invariants.z3.transitions import ENCODED_OPS, MUTATIONS, Encoding, acts_on_request
from kvgate.invariants.z3.unbounded_proof import check_uop, prove_unbounded
from kvgate.invariants.z3.unbounded_properties import UINVARIANTS, UPROPERTIES, UPROPERTY_BY_NAME
from kvgate.invariants.z3.unbounded_transitions import UEncoding
from kvgate.invariants.z3.unbounded_vocabulary import BLOCK, COPY, REQ, UState, finite
from kvgate.invariants.z3.vocabulary import RUNNING, WAITING
from kvgate.model import mutations as model_mutations

FULL = os.environ.get("KVGATE_FULL_PROOFS") == "1"
full_only = pytest.mark.skipif(not FULL, reason="set KVGATE_FULL_PROOFS=1 (minutes)")

# Each mutation's first failing cell under the unbounded encoding (one
# attention, one Mamba group): the lemma or invariant, across the op.
FAILS = {
    "hold_off": ("checkpoint_is_hold", "allocate"),
    "no_admission_extra": ("hold_reserved", "allocate"),
    "abort_keeps_hold": ("no_leak", "free"),
    "cow_copy_unreferenced": ("no_leak", "allocate"),
    "touch_keeps_queued": ("free_queue_exact", "allocate"),
    "superseded_hold_kept": ("one_hold", "allocate"),
    "no_follow": ("checkpoint_is_hold", "decode1"),
}


def test_invariants_keep_the_bounded_names() -> None:
    assert [p.name for p in UINVARIANTS] == [p.name for p in INVARIANTS]
    assert len({p.name for p in UPROPERTIES}) == len(UPROPERTIES)


def test_mutations_break_hooks_both_encodings_have() -> None:
    assert set(MUTATIONS) == set(FAILS)
    for name in MUTATIONS:
        assert model_mutations.MUTATIONS[name].breaks, name
        for hook in model_mutations.MUTATIONS[name].breaks:
            assert callable(getattr(Encoding, hook, None)), (name, hook)
            assert callable(getattr(UEncoding, hook, None)), (name, hook)


def test_every_property_is_proved_for_every_size() -> None:
    rows = prove_unbounded(groups=2)
    failed = [(r.prop, r.op, r.sizes, r.unknown) for r in rows if not r.proved]
    assert not failed
    assert len(rows) == len(UPROPERTIES) * (1 + len(ENCODED_OPS))
    # The proofs use their lemmas: across an allocation, no_total_miss rests
    # on a checkpoint being held (the bounded proof's strengthening too).
    [row] = [r for r in rows if (r.prop, r.op) == ("no_total_miss", "allocate")]
    assert "pre checkpoint_is_hold" in row.used


@pytest.mark.parametrize("op", ENCODED_OPS)
def test_each_transition_is_satisfiable_from_an_invariant_state(op: str) -> None:
    """No proof is vacuous by a transition that contradicts itself or the
    invariants: each op can fire from some state that satisfies them all
    (on a finite instance: 4 blocks, 2 requests, 3 copies). Allocations do
    their interesting part: a new request copies a partial hit and holds
    its source; a running one moves its keyed tail and holds the copy."""
    s = UState(2, "s")
    r = z3.Const("r", REQ) if acts_on_request(op) else None
    tx = UEncoding(2).build(op, s, r, "x")
    solver = z3.Solver()
    solver.set("timeout", 30_000)
    for sort, size, name in ((BLOCK, 4, "b"), (REQ, 2, "q"), (COPY, 3, "c")):
        solver.add(finite(sort, size, name)[1])
    solver.add(*[p.holds(s) for p in UPROPERTIES], *[c for _, c in tx.named()])
    t = tx.view()
    if op in ("allocate", "decode1"):
        b = z3.Const("x.srcblock1" if op == "allocate" else "x.tailblock1", BLOCK)
        before = s["hit_source1"](r, b) if op == "allocate" else s["pending_tail1"](r, b)
        solver.add(z3.Bool("x.ok"), s["hold_on"], before, s["has_hit"](r))
        h = z3.Const("held", BLOCK)
        solver.add(z3.Exists([h], z3.And(t["hold1"](r, h), t["hold_token1"](r, h))))
        solver.add(s["phase"](r) == (WAITING if op == "allocate" else RUNNING))
    assert solver.check() == z3.sat, op


def test_the_hold_alone_takes_a_retired_checkpoint() -> None:
    """The align-mode knobs' path is a transition, not a contradiction: in
    a group keeping more partial states (prefill checkpoint blocks), with
    the hold on and the fork's retention off, a running request's
    `remove_skipped` drops a mid-block keyed state that becomes its hold
    (finite instance: 4 blocks, 2 requests, 3 copies)."""
    s = UState(2, "s")
    r = z3.Const("r", REQ)
    tx = UEncoding(2).build("decode1", s, r, "x")
    solver = z3.Solver()
    solver.set("timeout", 30_000)
    for sort, size, name in ((BLOCK, 4, "b"), (REQ, 2, "q"), (COPY, 3, "c")):
        solver.add(finite(sort, size, name)[1])
    solver.add(*[p.holds(s) for p in UPROPERTIES], *[c for _, c in tx.named()])
    t, kept = tx.view(), z3.Const("x.retired1", BLOCK)
    solver.add(s["hold_on"], z3.Not(s["retain_retired"]), s["more_partial_states1"])
    solver.add(s["table1"](r, kept), s["tail_keyed"](kept), t["hold1"](r, kept))
    assert solver.check() == z3.sat
    # ... and only through the switch: without it the hold alone retires nothing.
    solver.add(z3.Not(s["more_partial_states1"]))
    assert solver.check() == z3.unsat


@pytest.mark.parametrize("mutation", sorted(FAILS))
def test_every_mutation_fails_for_every_size_too(mutation: str) -> None:
    prop, op = FAILS[mutation]
    [row] = check_uop(2, mutation, op, [UPROPERTY_BY_NAME[prop]])
    assert not row.proved and not row.unknown, row
    assert row.sizes is not None  # a finite counterexample to induction


def prove_cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["prove", "--unbounded", *args])
    return code, out.getvalue()


@full_only
def test_prove_unbounded_command_proves_the_whole_table() -> None:
    code, out = prove_cli("--jobs", "2", "--cores")
    assert code == 0, out
    rows = [line for line in out.splitlines() if line.endswith(tuple("0123456789"))]
    assert len(rows) == len(UPROPERTIES) * (1 + len(ENCODED_OPS))
    assert "unsat cores" in out


@full_only
@pytest.mark.parametrize("mutation", sorted(FAILS))
def test_prove_unbounded_command_writes_each_mutation_trace(mutation: str, tmp_path: Path) -> None:
    code, out = prove_cli("--jobs", "2", "--mutation", mutation, "--out", str(tmp_path))
    assert code == 1, out
    target = model_mutations.MUTATIONS[mutation].target
    written = tmp_path / f"{mutation}.{target}.yaml"
    assert load_trace(written).steps, out
    assert str(written) in out
    with contextlib.suppress(StopIteration):
        next(line for line in out.splitlines() if "unknown (" in line)
        pytest.fail(f"a cell gave up: {out}")
