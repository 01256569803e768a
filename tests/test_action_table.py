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
