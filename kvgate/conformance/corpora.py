"""The corpora a gate runs: the bundled one, and each folder `--corpus` adds.

Each corpus is a folder read with its subfolders (the bundled one holds the
scheduler-level traces in `scheduler/`), its `*.yaml` files sorted by path.
A file is read once, however many corpora hold it: naming the bundled
folder beside the bundled corpus adds nothing. Two traces of one name, from
any corpora, are refused (a report line or a JUnit case would not say which
of them ran).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.conformance.limits import DEFAULT_LIMITS, Limits
from kvgate.conformance.trace import (
    Trace,
    TraceError,
    bundled_corpus,
    check_unique_names,
    read_traces,
)

# How a run names the corpus kvgate ships.
BUNDLED = "bundled"


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
) -> Corpora:
    """The bundled corpus (unless `bundled` is false), then each of `folders`
    in order (`partial` applies to those; the bundled traces are complete)."""
    corpora = Corpora()
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
        traces, invalid = read_traces(fresh, limits, cut_short)
        corpora.traces += traces
        corpora.invalid += invalid
    check_unique_names(corpora.traces)
    return corpora
