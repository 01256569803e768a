"""Hunt for vLLM defects: a long exploration on stock vLLM, its counts recorded.

Runs `kvgate explore` on the installed vLLM, as it is (no overlay), at both
levels: whole engine steps on vLLM's real Scheduler in lockstep with kvgate's
scheduler model (every deployment family it draws), then manager calls on
vLLM's KVCacheManager in lockstep with kvgate's model. Each run has a time
budget, so the counts depend on the machine; the record keeps one run's.

    python benchmarks/hunting.py                  # hunt, write the record, print it
    python benchmarks/hunting.py --budget 90s     # a shorter hunt (not recorded)
    python benchmarks/hunting.py --render         # print the record again

The record (findings/hunting.json) holds, per level, the command, examples,
steps, divergences found on stock vLLM, and the known vLLM defects the run
reached (docs/findings.md) and explored past. A divergence's saved trace is
under out/hunting/ for triage: a defect in vLLM becomes a finding, a fault of
kvgate's model a fix.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "findings" / "hunting.json"
OUT = "out/hunting"
DEFAULT_BUDGET = {"scheduler": "6m", "manager": "3m"}
SEED = 0


def command(level: str, budget: str, seed: int) -> list[str]:
    scope = ["--scope", "scheduler"] if level == "scheduler" else []
    return [
        "-m",
        "kvgate",
        "explore",
        *scope,
        "--target",
        "vllm",
        "--budget",
        budget,
        "--seed",
        str(seed),
        "--out",
        f"{OUT}/{level}",
    ]


def count(pattern: str, text: str) -> int:
    match = re.search(pattern, text, re.M)
    return int(match.group(1)) if match else 0


def read_run(level: str, text: str, exit_code: int) -> dict[str, Any]:
    """The counts a run's summary printed (0 for a count it did not print)."""
    steps = r"^(\d+) examples, (\d+) engine steps" if level == "scheduler" else None
    head = re.search(steps or r"^(\d+) examples, (\d+) steps", text, re.M)
    if head is None or exit_code not in (0, 1):
        tail = (text.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"hunting: the {level}-level exploration exited {exit_code}: {tail}")
    failed = re.search(r"^FAIL (.*)$", text, re.M)
    saved = re.search(r"^saved: (\S+)$", text, re.M)
    families = re.findall(r"^  ([^:\n]+\([^\n]*\)): (\d+)$", text, re.M)
    return {
        "examples": int(head.group(1)),
        "steps": int(head.group(2)),
        "divergences": 1 if failed else 0,
        "divergence": failed.group(1) if failed else None,
        "saved": saved.group(1) if saved else None,
        # The known defects the run reached and explored past: examples the
        # exact-fit admission stopped, resets not sent while a load held blocks.
        "exact_fit_defect": count(r"known vLLM defect \([^)]*\) (\d+)", text),
        "resets_held_back": count(r"not sent while a waiting request holds blocks (\d+)", text),
        "families": {name: int(n) for name, n in families},
    }


def hunt(budgets: dict[str, str], seed: int) -> dict[str, Any]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}
    runs = {}
    for level, budget in budgets.items():
        argv = command(level, budget, seed)
        print(f"hunting: python {' '.join(argv)}", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True
        )
        runs[level] = {
            "command": f"kvgate {' '.join(argv[2:])}",
            **read_run(level, done.stdout, done.returncode),
        }
    load = os.getloadavg()[0]
    return {
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {load:.1f} at the end), Python {platform.python_version()}",
        "vllm": vllm_version(),
        "runs": runs,
    }


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "not installed"


def render(record: dict[str, Any]) -> list[str]:
    """The record as the results page shows it."""
    runs = record["runs"]
    lines = [
        f"hunting on stock vLLM {record['vllm']}, {record['generated']}, {record['machine']}",
        f"{'level':<10} {'examples':>8} {'steps':>7} {'divergences':>11} "
        f"{'known defects reached':>21}",
    ]
    for level, run in runs.items():
        reached = run["exact_fit_defect"] + run["resets_held_back"]
        lines.append(
            f"{level:<10} {run['examples']:>8} {run['steps']:>7} {run['divergences']:>11} "
            f"{reached:>21}"
        )
    for level, run in runs.items():
        lines.append(f"{level}: {run['command']}")
        if run["exact_fit_defect"]:
            lines.append(
                f"  connector admission at an exact fit: {run['exact_fit_defect']} examples"
            )
        if run["resets_held_back"]:
            lines.append(
                "  prefix-cache reset preempting running requests while a load holds blocks: "
                f"{run['resets_held_back']} held back"
            )
        for family, n in sorted(run["families"].items()):
            lines.append(f"  {family}: {n} examples")
        if run["divergence"]:
            lines.append(f"  divergence: {run['divergence']}")
    total = sum(run["divergences"] for run in runs.values())
    lines.append(f"divergences on stock vLLM: {total}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget",
        help="each level's time budget (e.g. 90s); the run is then printed, not recorded "
        f"(default: scheduler {DEFAULT_BUDGET['scheduler']}, "
        f"manager {DEFAULT_BUDGET['manager']}, recorded)",
    )
    parser.add_argument("--seed", type=int, default=SEED, help="default: %(default)s")
    parser.add_argument("--render", action="store_true", help="print the record; run nothing")
    args = parser.parse_args(argv)
    if args.render:
        record = json.loads(RECORD.read_text(encoding="utf-8"))
    else:
        budgets = dict.fromkeys(DEFAULT_BUDGET, args.budget) if args.budget else DEFAULT_BUDGET
        record = hunt(budgets, args.seed)
        if args.budget is None:
            RECORD.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print("\n".join(render(record)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
