"""The whole workload on the model and on vLLM: time and peak memory, one process.

    python benchmarks/workload.py [--scale K] [--units 64,...] [--sessions N]
                                  [--turns T] [--seed S] [--out DIR]

Generates the workload's traces (the model as oracle), reads them back, then
replays every arm on each target alone (no lockstep model, so each number is
that target's own cost): one pass timed, one pass under tracemalloc for the
peak of Python allocations (tracemalloc slows a run, so the timed pass runs
without it). vLLM is imported and a manager built before anything is timed.
vLLM runs with kvgate's hold overlay, which gives it the hold and the
production fork's retention of retired states (`--build fork`, the default);
`--build upstream` runs vLLM 0.33.0's own behaviour in the hold-off arm.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path

from kvgate.conformance.replay import replay
from kvgate.conformance.trace import Trace, load_trace
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.target import Target
from kvgate.workload.command import add_workload_arguments, workload_of
from kvgate.workload.progress import Progress
from kvgate.workload.runner import Arm, write_traces

OVERLAY = "kvgate.impl.hold_overlay"
MIB = 1 << 20


def replay_all(traces: Sequence[Trace], build: Callable[[Config], Target]) -> int:
    """Replay every trace on a fresh target; returns the steps run."""
    steps = 0
    for trace in traces:
        with closing(build(trace.config)) as target:
            result = replay(trace, target, None, "api")
        if not result.passed:
            raise SystemExit(f"{trace.name}: {result.divergence}")
        steps += result.steps_run
    return steps


def timed(traces: Sequence[Trace], build: Callable[[Config], Target]) -> tuple[float, int]:
    started = time.perf_counter()
    steps = replay_all(traces, build)
    return time.perf_counter() - started, steps


def peak_bytes(traces: Sequence[Trace], build: Callable[[Config], Target]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        replay_all(traces, build)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, scale=1, units="64,256,512,1024,4096")
    parser.add_argument("--out", type=Path, help="where the traces go (default: a temp dir)")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from kvgate.impl.vllm_target import VllmTarget
    from kvgate.model import ModelTarget

    plugin = OVERLAY
    workload, deployment = workload_of(args)
    units = sorted({int(u) // args.scale for u in args.units.split(",")})
    arms = [Arm(u, h) for u in units for h in (False, True)]

    def vllm(config: Config) -> Target:
        return VllmTarget(config, plugin=plugin)

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        progress = Progress()
        started = time.perf_counter()
        paths = write_traces(workload, deployment, arms, out, progress)
        generate_s = time.perf_counter() - started
        started = time.perf_counter()
        traces = [load_trace(p) for p in paths]
        load_s = time.perf_counter() - started
    vllm(traces[0].config).close()  # import vLLM and warm it up, untimed

    print(
        f"workload: {workload.sessions} sessions x {workload.turns} turns, seed {args.seed}, "
        f"units {','.join(map(str, units))}"
        + (f", tokens / {args.scale}" if args.scale > 1 else "")
        + f"; build {args.build}; {len(arms)} traces (hold off and on)"
    )
    print(f"generate (model as oracle) + write: {generate_s:.1f}s; read back: {load_s:.1f}s")
    model_s, model_steps = timed(traces, ModelTarget)
    vllm_s, vllm_steps = timed(traces, vllm)
    model_peak = peak_bytes(traces, ModelTarget)
    vllm_peak = peak_bytes(traces, vllm)
    assert model_steps == vllm_steps
    per_step = 1e6 / model_steps
    print(f"{'':8}{'replay time':>14}{'us/step':>10}{'peak memory':>14}")
    print(f"{'model':8}{model_s:>13.1f}s{model_s * per_step:>10.0f}{model_peak / MIB:>11.1f} MiB")
    print(f"{'vllm':8}{vllm_s:>13.1f}s{vllm_s * per_step:>10.0f}{vllm_peak / MIB:>11.1f} MiB")
    print(
        f"{'ratio':8}{vllm_s / model_s:>13.2f}x{'':>10}{vllm_peak / model_peak:>11.2f}x"
        f"   (vllm / model, {model_steps} steps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
