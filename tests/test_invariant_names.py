"""One name per invariant in every layer (kvgate/invariants/catalogue.py)."""

from __future__ import annotations

from kvgate.explore.session import ALL_INVARIANTS, MODEL_INVARIANTS
from kvgate.invariants.catalogue import CATALOGUE, NAMES
from kvgate.invariants.lifecycle import TRACKERS
from kvgate.invariants.predicates import SNAPSHOT_INVARIANTS
from kvgate.invariants.z3.properties import INVARIANTS as Z3_INVARIANTS


def checked_by(layer: str) -> set[str]:
    return {i.name for i in CATALOGUE if layer in i.checked_by}


def test_each_layer_checks_exactly_what_the_catalogue_says() -> None:
    assert set(SNAPSHOT_INVARIANTS) == checked_by("snapshot")
    assert set(MODEL_INVARIANTS) == checked_by("model")
    assert {t.name for t in TRACKERS} == checked_by("lifecycle")
    assert {p.name for p in Z3_INVARIANTS} == checked_by("z3")


def test_exploration_knows_every_name_and_no_other() -> None:
    assert set(ALL_INVARIANTS) == NAMES
    assert len(ALL_INVARIANTS) == len(NAMES)
