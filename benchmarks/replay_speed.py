"""Corpus replay time: the model against the installed vLLM, in one run.

Each target replays the whole bundled corpus on its own (no lockstep), once
as calls only and once taking a strict snapshot after every step, several rounds,
interleaved so both see the same machine state. Prints the best round of
each and the ratio model / vLLM: below 1 means the model is faster.
Refusal traces are left out: nothing of them replays (vLLM refuses their
config, as they expect).

    python benchmarks/replay_speed.py [--rounds 5] [--corpus DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvgate.conformance.replay import replay
from kvgate.conformance.trace import Trace, bundled_corpus, load_corpus
from kvgate.model import ModelTarget
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.target import Target, WatchedTarget


def take_snapshot(step: Step, target: Target) -> None:
    target.snapshot()


def corpus_seconds(
    traces: list[Trace], factory: Callable[[Config], Target], snapshots: bool
) -> float:
    started = time.perf_counter()
    for trace in traces:
        target: Target = factory(trace.config)
        if snapshots:
            target = WatchedTarget(target, take_snapshot)
        try:
            replay(trace, target, None, "api")
        finally:
            target.close()
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--corpus", type=Path, metavar="DIR", help="default: the bundled corpus")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from kvgate.impl.vllm_target import VllmTarget

    traces = [t for t in load_corpus(args.corpus or bundled_corpus()) if t.expect_refused is None]
    steps = sum(len(t.primitives) for t in traces)
    print(f"corpus: {len(traces)} traces, {steps} written steps; best of {args.rounds} rounds")
    corpus_seconds(traces, VllmTarget, False)  # warm up: vLLM's import, caches
    for label, snapshots in (("calls", False), ("+snapshots", True)):
        best: dict[str, float] = {"model": float("inf"), "vllm": float("inf")}
        for _ in range(args.rounds):
            best["model"] = min(best["model"], corpus_seconds(traces, ModelTarget, snapshots))
            best["vllm"] = min(best["vllm"], corpus_seconds(traces, VllmTarget, snapshots))
        model_ms, vllm_ms = best["model"] * 1000, best["vllm"] * 1000
        print(
            f"{label:>10}: model {model_ms:8.1f} ms   vllm {vllm_ms:8.1f} ms"
            f"   model/vllm {model_ms / vllm_ms:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
