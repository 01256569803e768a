"""A gate over a corpus larger than it holds: every trace validated first,
then each one's steps read when it runs, one trace's body in memory at a
time, with the same report as a corpus held whole."""

from __future__ import annotations

import gc
import io
import re
import weakref
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from kvgate import cli
from kvgate.conformance import corpora
from kvgate.conformance.corpora import HELD_FILE_BYTES, read_corpora, read_held
from kvgate.conformance.trace import Trace, bundled_corpus, load_trace

MANAGER = (
    "attention-partial-tail-promoted",
    "seed1-next-turn-after-burst.hold-on",
    "abort-mid-prefill",
)
ENGINE = ("sched-async-abort-frees-after-batch", "sched-abort-mid-prefill")


def corpus(folder: Path) -> Path:
    """Manager-level traces in both forms (one step a line, and not) and
    scheduler-level ones, copied into `folder`."""
    folder.mkdir()
    for name in MANAGER:
        (folder / f"{name}.yaml").write_text((bundled_corpus() / f"{name}.yaml").read_text())
    for name in ENGINE:
        source = bundled_corpus() / "scheduler" / f"{name}.yaml"
        (folder / f"{name}.yaml").write_text(source.read_text())
    return folder


def gate(traces: list[Trace]) -> tuple[int, str]:
    """The gate on the model over `traces`: its exit code and its report,
    timings masked."""
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.run_traces(traces, "model", "strict", None, None, required=("none",))
    return code, re.sub(r"\d+\.\d+s", "#s", out.getvalue())


def test_beyond_the_bytes_it_holds_a_corpus_keeps_heads_only(tmp_path: Path) -> None:
    folder = corpus(tmp_path / "corpus")
    held = read_corpora([folder], bundled=False)
    heads = read_corpora([folder], bundled=False, held_bytes=0)
    assert [t.name for t in heads.traces] == [t.name for t in held.traces]
    assert all(t.steps or t.engine for t in held.traces)
    for trace in heads.traces:
        assert not trace.steps and not trace.primitives and not trace.engine
        # Streamed from its file as it replays, or read again when it runs.
        assert (trace.stream is None) != (trace.read_again is None)
    assert sum(t.stream is not None for t in heads.traces) == 2  # one step a line
    assert [t.config for t in heads.traces] == [t.config for t in held.traces]


def test_a_long_trace_is_never_held_whole(tmp_path: Path) -> None:
    folder = corpus(tmp_path / "corpus")
    source = (bundled_corpus() / "dense-retention-multiturn.hold-off.yaml").read_text()
    head = source.split("steps:\n")[0].replace("dense-retention-multiturn.hold-off", "long")
    steps = "".join(
        f"  - {{op: arrive, req: R{k}, prompt: [{{fresh: 40}}]}}\n"
        f"  - {{op: prefill, req: R{k}, lookahead: 3}}\n"
        f"  - {{op: free, req: R{k}, how: finish}}\n"
        "  - {op: drain}\n"
        for k in range(1000)
    )
    (folder / "long.yaml").write_text(f"{head}steps:\n{steps}")
    assert (folder / "long.yaml").stat().st_size > HELD_FILE_BYTES
    traces = {t.name: t for t in read_corpora([folder], bundled=False).traces}
    assert traces["long"].stream is not None and not traces["long"].steps
    # The short ones are held whole: read once.
    assert all(t.steps or t.engine for name, t in traces.items() if name != "long")
    # `kvgate replay` given the files reads them alike.
    held, invalid = read_held(sorted(folder.iterdir()))
    assert not invalid
    assert [(t.name, t.stream is None, bool(t.steps or t.engine)) for t in held] == [
        (t.name, t.stream is None, bool(t.steps or t.engine)) for t in traces.values()
    ]


def test_each_trace_is_read_when_it_runs_the_one_before_it_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = corpus(tmp_path / "corpus")
    expected = gate(read_corpora([folder], bundled=False).traces)
    heads = read_corpora([folder], bundled=False, held_bytes=0).traces

    bodies: list[weakref.ref[Trace]] = []
    load: Callable[..., Trace] = load_trace

    def load_one(*args: Any, **kwargs: Any) -> Trace:
        gc.collect()
        assert not [body for body in bodies if body() is not None], "a trace read earlier is held"
        trace = load(*args, **kwargs)
        bodies.append(weakref.ref(trace))
        return trace

    monkeypatch.setattr(corpora, "load_trace", load_one)
    assert gate(heads) == expected
    # Every trace not streamed was read again, once, as it ran.
    assert len(bodies) == len(heads) - 2


def test_a_trace_changed_after_it_was_read_is_an_error_not_a_pass(tmp_path: Path) -> None:
    folder = corpus(tmp_path / "corpus")
    heads = read_corpora([folder], bundled=False, held_bytes=0).traces
    head = next(t for t in heads if t.scheduler_level)
    head.path.write_text(head.path.read_text().replace(f"name: {head.name}", "name: another"))
    code, report = gate([head])
    assert code == 2
    assert f"{head.path}: file: changed since the corpus was read" in report
