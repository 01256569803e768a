"""What differs between vLLM releases, probed on the installed one: the hold
overlay's support check (it refuses a build lacking what it wraps, by name),
and the fault campaign's ports."""

from __future__ import annotations

import pytest
from configs import needs_vllm

from kvgate.impl import hold_overlay

pytestmark = needs_vllm


def test_the_overlay_supports_the_installed_release() -> None:
    # Every release kvgate gates (0.32.0, 0.33.0, 0.34.0) has what it wraps.
    assert hold_overlay.missing_internals() == []


def test_the_overlay_refuses_a_build_lacking_what_it_wraps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if hold_overlay.is_registered():
        pytest.skip("the overlay is installed in this process already")
    wrapped = dict(hold_overlay._WRAPPED)
    wrapped[("MambaManager", "allocate_new_blocks")] += ("no_such_parameter",)
    wrapped[("KVCacheCoordinator", "no_such_method")] = ()
    monkeypatch.setattr(hold_overlay, "_WRAPPED", wrapped)
    monkeypatch.setattr(hold_overlay, "_MAMBA_READS", (*hold_overlay._MAMBA_READS, "_no_attr"))
    assert hold_overlay.missing_internals() == [
        "MambaManager.allocate_new_blocks(no_such_parameter)",
        "KVCacheCoordinator.no_such_method",
        "MambaManager._no_attr",
    ]
    hold_overlay.install()
    try:
        assert not hold_overlay.is_registered()
    finally:
        hold_overlay.unregister()
