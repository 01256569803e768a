"""A manager-level trace read entry by entry, for histories too long to hold.

`kvgate replay --stream` reads a trace whose `steps` are written one flow
mapping a line (as kvgate writes every trace) twice, a line at a time:

1. The first pass validates every step, as the whole-file reader does, so a
   bad step is refused by file, step and field before anything runs, and
   notes the last step that names each request.
2. The replay's pass reads each step again as it runs it, and once a step
   is the last to name an ended request, tells both sides they may forget
   it (`forget`): nothing is held that a later step does not need.

Peak memory then follows the pool and the requests alive at once, not the
history's length. A trace in any other form is read whole, as without
`--stream`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from kvgate.conformance.limits import DEFAULT_LIMITS, LimitError, Limits, check_file, over
from kvgate.conformance.macros import expand
from kvgate.conformance.strict_yaml import load_document, load_flow_entry
from kvgate.conformance.trace import Trace, TraceError, _Reader, load_trace, read_each
from kvgate.vocabulary.ops import Step

_BODY = "steps:\n"
_ENTRY = "  - {"
# Every bare word of an entry: a request is named by one (as `req`, a
# prompt's source, a `check` key), so the last line holding its name is the
# last that needs it (a word that names no request costs an entry here).
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")

Forget = Callable[[list[str]], None]


@dataclass(frozen=True)
class StepStream:
    """A validated trace's primitive steps, read again from its file as they
    run. `last_use`: each word's last step index (request names among them)."""

    path: Path
    body_offset: int
    limits: Limits
    last_use: dict[str, int]

    def primitives(self, forget: Forget | None = None) -> Iterator[Step]:
        """The steps as the replayer runs them; before each step, `forget`
        is told the requests no step from it on names."""
        reader = _Reader(self.path, self.limits)
        ended_at: dict[int, list[str]] = {}
        for name, index in self.last_use.items():
            ended_at.setdefault(index, []).append(name)
        with self.path.open(encoding="utf-8") as file:
            file.seek(self.body_offset)
            head = _head(self.path, self.limits)
            reader.config = head.config
            reader.entries({"steps": [None]}, "steps")
            for index, raw in enumerate(_entries(file, self.path)):
                if index and forget is not None and index - 1 in ended_at:
                    forget(ended_at.pop(index - 1))
                yield from expand(reader.step(index, raw))


def _head(path: Path, limits: Limits) -> Trace:
    """The trace's head (everything before `steps:`) as a trace of one step
    (never run): its name, about, tags and config, validated."""
    with path.open(encoding="utf-8") as file:
        lines = []
        for line in file:
            if line == _BODY:
                break
            lines.append(line)
    text = "".join(lines) + "steps:\n  - {op: step}\n"
    return _Reader(path, limits).trace(load_document(text, path, limits))


def _entries(file: TextIO, path: Path) -> Iterator[object]:
    for index, line in enumerate(file):
        if not line.startswith(_ENTRY):
            raise TraceError(
                path,
                index,
                "steps",
                "a streamed trace has one step a line, `  - {...}`, to its end",
            )
        try:
            yield load_flow_entry(line[4:])
        except ValueError as error:
            raise TraceError(path, index, "yaml", str(error)) from None


def stream_trace(path: str | Path, limits: Limits = DEFAULT_LIMITS) -> Trace:
    """The trace in `path`, validated entry by entry, its steps left in the
    file (`Trace.stream`); a trace in another form (not one step a line, a
    scheduler-level trace, a refusal trace) is read whole (`load_trace`)."""
    path = Path(path)
    try:
        check_file(path, limits)
    except LimitError as error:
        raise TraceError(path, None, error.field, error.message) from None
    offset = _body_offset(path)
    if offset is None:
        return load_trace(path, limits)
    head = _head(path, limits)
    if head.scheduler_level or head.expect_refused is not None:
        return load_trace(path, limits)
    last_use: dict[str, int] = {}
    reader = _Reader(path, limits)
    reader.config = head.config
    reader.entries({"steps": [None]}, "steps")
    count = 0
    with path.open(encoding="utf-8") as file:
        file.seek(offset)
        for index, raw in enumerate(_entries(file, path)):
            reader.step(index, raw)
            count += 1
            if count > limits.steps:
                raise TraceError(path, None, "steps", over("steps", count, limits))
            for word in _WORD.findall(str(raw)):
                last_use[word] = index
    if not count:
        raise TraceError(path, None, "steps", "must be a non-empty list, got an empty one")
    stream = StepStream(path, offset, limits, last_use)
    return replace(head, steps=(), primitives=(), stream=stream)


def _body_offset(path: Path) -> int | None:
    """Where the first step's line starts, if the file has a `steps:` line
    and every line after it is one step; else None."""
    offset = 0
    body: int | None = None
    entry = _ENTRY.encode()
    with path.open("rb") as file:
        for line in file:
            if body is not None and not line.startswith(entry):
                return None
            offset += len(line)
            if body is None and line == _BODY.encode():
                body = offset
    return body


def read_streamed(
    paths: Sequence[str | Path], limits: Limits = DEFAULT_LIMITS
) -> tuple[list[Trace], list[TraceError]]:
    """`read_traces` for `--stream`: each trace validated entry by entry."""
    return read_each(paths, lambda path: stream_trace(path, limits))
