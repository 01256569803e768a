"""A seeded exploration draws the same examples whatever the process has
imported before it: Hypothesis's pool of constants from the local modules
loaded so far is kept out of its draws (`draws_from_the_seed_alone`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.explore import machine_run
from kvgate.explore.profiles import draws_from_the_seed_alone, profile
from kvgate.explore.runner import explore, model_mode

# Constants a local module holds (Hypothesis keeps integers of 100 and up).
PLANTED = tuple(range(424_242, 424_242 + 40))


def seeded_draws(isolated: bool) -> list[int]:
    drawn: list[int] = []

    @settings(
        max_examples=300, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.integers(0, 10**6))
    def draw(value: int) -> None:
        drawn.append(value)

    guard: AbstractContextManager[None] = draws_from_the_seed_alone()
    if isolated:
        with guard:
            draw()
    else:
        draw()
    return drawn


def plant(directory: Path, name: str) -> None:
    module = directory / f"{name}.py"
    module.write_text(f"TABLE = {list(PLANTED)}\n", encoding="utf-8")
    sys.path.insert(0, str(directory))
    try:
        importlib.import_module(name)
    finally:
        sys.path.remove(str(directory))


def forget(name: str) -> None:
    """Drop the planted module and its constants from Hypothesis's pool, so
    later tests in this process draw as they would have."""
    from hypothesis.internal.conjecture import providers

    sys.modules.pop(name, None)
    providers._local_constants.integers -= set(PLANTED)
    providers.CONSTANTS_CACHE.cache.clear()


@pytest.fixture
def planted_module(tmp_path: Path) -> Iterator[None]:
    """A local module full of constants, as an unrelated kvgate module that
    an earlier test imported would be."""
    plant(tmp_path, "kvgate_planted_constants")
    yield
    forget("kvgate_planted_constants")


def test_loaded_modules_change_plain_draws(planted_module: None) -> None:
    """Why the guard exists: outside it, the planted constants are drawn."""
    assert set(seeded_draws(isolated=False)) & set(PLANTED)


def test_inside_the_guard_draws_depend_on_the_seed_alone(tmp_path: Path) -> None:
    before = seeded_draws(isolated=True)
    plant(tmp_path, "kvgate_planted_constants_2")
    try:
        after = seeded_draws(isolated=True)
    finally:
        forget("kvgate_planted_constants_2")
    assert after == before
    assert not set(after) & set(PLANTED)


def test_every_exploration_run_is_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[bool] = []

    @contextmanager
    def recording() -> Iterator[None]:
        entered.append(True)
        with draws_from_the_seed_alone():
            yield

    monkeypatch.setattr(machine_run, "draws_from_the_seed_alone", recording)
    explore(model_mode(hold=True), profile("dev", max_examples=2), seed=0)
    assert entered
