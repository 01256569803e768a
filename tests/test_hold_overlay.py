"""The hold overlay (`kvgate.impl.hold_overlay`) on the installed upstream vLLM.

The overlay must make vLLM 0.33.0 conform to the model's hold, step by step at
strict level, on every hold-on corpus trace (which fail without it), and
change nothing while switched off. vLLM is imported once for the module; the
module leaves the process as it found it (overlay installed or not).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import shutil
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import hybrid_config, needs_vllm

from kvgate import cli
from kvgate.conformance.replay import HOLD_NOTE, RETIRE_NOTE, ReplayResult, replay
from kvgate.conformance.trace import Trace, TraceError, bundled_corpus, load_corpus
from kvgate.model import ModelTarget
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.snapshot import Snapshot
from kvgate.vocabulary.target import Target, WatchedTarget

pytestmark = needs_vllm

PLUGIN = "kvgate.impl.hold_overlay"
# Refusal traces (`expect_refused`) replay nothing: tests/test_refusals.py judges them.
CORPUS = [t for t in load_corpus(bundled_corpus()) if t.expect_refused is None]
# Traces that need what upstream lacks: the hold, or the fork's retention of
# retired states (the overlay offers both); and those upstream runs as it is.
HOLD_ON = [t for t in CORPUS if t.config.hold or t.config.retain_retired]
HOLD_OFF = [t for t in CORPUS if not t.config.hold and not t.config.retain_retired]
# A Mamba block wider than the hash unit, used by no corpus trace, so this
# module's startup line is not one an earlier build already logged.
LOG_UNIT, LOG_BLOCK = 16, 64


class Records(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def ids(traces: list[Trace]) -> list[str]:
    return [t.name for t in traces]


def run(trace: Trace, plugin: str | None, record: list[Snapshot] | None = None) -> ReplayResult:
    from kvgate.impl.vllm_target import VllmTarget

    target: Target = VllmTarget(trace.config, plugin=plugin)
    if record is not None:
        target = WatchedTarget(target, lambda step, t: record.append(t.snapshot()))
    try:
        return replay(trace, target, ModelTarget, "strict")
    finally:
        target.close()


def test_the_corpus_has_both_arms() -> None:
    assert len(HOLD_ON) >= 10 and len(HOLD_OFF) >= 20


# -- (1) hold on: conforms with the overlay, fails without it ---------------------


@pytest.mark.parametrize("trace", HOLD_ON, ids=ids(HOLD_ON))
def test_hold_on_trace_conforms_with_the_overlay(overlay: Any, trace: Trace) -> None:
    result = run(trace, PLUGIN)
    assert result.capabilities.hold is trace.config.hold
    assert result.capabilities.retain_retired is trace.config.retain_retired
    if trace.config.hold:
        assert result.capabilities.hold_source == overlay.HOLD_SOURCE
    assert not result.notes  # the lockstep model ran with all of it on
    assert result.passed, result.divergence


@pytest.mark.usefixtures("upstream")
@pytest.mark.parametrize("trace", HOLD_ON, ids=ids(HOLD_ON))
def test_without_the_overlay_vllm_runs_as_upstream(trace: Trace) -> None:
    result = run(trace, None)
    assert result.capabilities.hold is False
    assert result.notes == (
        *([HOLD_NOTE] if trace.config.hold else []),
        *([RETIRE_NOTE] if trace.config.retain_retired else []),
    )
    inert = not trace.config.partial_hits  # no sub-block state for the hold to take
    # The fork's traces whose next turn needs a retained state upstream drops.
    needs_retention = {
        "retired-state-held.fork.hold-off",
        "pure-mamba-next-turn-siblings.fork.hold-on",
        "mamba2-connector-async-load.fork.hold-off",
    }
    if (not trace.config.hold or inert) and trace.name not in needs_retention:
        # The fork's seed scenarios without the hold expect what upstream does,
        # and so do hold-on traces of a pure Mamba model.
        assert result.passed, result.divergence
        return
    assert result.divergence is not None
    # The hold-off lockstep model agrees with upstream; the trace's own
    # expectations (holds, refs, hits, reservations) are what it misses.
    assert result.divergence.level == "expect"


# -- (2) hold off: conforms with the overlay installed and switched off ---------------


@pytest.mark.parametrize("trace", HOLD_OFF, ids=ids(HOLD_OFF))
def test_hold_off_trace_conforms_with_the_overlay_switched_off(overlay: Any, trace: Trace) -> None:
    result = run(trace, PLUGIN)
    assert result.capabilities.hold is False
    assert result.passed, result.divergence


def test_switched_off_the_overlay_changes_nothing(overlay: Any) -> None:
    """Every hold-off trace: the same observations and the same snapshot after
    every step, with the overlay installed (switch off) and without it."""
    with_overlay: dict[str, tuple[ReplayResult, list[Snapshot]]] = {}
    for trace in HOLD_OFF:
        snaps: list[Snapshot] = []
        with_overlay[trace.name] = (run(trace, PLUGIN, snaps), snaps)
    overlay.unregister()
    try:
        for trace in HOLD_OFF:
            snaps = []
            result = run(trace, None, snaps)
            installed, installed_snaps = with_overlay[trace.name]
            assert result.passed and installed.passed
            assert result.steps_run == installed.steps_run
            assert len(snaps) > 10 and snaps == installed_snaps, trace.name
    finally:
        overlay.install()


# -- beyond the corpus's own expectations ----------------------------------------


@pytest.mark.parametrize("trace", HOLD_OFF, ids=ids(HOLD_OFF))
def test_switched_on_every_trace_keeps_lockstep_with_the_model(overlay: Any, trace: Trace) -> None:
    """The hold-off traces with the hold switched on: the expectations were
    written for the hold off, but overlay and model must still agree at
    every step (abort, preemption, deferred frees, two Mamba groups, ...)."""
    flipped = replace(trace, config=replace(trace.config, hold=True))
    try:
        result = run(flipped, PLUGIN)
    except TraceError as error:
        # With the hold a later turn may resume further, so a step written
        # for the hold-off history (an `auto` chunk) has nothing left to do:
        # the model refused it first, so overlay and model still agree.
        assert "nothing is left to compute" in str(error), error
        pytest.skip(f"the hold-off history does not replay with the hold on: {error}")
    # Without prefix caching nothing is keyed: the overlay (as the seed's
    # switch) stays off.
    assert result.capabilities.hold is trace.config.prefix_caching
    lockstep = [d for d in result.failures if d.level != "expect"]
    assert not lockstep, lockstep[0]


def test_the_overlay_is_exercised_on_two_mamba_groups(overlay: Any) -> None:
    """A hold per Mamba group, released together: the two-group traces take
    holds in both groups (so the lockstep check above covers group order)."""
    groups_held: set[int] = set()

    def after(step: Step, target: Target) -> None:
        for held in target.snapshot().holds.values():
            groups_held.update(held)

    for trace in CORPUS:
        if len(trace.config.mamba_group_ids) > 1:
            flipped = replace(trace, config=replace(trace.config, hold=True))
            from kvgate.impl.vllm_target import VllmTarget

            with closing(WatchedTarget(VllmTarget(flipped.config, plugin=PLUGIN), after)) as target:
                replay(flipped, target, ModelTarget, "strict")
    assert groups_held >= {1, 2}


# -- loading, the switch, the startup line --------------------------------------------


def test_register_is_idempotent_and_unregister_restores(overlay: Any) -> None:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    names = ("__init__", "get_num_blocks_to_allocate", "allocate_new_blocks")
    patched = [MambaManager.__dict__[n] for n in names] + [KVCacheCoordinator.__dict__["free"]]
    overlay.install()
    again = [MambaManager.__dict__[n] for n in names] + [KVCacheCoordinator.__dict__["free"]]
    assert again == patched
    assert all(f.__module__ == PLUGIN for f in patched)
    overlay.unregister()
    try:
        assert all(MambaManager.__dict__[n].__module__.startswith("vllm.") for n in names)
        assert KVCacheCoordinator.__dict__["free"].__module__.startswith("vllm.")
    finally:
        overlay.install()


def test_the_switch_is_read_per_manager(overlay: Any) -> None:
    """One process, both arms: each manager reads the switch when built."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from kvgate.impl.vllm_target import VllmTarget

    on, off = HOLD_ON[0].config, replace(HOLD_ON[0].config, hold=False)
    for config, want in ((on, True), (off, False), (on, True)):
        target = VllmTarget(config)
        managers = target.manager.coordinator.single_type_managers
        mambas = [m for m in managers if isinstance(m, MambaManager)]
        assert mambas and all(m._retain_checkpoint is want for m in mambas)
        assert target.capabilities.hold is want
        target.close()


def test_entry_point_loads_the_overlay(overlay: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own plugin loader finds the overlay by its entry point (the
    hold switch on, as a server with the hold is started)."""
    from kvgate.impl.vllm_target import VllmTarget

    # Spelled unlike kvgate's own "1", so it reads as the user's setting even
    # after earlier tests in this process had kvgate write the switch.
    monkeypatch.setenv("VLLM_E2_MAMBA_RETAIN_CHECKPOINT", "true")
    found = importlib.metadata.entry_points(group="vllm.general_plugins", name="kvgate_hold")
    assert [e.value for e in found] == [f"{PLUGIN}:register"]
    target = VllmTarget(HOLD_ON[0].config, plugin="entry-points")
    assert target.capabilities.hold_source == overlay.HOLD_SOURCE
    target.close()


def test_one_startup_line_when_the_hold_is_active(overlay: Any) -> None:
    from kvgate.impl.vllm_target import VllmTarget
    from kvgate.vocabulary.config import Config, GroupConfig

    def config(unit: int, hold: bool) -> Config:
        return hybrid_config(
            GroupConfig("full_attention", unit),
            GroupConfig("mamba_align", LOG_BLOCK),
            GroupConfig("mamba_align", LOG_BLOCK),
            retention_interval=None,
            hold=hold,
        )

    logger = logging.getLogger(overlay.LOGGER_NAME)
    handler = Records()
    records = handler.records
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    overlay._announced.discard((LOG_UNIT, LOG_BLOCK))
    try:
        for unit, hold in ((LOG_UNIT, False), (LOG_BLOCK, True)):
            VllmTarget(config(unit, hold)).close()
        assert records == []  # switch off; unit == block: no partial tails
        for _ in range(2):
            VllmTarget(config(LOG_UNIT, True)).close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    # Two builds of two Mamba groups each: one line for the process.
    assert len(records) == 1
    message = records[0].getMessage()
    assert "VLLM_E2_MAMBA_RETAIN_CHECKPOINT=1" in message
    assert f"hash unit {LOG_UNIT} < Mamba block {LOG_BLOCK}" in message


def test_gate_header_names_the_hold_source(
    overlay: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The header comes from a hold-on trace even when a hold-off one sorts first."""
    for trace in (HOLD_OFF[0], HOLD_ON[0]):
        shutil.copy(trace.path, tmp_path / trace.path.name)
    assert sorted(p.name for p in tmp_path.iterdir())[0] == HOLD_OFF[0].path.name
    code = cli.main(
        ["gate", "--target", "vllm", "--no-bundled", "--corpus", str(tmp_path), "--plugin", PLUGIN]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0, out
    version = importlib.metadata.version("vllm")
    assert out[0] == (
        f"target: vllm {version} (partial hits: yes, hold: yes ({overlay.HOLD_SOURCE}))"
    )
    assert out[-1] == "2 passed, 0 failed"
