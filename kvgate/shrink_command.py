"""`kvgate shrink`: make a diverging trace small enough to read.

    kvgate shrink TRACE [--target vllm|model] [--keep first-divergence] [-o OUT]
                  [--plugin MODULE] [--level api|strict] [--partial]

The trace, of either kind (manager-level or scheduler-level; written by
hand, generated, explored or recorded), is replayed on the target the way
the gate replays it, but without its own `expect` and `check` values, so
that it fails only where the target and the model differ. That first
divergence (its kind of step, level and field) is what the shrunk trace
must keep; `conformance.shrink` then removes requests, steps, tokens and
pool blocks while it does. Every candidate runs in this process (vLLM is
imported once). A trace written one entry a line (as kvgate writes them:
manager steps, or the engine entries of a generated Scheduler-level
history) is not held whole: its first divergence is found by a streamed
replay, as `kvgate replay --stream` reads it, and only the entries up to
it are read into memory and shrunk; the account still counts the whole
history's steps. On `--target model` there is no lockstep: the trace's own
expectations are what the model fails, so candidates keep them. A
recording cut short is refused, as by `kvgate replay`, unless `--partial`
asks to shrink the entries recorded before the cut.

The result is written with the project's writer (default: beside TRACE,
`NAME.shrunk.yaml`), readable by `kvgate replay`, and one line says what
was done: `from 514 steps to 9, diverges on vllm at step 8 (allocate):
free queue (strict)`.

Exit codes: 0 shrunk and written; 2 bad input (an invalid trace, an
unwritable output, or a trace that does not diverge on the target: there
is nothing to shrink), one line each; 3 a bug in kvgate (the model raised
on the trace itself).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from kvgate import options
from kvgate.conformance.replay import (
    LEVELS,
    Divergence,
    Level,
    Outcome,
    ReplayResult,
    TraceRunError,
)
from kvgate.conformance.shrink import Shrinker, streamed_without_expectations
from kvgate.conformance.stream import stream_trace
from kvgate.conformance.trace import Trace
from kvgate.errors import EXIT_KVGATE_BUG, EXIT_OK, InputError, printable
from kvgate.output import VERBOSE, VllmLogs
from kvgate.targets import (
    LOCKSTEP_MODEL,
    gate_factories,
    run_scheduler_trace,
    run_trace,
    scheduler_factories,
)

KEEP = ("first-divergence",)


def register(subparsers: Any) -> None:
    cmd = subparsers.add_parser(
        "shrink",
        help="reduce a diverging trace to a small one that diverges at the same field",
        description="Reduce a trace that diverges on the target to a small one that still "
        "diverges there at the same kind of step and field: requests, then steps, then token "
        "counts and the pool size (docs/how-to/shrink-a-divergence.md).",
    )
    cmd.add_argument("trace", type=Path, metavar="TRACE", help="the diverging trace, either kind")
    options.add_target(
        cmd,
        ("vllm", "model"),
        "vllm",
        "vllm: the installed vLLM in lockstep with the model (the trace's expectations set "
        "aside); model: the model against the trace's own expectations",
    )
    cmd.add_argument(
        "--keep",
        choices=KEEP,
        default=KEEP[0],
        help="what the shrunk trace keeps: its first divergence's kind of step, level and field",
    )
    cmd.add_argument(
        "-o",
        "--out",
        type=Path,
        metavar="OUT",
        help="where to write the shrunk trace (default: NAME.shrunk.yaml beside TRACE)",
    )
    options.add_overlay(cmd)
    options.add_plugin(cmd)
    options.add_level(cmd, LEVELS, "strict")
    options.add_partial(cmd)
    # Its --out names the file to write, not a directory.
    cmd.set_defaults(handler=run, out_is_file=True)


def run(args: argparse.Namespace) -> int:
    path: Path = args.trace
    trace = stream_trace(path, partial=args.partial)
    if trace.expect_refused is not None:
        raise InputError(f"{path}: a refusal trace has no steps to shrink")
    out: Path = args.out or path.with_name(f"{path.stem}.shrunk.yaml")
    if out.resolve() == path.resolve():
        raise InputError(f"{out}: the output would replace the trace being shrunk")
    logs: VllmLogs | None = getattr(args, "vllm_logs", None)
    outcome = _outcome(args.target, options.plugin_of(args), args.level)
    keep_expectations = args.target == LOCKSTEP_MODEL
    history = None
    if trace.stream is not None:
        # The first divergence found streaming; only the entries up to it
        # read. A divergence's step is numbered by the written entry (an
        # engine step of a run of `steps: N` by the run's line), so the
        # prefix ends with the line it was seen in.
        history = trace.stream.length
        first = outcome(trace if keep_expectations else streamed_without_expectations(trace))
        divergence = _divergence(path, first, args.target)
        if divergence is None:
            return EXIT_KVGATE_BUG
        trace = trace.stream.prefix(divergence.step.index + 1)

    def judge(candidate: Trace) -> ReplayResult | None:
        # vLLM's log lines while candidates run are one unit of work, never shown.
        with logs.unit("shrink candidates") if logs is not None else nullcontext():
            result = outcome(candidate)
        return result if isinstance(result, ReplayResult) else None

    progress = None if args.verbosity < VERBOSE else _progress
    shrinker = Shrinker(trace, judge, keep_expectations, progress, history)
    trace = shrinker.original  # its head: the shrinker holds the steps it still needs
    reference: Outcome | None = shrinker.reference()
    if reference is None:
        reference = outcome(shrinker.reference_trace())  # no verdict: why
    if _divergence(path, reference, args.target) is None:
        return EXIT_KVGATE_BUG
    shrunk = shrinker.shrink()
    name = f"{trace.name}.shrunk"
    about = (
        f"Shrunk by kvgate shrink from {trace.name} ({shrunk.steps_before} steps) to "
        f"{shrunk.steps_after}; it diverges on {args.target} as the original does."
    )
    text = shrunk.renamed(shrinker, name, about)
    try:
        out.write_text(text)
    except OSError as error:
        raise InputError(f"{out}: cannot write: {error.strerror}") from None
    print(f"{printable(str(out))}: {shrunk.account(args.target)}")
    return EXIT_OK


def _outcome(target: str, plugin: str | None, level: Level) -> Callable[[Trace], Outcome]:
    """A trace's outcome on `target`, as the gate runs it."""
    factory, model = gate_factories(target, plugin)
    scheduler_model, real = scheduler_factories(target, plugin)

    def outcome(trace: Trace) -> Outcome:
        if trace.scheduler_level:
            return run_scheduler_trace(trace, scheduler_model, real, level)
        return run_trace(trace, factory, model, level, target_is_model=target == LOCKSTEP_MODEL)

    return outcome


def _divergence(path: Path, result: Outcome, target: str) -> Divergence | None:
    """The trace's first divergence, the one the shrunk trace must keep.
    A trace that does not diverge, or that got no verdict (why, in one
    line), is the input's error; None when the model raised (kvgate's bug,
    printed)."""
    if isinstance(result, TraceRunError):
        if result.bug:
            print(f"kvgate: internal error: {printable(result.message)}", file=sys.stderr)
            return None
        raise InputError(result.message)
    if result.divergence is None:
        aside = "" if target == LOCKSTEP_MODEL else " (its own expectations set aside)"
        raise InputError(f"{path}: does not diverge on --target {target}{aside}: nothing to shrink")
    return result.divergence


def _progress(line: str) -> None:
    print(printable(line), flush=True)
