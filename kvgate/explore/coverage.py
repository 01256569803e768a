"""Line and branch coverage of vLLM's KV-cache manager files, as a table.

    python -m kvgate.explore.coverage [--missing DIR] NAME=DATAFILE [NAME=DATAFILE ...]

Each column is one coverage.py data file (recorded with --branch); rows are
block_pool.py, kv_cache_manager.py, kv_cache_coordinator.py, the
MambaManager class of single_type_kv_cache_manager.py, and the Scheduler's
KV paths in sched/scheduler.py (`kv_paths`: every method of the `Scheduler`
class that touches the KV-cache manager or a request's computed or cached
tokens, but those a hybrid align-mode deployment never runs,
`OUT_OF_SCOPE`). A file's figures are coverage.py's own analysis; a class's
or the KV paths' are counted inside their line ranges (from the source's
syntax tree): statements and branch exits the parser finds there, against the
lines and arcs the data file recorded.
`--missing DIR` also writes, per column, the statements and branch exits
it did not reach (DIR/missing-<column>.txt), per source and per KV path,
and the table per KV path (DIR/kv-paths-by-method.txt): where the gaps are.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import coverage

FILES = ("block_pool.py", "kv_cache_manager.py", "kv_cache_coordinator.py")
CLASS_FILE = "single_type_kv_cache_manager.py"
CLASS_NAME = "MambaManager"
SCHEDULER_FILE = "sched/scheduler.py"
SCHEDULER_CLASS = "Scheduler"
# What makes a Scheduler method a KV path: it reads or writes one of these
# attributes (the KV-cache manager it owns; a request's computed tokens,
# cached tokens or prefill stats, what the manager's answers become).
KV_PATH_ATTRIBUTES = frozenset(
    {"kv_cache_manager", "num_computed_tokens", "num_cached_tokens", "prefill_stats"}
)
# KV paths a hybrid align-mode deployment never runs, left out of every
# column alike, each with why.
OUT_OF_SCOPE = {
    "_drain_deferred_loads": "loads are deferred only for HiSparse's host pool",
    "_update_requests_with_invalid_blocks": (
        "called only past _handle_invalid_blocks' refusal of several KV-cache groups"
    ),
}
# Inside the KV paths, the branches a hybrid align-mode deployment never
# takes: the body of an `if` whose condition names one of these is left out
# of every column alike (its statements, and the exit into it), each with why.
SLIDING_WINDOW_REPLAY = "a sliding-window coordinator's bounded replay"
OUT_OF_SCOPE_CONDITIONS = {
    "prefix_replay_tokens": SLIDING_WINDOW_REPLAY,
    "_load_restores_replay_window": SLIDING_WINDOW_REPLAY,
    "num_replay_tokens": SLIDING_WINDOW_REPLAY,
    "is_encoder_decoder": "an encoder-decoder model's cross-attention",
    "SupportsHMA": "a KV connector without hybrid-model support (one KV-cache group only)",
    "defer_async_loads": "HiSparse's host pool (its deferred loads)",
    "defer_load": "HiSparse's host pool (its deferred loads)",
}
# The same, for a condition that holds only where one of these is off.
OUT_OF_SCOPE_WHEN_OFF = {
    "needs_kv_cache_zeroing": "a model without Mamba layers (new blocks need no zeroing)",
}


@dataclass(frozen=True)
class Figures:
    lines: int
    lines_hit: int
    branches: int
    branches_hit: int
    # What was not reached: statement lines, and branch exits (src, dst).
    missing_lines: tuple[int, ...] = ()
    missing_branches: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def pct(hit: int, total: int) -> str:
        return f"{100.0 * hit / total:5.1f}%" if total else "    -"

    def cell(self) -> str:
        return (
            f"{self.pct(self.lines_hit, self.lines)} ({self.lines_hit}/{self.lines}) "
            f"{self.pct(self.branches_hit, self.branches)} ({self.branches_hit}/{self.branches})"
        )


def core_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vLLM is not installed")
    return Path(spec.origin).parent / "v1" / "core"


def class_range(path: Path, name: str) -> tuple[int, int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            assert node.end_lineno is not None
            return node.lineno, node.end_lineno
    raise SystemExit(f"no class {name} in {path}")


def kv_paths(
    path: Path, out_of_scope: Collection[str] = tuple(OUT_OF_SCOPE)
) -> list[tuple[str, int, int]]:
    """The Scheduler's KV paths in `path`: (method, first line, last line) of
    each method of the `Scheduler` class whose body names an attribute of
    `KV_PATH_ATTRIBUTES`, in source order, but those named in `out_of_scope`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == SCHEDULER_CLASS:
            paths = []
            for method in node.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if method.name in out_of_scope:
                    continue
                if any(
                    isinstance(n, ast.Attribute) and n.attr in KV_PATH_ATTRIBUTES
                    for n in ast.walk(method)
                ):
                    assert method.end_lineno is not None
                    paths.append((method.name, method.lineno, method.end_lineno))
            return paths
    raise SystemExit(f"no class {SCHEDULER_CLASS} in {path}")


Spans = tuple[tuple[int, int], ...]


def out_of_scope_branches(path: Path, methods: Sequence[tuple[str, int, int]]) -> Spans:
    """The bodies of the `if` statements inside `methods` (name, first and
    last line) whose condition names one of `OUT_OF_SCOPE_CONDITIONS`, as
    line spans."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    spans = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        if not any(first <= node.lineno <= last for _, first, last in methods):
            continue
        if _requires_out_of_scope(node.test):
            last = node.body[-1].end_lineno
            assert last is not None
            spans.append((node.body[0].lineno, last))
    return tuple(sorted(spans))


def _requires_out_of_scope(test: ast.expr) -> bool:
    """Whether condition `test` holds only where a feature of
    `OUT_OF_SCOPE_CONDITIONS` is on: it names one (alone, compared, called,
    or `not isinstance(..., It)`), or an `and` with such a term, or an `or`
    of such terms only."""
    if isinstance(test, ast.BoolOp):
        each = [_requires_out_of_scope(value) for value in test.values]
        return any(each) if isinstance(test.op, ast.And) else all(each)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        call = test.operand
        if isinstance(call, (ast.Name, ast.Attribute)):
            return _names_out_of_scope(call, OUT_OF_SCOPE_WHEN_OFF)
        return (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "isinstance"
            and _names_out_of_scope(call.args[-1])
        )
    if isinstance(test, ast.Call):
        return _names_out_of_scope(test.func)
    return isinstance(test, (ast.Name, ast.Attribute, ast.Compare)) and _names_out_of_scope(test)


def _names_out_of_scope(node: ast.expr, features: Mapping[str, str] | None = None) -> bool:
    for n in ast.walk(node):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
        if name in (OUT_OF_SCOPE_CONDITIONS if features is None else features):
            return True
    return False


def figures(
    data_file: Path,
    path: Path,
    within: tuple[int, int] | Spans | None = None,
    excluded: Spans = (),
) -> Figures:
    """Lines and branch exits of `path` (optionally only those starting in
    `within`, one line range or several, and none in `excluded`, whose
    statements and the exits into them are not counted), and how many of
    them the data file recorded.

    The counts are coverage.py's own analysis, so a whole file's figures
    equal `coverage report`'s. Its analysis maps what the tracer recorded
    onto statements first: Python 3.11 reports a multi-line condition on a
    continuation line, and the raw data file would leave its statement, and
    both of its exits, unreached in every column."""
    cov = coverage.Coverage(data_file=str(data_file), branch=True)
    cov.load()
    analysis = cov._analyze(str(path))
    if within is None:
        spans: Spans = ((1, 10**9),)
    elif isinstance(within[0], int):
        spans = (within,)
    else:
        spans = within

    def left_out(line: int) -> bool:
        return any(first <= line <= last for first, last in excluded)

    def inside(line: int) -> bool:
        return any(first <= line <= last for first, last in spans) and not left_out(line)

    statements = {n for n in analysis.statements if inside(n)}
    executed = statements & set(analysis.executed)
    # {branch line: (exits, exits taken)}, less the exits into what is left
    # out; and the exits not taken.
    not_taken = analysis.missing_branch_arcs()
    taken = analysis.executed_branch_arcs()
    stats = {}
    for src, (exits, hit) in analysis.branch_stats().items():
        if inside(src):
            gone_taken = sum(1 for dst in taken.get(src, ()) if left_out(dst))
            gone = gone_taken + sum(1 for dst in not_taken.get(src, ()) if left_out(dst))
            stats[src] = (exits - gone, hit - gone_taken)
    missing = tuple(
        sorted(
            (src, dst)
            for src, dsts in not_taken.items()
            if inside(src)
            for dst in dsts
            if not left_out(dst)
        )
    )
    return Figures(
        lines=len(statements),
        lines_hit=len(executed),
        branches=sum(total for total, _ in stats.values()),
        branches_hit=sum(taken for _, taken in stats.values()),
        missing_lines=tuple(sorted(statements - executed)),
        missing_branches=missing,
    )


def measure(columns: Sequence[tuple[str, Path]]) -> list[tuple[str, list[Figures]]]:
    """One row per source, one `Figures` per column."""
    core = core_dir()
    rows: list[tuple[str, list[Figures]]] = []
    for name in FILES:
        rows.append((name, [figures(data, core / name) for _, data in columns]))
    span = class_range(core / CLASS_FILE, CLASS_NAME)
    rows.append(
        (
            f"{CLASS_NAME} (lines {span[0]}-{span[1]})",
            [figures(data, core / CLASS_FILE, span) for _, data in columns],
        )
    )
    methods = kv_paths(core / SCHEDULER_FILE)
    spans = tuple((first, last) for _, first, last in methods)
    excluded = out_of_scope_branches(core / SCHEDULER_FILE, methods)
    rows.append(
        (
            f"Scheduler KV paths ({len(methods)} methods)",
            [figures(data, core / SCHEDULER_FILE, spans, excluded) for _, data in columns],
        )
    )
    return rows


def table(columns: Sequence[tuple[str, Path]], rows: list[tuple[str, list[Figures]]]) -> str:
    width = max(len(r[0]) for r in rows) + 2
    cell = 40
    out = [
        "line % (hit/total) and branch % (hit/total) per source",
        " " * width + "".join(f"{title:<{cell}}" for title, _ in columns),
    ]
    for name, cells in rows:
        out.append(f"{name:<{width}}" + "".join(f"{c.cell():<{cell}}" for c in cells))
    return "\n".join(out)


def method_rows(columns: Sequence[tuple[str, Path]]) -> list[tuple[str, list[Figures]]]:
    """One row per Scheduler KV path (its method and lines), one `Figures`
    per column: where each column's reach into the Scheduler ends."""
    source = core_dir() / SCHEDULER_FILE
    methods = kv_paths(source)
    excluded = out_of_scope_branches(source, methods)
    return [
        (
            f"Scheduler.{name} (lines {first}-{last})",
            [figures(data, source, (first, last), excluded) for _, data in columns],
        )
        for name, first, last in methods
    ]


def missing_report(name: str, rows: Sequence[tuple[str, list[Figures]]], column: int) -> str:
    """A column's unreached statements and branch exits, per source (a
    source row whose column reached everything is left out)."""
    out: list[str] = []
    for row, cells in rows:
        fig = cells[column]
        if not fig.missing_lines and not fig.missing_branches:
            continue
        out.append(f"{row}: lines {_ranges(fig.missing_lines)}")
        exits = ", ".join(f"{s}->{d if d > 0 else 'exit'}" for s, d in fig.missing_branches)
        out.append(f"{row}: branches {exits or '-'}")
    return f"# {name}\n" + "\n".join(out) + "\n"


def _ranges(lines: Sequence[int]) -> str:
    """`3-5, 9`: consecutive line numbers folded."""
    spans: list[list[int]] = []
    for n in lines:
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "-"


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    missing_dir: Path | None = None
    if args[:1] == ["--missing"] and len(args) >= 2:
        missing_dir = Path(args[1])
        args = args[2:]
    columns = []
    for arg in args:
        title, sep, data = arg.partition("=")
        if not sep or not Path(data).is_file():
            print(f"usage: NAME=DATAFILE ...; bad or missing: {arg}", file=sys.stderr)
            return 2
        columns.append((title, Path(data)))
    if not columns:
        print("usage: python -m kvgate.explore.coverage NAME=DATAFILE ...", file=sys.stderr)
        return 2
    rows = measure(columns)
    print(table(columns, rows))
    source = core_dir() / SCHEDULER_FILE
    paths = kv_paths(source)
    names = ", ".join(name for name, _, _ in paths)
    left_out = "; ".join(f"{name}: {why}" for name, why in OUT_OF_SCOPE.items())
    print(f"Scheduler KV paths: {names} (left out, {left_out})")
    branches = ", ".join(
        str(a) if a == b else f"{a}-{b}" for a, b in out_of_scope_branches(source, paths)
    )
    reasons = "; ".join(
        dict.fromkeys([*OUT_OF_SCOPE_CONDITIONS.values(), *OUT_OF_SCOPE_WHEN_OFF.values()])
    )
    print(f"Inside them, left out alike: lines {branches}, what only these run: {reasons}")
    if missing_dir is not None:
        missing_dir.mkdir(parents=True, exist_ok=True)
        methods = method_rows(columns)
        (missing_dir / "kv-paths-by-method.txt").write_text(
            table(columns, methods) + "\n", encoding="utf-8"
        )
        for i, (title, _) in enumerate(columns):
            slug = "".join(c if c.isalnum() else "-" for c in title.lower()).strip("-")
            (missing_dir / f"missing-{slug}.txt").write_text(
                missing_report(title, [*rows, *methods], i), encoding="utf-8"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
