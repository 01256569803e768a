"""Differential mode: the model and the real vLLM manager in lockstep.

The same machine drives both through the shared op driver; after every step
the session compares what each reported (api) and their full snapshots
(strict). vLLM is imported only when a differential run starts.
"""

from __future__ import annotations

import os
from typing import Any

from kvgate.driver.op_driver import OpDriver
from kvgate.explore.mode import Mode
from kvgate.explore.session import ALL_INVARIANTS, HOLD_ONLY_INVARIANTS
from kvgate.vocabulary.config import Config

# The overlay that gives upstream vLLM 0.33.0 the hold (kvgate.impl.hold_overlay).
HOLD_OVERLAY = "kvgate.impl.hold_overlay"


def vllm_target(config: Config, plugin: str | None = None) -> OpDriver[Any]:
    """A `VllmTarget` for `config` (imports vLLM on first use, CPU)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from kvgate.impl.vllm_target import VllmTarget

    return VllmTarget(config, plugin=plugin)


def vllm_with_overlay(config: Config) -> OpDriver[Any]:
    return vllm_target(config, plugin=HOLD_OVERLAY)


def differential_mode(refusals: bool = False) -> Mode:
    """Model vs vLLM 0.33.0, hold off (upstream has none), strict level.

    The invariants that upstream is known to break by design are left out;
    every other one is checked on the model, and any divergence fails.
    `refusals`: a share of the configs break one of vLLM's config rules,
    which both sides must refuse alike (`kvgate explore --target vllm`).
    """
    invariants = tuple(i for i in ALL_INVARIANTS if i not in HOLD_ONLY_INVARIANTS)
    return Mode(hold=False, invariants=invariants, lockstep=vllm_target, refusals=refusals)


def overlay_differential_mode(retain_retired: bool = False, refusals: bool = False) -> Mode:
    """Model vs vLLM 0.33.0 with the hold overlay, hold on, strict level:
    every invariant, the hold's included, and any divergence fails.
    `retire`: the overlay's retention of retired states on too (the fork);
    `refusals` as for `differential_mode`."""
    return Mode(
        hold=True,
        invariants=ALL_INVARIANTS,
        lockstep=vllm_with_overlay,
        retain_retired=retain_retired,
        refusals=refusals,
    )


# Deployment families, for a short differential exploration that splits
# its budget over them (the fault campaign's). A hybrid model with prefix
# caching, by how its blocks are keyed for a drafter -- EAGLE/MTP with
# lookahead hashes (vLLM's default for them: every key covers the next
# token), with the trailing-block drop instead, or no drafter -- x no
# prefill checkpoint block (GDN on Triton) or one at alignment 1 (Mamba2: a
# checkpoint column, and an export at every chunk end inside a block); then
# a pure Mamba model (the unitary coordinator), with retention as drawn
# and dense, and prefix caching off. A
# fault on one side is often invisible from the others, and a knob left to
# swarm drawing is on in about a quarter of the examples: a family makes it
# every one of its share. Within each, every other knob is drawn.
HYBRID_CACHED: dict[str, Any] = {"pure_mamba": False, "prefix_caching": True}
DRAFTERS: tuple[dict[str, Any], ...] = (
    {"eagle": True, "hash_lookahead_tokens": 1},
    {"eagle": True, "hash_lookahead_tokens": 0},
    {"eagle": False},
)
FAMILIES: tuple[dict[str, Any], ...] = (
    *(
        {**HYBRID_CACHED, **drafter, "prefill_checkpoint": checkpoint}
        for drafter in DRAFTERS
        for checkpoint in ((0, None), (1, 1))
    ),
    # Pure Mamba models (Mamba-Codestral, Falcon-Mamba) are served without
    # an EAGLE/MTP drafter: with one, the drop hides the end of every hit.
    # Retention as drawn (vLLM's default, sparse, keeps no block-aligned
    # prompt end), and dense: every state kept, so a lookup can reach a
    # prompt's end.
    # One Mamba group: a pure Mamba model has no other (`knobs._pure_mamba`).
    # No KV connector there: these families' share stays on the unitary
    # coordinator's own paths (the hybrid families draw the connector).
    {"mamba_groups": 1, "pure_mamba": True, "eagle": False, "kv_connector": "off"},
    {
        "mamba_groups": 1,
        "pure_mamba": True,
        "eagle": False,
        "retention_interval": None,
        "kv_connector": "off",
    },
    {"prefix_caching": False},
)
