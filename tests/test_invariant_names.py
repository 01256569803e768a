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


def test_every_z3_check_is_a_catalogue_property_in_its_encodings_table() -> None:
    """A check registered in either encoding is an invariant or a lemma of the
    catalogue and appears in that encoding's table (none dropped silently)."""
    from kvgate.invariants.catalogue import LEMMA_NAMES, Z3_INVARIANT_NAMES
    from kvgate.invariants.z3 import properties, unbounded_properties

    for checks, table in (
        (properties._CHECKS, properties.PROPERTIES),
        (unbounded_properties._CHECKS, unbounded_properties.UPROPERTIES),
    ):
        assert set(checks) <= set(Z3_INVARIANT_NAMES) | set(LEMMA_NAMES)
        assert [p.name for p in table] == [
            n for n in (*Z3_INVARIANT_NAMES, *LEMMA_NAMES) if n in checks
        ]
