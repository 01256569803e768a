"""Exploration campaign throughput: examples per second at 1 and 2 jobs and on Ray.

    python benchmarks/explore_campaign_scaling.py [--cells 4] [--shards 2] [--examples 30]
                                                  [--ray local:2 | --no-ray]

One campaign plan (the model, hold on, the first `--cells` config strata,
`--shards` shards of `--examples` examples per cell), run three times in
this process, each into a fresh directory: in-process (1 job), on a pool of
2 worker processes, and on a local Ray cluster of 2 worker CPUs. Prints
examples, wall seconds and examples per second for each, and the ratios
to 1 job from this one run. Wall times include starting the pool or the Ray
cluster. The hold-on arm finds nothing, so every shard runs its full budget.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvgate.explore import campaign
from kvgate.explore.knobs import strata


def _busy(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def cores_given(processes: int, seconds: float = 2.0) -> float:
    """Cores this machine gives `processes` busy loops started from here
    (CPU s / wall s). On a machine shared with other sessions the kernel
    (autogroup) shares CPU between sessions, not processes: two loops may get
    what one gets, and then no engine can scale."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    loops = [context.Process(target=_busy, args=(seconds,)) for _ in range(processes)]
    for loop in loops:
        loop.start()
    for loop in loops:
        loop.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return cpu / (time.perf_counter() - started)


def cpu_now() -> float:
    """CPU seconds of this process and of its children waited for so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass(frozen=True)
class Run:
    examples: int
    seconds: float  # wall
    cpu: float  # this process and its waited-for children (a pool's workers)
    shard_cpu: float  # the shards' own CPU, as each worker measured it
    shard_wall: float  # the shards' own wall seconds, summed


def run(plan: campaign.Plan, engine: campaign.Engine) -> Run:
    with tempfile.TemporaryDirectory() as out:
        cpu = cpu_now()
        started = time.perf_counter()
        result = campaign.run_campaign(plan, Path(out), engine)
        seconds = time.perf_counter() - started
        cpu = cpu_now() - cpu
    broken = [r.error for r in result.results if r.error]
    if broken:
        raise SystemExit(f"a shard broke: {broken[0]}")
    return Run(
        sum(r.examples for r in result.results),
        seconds,
        cpu,
        sum(r.cpu_seconds for r in result.results),
        sum(r.seconds for r in result.results),
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--examples", type=int, default=30, help="per cell")
    parser.add_argument("--ray", default="local:2", help="Ray address (default local:2)")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument(
        "--busy-seconds",
        type=float,
        default=2.0,
        help="how long the busy loops that measure the cores given run",
    )
    args = parser.parse_args(argv)
    cells = tuple(
        campaign.Cell(tuple(s.items()), "on", "model")
        for s in itertools.islice(strata(), args.cells)
    )
    plan = campaign.Plan(cells, "dev", args.examples, args.shards, seed=0)
    engines: list[tuple[str, campaign.Engine]] = [
        ("1 job", campaign.in_processes(1)),
        ("2 jobs", campaign.in_processes(2)),
    ]
    if not args.no_ray:
        if importlib.util.find_spec("ray") is None:
            print("Ray is not installed: pip install 'kvgate[ray]' (or --no-ray)")
            return 2
        engines.append((f"Ray {args.ray}", campaign.on_ray(args.ray)))
    print(
        f"plan: {len(cells)} cells x {args.shards} shards, {args.examples} examples per cell "
        "(model, hold on)"
    )
    one, two = cores_given(1, args.busy_seconds), cores_given(2, args.busy_seconds)
    print(
        f"this machine now gives 1 busy loop {one:.2f} cores, 2 busy loops {two:.2f} cores "
        f"(the most any engine here can use: {two / one:.2f}x one process)"
    )
    print(
        f"{'engine':<14} {'examples':>9} {'wall s':>8} {'ex/s':>7} {'vs 1 job':>9} "
        f"{'cpu s':>7} {'shard cpu s':>12} {'busy cores':>11} {'concurrency':>12}"
    )
    base = None
    for name, engine in engines:
        measured = run(plan, engine)
        rate = measured.examples / measured.seconds
        base = base or rate
        # Ray's workers are not this process's children: only the shards'
        # own CPU is known there.
        cpu = max(measured.cpu, measured.shard_cpu)
        print(
            f"{name:<14} {measured.examples:>9} {measured.seconds:>8.1f} {rate:>7.1f} "
            f"{rate / base:>8.2f}x {cpu:>7.1f} {measured.shard_cpu:>12.1f} "
            f"{cpu / measured.seconds:>11.2f} {measured.shard_wall / measured.seconds:>12.2f}"
        )
    print(
        "busy cores = CPU s / wall s: the cores the engine kept busy (bounded by what a "
        "shared machine gives it)\nconcurrency = the shards' wall seconds summed / wall s: "
        "shards running at once on average (2 when both workers always run one, whatever "
        "the load)\ncpu s - shard cpu s: the engine's own cost (starting workers, imports, "
        "the log)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
