"""Installing kvgate changes no vLLM process: vLLM's own general-plugin
loader, with kvgate's entry point installed, wraps nothing unless the user
opted in (the hold switch, or KVGATE_HOLD_OVERLAY)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm

# What the overlay wraps, when it is installed.
WRAPPED = [
    "KVCacheCoordinator.free",
    "KVCacheCoordinator.pop_blocks_for_free",
    "MambaManager.__init__",
    "MambaManager._remove_blocks_in_range",
    "MambaManager.allocate_new_blocks",
    "MambaManager.get_num_blocks_to_allocate",
]
SWITCHES = ("VLLM_E2_MAMBA_RETAIN_CHECKPOINT", "KVGATE_HOLD_OVERLAY")


def wrapped_methods() -> list[str]:
    """The methods of the classes the overlay wraps that are not vLLM's own."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    return sorted(
        f"{cls.__name__}.{name}"
        for cls in (MambaManager, KVCacheCoordinator)
        for name, value in vars(cls).items()
        if callable(value) and not str(getattr(value, "__module__", "vllm")).startswith("vllm")
    )


@pytest.fixture
def upstream_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM as a fresh engine process finds it: the overlay not installed, the
    plugin loader not run yet, no switch set; the overlay's state is put back
    after. vLLM's loader runs only kvgate's entry point (`VLLM_PLUGINS`, vLLM's
    own filter), so vLLM's own plugins are not registered twice."""
    from kvgate.impl import _vllm_api, hold_overlay

    _vllm_api.load()
    import vllm.plugins

    was_installed = hold_overlay.is_registered()
    hold_overlay.unregister()
    for switch in SWITCHES:
        monkeypatch.delenv(switch, raising=False)
    monkeypatch.setenv("VLLM_PLUGINS", "kvgate_hold")
    _vllm_api.clear_env_cache()
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    try:
        yield vllm.plugins
    finally:
        hold_overlay.unregister()
        if was_installed:
            hold_overlay.install()
        monkeypatch.undo()
        _vllm_api.clear_env_cache()


@needs_vllm
@pytest.mark.parametrize(
    ("switches", "wrapped"),
    [
        ({}, []),
        ({"VLLM_E2_MAMBA_RETAIN_CHECKPOINT": "0"}, []),
        ({"VLLM_E2_MAMBA_RETAIN_CHECKPOINT": "1"}, WRAPPED),
        ({"KVGATE_HOLD_OVERLAY": "1"}, WRAPPED),
    ],
    ids=["unset", "switch-off", "switch-on", "opted-in"],
)
def test_the_entry_point_wraps_nothing_unless_asked(
    upstream_vllm: Any,
    monkeypatch: pytest.MonkeyPatch,
    switches: dict[str, str],
    wrapped: list[str],
) -> None:
    found = importlib.metadata.entry_points(group="vllm.general_plugins", name="kvgate_hold")
    assert [e.value for e in found] == ["kvgate.impl.hold_overlay:register"]
    assert wrapped_methods() == []
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    upstream_vllm.load_general_plugins()  # as an engine process starts
    assert wrapped_methods() == wrapped


@needs_vllm
def test_the_hybrid_model_config_is_written_once_and_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process that builds vLLM's Scheduler shares one config folder:
    a process that leaves through `os._exit` (as pytest-xdist's workers do)
    leaves nothing else behind in the temporary directory."""
    import tempfile

    from kvgate.impl.vllm_scheduler_config import model_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model_dir.cache_clear()
    try:
        here = model_dir()
    finally:
        model_dir.cache_clear()
    child = (
        "import os; from kvgate.impl.vllm_scheduler_config import model_dir; "
        "print(model_dir(), flush=True); os._exit(0)"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env)
    assert done.stdout.strip() == str(here), done.stderr[-500:]
    assert list(tmp_path.iterdir()) == [here]
    assert (here / "config.json").is_file()
