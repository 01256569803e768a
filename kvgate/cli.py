"""kvgate's command line: replay traces on a target, or gate a target on a corpus.

    kvgate replay TRACE... --target {model,vllm} [--level api|strict]
    kvgate gate [--target vllm|model] [--corpus DIR] [--level api|strict]
                [--junit-xml PATH] [--plugin MODULE|entry-points]

Exit codes: 0 every trace conforms, 1 some trace diverged, 2 invalid input
(a trace, an unsupported config, an unknown or unavailable target, bad
arguments), told in one line on stderr and never with a traceback.

Every trace is loaded and validated before anything is replayed. Against
`--target vllm` the model runs in lockstep; against `--target model` only the
traces' own expectations apply. Targets are imported only when chosen, so
`--target model` never imports vLLM.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, cast

from kvgate.conformance.replay import LEVELS, Level, TargetFactory, replay
from kvgate.conformance.report import TerminalReport, write_junit
from kvgate.conformance.target import Capabilities, Target
from kvgate.conformance.trace import Trace, TraceError, bundled_corpus, load_corpus, load_trace
from kvgate.errors import InputError
from kvgate.targets import LOCKSTEP_MODEL, TARGETS, build_target, target_factory

# Further commands, each a module with `register(subparsers)` that adds its
# parser and sets `handler(args) -> exit code` on it. A handler raises
# TraceError or InputError for bad input (exit 2, one line).
COMMAND_MODULES: tuple[str, ...] = (
    "kvgate.explore.command",
    "kvgate.workload.command",
    "kvgate.mutate.command",
    "kvgate.invariants.z3.command",
)


class _Parser(argparse.ArgumentParser):
    # argparse prints usage and exits on a bad argument; we want one line.
    def error(self, message: str) -> NoReturn:
        raise InputError(message)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        handler = getattr(args, "handler", None)
        if handler is not None:
            return cast(int, handler(args))
        if args.command == "replay":
            traces = [load_trace(path) for path in args.traces]
        else:
            traces = load_corpus(args.corpus or bundled_corpus())
        return run_traces(traces, args.target, args.level, args.plugin, args.junit_xml)
    except (TraceError, InputError) as error:
        print(f"kvgate: error: {error}", file=sys.stderr)
        return 2


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
    if plugin is not None and target_name != "vllm":
        raise InputError("--plugin: only --target vllm loads plugins")
    factory = target_factory(target_name)
    if plugin is not None:
        # VllmTarget(config, plugin=...): the one target that loads plugins.
        factory = functools.partial(cast(Callable[..., Target], factory), plugin=plugin)
    model = None if target_name == LOCKSTEP_MODEL else target_factory(LOCKSTEP_MODEL)

    report = TerminalReport(sys.stdout)
    if traces:
        report.target(_header_capabilities(factory, traces))
    for trace in traces:
        target = build_target(factory, trace)
        try:
            result = replay(trace, target, model, level)
        finally:
            target.close()
        report.add(result)
    report.finish()

    if junit_xml is not None:
        try:
            write_junit(report.results, junit_xml)
        except OSError as error:
            raise InputError(f"--junit-xml: cannot write {junit_xml}: {error.strerror}") from None
    return 0 if all(r.passed for r in report.results) else 1


def _header_capabilities(factory: TargetFactory, traces: Sequence[Trace]) -> Capabilities:
    """The target as the report's header shows it: built for the first trace
    that switches the hold on, if any, so the header names the hold
    implementation the hold-on traces run (the switch is per trace)."""
    trace = next((t for t in traces if t.config.hold), traces[0])
    target = build_target(factory, trace)
    try:
        return target.capabilities
    finally:
        target.close()


if __name__ == "__main__":
    sys.exit(main())
