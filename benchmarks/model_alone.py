"""The full-scale workload trace replayed on the model alone against vLLM at
level api, each a `kvgate replay` of its own (reading and start-up
included), in one run.

The trace is the one `benchmarks/scale.py --full-scale` replays (the
workload at unit 64, served with a 64-token block: 11,326 blocks; hold off,
upstream build), generated once into `--out`. Each round runs the model,
then vLLM (which runs the model in lockstep too), for each checkout given
(default: this one), so every checkout sees the same machine state. CPU
seconds (user + sys of the child) are the stable measure on a shared
machine; wall seconds are printed beside them. The best round of each, and
the ratio vLLM api / model.

Each checkout's kvgate is byte-compiled first, as pip compiles a package it
installs (vLLM's modules were, at its install): both targets then run from
compiled code, as an installed kvgate does. Without it, on a machine that
sets PYTHONDONTWRITEBYTECODE, every replay would compile the checkout's
modules again, and the model's time would count that.

    python benchmarks/model_alone.py [--rounds 3] [--out DIR] [--checkout DIR ...]
                                     [--trace PATH]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# The full-scale trace is scale.py's, beside this script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import compile_checkout, workload_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TARGETS = ("model", "vllm")


def replay_seconds(checkout: Path, target: str, trace: Path) -> tuple[float, float]:
    """One `kvgate replay` of `trace` on `target` from `checkout`: wall and
    CPU seconds of the child process."""
    command = [PY, "-m", "kvgate", "replay", "--target", target, "--level", "api"]
    command += ["--require", "none", "-q", str(trace)]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(checkout))
    started = time.perf_counter()
    child = subprocess.Popen(
        command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert child.stderr is not None
    errors = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(f"{target} replay from {checkout} exited {child.returncode}: {errors.decode()}")
    return wall, usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--out", type=Path, default=Path("/tmp/kvgate-model-alone"), help="the trace's folder"
    )
    parser.add_argument(
        "--checkout",
        type=Path,
        action="append",
        help="a kvgate source tree to run (repeatable; default: this one)",
    )
    parser.add_argument(
        "--trace", type=Path, help="replay this trace instead of the full-scale one"
    )
    args = parser.parse_args(argv)
    checkouts = [c.resolve() for c in args.checkout or [ROOT]]
    trace = args.trace.resolve() if args.trace else workload_trace(args.out, 1, 64)
    print(f"trace: {trace} ({trace.stat().st_size / 2**20:.1f} MiB)")
    for checkout in checkouts:
        compile_checkout(checkout)
    best: dict[tuple[Path, str], tuple[float, float]] = {}
    for round_no in range(args.rounds):
        for checkout in checkouts:
            for target in TARGETS:
                wall, cpu = replay_seconds(checkout, target, trace)
                where = f"round {round_no} {checkout} {target:<5}"
                print(f"{where} wall {wall:6.2f} s cpu {cpu:6.2f} s")
                old = best.get((checkout, target), (wall, cpu))
                best[(checkout, target)] = (min(old[0], wall), min(old[1], cpu))
    for checkout in checkouts:
        (mw, mc), (vw, vc) = best[(checkout, "model")], best[(checkout, "vllm")]
        print(
            f"{checkout}: model alone {mw:.2f} s wall / {mc:.2f} s cpu; vLLM api {vw:.2f} s "
            f"wall / {vc:.2f} s cpu; vLLM api / model: {vw / mw:.1f}x wall, {vc / mc:.1f}x cpu"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
