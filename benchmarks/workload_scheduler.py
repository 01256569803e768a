"""The workload on vLLM's real Scheduler against the manager-level replay: time, one process.

    python benchmarks/workload_scheduler.py [--scale K] [--units 64,...] [--sessions N]
                                            [--turns T] [--seed S] [--build fork|upstream]
                                            [--level api|strict]

For each arm (unit x hold), both ways of running vLLM against kvgate's
model, each timed on its own:

- manager level: the arm's trace (written first, untimed) replayed on vLLM's
  `KVCacheManager` with the model in lockstep (`kvgate workload --target vllm`);
- scheduler level: the same sessions through kvgate's scheduler model and
  vLLM's real `Scheduler` in lockstep (`--target vllm-scheduler`), which also
  writes the trace again.

Prints both times per arm and in all, and scheduler / manager as a ratio.
vLLM runs with kvgate's hold overlay; vLLM is imported and both targets are
built once before anything is timed.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import tempfile
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

from kvgate.conformance.replay import Level, replay
from kvgate.conformance.trace import load_trace
from kvgate.workload.command import add_workload_arguments, workload_of
from kvgate.workload.lockstep import run_on_scheduler
from kvgate.workload.plan import make_plan
from kvgate.workload.progress import Progress
from kvgate.workload.runner import Arm, about, trace_name, write_traces

OVERLAY = "kvgate.impl.hold_overlay"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, scale=16, units="64,4096")
    parser.add_argument("--level", default="api", choices=("api", "strict"))
    args = parser.parse_args(argv)
    level: Level = args.level

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from kvgate.impl.vllm_scheduler import VllmScheduler
    from kvgate.impl.vllm_target import VllmTarget
    from kvgate.model import ModelTarget

    workload, deployment = workload_of(args)
    units = sorted({int(u) // args.scale for u in args.units.split(",")})
    arms = [Arm(u, h) for u in units for h in (False, True)]
    sessions = make_plan(workload, args.scale)
    scheduler: Any = functools.partial(
        VllmScheduler,
        spec_tokens=deployment.spec_tokens,
        max_num_seqs=deployment.max_num_seqs,
        plugin=OVERLAY,
    )
    manager: Any = functools.partial(VllmTarget, plugin=OVERLAY)

    print(
        f"workload: {workload.sessions} sessions x {workload.turns} turns, seed {args.seed}, "
        f"units {','.join(map(str, units))}"
        + (f", tokens / {args.scale}" if args.scale > 1 else "")
        + f"; build {args.build}; level {level}; the model in lockstep both ways"
    )
    print(f"{'arm':>20}{'manager level':>15}{'scheduler level':>17}{'ratio':>8}")
    totals = [0.0, 0.0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        quiet = Progress(stream=io.StringIO())
        paths = write_traces(workload, deployment, arms, out, quiet)
        # Import vLLM and build each kind of target once, untimed.
        first = load_trace(paths[0]).config
        manager(first).close()
        scheduler(first).close()
        for arm, path in zip(arms, paths, strict=True):
            trace = load_trace(path)
            with closing(manager(trace.config)) as target:
                result = replay(trace, target, ModelTarget, level)
            manager_s = result.seconds
            if not result.passed:
                raise SystemExit(f"{arm.label}: manager level: {result.divergence}")
            real = scheduler(trace.config)
            try:
                arm_result = run_on_scheduler(
                    trace.config,
                    sessions,
                    deployment.serving(workload.system_prompt, workload.seed),
                    real=real,
                    name=trace_name(workload, deployment, arm) + ".scheduler",
                    out=out,
                    about=about(workload, deployment, arm),
                    level=level,
                )
            finally:
                real.close()
            # The lockstep loop alone, as the replay's time is the replay
            # alone (neither counts writing or reading a trace).
            scheduler_s = arm_result.replay.seconds
            if not arm_result.replay.passed:
                raise SystemExit(f"{arm.label}: scheduler level: {arm_result.replay.divergence}")
            totals[0] += manager_s
            totals[1] += scheduler_s
            print(
                f"{arm.label:>20}{manager_s:>14.1f}s{scheduler_s:>16.1f}s"
                f"{scheduler_s / manager_s:>7.2f}x"
            )
    print(f"{'all':>20}{totals[0]:>14.1f}s{totals[1]:>16.1f}s{totals[1] / totals[0]:>7.2f}x")
    print("ratio: real Scheduler lockstep time / manager-level replay time, same run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
