"""Whether a running server has the hold, read from its log: the line kvgate's
hold overlay logs through vLLM's logger when the first Mamba manager with the
hold on is built (`hold_overlay.STARTUP_LINE`), or one of the overlay's two
refusals. Reads text only; imports nothing of vLLM."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvgate.errors import InputError
from kvgate.impl.hold_overlay import NOT_INSTALLED_LINE, REFUSED_LINE, STARTUP_LINE


def _pattern(line: str) -> re.Pattern[str]:
    """A logged line's format as a pattern: each `%s` or `%d` a group."""
    parts = re.split(r"(%[sd])", line)
    return re.compile(
        "".join(
            r"(\d+)" if part == "%d" else r"(.+?)" if part == "%s" else re.escape(part)
            for part in parts
        )
        + "$"
    )


# What every line of the overlay starts with.
_MARK = "kvgate hold overlay "
_STARTED = _pattern(STARTUP_LINE)
_REFUSALS = (_pattern(NOT_INSTALLED_LINE), _pattern(REFUSED_LINE))


@dataclass(frozen=True)
class HoldCheck:
    """What a log says of the hold: `on`, and the line that says it (with
    its line number), or None when the log says nothing of it."""

    on: bool
    line: str | None = None
    number: int = 0


def check_log(path: Path) -> HoldCheck:
    """The first startup line of the hold, else the first refusal, in `path`."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise InputError(f"{path}: cannot read the log: {error.strerror or error}") from None
    refusal: HoldCheck | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        # vLLM prefixes each line (process, level, time, source): search in it.
        start = line.find(_MARK)
        if start < 0:
            continue
        body = line[start:].rstrip()
        if _STARTED.match(body):
            return HoldCheck(True, body, number)
        if refusal is None and any(p.match(body) for p in _REFUSALS):
            refusal = HoldCheck(False, body, number)
    return refusal or HoldCheck(False)
