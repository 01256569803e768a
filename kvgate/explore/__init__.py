"""Stateful exploration of the model (Hypothesis), alone or against vLLM.

Its state machines are public, for a user's own test suite:
`kvgate.explore.KVManagerMachine`, `kvgate.explore.VllmLockstepMachine` and
`kvgate.explore.profile` (see `kvgate.explore.machines`). They are imported
on first use, so importing another part of `kvgate.explore` does not build
them.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = ("KVManagerMachine", "VllmLockstepMachine", "profile")


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module("kvgate.explore.machines"), name)
    raise AttributeError(f"module 'kvgate.explore' has no attribute {name!r}")
