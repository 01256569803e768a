"""A pytest plugin: `pytest --kvgate` runs kvgate's traces as tests.

    pytest --kvgate [--kvgate-corpus DIR ...] [--kvgate-no-bundled] [--kvgate-target vllm|model]
                    [--kvgate-require hold|retention|none] [--kvgate-plugin MODULE]
                    [-k EXPR] [-x] [--junit-xml PATH] ...

Registered for every pytest run in the environment (entry point group
`pytest11`) and inert unless `--kvgate` is given. With it, each trace the
gate runs (the corpus kvgate ships, manager-level and scheduler-level, and
each `--kvgate-corpus` folder with its subfolders, as `kvgate gate
--corpus`) is a test item under
`kvgate::<family>::<arm>` (JUnit class `kvgate.<family>.<arm>`), its tags
are keywords, so pytest's `-k` selects by name, tag, family and arm, and
`-x`, `--junit-xml`, `-q` and CI integrations work unchanged. Without test
paths on the command line only the traces are collected; name paths to run
them beside your own tests.

Each item's outcome is the gate's verdict: conforms passes; diverges fails
with its first divergence; a missing capability fails when required
(`--kvgate-require`, default the hold, as `kvgate gate`) and is skipped
otherwise, as is a config the target refuses; an invalid trace fails with
its one-line error. The terminal summary adds one line per missing
capability: what it costs and the remedy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.conformance.corpora import read_corpora
from kvgate.conformance.replay import LEVELS, Level, Outcome, ReplayResult, TargetFactory
from kvgate.conformance.report import capability_lines, divergence_lines, trace_line
from kvgate.conformance.selection import arm, trace_family
from kvgate.conformance.trace import Trace, TraceError
from kvgate.conformance.verdict import (
    CAPABILITY_NAMES,
    REQUIRE_NONE,
    Verdict,
    fails_requirement,
    lacking,
    resolve_required,
    verdict,
)
from kvgate.errors import InputError
from kvgate.targets import (
    LOCKSTEP_MODEL,
    TARGETS,
    gate_factories,
    run_scheduler_trace,
    run_trace,
    scheduler_factories,
)

_OUTCOMES = pytest.StashKey[list[Outcome]]()
_RUN = pytest.StashKey["_GateRun"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvgate", "kvgate: vLLM's KV-cache manager against its model")
    group.addoption(
        "--kvgate", action="store_true", help="collect kvgate's traces as tests (off by default)"
    )
    group.addoption(
        "--kvgate-corpus",
        metavar="DIR",
        type=Path,
        action="append",
        help="also collect the traces in DIR and its subfolders (repeatable; default: only "
        "the corpus kvgate ships), as kvgate gate --corpus",
    )
    group.addoption(
        "--kvgate-no-bundled",
        action="store_true",
        help="leave out the corpus kvgate ships: collect only the --kvgate-corpus folders",
    )
    group.addoption(
        "--kvgate-target",
        default="vllm",
        choices=sorted(TARGETS),
        help="what the traces run on (default: vllm, the installed vLLM)",
    )
    group.addoption(
        "--kvgate-require",
        action="append",
        metavar="CAPABILITY",
        help=f"a capability the build must have: {', '.join(CAPABILITY_NAMES)}, or "
        f"{REQUIRE_NONE} (repeatable; default: hold, as kvgate gate)",
    )
    group.addoption(
        "--kvgate-plugin",
        metavar="MODULE",
        help="a vLLM plugin module for --kvgate-target vllm (e.g. kvgate.impl.hold_overlay)",
    )
    group.addoption(
        "--kvgate-level",
        default="strict",
        choices=LEVELS,
        help="how closely the target must match the model (default: strict)",
    )


class _GateRun:
    """The session's choices, and the target factories built on first use
    (`--kvgate-target vllm` imports vLLM only when a trace runs)."""

    def __init__(self, config: pytest.Config) -> None:
        self.folders: list[Path] = config.getoption("kvgate_corpus") or []
        self.bundled = not config.getoption("kvgate_no_bundled")
        if not self.bundled and not self.folders:
            raise pytest.UsageError("--kvgate-no-bundled: name at least one --kvgate-corpus DIR")
        self.target: str = config.getoption("kvgate_target")
        self.plugin: str | None = config.getoption("kvgate_plugin")
        self.level: Level = config.getoption("kvgate_level")
        try:
            self.required = resolve_required(config.getoption("kvgate_require"))
        except ValueError as error:
            raise pytest.UsageError(f"--kvgate-require: {error}") from None
        if self.plugin is not None and self.target != "vllm":
            raise pytest.UsageError("--kvgate-plugin: only --kvgate-target vllm loads plugins")
        self._factories: tuple[TargetFactory, TargetFactory | None] | None = None
        self._engine: tuple[Any, Any] | None = None

    @property
    def corpora(self) -> str:
        names = (["bundled"] if self.bundled else []) + [str(f) for f in self.folders]
        return ", ".join(names)

    def factories(self) -> tuple[TargetFactory, TargetFactory | None]:
        if self._factories is None:
            self._factories = gate_factories(self.target, self.plugin)
        return self._factories

    def run(self, trace: Trace) -> Outcome:
        """`trace`'s outcome, as `kvgate gate` runs it."""
        if trace.scheduler_level:
            if self._engine is None:
                self._engine = scheduler_factories(self.target, self.plugin)
            model, real = self._engine
            return run_scheduler_trace(trace, model, real, self.level)
        factory, model = self.factories()
        return run_trace(trace, factory, model, self.level, self.target == LOCKSTEP_MODEL)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("kvgate", False):
        config.stash[_RUN] = _GateRun(config)
        config.stash[_OUTCOMES] = []


def pytest_report_header(config: pytest.Config) -> str | None:
    run = config.stash.get(_RUN, None)
    if run is None:
        return None
    required = ",".join(run.required) or REQUIRE_NONE
    plugin = f", plugin {run.plugin}" if run.plugin else ""
    return f"kvgate: corpora {run.corpora}, target {run.target}{plugin}, require {required}"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # `pytest --kvgate` alone runs the traces only, not the tests under the
    # configured test paths; tests named on the command line still run.
    if _RUN in config.stash and config.args_source != pytest.Config.ArgsSource.ARGS:
        return True
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    # First, so that -k and the other selections see the traces too.
    run = config.stash.get(_RUN, None)
    if run is None:
        return
    corpus = Corpus.from_parent(session, name="kvgate", nodeid="kvgate")
    traces = list(_items(corpus.collect()))
    # Counted as collected (the terminal's "collected N items"), as a file's are.
    config.hook.pytest_collectreport(
        report=pytest.CollectReport(corpus.nodeid, "passed", None, list[Any](traces))
    )
    items.extend(traces)


def _items(nodes: Iterable[pytest.Item | pytest.Collector]) -> Iterator[pytest.Item]:
    for node in nodes:
        if isinstance(node, pytest.Item):
            yield node
        else:
            yield from _items(node.collect())


class Corpus(pytest.Collector):
    """The corpus: a collector per family, in it one per arm, in it an item
    per trace (`kvgate::<family>::<arm>::<name>`); the invalid traces under
    `kvgate::invalid`."""

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        run = self.config.stash[_RUN]
        try:
            corpora = read_corpora(run.folders, run.bundled)
        except TraceError as error:
            raise pytest.UsageError(f"--kvgate-corpus: {error}") from None
        traces, invalid = corpora.traces, corpora.invalid
        nodes: list[pytest.Item | pytest.Collector] = [
            Group.from_parent(self, name=name, traces=group, by_arm=True)
            for name, group in _grouped(traces, lambda t: trace_family(t) or "other")
        ]
        if invalid:
            nodes.append(Invalid.from_parent(self, name="invalid", invalid=invalid))
        return nodes


def _grouped(traces: Iterable[Trace], key: Callable[[Trace], str]) -> list[tuple[str, list[Trace]]]:
    groups: dict[str, list[Trace]] = {}
    for trace in traces:
        groups.setdefault(key(trace), []).append(trace)
    return sorted(groups.items())


class Group(pytest.Collector):
    """A family's traces (`by_arm`: a collector per arm), or an arm's (an item each)."""

    def __init__(self, *, traces: list[Trace], by_arm: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.traces = traces
        self.by_arm = by_arm

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        if self.by_arm:
            return [
                Group.from_parent(self, name=name, traces=group, by_arm=False)
                for name, group in _grouped(self.traces, lambda t: arm(t.config))
            ]
        return [TraceItem.from_parent(self, name=t.name, trace=t) for t in self.traces]


class Invalid(pytest.Collector):
    def __init__(self, *, invalid: list[TraceError], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.invalid = invalid

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        return [
            InvalidTrace.from_parent(self, name=error.path.name, error=error)
            for error in self.invalid
        ]


class TraceFailed(Exception):
    """A trace's verdict failed the item; `lines` say why."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(lines[0] if lines else "")
        self.lines = lines


class _Item(pytest.Item):
    """An item whose failure is its own lines, not a traceback into kvgate."""

    def repr_failure(
        self,
        excinfo: pytest.ExceptionInfo[BaseException],
        style: Any = None,
    ) -> str:
        if isinstance(excinfo.value, TraceFailed):
            return "\n".join(excinfo.value.lines)
        return str(super().repr_failure(excinfo, style))


class TraceItem(_Item):
    def __init__(self, *, trace: Trace, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trace = trace
        self.path = trace.path
        # `-k` matches a trace's tags as it matches its name.
        self.extra_keyword_matches.update(trace.tags)

    def runtest(self) -> None:
        run = self.config.stash[_RUN]
        try:
            outcome = run.run(self.trace)
        except InputError as error:
            raise TraceFailed([str(error)]) from None
        self.config.stash[_OUTCOMES].append(outcome)
        cause = verdict(outcome)
        if cause is Verdict.CONFORMS:
            return
        if cause is Verdict.NOT_APPLICABLE:
            pytest.skip(trace_line(outcome))
        if cause is Verdict.LACKS and not fails_requirement(outcome, run.required):
            assert isinstance(outcome, ReplayResult)
            names = ", ".join(c.name for c in lacking(outcome))
            pytest.skip(f"the build lacks {names} (not required: --kvgate-require to fail)")
        lines = [trace_line(outcome)]
        if cause is Verdict.LACKS:
            lines += [_as_options(line) for line in capability_lines([outcome], run.required)]
        if isinstance(outcome, ReplayResult):
            lines += divergence_lines(outcome)
        raise TraceFailed(lines)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.trace.path, None, f"kvgate trace {self.trace.name}"


class InvalidTrace(_Item):
    """A trace that could not be read: it fails with its one-line error."""

    def __init__(self, *, error: TraceError, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error = error

    def runtest(self) -> None:
        raise TraceFailed([f"invalid trace: {self.error}"])

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.error.path, None, f"invalid kvgate trace {self.error.path.name}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    config = terminalreporter.config
    run = config.stash.get(_RUN, None)
    if run is None:
        return
    outcomes: list[Outcome] = config.stash[_OUTCOMES]
    lines = capability_lines(outcomes, run.required)
    if lines:
        terminalreporter.section("kvgate")
        for line in lines:
            if line:
                terminalreporter.write_line(_as_options(line))


def _as_options(line: str) -> str:
    """A gate's summary line with the options spelled as this plugin's."""
    return line.replace("--plugin ", "--kvgate-plugin ").replace("--require ", "--kvgate-require ")
