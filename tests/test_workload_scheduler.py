"""The workload on vLLM's real `Scheduler`, in lockstep with kvgate's scheduler model.

A reduced workload (every token count / 32, four sessions x three turns) at
the smallest unit and at the Mamba block, both builds, hold on (the overlay)
and off, compared at strict level every engine step; the counts the real
scheduler's observations give are the model's on the same trace; a
scheduler built with other settings, or one that raises mid-run, is a
divergence at that step; a request or config the Scheduler refuses is one
line, exit 2.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm
from scheduler_runs import Wrapped

from kvgate import cli, targets
from kvgate.conformance.replay import replay
from kvgate.conformance.trace import TraceError, load_trace
from kvgate.model import ModelTarget
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.target import StepRefused
from kvgate.vocabulary.tokens import HashInputs
from kvgate.workload import command
from kvgate.workload.deployment import Deployment
from kvgate.workload.lockstep import SchedulerFactory, run_on_scheduler, scheduler_arm
from kvgate.workload.measure import Recorder, count
from kvgate.workload.plan import Workload, make_plan
from kvgate.workload.progress import Progress
from kvgate.workload.runner import Arm, ArmResult

pytestmark = needs_vllm

SCALE = 32
WORKLOAD = Workload(sessions=4, turns=3)
PLUGIN = "kvgate.impl.hold_overlay"


@pytest.fixture(autouse=True, scope="module")
def _overlay_uninstalled_after() -> Iterator[None]:
    """These runs load the overlay into vLLM; no later test may run on it."""
    from kvgate.impl import hold_overlay

    before = hold_overlay.is_registered()
    yield
    if not before and hold_overlay.is_registered():
        hold_overlay.unregister()


UNITS = (64 // SCALE, 4096 // SCALE)


def _quiet() -> Progress:
    return Progress(stream=io.StringIO())


def _scheduler(plugin: str | None = PLUGIN) -> SchedulerFactory:
    factory: Any = targets.target_factory("vllm-scheduler")
    return functools.partial(factory, plugin=plugin) if plugin else factory


@pytest.fixture(scope="module")
def arms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[ArmResult]]:
    out = tmp_path_factory.mktemp("scheduler")
    results: dict[str, list[ArmResult]] = {}
    for build in ("fork", "upstream"):
        deployment = Deployment(build=build).scaled(SCALE)
        results[build] = [
            scheduler_arm(
                WORKLOAD, deployment, Arm(unit, hold), _scheduler(), out, "strict", _quiet()
            )
            for unit in UNITS
            for hold in (False, True)
        ]
    return results


@pytest.mark.parametrize("build", ["fork", "upstream"])
def test_real_scheduler_keeps_lockstep_with_the_model_at_strict_level(
    arms: dict[str, list[ArmResult]], build: str
) -> None:
    for result in arms[build]:
        assert result.replay is not None and result.counts is not None, result.skipped
        assert result.replay.passed, result.replay.divergence
        assert result.replay.capabilities.implementation.endswith("Scheduler")
        assert result.replay.level == "strict"
        # Every follow-up was admitted on the real scheduler and counted.
        assert len(result.counts.follow_ups) == WORKLOAD.sessions * (WORKLOAD.turns - 1)


@pytest.mark.parametrize("build", ["fork", "upstream"])
def test_counts_on_the_real_scheduler_are_the_models_on_the_same_trace(
    arms: dict[str, list[ArmResult]], build: str
) -> None:
    for result in arms[build]:
        recorder = Recorder(ModelTarget(result.trace.config))
        replayed = replay(load_trace(result.trace.path), recorder, None, "api")
        assert replayed.passed, replayed.divergence
        assert count(recorder, result.trace.config) == result.counts


def _one_arm(
    tmp_path: Path,
    factory: SchedulerFactory,
    config: Config | None = None,
    workload: Workload | None = None,
) -> Any:
    """A small upstream arm at the smallest unit, hold off, on `factory`'s scheduler."""
    deployment = Deployment(build="upstream").scaled(SCALE)
    if config is None:
        config = deployment.config(UNITS[0], False, WORKLOAD.sessions)
    if workload is None:
        workload = Workload(sessions=2, turns=2)
    return run_on_scheduler(
        config,
        make_plan(workload, SCALE),
        deployment.serving(WORKLOAD.system_prompt),
        real=factory(config, spec_tokens=deployment.spec_tokens, max_num_seqs=16),
        name="one-arm",
        out=tmp_path,
        about="test",
        level="api",
    )


def test_a_scheduler_built_otherwise_diverges_at_the_first_step_it_decides_otherwise(
    tmp_path: Path,
) -> None:
    # One running sequence at a time instead of the model's 16.
    real = functools.partial(_scheduler(None), max_num_seqs=1)

    def build(config: Any, *, spec_tokens: int, max_num_seqs: int) -> Any:
        return real(config, spec_tokens=spec_tokens)

    result = _one_arm(tmp_path, build)
    divergence = result.replay.divergence
    assert divergence is not None
    assert divergence.level == "api"
    assert "scheduled" in divergence.what or "lookups" in divergence.what


def test_a_scheduler_exception_mid_run_is_a_divergence_at_that_step(tmp_path: Path) -> None:
    def build(config: Any, *, spec_tokens: int, max_num_seqs: int) -> Any:
        real: Any = _scheduler(None)(config, spec_tokens=spec_tokens, max_num_seqs=max_num_seqs)
        schedule = real.scheduler.schedule
        calls = iter(range(1_000_000))

        def failing(*args: Any, **kwargs: Any) -> Any:
            if next(calls) == 4:
                raise AssertionError("injected at the fifth step")
            return schedule(*args, **kwargs)

        real.scheduler.schedule = failing
        return real

    result = _one_arm(tmp_path, build)
    divergence = result.replay.divergence
    assert divergence is not None
    assert divergence.what == "engine step 5: schedule() raised"
    assert divergence.actual == "AssertionError: injected at the fifth step"
    assert divergence.step.op == "drain"


def _workload_command(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    **knobs: Any,
) -> tuple[int, str]:
    monkeypatch.setattr(command, "Deployment", functools.partial(Deployment, **knobs))
    argv = [
        "workload", "--target", "vllm-scheduler", "--scale", str(SCALE), "--sessions", "2",
        "--turns", "2", "--units", "64", "--hold", "off", "--build", "upstream",
        "--out", str(tmp_path),
    ]  # fmt: skip
    code = cli.main(argv)
    return code, capsys.readouterr().err


def test_a_request_the_scheduler_refuses_is_one_line_naming_the_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # max_model_len = the first turn's prompt: the model takes the prompt,
    # the engine refuses it (no room left for the output).
    plan = make_plan(Workload(sessions=2, turns=2), SCALE)
    first = min(plan, key=lambda s: (s.turns[0].delay, s.index))
    prompt = WORKLOAD.system_prompt // SCALE + first.turns[0].fresh
    code, err = _workload_command(monkeypatch, capsys, tmp_path, max_model_len=prompt * SCALE)
    assert code == 2
    (line,) = [x for x in err.splitlines() if x.startswith("kvgate: error:")]
    assert ": step 1: prompt: vLLM's Scheduler refuses it: " in line
    assert f"exceed max_model_len {prompt}" in line
    assert "Traceback" not in err


def test_a_config_the_scheduler_cannot_run_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The eagle drop without draft tokens: vLLM has no such configuration;
    # refused before any unit is generated.
    code, err = _workload_command(monkeypatch, capsys, tmp_path, spec_tokens=0)
    assert code == 2
    assert err.splitlines()[-1] == (
        "kvgate: error: --target vllm-scheduler: cannot run config.eagle: "
        "the eagle drop needs draft tokens (spec > 0)"
    )
    assert not list(tmp_path.glob("**/*.yaml"))
    assert "Traceback" not in err


def test_unsupported_config_names_the_field() -> None:
    deployment = Deployment(build="upstream").scaled(SCALE)
    config = deployment.config(UNITS[0], False, 2)
    with pytest.raises(UnsupportedConfig) as error:
        _scheduler(None)(config, spec_tokens=0, max_num_seqs=16)
    assert error.value.field == "eagle"


@pytest.mark.parametrize(("sessions", "adaptive"), [(1, False), (4, True)])
def test_the_prefill_threshold_counts_the_schedulers_requests_not_the_system_prompt(
    tmp_path: Path, sessions: int, adaptive: bool
) -> None:
    # vLLM cuts a prefill to `long_prefill_token_threshold` only while it
    # holds more than one request; the system prompt's holder is kvgate's
    # bookkeeping, never a request of the Scheduler. One session: a turn
    # alone. Four, adaptive: the cap floored at the budget's fair share.
    from dataclasses import replace

    deployment = Deployment(build="upstream").scaled(SCALE)
    config = deployment.config(UNITS[0], False, sessions)
    config = replace(
        config,
        long_prefill_token_threshold=config.scheduler_block_size // 2,
        long_prefill_token_threshold_adaptive=adaptive,
    )
    result = _one_arm(tmp_path, _scheduler(None), config, Workload(sessions=sessions, turns=2))
    assert result.replay.passed, result.replay.divergence
    # The trace replays on the manager-level target too (`auto` chunks included).
    replayed = replay(load_trace(result.path), ModelTarget(config), None, "api")
    assert replayed.passed, replayed.divergence


def test_tenants_salts_keep_lockstep_on_the_real_scheduler(tmp_path: Path) -> None:
    """Two tenants (a cache salt each): the real Scheduler hashes the salts
    itself and stays in strict lockstep with the model (at the Mamba block's
    unit: the quicker arm)."""
    deployment = Deployment(build="upstream").scaled(SCALE)
    config = deployment.config(UNITS[1], False, WORKLOAD.sessions)
    workload = Workload(sessions=2, turns=2, tenants=2)
    result = run_on_scheduler(
        config,
        make_plan(workload, SCALE),
        deployment.serving(WORKLOAD.system_prompt),
        real=_scheduler(None)(config, spec_tokens=deployment.spec_tokens, max_num_seqs=16),
        name="tenants",
        out=tmp_path,
        about="test",
        level="strict",
    )
    assert result.replay.passed, result.replay.divergence
    salts = {s.cache_salt for s in load_trace(result.path).steps if s.op == "arrive"}
    assert salts == {"", "tenant-0", "tenant-1"}  # the unsalted system prompt besides


def test_a_lora_adapter_without_a_lora_config_is_refused_by_name() -> None:
    """An engine without a LoRA config (the workload's deployments have
    none) refuses a request with an adapter, as vLLM's engine does. (Under
    `max_loras` adapters are scheduled: see test_scheduler_lora.py.)"""
    deployment = Deployment(build="upstream").scaled(SCALE)
    config = deployment.config(UNITS[0], False, 2)
    real = _scheduler(None)(config, spec_tokens=deployment.spec_tokens, max_num_seqs=16)
    try:
        with pytest.raises(StepRefused) as error:
            real.add_request("R", list(range(100, 140)), 4, None, HashInputs(lora="ad-1"))
        assert error.value.field == "lora" and "\n" not in error.value.message
    finally:
        real.close()


def test_residency_metrics_keep_lockstep_on_the_real_scheduler(tmp_path: Path) -> None:
    """`--kv-cache-metrics`: vLLM's Scheduler builds the collector itself and
    drains it into every step's stats; each step's eviction events (their
    reuse gaps) are the model's. A collector that drops the events of
    blocks it never saw accessed diverges at the first such step."""
    from dataclasses import replace

    deployment = Deployment(build="upstream").scaled(SCALE)
    config = replace(deployment.config(UNITS[0], False, WORKLOAD.sessions), kv_cache_metrics=True)
    result = _one_arm(tmp_path / "ok", _scheduler(None), config)
    assert result.replay.passed, result.replay.divergence
    assert result.evictions_compared > 0

    def dropping(config: Config, **kwargs: Any) -> Any:
        real: Any = _scheduler(None)(config, **kwargs)
        collector = real.scheduler.kv_metrics_collector
        evicted = collector.on_block_evicted

        def unaccessed_dropped(block: Any) -> None:
            metrics = collector.block_metrics.get(block.block_id)
            if metrics is not None and not metrics.access_history:
                del collector.block_metrics[block.block_id]
                return
            evicted(block)

        collector.on_block_evicted = unaccessed_dropped
        return real

    broken = _one_arm(tmp_path / "broken", dropping, config)
    divergence = broken.replay.divergence
    assert divergence is not None
    assert divergence.what.endswith("residency eviction events (reuse gaps each)")


def test_an_unmodelled_input_in_a_run_is_one_line_naming_the_step(tmp_path: Path) -> None:
    """Inside a workload run the refusal is the run's one-line error at the
    arrival, not a divergence."""

    def build(config: Any, *, spec_tokens: int, max_num_seqs: int) -> Any:
        real: Any = _scheduler(None)(config, spec_tokens=spec_tokens, max_num_seqs=max_num_seqs)
        add = real.add_request

        def with_adapter(*args: Any, **kwargs: Any) -> None:
            add(*args[:4], HashInputs(lora="ad-1"), **kwargs)

        real.add_request = with_adapter
        return real

    with pytest.raises(TraceError) as error:
        _one_arm(tmp_path, build)
    message = str(error.value)
    assert ": step 1: lora: vLLM's Scheduler refuses it: " in message, message
    assert "\n" not in message


class _OneEventFewer(Wrapped):
    """vLLM's Scheduler, each published batch of KV-cache events without its
    last event."""

    def take_kv_events(self) -> list[Any]:
        return list(self.real.take_kv_events())[:-1]


def test_a_wrong_kv_event_fails_the_workload_as_it_fails_the_gate(tmp_path: Path) -> None:
    """The workload runs the gate's scheduler-level lockstep, so it compares
    the KV-cache events a step publishes: with `kv_events` on the workload
    conforms, and a Scheduler that publishes one event fewer per batch is
    caught at the first step that publishes any, as the gate catches the
    same fault on the bundled events trace."""
    from dataclasses import replace

    from scheduler_runs import first_failure, run_vllm, trace_of

    events_trace = trace_of("sched-kv-events-store-evict-clear")
    assert first_failure(run_vllm(events_trace, _OneEventFewer))[1:] == ("expect", "events")

    deployment = Deployment(build="upstream").scaled(SCALE)
    config = replace(deployment.config(UNITS[0], False, WORKLOAD.sessions), kv_events=True)
    clean = _one_arm(tmp_path / "ok", _scheduler(None), config)
    assert clean.replay.passed, clean.replay.divergence

    def fewer(config: Config, **kwargs: Any) -> Any:
        return _OneEventFewer(_scheduler(None)(config, **kwargs))

    divergence = _one_arm(tmp_path / "fewer", fewer, config).replay.divergence
    assert divergence is not None and divergence.level == "api"
    assert divergence.what.endswith(": KV-cache events published"), divergence.what
