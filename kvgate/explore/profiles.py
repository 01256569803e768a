"""Hypothesis settings for exploration: `dev`, `ci` and `nightly`, at the
manager level and (smaller) at the Scheduler level.

Kept as settings objects rather than registered profiles: Hypothesis loads
its own `ci` profile when the CI variable is set, and a run here must not
depend on the environment. No example database: a run is reproduced from its
seed (`ci` is derandomized) and a failure from its saved trace; runs draw
without Hypothesis's pool of constants from the modules loaded so far
(`draws_from_the_seed_alone`), which made a seeded run depend on what the
process had imported before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, Phase, settings

_BASE = settings(
    deadline=None,
    database=None,
    # One failure, shrunk and saved; not every distinct bug found on the way.
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    # `target`: the machine steers toward resume depth, held blocks and
    # free-queue pressure (`hypothesis.target` in its teardown).
    phases=(Phase.explicit, Phase.generate, Phase.target, Phase.shrink),
    print_blob=False,
)

PROFILES: dict[str, settings] = {
    # Seconds: a quick look while editing.
    "dev": settings(_BASE, max_examples=25, stateful_step_count=20),
    # The default test run: deterministic, a few minutes for everything.
    "ci": settings(_BASE, max_examples=400, stateful_step_count=30, derandomize=True),
    # Long: run outside the default suite (`kvgate explore --profile nightly`).
    "nightly": settings(_BASE, max_examples=5000, stateful_step_count=100),
}


# The same names at the Scheduler level (`kvgate explore --scope scheduler`),
# smaller: every example builds vLLM's `Scheduler`, and every engine step
# runs a whole `schedule()` on both sides.
SCHEDULER_PROFILES: dict[str, settings] = {
    "dev": settings(_BASE, max_examples=10, stateful_step_count=15),
    # The default test run: deterministic, seconds.
    "ci": settings(_BASE, max_examples=100, stateful_step_count=25, derandomize=True),
    "nightly": settings(_BASE, max_examples=1000, stateful_step_count=60),
}

# The profiles of each exploration scope.
SCOPES: dict[str, dict[str, settings]] = {"manager": PROFILES, "scheduler": SCHEDULER_PROFILES}


def profile(name: str, scope: str = "manager", **overrides: Any) -> settings:
    """The named profile of `scope`, with any setting overridden."""
    profiles = SCOPES[scope]
    if name not in profiles:
        raise KeyError(f"no profile {name!r} (profiles: {', '.join(profiles)})")
    return settings(profiles[name], **overrides)


@contextmanager
def draws_from_the_seed_alone() -> Iterator[None]:
    """Hypothesis draws, now and then, a literal constant found in the local
    (non-installed) modules imported so far, and it reads them afresh
    whenever `sys.modules` grows. Which kvgate modules a process has imported
    by the time a search starts (a test file run earlier, the CLI against a
    test) then changes a seeded search's draws. Inside this block the local
    pool is empty (its cached draws dropped on the way in and out), so a run
    depends on its seed and settings only. A Hypothesis without the pool is
    left alone."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # pragma: no cover - a Hypothesis laid out otherwise
        yield
        return
    local_constants = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if local_constants is None or cache is None:
        yield
        return
    empty = Constants()
    cache.cache.clear()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = local_constants
        cache.cache.clear()
