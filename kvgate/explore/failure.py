"""A failure exploration found and the history that led to it as a trace:
named by a digest of that trace, shown as it, saved as it (`TraceFailure`).
The manager level's failure (`session.ExploreFailure`) writes version-1
steps.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvgate.conformance.writer import save_text


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
