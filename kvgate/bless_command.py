"""`kvgate bless`: fill or refresh traces' expected values from the model.

    kvgate bless TRACE... [--target model|vllm] [--plugin MODULE] [--level api|strict]
                 [--check]

Every trace is read and validated first; an invalid one (or a refusal
trace, which has no values) stops the command before anything runs or is
written. Each trace's `expect` and `check` values (a scheduler-level
trace's engine entries' `expect`) are then taken from the model
(`conformance.bless`). A trace that asks for a capability (the hold, the
retained-state retention) that none of its blessed values shows is refused
in one line: a build without it would pass the trace. With `--target vllm`
the blessed trace is also replayed on vLLM in lockstep with the model (a
scheduler-level one on vLLM's Scheduler), and a trace where vLLM disagrees
is refused: nothing is written for it. Each file
is replaced whole (a temporary file renamed over it), never half-written.
With `--check` nothing is written: the command says which files would change.
With `-q`, traces already up to date go unmentioned.

Exit codes: 0 done (or, with `--check`, nothing would change); 1 vLLM
disagreed on some trace, or with `--check` some file would change; 2 invalid
input (one line naming file, step and field); 3 a bug in kvgate. The highest
applies.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvgate import options
from kvgate.conformance.bless import (
    Blessing,
    bless,
    bless_engine,
    check_blessable,
    check_shows_capabilities,
)
from kvgate.conformance.replay import LEVELS, Level, ModelBug, ReplayResult, TargetFactory, replay
from kvgate.conformance.report import show_pair
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import Trace, TraceError, check_unique_names, load_trace
from kvgate.errors import EXIT_DIVERGED, EXIT_INPUT, EXIT_KVGATE_BUG, InputError, printable
from kvgate.output import QUIET
from kvgate.targets import (
    LOCKSTEP_MODEL,
    build_target,
    plugin_factory,
    scheduler_factories,
    target_factory,
)


def register(subparsers: Any) -> None:
    cmd = subparsers.add_parser(
        "bless",
        help="fill or refresh traces' expect/check values from the model",
        description="Fill or refresh each trace's expect and check values from the model, "
        "editing only those values in the file (docs/bless.md).",
    )
    cmd.add_argument(
        "traces", nargs="+", type=Path, metavar="TRACE", help="trace files, edited in place"
    )
    options.add_target(
        cmd,
        ("model", "vllm"),
        "model",
        "vllm: also replay each blessed trace on vLLM in lockstep, and refuse "
        "a trace where vLLM disagrees with the model",
    )
    options.add_overlay(cmd)
    options.add_plugin(cmd)
    options.add_level(cmd, LEVELS, "strict")
    cmd.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if any file would change",
    )
    cmd.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    paths: list[Path] = args.traces
    traces = [load_trace(path) for path in paths]
    check_unique_names(traces)
    for trace in traces:
        check_blessable(trace)
    model = target_factory(LOCKSTEP_MODEL)
    plugin = options.plugin_of(args)
    chosen = plugin_factory(args.target, plugin)
    vllm = None if args.target == LOCKSTEP_MODEL else chosen
    engine = _Engine(args.target, plugin) if any(t.scheduler_level for t in traces) else None

    status = 0
    blessings: list[Blessing] = []
    for trace in traces:
        try:
            if trace.scheduler_level:
                assert engine is not None
                blessing = bless_engine(trace, _read(trace.path), engine.model)
                check_shows_capabilities(blessing.blessed, engine.meets)
            else:
                oracle = build_target(model, trace)
                try:
                    blessing = bless(trace, _read(trace.path), oracle)
                finally:
                    oracle.close()
                check_shows_capabilities(blessing.blessed, lambda t: _model_meets(t, model))
            if trace.scheduler_level and engine is not None and engine.real is not None:
                disagreement = engine.disagreement(blessing.blessed, args.level)
                if disagreement is not None:
                    _error(f"refused to bless {trace.path}: {disagreement}")
                    status = max(status, EXIT_DIVERGED)
                    continue
            elif not trace.scheduler_level and vllm is not None:
                disagreement = _disagreement(blessing.blessed, vllm, model, args.level)
                if disagreement is not None:
                    _error(f"refused to bless {trace.path}: {disagreement}")
                    status = max(status, EXIT_DIVERGED)
                    continue
        except TraceError as error:
            _error(str(error))
            status = max(status, EXIT_INPUT)
            continue
        except ModelBug as bug:
            print(f"kvgate: internal error: {printable(str(bug))}", file=sys.stderr)
            status = max(status, EXIT_KVGATE_BUG)
            continue
        blessings.append(blessing)

    for blessing in blessings:
        name = printable(str(blessing.trace.path))
        if not blessing.changes:
            if args.verbosity > QUIET:
                print(f"{name}: up to date ({blessing.kept} values)")
        elif args.check:
            print(f"{name}: would change: {blessing.account()}")
            status = max(status, EXIT_DIVERGED)
        else:
            _write(blessing.trace.path, blessing.text)
            print(f"blessed {name}: {blessing.account()}")
    return status


def _model_meets(trace: Trace, model: TargetFactory) -> bool:
    """Whether the model, replaying `trace`, meets every expectation of it."""
    try:
        target = build_target(model, trace)
    except TraceError:
        return False
    try:
        result = replay(trace, target, None, "strict", target_is_model=True)
    except (TraceError, ModelBug):
        return False
    finally:
        target.close()
    return result.divergence is None and result.stopped is None


class _Engine:
    """Scheduler-level traces: kvgate's scheduler model, and vLLM's real
    Scheduler with `--target vllm`."""

    def __init__(self, target: str, plugin: str | None) -> None:
        self.model, self.real = scheduler_factories(target, plugin)

    def meets(self, trace: Trace) -> bool:
        """Whether the scheduler model meets every expectation of `trace`."""
        try:
            result = replay_scheduler(trace, self.model, None, "strict")
        except (TraceError, ModelBug):
            return False
        return result.divergence is None

    def disagreement(self, blessed: Trace, level: Level) -> str | None:
        """Where vLLM's Scheduler, in lockstep with the model, fails `blessed`."""
        assert self.real is not None and blessed.scheduler is not None
        real = self.real(blessed.config, blessed.scheduler.spec, blessed.scheduler.max_num_seqs)
        try:
            result = replay_scheduler(blessed, self.model, real, level)
        finally:
            real.close()
        return _described(result)


def _disagreement(
    blessed: Trace, vllm: TargetFactory, model: TargetFactory, level: Level
) -> str | None:
    """Where vLLM, in lockstep with the model, fails the blessed trace."""
    target = build_target(vllm, blessed)
    try:
        result = replay(blessed, target, model, level)
    finally:
        target.close()
    return _described(result)


def _described(result: ReplayResult) -> str | None:
    """A lockstep replay's first divergence, as a refusal's reason."""
    d = result.divergence
    if d is None:
        return None
    # At level `expect` the trace's values are the model's (just blessed);
    # at `api` and `strict` the lockstep model's.
    model_says, vllm_says = show_pair(d.expected, d.actual)
    notes = "".join(f"; {note}" for note in (d.note, *result.notes) if note)
    return (
        f"vLLM disagrees with the model at {d.step.where()}: {d.what}: "
        f"the model {model_says}, vLLM {vllm_says}{notes}"
    )


def _read(path: Path) -> str:
    # The reader has read it already (within the limits); bytes, so the
    # file's own line endings are kept.
    return path.read_bytes().decode("utf-8")


def _write(path: Path, text: str) -> None:
    """Replace `path` by `text` whole: a temporary file beside it, renamed over it."""
    try:
        mode = path.stat().st_mode & 0o7777
        handle, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
        )
    except OSError as error:
        raise InputError(f"{path}: cannot write: {error.strerror}") from None
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(text.encode("utf-8"))
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise InputError(f"{path}: cannot write: {error.strerror}") from None
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _error(message: str) -> None:
    print(f"kvgate: error: {printable(message)}", file=sys.stderr)
