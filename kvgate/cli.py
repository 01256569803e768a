"""kvgate's command line: replay traces on a target, or gate a target on a corpus.

    kvgate replay TRACE... --target {model,vllm} [--level api|strict]
    kvgate gate [--target vllm|model] [--corpus DIR] [--level api|strict]
                [--junit-xml PATH] [--plugin MODULE|entry-points]
    (both) [--limit NAME=N ...]

Exit codes: 0 every trace conforms, 1 some trace diverged, 2 invalid input
(a trace, an unsupported config, an unknown or unavailable target, bad
arguments), told in one line on stderr and never with a traceback, 3 a bug
in kvgate itself (its model raised), told in one line naming the trace and
step. The highest applies.

Every trace is loaded and validated before anything is replayed; an invalid
one stops the run before anything runs. A trace refused while it runs (a
step its state cannot do, a config the target cannot run) or stopped by a
bug in the model gets an ERROR line instead of a verdict, and the rest
still run; the summary counts it and the JUnit file is written either way.
Against `--target vllm` the model runs in lockstep; against `--target model`
only the traces' own expectations apply. Targets are imported only when
chosen, so `--target model` never imports vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, cast

from kvgate.conformance.limits import DEFAULT_LIMITS, Limits
from kvgate.conformance.refusal import judge_refusal
from kvgate.conformance.replay import (
    LEVELS,
    Level,
    ModelBug,
    Outcome,
    TargetFactory,
    TraceRunError,
    one_line,
    replay,
)
from kvgate.conformance.report import TerminalReport, write_junit
from kvgate.conformance.target import Capabilities
from kvgate.conformance.trace import (
    Trace,
    TraceError,
    bundled_corpus,
    check_unique_names,
    load_corpus,
    load_trace,
)
from kvgate.errors import InputError, printable
from kvgate.targets import LOCKSTEP_MODEL, TARGETS, build_target, plugin_factory, target_factory

# Further commands, each a module with `register(subparsers)` that adds its
# parser and sets `handler(args) -> exit code` on it. A handler raises
# TraceError or InputError for bad input (exit 2, one line).
COMMAND_MODULES: tuple[str, ...] = (
    "kvgate.explore.command",
    "kvgate.workload.command",
    "kvgate.mutate.command",
    "kvgate.invariants.z3.command",
    "kvgate.bless_command",
)


class _Parser(argparse.ArgumentParser):
    # argparse prints usage and exits on a bad argument; we want one line.
    def error(self, message: str) -> NoReturn:
        raise InputError(message)


# Exit codes (see the module docstring).
EXIT_DIVERGED = 1
EXIT_INPUT = 2
EXIT_KVGATE_BUG = 3


def main(argv: Sequence[str] | None = None) -> int:
    args: argparse.Namespace | None = None
    try:
        args = _parser().parse_args(argv)
        handler = getattr(args, "handler", None)
        if handler is not None:
            return cast(int, handler(args))
        limits = _limits(args.limit)
        if args.command == "replay":
            traces = [load_trace(path, limits) for path in args.traces]
            check_unique_names(traces)
        else:
            traces = load_corpus(args.corpus or bundled_corpus(), limits)
        return run_traces(traces, args.target, args.level, args.plugin, args.junit_xml)
    except (TraceError, InputError) as error:
        print(f"kvgate: error: {printable(str(error))}", file=sys.stderr)
        junit_xml: Path | None = getattr(args, "junit_xml", None)
        if isinstance(error, TraceError) and junit_xml is not None:
            # Nothing ran; CI still gets a file that says why.
            try:
                _write_junit([], junit_xml, [(str(error.path), str(error))])
            except InputError as unwritable:
                print(f"kvgate: error: {printable(str(unwritable))}", file=sys.stderr)
        return EXIT_INPUT
    except ModelBug as bug:
        # From a command that replays outside `run_traces` (the workload).
        print(f"kvgate: internal error: {printable(str(bug))}", file=sys.stderr)
        return EXIT_KVGATE_BUG
    except Exception as error:
        # Whatever else escapes is kvgate's own bug, not the input's: one
        # line and exit 3; KVGATE_TRACEBACK=1 shows the traceback to debug it.
        if os.environ.get("KVGATE_TRACEBACK"):
            raise
        print(
            f"kvgate: internal error: {printable(one_line(error))}; this is a bug in kvgate: "
            "please report it with the command (KVGATE_TRACEBACK=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_KVGATE_BUG


def _limits(assignments: Sequence[str] | None) -> Limits:
    limits = DEFAULT_LIMITS
    for assignment in assignments or ():
        try:
            limits = limits.raised(assignment)
        except ValueError as error:
            raise InputError(f"--limit: {error}") from None
    return limits


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvgate", description="Conformance gate for vLLM's KV-cache manager.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    replay_cmd = commands.add_parser("replay", help="replay traces on a target")
    replay_cmd.add_argument("traces", nargs="+", type=Path, metavar="TRACE")
    replay_cmd.add_argument("--target", required=True, choices=sorted(TARGETS))

    gate_cmd = commands.add_parser("gate", help="replay a corpus; exit 0 only if all conform")
    gate_cmd.add_argument("--target", default="vllm", choices=sorted(TARGETS))
    gate_cmd.add_argument(
        "--corpus", type=Path, metavar="DIR", help="default: the corpus kvgate ships"
    )

    for command in (replay_cmd, gate_cmd):
        command.add_argument("--level", default="strict", choices=LEVELS)
        command.add_argument("--junit-xml", type=Path, metavar="PATH")
        command.add_argument(
            "--plugin",
            metavar="MODULE",
            help="a vLLM plugin module for --target vllm (e.g. kvgate.impl.hold_overlay), "
            "or 'entry-points' to run vLLM's own vllm.general_plugins loader",
        )
        command.add_argument(
            "--limit",
            action="append",
            metavar="NAME=N",
            help="raise one of a trace's limits (docs/trace-format.md, Limits): "
            + ", ".join(Limits.names()),
        )
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(commands)
    return parser


def run_traces(
    traces: Sequence[Trace],
    target_name: str,
    level: Level,
    plugin: str | None,
    junit_xml: Path | None,
) -> int:
    factory = plugin_factory(target_name, plugin)
    model = None if target_name == LOCKSTEP_MODEL else target_factory(LOCKSTEP_MODEL)

    report = TerminalReport(sys.stdout)
    if traces:
        report.target(_header_capabilities(factory, traces), target_name)
    for trace in traces:
        excluded: list[str] = []
        result = _run_one(trace, factory, model, level, target_name == LOCKSTEP_MODEL, excluded)
        report.exclusions(trace.name, excluded)
        if isinstance(result, TraceRunError):
            kind = "internal error" if result.bug else "error"
            print(f"kvgate: {kind}: {printable(result.message)}", file=sys.stderr)
        report.add(result)
    report.finish()

    if junit_xml is not None:
        _write_junit(report.results, junit_xml)
    errors = [r for r in report.results if isinstance(r, TraceRunError)]
    if any(e.bug for e in errors):
        return EXIT_KVGATE_BUG
    if errors:
        return EXIT_INPUT
    return 0 if all(r.passed for r in report.results) else EXIT_DIVERGED


def _run_one(
    trace: Trace,
    factory: TargetFactory,
    model: TargetFactory | None,
    level: Level,
    target_is_model: bool,
    excluded: list[str] | None = None,
) -> Outcome:
    """One trace's verdict, or the error that kept it from getting one;
    `excluded` gets the strict-view exclusions that hid the target's raw state."""
    started = time.perf_counter()
    if trace.expect_refused is not None:
        return judge_refusal(trace, factory, level)
    try:
        target = build_target(factory, trace)
        try:
            result = replay(trace, target, model, level, target_is_model=target_is_model)
            if excluded is not None:
                excluded.extend(getattr(target, "exclusions_applied", ()))
            return result
        finally:
            target.close()
    except TraceError as error:
        return TraceRunError(trace, str(error), bug=False, seconds=time.perf_counter() - started)
    except ModelBug as bug:
        return TraceRunError(trace, str(bug), bug=True, seconds=time.perf_counter() - started)


def _write_junit(
    results: Sequence[Outcome], path: Path, unloaded: Sequence[tuple[str, str]] = ()
) -> None:
    try:
        write_junit(results, path, unloaded=unloaded)
    except OSError as error:
        raise InputError(f"--junit-xml: cannot write {path}: {error.strerror}") from None


def _header_capabilities(factory: TargetFactory, traces: Sequence[Trace]) -> Capabilities | None:
    """The target as the report's header shows it: built for the first trace
    that switches the hold on, if any, so the header names the hold
    implementation the hold-on traces run (the switch is per trace). A trace
    whose config the target refuses is passed over (it gets its own ERROR
    line); None when the target runs none of them."""
    ordered = sorted(traces, key=lambda t: not t.config.hold)
    for trace in ordered:
        try:
            target = build_target(factory, trace)
        except TraceError:
            continue
        try:
            return target.capabilities
        finally:
            target.close()
    return None


if __name__ == "__main__":
    sys.exit(main())
