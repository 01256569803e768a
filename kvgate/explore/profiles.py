"""Hypothesis settings for exploration: `dev`, `ci` and `nightly`.

Kept as settings objects rather than registered profiles: Hypothesis loads
its own `ci` profile when the CI variable is set, and a run here must not
depend on the environment. No example database: a run is reproduced from its
seed (`ci` is derandomized) and a failure from its saved trace.
"""

from __future__ import annotations

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


def profile(name: str, **overrides: Any) -> settings:
    """The named profile, with any setting overridden."""
    if name not in PROFILES:
        raise KeyError(f"no profile {name!r} (profiles: {', '.join(PROFILES)})")
    return settings(PROFILES[name], **overrides)
