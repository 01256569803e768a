"""Time for exploration to find the seed's total miss from scratch (hold off).

    python benchmarks/explore_first_counterexample.py [--seeds 10] [--examples 5000] [--shrink]

For each seed, the model is explored with the hold off (the `dev` profile)
until the first counterexample (the no-total-miss invariant); prints, per
seed, the seconds to the first failing example Hypothesis ran, the examples
run by then and the total time; then the median and the maximum over the
seeds. `--shrink` also shrinks each failure (both shrinkers) and prints the
shrunk trace's length. Wall-clock seconds: on a shared machine they are
noisy; the process CPU time is printed beside them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from hypothesis import Phase

from kvgate.explore.profiles import profile
from kvgate.explore.runner import explore, model_mode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--examples", type=int, default=5000, help="cap per seed")
    parser.add_argument("--shrink", action="store_true", help="shrink each failure too")
    args = parser.parse_args(argv)
    phases = [Phase.explicit, Phase.generate, Phase.target]
    if args.shrink:
        phases.append(Phase.shrink)
    settings = profile("dev", max_examples=args.examples, phases=phases)
    firsts: list[float] = []
    firsts_cpu: list[float] = []
    print(
        f"{'seed':>4} {'first (s)':>10} {'CPU (s)':>8} {'examples':>9} {'total (s)':>10} "
        f"{'steps':>6}  invariant"
    )
    cpu_started = time.process_time()
    for seed in range(args.seeds):
        outcome = explore(model_mode(hold=False), settings, seed=seed, shrink=args.shrink)
        failure, stats = outcome.failure, outcome.stats
        if failure is None or stats.first_failure is None or stats.first_failure_cpu is None:
            print(
                f"{seed:>4} {'-':>10} {'-':>8} {stats.examples:>9} {outcome.seconds:>10.1f}"
                "  none found"
            )
            continue
        firsts.append(stats.first_failure)
        firsts_cpu.append(stats.first_failure_cpu)
        length = str(len(failure.trace_steps())) if args.shrink else "-"
        print(
            f"{seed:>4} {stats.first_failure:>10.2f} {stats.first_failure_cpu:>8.2f} "
            f"{stats.examples:>9} "
            f"{outcome.seconds:>10.1f} {length:>6}  {failure.invariant}"
        )
    if not firsts:
        print("no counterexample found")
        return 1
    print(
        f"time to first counterexample over {args.seeds} seeds: "
        f"median {statistics.median(firsts):.2f}s, max {max(firsts):.2f}s wall; "
        f"median {statistics.median(firsts_cpu):.2f}s, max {max(firsts_cpu):.2f}s CPU "
        f"({len(firsts)}/{args.seeds} found it; {time.process_time() - cpu_started:.1f}s CPU "
        "in all)"
    )
    return 0 if len(firsts) == args.seeds else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
