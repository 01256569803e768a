"""kvgate's command line: replay traces on a target, or gate a target on a corpus.

    kvgate replay TRACE... [--target vllm|model] [--level strict|api]
    kvgate gate [--target vllm|model] [--corpus DIR ...] [--no-bundled] [--level strict|api]
    (both) [--junit-xml PATH] [--overlay | --plugin MODULE|entry-points]
           [--require hold|retention|none ...] [--limit NAME=N ...] [-q | -v | -vv]
           [--jobs N | --ray ADDRESS]

The options every command shares (target, overlay, level, hold, seed,
profile, budget, output directory, verbosity) are spelled once, in
`kvgate/options.py`.

Each trace gets a verdict by cause (`conformance.verdict`): conforms,
diverges, lacks a capability (the build lacks what the trace's config asks
for; it fails the gate only when `--require` names it), not applicable (the
target refuses the config), or an error. The exit codes are
`errors.EXIT_CODES`; `--help` shows them.

Every trace is loaded and validated before anything is replayed; an invalid
one stops the run before anything runs. A trace refused while it runs (a
step its state cannot do) or stopped by a bug in the model gets an ERROR
line instead of a verdict, and the rest still run; the summary counts it and
the JUnit file is written either way. Against `--target vllm` the model runs
in lockstep; against `--target model` only the traces' own expectations
apply. Targets are imported only when chosen, so `--target model` never
imports vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import kvgate
from kvgate import options
from kvgate.conformance.corpora import CorpusCount, read_corpora, read_held
from kvgate.conformance.limits import DEFAULT_LIMITS, Limits
from kvgate.conformance.replay import (
    LEVELS,
    WHOLE_VIEW_EVERY,
    Level,
    Outcome,
    TargetFactory,
    TraceRunError,
    one_line,
)
from kvgate.conformance.report import TerminalReport, write_junit
from kvgate.conformance.selection import (
    ARMS,
    FAMILIES,
    Selection,
    SelectionError,
    describe,
)
from kvgate.conformance.stream import read_streamed
from kvgate.conformance.trace import (
    Trace,
    TraceError,
)
from kvgate.conformance.verdict import (
    CAPABILITY_NAMES,
    DEFAULT_REQUIRED,
    REQUIRE_NONE,
    Verdict,
    fails_requirement,
    resolve_required,
    verdict,
)
from kvgate.errors import (
    EXIT_CODES,
    EXIT_DIVERGED,
    EXIT_INPUT,
    EXIT_KVGATE_BUG,
    EXIT_LACKS_REQUIRED,
    EXIT_OK,
    EXIT_PRECEDENCE,
    InputError,
    KvgateError,
    exit_code_table,
    printable,
)
from kvgate.output import QUIET, VllmLogs, vllm_logs
from kvgate.replay_jobs import GateSettings, run_all
from kvgate.targets import (
    TARGETS,
    build_target,
    gate_factories,
)
from kvgate.vocabulary.target import Capabilities

if TYPE_CHECKING:
    from kvgate.known_defects import Policy

# Further commands, by name, each a module with `register(subparsers)` that
# adds its parser and sets `handler(args) -> exit code` on it. A handler
# raises TraceError or InputError for bad input (exit 2, one line). Only the
# module of the command run is imported: `kvgate gate` needs PyYAML alone.
COMMAND_MODULES: dict[str, str] = {
    "explore": "kvgate.explore.command",
    "workload": "kvgate.workload.command",
    "mutate": "kvgate.mutate.command",
    "prove": "kvgate.invariants.z3.command",
    "bless": "kvgate.bless_command",
    "shrink": "kvgate.shrink_command",
    "deployment": "kvgate.deployment_command",
    "hold-check": "kvgate.hold_check_command",
}

# A package a command needs beyond the gate's, and the extra that installs it
# (pyproject.toml's optional dependencies).
OPTIONAL_PACKAGES: dict[str, str] = {"hypothesis": "explore", "z3": "prove"}


TARGET_HELP = "model: kvgate's model alone; vllm: the installed vLLM, the model in lockstep"


class _VersionAction(argparse._VersionAction):
    """`--version`: argparse's, with the line built only when asked for
    (reading the installed vLLM's metadata would cost every command's
    start-up)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        self.version = (
            f"kvgate {kvgate.__version__} "
            f"(checked on vLLM {', '.join(kvgate.CHECKED_VLLM)}; installed: {_installed_vllm()})"
        )
        super().__call__(parser, namespace, values, option_string)


class _Parser(argparse.ArgumentParser):
    # argparse prints usage and exits on a bad argument; we want one line.
    def error(self, message: str) -> NoReturn:
        raise InputError(message)


def main(argv: Sequence[str] | None = None) -> int:
    args: argparse.Namespace | None = None
    try:
        args = _parser(_command_of(argv)).parse_args(argv)
        options.check_output_paths(args)
        with vllm_logs(args.verbosity) as logs:
            args.vllm_logs = logs
            handler = getattr(args, "handler", None)
            if handler is not None:
                # Lines no smaller unit claims count as the command's own.
                with logs.unit(f"kvgate {args.command}"):
                    code = cast(int, handler(args))
                logs.print_summary()
                return code
            if args.ray is not None and args.jobs > 1:
                raise InputError("--ray: the traces run on the cluster's workers; leave out --jobs")
            limits = _limits(args.limit)
            deployment_lines: list[str] = []
            explored_failure = False
            measured_costs: dict[str, str] = {}
            counts: Callable[[Sequence[Trace]], list[CorpusCount]] | None = None
            if args.command == "replay" and args.stream:
                traces, invalid = read_streamed(args.traces, limits)
            elif args.command == "replay":
                traces, invalid = read_held(args.traces, limits, args.partial)
            else:
                if args.deployment is not None:
                    # Only here: resolving a serve command line needs vLLM.
                    from kvgate.deployment_gate import prepare

                    deployment = prepare(args)
                    args.corpus = [*(args.corpus or ()), deployment.folder]
                    deployment_lines = deployment.lines
                    explored_failure = deployment.explored_failure
                    measured_costs = deployment.costs
                if args.no_bundled and not args.corpus:
                    raise InputError("--no-bundled: name at least one --corpus DIR to run")
                corpora = read_corpora(args.corpus or (), not args.no_bundled, limits, args.partial)
                traces, invalid = _select(corpora.traces, args), corpora.invalid
                counts = corpora.counts
                if args.list:
                    return list_traces(traces, invalid)
                if not traces and not invalid:
                    raise InputError("no trace selected (-k, --arm, --family): nothing to gate")
            return run_traces(
                traces,
                args.target,
                args.level,
                options.plugin_of(args),
                args.junit_xml,
                _required(args.require),
                explain_lacking=args.command == "replay",
                invalid=invalid,
                logs=logs,
                corpora=counts,
                defects=_defects_policy(args),
                notes=deployment_lines,
                failed_elsewhere=explored_failure,
                measured_costs=measured_costs,
                whole_view_every=args.whole_view_every,
                jobs=args.jobs,
                ray=args.ray,
            )
    except _NothingValid as nothing:
        for error in nothing.invalid:
            print(f"kvgate: error: {printable(str(error))}", file=sys.stderr)
        junit_path: Path | None = getattr(args, "junit_xml", None)
        if junit_path is not None:
            # Nothing ran; CI still gets a file that says why.
            try:
                _write_junit([], junit_path, [(str(e.path), str(e)) for e in nothing.invalid])
            except InputError as unwritable:
                print(f"kvgate: error: {printable(str(unwritable))}", file=sys.stderr)
        return EXIT_INPUT
    except KvgateError as error:
        kind = "internal error" if error.exit_code == EXIT_KVGATE_BUG else "error"
        print(f"kvgate: {kind}: {printable(str(error))}", file=sys.stderr)
        junit_xml: Path | None = getattr(args, "junit_xml", None)
        if isinstance(error, TraceError) and junit_xml is not None:
            # Nothing ran; CI still gets a file that says why.
            try:
                _write_junit([], junit_xml, [(str(error.path), str(error))])
            except InputError as unwritable:
                print(f"kvgate: error: {printable(str(unwritable))}", file=sys.stderr)
        return error.exit_code
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


def _at_least_one(text: str) -> int:
    """A count of steps, 1 or more (argparse turns the error into its one line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _limits(assignments: Sequence[str] | None) -> Limits:
    limits = DEFAULT_LIMITS
    for assignment in assignments or ():
        try:
            limits = limits.raised(assignment)
        except ValueError as error:
            raise InputError(f"--limit: {error}") from None
    return limits


def _select(traces: Sequence[Trace], args: argparse.Namespace) -> list[Trace]:
    selection = Selection(args.keyword or "", tuple(args.arm or ()), tuple(args.family or ()))
    try:
        return selection.select(traces)
    except SelectionError as error:
        raise InputError(f"-k: {error}") from None


def list_traces(traces: Sequence[Trace], invalid: Sequence[TraceError]) -> int:
    """`--list`: the selected traces, one a line, and each invalid one's error."""
    for trace in traces:
        print(printable(describe(trace)))
    for error in invalid:
        print(f"kvgate: error: {printable(str(error))}", file=sys.stderr)
    errors = f", {len(invalid)} invalid" if invalid else ""
    print(f"{len(traces)} traces selected{errors}")
    return EXIT_INPUT if invalid else EXIT_OK


def _required(values: Sequence[str] | None) -> tuple[str, ...]:
    try:
        return resolve_required(values)
    except ValueError as error:
        raise InputError(f"--require: {error}") from None


def _defects_policy(args: argparse.Namespace) -> Policy:
    """The known defects' policy of a command that has `--known-defects`
    (the gate); any other command probes nothing, and leaves the module
    unimported."""
    if not hasattr(args, "known_defects"):
        return "skip"
    from kvgate import known_defects

    return known_defects.policy_of(args)


def _installed_vllm() -> str:
    """The installed vLLM's version, from its metadata (vLLM is not imported;
    the metadata reader only when the version is asked for)."""
    import importlib.metadata

    try:
        return f"vLLM {importlib.metadata.version('vllm')}"
    except importlib.metadata.PackageNotFoundError:
        return "no vLLM"


def _command_of(argv: Sequence[str] | None) -> str | None:
    """The command `argv` names, when it is one kvgate has (None: build them
    all, for `--help` or to say a command is unknown)."""
    words = [word for word in (sys.argv[1:] if argv is None else argv) if not word.startswith("-")]
    if words and (words[0] in COMMAND_MODULES or words[0] in ("replay", "gate")):
        return words[0]
    return None


def _register(commands: Any, name: str, run: bool) -> None:
    """Command `name`'s parser, from its module. A command whose optional
    package is not installed refuses in one line when it is run (`run`), and
    is listed as unavailable otherwise (`kvgate --help`)."""
    try:
        module = importlib.import_module(COMMAND_MODULES[name])
    except ModuleNotFoundError as error:
        package = (error.name or "").split(".")[0]
        if package not in OPTIONAL_PACKAGES:
            raise
        extra = OPTIONAL_PACKAGES[package]
        need = f"{package}, which is not installed here: pip install 'kvgate[{extra}]'"
        if run:
            raise InputError(f"kvgate {name} needs {need}") from None
        commands.add_parser(name, help=f"(unavailable: needs {need})")
        return
    module.register(commands)


def _parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser (`only`: the built-in ones and that one)."""
    parser = _Parser(
        prog="kvgate",
        description="Conformance gate for vLLM's KV-cache manager.",
        epilog=exit_code_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    replay_cmd = commands.add_parser(
        "replay",
        help="replay traces on a target",
        epilog=exit_code_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay_cmd.add_argument("traces", nargs="+", type=Path, metavar="TRACE")
    replay_cmd.add_argument(
        "--stream",
        action="store_true",
        help="read each trace written one entry a line (manager-level steps or scheduler-level "
        "engine entries) entry by entry: validated whole first, then read again as it "
        "replays, holding only what a later entry needs (for histories too long to hold; "
        "other traces, recordings among them, are read whole)",
    )
    options.add_target(replay_cmd, sorted(TARGETS), "vllm", TARGET_HELP)

    gate_cmd = commands.add_parser(
        "gate",
        help="replay a corpus; exit 0 only if the build is deployable",
        epilog=exit_code_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    options.add_target(gate_cmd, sorted(TARGETS), "vllm", TARGET_HELP)
    gate_cmd.add_argument(
        "--corpus",
        type=Path,
        action="append",
        metavar="DIR",
        help="also run the traces in DIR and its subfolders (repeatable; default: only the "
        "corpus kvgate ships)",
    )
    gate_cmd.add_argument(
        "--no-bundled",
        action="store_true",
        help="leave out the corpus kvgate ships: run only the --corpus folders",
    )
    gate_cmd.add_argument(
        "-k",
        dest="keyword",
        metavar="EXPR",
        help="only the traces EXPR matches, as pytest's -k: words (a substring of a trace's "
        "name, a tag, its family or arm) joined by and, or, not, parentheses "
        "(default: every trace)",
    )
    gate_cmd.add_argument(
        "--arm",
        action="append",
        choices=ARMS,
        help="only the traces of this arm, from their config's hold switches (repeatable; "
        "default: every arm)",
    )
    gate_cmd.add_argument(
        "--family",
        action="append",
        choices=FAMILIES,
        help="only the traces of this deployment family, from their config's Mamba "
        "checkpoint and a recording's device (repeatable; default: every trace, of a "
        "family or not)",
    )
    gate_cmd.add_argument(
        "--list",
        "--collect-only",
        dest="list",
        action="store_true",
        help="print the selected traces (and every invalid one) and exit without running them",
    )
    if only != "replay":
        # Only the gate probes the known defects: a replay's parser leaves
        # their module unimported.
        from kvgate import known_defects

        gate_cmd.add_argument(
            "--known-defects",
            choices=known_defects.POLICIES,
            help=known_defects.POLICY_HELP,
        )
    gate_cmd.add_argument(
        "--deployment-traces",
        type=Path,
        metavar="DIR",
        help="with --deployment: write the traces generated at the deployment there, and keep "
        "them (default: a temporary folder, removed at exit)",
    )
    options.add_serving_machine(gate_cmd)
    options.add_seed(
        gate_cmd, 0, "with --deployment: the exploration at the deployment's config draws from N"
    )
    gate_cmd.add_argument(
        "--deployment",
        nargs=argparse.REMAINDER,
        metavar="SERVE-ARGS",
        help="gate the deployment this vllm serve command line resolves to (the rest of the "
        "command line: MODEL-DIR [FLAG...], a leading 'vllm serve' dropped): the scenario "
        "families generated at its config run beside the corpus "
        "(docs/how-to/gate-your-deployment.md)",
    )

    for command in (replay_cmd, gate_cmd):
        options.add_level(command, LEVELS, "strict")
        command.add_argument(
            "--junit-xml", type=Path, metavar="PATH", help="also write a JUnit XML report there"
        )
        options.add_overlay(command)
        options.add_plugin(command)
        command.add_argument(
            "--require",
            action="append",
            metavar="CAPABILITY",
            help="a capability the build must have, or the gate exits "
            f"{EXIT_LACKS_REQUIRED}: {', '.join(CAPABILITY_NAMES)}, or {REQUIRE_NONE} to gate "
            "the build's own semantics (repeat or comma-separate; default: "
            f"{','.join(DEFAULT_REQUIRED)}, the hold the multi-turn agent load needs)",
        )
        command.add_argument(
            "--limit",
            action="append",
            metavar="NAME=N",
            help="raise one of a trace's limits (docs/trace-format.md, Limits): "
            + ", ".join(Limits.names()),
        )
        options.add_partial(command)
        command.add_argument(
            "--jobs",
            type=_at_least_one,
            default=1,
            metavar="N",
            help="replay N traces at once, each in a worker process (a recording is one "
            "trace, its parts replayed in order); the verdicts and the report are those of "
            "one at a time, in the same order",
        )
        command.add_argument(
            "--ray",
            metavar="ADDRESS",
            help="replay the traces as tasks on the Ray cluster at ADDRESS instead (local:N "
            "starts one of N CPUs here; every node needs kvgate, vLLM and the traces' files), "
            "reported as --jobs reports them (pip install 'kvgate[ray]')",
        )
        command.add_argument(
            "--whole-view-every",
            type=_at_least_one,
            default=WHOLE_VIEW_EVERY,
            metavar="N",
            help="at level strict, compare the whole manager state every N steps and after the "
            "last; each step in between compares the blocks and requests it changed, and a "
            "difference found by the whole comparison names the steps since the last one "
            "(1: the whole state after every step); a scheduler-level trace counts its "
            "engine entries",
        )
    for name in COMMAND_MODULES:
        if only is None or name == only:
            _register(commands, name, run=name == only)
    for command in commands.choices.values():
        options.add_verbosity(command)
        options.finish(command)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser (the docs' command reference reads them)."""
    return _parser()


def run_traces(
    traces: Sequence[Trace],
    target_name: str,
    level: Level,
    plugin: str | None,
    junit_xml: Path | None,
    required: Sequence[str] = DEFAULT_REQUIRED,
    explain_lacking: bool = False,
    invalid: Sequence[TraceError] = (),
    logs: VllmLogs | None = None,
    corpora: Callable[[Sequence[Trace]], list[CorpusCount]] | None = None,
    defects: Policy = "skip",
    notes: Sequence[str] = (),
    failed_elsewhere: bool = False,
    measured_costs: Mapping[str, str] | None = None,
    whole_view_every: int = WHOLE_VIEW_EVERY,
    jobs: int = 1,
    ray: str | None = None,
) -> int:
    """Run `traces` and report each one's verdict, with every `invalid`
    trace's error listed and counted; the exit code (`errors.EXIT_CODES`).
    `corpora` counts the traces of each corpus a gate read, for the header.
    `_NothingValid` when there is nothing to run: only errors to tell.
    `defects`: the known vLLM defects' policy (probed while the traces run);
    `notes`: lines shown before the verdict (the deployment gated);
    `failed_elsewhere`: a check besides the traces failed (the exploration
    at a deployment, which its note names): the gate fails as on a divergence;
    `measured_costs`: what lacking each capability costs at that deployment;
    `jobs`: how many traces run at once, each in a worker process
    (`replay_jobs.py`), reported in the same order as one at a time; `ray`:
    the traces run as tasks on that Ray cluster instead."""
    if not traces and invalid:
        raise _NothingValid(invalid)
    logs = logs or VllmLogs()
    factory, _ = gate_factories(target_name, plugin)
    probe = None
    if traces and defects != "skip":
        from kvgate import known_defects

        probe = known_defects.start(defects, target_name)

    report = TerminalReport(
        sys.stdout,
        required,
        explain_lacking,
        quiet=logs.verbosity <= QUIET,
        measured_costs=measured_costs,
    )
    if traces:
        report.target(_header_capabilities(factory, traces), target_name)
        scheduler_level = sum(trace.scheduler_level for trace in traces)
        if corpora is not None:
            report.corpora([count.line() for count in corpora(traces)])
        elif scheduler_level:
            report.corpora([CorpusCount("", len(traces) - scheduler_level, scheduler_level).line()])
    for error in invalid:
        print(f"kvgate: error: {printable(str(error))}", file=sys.stderr)
        report.add_invalid(error)
    settings = GateSettings(target_name, plugin, level, whole_view_every, logs.verbosity)
    for trace, run in zip(traces, run_all(traces, settings, jobs, ray), strict=True):
        result = run.outcome
        logs.merge(run.counted)
        report.exclusions(trace.name, list(run.excluded))
        if isinstance(result, TraceRunError) and not result.config_refused:
            kind = "internal error" if result.bug else "error"
            print(f"kvgate: {kind}: {printable(result.message)}", file=sys.stderr)
        report.add(result)
        if verdict(result) in (Verdict.DIVERGES, Verdict.ERROR, Verdict.BUG):
            # Only a failure's: a trace the build lacks a capability for
            # conforms as far as it goes.
            logs.show(run.logs, f"trace {trace.name}")
    code = exit_code(report.results, required, len(invalid))
    if report.results and all(verdict(r) is Verdict.NOT_APPLICABLE for r in report.results):
        # Nothing was checked: each refusal is the input's error.
        for result in report.results:
            assert isinstance(result, TraceRunError)
            print(f"kvgate: error: {printable(result.message)}", file=sys.stderr)
    logged = logs.summary() if logs.verbosity > QUIET else None
    notes = [*notes, logged] if logged else list(notes)
    if probe is not None:
        from kvgate import known_defects

        probes = probe.finish()
        notes = [*known_defects.lines(probes, defects), *notes]
        if known_defects.fails(probes, defects):
            code = next(c for c in EXIT_PRECEDENCE if c in (code, EXIT_DIVERGED))
    if failed_elsewhere:
        code = next(c for c in EXIT_PRECEDENCE if c in (code, EXIT_DIVERGED))
    report.finish(f"verdict: exit {code}: {dict(EXIT_CODES)[code]}", notes)

    if junit_xml is not None:
        unloaded = [(str(error.path), str(error)) for error in invalid]
        _write_junit(report.results, junit_xml, unloaded, required)
    return code


class _NothingValid(Exception):
    """Every trace given is invalid: no report, only their errors (exit 2)."""

    def __init__(self, invalid: Sequence[TraceError]) -> None:
        super().__init__(f"{len(invalid)} invalid traces")
        self.invalid = invalid


def exit_code(results: Sequence[Outcome], required: Sequence[str], invalid: int = 0) -> int:
    """The exit code of a run with these outcomes and `invalid` traces that
    could not be read (`errors.EXIT_CODES`)."""
    causes = {verdict(r) for r in results}
    applies = {
        EXIT_KVGATE_BUG: Verdict.BUG in causes,
        # A run in which no trace applies to the target checked nothing.
        EXIT_INPUT: bool(invalid) or Verdict.ERROR in causes or causes == {Verdict.NOT_APPLICABLE},
        EXIT_DIVERGED: Verdict.DIVERGES in causes,
        EXIT_LACKS_REQUIRED: any(fails_requirement(r, required) for r in results),
        EXIT_OK: True,
    }
    return next(code for code in EXIT_PRECEDENCE if applies[code])


def _write_junit(
    results: Sequence[Outcome],
    path: Path,
    unloaded: Sequence[tuple[str, str]] = (),
    required: Sequence[str] = DEFAULT_REQUIRED,
) -> None:
    try:
        write_junit(results, path, unloaded=unloaded, required=required)
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
