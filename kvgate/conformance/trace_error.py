"""`TraceError`: an invalid trace, as one line naming file, step and field."""

from __future__ import annotations

from pathlib import Path

from kvgate.errors import KvgateError, printable
from kvgate.vocabulary.config import UnsupportedConfig

# How much of a field (a key path, perhaps a hostile key) an error line shows.
FIELD_WIDTH = 80


class TraceError(KvgateError, ValueError):
    """An invalid trace: one line, `<file>: step <i>: <field>: <message>`.

    `step_index` is None for document-level problems (the `step <i>` part is
    then left out). Raised by the loader, and by a replay when a target
    refuses a step the trace should not have asked for.
    """

    def __init__(self, path: str | Path, step_index: int | None, field: str, message: str) -> None:
        # One line whatever the message holds (YAML errors span several).
        self.path = Path(path)
        self.step_index = step_index
        self.field = field
        self.message = " ".join(message.split())
        super().__init__(str(self))

    def __str__(self) -> str:
        # A key or a path from the input may hold a newline or an escape
        # sequence: escaped, the error stays one physical line that says
        # only what it means. A field is a key path, short unless hostile.
        step = "" if self.step_index is None else f"step {self.step_index}: "
        field = self.field if len(self.field) <= FIELD_WIDTH else self.field[:FIELD_WIDTH] + "..."
        return printable(f"{self.path}: {step}{field}: {self.message}")

    @classmethod
    def unsupported(cls, path: str | Path, error: UnsupportedConfig) -> TraceError:
        """A config a target (or the model, or `validate`) will not run."""
        return cls(path, None, f"config.{error.field}", error.message)
