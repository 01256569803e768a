"""Time for exploration to find the seed's total miss from scratch (hold off).

    python benchmarks/explore_first_counterexample.py [--seeds 5] [--examples 5000]

For each seed, the model is explored with the hold off until the first
counterexample (the no-total-miss invariant); prints, per seed, the seconds
to the first failing example Hypothesis ran (before shrinking), the total
time with both shrinks, and the shrunk trace's length; then the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from kvgate.explore.profiles import profile
from kvgate.explore.runner import explore, model_mode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--examples", type=int, default=5000, help="cap per seed")
    args = parser.parse_args(argv)
    settings = profile("dev", max_examples=args.examples)
    firsts: list[float] = []
    lengths: list[int] = []
    print(
        f"{'seed':>4} {'first (s)':>10} {'total (s)':>10} {'examples':>9} {'steps':>6}  invariant"
    )
    for seed in range(args.seeds):
        outcome = explore(model_mode(hold=False), settings, seed=seed)
        failure, stats = outcome.failure, outcome.stats
        if failure is None or stats.first_failure is None:
            row = f"{seed:>4} {'-':>10} {outcome.seconds:>10.1f} {stats.examples:>9}"
            print(f"{row} {'-':>6}  none found")
            continue
        length = len(failure.trace_steps())
        firsts.append(stats.first_failure)
        lengths.append(length)
        print(
            f"{seed:>4} {stats.first_failure:>10.2f} {outcome.seconds:>10.1f} "
            f"{stats.examples:>9} {length:>6}  {failure.invariant}"
        )
    if not firsts:
        print("no counterexample found")
        return 1
    print(
        f"median time to first counterexample: {statistics.median(firsts):.2f}s "
        f"({len(firsts)}/{args.seeds} seeds found it)"
    )
    print(f"median shrunk trace length: {statistics.median(lengths):g} steps")
    return 0 if len(firsts) == args.seeds else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
