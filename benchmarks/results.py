"""Regenerate docs/results.md: every number the docs publish, produced by the code.

    python benchmarks/results.py [SECTION ...]      (default: every section)
    python benchmarks/results.py --check [SECTION ...]
    python benchmarks/results.py --list

Each section runs the project's own commands against the installed vLLM and
replaces its part of docs/results.md (between `<!-- results: NAME -->` and
`<!-- end: NAME -->`), stamped with the date, the exact commands and the
machine; the other sections are kept as they were. Some sections take many
minutes (see --list), so regenerate one at a time when only one changed.

`--check` reruns the sections and compares what they print with the page
instead of writing it: timings are masked (they depend on the machine and its
load), every count and verdict must be the same. It exits 1 naming each
section that drifted, with the lines that differ.
"""

from __future__ import annotations

import argparse
import difflib
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kvgate.mutate.faults import DRAFT_AREAS

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results.md"
PY = sys.executable

HEADER = """# Results

Every number on this page was printed by the command shown above it, on the
machine named there; none is typed by hand. To regenerate the whole page run
`python benchmarks/results.py`, or one section with
`python benchmarks/results.py SECTION` (`--list` names them and says how long
each takes). Timings depend on the machine and its load; counts and verdicts
do not: `python benchmarks/results.py --check SECTION` reruns a section and
says whether any of them has drifted from this page.
"""


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    cost: str  # how long it takes on a 2-core machine, for --list
    commands: tuple[str, ...]  # shell commands, run from the checkout
    render: Callable[[list[str]], str]  # outputs -> markdown body
    about: str  # one paragraph saying what the numbers are
    # The rendered output with what depends on the machine masked, for --check.
    stable: Callable[[str], str] = lambda text: text


def summary_lines(output: str) -> list[str]:
    """The lines of a gate run a reader needs: target, capabilities, verdict, counts."""
    keep = re.compile(r"^(target:|difference |lacks |verdict:|\d+ passed|exit )")
    return [line for line in output.splitlines() if keep.match(line)]


def fenced(lines: Sequence[str]) -> str:
    return "```text\n" + "\n".join(lines).rstrip() + "\n```\n"


def render_gate(outputs: list[str]) -> str:
    return "\n".join(fenced(summary_lines(output)) for output in outputs)


def render_tail(lines: int) -> Callable[[list[str]], str]:
    def render(outputs: list[str]) -> str:
        return "\n".join(fenced(o.rstrip().splitlines()[-lines:]) for o in outputs)

    return render


def render_from(first: str) -> Callable[[list[str]], str]:
    """Each output from its last line matching `first` to the end."""

    def render(outputs: list[str]) -> str:
        blocks = []
        for output in outputs:
            lines = output.rstrip().splitlines()
            starts = [i for i, line in enumerate(lines) if re.match(first, line)]
            blocks.append(fenced(lines[starts[-1] if starts else 0 :]))
        return "\n".join(blocks)

    return render


def render_whole(outputs: list[str]) -> str:
    return "\n".join(fenced(o.rstrip().splitlines()) for o in outputs)


def render_summary(outputs: list[str]) -> str:
    """A fault campaign's summary: its baseline and the lines after the table."""
    lines = outputs[0].rstrip().splitlines()
    baseline = [
        line for line in lines if line.startswith(("baseline", "  ")) and "caught" not in line
    ]
    start = next((i for i, line in enumerate(lines) if line.startswith("kill rate")), len(lines))
    return fenced(baseline + [""] + lines[start:])


SECONDS = re.compile(r"\d+\.\d+")


def mask_seconds(text: str) -> str:
    """Every decimal number masked: in these outputs they are timings,
    averages and the percentages derived from counts that stay unmasked."""
    return SECONDS.sub("#", text)


def mask_campaign(text: str) -> str:
    """A fault campaign's output with its timings masked, and what depends on
    the machine rather than on vLLM and kvgate: the job count, vLLM's warnings."""
    text = re.sub(r"\d+ job\(s\)", "# job(s)", mask_seconds(text))
    return re.sub(r"^vLLM logged .*$", "vLLM logged #", text, flags=re.M)


def mask_benchmarks(text: str) -> str:
    """Decimals masked, and every number of a per-target timing row
    (`model`, `vllm`, `ratio`, `import`, a corpus row): counts elsewhere stay."""
    lines = []
    for line in mask_seconds(text).splitlines():
        if re.match(r"^\s*(calls:|\+snapshots:|model |vllm |ratio |import |Scheduler calls)", line):
            line = re.sub(r"\d+", "#", line)
        elif re.match(r"^(scheduler-level|manager-level)\s+\d+", line):
            name, traces, _rest = line.split(None, 2)
            line = f"{name} {traces} #"
        lines.append(line)
    return "\n".join(lines)


SECTIONS: tuple[Section, ...] = (
    Section(
        "gate",
        "The gate on the bundled corpus",
        "about 1 minute",
        (
            f"{PY} -m kvgate gate --target vllm",
            f"{PY} -m kvgate gate --target vllm --plugin kvgate.impl.hold_overlay",
        ),
        render_gate,
        "The installed vLLM gated on the bundled corpus at strict level, first as it is, "
        "then with kvgate's hold overlay loaded. Upstream vLLM lacks the hold, so a trace "
        "that asks for it gets the verdict LACKS there; the second run shows what the "
        "hold changes.",
    ),
    Section(
        "mutate",
        "The fault campaign",
        "about 11 minutes",
        (f"{PY} -m kvgate mutate --target vllm --timeout 1800",),
        render_whole,
        "One realistic one-line fault at a time injected into the installed vLLM's "
        "KV-cache manager, and the gate run against each: a row per fault (caught or not, "
        "by what), then the kill rate, the share of applicable faults the gate catches. "
        "`kvgate mutate --list` says what each fault edits and why it is realistic.",
        stable=mask_campaign,
    ),
    Section(
        "kill-rates",
        "Kill rates by stage",
        "over an hour (the exploration runs against every fault)",
        (f"{PY} -m kvgate mutate --target vllm --explore-every-fault --timeout 1800",),
        render_summary,
        "The same faults, with the differential exploration run against every fault too, "
        "so each stage's kill rate is known alone: the corpus (traces at strict level plus "
        "the invariants) and the exploration without any trace.",
        stable=mask_campaign,
    ),
    Section(
        "coverage",
        "Reach into vLLM's manager and Scheduler",
        "about 8 minutes, and an hour more the first time (vLLM's own scheduler tests)",
        ("KVGATE_OWN_COLUMNS=scheduler bash scripts/coverage-report.sh out/results-coverage",),
        render_from(r"\s+kvgate \(gate"),
        "Line and branch coverage of vLLM's block pool, KV-cache manager, coordinator, "
        "Mamba manager and the Scheduler's KV paths (the methods of its `Scheduler` class "
        "that touch the KV-cache manager or a request's computed or cached tokens; the "
        "line after the table names them and those left out), reached by kvgate (the corpus "
        "gate at strict level plus the manager-level and Scheduler-level explorations, ci "
        "profile), by the Scheduler-level gate alone, by the Scheduler-level exploration "
        "(ci profile), and by vLLM's own scheduler tests (the files of its test suite "
        "that build a Scheduler, as the fault campaign runs them). vLLM's column depends "
        "only on the installed vLLM, so it is run once and then reused; the last line "
        "says when. vLLM's own manager tests (another hour) are left out here; "
        "`scripts/coverage-report.sh` without `KVGATE_OWN_COLUMNS` adds them.",
    ),
    Section(
        "benchmarks",
        "Benchmark ratios",
        "about 10 minutes",
        (
            f"{PY} benchmarks/replay_speed.py --rounds 3",
            f"{PY} benchmarks/workload.py --scale 16",
            f"{PY} benchmarks/recorder_overhead.py --runs 3",
            f"{PY} benchmarks/gate_cost.py",
        ),
        render_whole,
        "Ratios measured within one run, so the machine's speed cancels out: the corpus "
        "replayed on the model against vLLM (below 1: the model is faster), the "
        "production workload on each target alone (time and peak memory), the "
        "recorder's own time inside vLLM's Scheduler calls against the Scheduler's time in "
        "them, measured in the same calls while one recorded workload is replayed, over "
        "many rounds (min, median, max; the floor is what the timing itself costs), the "
        "whole measurement made three times, each in a process of its own as three "
        "regenerations of this page would make it, and how far apart the three medians "
        "are against each run's own spread; and "
        "what each bundled corpus costs a gate run (wall and CPU time, vLLM imported once).",
        stable=mask_benchmarks,
    ),
    Section(
        "corpus-memory",
        "A gate's memory over a corpus of long traces",
        "about a minute",
        (f"{PY} benchmarks/corpus_memory.py",),
        render_whole,
        "The gate's peak resident memory (each run a process of its own, on kvgate's model) "
        "over a corpus holding one long manager-level trace and over one holding several "
        "copies of it, for a trace written one step a line (read as it replays) and for one "
        "in another form (read whole when it runs, after every trace was checked): the "
        "ratio near 1 says the gate holds one trace at a time, not the corpus.",
        stable=mask_seconds,
    ),
    Section(
        "served-overhead",
        "Recorder overhead on a served engine",
        "seconds (it prints the record; measuring it again takes about 10 minutes)",
        (f"{PY} benchmarks/served_overhead.py --render",),
        render_whole,
        "Tokens per second of vLLM's OpenAI server (the registry's CPU build, the tiny "
        "Qwen3-Next of the served end-to-end test) with the recorder on against off, the "
        "same load run several times on each, the two arms interleaved, engine start-up "
        "not timed. The numbers come from the record benchmarks/served_overhead.json, "
        "written by the measurement itself (`bash scripts/served-env.sh`, then "
        "`.venvs/served/bin/python benchmarks/served_overhead.py`); the command below "
        "prints that record. Each arm's min, median and max show the spread between its "
        "runs, which the machine's load sets as much as the recorder does.",
        stable=mask_benchmarks,
    ),
    Section(
        "hunting",
        "Hunting for vLLM defects",
        "about 10 minutes",
        (f"{PY} benchmarks/hunting.py",),
        render_whole,
        "A long exploration on stock vLLM, as a routine hunt for defects in vLLM itself: "
        "whole engine steps on vLLM's real Scheduler in lockstep with kvgate's scheduler "
        "model, over the deployment families it draws, then manager calls on vLLM's "
        "KV-cache manager in lockstep with kvgate's model, each for a fixed time. The "
        "counts are one run's, kept in `findings/hunting.json` (`python "
        "benchmarks/hunting.py --render` prints them again): examples, steps (engine "
        "steps at the Scheduler level), divergences on stock vLLM, and the known vLLM "
        "defects ([known vLLM defects](findings.md)) the run reached and explored past. "
        "Each divergence is triaged into a new finding or a fix of kvgate's model.",
    ),
    Section(
        "matrix",
        "Other vLLM releases",
        "about 10 minutes, plus downloading two vLLM wheels the first time",
        ('KVGATE_SKIP_SETUP=1 KVGATE_MATRIX_RUNS="gate overlay" bash scripts/vllm-matrix.sh',),
        render_tail(6),
        "The gate, without and with the hold overlay, on each vLLM release a user may "
        "deploy (each in its own environment sharing the pinned dependencies), on both "
        "corpora, manager-level and Scheduler-level, on CPU. A `known "
        "difference` is a failure kvgate has traced to a change between releases; the "
        "gate's report explains each under the failing trace, and "
        "[gate another release](how-to/gate-another-release.md) lists them with the "
        "upstream change. The fault campaign and vLLM's own tests per release are left "
        "out here; `scripts/vllm-matrix.sh` runs them by default.",
    ),
)


# -- the scale section --------------------------------------------------------
# Its own block: `benchmarks/scale.py` writes its numbers and plot beside the
# page, and the section shows its output with the plot under it.

SCALE_JSON = "docs/results/scale.json"
SCALE_PLOT = "docs/results/scale.png"


def render_scale(outputs: list[str]) -> str:
    plot = Path(ROOT / SCALE_PLOT)
    image = f"\n![Time and peak memory against history and pool]({SCALE_PLOT[5:]})\n"
    return render_whole(outputs) + (image if plot.exists() else "")


def mask_scale(text: str) -> str:
    """Every number of a timing, memory or ratio line masked: the counts of
    blocks and steps stay."""
    lines = []
    for line in mask_seconds(text).splitlines():
        if line.startswith("ratio "):
            line = re.sub(r": .*$", ": #", line)
        elif re.match(r"^\s+(full|history|pool)\s", line):
            line = re.sub(r"\S+ MB .*$", "# MB # s # MiB", line)
        elif re.match(r"^\s+scheduler\s", line):
            masked = "engine steps loop # s, # s CPU # steps/s # s # MiB"
            line = re.sub(r"engine steps .*$", masked, line)
        elif line.startswith("scheduler: "):
            line = re.sub(r": \d+ engine steps", ": # engine steps", line)
        lines.append(line)
    return "\n".join(lines)


SCALE_SECTION = Section(
    "scale",
    "Replay at production scale",
    "about 20 minutes",
    (
        f"{PY} benchmarks/scale.py --full-scale --full-runs 3 --scheduler --scale 64 "
        f"--json {SCALE_JSON} "
        f"--plot {SCALE_PLOT}",
    ),
    render_scale,
    "The production workload's traces replayed by `kvgate replay`, each run a process of "
    "its own (its time includes importing vLLM and reading the trace; its peak memory is "
    "the process's maximum resident set): the full-scale trace on the model alone and on "
    "vLLM in lockstep with the model at levels api and strict (three runs of each, the "
    "fastest in CPU time counted); the workload's day repeated "
    "into a longer history at level strict (read entry by entry); the pool's size "
    "from the coarsest hash unit to the finest; and the workload as a scheduler-level "
    "trace served with the finest hash unit's block (its pool's size on each line), on "
    "kvgate's scheduler model alone and on vLLM's `Scheduler` in lockstep with it at "
    "levels api and strict, each process on one core, in engine steps a second of the "
    "replay's loop. The numbers are also in "
    "`docs/results/scale.json`.",
    stable=mask_scale,
)


# The faults of async scheduling with drafts, beside vLLM's own tests.
DRAFT_FAULTS_SECTION = Section(
    "draft-faults",
    "Faults of async scheduling with drafts: the gate beside vLLM's own tests",
    "about an hour (vLLM's own tests run once per fault)",
    (
        f"{PY} -m kvgate mutate --target vllm --suite both --timeout 3600 --areas "
        + " ".join(f'"{area}"' for area in DRAFT_AREAS),
    ),
    render_whole,
    "The fault classes of an engine under async scheduling with drafts (outputs in "
    "flight, rejected drafts taken back, draft-aware prefix hits, the align-mode chunk "
    "split with the drafter's block drop), each fault run against the gate and, in a "
    "pytest session of its own, against vLLM's own manager and Scheduler tests "
    "(its async scheduler tests among them): a row per fault with what caught it in each "
    "column.",
    stable=mask_campaign,
)

SECTIONS = (*SECTIONS, SCALE_SECTION, DRAFT_FAULTS_SECTION)


def machine() -> str:
    def vllm_version() -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("vllm")
        except PackageNotFoundError:
            return "not installed"

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    load = os.getloadavg()[0]
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {load:.1f} at the start), Python {platform.python_version()}, "
        f"vLLM {vllm_version()}, kvgate at commit {commit or 'unknown'}"
    )


@dataclass(frozen=True)
class Run:
    """What a section's commands printed, and where and when."""

    outputs: list[str]
    started: datetime
    seconds: float
    where: str


def run_commands(section: Section) -> Run:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(ROOT))
    started = datetime.now(timezone.utc)
    where = machine()
    outputs: list[str] = []
    seconds = 0.0
    for command in section.commands:
        print(f"results: {section.name}: {command}", file=sys.stderr, flush=True)
        clock = time.perf_counter()
        done = subprocess.run(
            command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True
        )
        seconds += time.perf_counter() - clock
        # vLLM's own log lines go to stderr: shown only when the command failed.
        errors = done.stderr.strip().splitlines()[-5:] if done.returncode else []
        text = "\n".join([done.stdout.rstrip(), *errors, f"exit {done.returncode}"])
        # Paths inside the checkout as a reader's checkout names them.
        outputs.append(text.replace(f"{ROOT}/", ""))
    return Run(outputs, started, seconds, where)


def run_section(section: Section) -> str:
    run = run_commands(section)
    commands = "\n".join(f"    {c.replace(PY, 'python')}" for c in section.commands)
    return (
        f"## {section.title}\n\n{section.about}\n\n"
        f"Generated {run.started:%Y-%m-%d %H:%M} UTC in {run.seconds:.0f} s on {run.where}, by:\n\n"
        f"{commands}\n\n{section.render(run.outputs)}"
    )


FENCE = re.compile(r"^```text\n(.*?)^```$", re.S | re.M)


def printed(section: Section, body: str) -> list[str]:
    """The lines of a section's fenced outputs, machine-dependent parts masked."""
    return section.stable("".join(FENCE.findall(body))).splitlines()


def check_section(section: Section, page_body: str | None) -> list[str]:
    """Rerun `section`; the differences from the page (empty: no drift)."""
    if page_body is None:
        return [f"results: docs/results.md has no section {section.name!r}"]
    now = printed(section, section.render(run_commands(section).outputs))
    published = printed(section, page_body)
    if now == published:
        return []
    diff = difflib.unified_diff(published, now, "docs/results.md", "now", n=0, lineterm="")
    return [
        f"results: section {section.name!r} drifted from docs/results.md; regenerate it "
        f"with: python benchmarks/results.py {section.name}",
        *list(diff)[2:],
    ]


BLOCK = re.compile(r"<!-- results: (\S+) -->\n(.*?)\n<!-- end: \1 -->", re.S)


def page_sections(page: str) -> dict[str, str]:
    """The sections docs/results.md holds: name -> generated markdown."""
    return {m.group(1): m.group(2) for m in BLOCK.finditer(page)}


def assemble(bodies: dict[str, str]) -> str:
    """The page: the header, then each generated section in SECTIONS' order."""
    blocks = [
        f"<!-- results: {s.name} -->\n{bodies[s.name].rstrip()}\n<!-- end: {s.name} -->"
        for s in SECTIONS
        if s.name in bodies
    ]
    return "\n\n".join([HEADER.rstrip(), *blocks]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", metavar="SECTION")
    parser.add_argument("--list", action="store_true", help="name the sections and their cost")
    parser.add_argument(
        "--check", action="store_true", help="rerun and compare with the page; write nothing"
    )
    args = parser.parse_args(argv)
    by_name = {s.name: s for s in SECTIONS}
    if args.list:
        for s in SECTIONS:
            print(f"{s.name:<12} {s.title} ({s.cost})")
        return 0
    unknown = [n for n in args.sections if n not in by_name]
    if unknown:
        print(f"results: unknown section {unknown[0]!r}; known: {', '.join(by_name)}")
        return 2
    chosen = [by_name[n] for n in args.sections] if args.sections else list(SECTIONS)
    bodies = page_sections(PAGE.read_text(encoding="utf-8")) if PAGE.exists() else {}
    if args.check:
        drifted = [line for s in chosen for line in check_section(s, bodies.get(s.name))]
        print("\n".join(drifted) or f"results: no drift in {', '.join(s.name for s in chosen)}")
        return 1 if drifted else 0
    for section in chosen:
        bodies[section.name] = run_section(section)
        # Written after each section, so a long run keeps what it finished.
        with tempfile.NamedTemporaryFile("w", dir=PAGE.parent, delete=False) as tmp:
            tmp.write(assemble(bodies))
        Path(tmp.name).replace(PAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
