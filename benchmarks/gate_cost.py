"""What each bundled corpus costs a gate run: wall and CPU time, one process.

    python benchmarks/gate_cost.py [--rounds R] [--manager DIR] [--scheduler DIR]

Imports vLLM once (what every gate run pays first, timed on its own), then
runs `kvgate gate --target vllm --plugin kvgate.impl.hold_overlay` on the
scheduler-level corpus and on the manager-level corpus, R rounds each,
alternately, and prints each corpus's trace count, its wall and CPU time
(the median of the rounds) and the scheduler-level corpus's share of the
manager-level one's. Every run must exit 0 (the overlay supplies the hold).
`--manager`/`--scheduler` replace a bundled corpus with a directory.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvgate import cli
from kvgate.conformance.trace import bundled_corpus, bundled_scheduler_corpus

PLUGIN = "kvgate.impl.hold_overlay"


def gate_once(corpus: Path) -> tuple[float, float]:
    """One gate run on the traces directly in `corpus` (a corpus folder is
    read with its subfolders: the manager-level one holds the scheduler-level
    one): (wall seconds, CPU seconds)."""
    with tempfile.TemporaryDirectory() as flat:
        for trace in corpus.glob("*.yaml"):
            (Path(flat) / trace.name).symlink_to(trace.resolve())
        wall, cpu = time.perf_counter(), time.process_time()
        out = io.StringIO()
        argv = ["gate", "--target", "vllm", "--plugin", PLUGIN, "--no-bundled", "--corpus", flat]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main([*argv, "-q"])
    if code != 0:
        raise SystemExit(f"gate_cost: the gate on {corpus} exited {code}:\n{out.getvalue()}")
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--manager", type=Path, default=bundled_corpus())
    parser.add_argument("--scheduler", type=Path, default=bundled_scheduler_corpus())
    args = parser.parse_args(argv)
    wall, cpu = time.perf_counter(), time.process_time()
    import vllm  # noqa: F401  (what every gate run pays once)

    print(
        f"import vllm: {time.perf_counter() - wall:.1f} s wall, "
        f"{time.process_time() - cpu:.1f} s CPU"
    )
    corpora = {"scheduler-level": args.scheduler, "manager-level": args.manager}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in corpora}
    for _ in range(args.rounds):
        for name, corpus in corpora.items():
            times[name].append(gate_once(corpus))
    medians = {
        name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        for name, runs in times.items()
    }
    print(f"{'corpus':<16} {'traces':>6} {'wall s':>8} {'CPU s':>8}  (median of {args.rounds})")
    for name, corpus in corpora.items():
        traces = len(list(corpus.glob("*.yaml")))
        print(f"{name:<16} {traces:>6} {medians[name][0]:>8.1f} {medians[name][1]:>8.1f}")
    share_wall = medians["scheduler-level"][0] / medians["manager-level"][0]
    share_cpu = medians["scheduler-level"][1] / medians["manager-level"][1]
    print(
        f"scheduler-level / manager-level: {share_wall:.2f} of the wall time, "
        f"{share_cpu:.2f} of the CPU time"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
