"""A failure exploration found, at either level, and the history that led to
it as a trace: named by a digest of that trace, shown as it, saved as it
(`TraceFailure`). The manager level's failure (`session.ExploreFailure`)
writes version-1 steps; the Scheduler level's (`SchedulerExploreFailure`)
engine steps, which `kvgate replay FILE --target vllm` shows diverging.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvgate.conformance.writer import dump_engine_trace, engine_step_dicts, save_text
from kvgate.explore.mode import SchedulerMode
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.scheduling import EngineSettings, EngineStep


class TraceFailure(AssertionError):
    """A failure with its history; subclasses say how the history reads as
    a trace (`trace_text`), its name's prefix and its `about` line."""

    def trace_text(self, name: str, about: str | None) -> str:
        raise NotImplementedError

    def name_prefix(self) -> str:
        raise NotImplementedError

    def about(self) -> str:
        raise NotImplementedError

    @property
    def name(self) -> str:
        # The digest of the history alone (no name, no about line), so the
        # same history found twice is saved under the same name.
        body = self.trace_text("explore", None)
        return f"{self.name_prefix()}-{hashlib.blake2b(body.encode(), digest_size=4).hexdigest()}"

    def yaml(self) -> str:
        return self.trace_text(self.name, self.about())

    def save(self, directory: Path) -> Path:
        return save_text(directory, self.name, self.yaml())


class SchedulerExploreFailure(TraceFailure):
    """The Scheduler-level lockstep diverged (or the model raised) after
    `events`."""

    def __init__(
        self,
        kind: str,
        message: str,
        config: Config,
        settings: EngineSettings,
        events: list[EngineStep],
        mode: SchedulerMode,
    ) -> None:
        self.kind = kind
        self.message = message
        self.config = config
        self.settings = settings
        self.events = tuple(events)  # the diverging one last
        self.mode = mode
        super().__init__(f"{kind}: {message}")

    def __str__(self) -> str:
        # Built on demand: Hypothesis raises many of these while it shrinks.
        return f"{self.kind} after {len(self.events)} engine entries: {self.message}\n" + (
            "\n".join(self.runnable())
        )

    def trace_text(self, name: str, about: str | None) -> str:
        return dump_engine_trace(name, self.config, self.settings, self.events, about)

    def name_prefix(self) -> str:
        return "explore-sched"

    def about(self) -> str:
        hold = "on" if self.config.hold else "off"
        return (
            f"Found by kvgate explore --scope scheduler (hold {hold}) against vLLM's "
            f"Scheduler: {self.kind}: {self.message}"
        )

    def runnable(self) -> list[str]:
        """The history as the trace's engine entries, one a line, in order."""
        body = self.trace_text("x", None)
        return body[body.index("engine:") :].rstrip("\n").splitlines()

    def entries(self) -> int:
        return len(engine_step_dicts(self.events))
