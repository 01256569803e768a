"""A plain progress bar on stderr (no dependency).

On a terminal the bar is redrawn in place, at most every `interval` seconds;
elsewhere (a log, CI) each phase prints one line when it ends, so a log is
not flooded with redraws.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 30


class Progress:
    def __init__(
        self, stream: TextIO | None = None, interval: float = 0.1, quiet: bool = False
    ) -> None:
        """`quiet` (`-q`): phases are timed, nothing is printed."""
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.live = self.stream.isatty() and not quiet
        self.interval = interval
        self.label = ""
        self.total = 0
        self.done = 0
        self.started = 0.0
        self._drawn = 0.0

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.started = self._drawn = time.perf_counter()
        if self.live:
            self._draw()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.live and time.perf_counter() - self._drawn >= self.interval:
            self._draw()

    def set(self, done: int) -> None:
        self.advance(done - self.done)

    def finish(self, note: str = "") -> float:
        """End the phase; returns its duration in seconds."""
        seconds = time.perf_counter() - self.started
        self.done = self.total
        tail = f" {note}" if note else ""
        if self.quiet:
            return seconds
        if self.live:
            self._draw(f" {seconds:.1f}s{tail}\n")
        else:
            self.stream.write(f"{self.label}: done in {seconds:.1f}s{tail}\n")
        self.stream.flush()
        return seconds

    def _draw(self, end: str = "") -> None:
        self._drawn = time.perf_counter()
        fraction = min(self.done / self.total, 1.0)
        filled = int(fraction * WIDTH)
        bar = "#" * filled + "." * (WIDTH - filled)
        self.stream.write(f"\r{self.label:<34} [{bar}] {fraction:4.0%}{end}")
        self.stream.flush()
