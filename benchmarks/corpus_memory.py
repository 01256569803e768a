"""A gate's peak memory over a corpus of long traces: one of them against many.

    python benchmarks/corpus_memory.py [--sessions N] [--copies C]

Writes a long manager-level trace (N conversations of two turns, one after
the other, each step a line as kvgate writes traces) in two forms: as
written, which the gate reads step by step as it replays, and with a
comment line after its last step, which it reads whole when the trace
runs. For each form, `kvgate gate --target model` runs, each run a process
of its own, on a corpus holding the trace once and on one holding C copies
of it, and the processes' peak resident memory is compared: a gate that
held every trace of its corpus at once would need about C times the
memory, one that holds a trace at a time the same.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvgate.conformance.trace import bundled_corpus

# The config the trace runs at: a bundled trace's (a hybrid, hold off).
CONFIG_OF = "dense-retention-multiturn.hold-off.yaml"
FORMS = (("one step a line", ""), ("read whole", "# a comment: not one step a line\n"))


def long_trace(name: str, sessions: int, tail: str) -> str:
    head = (bundled_corpus() / CONFIG_OF).read_text().split("steps:\n")[0]
    head = head.replace(CONFIG_OF.removesuffix(".yaml"), name, 1)
    lines = [head, "steps:\n"]
    for k in range(sessions):
        lines += [
            f"  - {{op: arrive, req: Q{k}, prompt: [{{fresh: 150}}]}}\n",
            f"  - {{op: prefill, req: Q{k}, lookahead: 3}}\n",
            f"  - {{op: decode, req: Q{k}, steps: 4, spec: 3}}\n",
            f"  - {{op: free, req: Q{k}, how: finish}}\n",
            "  - {op: drain}\n",
            f"  - {{op: arrive, req: F{k}, prompt: [{{all_of: Q{k}}}, {{fresh: 26}}]}}\n",
            f"  - {{op: prefill, req: F{k}, lookahead: 3}}\n",
            f"  - {{op: free, req: F{k}, how: finish}}\n",
            "  - {op: drain}\n",
        ]
    return "".join(lines) + tail


def peak_memory(corpus: Path) -> int:
    """The peak resident memory (KiB) of one gate run on `corpus` alone."""
    argv = [sys.executable, "-m", "kvgate", "gate", "--target", "model", "--no-bundled"]
    argv += ["--corpus", str(corpus), "--require", "none", "-q"]
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        assert child.stderr is not None
        raise SystemExit(f"the gate exited {child.returncode}: {child.stderr.read().decode()}")
    return usage.ru_maxrss


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=600, help="(600)")
    parser.add_argument("--copies", type=int, default=6, help="(6)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        size = len(long_trace("long", args.sessions, "").encode())
        print(
            f"trace: {args.sessions} conversations of two turns, {args.sessions * 9} steps, "
            f"{size // 1024} KiB; kvgate gate --target model on 1 and on {args.copies} copies"
        )
        print(f"{'form':<18}{'x1 peak':>12}{f'x{args.copies} peak':>12}   ratio")
        for form, tail in FORMS:
            peaks = []
            for copies in (1, args.copies):
                corpus = Path(tmp) / f"{form}-{copies}".replace(" ", "-")
                corpus.mkdir()
                for i in range(copies):
                    text = long_trace(f"long-{i}", args.sessions, tail)
                    (corpus / f"long-{i}.yaml").write_text(text)
                peaks.append(peak_memory(corpus))
            one, many = peaks
            print(
                f"{form:<18}{one / 1024:>8.1f} MiB{many / 1024:>8.1f} MiB   {many / one:.2f}"
                f"   (x{args.copies} / x1)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
