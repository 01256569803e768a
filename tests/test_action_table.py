"""One action table: the trace parser, the op driver (both targets) and the
trace writer agree on the same ops."""

from __future__ import annotations

import inspect
from typing import Any

from kvgate.conformance.trace import bundled_corpus, load_corpus, parse_trace
from kvgate.conformance.writer import dump_trace
from kvgate.driver import op_driver as driver
from kvgate.model.target import ModelTarget
from kvgate.vocabulary.ops import ACTIONS, PRIMITIVE_OPS, Action, next_phase


def test_the_driver_runs_exactly_the_primitive_ops() -> None:
    handled = {name[len("_op_") :] for name in dir(driver.OpDriver) if name.startswith("_op_")}
    # `check` reads state instead of running an op; macros expand first.
    assert handled == set(PRIMITIVE_OPS) - {"check"}
    assert not {n for n, a in ACTIONS.items() if a.macro} & handled


def test_the_model_target_implements_every_hook() -> None:
    assert not inspect.isabstract(ModelTarget)


def test_the_vllm_target_implements_every_hook() -> None:
    from kvgate.impl.vllm_target import VllmTarget  # no vllm import at module level

    assert not inspect.isabstract(VllmTarget)


def test_written_traces_read_back_identically() -> None:
    for trace in load_corpus(bundled_corpus()):
        text = dump_trace(trace.name, trace.config, trace.steps, trace.about, trace.expect_refused)
        again = parse_trace(text)
        assert (again.config, again.primitives, again.expect_refused) == (
            trace.config,
            trace.primitives,
            trace.expect_refused,
        ), trace.name


def _admitted(guard: Any, phase: Any) -> set[str]:
    """The action table's phases a Z3 guard admits, `phase` the request's."""
    import z3

    from kvgate.invariants.z3.vocabulary import PHASE_NUMBER

    admitted: set[str] = set()
    for name, number in PHASE_NUMBER.items():
        solver = z3.Solver()
        solver.add(guard, phase == number)
        if solver.check() == z3.sat:
            admitted.add(name)
    return admitted


def _guard(clauses: list[tuple[str, Any]], op: str) -> Any:
    [guard] = [expr for name, expr in clauses if name == f"{op}: guard"]
    return guard


def _table_phases(action: Action) -> set[str]:
    folded = {"running", "decoding"}  # one Z3 phase
    return set(action.valid_in) | (folded if folded & action.valid_in else set())


def test_the_z3_guards_admit_exactly_the_phases_the_table_lists() -> None:
    import z3

    from kvgate.invariants.z3.transitions import Encoding
    from kvgate.invariants.z3.unbounded_transitions import UEncoding
    from kvgate.invariants.z3.unbounded_vocabulary import REQ, UState
    from kvgate.invariants.z3.vocabulary import Bounds, State

    bounds = Bounds(blocks=3, requests=1, groups=2)
    s, us, r = State(bounds, "s"), UState(2, "s"), z3.Const("r", REQ)
    for op, action in ACTIONS.items():
        if action.macro or not action.valid_in:
            continue
        bounded = _guard(Encoding(bounds).build(op, s, 0, "t").clauses, op)
        assert _admitted(bounded, s.phase[0]) == _table_phases(action), op
        unbounded = _guard(UEncoding(2).build(op, us, r, "t").clauses, op)
        assert _admitted(unbounded, us["phase"](r)) == _table_phases(action), op


def test_the_z3_phase_after_an_op_is_the_tables_next_phase() -> None:
    from kvgate.invariants.z3.vocabulary import PHASE_NUMBER, phase_after

    # The ops that move their request to another phase (the encodings set
    # each one's result with `phase_after`; the other ops leave it).
    for op in ("arrive", "allocate", "decode1", "free", "pop", "release"):
        for how in ("finish", "abort", "preempt") if op == "free" else (None,):
            for phase in ACTIONS[op].valid_in:
                assert phase_after(op, how) == PHASE_NUMBER[next_phase(op, phase, how)], op
