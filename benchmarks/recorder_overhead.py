"""The recorder's overhead: its own time inside vLLM's Scheduler calls, one process.

    python benchmarks/recorder_overhead.py [--scale K] [--sessions N] [--turns T]
                                           [--seed S] [--rounds R] [--runs M]

The workload (upstream build, hold off, the smallest unit) is first served
once on vLLM's real `Scheduler` with the recorder on, untimed: that gives a
recording, a scheduler-level trace of the whole history. The recording is
then replayed R rounds with the recorder on and R with it off, interleaved,
each on a fresh `Scheduler`, beside kvgate's scheduler model at level api.

Each of the Scheduler's entry points the recorder wraps (adding requests,
`schedule()`, the update, aborts, resets, pauses) is timed twice in the
same call: around vLLM's own method (the Scheduler's work) and around the
whole call as the engine makes it (the recorder's wrapper around vLLM's
method). The difference is the recorder's time, measured in the same call
as the work it is compared with, so the machine's load moves both alike;
with the recorder off the difference is the timing's own cost (the floor).
Prints, over the rounds, the recorder's time per engine step and as a share
of the Scheduler's own time in its calls (min, median, max), and the floor.
A share of the Scheduler's time alone is an upper bound of what recording
adds to a served engine's step, which also runs the model.

With `--runs M` the whole measurement is made M times, each in a process of
its own (as M regenerations of the results page would make it): one line
per run, then how far apart the runs' medians are, against each run's own
spread between its rounds. The figure is stable when the medians differ by
less than a run's own spread.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import load_trace
from kvgate.impl.recorder import WRAPPED
from kvgate.workload.deployment import Deployment
from kvgate.workload.plan import Workload
from kvgate.workload.progress import Progress
from kvgate.workload.runner import Arm

# The Scheduler's entry points timed: those the recorder wraps that an
# engine step calls (its constructor and shutdown are left out).
TIMED = tuple(name for name in WRAPPED if name not in ("__init__", "shutdown"))


class _Clock:
    """Seconds spent in the outermost of the calls it times (a call the
    Scheduler makes from inside another is counted once, in the outer)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.depth = 0

    def timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return call(*args, **kwargs)
            self.depth += 1
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.depth -= 1

        return wrapper


@contextmanager
def _timed_layer(scheduler_class: Any, clock: _Clock) -> Iterator[None]:
    """Time the class's entry points as they are now; put them back after."""
    saved = {
        name: scheduler_class.__dict__[name] for name in TIMED if name in scheduler_class.__dict__
    }
    for name, method in saved.items():
        setattr(scheduler_class, name, clock.timed(method))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(scheduler_class, name, method)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=32, help="token counts divided by (32)")
    parser.add_argument("--sessions", type=int, default=8, help="(8)")
    parser.add_argument("--turns", type=int, default=5, help="(5)")
    parser.add_argument("--seed", type=int, default=0, help="(0)")
    parser.add_argument("--rounds", type=int, default=12, help="rounds each way (12)")
    parser.add_argument(
        "--runs", type=int, default=1, help="whole measurements, each in its own process (1)"
    )
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs > 1:
        return _runs(args)
    figures = measure(args)
    if args.json:
        print(json.dumps(figures))
        return 0
    print(_workload_line(args, figures["steps"]))
    print(
        f"Scheduler's own time in its calls, a round: {spread(figures['work_seconds'], 1e3, ' ms')}"
    )
    print(f"recorder time per engine step: {spread(figures['per_step'], 1, ' us')}")
    print(f"recorder time / Scheduler's own time: {spread(figures['recorded'], 100, ' %')}")
    print(f"timing floor (recorder off): {spread(figures['floor'], 100, ' %')}")
    return 0


def spread(values: list[float], scale: float, unit: str) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return ", ".join(
        f"{what} {value * scale:.1f}{unit}"
        for what, value in (("min", low), ("median", mid), ("max", high))
    )


def _workload_line(args: argparse.Namespace, steps: int) -> str:
    runs = f", in each of {args.runs} runs (a process each)" if args.runs > 1 else ""
    return (
        f"workload: {args.sessions} sessions x {args.turns} turns, seed {args.seed}, "
        f"tokens / {args.scale}; {steps} engine steps; {args.rounds} rounds with the recorder "
        f"on and off, interleaved{runs}"
    )


def _runs(args: argparse.Namespace) -> int:
    """The measurement made `args.runs` times, each in a fresh process."""
    settings = ("scale", "sessions", "turns", "seed", "rounds")
    own = [word for name in settings for word in (f"--{name}", str(getattr(args, name)))]
    runs = []
    for _ in range(args.runs):
        child = subprocess.run(
            [sys.executable, __file__, *own, "--json"], capture_output=True, text=True
        )
        if child.returncode:
            sys.stderr.write(child.stderr)
            return child.returncode
        runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(_workload_line(args, runs[0]["steps"]))
    for number, figures in enumerate(runs, start=1):
        print(
            f"run {number}: recorder time / Scheduler's own time: "
            f"{spread(figures['recorded'], 100, ' %')}; per engine step, median "
            f"{statistics.median(figures['per_step']):.1f} us; timing floor, median "
            f"{statistics.median(figures['floor']) * 100:.1f} %"
        )
    medians = [statistics.median(f["recorded"]) * 100 for f in runs]
    own_spreads = [(max(f["recorded"]) - min(f["recorded"])) * 100 for f in runs]
    print(
        f"across the {args.runs} runs: recorder time / Scheduler's own time, median of the "
        f"medians {statistics.median(medians):.1f} %; the medians {min(medians):.1f} % to "
        f"{max(medians):.1f} % ({max(medians) - min(medians):.1f} points apart), each run's "
        f"own spread (max - min of its rounds) {min(own_spreads):.1f} to "
        f"{max(own_spreads):.1f} points"
    )
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One whole measurement: the recording made, then replayed `args.rounds`
    times each way; each round's figures."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvgate import targets
    from kvgate.impl import recorder
    from kvgate.impl.vllm_scheduler import VllmScheduler
    from kvgate.workload.lockstep import scheduler_arm

    workload = Workload(sessions=args.sessions, turns=args.turns, seed=args.seed)
    deployment = Deployment(build="upstream").scaled(args.scale)
    unit = 64 // args.scale or 1
    model, _ = targets.scheduler_factories("model", None)
    factory: Any = targets.target_factory("vllm-scheduler")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        recorder.install(out / "first")
        try:
            scheduler_arm(
                workload,
                deployment,
                Arm(unit, False),
                factory,
                out / "workload",
                "api",
                Progress(stream=io.StringIO()),
            )
        finally:
            recorder.uninstall()
        [path] = sorted((out / "first").iterdir())
        trace = load_trace(path)
        assert trace.scheduler is not None
        steps = sum(e.op == "step" for e in trace.engine)

        def replay_once(recorded: bool, round_: int) -> tuple[float, float]:
            """(the Scheduler's own seconds, the seconds around them) in its calls."""
            work, whole = _Clock(), _Clock()
            with _timed_layer(Scheduler, work):
                if recorded:
                    recorder.install(out / f"round-{round_}")
                try:
                    with _timed_layer(Scheduler, whole):
                        assert trace.scheduler is not None
                        real = VllmScheduler(
                            trace.config,
                            spec_tokens=trace.scheduler.spec,
                            max_num_seqs=trace.scheduler.max_num_seqs,
                        )
                        result = replay_scheduler(trace, model, real, "api")
                        real.close()
                finally:
                    recorder.uninstall()
            if not result.passed:
                raise SystemExit(f"the recording diverged: {result.divergence}")
            if recorded and not any((out / f"round-{round_}").glob("*.yaml")):
                raise SystemExit("the recorder wrote nothing")
            return work.seconds, whole.seconds

        replay_once(True, -1)  # warm up, untimed
        shares: dict[bool, list[float]] = {False: [], True: []}
        per_step: list[float] = []
        work_seconds: list[float] = []
        for round_ in range(args.rounds):
            for recorded in (True, False):
                work, whole = replay_once(recorded, round_)
                shares[recorded].append((whole - work) / work)
                if recorded:
                    per_step.append((whole - work) / steps * 1e6)
                    work_seconds.append(work)

    return {
        "steps": steps,
        "work_seconds": work_seconds,
        "per_step": per_step,
        "recorded": shares[True],
        "floor": shares[False],
    }


if __name__ == "__main__":
    raise SystemExit(main())
