"""Time per fault of the fault-injection campaign (`kvgate mutate`).

Runs the gate campaign on the installed vLLM (every fault unless named) and
prints the parent's one vLLM import, the baseline, each fault's wall time
(its child process: applying the fault, replaying the usable corpus with
invariants, and exploring when the corpus missed it), then the mean, the
slowest and the whole run. With `--jobs 1` (the default here) faults run
one after another, so each also gets its CPU time (what its child process
used, read from the parent's children usage): wall time grows on a loaded
machine, CPU time does not.

    python benchmarks/mutate_time.py [--faults NAME...] [--jobs N] [--explore N]
                                     [--corpus DIR] [--no-scheduler-stage]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kvgate.conformance.trace import bundled_corpus
from kvgate.mutate.campaign import Baseline, FaultResult, run_campaign, warm_up
from kvgate.mutate.faults import select
from kvgate.mutate.stages import Settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", nargs="+", metavar="NAME")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--explore", type=int, default=20, metavar="N")
    parser.add_argument("--corpus", type=Path, metavar="DIR", help="default: the bundled corpus")
    parser.add_argument(
        "--no-scheduler-stage", action="store_true", help="leave out the real-Scheduler stage"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    faults = select(args.faults)

    started = time.perf_counter()
    warm_up()
    print(f"vLLM import (parent, once): {time.perf_counter() - started:.1f}s", flush=True)

    cpu_seen = [_children_cpu()]
    cpu: list[float] = []

    def baseline(b: Baseline) -> None:
        cpu_seen.append(_children_cpu())
        print(f"baseline (no fault): {b.seconds:.1f}s, cpu {cpu_seen[-1] - cpu_seen[-2]:.1f}s")
        print(f"{'fault':<38} {'verdict':<8} {'wall s':>7} {'cpu s':>7}", flush=True)

    def row(r: FaultResult) -> None:
        cpu_seen.append(_children_cpu())
        # Exact with one job; with more, children overlap and this is a share.
        cpu.append(cpu_seen[-1] - cpu_seen[-2])
        print(f"{r.fault.name:<38} {r.verdict:<8} {r.seconds:7.2f} {cpu[-1]:7.2f}", flush=True)

    settings = Settings(
        corpus=args.corpus or bundled_corpus(),
        explore_examples=args.explore,
        scheduler_stage=not args.no_scheduler_stage,
    )
    campaign = run_campaign(faults, settings, args.jobs, on_baseline=baseline, on_result=row)
    times = [r.seconds for r in campaign.results]
    slowest = max(campaign.results, key=lambda r: r.seconds)
    print(
        f"per fault: wall mean {sum(times) / len(times):.2f}s, "
        f"slowest {slowest.seconds:.2f}s ({slowest.fault.name}), sum {sum(times):.1f}s; "
        f"cpu mean {sum(cpu) / len(cpu):.2f}s, sum {sum(cpu):.1f}s"
    )
    print(
        f"campaign: {campaign.seconds:.1f}s for {len(faults)} faults with {args.jobs} job(s); "
        f"with the import {time.perf_counter() - started:.1f}s"
    )
    return 0


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    sys.exit(main())
