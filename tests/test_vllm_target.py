"""`VllmTarget` against the installed vLLM (CPU), one primitive op at a time.

Skipped only when vLLM is not installed; vLLM is imported once for the module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from configs import EXAMPLE_CONFIG, hybrid_config, needs_vllm

from kvgate.impl.vllm_probe import probe
from kvgate.impl.vllm_target import VllmTarget
from kvgate.vocabulary.config import Config, GroupConfig, UnsupportedConfig
from kvgate.vocabulary.ops import Segment, Step
from kvgate.vocabulary.snapshot import Snapshot
from kvgate.vocabulary.target import StepRefused, Target
from kvgate.vocabulary.tokens import prefix_keys

pytestmark = needs_vllm

# The trace-format example's config (the seed's first scenario).
CONFIG = EXAMPLE_CONFIG
UNIT = CONFIG.hash_unit
# A `check` query for the plain values.
PLAIN = {"pool_clean": True, "free_blocks": 0, "holds": {}}


def fresh(n: int) -> Segment:
    return Segment("fresh", count=n)


def all_of(req: str) -> Segment:
    return Segment("all_of", req=req)


def check_invariants(snap: Snapshot, free_blocks: int) -> None:
    """Free queue and ref counts agree with everything that references a block."""
    free = set(snap.free_queue)
    assert len(free) == len(snap.free_queue) == free_blocks
    assert 0 not in free
    refs: Counter[int] = Counter()
    for per_group in snap.tables.values():
        assert len(per_group) == len(CONFIG.groups)
        for ids in per_group:
            refs.update(i for i in ids if i)
    for groups in snap.holds.values():
        refs.update(bid for _, bid in groups.values())
    for _, src, dst in snap.pending_copies:
        refs.update((src, dst))
    for ids in snap.popped.values():
        refs.update(i for i in ids if i)
    for bid, view in enumerate(snap.blocks):
        if bid == 0:
            continue
        assert view.ref == refs[bid], f"block {bid}: ref {view.ref}, referenced {refs[bid]}"
        assert (view.ref == 0) == (bid in free), f"block {bid}"
        assert all(h.startswith(("g0/", "g1/")) for h in view.hashes)


class Driver:
    """Applies steps to a target, checking the snapshot invariants after each."""

    def __init__(self, target: VllmTarget) -> None:
        self.target = target
        self.index = 0

    def __call__(self, op: str, **fields: Any) -> dict[str, Any]:
        self.index += 1
        result = self.target.apply(Step(op=op, index=self.index, **fields))
        check_invariants(self.target.snapshot(), result["free_blocks"])
        return result

    def prefill(self, req: str, lookahead: int = 0) -> tuple[int, list[dict[str, Any]]]:
        """The `prefill` macro: lookup, then allocate auto / step / drain to the end."""
        hit = int(self("lookup", req=req)["hit"])
        drains = []
        while True:
            got = self("allocate", req=req, tokens="auto", lookahead=lookahead)
            assert got["ok"], got
            assert got["tokens"] > 0
            self("step")
            drains.append(self("drain"))
            if got["prompt_done"]:
                return hit, drains

    def decode(self, req: str, steps: int, spec: int = 0) -> None:
        for _ in range(steps):
            assert self("decode1", req=req, spec=spec)["ok"]
            self("step")
            self("drain")


@pytest.fixture(scope="module")
def vllm_loaded() -> None:
    from kvgate.impl import _vllm_api

    _vllm_api.load()


@pytest.fixture
def target(vllm_loaded: None) -> Iterator[VllmTarget]:
    t = VllmTarget(CONFIG)
    yield t
    t.close()


@pytest.fixture
def drive(target: VllmTarget) -> Driver:
    return Driver(target)


def test_importing_the_module_does_not_import_vllm() -> None:
    code = "import sys, kvgate.impl.vllm_target; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_probe_reports_the_installed_build(vllm_loaded: None) -> None:
    import vllm

    info = probe()
    assert info["vllm"] == vllm.__version__
    assert info["partial_hits"] is True
    assert info["deferred_free"] is True
    assert isinstance(info["hold"], bool)
    assert "error" not in info
    # The probe agrees with a target built with the switch on.
    t = VllmTarget(CONFIG)
    assert t.capabilities.hold is info["hold"]
    t.close()


def test_capabilities(target: VllmTarget, vllm_loaded: None) -> None:
    as_protocol: Target = target  # mypy checks the structural fit
    caps = as_protocol.capabilities
    assert caps.implementation.startswith("vllm ")
    assert caps.partial_hits is True
    assert caps.hold_source == ("" if not caps.hold else caps.hold_source)
    assert os.environ["VLLM_E2_MAMBA_RETAIN_CHECKPOINT"] == "1"
    coarse = hybrid_config(
        GroupConfig("full_attention", 32), GroupConfig("mamba_align", 32), retention_interval=None
    )
    other = VllmTarget(coarse)
    assert other.capabilities.partial_hits is False
    assert other.capabilities.hold is False and other.capabilities.hold_source == ""
    assert os.environ["VLLM_E2_MAMBA_RETAIN_CHECKPOINT"] == "0"
    other.close()


def test_seed_partial_tail_scenario(target: VllmTarget, drive: Driver) -> None:
    drive("arrive", req="A0", prompt=(fresh(150),))
    hit, _ = drive.prefill("A0", lookahead=3)
    assert hit == 0
    drive.decode("A0", steps=4, spec=3)
    drive("free", req="A0", how="finish")
    drive("drain")

    drive("arrive", req="A1", prompt=(all_of("A0"), fresh(26)))
    a1_prompt = target.token_ids("A1")
    assert len(a1_prompt) == 155 + 26
    hit, drains = drive.prefill("A1", lookahead=3)
    assert hit == 136  # A0's partial tail: 150 // 8 * 8 - 8
    assert drains[0]["copies"], "a sub-block hit copies the hit state (CoW)"
    drive.decode("A1", steps=4, spec=3)
    drive("evict", blocks="all")
    drive("free", req="A1", how="finish")
    drive("drain")

    drive("arrive", req="A2", prompt=(all_of("A1"), fresh(22)))
    a1_tail = len(a1_prompt) // UNIT * UNIT - UNIT
    hit = int(drive("lookup", req="A2")["hit"])
    assert hit == (a1_tail if target.capabilities.hold else 0)  # 0: the known total miss

    names = {h for view in target.snapshot().blocks for h in view.hashes}
    keys = prefix_keys(a1_prompt, UNIT)
    assert all(f"g0/{key}" in names for key in keys), "A1's attention prefix stays cached"
    if not target.capabilities.hold:
        assert f"g1/{keys[a1_tail // UNIT - 1]}" not in names  # the evicted tail state
    query = {"ref": {"A1": {0: {a1_tail: 0, 7: 0}, 1: {a1_tail: 0}}}, "attention_cached": {"A1": 0}}
    values = target.check_values(query)
    tail_ref = 0 if target.capabilities.hold else None
    assert values["ref"] == {"A1": {0: {a1_tail: 0, 7: None}, 1: {a1_tail: tail_ref}}}
    assert values["attention_cached"] == {"A1": len(a1_prompt) // 8 * 8}
    values = target.check_values(PLAIN)
    assert values["pool_clean"] is True
    assert values["holds"] == {}


def test_two_targets_replay_identically(vllm_loaded: None) -> None:
    snaps = []
    for _ in range(2):
        t = VllmTarget(CONFIG)
        d = Driver(t)
        d("arrive", req="A0", prompt=(fresh(70),))
        d.prefill("A0", lookahead=3)
        d.decode("A0", steps=2, spec=3)
        d("arrive", req="A1", prompt=(all_of("A0"), fresh(9)))
        d("lookup", req="A1")
        d("allocate", req="A1", tokens="auto", lookahead=3)
        snaps.append(t.snapshot())
        t.close()
    assert list(snaps[0].differences(snaps[1])) == []
    assert snaps[0].pending_copies  # A1's first chunk queued a CoW copy


def test_evict_more_than_free_is_refused(target: VllmTarget, drive: Driver) -> None:
    drive("arrive", req="A0", prompt=(fresh(100),))
    drive.prefill("A0")
    before = target.snapshot()
    free = target.check_values(PLAIN)["free_blocks"]
    with pytest.raises(StepRefused) as refused:
        target.apply(Step(op="evict", index=99, blocks=free + 1))
    assert refused.value.field == "blocks"
    assert list(before.differences(target.snapshot())) == []
    assert drive("evict", blocks=0)["free_blocks"] == free
    assert drive("evict", blocks=free)["free_blocks"] == free
    assert drive("evict", blocks="all")["free_blocks"] == free


def test_pop_then_release(target: VllmTarget, drive: Driver) -> None:
    drive("arrive", req="A0", prompt=(fresh(100),))
    drive.prefill("A0", lookahead=3)
    free = target.check_values(PLAIN)["free_blocks"]
    table = target.snapshot().tables["A0"]

    assert drive("pop", req="A0")["free_blocks"] == free  # deferred: nothing freed yet
    snap = target.snapshot()
    assert "A0" not in snap.tables
    kept = snap.popped["A0"]
    assert sorted(i for i in kept if i) == sorted(i for ids in table for i in ids if i)
    assert target.check_values(PLAIN)["pool_clean"] is False

    released = drive("release", req="A0")
    assert released["free_blocks"] == free + len({i for i in kept if i})
    assert target.snapshot().popped == {}
    assert target.check_values(PLAIN)["pool_clean"] is True
    with pytest.raises(StepRefused) as refused:
        target.apply(Step(op="release", index=99, req="A0"))
    assert refused.value.field == "req"


def test_preempt_then_lookup_again(target: VllmTarget, drive: Driver) -> None:
    drive("arrive", req="A0", prompt=(fresh(150),))
    drive.prefill("A0", lookahead=3)
    drive.decode("A0", steps=2, spec=3)
    tokens = target.token_ids("A0")
    drive("free", req="A0", how="preempt")
    assert target.num_computed_tokens("A0") == 0
    assert target.token_ids("A0") == tokens  # output kept
    assert "A0" not in target.snapshot().tables

    hit, _ = drive.prefill("A0", lookahead=3)
    assert 0 < hit < len(tokens) and hit % UNIT == 0
    assert target.num_computed_tokens("A0") == len(tokens)
    drive.decode("A0", steps=1, spec=3)
    drive("free", req="A0", how="abort")
    drive("drain")
    assert target.check_values(PLAIN)["pool_clean"] is True


def test_reserve_returns_block_counts(target: VllmTarget, drive: Driver) -> None:
    drive("arrive", req="A0", prompt=(fresh(150),))
    cold = drive("reserve", req="A0")
    assert type(cold["blocks"]) is int and type(cold["step_blocks"]) is int
    assert cold["blocks"] > 0 and cold["step_blocks"] > 0
    drive.prefill("A0", lookahead=3)
    drive("free", req="A0", how="finish")
    drive("arrive", req="A1", prompt=(all_of("A0"), fresh(40)))
    drive("lookup", req="A1")
    warm = drive("reserve", req="A1")
    assert type(warm["blocks"]) is int and type(warm["step_blocks"]) is int
    assert "A1" not in target.snapshot().tables  # counting allocated nothing


def test_refusals(target: VllmTarget, drive: Driver) -> None:
    drive("arrive", req="A0", prompt=(fresh(40),))
    drive.prefill("A0")
    with pytest.raises(StepRefused) as nothing_left:
        target.apply(Step(op="allocate", index=99, req="A0", tokens="auto"))
    assert nothing_left.value.field == "tokens"
    with pytest.raises(StepRefused) as unknown:
        target.apply(Step(op="lookup", index=99, req="B"))
    assert unknown.value.field == "req"
    with pytest.raises(StepRefused) as again:
        target.apply(Step(op="arrive", index=99, req="A0", prompt=(fresh(1),)))
    assert again.value.field == "req"
    drive("free", req="A0", how="finish")
    with pytest.raises(StepRefused) as ended:
        target.apply(Step(op="lookup", index=99, req="A0"))
    assert ended.value.field == "req"
    drive("arrive", req="A1", prompt=(all_of("A0"),))  # an ended request's tokens


def test_vllm_exceptions_propagate(target: VllmTarget, drive: Driver) -> None:
    drive("arrive", req="A0", prompt=(fresh(40),))
    # Zero tokens with no hit to adopt: vLLM's own argument check raises.
    with pytest.raises(ValueError, match="num_new_tokens"):
        target.apply(Step(op="allocate", index=99, req="A0", tokens=0))


def test_check_values(target: VllmTarget, drive: Driver) -> None:
    assert target.check_values(PLAIN) == {"pool_clean": True, "free_blocks": 95, "holds": {}}
    drive("arrive", req="A0", prompt=(fresh(40),))
    drive.prefill("A0")
    values = target.check_values(PLAIN)
    assert values["pool_clean"] is False and values["free_blocks"] < 95
    drive("free", req="A0", how="finish")
    assert target.check_values(PLAIN)["pool_clean"] is True


def test_prompt_segments(target: VllmTarget, drive: Driver) -> None:
    drive("arrive", req="A0", prompt=(fresh(20), Segment("tokens", token_ids=(5, 6, 7))))
    a0 = target.token_ids("A0")
    assert a0 == [*range(1000, 1020), 5, 6, 7]
    drive.prefill("A0")
    drive.decode("A0", steps=2)
    drive("arrive", req="B", prompt=(Segment("prompt_of", req="A0"), all_of("A0")))
    assert target.token_ids("B") == a0 + target.token_ids("A0")
    with pytest.raises(StepRefused) as empty:
        target.apply(Step(op="arrive", index=99, req="C", prompt=(fresh(0),)))
    assert empty.value.field == "prompt"


def test_vllm_rejecting_a_config_is_unsupported(vllm_loaded: None) -> None:
    def config(hash_unit: int, retention_interval: int) -> Config:
        return hybrid_config(
            GroupConfig("full_attention", 8),
            GroupConfig("mamba_align", 32),
            hash_unit=hash_unit,
            retention_interval=retention_interval,
        )

    with pytest.raises(UnsupportedConfig) as retention:
        VllmTarget(config(hash_unit=8, retention_interval=16))
    assert retention.value.field == "retention_interval"
    with pytest.raises(UnsupportedConfig) as unit:
        VllmTarget(config(hash_unit=16, retention_interval=0))
    assert unit.value.field == "hash_unit"
    assert "\n" not in unit.value.message


def test_plugin_is_registered_once(
    vllm_loaded: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "kvgate_test_overlay_plugin"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            calls = 0
            def register():
                global calls
                calls += 1
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for _ in range(2):
        VllmTarget(CONFIG, plugin=name).close()
    assert sys.modules[name].calls == 1


def test_a_plugin_uninstalled_since_is_installed_again(
    vllm_loaded: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test that restores vLLM (the plugin's `unregister()`) leaves no
    stale record: the next `plugin=` target installs it again (the leak that
    made tests/test_workload.py run without the overlay after
    tests/test_workload_scheduler.py)."""
    name = "kvgate_test_uninstallable_plugin"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            calls = 0
            installed = False
            def register():
                global calls, installed
                if not installed:
                    calls += 1
                    installed = True
            def unregister():
                global installed
                installed = False
            def is_registered():
                return installed
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    VllmTarget(CONFIG, plugin=name).close()
    plugin = sys.modules[name]
    VllmTarget(CONFIG, plugin=name).close()
    assert plugin.calls == 1 and plugin.is_registered()
    plugin.unregister()
    VllmTarget(CONFIG, plugin=name).close()
    assert plugin.calls == 2 and plugin.is_registered()
