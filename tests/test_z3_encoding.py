"""The Z3 encoding: one transition per trace op, proofs, cores, the command.

Proofs here run at small bounds, to keep the default run fast;
`kvgate prove` (default bound) and `benchmarks/prove_scaling.py` run the
larger ones. That every mutation breaks induction, and yields a trace, is
`test_z3_counterexamples.py`.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import z3

from kvgate import cli
from kvgate.conformance.trace import load_trace
from kvgate.invariants.z3.checker import INIT, check_op, prove
from kvgate.invariants.z3.properties import INVARIANTS, LEMMAS, PROPERTIES, PROPERTY_BY_NAME
from kvgate.invariants.z3.transitions import (
    ENCODED_OPS,
    MUTATIONS,
    TRANSITIONS,
    Encoding,
    acts_on_request,
)
from kvgate.invariants.z3.vocabulary import Bounds, State
from kvgate.model import mutations as model_mutations
from kvgate.vocabulary.ops import PRIMITIVE_OPS

SMALL = Bounds(blocks=5, requests=2, groups=3)


def test_one_transition_per_primitive_op_but_check() -> None:
    """The action table and the encoding agree: every primitive op has a
    transition, `check` (which replays nothing) has none, nothing else has."""
    assert set(TRANSITIONS) == set(PRIMITIVE_OPS) - {"check"}
    encoding = Encoding(SMALL)
    s, t = State(SMALL, "s"), State(SMALL, "t")
    for op in ENCODED_OPS:
        r = 0 if acts_on_request(op) else None
        clauses = encoding.transition(op, s, t, r, f"x.{op}")
        assert all(name.startswith(f"{op}: ") for name, _ in clauses)
        # Each transition is satisfiable from some state that satisfies every
        # property: none is vacuous by a contradiction of its own.
        solver = z3.Solver()
        solver.add(*[p.holds(s) for p in PROPERTIES], *[c for _, c in clauses])
        assert solver.check() == z3.sat, op


def test_invariants_are_the_named_ones() -> None:
    names = [p.name for p in INVARIANTS]
    for required in (
        "no_leak",
        "one_hold",
        "reservation_covers_tail_swap",
        "free_queue_exact",
        "no_total_miss",
    ):
        assert required in names
    assert len(set(p.name for p in PROPERTIES)) == len(PROPERTIES)
    assert all(p.kind == "lemma" for p in LEMMAS)


def test_every_property_is_proved_at_a_small_bound() -> None:
    rows = prove(SMALL)
    failed = [(r.prop, r.op, r.violated) for r in rows if not r.proved]
    assert not failed
    assert len(rows) == len(PROPERTIES) * (1 + len(ENCODED_OPS))


def test_a_proof_names_the_lemmas_it_used() -> None:
    """The unsat core shows the strengthening: across `drain`, no_total_miss
    holds because a held block is the checkpoint (checkpoint_is_hold) and
    refs are exact (no_leak); the invariant alone is not inductive."""
    encoding = Encoding(SMALL)
    [row] = check_op(encoding, "drain", [PROPERTY_BY_NAME["no_total_miss"]], minimize=True)
    assert row.proved
    assert "pre checkpoint_is_hold" in row.used
    assert "pre no_leak" in row.used


def test_mutations_have_twins_in_the_model() -> None:
    assert set(MUTATIONS) == set(model_mutations.MUTATIONS)
    for name in MUTATIONS:
        assert model_mutations.MUTATIONS[name].target in {p.name for p in INVARIANTS}


def test_a_failed_check_names_the_clause_and_the_op() -> None:
    """Abort forgetting its holds breaks exact ref accounting across `free`,
    and only there; the row names the block and keeps the pre-state."""
    rows = prove(SMALL, "abort_keeps_hold", props=["no_leak"])
    failed = [r for r in rows if not r.proved]
    assert [r.op for r in failed] == ["free"]
    assert failed[0].violated and all(v.startswith("no_leak[b") for v in failed[0].violated)
    cti = failed[0].cti
    # Only a request that holds can leak so: the hold, or the fork's retention.
    assert cti is not None and (cti["hold_on"][()] or cti["retain_retired"][()])


def prove_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["prove", *args])
    return code, out.getvalue(), err.getvalue()


def test_prove_command_prints_the_table() -> None:
    code, out, _ = prove_cli("--blocks", "4", "--requests", "1", "--groups", "2", "--jobs", "1")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split() == ["invariant", "op", "result", "seconds"]
    rows = [line.split() for line in lines[2:-1]]
    assert len(rows) == len(PROPERTIES) * (1 + len(ENCODED_OPS))
    assert all(row[-2] == "proved" for row in rows)
    assert lines[-1].startswith(f"{len(rows)} of {len(rows)} proved")


def test_prove_command_writes_a_counterexample(tmp_path: Path) -> None:
    code, out, _ = prove_cli(
        *("--blocks", "5", "--requests", "1", "--groups", "2", "--jobs", "1"),
        *("--mutation", "abort_keeps_hold", "--out", str(tmp_path)),
    )
    assert code == 1
    failing = [line for line in out.splitlines() if line.startswith("no_leak ")]
    assert any(" free " in line and str(tmp_path) in line for line in failing)
    written = tmp_path / "abort_keeps_hold.no_leak.yaml"
    assert load_trace(written).config.num_blocks == 5


@pytest.mark.parametrize(
    "args",
    [["--blocks", "1"], ["--groups", "1"], ["--requests", "0"], ["--mutation", "nope"]],
)
def test_prove_command_bad_input_is_one_line(args: list[str]) -> None:
    code, out, err = prove_cli(*args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_prove_command_prints_rows_before_searching_and_times_a_search_out(
    tmp_path: Path,
) -> None:
    code, out, _ = prove_cli(
        *("--blocks", "5", "--requests", "1", "--groups", "2", "--jobs", "1"),
        *("--mutation", "abort_keeps_hold", "--out", str(tmp_path)),
        *("--search-timeout", "0.001"),
    )
    assert code == 1
    lines = out.splitlines()
    decided = lines.index(next(line for line in lines if "counterexample search follows" in line))
    searching = lines.index(
        next(line for line in lines if line.startswith("searching for a counterexample to "))
    )
    # Every cell's row came before the first search, the failed one included.
    assert decided < searching
    assert sum(line.endswith(tuple("0123456789")) for line in lines[:searching]) == len(
        PROPERTIES
    ) * (1 + len(ENCODED_OPS))
    timed_out = [line for line in lines[searching:] if line.startswith("no_leak ")]
    assert timed_out and "timed out: no counterexample within 0.001s" in timed_out[0]
    assert not (tmp_path / "abort_keeps_hold.no_leak.yaml").exists()


def test_proof_table_hands_over_each_op_as_it_is_decided() -> None:
    decided: list[list[str]] = []
    rows = prove(
        SMALL,
        "clean",
        props=["no_leak"],
        decided=lambda cells: decided.append([c.op for c in cells]),
    )
    assert decided == [[op] for op in (INIT, *ENCODED_OPS)]
    assert len(rows) == 1 + len(ENCODED_OPS)


def test_prove_command_refuses_a_search_timeout_of_zero() -> None:
    code, out, err = prove_cli("--search-timeout", "0")
    assert code == 2 and out == "" and "--search-timeout" in err
