"""A refusal trace's verdict (`expect_refused`): the config is refused, by the
field the trace names, both by the target and by the model side.

The target is built from the config as for any trace: the vLLM target hands
the config to vLLM's own objects, so the refusal is vLLM's (mapped to the
field by `impl/vllm_errors.py`); the model side is kvgate's validation
(`config.validate`), its statement of the same rule. Nothing is replayed: a
target that accepts the config fails the trace, and so does a model side
that accepts it or names another field (kvgate's rule drifted from the
target's).
"""

from __future__ import annotations

import time

from kvgate.conformance.replay import (
    Divergence,
    DivergenceLevel,
    Level,
    ReplayResult,
    TargetFactory,
    TraceRunError,
)
from kvgate.conformance.trace import Trace, TraceError
from kvgate.model.scope import validate
from kvgate.vocabulary.config import Config, NotModelled, UnsupportedConfig
from kvgate.vocabulary.ops import CONFIG_STEP
from kvgate.vocabulary.target import Capabilities

__all__ = ["NOT_BUILT", "judge_refusal", "refusal_of", "refused_for_lacking"]

# A refused target has no capabilities to report.
NOT_BUILT = Capabilities(
    implementation="not built (config refused)", partial_hits=False, hold=False
)

ACCEPTED = "accepted (nothing replayed)"


def refused(error: UnsupportedConfig) -> tuple[str, str]:
    """A refusal's field and one-line account. kvgate's own (`NotModelled`)
    is not a field a refusal trace can name: it says nothing of vLLM."""
    if isinstance(error, NotModelled):
        return f"not modelled: {error.field}", (
            f"refused by kvgate, not modelled ({error.field}): {error.message}"
        )
    return error.field, f"refused by {error.field}: {error.message}"


def refusal_of(build: TargetFactory, config: Config) -> tuple[str | None, str, Capabilities]:
    """How `build` takes `config`: the field it refuses it by (None: accepted),
    a one-line account, and the built target's capabilities."""
    try:
        target = build(config)
    except UnsupportedConfig as error:
        return (*refused(error), NOT_BUILT)
    try:
        return None, ACCEPTED, target.capabilities
    finally:
        target.close()


def model_refusal(config: Config) -> tuple[str | None, str]:
    """The model side's verdict: kvgate's validation of the config."""
    try:
        validate(config)
    except UnsupportedConfig as error:
        return refused(error)
    return None, ACCEPTED


def refused_for_lacking(build: TargetFactory, trace: Trace) -> TraceRunError | None:
    """A refusal trace whose target refuses its config first for something
    its release lacks (a plain refusal: neither vLLM's rule nor kvgate's),
    by another field than the trace's: it cannot show the refusal the trace
    is about, so the trace is not applicable there, as a replay trace the
    target cannot build is."""
    try:
        build(trace.config).close()
    except UnsupportedConfig as error:
        if type(error) is UnsupportedConfig and error.field != trace.expect_refused:
            message = str(TraceError.unsupported(trace.path, error))
            return TraceRunError(trace, message, bug=False, config_refused=True)
    return None


def judge_refusal(trace: Trace, factory: TargetFactory, level: Level = "strict") -> ReplayResult:
    """Build the target for a refusal trace and judge it: a pass only when
    the target and the model both refuse the config by `expect_refused`."""
    assert trace.expect_refused is not None, "a refusal trace"
    started = time.perf_counter()
    want = trace.expect_refused
    got, account, capabilities = refusal_of(factory, trace.config)
    model_got, model_account = model_refusal(trace.config)

    def divergence(level: DivergenceLevel, expected: str, actual: str) -> Divergence:
        return Divergence(
            trace=trace.name,
            path=trace.path,
            step=CONFIG_STEP,
            level=level,
            what="config refusal",
            expected=expected,
            actual=actual,
        )

    failures: list[Divergence] = []
    if got != want:
        failures.append(divergence("expect", f"refused by {want}", account))
    if model_got != got:
        failures.append(divergence("api", model_account, account))
    elif model_got != want:  # both agree, on something the trace does not say
        failures.append(divergence("expect", f"refused by {want}", f"model: {model_account}"))
    return ReplayResult(
        trace=trace,
        level=level,
        capabilities=capabilities,
        steps_run=0,
        seconds=time.perf_counter() - started,
        divergence=failures[0] if failures else None,
        also=tuple(failures[1:]),
    )
