"""The corpora a gate runs: the bundled one, and each folder `--corpus` adds.

Each corpus is a folder read with its subfolders (the bundled one holds the
scheduler-level traces in `scheduler/`), its `*.yaml` files sorted by path.
A file is read once, however many corpora hold it: naming the bundled
folder beside the bundled corpus adds nothing. Two traces of one name, from
any corpora, are refused (a report line or a JUnit case would not say which
of them ran).

Every trace is validated when the corpora are read, before anything runs,
but a gate holds only a bounded amount of them at once: a short trace (its
file within `HELD_FILE_BYTES`) is kept whole while the files kept total
within `HELD_BYTES`; every other trace is kept as its head alone (its name,
config, tags: what selection and the report need). A manager-level
trace written one step a line is then read as `kvgate replay --stream`
reads it, its steps read from its file as they replay; any other trace is
set aside and read whole again when it runs (`whole`). Peak memory follows
the largest trace replayed, not the corpus.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvgate.conformance.limits import DEFAULT_LIMITS, Limits
from kvgate.conformance.stream import stream_trace
from kvgate.conformance.trace import (
    ReadAgain,
    Trace,
    TraceError,
    bundled_corpus,
    check_unique_names,
    load_trace,
    read_each,
    read_traces,
)

# How a run names the corpus kvgate ships.
BUNDLED = "bundled"
# The bytes of trace files a gate holds read whole, and the largest file it
# holds so: the bundled corpus fits (its files are a few kilobytes each), so
# its traces are read once; a long trace is never held whole (in memory a
# trace takes tens of times its file's bytes).
HELD_BYTES = 1 << 20
HELD_FILE_BYTES = 64 << 10


@dataclass(frozen=True)
class CorpusCount:
    """One corpus's traces in a run, of each kind."""

    name: str
    manager_level: int
    scheduler_level: int

    def line(self) -> str:
        """`NAME: manager-level M traces, scheduler-level S traces` (no
        `NAME: ` when the traces were named one by one)."""
        named = f"{self.name}: " if self.name else ""
        return (
            f"{named}manager-level {self.manager_level} traces, "
            f"scheduler-level {self.scheduler_level} traces"
        )


@dataclass
class Corpora:
    """The traces read, each invalid one's error, and which corpus each file
    came from (by corpus, in the order they were named)."""

    traces: list[Trace] = field(default_factory=list)
    invalid: list[TraceError] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    origin: dict[Path, str] = field(default_factory=dict)

    def counts(self, traces: Sequence[Trace]) -> list[CorpusCount]:
        """How many of `traces` (a selection of this run's) each corpus holds."""
        counts = []
        for name in self.names:
            mine = [t for t in traces if self.origin.get(t.path.resolve()) == name]
            engine = sum(t.scheduler_level for t in mine)
            counts.append(CorpusCount(name, len(mine) - engine, engine))
        return counts


def corpus_files(directory: Path) -> list[Path]:
    """Every `*.yaml` under `directory`, its subfolders included, sorted by
    path; a directory that is missing or holds none raises."""
    if not directory.is_dir():
        raise TraceError(directory, None, "corpus", "is not a directory")
    paths = sorted(p for p in directory.rglob("*.yaml") if p.is_file())
    if not paths:
        raise TraceError(directory, None, "corpus", "holds no *.yaml traces")
    return paths


def read_corpora(
    folders: Sequence[Path] = (),
    bundled: bool = True,
    limits: Limits = DEFAULT_LIMITS,
    partial: bool = False,
    held_bytes: int = HELD_BYTES,
) -> Corpora:
    """The bundled corpus (unless `bundled` is false), then each of `folders`
    in order (`partial` applies to those; the bundled traces are complete);
    traces read whole until their files reach `held_bytes`, the rest kept as
    their heads (see the module's docstring)."""
    corpora = Corpora()
    holding = _Holding(limits, held_bytes)
    named: list[tuple[str, Path, bool]] = []
    if bundled:
        named.append((BUNDLED, bundled_corpus(), False))
    named += [(str(folder), folder, partial) for folder in folders]
    for name, folder, cut_short in named:
        fresh = [p for p in corpus_files(folder) if p.resolve() not in corpora.origin]
        if name not in corpora.names:
            corpora.names.append(name)
        for path in fresh:
            corpora.origin[path.resolve()] = name
        traces, invalid = read_each(fresh, functools.partial(holding.read, partial=cut_short))
        corpora.traces += traces
        corpora.invalid += invalid
    check_unique_names(corpora.traces)
    return corpora


def read_held(
    paths: Sequence[str | Path],
    limits: Limits = DEFAULT_LIMITS,
    partial: bool = False,
    held_bytes: int = HELD_BYTES,
) -> tuple[list[Trace], list[TraceError]]:
    """`trace.read_traces` as a gate reads its corpora: every trace
    validated, short ones held whole, the others kept as their heads
    (`kvgate replay` given many traces). A single trace is read whole, once:
    nothing else is held beside it."""
    if len(paths) == 1:
        return read_traces(paths, limits, partial)
    holding = _Holding(limits, held_bytes)
    return read_each(paths, lambda path: holding.read(path, partial))


class _Holding:
    """What a run still holds room for: short traces read whole while the
    files held stay within `held_bytes`; every other one kept as its head."""

    def __init__(self, limits: Limits, held_bytes: int) -> None:
        self.limits = limits
        self.room = held_bytes

    def read(self, path: str | Path, partial: bool) -> Trace:
        try:
            size = Path(path).stat().st_size
        except OSError:
            size = self.room + 1  # the reader below says what is wrong with it
        if size <= min(self.room, HELD_FILE_BYTES):
            self.room -= size
            return load_trace(path, self.limits, partial)
        return head_only(stream_trace(path, self.limits, partial), self.limits, partial)


def head_only(trace: Trace, limits: Limits, partial: bool) -> Trace:
    """`trace` without the steps it holds in memory (a streamed trace holds
    none), read again by `whole` when it runs."""
    if trace.stream is not None or trace.expect_refused is not None:
        return trace
    return replace(trace, steps=(), primitives=(), engine=(), read_again=ReadAgain(limits, partial))


def whole(trace: Trace) -> Trace:
    """A trace as it replays: one kept as its head (`head_only`) read again
    from its file; any other as it is. A file changed since it was read is
    the trace's error."""
    again = trace.read_again
    if again is None:
        return trace
    read = load_trace(trace.path, again.limits, again.partial)
    if read.name != trace.name or read.config != trace.config or read.cut != trace.cut:
        raise TraceError(
            trace.path, None, "file", "changed since the corpus was read: run the gate again"
        )
    return read
