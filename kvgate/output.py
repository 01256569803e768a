"""Output levels and vLLM's log lines, for every command.

Levels: `-q` (quiet: failures and the summary), the default (kvgate's own
progress), `-v` (also vLLM's warnings as they happen), `-vv` (also vLLM's
info and debug lines, with the logger that wrote them).

vLLM logs through the standard `logging` module under the logger "vllm"
and its children. Many traces make vLLM refuse or warn on purpose (a
prefix-cache reset while blocks are in use, a config it cannot build), and
its import prints platform notes ("Failed to import from vllm._C"); shown
as they come, those look like failures and bury the progress lines. So a
command installs `VllmLogs` once: by default it keeps each unit of work's
records (a trace, an example, a fault) and shows them only when that unit
fails, as pytest captures output; every record is counted, and the
summary says how many there were and where from. Records from child
processes are handled by the same class installed in the child.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

VLLM_LOGGER = "vllm"

QUIET = -1
DEFAULT = 0
VERBOSE = 1
DEBUG = 2

# vLLM reads these at import; an application that owns its logging asks
# vLLM not to install its own handler (which would print every line).
_VLLM_CONFIGURE_LOGGING = "VLLM_CONFIGURE_LOGGING"


@dataclass
class CapturedLogs:
    """One unit of work's vLLM records (kept only below `-v`)."""

    kind: str
    lines: list[str] = field(default_factory=list)
    levels: Counter[str] = field(default_factory=Counter)

    @property
    def count(self) -> int:
        return sum(self.levels.values())


class VllmLogs(logging.Handler):
    """The one handler on vLLM's logger while a command runs: counts every
    record, prints it at once with `-v`, otherwise keeps it with the unit of
    work running (see `unit`) so a failing unit can show its own."""

    def __init__(self, verbosity: int = DEFAULT, stream: TextIO | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.verbosity = verbosity
        self.stream = stream
        self._current: CapturedLogs | None = None
        # kind of unit (e.g. "refusal traces") -> level name -> records.
        self.counted: dict[str, Counter[str]] = {}
        self._logger = logging.getLogger(VLLM_LOGGER)
        self._saved: tuple[int, bool] | None = None

    # -- installing --------------------------------------------------------

    def install(self) -> VllmLogs:
        os.environ.setdefault(_VLLM_CONFIGURE_LOGGING, "0")
        self._saved = (self._logger.level, self._logger.propagate)
        self._logger.setLevel(logging.DEBUG if self.verbosity >= DEBUG else logging.WARNING)
        self._logger.propagate = False
        self._logger.addHandler(self)
        return self

    def uninstall(self) -> None:
        self._logger.removeHandler(self)
        if self._saved is not None:
            self._logger.setLevel(self._saved[0])
            self._logger.propagate = self._saved[1]
            self._saved = None

    # -- recording ---------------------------------------------------------

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self._line(record)
        except Exception:  # a record whose message cannot be formatted
            self.handleError(record)
            return
        unit = self._current
        kind = unit.kind if unit is not None else "loading vLLM"
        self.counted.setdefault(kind, Counter())[record.levelname.lower()] += 1
        if self.verbosity >= VERBOSE:
            self._write(line)
        elif unit is not None:
            unit.lines.append(line)
            unit.levels[record.levelname.lower()] += 1

    @contextmanager
    def unit(self, kind: str) -> Iterator[CapturedLogs]:
        """Records logged inside the block belong to one unit of work of
        `kind` (plural, as the summary names it: "traces", "refusal
        traces", "examples"); `show` prints them if the unit failed."""
        outer = self._current
        captured = CapturedLogs(kind)
        self._current = captured
        try:
            yield captured
        finally:
            self._current = outer

    def restart_count(self) -> None:
        """Count afresh (a forked child, whose parent already counts what it
        inherited); `merge` adds a child's counts back in the parent."""
        self.counted = {}

    def merge(self, counted: dict[str, Counter[str]]) -> None:
        for kind, levels in counted.items():
            self.counted.setdefault(kind, Counter()).update(levels)

    def show(self, captured: CapturedLogs, title: str) -> None:
        """A failed unit's records (nothing when `-v` already printed them)."""
        if not captured.lines or self.verbosity >= VERBOSE:
            return
        self._write(f"vLLM logged during {title}:")
        for line in captured.lines:
            self._write(f"  {line}")

    # -- the summary -------------------------------------------------------

    def summary(self) -> str | None:
        """One line: how many records vLLM logged and from which kind of
        unit, and how to see them; None when it logged nothing."""
        total: Counter[str] = Counter()
        for levels in self.counted.values():
            total.update(levels)
        if not total:
            return None
        what = ", ".join(
            _plural(n, level) for level, n in sorted(total.items(), key=lambda kv: -kv[1])
        )
        kinds = sorted(self.counted, key=lambda k: -sum(self.counted[k].values()))
        if len(kinds) == 1:
            where = f"all from {kinds[0]}"
        else:
            where = ", ".join(f"{sum(self.counted[k].values())} from {k}" for k in kinds)
        hint = "" if self.verbosity >= VERBOSE else "; -v shows them"
        return f"vLLM logged {what} ({where}){hint}"

    def print_summary(self, out: TextIO | None = None) -> None:
        line = self.summary()
        if line is not None and self.verbosity > QUIET:
            print(line, file=out or sys.stdout, flush=True)

    def _line(self, record: logging.LogRecord) -> str:
        message = record.getMessage().replace("\n", " ")
        if self.verbosity >= DEBUG:
            return f"vllm {record.levelname} {record.name}: {message}"
        return f"vllm {record.levelname}: {message}"

    def _write(self, line: str) -> None:
        print(line, file=self.stream or sys.stderr, flush=True)


def _plural(count: int, level: str) -> str:
    noun = {"warning": "warning", "error": "error", "critical": "critical error"}.get(
        level, f"{level} line"
    )
    return f"{count} {noun}{'' if count == 1 else 's'}"


def installed() -> VllmLogs | None:
    """The handler a command installed (inherited by a forked child)."""
    for handler in logging.getLogger(VLLM_LOGGER).handlers:
        if isinstance(handler, VllmLogs):
            return handler
    return None


@contextmanager
def vllm_logs(verbosity: int = DEFAULT, stream: TextIO | None = None) -> Iterator[VllmLogs]:
    """`VllmLogs` installed for the block, removed after it."""
    logs = VllmLogs(verbosity, stream).install()
    try:
        yield logs
    finally:
        logs.uninstall()
