"""`kvgate explore`: the state machine outside pytest.

    kvgate explore [--target model|vllm [--overlay]] [--hold on|off] [--retired on|off]
                   [--profile dev|ci|nightly]
                   [--budget N | --budget 90s | --budget 5m] [--seed N] [--out DIR]
    kvgate explore --jobs N | --ray ADDRESS | --matrix  [--target T] [--hold H]
                   [--retired R] [--shards K] [--profile P] [--budget N] [--seed N] [--out DIR]
    kvgate explore --scope scheduler [--target vllm [--overlay]] [--hold on|off]
                   [--retired on|off] [--profile P] [--budget N] [--seed N] [--out DIR]

`--target model` explores the model alone, checking every invariant;
`--target vllm` drives the model and vLLM 0.33.0 in lockstep at strict level
(hold off: upstream has none); `--target vllm --overlay` does the same with
kvgate's hold overlay on vLLM, hold on (once spelled `--target vllm+overlay`).
`--retired on` (the model, the overlay) adds the production fork's retention
of retired states (`retain_retired`). A budget
of N runs N examples; a duration runs rounds of the profile's examples, one
seed after another, until it is spent. The first failure is shrunk and
saved in DIR (default out/explore; nothing is written when nothing fails) as a
version-1 trace that `kvgate replay` shows failing. Exit 0:
nothing found; 1: a failure was saved; 2: bad input.

With `--jobs N`, `--ray ADDRESS` or `--matrix` it runs a campaign
(`kvgate.explore.campaign`): the config matrix (every stratum of the config
knobs; with `--jobs`/`--ray` alone, the same) x the hold arms x the targets
available (probed: the model runs every arm, vLLM hold off, vLLM with the
overlay the hold arms), narrowed by `--target`, `--hold` and `--retired` when given;
`--budget N` examples per cell, in `--shards K` shards each (default: enough
for every worker), on N processes or a Ray cluster (`local:2` starts a local
one). Every failure is saved under DIR/traces; one summary at the end. Run
it again on the same DIR to continue a stopped campaign. Exit 0: nothing
found; 1: a failure was found (or a shard broke); 2: bad input.

With `--scope scheduler` the steps are engine steps (requests arriving,
engine steps, aborts, prefix-cache resets) on kvgate's scheduler model and
vLLM's real `Scheduler`, in the strict lockstep the gate replays
scheduler-level traces with (`kvgate.explore.scheduler_machine`), over the
hybrid deployment families; `--profile` then names the Scheduler level's
smaller profiles. The first divergence, shrunk, is printed as the engine
steps that reproduce it and saved in DIR as a scheduler-level trace that
`kvgate replay FILE --target vllm` shows diverging.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from hypothesis import settings as Settings

from kvgate import options
from kvgate.errors import InputError
from kvgate.explore.mode import Mode, SchedulerMode, Stats
from kvgate.explore.profiles import PROFILES, SCHEDULER_PROFILES, profile
from kvgate.explore.runner import Outcome, explore, model_mode
from kvgate.explore.scheduler_draws import ABORT_PLACES, SHAPES
from kvgate.explore.scheduler_runner import SchedulerOutcome, explore_scheduler
from kvgate.vocabulary.ops import FREE_HOW, PRIMITIVE_OPS

BAR_WIDTH = 30
DEFAULT_OUT = Path("out/explore")  # beside out/workload; git ignores out/
# The largest budget: this many examples, or this many seconds (a day).
MAX_EXAMPLES = 10**7
MAX_SECONDS = 86_400.0
# Without a terminal, a progress line at most this often (seconds).
PLAIN_PROGRESS_EVERY = 10.0


# What an `arrive` line counts: requests with each hash input, and those
# that changed one of their parent's (another tenant, adapter or image id).
ARRIVE_INPUTS = ("cache_salt", "lora", "mm", "varied")


def register(subparsers: Any) -> None:
    cmd = subparsers.add_parser(
        "explore", help="explore the model with Hypothesis (alone, or against vLLM)"
    )
    cmd.add_argument(
        "--target",
        choices=("model", "vllm", "vllm+overlay"),  # the last one deprecated
        metavar="{model,vllm}",
        help="model: the model alone; vllm: the model and vLLM in lockstep (default: model; "
        "a campaign: every target available)",
    )
    options.add_overlay(cmd)
    options.add_scope(
        cmd,
        "manager",
        "manager: manager calls as kvgate's scheduler model issues them; scheduler: whole "
        "engine steps on vLLM's real Scheduler in lockstep with kvgate's scheduler model "
        "(--target vllm)",
    )
    options.add_hold(
        cmd, None, "default: off for --target vllm, on otherwise (a campaign: both)", both=False
    )
    cmd.add_argument(
        "--retired",
        choices=("on", "off"),
        help="the retained-state retention: the newest state leaving a request's table "
        "stays held (default off)",
    )
    cmd.add_argument(
        "--profile",
        default="dev",
        choices=sorted(PROFILES),
        help="examples per run: "
        + ", ".join(f"{name} {PROFILES[name].max_examples}" for name in PROFILES)
        + "; with --scope scheduler: "
        + ", ".join(f"{name} {SCHEDULER_PROFILES[name].max_examples}" for name in PROFILES),
    )
    cmd.add_argument(
        "--budget",
        metavar="N|DURATION",
        help="N examples, or a duration (90s, 5m, 1h); default: the profile's examples",
    )
    options.add_seed(cmd, 0, "first round's seed")
    options.add_out(
        cmd,
        DEFAULT_OUT,
        "where a failing example's trace is saved (nothing is written when none fails); "
        "a campaign keeps its log there too",
    )
    campaign = cmd.add_argument_group("campaigns")
    campaign.add_argument("--jobs", type=int, metavar="N", help="a campaign on N processes")
    campaign.add_argument(
        "--ray", metavar="ADDRESS", help="a campaign on a Ray cluster (local:N starts one here)"
    )
    campaign.add_argument(
        "--matrix", action="store_true", help="a campaign over the config matrix (in process)"
    )
    campaign.add_argument("--shards", type=int, metavar="K", help="shards (seeds) per cell")
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


def _resolve_target(args: argparse.Namespace) -> None:
    """`--target vllm --overlay` is the overlay target, named `vllm+overlay`
    inside (the old spelling of the flag, still accepted)."""
    if args.target == "vllm+overlay":
        options.deprecated("--target vllm+overlay", "--target vllm --overlay")
        args.target, args.overlay = "vllm", True
    if args.overlay:
        if args.target not in (None, "vllm"):
            raise InputError(f"--overlay: loads into vLLM; --target {args.target} has no vLLM")
        args.target = "vllm+overlay"


def _check_seed(args: argparse.Namespace) -> None:
    if not 0 <= args.seed < 2**63:
        raise InputError(f"--seed: {args.seed} is outside 0..2**63-1")


def _settings(
    args: argparse.Namespace, scope: str, examples: int | None, seconds: float | None
) -> Settings:
    """The run's Hypothesis settings: `--profile` of `scope`, `--budget`'s
    examples in place of the profile's."""
    overrides: dict[str, Any] = {} if examples is None else {"max_examples": examples}
    settings = profile(args.profile, scope, **overrides)
    if seconds is not None and settings.derandomize:
        raise InputError(f"--budget {args.budget}: profile {args.profile} is one fixed run")
    return settings


def _announce(
    args: argparse.Namespace, what: str, settings: Settings, seconds: float | None
) -> None:
    """The run's first line (not with `-q`): `what` it runs and its budget."""
    if options.quiet(args):
        return
    print(
        f"explore: {what}, profile {args.profile}, "
        + (f"{seconds:g}s" if seconds is not None else f"{settings.max_examples} examples"),
        flush=True,
    )


def handle(args: argparse.Namespace) -> int:
    _resolve_target(args)
    if args.scope == "scheduler":
        return handle_scheduler(args)
    if args.jobs is not None or args.ray is not None or args.matrix:
        return handle_campaign(args)
    if args.shards is not None:
        raise InputError("--shards: only for a campaign (--jobs, --ray or --matrix)")
    args.target = args.target or "model"
    # The hold arm follows the target: upstream vLLM has no hold.
    args.hold = args.hold or ("off" if args.target == "vllm" else "on")
    args.retired = args.retired or "off"
    examples, seconds = parse_budget(args.budget)
    _check_seed(args)
    if args.target == "vllm":
        if args.hold == "on":
            raise InputError(
                "--hold on: vLLM 0.33.0 has no hold; --target vllm runs hold off "
                "(--target vllm --overlay runs it with the hold)"
            )
        if args.retired == "on":
            raise InputError(
                "--retired on: vLLM 0.33.0 retains no retired state; "
                "--target vllm --overlay (or model) runs it"
            )
        from kvgate.explore.differential import differential_mode

        mode: Mode = differential_mode(refusals=True)
    elif args.target == "vllm+overlay":
        if args.hold == "off":
            raise InputError("--hold off: the overlay is the hold; --target vllm runs hold off")
        from kvgate.explore.differential import overlay_differential_mode

        mode = overlay_differential_mode(retain_retired=args.retired == "on", refusals=True)
    else:
        mode = model_mode(hold=args.hold == "on", retain_retired=args.retired == "on")
    settings = _settings(args, "manager", examples, seconds)
    total = None if seconds is not None else settings.max_examples
    progress = Progress(sys.stderr, total, seconds)
    what = f"target {args.target}, hold {args.hold}, retired {args.retired}"
    _announce(args, what, settings, seconds)
    outcome = explore(
        mode,
        settings,
        out=args.out,
        seed=args.seed,
        seconds=seconds,
        on_example=None if options.quiet(args) else progress,
    )
    if not options.quiet(args):
        progress.done()
    _summary(args, write_summary, outcome)
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


# Where a summary's verdict part starts: what `-q` keeps, after the count line.
_VERDICT_STARTS = ("no failure found", "no divergence found", "first ", "FAIL ")


def _summary(args: argparse.Namespace, write: Callable[[TextIO, Any], None], outcome: Any) -> None:
    """The run's summary; with `-q` only its count line and its verdict (no
    failure, or the failure and how to replay it), not what it exercised."""
    if not options.quiet(args):
        write(sys.stdout, outcome)
        return
    text = io.StringIO()
    write(text, outcome)
    lines = text.getvalue().splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.startswith(_VERDICT_STARTS)), len(lines)
    )
    print("\n".join([lines[0], *lines[start:]]), flush=True)


def write_summary(out: TextIO, outcome: Outcome) -> None:
    stats = outcome.stats
    # Examples dropped at a full-report lookup vLLM 0.33.0 raises on are
    # among those dropped part-way (Hypothesis counts them as invalid).
    crashes = (
        f", {stats.rejected_lookups} of them at a kv_events_full lookup vLLM raises on"
        if stats.rejected_lookups
        else ""
    )
    print(
        f"{stats.examples} examples, {stats.steps} steps, {outcome.rounds} round(s), "
        f"{outcome.seconds:.1f}s (besides: {stats.discarded} dropped part-way by Hypothesis"
        f"{crashes}, {stats.shrinking} while shrinking)",
        file=out,
    )
    ops = stats.ops
    print("ops exercised:", file=out)
    for op in (*PRIMITIVE_OPS,):
        line = f"  {op:<9}{ops[op]:>9}"
        if op == "free":
            line += "  (" + ", ".join(f"{how} {ops[f'free:{how}']}" for how in FREE_HOW) + ")"
        if op in ("lookup", "allocate") and ops[f"{op}:connector"]:
            # A KV connector's share: external tokens taken, async loads.
            line += f"  (connector: {ops[f'{op}:connector']})"
        if op == "residency":
            line += f"  (eviction events: {ops['residency:evicted']})"
        if op == "arrive":
            # The hash inputs requests arrived with (`explore.hash_inputs`).
            line += "  (" + ", ".join(f"{k} {ops[f'arrive:{k}']}" for k in ARRIVE_INPUTS) + ")"
        print(line, file=out)
    failures = [
        f"{kind} on {op} {ops[f'load_failure:{kind}:{op}']}"
        for kind in ("whole", "blocks")
        for op in ("lookup", "allocate", "free")
        if ops[f"load_failure:{kind}:{op}"]
    ]
    if failures:
        # A connector's load failures: whole or of some blocks; on a lookup
        # or allocate under policy recompute, on a free under policy fail.
        print(f"  KV load failures: {', '.join(failures)}", file=out)
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
    breaches = stats.rule_breaches
    if breaches:
        refusals = ", ".join(f"{how} {breaches[how]}" for how in sorted(breaches))
        print(
            f"config rules broken before the search: {breaches.total()} configs, "
            f"refused alike ({refusals})",
            file=out,
        )
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


def handle_campaign(args: argparse.Namespace) -> int:
    from kvgate.explore import campaign

    if args.jobs is not None and args.jobs < 1:
        raise InputError("--jobs: must be at least 1")
    if args.jobs is not None and args.ray is not None:
        raise InputError("--ray: runs on the cluster's workers; leave out --jobs")
    if args.shards is not None and args.shards < 1:
        raise InputError("--shards: must be at least 1")
    examples, seconds = parse_budget(args.budget)
    if seconds is not None:
        raise InputError(f"--budget {args.budget}: a campaign's budget is examples per cell")
    wanted = (args.target,) if args.target is not None else campaign.TARGET_NAMES
    targets, why_not = campaign.available_targets(wanted)
    if args.target is not None and args.target in why_not:
        raise InputError(f"--target {args.target}: cannot run here ({why_not[args.target]})")
    arms = [
        a.name
        for a in campaign.ARMS
        if (args.hold is None or a.hold == (args.hold == "on"))
        and (args.retired is None or a.retain_retired == (args.retired == "on"))
    ]
    if not arms:
        raise InputError("--retired on: needs the hold on")
    cells = campaign.matrix(targets, arms)
    if not cells:
        raise InputError(
            f"--hold {args.hold}: target {args.target} runs hold "
            f"{', '.join(campaign.TARGET_ARMS[targets[0]])} only"
        )
    for target, why in why_not.items():
        print(f"target {target} left out: {why}", flush=True)
    workers = args.jobs or 1
    if args.ray is not None:
        workers = int(args.ray.partition(":")[2] or 2) if args.ray.startswith("local") else 2
    shards = args.shards or max(1, -(-workers // len(cells)))
    settings = profile(args.profile)
    plan = campaign.Plan(cells, args.profile, examples or settings.max_examples, shards, args.seed)
    engine = campaign.on_ray(args.ray) if args.ray is not None else campaign.in_processes(workers)
    where = f"Ray cluster {args.ray}" if args.ray is not None else f"{workers} process(es)"
    configs = len({c.stratum for c in cells})
    pairs = list(dict.fromkeys((c.target, c.arm) for c in cells))
    print(
        f"explore campaign: {len(cells)} cells (configs x (target, hold arm): {configs} x "
        f"{len(pairs)}: {', '.join(f'{t} {a}' for t, a in pairs)}), "
        f"{plan.examples} examples per cell in {shards} shard(s), profile {args.profile}, "
        f"on {where}",
        flush=True,
    )
    log = campaign.CampaignLog.open(args.out, plan)
    if log.resumed:
        print(
            f"resuming: {log.resumed} of {len(plan.shard_list())} shards done, read from "
            f"{log.path} (kvgate's campaign log; Hypothesis's example database is not used)",
            flush=True,
        )

    def progress(result: campaign.ShardResult, done: int, total: int) -> None:
        what = (
            "error"
            if result.error
            else "n/a"
            if result.skipped
            else "FAIL"
            if result.failure
            else "ok"
        )
        print(
            f"[{done}/{total}] {result.key}: {result.examples} examples, "
            f"{result.seconds:.1f}s, {what}",
            file=sys.stderr,
            flush=True,
        )

    outcome = campaign.run_campaign(plan, args.out, engine, progress)
    ran = sum(r.examples for r in outcome.results)
    print(
        f"{ran} examples in all; this run {outcome.seconds:.1f}s"
        + (f" ({outcome.resumed} shards resumed from the log)" if outcome.resumed else "")
    )
    for line in campaign.summary_lines(outcome):
        print(line)
    broken = any(r.error for r in outcome.results)
    return 1 if outcome.distinct() or broken else 0


def handle_scheduler(args: argparse.Namespace) -> int:
    """`--scope scheduler`: engine steps against vLLM's real Scheduler."""
    for flag, value in (("--jobs", args.jobs), ("--ray", args.ray), ("--shards", args.shards)):
        if value is not None:
            raise InputError(f"{flag}: campaigns run at the manager level; leave out --scope")
    if args.matrix:
        raise InputError("--matrix: campaigns run at the manager level; leave out --scope")
    target = args.target or "vllm"
    if target == "model":
        raise InputError(
            "--target model: the Scheduler-level exploration runs kvgate's scheduler model "
            "in lockstep with vLLM's Scheduler; give --target vllm"
        )
    overlay = target == "vllm+overlay"
    hold = args.hold or ("on" if overlay else "off")
    retired = args.retired or "off"
    if not overlay and hold == "on":
        raise InputError(
            "--hold on: vLLM 0.33.0 has no hold; --target vllm --overlay runs it with the hold"
        )
    if not overlay and retired == "on":
        raise InputError(
            "--retired on: vLLM 0.33.0 retains no retired state; --target vllm --overlay runs it"
        )
    if overlay and hold == "off" and retired == "off":
        raise InputError("--hold off: the overlay is the hold; --target vllm runs hold off")
    _check_seed(args)
    examples, seconds = parse_budget(args.budget)
    settings = _settings(args, "scheduler", examples, seconds)
    mode = SchedulerMode(hold=hold == "on", retain_retired=retired == "on")
    what = f"scope scheduler, target {target}, hold {hold}, retired {retired}"
    _announce(args, what, settings, seconds)
    outcome = explore_scheduler(mode, settings, out=args.out, seed=args.seed, seconds=seconds)
    _summary(args, write_scheduler_summary, outcome)
    return 0 if outcome.passed else 1


def write_scheduler_summary(out: TextIO, outcome: SchedulerOutcome) -> None:
    """What a Scheduler-level run exercised, and its failure as runnable steps."""
    stats = outcome.stats
    print(
        f"{stats.examples} examples, {stats.engine_steps} engine steps, "
        f"{outcome.rounds} round(s), {outcome.seconds:.1f}s (besides: {stats.discarded} "
        f"dropped part-way, {stats.shrinking} while shrinking)",
        file=out,
    )
    ops = stats.ops
    print("engine ops exercised:", file=out)
    arrivals = ", ".join(f"{shape} {ops[f'arrive:{shape}']}" for shape in SHAPES)
    arrived = sum(ops[f"arrive:{shape}"] for shape in SHAPES)
    print(
        f"  arrive   {arrived:>7}  ({arrivals}; another tenant's salt {ops['arrive:salted']}; "
        f"images {ops['arrive:image']} (two {ops['arrive:images']}); "
        f"priority 1 {ops['arrive:priority:1']}, 2 {ops['arrive:priority:2']} "
        f"(in {ops['engine:priority']} examples under the priority policy); "
        f"a KV connector's hit, sync {ops['arrive:remote:sync']}, "
        f"async {ops['arrive:remote:async']})",
        file=out,
    )
    print(
        f"  step     {ops['step']:>7}  (preemptions {stats.preemptions}; a stop condition "
        f"ended a running request {ops['step:stop']}; steps accepting drafts without async "
        f"scheduling {ops['step:drafts_accepted:sync']}; in {ops['engine:async']} examples "
        f"under async scheduling: a stop {ops['step:stop:async']}, drafts accepted in flight "
        f"{ops['step:drafts_accepted']}, rejected {ops['step:drafts_rejected']})",
        file=out,
    )
    chunks = sum(ops[f"chunk:{kind}"] for kind in ("queued", "paused", "end"))
    print(
        f"  chunk    {chunks:>7}  (to {ops['arrive:session']} streaming-input sessions: a chunk "
        f"queued while running {ops['chunk:queued']}, sent to a paused session "
        f"{ops['chunk:paused']}, a session's end {ops['chunk:end']})",
        file=out,
    )
    aborts = ", ".join(f"{where} {ops[f'abort:{where}']}" for where in ABORT_PLACES)
    print(f"  abort    {sum(ops[f'abort:{w}'] for w in ABORT_PLACES):>7}  ({aborts})", file=out)
    resets = [
        f"{'preempting' if running else 'keeping'} running requests, {busy} "
        f"{ops[f'reset:{key}:{busy}']}"
        for running, key in ((True, "running"), (False, "kept"))
        for busy in ("busy", "idle")
    ]
    total = sum(ops[k] for k in ops if k.startswith("reset:") and k != "reset:skipped")
    if ops["reset:skipped"]:
        # Not sent: vLLM raises while blocks are held outside the running queue.
        resets.append(
            f"preempting running requests, not sent while a waiting request holds blocks "
            f"{ops['reset:skipped']}"
        )
    print(f"  reset    {total:>7}  ({'; '.join(resets)})", file=out)
    print("examples per deployment family:", file=out)
    for family, count in sorted(stats.families.items()):
        print(f"  {family}: {count}", file=out)
    if stats.refused:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(stats.refused.items()))
        print(f"examples dropped (config or request refused, by field): {refused}", file=out)
    failure = outcome.failure
    if failure is None:
        print("no divergence found", file=out)
        return
    if stats.first_failure is not None:
        print(f"first divergence after {stats.first_failure:.1f}s", file=out)
    print(f"FAIL {failure.kind} ({failure.entries()} engine entries): {failure.message}", file=out)
    print("steps that reproduce it:", file=out)
    for line in failure.runnable():
        print(f"  {line}", file=out)
    if outcome.saved is not None:
        print(f"saved: {outcome.saved}", file=out)
        print(f"replay: {failure.mode.replay_command(outcome.saved)}", file=out)
