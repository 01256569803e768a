"""One action table: the trace parser, the op driver (both targets) and the
trace writer agree on the same ops."""

from __future__ import annotations

import inspect

from kvgate.conformance import driver
from kvgate.conformance.ops import ACTIONS, PRIMITIVE_OPS
from kvgate.conformance.trace import bundled_corpus, load_corpus, parse_trace
from kvgate.conformance.writer import dump_trace
from kvgate.model.target import ModelTarget


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
        again = parse_trace(dump_trace(trace.name, trace.config, trace.steps, trace.about))
        assert (again.config, again.primitives) == (trace.config, trace.primitives), trace.name


def test_the_z3_guards_admit_exactly_the_phases_the_table_lists() -> None:
    import z3

    from kvgate.invariants.z3.transitions import Encoding
    from kvgate.invariants.z3.vocabulary import PHASE_NUMBER, Bounds, State

    bounds = Bounds(blocks=3, requests=1, groups=2)
    s = State(bounds, "s")
    for op, action in ACTIONS.items():
        if action.macro or not action.valid_in:
            continue
        tx = Encoding(bounds).build(op, s, 0, "t")
        [guard] = [expr for name, expr in tx.clauses if name == f"{op}: guard"]
        admitted = set()
        for phase, number in PHASE_NUMBER.items():
            solver = z3.Solver()
            solver.add(guard, s.phase[0] == number)
            if solver.check() == z3.sat:
                admitted.add(phase)
        folded = {"running", "decoding"}  # one Z3 phase
        expected = set(action.valid_in) | (folded if folded & action.valid_in else set())
        assert admitted == expected, op
