"""`kvgate workload`: the production measurement, reproduced on a target.

    kvgate workload [--target vllm|model|vllm-scheduler] [--units 64,256,512,1024,4096]
                    [--hold both|on|off] [--build fork|upstream] [--no-enable-prefix-caching]
                    [--kv-connector [--kv-connector-divergent-hits]
                     [--kv-load-failure-policy recompute|fail]]
                    [--sessions N] [--turns T] [--seed S]
                    [--scale K] [--out DIR] [--level api|strict]
                    [--overlay | --plugin MODULE]

Writes one trace per unit x hold arm into DIR, replays each on the target
(with the model in lockstep against vLLM), prints the table, and writes
`<stem>.png` (the plot) and `<stem>.json` (the numbers) next to the traces.
Exit 0 when every arm that ran replayed without a divergence, 1 otherwise, 2
for bad input or when no arm can run on the target (told before any trace
is written). An arm the target cannot run (a hold-on arm without the hold,
a `--build fork` arm without retired-state retention) is not run, and the
table says so: pass `--overlay` for vLLM. `--build`
follows the target unless given: upstream for vLLM without a plugin, fork
otherwise.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from kvgate import options
from kvgate.conformance.replay import LEVELS, Level
from kvgate.conformance.report import capabilities_line
from kvgate.errors import InputError
from kvgate.targets import SCHEDULER_TARGETS
from kvgate.vocabulary.config import KV_LOAD_FAILURE_POLICIES, Config, UnsupportedConfig
from kvgate.vocabulary.scheduling import SchedulerTarget
from kvgate.vocabulary.schema import config_default
from kvgate.vocabulary.target import StepRefused, Target
from kvgate.workload import report
from kvgate.workload.deployment import BUILDS, Deployment
from kvgate.workload.generator import WorkloadStuck
from kvgate.workload.lockstep import SchedulerFactory, scheduler_arm
from kvgate.workload.plan import Workload
from kvgate.workload.progress import Progress
from kvgate.workload.runner import (
    Arm,
    ArmResult,
    factories,
    lacking_capability,
    replay_arm,
    write_traces,
)

DEFAULT_UNITS = "64,256,512,1024,4096"
DEFAULT_OUT = Path("out/workload")
# The flags' ranges. Sessions x turns at most 16 x 16 keeps a full-size
# arm's trace within the trace limits (kvgate.conformance.limits: prompt
# tokens summed); the scale and the units only divide token counts.
FLAG_RANGES: dict[str, tuple[int, int]] = {
    "sessions": (1, 16),
    "turns": (1, 16),
    "seed": (0, 2**63 - 1),
    "scale": (1, 4096),
    "tenants": (1, 16),
}
MAX_UNIT = 2**20


def add_workload_arguments(parser: argparse.ArgumentParser, scale: int, units: str) -> None:
    """The workload's own flags (sessions, turns, seed, scale, units, build),
    shared by `kvgate workload` and the workload benchmarks."""
    defaults = Workload()
    parser.add_argument(
        "--units",
        default=units,
        help=f"default {units} (kvgate workload --deployment: the deployment's hash unit)",
    )
    parser.add_argument(
        "--build",
        choices=BUILDS,
        help="fork: the production build, which retains retired states; upstream: vLLM "
        "0.33.0 as released (default: follows the target: upstream for a vLLM target "
        "without --plugin, which keeps no retired state, fork otherwise)",
    )
    parser.add_argument(
        "--kv-connector",
        action="store_true",
        help="serve with a KV connector (an offloading store) beside the prefix cache: each "
        "request's external hit drawn (none, sync or async, some superseding a local "
        "sub-block tail), every lookup running the Scheduler's connector branch; off by "
        "default (the workload as measured)",
    )
    parser.add_argument(
        "--kv-connector-divergent-hits",
        action="store_true",
        help="with --kv-connector: the connector restores lagging Mamba states "
        "(supports_divergent_local_hybrid_hits, as NIXL's), so the local lookup is per group",
    )
    parser.add_argument(
        "--kv-load-failure-policy",
        default=config_default("kv_load_failure_policy"),
        choices=KV_LOAD_FAILURE_POLICIES,
        help="with --kv-connector, as vLLM's flag: recompute (default) looks a request up again "
        "after its async load failed; fail ends it with an error (the session's next turn "
        "still arrives)",
    )
    parser.add_argument(
        "--no-enable-prefix-caching",
        action="store_true",
        help="serve without prefix caching, as vLLM's flag: Mamba in cache mode none, its "
        "block max_model_len long (as vLLM's engine config resolves them); every hold and "
        "retention then holds nothing",
    )
    seed = Deployment()
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=seed.gpu_memory_gib,
        metavar="GIB",
        help="each GPU's memory, which no serve flag says",
    )
    parser.add_argument(
        "--weights-gib",
        type=float,
        default=seed.weights_gib,
        metavar="GIB",
        help="the model's weights over all GPUs, which no serve flag says (the default: an "
        "80B-parameter MoE at about 4.4 bits a weight)",
    )
    parser.add_argument(
        "--runtime-overhead-gib",
        type=float,
        default=seed.runtime_overhead_gib,
        metavar="GIB",
        help="each GPU's activations, CUDA graphs and buffers",
    )
    parser.add_argument("--sessions", type=int, default=defaults.sessions)
    parser.add_argument("--turns", type=int, default=defaults.turns)
    options.add_seed(parser, defaults.seed, "sessions are drawn from seed N")
    parser.add_argument(
        "--tenants",
        type=int,
        default=defaults.tenants,
        help="sessions belong to N tenants in turn, each turn carrying its tenant's "
        "cache_salt (no state is shared across tenants, the system prompt included); "
        "default 1: no salt",
    )
    parser.add_argument(
        "--scale",
        type=int,
        default=scale,
        help="divide every token count (prompts, outputs, units, Mamba block, budget, pool) "
        "and step duration by K, for a quick run",
    )


def default_build(target: str, plugin: str | None) -> str:
    """The build `--build` defaults to: the fork's retained retired states
    need retention, which vLLM has only with a plugin (the hold overlay)."""
    return "upstream" if target.startswith("vllm") and plugin is None else "fork"


def workload_of(args: argparse.Namespace) -> tuple[Workload, Deployment]:
    """The workload and the (scaled) deployment the shared flags describe;
    sets `args.build` when it was left to follow the target."""
    if args.build is None:
        args.build = default_build(getattr(args, "target", "model"), getattr(args, "plugin", None))
    workload = Workload(
        sessions=args.sessions, turns=args.turns, seed=args.seed, tenants=args.tenants
    )
    if args.kv_connector_divergent_hits and not args.kv_connector:
        raise InputError("--kv-connector-divergent-hits: needs --kv-connector")
    if args.kv_load_failure_policy != config_default("kv_load_failure_policy") and not (
        args.kv_connector
    ):
        raise InputError("--kv-load-failure-policy: needs --kv-connector")
    for flag in ("gpu_memory_gib", "weights_gib", "runtime_overhead_gib"):
        if not 0 <= getattr(args, flag) < 1 << 20:
            raise InputError(f"--{flag.replace('_', '-')}: {getattr(args, flag)} is not a size")
    deployment = Deployment(
        build=args.build,
        kv_connector=args.kv_connector,
        kv_connector_divergent_hits=args.kv_connector_divergent_hits,
        kv_load_failure_policy=args.kv_load_failure_policy,
        prefix_caching=not args.no_enable_prefix_caching,
        gpu_memory_gib=args.gpu_memory_gib,
        weights_gib=args.weights_gib,
        runtime_overhead_gib=args.runtime_overhead_gib,
    )
    if getattr(args, "deployment", None) is not None:
        deployment = served_deployment(args, deployment)
    return workload, deployment.scaled(args.scale)


def served_deployment(args: argparse.Namespace, base: Deployment) -> Deployment:
    """`base` with everything a serve command line says replaced by what
    vLLM resolves it to (`kvgate deployment`): the GPUs, the utilization,
    the layers and their pages per GPU, the served block, the drafts and
    their lookahead hashes, the budget, max_num_seqs, max_model_len, prefix
    caching and the retention; sets `args.units` to its hash unit unless
    given. The memory no flag says stays `base`'s (the options above)."""
    # Only here: resolving a serve command line needs vLLM.
    from kvgate.impl.serve_flags import resolve, serve_args

    options.check_serving_machine(args)
    resolved = resolve(
        serve_args(list(args.deployment)),
        64,
        args.assume_attention_backend,
        args.assume_checkpoint_alignment,
    )
    config, served, values = resolved.config, resolved.served, resolved.values
    if config is None or served is None:
        raise InputError(
            "--deployment: kvgate's workload needs a hybrid model (attention and Mamba layers)"
        )
    if args.units is None:
        args.units = str(config.hash_unit)
    return replace(
        base,
        gpus=int(values["GPUs"]),
        gpu_memory_utilization=float(values["GPU memory utilization"]),
        attention_layers=int(values["attention layers"]),
        mamba_layers=int(values["mamba layers"]),
        attention_page_per_token=served.attention_page_bytes_per_token,
        mamba_page_bytes=served.mamba_page_bytes,
        mamba_block_size=config.scheduler_block_size,
        spec_tokens=int(values["drafts"]),
        eagle=config.eagle,
        hash_lookahead_tokens=config.hash_lookahead_tokens,
        retention_interval=config.retention_interval,
        max_num_scheduled_tokens=config.max_num_scheduled_tokens,
        max_num_seqs=int(values["max_num_seqs"]),
        max_model_len=config.max_model_len,
        prefix_caching=config.prefix_caching,
        served_from=str(values["model"]),
    )


def register(subparsers: Any) -> None:
    cmd = subparsers.add_parser(
        "workload",
        help="multi-turn agent load: misses by prefix-match unit, hold on/off",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    options.add_target(
        cmd,
        ("model", "vllm", *SCHEDULER_TARGETS),
        "vllm",
        "model; vllm: vLLM's KVCacheManager replaying the traces; vllm-scheduler: "
        "vLLM's real Scheduler run beside kvgate's scheduler model",
    )
    add_workload_arguments(cmd, scale=1, units=DEFAULT_UNITS)
    # Left unset so that --deployment can tell a unit given from the default.
    cmd.set_defaults(units=None)
    options.add_hold(cmd, "both", "the arms to run")
    options.add_out(cmd, DEFAULT_OUT, "where the traces, the plot and the numbers go")
    options.add_level(cmd, LEVELS, "api")
    options.add_overlay(cmd)
    options.add_plugin(cmd)
    options.add_serving_machine(cmd)
    cmd.add_argument(
        "--deployment",
        nargs=argparse.REMAINDER,
        metavar="SERVE-ARGS",
        help="measure at the deployment this vllm serve command line resolves to (the rest "
        "of the command line: MODEL-DIR [FLAG...]): its GPUs, utilization, layers, served "
        "blocks, drafts, budget, max_num_seqs and max_model_len from vLLM's resolution, "
        "--units its hash unit unless given; the memory no flag says from --gpu-memory-gib, "
        "--weights-gib, --runtime-overhead-gib",
    )
    cmd.set_defaults(handler=run)


def _units(text: str, scale: int) -> list[int]:
    parts = text.split(",")
    if not all(p.strip().isascii() and p.strip().isdigit() and len(p.strip()) < 10 for p in parts):
        raise InputError(f"--units: {text[:40]!r} is not a comma-separated list of integers")
    units = [int(u) for u in parts]
    for unit in units:
        if unit < 1 or unit % scale:
            raise InputError(f"--units: {unit} is not a positive multiple of --scale {scale}")
        if unit > MAX_UNIT:
            raise InputError(f"--units: {unit} is more than {MAX_UNIT}")
    return sorted({u // scale for u in units})


def _check_out(out: Path) -> None:
    """`--out` is a directory kvgate can create and write in, checked before
    minutes of generation: not an existing file, not inside /proc."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out: {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".kvgate-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise InputError(f"--out: cannot write in {out}: {error.strerror}") from None


def run(args: argparse.Namespace) -> int:
    from kvgate.targets import LOCKSTEP_MODEL, target_factory

    args.plugin = options.plugin_of(args)
    if args.plugin is not None and not args.target.startswith("vllm"):
        raise InputError("--plugin: only the vLLM targets load plugins")
    level: Level = args.level
    for flag, (low, high) in FLAG_RANGES.items():
        value = getattr(args, flag)
        if not low <= value <= high:
            raise InputError(f"--{flag}: {value} is outside {low}..{high}")
    _check_out(args.out)
    try:
        workload, deployment = workload_of(args)
        units = _units(args.units or DEFAULT_UNITS, args.scale)
        arms = [Arm(u, h) for u in units for h in options.hold_values(args.hold)]
        for arm in arms:
            deployment.config(arm.unit, arm.hold, workload.sessions)
    except ValueError as error:
        raise InputError(str(error)) from None
    progress = Progress(quiet=options.quiet(args))
    if args.target in SCHEDULER_TARGETS:
        scheduler = cast(SchedulerFactory, target_factory(args.target))
        if args.plugin is not None:
            scheduler = functools.partial(scheduler, plugin=args.plugin)
        _check_some_arm_runs(
            args.target,
            arms,
            lambda config: scheduler(
                config, spec_tokens=deployment.spec_tokens, max_num_seqs=deployment.max_num_seqs
            ),
            deployment,
            workload,
        )
        try:
            results = [
                scheduler_arm(workload, deployment, arm, scheduler, args.out, level, progress)
                for arm in arms
            ]
        except WorkloadStuck as error:
            raise InputError(str(error)) from None
        except StepRefused as refused:  # a session outgrows the deployment
            raise InputError(f"the workload does not fit the deployment: {refused}") from None
        except OSError as error:
            raise InputError(f"--out: cannot write in {args.out}: {error.strerror}") from None
    else:
        factory, model = factories(target_factory, args.target, args.plugin, LOCKSTEP_MODEL)
        _check_some_arm_runs(args.target, arms, factory, deployment, workload)
        try:
            paths = write_traces(workload, deployment, arms, args.out, progress)
        except WorkloadStuck as error:
            raise InputError(str(error)) from None
        except StepRefused as refused:  # a session outgrows the deployment
            raise InputError(f"the workload does not fit the deployment: {refused}") from None
        except OSError as error:
            raise InputError(f"--out: cannot write in {args.out}: {error.strerror}") from None
        results = [
            replay_arm(path, arm, factory, model, level, progress)
            for arm, path in zip(arms, paths, strict=True)
        ]

    if all(r.skipped for r in results):
        # Nothing replayed is nothing measured: not a pass.
        raise InputError(f"--target {args.target}: no arm can run: {results[0].skipped}")

    scale = f"-div{args.scale}" if args.scale > 1 else ""
    stem = args.out / (
        f"workload-{workload.sessions}x{workload.turns}-seed{workload.seed}{scale}-{args.build}"
        + ("-kv-connector" if args.kv_connector else "")
        + deployment.connector_tags()
        + ("-no-prefix-caching" if args.no_enable_prefix_caching else "")
    )
    # The header names the hold implementation when a hold-on arm ran.
    replays = sorted(
        (r.replay for r in results if r.replay is not None),
        key=lambda replay: not replay.capabilities.hold,
    )
    target_line = (
        capabilities_line(replays[0].capabilities) if replays else f"target: {args.target}"
    )
    title = (
        f"{workload.sessions} sessions x {workload.turns} turns, seed {workload.seed}"
        + (f", tokens / {args.scale}" if args.scale > 1 else "")
        + f", build {args.build}"
        + f" -- {target_line.removeprefix('target: ')}, level {level}"
    )
    lines = [
        f"kvgate workload: {title}",
        *deployment.describe(tuple(units), workload.sessions),
        "",
        *report.table_lines(results),
        "",
        *report.LEGEND,
        *report.divergence_report(results),
    ]
    print("\n".join(lines), flush=True)
    written = [stem.with_suffix(".json")]
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "no plot: matplotlib is not installed (pip install 'kvgate[workload]')", file=sys.stderr
        )
    else:
        report.plot(results, stem.with_suffix(".png"), title)
        written.insert(0, stem.with_suffix(".png"))
    report.write_summary(
        stem.with_suffix(".json"),
        report.summary(
            results,
            {
                "target": target_line,
                "level": level,
                "sessions": workload.sessions,
                "turns": workload.turns,
                "seed": workload.seed,
                "scale": args.scale,
                "build": args.build,
                "deployment": deployment.describe(tuple(units), workload.sessions),
            },
        ),
    )
    print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0 if all(_passed(r) for r in results) else 1


def _check_some_arm_runs(
    target: str,
    arms: list[Arm],
    build: Callable[[Config], Target | SchedulerTarget],
    deployment: Deployment,
    workload: Workload,
) -> None:
    """Before any generation: build the target once per hold arm (the same
    capabilities at every unit) and refuse, in one line, when it can run
    none of the arms (e.g. the fork's retained states on vLLM without the
    overlay), rather than after minutes of writing traces."""
    reasons: list[str] = []
    for hold in sorted({arm.hold for arm in arms}):
        config = deployment.config(arms[0].unit, hold, workload.sessions)
        try:
            built = build(config)
        except UnsupportedConfig as error:
            raise InputError(
                f"--target {target}: cannot run config.{error.field}: {error.message}"
            ) from None
        try:
            lacking = lacking_capability(config, built.capabilities)
        finally:
            built.close()
        if not lacking:
            return
        reasons.append(f"{built.capabilities.implementation} {lacking}")
    raise InputError(f"--target {target}: no arm can run: {reasons[0]}")


def _passed(result: ArmResult) -> bool:
    return result.replay is None or result.replay.passed
