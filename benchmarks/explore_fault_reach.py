"""How many examples differential exploration needs to catch each fault.

    python benchmarks/explore_fault_reach.py [--faults NAME ...] [--seeds 6] [--cap 150]

The fault campaign's exploration stage (`kvgate mutate --explore-every-fault`)
is one derandomized run per deployment family: it catches a fault or not,
and which faults it misses moves whenever the generator changes. This
measures instead how likely one example is to catch a fault: for each fault
(in a forked child with the fault in effect, as the campaign runs it) and
each family of `explore.differential.FAMILIES`, `--seeds` random runs of at
most `--cap` examples (the campaign's rules per example), each until the
first failure. Per family it prints the runs that caught the fault and the
examples each needed; the last column is the estimated chance that one
example catches it (catches / examples run), and the chance that the
campaign's share of the budget per family misses it (`(1 - p) ** share`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

from hypothesis import Phase

from kvgate.explore.differential import FAMILIES, differential_mode
from kvgate.explore.knobs import stratum_name
from kvgate.explore.profiles import profile
from kvgate.explore.runner import run_once
from kvgate.mutate.campaign import warm_up
from kvgate.mutate.faults import select
from kvgate.mutate.inject import apply
from kvgate.mutate.stages import EXPLORE_EXAMPLES, EXPLORE_STEPS

DEFAULT_FAULTS = (
    "lookup-hits-last-token",
    "lookahead-hash-misses-next-token",
    "evict-keeps-partial-keys",
)


def family_name(family: dict[str, Any]) -> str:
    return stratum_name(family).replace("prefix_caching", "caching").replace("pure_mamba", "pure")


def reach(
    fault_name: str, seeds: int, cap: int, families: list[int] | None, conn: Connection
) -> None:
    """In a child: the fault in effect, every family x seed; sends rows."""
    [fault] = select([fault_name])
    apply(fault)
    rows = []
    for index, family in enumerate(FAMILIES):
        if families is not None and index not in families:
            continue
        for seed in range(seeds):
            mode = differential_mode()
            mode.stratum = family
            settings = profile(
                "dev",
                max_examples=cap,
                stateful_step_count=EXPLORE_STEPS,
                derandomize=False,
                phases=(Phase.explicit, Phase.generate),
            )
            started = time.process_time()
            try:
                caught = run_once(mode, settings, seed) is not None
            except Exception:  # a divergence the machine did not wrap: caught too
                caught = True
            ran = mode.stats.examples + (1 if caught else 0)
            rows.append((family_name(family), seed, caught, ran, time.process_time() - started))
    conn.send(rows)
    conn.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", nargs="+", default=list(DEFAULT_FAULTS))
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--cap", type=int, default=150, help="examples per run at most")
    parser.add_argument(
        "--families", nargs="+", type=int, metavar="K", help="only these (index in FAMILIES)"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    warm_up()
    context = multiprocessing.get_context("fork")
    share = EXPLORE_EXAMPLES // len(FAMILIES)
    print(f"{args.seeds} seeds x at most {args.cap} examples per family; the campaign: {share}")
    print(f"{'fault':<34} {'family':<26} {'caught':>7} {'examples to catch':<24} "
          f"{'p/example':>9} {'miss@' + str(share):>9} {'cpu s':>6}")  # fmt: skip
    for name in args.faults:
        receive, send = context.Pipe(duplex=False)
        child = context.Process(
            target=reach, args=(name, args.seeds, args.cap, args.families, send)
        )
        child.start()
        send.close()
        rows = receive.recv()
        child.join()
        for family in dict.fromkeys(r[0] for r in rows):
            mine = [r for r in rows if r[0] == family]
            caught = [r[3] for r in mine if r[2]]
            examples = sum(r[3] for r in mine)
            p = len(caught) / examples if examples else 0.0
            miss = (1 - p) ** share
            shown = ",".join(str(n) for n in caught) or "-"
            median = f" (median {statistics.median(caught):g})" if caught else ""
            print(
                f"{name:<34} {family:<26} {len(caught):>3}/{len(mine):<3} "
                f"{(shown + median)[:24]:<24} {p:>9.4f} {miss:>9.2f} "
                f"{sum(r[4] for r in mine):>6.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
