"""Replay at production scale: time and peak memory against the history's
length and the pool's size, the model against vLLM, api against strict.

    python benchmarks/scale.py [--scale K] [--lengths 1,10,100] [--units 4,16,64,256]
                               [--full-scale [--full-runs N]]
                               [--scheduler [--scheduler-block TOKENS]
                               [--scheduler-sessions N] [--cpu N]]
                               [--out DIR] [--json PATH] [--plot PATH]

Every replay is `kvgate replay` in a child process of its own, so each time
includes reading the trace and each peak memory is that process's maximum
resident set (`os.wait4`'s `ru_maxrss`); kvgate's modules are byte-compiled
first, as an installed kvgate's are (`compile_checkout`); the runs of one
measurement follow one another in one run of this script, and the ratios
compare the children's CPU time (wall time is printed beside it), so they
compare like with like on a loaded machine. The traces are the production
workload's (`kvgate workload`, hold off, vLLM 0.33.0's own behaviour):

- `full`: with `--full-scale`, the workload at full scale (unit 64, 11,326
  blocks), replayed on the model alone and on vLLM in lockstep with the
  model at levels api and strict: vLLM's strict / api and vLLM's api / the
  model's; with `--full-runs N`, each replayed N times and the run of least
  CPU time counted (each run's line printed).
- `history`: the workload divided by K (`--scale`), its day repeated N times
  for each N of `--lengths` (each day's requests renamed, so a day's
  prompts are its own), replayed on vLLM at level strict, read entry by
  entry (`--stream`): time and peak memory against the 1x run's.
- `pool`: the 1x day at each hash unit of `--units` (a finer unit, a larger
  pool), on the model and on vLLM at api and strict.
- `scheduler`: with `--scheduler`, the workload at full scale as a
  scheduler-level trace (its arrivals and engine steps), served with a
  `--scheduler-block`-token block (64: a pool of 11,326 blocks), replayed on
  kvgate's scheduler model alone and on vLLM's `Scheduler` in lockstep with
  it at levels api and strict, and at strict with the whole views compared
  after every entry (`strict-whole`: `--whole-view-every 1`), each child
  process pinned to one core (`--cpu`) and replaying as `kvgate replay`
  does: engine steps a second of the replay loop's CPU time (importing vLLM
  and building its Scheduler left out; the loop's wall time is printed
  too, which a loaded machine stretches).

Prints a table per part and the ratios; writes the numbers as JSON
(`--json`) and a plot of time and peak memory against the history's length
and the pool's size (`--plot`, with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
# Request names in a workload trace: the system prompt and sNNtMM.
_REQUEST = re.compile(r"(?<![A-Za-z0-9_-])(system|s\d+t\d+)(?![A-Za-z0-9_-])")


@dataclass(frozen=True)
class Run:
    part: str
    target: str  # model | vllm
    level: str  # api | strict
    length: int  # days of history
    unit: int
    blocks: int
    steps: int  # written steps of the trace
    trace_bytes: int
    seconds: float
    peak_mib: float
    # The child's CPU seconds (user + sys): what the ratios compare, as a
    # loaded machine's other work stretches wall time, not CPU time.
    cpu_seconds: float = 0.0
    # The scheduler part: engine steps, and the replay loop's own seconds
    # (wall) and CPU seconds (the process's, which a loaded machine's other
    # work does not add to).
    engine_steps: int = 0
    loop_seconds: float = 0.0
    loop_cpu_seconds: float = 0.0

    @property
    def engine_steps_per_second(self) -> float:
        """Engine steps a second of the loop's CPU time: on one core."""
        return self.engine_steps / self.loop_cpu_seconds if self.loop_cpu_seconds else 0.0


def workload_trace(out: Path, scale: int, unit: int) -> Path:
    """The workload's trace at the production `unit` divided by `scale`
    (hold off, upstream), served with a `unit`-token attention and Mamba
    block, as the scheduler part is: a finer unit is a larger pool (unit 64
    at full scale: 11,326 blocks); generated once."""
    from dataclasses import replace

    from kvgate.workload.deployment import Deployment
    from kvgate.workload.plan import Workload
    from kvgate.workload.progress import Progress
    from kvgate.workload.runner import Arm, write_traces

    out.mkdir(parents=True, exist_ok=True)
    found = sorted(out.glob(f"workload-*-u{unit // scale}.upstream.hold-off.yaml"))
    if found:
        return found[0]
    deployment = replace(Deployment(build="upstream"), mamba_block_size=unit).scaled(scale)
    arm = Arm(unit // scale, False)
    [path] = write_traces(Workload(), deployment, [arm], out, Progress(quiet=True))
    return path


def scheduler_trace(out: Path, block: int, sessions: int) -> Path:
    """The workload at full scale as a scheduler-level trace, served with a
    `block`-token attention and Mamba block (the hash unit), hold off,
    upstream; generated once."""
    from dataclasses import replace

    from kvgate.workload.deployment import Deployment
    from kvgate.workload.engine_trace import write_engine_trace
    from kvgate.workload.plan import Workload
    from kvgate.workload.runner import Arm

    workload = Workload(sessions=sessions)
    deployment = replace(Deployment(build="upstream"), mamba_block_size=block)
    found = sorted(out.glob(f"workload-{sessions}x*-u{block}.upstream.hold-off.engine.yaml"))
    if found:
        return found[0]
    return write_engine_trace(workload, deployment, Arm(block, False), out)


def engine_steps_of(trace: Path) -> int:
    """A scheduler-level trace's engine steps (a `steps: N` entry is N)."""
    count = 0
    with trace.open() as file:
        for line in file:
            if line.startswith("  - {op: step"):
                found = re.search(r"\bsteps: (\d+)", line)
                count += int(found.group(1)) if found else 1
    return count


def repeated(trace: Path, days: int, out: Path) -> Path:
    """`trace` with its steps repeated `days` times, day d's requests named
    `d<d>-<name>` (the first day's names kept), the pool checked clean after
    each day as after the first."""
    if days == 1:
        return trace
    path = out / f"{trace.stem}.x{days}.yaml"
    if path.exists():
        return path
    text = trace.read_text()
    head, marker, body = text.partition("\nsteps:\n")
    head = re.sub(r"(?m)^name: (.*)$", rf"name: \1-x{days}", head)
    with path.open("w") as file:
        file.write(head + marker + body)
        for day in range(1, days):
            file.write(_REQUEST.sub(rf"d{day}-\1", body))
    return path


def count_steps(trace: Path) -> int:
    with trace.open() as file:
        return sum(1 for line in file if line.startswith("  - "))


def blocks_of(trace: Path) -> int:
    with trace.open() as file:
        for line in file:
            if line.strip().startswith("num_blocks:"):
                return int(line.split(":")[1])
    raise SystemExit(f"{trace}: no num_blocks")


def replay_child(
    trace: Path,
    target: str,
    level: str,
    extra: Sequence[str] = (),
    cpu: int | None = None,
    quiet: bool = True,
) -> tuple[float, float, str, float]:
    """`kvgate replay` in a child process (pinned to `cpu` if given): (wall
    seconds, peak RSS in MiB, what it printed: with `quiet`, only the verdict,
    CPU seconds)."""
    command = [PY, "-m", "kvgate", "replay", "--target", target, "--level", level]
    command += ["--require", "none", *(("-q",) if quiet else ()), *extra, str(trace)]

    def pin() -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})

    started = time.perf_counter()
    child = subprocess.Popen(
        command,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=pin,
    )
    assert child.stdout is not None
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    child.returncode = code
    if code != 0:
        raise SystemExit(f"scale: {' '.join(command)} exited {code}:\n{output}")
    # ru_maxrss is in KiB on Linux.
    return seconds, usage.ru_maxrss / 1024, output, usage.ru_utime + usage.ru_stime


def measure(
    part: str,
    trace: Path,
    target: str,
    level: str,
    length: int,
    unit: int,
    extra: Sequence[str] = (),
) -> Run:
    seconds, peak, _, cpu = replay_child(trace, target, level, extra)
    run = Run(
        part,
        target,
        level,
        length,
        unit,
        blocks_of(trace),
        count_steps(trace),
        trace.stat().st_size,
        round(seconds, 2),
        round(peak, 1),
        round(cpu, 2),
    )
    print(
        f"  {part:<8} {target:<6} {level:<7} x{length:<4} unit {unit:<5} {run.blocks:>7} blocks "
        f"{run.steps:>9} steps {run.trace_bytes / 1e6:>8.1f} MB  {run.seconds:>8.2f} s "
        f"{run.cpu_seconds:>7.2f} s CPU {run.peak_mib:>8.1f} MiB",
        flush=True,
    )
    return run


# The scheduler part's strict level comparing the whole views after every
# engine entry (`--whole-view-every 1`), as it did before step views.
WHOLE_EACH_ENTRY = "strict-whole"


def replay_loop(trace_path: str, target: str, level: str) -> None:
    """In a child process: `trace_path` replayed as `kvgate replay` replays a
    scheduler-level trace (the same factories), its loop alone timed in wall
    and CPU seconds; prints them, and the entries run, as one JSON line."""
    from kvgate.conformance.scheduler_replay import replay_scheduler
    from kvgate.conformance.trace import load_trace
    from kvgate.targets import scheduler_factories

    trace = load_trace(trace_path)
    assert trace.scheduler is not None
    model, real_factory = scheduler_factories(target, None)
    real = None
    if real_factory is not None:
        # vLLM imported and a Scheduler built once, untimed, as the CLI does.
        real_factory(trace.config, trace.scheduler.spec, trace.scheduler.max_num_seqs).close()
        real = real_factory(trace.config, trace.scheduler.spec, trace.scheduler.max_num_seqs)
    every = 1 if level == WHOLE_EACH_ENTRY else 1000
    cpu = time.process_time()
    result = replay_scheduler(
        trace,
        model,
        real,
        "strict" if level == WHOLE_EACH_ENTRY else cast(Any, level),
        whole_view_every=every,
    )
    cpu = time.process_time() - cpu
    if real is not None:
        real.close()
    if not result.passed:
        raise SystemExit(f"{trace_path}: diverged: {result.divergence}")
    print(json.dumps({"entries": result.steps_run, "seconds": result.seconds, "cpu": cpu}))


def measure_scheduler(trace: Path, target: str, level: str, cpu: int) -> Run:
    """One scheduler-level replay pinned to `cpu`: its loop's engine steps a second."""
    command = [PY, str(Path(__file__)), "--replay-loop", str(trace), target, level]
    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as errors:
        child = subprocess.Popen(
            command,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        )
        assert child.stdout is not None
        output = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - started
        if child.returncode != 0:
            errors.seek(0)
            raise SystemExit(
                f"scale: {' '.join(command)} exited {child.returncode}:\n{errors.read()[-4000:]}"
            )
    loop = json.loads(output.strip().splitlines()[-1])
    # ru_maxrss is in KiB on Linux.
    peak = usage.ru_maxrss / 1024
    engine_steps = engine_steps_of(trace)
    run = Run(
        "scheduler",
        target,
        level,
        1,
        int(re.sub(r".*-u(\d+)\..*", r"\1", trace.name)),
        blocks_of(trace),
        int(loop["entries"]),
        trace.stat().st_size,
        round(seconds, 2),
        round(peak, 1),
        cpu_seconds=round(usage.ru_utime + usage.ru_stime, 2),
        engine_steps=engine_steps,
        loop_seconds=round(loop["seconds"], 2),
        loop_cpu_seconds=round(loop["cpu"], 2),
    )
    print(
        f"  {'scheduler':<9} {target:<6} {level:<12} unit {run.unit:<5} {run.blocks:>7} blocks "
        f"{engine_steps:>7} engine steps  loop {run.loop_seconds:>7.2f} s, "
        f"{run.loop_cpu_seconds:>7.2f} s CPU {run.engine_steps_per_second:>7.0f} steps/s  "
        f"{run.seconds:>7.2f} s {run.peak_mib:>7.1f} MiB",
        flush=True,
    )
    return run


def _env() -> dict[str, str]:
    return dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(ROOT))


def compile_checkout(checkout: Path) -> None:
    """Byte-compile `checkout`'s kvgate, as pip does for a regular install
    (and `scripts/setup.sh` for the editable one): vLLM's installed modules
    are compiled, and where PYTHONDONTWRITEBYTECODE is set a checkout's
    would be compiled again by every child, a cost no installed kvgate pays."""
    subprocess.run([PY, "-m", "compileall", "-q", str(checkout / "kvgate")], check=True)


def _find(runs: Sequence[Run], **match: Any) -> Run | None:
    return next((r for r in runs if all(getattr(r, k) == v for k, v in match.items())), None)


def ratios(runs: Sequence[Run], lengths: Sequence[int], units: Sequence[int]) -> dict[str, float]:
    """Each ratio whose two runs were made."""
    found: dict[str, float] = {}

    def ratio(name: str, field: str, top: Run | None, bottom: Run | None) -> None:
        if top is not None and bottom is not None:
            found[name] = getattr(top, field) / getattr(bottom, field)

    full = {(r.target, r.level): r for r in runs if r.part == "full"}
    ratio(
        "full: vllm strict / api (CPU time)",
        "cpu_seconds",
        full.get(("vllm", "strict")),
        full.get(("vllm", "api")),
    )
    ratio(
        "full: vllm api / model api (CPU time)",
        "cpu_seconds",
        full.get(("vllm", "api")),
        full.get(("model", "api")),
    )
    sched = {(r.target, r.level): r for r in runs if r.part == "scheduler"}
    ratio(
        "scheduler: vllm strict / api (loop CPU time)",
        "loop_cpu_seconds",
        sched.get(("vllm", "strict")),
        sched.get(("vllm", "api")),
    )
    ratio(
        "scheduler: vllm strict, whole views every entry / step views (loop CPU time)",
        "loop_cpu_seconds",
        sched.get(("vllm", WHOLE_EACH_ENTRY)),
        sched.get(("vllm", "strict")),
    )
    ratio(
        "scheduler: vllm strict / model alone (loop CPU time)",
        "loop_cpu_seconds",
        sched.get(("vllm", "strict")),
        sched.get(("model", "api")),
    )
    first = _find(runs, part="history", length=lengths[0]) if lengths else None
    for length in lengths[1:]:
        run = _find(runs, part="history", length=length)
        name = f"history: x{length} / x{lengths[0]}"
        ratio(f"{name} (peak memory)", "peak_mib", run, first)
        ratio(f"{name} (CPU time)", "cpu_seconds", run, first)
    for unit in units:
        pool = {(r.target, r.level): r for r in runs if r.part == "pool" and r.unit == unit}
        if not pool:
            continue
        blocks = next(iter(pool.values())).blocks
        ratio(
            f"pool {blocks}: vllm strict / api (CPU time)",
            "cpu_seconds",
            pool.get(("vllm", "strict")),
            pool.get(("vllm", "api")),
        )
        ratio(
            f"pool {blocks}: vllm api / model api (CPU time)",
            "cpu_seconds",
            pool.get(("vllm", "api")),
            pool.get(("model", "api")),
        )
    return found


def plot(runs: Sequence[Run], path: Path) -> bool:
    """Time and peak memory against the history's length and the pool's
    size; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    history = sorted((r for r in runs if r.part == "history"), key=lambda r: r.length)
    for row, (field, label) in enumerate((("seconds", "time (s)"), ("peak_mib", "peak (MiB)"))):
        ax = axes[row][0]
        ax.plot(
            [r.length for r in history],
            [getattr(r, field) for r in history],
            "o-",
            label="vLLM strict",
        )
        ax.set_xscale("log")
        ax.set_xlabel("history (days of the workload)")
        ax.set_ylabel(label)
        ax.legend()
        ax = axes[row][1]
        for target, level, style in (
            ("model", "api", "s-"),
            ("vllm", "api", "o-"),
            ("vllm", "strict", "^-"),
        ):
            pool = sorted(
                (r for r in runs if r.part == "pool" and r.target == target and r.level == level),
                key=lambda r: r.blocks,
            )
            ax.plot(
                [r.blocks for r in pool],
                [getattr(r, field) for r in pool],
                style,
                label=f"{'vLLM' if target == 'vllm' else 'model'} {level}",
            )
        ax.set_xscale("log")
        ax.set_xlabel("pool (blocks)")
        ax.set_ylabel(label)
        ax.legend()
    figure.suptitle("kvgate replay of the production workload (each run a process of its own)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--replay-loop"]:
        replay_loop(*sys.argv[2:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=16, help="divide the workload by K")
    parser.add_argument(
        "--lengths", default="1,10,100", help="days of history (empty: no history part)"
    )
    parser.add_argument(
        "--units",
        default="64,256,1024,4096",
        help="the production hash units of the pool part (each divided by K, as the pool; "
        "empty: no pool part)",
    )
    parser.add_argument(
        "--history-unit", type=int, default=1024, help="the production hash unit of the history"
    )
    parser.add_argument("--full-scale", action="store_true", help="also the full-scale trace")
    parser.add_argument(
        "--full-runs",
        type=int,
        default=1,
        help="replay the full-scale trace this many times on each target; the fastest counts",
    )
    parser.add_argument(
        "--model-only", action="store_true", help="replay on the model alone (no vLLM)"
    )
    parser.add_argument(
        "--scheduler",
        action="store_true",
        help="also the scheduler-level part: the workload's engine steps, each replay on one core",
    )
    parser.add_argument(
        "--scheduler-block",
        type=int,
        default=64,
        help="the scheduler part's block (and hash unit) in tokens: 64 is a pool of 11,326",
    )
    parser.add_argument(
        "--scheduler-sessions", type=int, default=9, help="the scheduler part's sessions"
    )
    parser.add_argument("--cpu", type=int, default=0, help="the core the scheduler part runs on")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "scale")
    parser.add_argument("--json", type=Path, help="write the numbers there")
    parser.add_argument("--plot", type=Path, help="write the plot there (PNG)")
    args = parser.parse_args(argv)
    # An empty list leaves its part out.
    lengths = [int(n) for n in args.lengths.split(",") if n]
    units = [int(u) for u in args.units.split(",") if u]
    runs: list[Run] = []
    compile_checkout(ROOT)
    print(f"scale: the workload divided by {args.scale}; each replay a child process")
    kinds = (
        [("model", "api")]
        if args.model_only
        else [("model", "api"), ("vllm", "api"), ("vllm", "strict")]
    )
    history = ("model", "api") if args.model_only else ("vllm", "strict")
    if args.full_scale:
        full = workload_trace(args.out / "full", 1, 64)
        if args.full_runs > 1:
            print(f"full: {args.full_runs} runs of each; the one of least CPU time counts")
        for target, level in kinds:
            tries = [measure("full", full, target, level, 1, 64) for _ in range(args.full_runs)]
            runs.append(min(tries, key=lambda run: run.cpu_seconds))
    base_unit = args.history_unit
    for length in lengths:
        day = workload_trace(args.out / f"div{args.scale}", args.scale, base_unit)
        trace = repeated(day, length, args.out / f"div{args.scale}")
        # Read entry by entry; the file is as long as the history.
        streamed = ["--stream", "--limit", f"file_bytes={trace.stat().st_size}"]
        runs.append(measure("history", trace, *history, length, base_unit, streamed))
    for unit in units:
        trace = workload_trace(args.out / f"div{args.scale}", args.scale, unit)
        for target, level in kinds:
            runs.append(measure("pool", trace, target, level, 1, unit))
    if args.scheduler:
        trace = scheduler_trace(
            args.out / "scheduler", args.scheduler_block, args.scheduler_sessions
        )
        scheduler_kinds = [*kinds, ("vllm", WHOLE_EACH_ENTRY)] if not args.model_only else kinds
        for target, level in scheduler_kinds:
            runs.append(measure_scheduler(trace, target, level, args.cpu))
    found = ratios(runs, lengths, units)
    for name, value in found.items():
        print(f"ratio {name}: {value:.2f}")
    for run in runs:
        if run.part == "scheduler":
            print(
                f"scheduler: {run.target} {run.level}: {run.engine_steps_per_second:.0f} engine "
                f"steps a second of CPU time on one core at {run.blocks} blocks"
            )
    record = {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at the end, Python {platform.python_version()}",
        "scale": args.scale,
        "runs": [
            {**asdict(r), "engine_steps_per_second": round(r.engine_steps_per_second, 1)}
            for r in runs
        ],
        "ratios": {k: round(v, 3) for k, v in found.items()},
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}" if plot(runs, args.plot) else "no plot: matplotlib missing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
