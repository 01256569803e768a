"""`kvgate prove`: the manager's invariants, proved by induction with Z3.

    kvgate prove [--blocks N] [--requests R] [--groups G] [--mutation NAME]
                 [--jobs J] [--out DIR] [--depth K] [--search-timeout SECONDS]
                 [--unbounded] [--cores]

Prints one row per property (invariants, then the lemmas they need) and per
`init` or op as soon as it is decided: proved, or not inductive. Then, for
each property that failed, a counterexample search (bounded model checking
from `init`, written as a version-1 trace under `--out`) that says how long
it has run while it runs, and a row per failed cell with the trace's path
or why there is none ("timed out: no counterexample within N s" when the
search hit `--search-timeout`); each row ends with the seconds it took.
`--mutation` checks a deliberately broken transition relation instead
(see `kvgate.model.mutations`); its target invariant's counterexample is
written even when the induction failure is in a lemma.

`--unbounded` proves the same invariants for every pool size and number of
requests (`unbounded_properties.py`: quantified formulas over uninterpreted
sorts; `--blocks` and `--requests` then only say where bounded model
checking looks for a counterexample trace). `--cores` prints each proved
cell's unsat core: the lemmas and transition clauses its proof used.

Exit codes: 0 every cell proved, 1 some cell failed, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TextIO

from kvgate import options
from kvgate.errors import InputError
from kvgate.invariants.z3.checker import INIT, Result, prove
from kvgate.invariants.z3.counterexample import Found, find
from kvgate.invariants.z3.properties import PROPERTIES, PROPERTY_BY_NAME
from kvgate.invariants.z3.transitions import ENCODED_OPS, MUTATIONS
from kvgate.invariants.z3.unbounded_proof import UResult, prove_unbounded
from kvgate.invariants.z3.unbounded_properties import UPROPERTIES
from kvgate.invariants.z3.vocabulary import Bounds
from kvgate.model.mutations import MUTATIONS as MODEL_MUTATIONS

DEFAULT_OUT = Path("out/prove")  # beside out/workload; git ignores out/
DEFAULT_DEPTH = 10
# One counterexample search's time limit: on a 2-core machine the searches
# the mutations need take from under a second to about half a minute.
DEFAULT_SEARCH_TIMEOUT = 60.0
# While a search runs, a line saying so at most this often (seconds).
SEARCH_PROGRESS_EVERY = 10.0
# The flags' upper bounds: the encoding grows with blocks x requests x
# groups, and past these a proof takes hours or exhausts memory (16 blocks:
# 13 s; 100,000 blocks: Z3 out of memory) rather than saying anything new.
MAX_FLAGS = {"blocks": 32, "requests": 8, "groups": 6, "depth": 64, "jobs": 64}
MAX_SECONDS = 86_400.0  # a day


def register(subparsers: Any) -> None:
    defaults = Bounds()
    parser = subparsers.add_parser(
        "prove",
        help="prove the manager's invariants with Z3 (bounded, or --unbounded for every size)",
    )
    parser.add_argument(
        "--blocks", type=int, default=defaults.blocks, help="pool size, null included"
    )
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument(
        "--groups", type=int, default=defaults.groups, help="KV-cache groups: attention + Mamba"
    )
    parser.add_argument(
        "--mutation",
        type=options.name_argument(MUTATIONS, "--mutation"),
        metavar="NAME",
        help="check a broken transition relation: "
        + ", ".join(options.kebab(name) for name in MUTATIONS)
        + " (default: none, the manager as it is)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    options.add_out(parser, DEFAULT_OUT, "where counterexample traces are written")
    parser.add_argument(
        "--depth", type=int, default=DEFAULT_DEPTH, help="counterexample search depth"
    )
    parser.add_argument(
        "--search-timeout",
        type=float,
        default=DEFAULT_SEARCH_TIMEOUT,
        metavar="SECONDS",
        help="time limit of each counterexample search",
    )
    parser.add_argument(
        "--unbounded",
        action="store_true",
        help="prove for every pool size and request count (quantified encoding)",
    )
    parser.add_argument(
        "--cores", action="store_true", help="print what each proof used (its unsat core)"
    )
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    for flag, most in MAX_FLAGS.items():
        if getattr(args, flag) > most:
            raise InputError(f"--{flag}: {getattr(args, flag)} is more than {most}")
    bounds = Bounds(args.blocks, args.requests, args.groups)  # BadBounds: one line, exit 2
    if args.jobs < 1 or args.depth < 1:
        raise InputError("--jobs and --depth must be at least 1")
    if not 0 < args.search_timeout <= MAX_SECONDS:
        raise InputError(f"--search-timeout: must be above 0 and at most {MAX_SECONDS:g} seconds")
    if args.mutation is not None and args.mutation not in MUTATIONS:
        names = ", ".join(options.kebab(name) for name in MUTATIONS)
        raise InputError(f"--mutation: no mutation {args.mutation!r} (mutations: {names})")
    mutation = args.mutation or "clean"
    return run(
        bounds,
        mutation,
        args.jobs,
        args.out,
        args.depth,
        sys.stdout,
        args.cores,
        args.unbounded,
        args.search_timeout,
        quiet=options.quiet(args),
    )


def run(
    bounds: Bounds,
    mutation: str,
    jobs: int,
    out: Path,
    depth: int,
    stream: TextIO,
    cores: bool = False,
    unbounded: bool = False,
    search_timeout: float = DEFAULT_SEARCH_TIMEOUT,
    quiet: bool = False,
) -> int:
    """The table, bounded or (`unbounded`) for every pool size: prove every
    cell, printing each op's rows as they are decided; then search a trace
    for each failed property the bounded search knows and for a mutation's
    target, each search limited to `search_timeout` seconds, and print a
    row per failed cell with what its search found; then the count. Exit 0
    only when every cell is proved.

    With `unbounded`, a failed cell's counterexample to induction is a
    finite model of some size; the trace comes from bounded model checking
    of the same mutation and property from `init` (at `bounds`, reduced
    first), as in the bounded mode.

    `quiet` (`-q`): only the cells not proved (under the table's header)
    and the count."""
    started = time.perf_counter()
    if unbounded:
        title = "kvgate prove --unbounded: every pool size, every request count, "
        title += f"{bounds.groups} groups"
    else:
        title = f"kvgate prove: {bounds}"
    title += "" if mutation == "clean" else f", mutation {options.kebab(mutation)}"
    if not quiet:
        print(title, file=stream, flush=True)
    table = _Table(stream, header=not quiet)

    def decided(cells: Sequence[Result | UResult]) -> None:
        for row in cells:
            if row.proved and quiet:
                continue
            if row.proved:
                cell = "proved"
            elif row.prop in PROPERTY_BY_NAME:
                cell = "not inductive: counterexample search follows"
            else:
                cell = _cell(row, {})
            table.row(_name(row), row.op, cell, f"{row.seconds:.2f}")

    rows: Sequence[Result | UResult] = (
        prove_unbounded(bounds.groups, mutation, jobs=jobs, decided=decided)
        if unbounded
        else prove(bounds, mutation, jobs=jobs, decided=decided)
    )
    target = MODEL_MUTATIONS[mutation].target if mutation != "clean" else ""
    searchable = [r.prop for r in rows if not r.proved and r.prop in PROPERTY_BY_NAME]
    searches = list(dict.fromkeys([*searchable, *([target] if target else [])]))
    found: dict[str, Found] = {}
    for number, prop in enumerate(searches, 1):
        if not quiet:
            print(
                f"searching for a counterexample to {prop} ({number} of {len(searches)}, "
                f"at most {search_timeout:g}s)",
                file=stream,
                flush=True,
            )
        search_started = time.perf_counter()
        progress = io.StringIO() if quiet else stream
        found[prop] = _search(bounds, mutation, prop, out, depth, search_timeout, progress)
        seconds = f"{time.perf_counter() - search_started:.2f}"
        for row in rows:
            if row.prop == prop and not row.proved:
                table.row(_name(row), row.op, _cell(row, found), seconds)
    if cores:
        _print_cores([(r.prop, r.op, r.used) for r in rows if r.proved], stream)
    failed = [r for r in rows if not r.proved]
    if target and all(r.proved for r in rows if r.prop == target):
        # The target broke only through a lemma: show its own counterexample.
        example = found[target]
        print(f"counterexample to {target}: {example.file or example.note}", file=stream)
    proved = len(rows) - len(failed)
    print(
        f"{proved} of {len(rows)} proved{' for every size' if unbounded else ''} in "
        f"{time.perf_counter() - started:.1f}s "
        f"({jobs} job{'s' if jobs > 1 else ''})",
        file=stream,
    )
    return 0 if not failed else 1


def _name(row: Result | UResult) -> str:
    return row.prop if row.kind == "invariant" else f"{row.prop} (lemma)"


def _cell(row: Result | UResult, found: dict[str, Found]) -> str:
    return _unbounded_result(row, found) if isinstance(row, UResult) else _result(row, found)


def _unbounded_result(row: UResult, found: dict[str, Found]) -> str:
    if row.proved:
        return "proved"
    if row.unknown:
        return f"unknown ({row.unknown})"
    sizes = row.sizes or (0, 0, 0)
    where = f"a model of {sizes[0]} blocks, {sizes[1]} requests, {sizes[2]} copies"
    example = found.get(row.prop)
    if example is not None and example.file is not None:
        return f"{example.file} (induction: {where})"
    why = example.note.split("; ")[0] if example else "no bounded twin to search"
    return f"not inductive ({where}); no trace: {_shorten(why, 60)}"


def _print_cores(cells: list[tuple[str, str, tuple[str, ...]]], stream: TextIO) -> None:
    print("unsat cores (what each proof used):", file=stream)
    for prop, op, used in cells:
        print(f"  {prop} {op}: {', '.join(used)}", file=stream)


def _search(
    bounds: Bounds,
    mutation: str,
    prop: str,
    out: Path,
    depth: int,
    timeout: float,
    stream: TextIO,
) -> Found:
    """`find` in a fresh process: Z3's search follows the order its terms were
    created in, and one run after the proofs' terms can take minutes. A line
    every `SEARCH_PROGRESS_EVERY` seconds says it still runs; past `timeout`
    the process is stopped and the search has timed out."""
    spawn = multiprocessing.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    process = spawn.Process(
        target=_find_in_child, args=(bounds, mutation, prop, out, depth, send), daemon=True
    )
    process.start()
    send.close()  # the child's end: EOF here once the child is gone
    started = time.perf_counter()
    try:
        while True:
            left = timeout - (time.perf_counter() - started)
            if left <= 0:
                return Found(prop, None, f"timed out: no counterexample within {timeout:g}s")
            if receive.poll(min(SEARCH_PROGRESS_EVERY, left)):
                try:
                    kind, payload = receive.recv()
                except EOFError:
                    process.join()
                    return Found(prop, None, f"the search stopped (exit {process.exitcode})")
                if kind == "unwritable":
                    raise InputError(f"--out: cannot write {out}: {payload}")
                assert isinstance(payload, Found)
                return payload
            elapsed = time.perf_counter() - started
            if elapsed < timeout:
                print(
                    f"  still searching ({elapsed:.0f}s of {timeout:g}s)", file=stream, flush=True
                )
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        receive.close()


def _find_in_child(
    bounds: Bounds, mutation: str, prop: str, out: Path, depth: int, conn: Connection
) -> None:
    try:
        conn.send(("found", find(bounds, mutation, prop, out, depth)))
    except OSError as error:
        conn.send(("unwritable", error.strerror))
    conn.close()


def _result(row: Result, found: dict[str, Found]) -> str:
    if row.proved:
        return "proved"
    example = found.get(row.prop)
    where = ", ".join(row.violated[:2])
    if example is not None and example.file is not None:
        return f"{example.file} ({where})"
    if example is not None and example.note.startswith("timed out"):
        return f"{example.note} (not inductive: {where})"
    # The search's full story is long (every path tried); the first reason will do.
    why = example.note.split("; ")[0] if example else "no search"
    return f"not inductive ({where}); no trace: {_shorten(why, 70)}"


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


class _Table:
    """The proof table, a row at a time: the columns are as wide as the
    longest name and op there can be, so rows printed apart still line up."""

    def __init__(self, stream: TextIO, header: bool = True) -> None:
        """The header now (`header`), or before the first row printed."""
        self.stream = stream
        props = {p.name for p in PROPERTIES} | {p.name for p in UPROPERTIES}
        names = [*props, *(f"{name} (lemma)" for name in props)]
        self.widths = (max(map(len, names)), max(len(op) for op in (INIT, *ENCODED_OPS)), 9)
        self.headed = False
        if header:
            self.row("invariant", "op", "result", "seconds")

    def row(self, name: str, op: str, result: str, seconds: str) -> None:
        if not self.headed:
            self.headed = True
            if name != "invariant":
                self.row("invariant", "op", "result", "seconds")
        cells = [
            text.ljust(width) for text, width in zip((name, op, result), self.widths, strict=True)
        ]
        print(
            f"{cells[0]}  {cells[1]}  {cells[2]}  {seconds.rjust(7)}", file=self.stream, flush=True
        )
