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
import sys
import tempfile
import time
from pathlib import Path

from kvgate.explore import campaign
from kvgate.explore.knobs import strata


def run(plan: campaign.Plan, engine: campaign.Engine) -> tuple[int, float]:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = campaign.run_campaign(plan, Path(out), engine)
        seconds = time.perf_counter() - started
    broken = [r.error for r in result.results if r.error]
    if broken:
        raise SystemExit(f"a shard broke: {broken[0]}")
    return sum(r.examples for r in result.results), seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--examples", type=int, default=30, help="per cell")
    parser.add_argument("--ray", default="local:2", help="Ray address (default local:2)")
    parser.add_argument("--no-ray", action="store_true")
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
    print(f"{'engine':<14} {'examples':>9} {'wall s':>8} {'ex/s':>7} {'vs 1 job':>9}")
    base = None
    for name, engine in engines:
        examples, seconds = run(plan, engine)
        rate = examples / seconds
        base = base or rate
        print(f"{name:<14} {examples:>9} {seconds:>8.1f} {rate:>7.1f} {rate / base:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
