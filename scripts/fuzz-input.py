#!/usr/bin/env python3
"""The hostile-input campaign: many variants of malformed traces and flags.

    scripts/fuzz-input.py [--variants N] [--seed S] [--timeout SECONDS]
                          [--memory-limit-mib M] [--target model|vllm]

Draws N variants with `tests/hostile_inputs.make_variant` (seeded: the same
seed draws the same variants), runs each in this process through kvgate's
command line with a per-variant alarm, and prints a table: variants by kind
and by exit code, then tracebacks, timeouts, forged report lines, passes of
an impossible step, other contract breaks, and the process's peak memory
(its resident set's high-water mark). The address space is capped at
`--memory-limit-mib`, so a run-away allocation shows as a MemoryError
(a traceback) instead of taking the box down (vLLM's import reserves much
address space: give `--target vllm` a larger cap). `--target vllm` replays
the trace variants on the installed vLLM, the model in lockstep. Exit 0
when nothing broke.
The README's table comes from `scripts/fuzz-input.py --variants 2000`.
"""

from __future__ import annotations

import argparse
import collections
import random
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hostile_inputs import Outcome, base_doc, dump, make_variant, run_variant  # noqa: E402


class Timeout(BaseException):  # not an Exception: kvgate must not catch it
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Timeout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=30, help="seconds per variant")
    parser.add_argument("--memory-limit-mib", type=int, default=4096)
    parser.add_argument("--target", default="model", choices=("model", "vllm"))
    args = parser.parse_args()

    limit = args.memory_limit_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    if args.target != "model":
        # Import the target once, outside any variant's alarm: on a busy box
        # vLLM's import alone can outlast it, and an import cut short leaves
        # the process unable to import it again.
        from kvgate.conformance.trace import parse_trace
        from kvgate.targets import target_factory

        config = parse_trace(dump(base_doc()).decode()).config
        target_factory(args.target)(config).close()
    rng = random.Random(args.seed)
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    counts: collections.Counter[str] = collections.Counter()
    examples: list[str] = []
    started = time.perf_counter()
    slowest = (0.0, "")
    for number in range(args.variants):
        variant = make_variant(rng)
        if args.target != "model":
            variant.argv = [args.target if a == "model" else a for a in variant.argv]
        with tempfile.TemporaryDirectory(prefix="kvgate-fuzz-") as workdir:
            signal.alarm(args.timeout)
            try:
                outcome = run_variant(variant, Path(workdir))
            except Timeout:
                outcome = Outcome(variant.kind, None, "", "", args.timeout, ["timeout"])
                counts["timeouts"] += 1
            finally:
                signal.alarm(0)
        outcome_name = "timeout" if outcome.code is None else f"exit {outcome.code}"
        by_kind[variant.kind][outcome_name] += 1
        counts["tracebacks"] += outcome.traceback
        counts["forged report lines"] += outcome.forged
        counts["impossible steps passed"] += outcome.impossible_passed
        other = [
            p
            for p in outcome.problems
            if not p.startswith(("traceback", "timeout", "an impossible", "exit code"))
            and "verdict lines" not in p
        ]
        counts["other contract breaks"] += bool(other)
        if outcome.problems and len(examples) < 20:
            examples.append(
                f"#{number} {variant.kind} {variant.argv}: "
                f"{outcome.problems} {outcome.err[-300:]!r}"
            )
        if outcome.seconds > slowest[0]:
            slowest = (outcome.seconds, f"#{number} {variant.kind}")

    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    codes = sorted({c for kinds in by_kind.values() for c in kinds})
    print(
        f"kvgate hostile-input campaign: {args.variants} variants on --target {args.target}, "
        f"seed {args.seed}, "
        f"{time.perf_counter() - started:.0f}s, timeout {args.timeout}s per variant, "
        f"address space capped at {args.memory_limit_mib} MiB"
    )
    header = f"| {'kind':<22} | {'variants':>8} | " + " | ".join(f"{c:>8}" for c in codes) + " |"
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    total: collections.Counter[str] = collections.Counter()
    for kind in sorted(by_kind):
        row = by_kind[kind]
        total.update(row)
        cells = " | ".join(f"{row[c]:>8}" for c in codes)
        print(f"| {kind:<22} | {sum(row.values()):>8} | {cells} |")
    cells = " | ".join(f"{total[c]:>8}" for c in codes)
    print(f"| {'all':<22} | {sum(total.values()):>8} | {cells} |")
    print()
    for name in (
        "tracebacks",
        "timeouts",
        "forged report lines",
        "impossible steps passed",
        "other contract breaks",
    ):
        print(f"{name}: {counts[name]}")
    print(f"peak memory (max RSS of the process): {peak_mib:.0f} MiB")
    print(f"slowest variant: {slowest[1]} ({slowest[0]:.1f}s)")
    for line in examples:
        print(line)
    broke = sum(counts[n] for n in counts)
    return 0 if broke == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
