"""Proof time against the bound: the whole `kvgate prove` table at 4, 8, 12
and 16 blocks (3 requests, one attention and two Mamba groups), in one run.

Each row is every property at `init` and across every op, all proved (the
benchmark fails otherwise): wall seconds with `--jobs` worker processes,
the CPU seconds the solver checks took in total, and the slowest cell.

    python benchmarks/prove_scaling.py [--jobs 2] [--blocks 4 8 12 16]
"""

from __future__ import annotations

import argparse
import os
import time

from kvgate.invariants.z3.checker import prove
from kvgate.invariants.z3.vocabulary import Bounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 12, 16])
    parser.add_argument("--requests", type=int, default=Bounds().requests)
    parser.add_argument("--groups", type=int, default=Bounds().groups)
    args = parser.parse_args()

    print(f"{'blocks':>6}  {'cells':>5}  {'wall s':>7}  {'check s':>7}  slowest cell")
    for blocks in args.blocks:
        bounds = Bounds(blocks, args.requests, args.groups)
        started = time.perf_counter()
        rows = prove(bounds, jobs=args.jobs)
        wall = time.perf_counter() - started
        failed = [(r.prop, r.op) for r in rows if not r.proved]
        if failed:
            raise SystemExit(f"{bounds}: not proved: {failed}")
        slowest = max(rows, key=lambda r: r.seconds)
        checks = sum(r.seconds for r in rows)
        print(
            f"{blocks:>6}  {len(rows):>5}  {wall:>7.1f}  {checks:>7.1f}  "
            f"{slowest.prop} across {slowest.op} ({slowest.seconds:.1f}s)",
            flush=True,
        )
    print(f"({args.requests} requests, {args.groups} groups, {args.jobs} jobs)")


if __name__ == "__main__":
    main()
