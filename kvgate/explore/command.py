"""`kvgate explore`: the state machine outside pytest.

    kvgate explore [--target model|vllm] [--hold on|off] [--retired on|off]
                   [--profile dev|ci|nightly]
                   [--budget N | --budget 90s | --budget 5m] [--seed N] --out DIR

`--target model` explores the model alone, checking every invariant;
`--target vllm` drives the model and vLLM 0.33.0 in lockstep at strict level
(hold off: upstream has none). `--retired on` (model only) adds the
production fork's retention of retired states (`retain_retired`). A budget
of N runs N examples; a duration runs rounds of the profile's examples, one
seed after another, until it is spent. The first failure is shrunk and
saved in DIR as a version-1 trace that `kvgate replay` shows failing. Exit 0:
nothing found; 1: a failure was saved; 2: bad input.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from kvgate.conformance.ops import FREE_HOW, PRIMITIVE_OPS
from kvgate.errors import InputError
from kvgate.explore.machine import Mode, Stats
from kvgate.explore.profiles import PROFILES, profile
from kvgate.explore.runner import Outcome, explore, model_mode

BAR_WIDTH = 30
# The largest budget: this many examples, or this many seconds (a day).
MAX_EXAMPLES = 10**7
MAX_SECONDS = 86_400.0
# Without a terminal, a progress line at most this often (seconds).
PLAIN_PROGRESS_EVERY = 10.0


def register(subparsers: Any) -> None:
    cmd = subparsers.add_parser(
        "explore", help="explore the model with Hypothesis (alone, or against vLLM)"
    )
    cmd.add_argument("--target", default="model", choices=("model", "vllm"))
    cmd.add_argument("--hold", default="on", choices=("on", "off"))
    cmd.add_argument(
        "--retired",
        default="off",
        choices=("on", "off"),
        help="the production fork's retention of retired states (model only)",
    )
    cmd.add_argument("--profile", default="dev", choices=sorted(PROFILES))
    cmd.add_argument(
        "--budget",
        metavar="N|DURATION",
        help="N examples, or a duration (90s, 5m, 1h); default: the profile's examples",
    )
    cmd.add_argument("--seed", type=int, default=0, help="first round's seed (default 0)")
    cmd.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to save traces")
    cmd.set_defaults(handler=handle)


def parse_budget(text: str | None) -> tuple[int | None, float | None]:
    """(examples, seconds): `500` is examples, `90s`/`5m`/`1h` a duration."""
    if text is None:
        return None, None
    if re.fullmatch(r"[0-9]{1,12}", text) and int(text) > 0:
        if int(text) > MAX_EXAMPLES:
            raise InputError(f"--budget: {text} examples is more than {MAX_EXAMPLES:,}")
        return int(text), None
    match = re.fullmatch(r"([0-9]{1,12}(?:\.[0-9]{1,6})?)([smh])", text)
    if match is None or float(match[1]) <= 0:
        raise InputError(f"--budget: {text[:40]!r} is neither a count of examples nor a duration")
    seconds = float(match[1]) * {"s": 1, "m": 60, "h": 3600}[match[2]]
    if seconds > MAX_SECONDS:
        raise InputError(f"--budget: {text} is longer than a day")
    return None, seconds


def handle(args: argparse.Namespace) -> int:
    examples, seconds = parse_budget(args.budget)
    if not 0 <= args.seed < 2**63:
        raise InputError(f"--seed: {args.seed} is outside 0..2**63-1")
    if args.target == "vllm":
        if args.hold == "on":
            raise InputError("--hold on: vLLM 0.33.0 has no hold; --target vllm runs hold off")
        if args.retired == "on":
            raise InputError("--retired on: vLLM 0.33.0 retains no retired state; model only")
        from kvgate.explore.differential import differential_mode

        mode: Mode = differential_mode()
    else:
        mode = model_mode(hold=args.hold == "on", retire=args.retired == "on")
    overrides: dict[str, Any] = {}
    if examples is not None:
        overrides["max_examples"] = examples
    settings = profile(args.profile, **overrides)
    if seconds is not None and settings.derandomize:
        raise InputError(f"--budget {args.budget}: profile {args.profile} is one fixed run")
    total = None if seconds is not None else settings.max_examples
    progress = Progress(sys.stderr, total, seconds)
    print(
        f"explore: target {args.target}, hold {args.hold}, retired {args.retired}, "
        f"profile {args.profile}, "
        + (f"{seconds:g}s" if seconds is not None else f"{settings.max_examples} examples"),
        flush=True,
    )
    outcome = explore(
        mode, settings, out=args.out, seed=args.seed, seconds=seconds, on_example=progress
    )
    progress.done()
    write_summary(sys.stdout, outcome)
    return 0 if outcome.passed else 1


class Progress:
    """A one-line progress bar on a terminal; a line now and then otherwise."""

    def __init__(self, out: TextIO, total: int | None, seconds: float | None) -> None:
        self.out = out
        self.total = total
        self.seconds = seconds
        self.started = time.perf_counter()
        self.last_plain = self.started
        self.tty = out.isatty()

    def fraction(self, stats: Stats) -> float:
        elapsed = time.perf_counter() - self.started
        if self.seconds is not None:
            return min(elapsed / self.seconds, 1.0)
        assert self.total is not None
        # Hypothesis also runs shrink examples past the budget: cap at 1.
        return min(stats.examples / self.total, 1.0)

    def __call__(self, stats: Stats) -> None:
        now = time.perf_counter()
        if not self.tty and now - self.last_plain < PLAIN_PROGRESS_EVERY:
            return
        self.last_plain = now
        filled = int(self.fraction(stats) * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        line = f"[{bar}] {stats.examples} examples, {stats.steps} steps, {now - self.started:.1f}s"
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=self.out)
        self.out.flush()

    def done(self) -> None:
        if self.tty:
            print(file=self.out)


def write_summary(out: TextIO, outcome: Outcome) -> None:
    stats = outcome.stats
    print(
        f"{stats.examples} examples, {stats.steps} steps, {outcome.rounds} round(s), "
        f"{outcome.seconds:.1f}s",
        file=out,
    )
    ops = stats.ops
    print("ops exercised:", file=out)
    for op in (*PRIMITIVE_OPS,):
        line = f"  {op:<9}{ops[op]:>9}"
        if op == "free":
            line += "  (" + ", ".join(f"{how} {ops[f'free:{how}']}" for how in FREE_HOW) + ")"
        print(line, file=out)
    missing = [op for op in PRIMITIVE_OPS if not ops[op]]
    missing += [f"free:{how}" for how in FREE_HOW if not ops[f"free:{how}"]]
    if missing:
        print(f"  never exercised: {', '.join(missing)}", file=out)
    print("configs drawn per align-mode knob:", file=out)
    knobs: dict[str, list[str]] = {}
    for key in stats.knobs:
        knob, value = key.split("=", 1)
        knobs.setdefault(knob, []).append(f"{value} {stats.knobs[key]}")
    for knob, values in knobs.items():
        print(f"  {knob}: {', '.join(sorted(values))}", file=out)
    failure = outcome.failure
    if failure is None:
        print("no failure found", file=out)
        return
    if stats.first_failure is not None:
        print(f"first counterexample after {stats.first_failure:.1f}s", file=out)
    print(
        f"FAIL {failure.kind} {failure.invariant} ({len(failure.trace_steps())} steps): "
        f"{failure.message}",
        file=out,
    )
    if outcome.saved is not None:
        print(f"saved: {outcome.saved}", file=out)
        print(f"replay: kvgate replay {outcome.saved} --target model", file=out)
