"""A trace read entry by entry, for histories too long to hold.

`kvgate replay --stream` reads a trace whose `steps` (or, at the Scheduler
level, whose `engine` entries) are written one flow mapping a line (as
kvgate writes every trace) twice, a line at a time:

1. The first pass validates every step, as the whole-file reader does, so a
   bad step is refused by file, step and field before anything runs, and
   notes the last step that names each request.
2. The replay's pass reads each step again as it runs it, and once a step
   is the last to name an ended request, tells both sides they may forget
   it (`forget`): nothing is held that a later step does not need.

Peak memory then follows the pool and the requests alive at once, not the
history's length. A trace in any other form (a recording, with its end
line) is read whole, as without `--stream`. `kvgate shrink` replays a
stream to its first divergence, then reads whole only the entries up to
it (`StepStream.prefix`).
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
from kvgate.conformance.trace import (
    Trace,
    TraceError,
    _Reader,
    is_recording,
    load_trace,
    parse_trace,
    read_each,
)
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.scheduling import EngineStep

# The line a trace's body starts after: a manager-level trace's, a
# scheduler-level one's.
_BODIES = ("steps:\n", "engine:\n")
_ENTRY = "  - {"
# Every bare word of an entry: a request is named by one (as `req`, a
# prompt's source, a `check` key), so the last line holding its name is the
# last that needs it (a word that names no request costs an entry here).
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")

Forget = Callable[[list[str]], None]


@dataclass(frozen=True)
class StepStream:
    """A validated trace's primitive steps, read again from its file as they
    run. `last_use`: each word's last step index (request names among them).
    `length`: the history's length as a whole trace's is counted
    (`shrink.step_count`): its written steps, or at the Scheduler level its
    engine steps (a run of `steps: N` as N)."""

    path: Path
    body_offset: int
    limits: Limits
    last_use: dict[str, int]
    length: int

    def primitives(self, forget: Forget | None = None) -> Iterator[Step]:
        """The steps as the replayer runs them; before each step, `forget`
        is told the requests no step from it on names."""
        for reader, index, raw in self._read(forget):
            yield from expand(reader.step(index, raw))

    def engine(self, forget: Forget | None = None) -> Iterator[EngineStep]:
        """A scheduler-level trace's engine entries as the replayer runs
        them (a run of `steps: N` as N); before each entry, `forget` is told
        the requests no entry from it on names."""
        for reader, index, raw in self._read(forget):
            yield from reader.engine_step(index, raw)

    def _read(self, forget: Forget | None) -> Iterator[tuple[_Reader, int, object]]:
        reader = _Reader(self.path, self.limits)
        ended_at: dict[int, list[str]] = {}
        for name, index in self.last_use.items():
            ended_at.setdefault(index, []).append(name)
        head, body = _head(self.path, self.limits)
        reader.config = head.config
        if head.scheduler is not None:
            reader.engine_settings(_settings_doc(head))
        reader.entries({body: [None]}, body)
        with self.path.open(encoding="utf-8") as file:
            file.seek(self.body_offset)
            for index, raw in enumerate(_entries(file, self.path, body)):
                # Told before every entry (with no names, too): a side that
                # keeps a request another still needs drops it once it can.
                if index and forget is not None:
                    forget(ended_at.pop(index - 1, []))
                yield reader, index, raw

    def prefix(self, steps: int) -> Trace:
        """The trace of the first `steps` written steps (or engine entries, a
        run of `steps: N` one of them) alone, read whole: its head and those
        lines, nothing after them."""
        with self.path.open("rb") as file:
            head = file.read(self.body_offset)
            lines = [line for _, line in zip(range(steps), file, strict=False)]
        return parse_trace((head + b"".join(lines)).decode("utf-8"), self.path, self.limits)


def _settings_doc(head: Trace) -> dict[str, int]:
    assert head.scheduler is not None
    return {"spec": head.scheduler.spec, "max_num_seqs": head.scheduler.max_num_seqs}


def _head_lines(path: Path) -> tuple[list[str], str]:
    """The lines before the trace's body, and the body's line."""
    with path.open(encoding="utf-8") as file:
        lines: list[str] = []
        for line in file:
            if line in _BODIES:
                return lines, line
            lines.append(line)
    return lines, _BODIES[0]


def _head(path: Path, limits: Limits) -> tuple[Trace, str]:
    """The trace's head (everything before its body's line) as a trace of
    one step (never run): its name, about, tags, config and scheduler
    settings, validated; and the body's key (`steps` or `engine`)."""
    lines, body = _head_lines(path)
    text = "".join(lines) + body + "  - {op: step}\n"
    return _Reader(path, limits).trace(load_document(text, path, limits)), body[:-2]


def _is_recording(path: Path) -> bool:
    """A recording's head says so; it is read whole, which checks its end
    line (or, with `partial`, where it was cut)."""
    return is_recording("".join(_head_lines(path)[0]))


def _entries(file: TextIO, path: Path, body: str) -> Iterator[object]:
    for index, line in enumerate(file):
        if not line.startswith(_ENTRY):
            raise TraceError(
                path,
                index,
                body,
                "a streamed trace has one entry a line, `  - {...}`, to its end",
            )
        try:
            yield load_flow_entry(line[4:])
        except ValueError as error:
            raise TraceError(path, index, "yaml", str(error)) from None


def stream_trace(path: str | Path, limits: Limits = DEFAULT_LIMITS, partial: bool = False) -> Trace:
    """The trace in `path`, validated entry by entry, its steps (or engine
    entries) left in the file (`Trace.stream`); a trace in another form (not
    one entry a line, a recording, a refusal trace) is read whole
    (`load_trace`, `partial` applying to it)."""
    path = Path(path)
    try:
        check_file(path, limits)
    except LimitError as error:
        raise TraceError(path, None, error.field, error.message) from None
    offset = _body_offset(path)
    if offset is None or _is_recording(path):
        return load_trace(path, limits, partial)
    head, body = _head(path, limits)
    if head.expect_refused is not None:
        return load_trace(path, limits, partial)
    last_use: dict[str, int] = {}
    reader = _Reader(path, limits)
    reader.config = head.config
    if head.scheduler is not None:
        reader.engine_settings(_settings_doc(head))
    reader.entries({body: [None]}, body)
    count = length = 0
    with path.open(encoding="utf-8") as file:
        file.seek(offset)
        for index, raw in enumerate(_entries(file, path, body)):
            if head.scheduler_level:
                length += len(reader.engine_step(index, raw))
            else:
                reader.step(index, raw)
                length += 1
            count += 1
            if count > limits.steps:
                raise TraceError(path, None, body, over("steps", count, limits))
            for word in _WORD.findall(str(raw)):
                last_use[word] = index
    if not count:
        raise TraceError(path, None, body, "must be a non-empty list, got an empty one")
    stream = StepStream(path, offset, limits, last_use, length)
    if head.scheduler_level:
        return replace(head, engine=(), stream=stream)
    return replace(head, steps=(), primitives=(), stream=stream)


def _body_offset(path: Path) -> int | None:
    """Where the first step's line starts, if the file has a `steps:` line
    and every line after it is one step; else None."""
    offset = 0
    body: int | None = None
    entry = _ENTRY.encode()
    lines = tuple(b.encode() for b in _BODIES)
    with path.open("rb") as file:
        for line in file:
            if body is not None and not line.startswith(entry):
                return None
            offset += len(line)
            if body is None and line in lines:
                body = offset
    return body


def read_streamed(
    paths: Sequence[str | Path], limits: Limits = DEFAULT_LIMITS
) -> tuple[list[Trace], list[TraceError]]:
    """`read_traces` for `--stream`: each trace validated entry by entry."""
    return read_each(paths, lambda path: stream_trace(path, limits))
