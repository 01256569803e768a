"""The recorder's overhead: vLLM's Scheduler steps recorded against unrecorded, one process.

    python benchmarks/recorder_overhead.py [--scale K] [--sessions N] [--turns T]
                                           [--seed S] [--rounds R]

The workload (upstream build, hold off, the smallest unit) is first served
once on vLLM's real `Scheduler` with the recorder on, untimed: that gives a
recording, a scheduler-level trace of the whole history. The recording is
then replayed R rounds on a fresh `Scheduler` each, alternately with the
recorder off and on (writing to a temporary directory), beside kvgate's
scheduler model at level api. Only the time spent inside the Scheduler's
calls is counted (adding requests, `schedule()`, the update, aborts,
resets): the model's share of the replay is left out, so the ratio is what
recording adds to the Scheduler's own work. Prints both times summed over
the rounds, the engine steps, and recorded / unrecorded as a ratio.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import load_trace
from kvgate.workload.deployment import Deployment
from kvgate.workload.plan import Workload
from kvgate.workload.progress import Progress
from kvgate.workload.runner import Arm

# The Scheduler's calls a replay makes through the target.
TIMED = ("add_request", "schedule", "update", "abort", "reset_prefix_cache")


class _Timed:
    """A scheduler target whose calls into vLLM are timed (the rest passes through)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name not in TIMED:
            return value
        return functools.partial(self._timed, value)

    def _timed(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=32, help="token counts divided by (32)")
    parser.add_argument("--sessions", type=int, default=8, help="(8)")
    parser.add_argument("--turns", type=int, default=5, help="(5)")
    parser.add_argument("--seed", type=int, default=0, help="(0)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds each way (3)")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
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

        def replay_once(recorded: bool, round_: int) -> float:
            if recorded:
                recorder.install(out / f"round-{round_}")
            try:
                assert trace.scheduler is not None
                real: Any = _Timed(
                    VllmScheduler(
                        trace.config,
                        spec_tokens=trace.scheduler.spec,
                        max_num_seqs=trace.scheduler.max_num_seqs,
                    )
                )
                result = replay_scheduler(trace, model, real, "api")
                real.close()
            finally:
                recorder.uninstall()
            if not result.passed:
                raise SystemExit(f"the recording diverged: {result.divergence}")
            return float(real.seconds)

        replay_once(False, -1)  # warm up, untimed
        totals = {False: 0.0, True: 0.0}
        for round_ in range(args.rounds):
            for recorded in (False, True):
                totals[recorded] += replay_once(recorded, round_)
    print(
        f"workload: {workload.sessions} sessions x {workload.turns} turns, seed {args.seed}, "
        f"tokens / {args.scale}; {steps} engine steps, {args.rounds} rounds each way"
    )
    print(f"Scheduler calls unrecorded: {totals[False]:.3f} s")
    print(f"Scheduler calls recorded:   {totals[True]:.3f} s")
    print(f"recorder overhead ratio: {totals[True] / totals[False]:.2f} (recorded / unrecorded)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
