"""Proof time against the bound, and the proof for every size: the whole
`kvgate prove` table at 8, 16 and 32 blocks (3 requests, one attention and
two Mamba groups) and the whole `kvgate prove --unbounded` table (every pool
size and request count, the same groups), in one run.

Each row is every property at `init` and across every op, all proved (the
benchmark fails otherwise): wall seconds, CPU seconds, the slowest cell, and
the bounded proof's CPU time over the unbounded one's. The proofs run in
this process (`--jobs 1`, the default), so CPU seconds are what they cost
whatever else the machine runs; with more jobs only wall time is measured
(the CPU column is then the parent's alone).

    python benchmarks/prove_scaling.py [--jobs 1] [--blocks 8 16 32]
                                       [--props NAME...] [--ops OP...]

`--props` and `--ops` narrow the table (a smoke run); default: all of it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from kvgate.invariants.z3.checker import prove
from kvgate.invariants.z3.transitions import ENCODED_OPS
from kvgate.invariants.z3.unbounded_proof import prove_unbounded
from kvgate.invariants.z3.vocabulary import Bounds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--requests", type=int, default=Bounds().requests)
    parser.add_argument("--groups", type=int, default=Bounds().groups)
    parser.add_argument("--props", nargs="+", metavar="NAME", help="default: every property")
    parser.add_argument(
        "--ops", nargs="+", metavar="OP", default=list(ENCODED_OPS), help="default: every op"
    )
    args = parser.parse_args(argv)

    started, cpu = time.perf_counter(), time.process_time()
    unbounded = prove_unbounded(args.groups, props=args.props, ops=args.ops, jobs=args.jobs)
    unbounded_wall = time.perf_counter() - started
    unbounded_cpu = time.process_time() - cpu
    failed = [(r.prop, r.op) for r in unbounded if not r.proved]
    if failed:
        raise SystemExit(f"unbounded: not proved: {failed}")

    header = f"{'blocks':>9}  {'cells':>5}  {'wall s':>7}  {'cpu s':>7}  {'/unbounded':>10}"
    print(f"{header}  slowest cell")
    rows: list[tuple[str, int, float, float, str, float]] = []
    for blocks in args.blocks:
        bounds = Bounds(blocks, args.requests, args.groups)
        started, cpu = time.perf_counter(), time.process_time()
        results = prove(bounds, props=args.props, ops=args.ops, jobs=args.jobs)
        wall = time.perf_counter() - started
        used = time.process_time() - cpu
        failed = [(r.prop, r.op) for r in results if not r.proved]
        if failed:
            raise SystemExit(f"{bounds}: not proved: {failed}")
        slowest = max(results, key=lambda r: r.seconds)
        rows.append(
            (
                str(blocks),
                len(results),
                wall,
                used,
                f"{slowest.prop} across {slowest.op} ({slowest.seconds:.1f}s)",
                used / unbounded_cpu,
            )
        )
        _row(*rows[-1])
    worst = max(unbounded, key=lambda r: r.seconds)
    _row(
        "unbounded",
        len(unbounded),
        unbounded_wall,
        unbounded_cpu,
        f"{worst.prop} across {worst.op} ({worst.seconds:.1f}s)",
        1.0,
    )
    print(f"({args.requests} requests bounded, {args.groups} groups, {args.jobs} jobs)")
    return 0


def _row(label: str, cells: int, wall: float, cpu: float, slowest: str, ratio: float) -> None:
    print(
        f"{label:>9}  {cells:>5}  {wall:>7.1f}  {cpu:>7.1f}  {ratio:>9.2f}x  {slowest}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
