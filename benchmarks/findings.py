"""Write docs/findings.md: each known vLLM defect, reproduced on each release checked.

Each folder under findings/ holds one defect kvgate found in vLLM itself: its
description (finding.yaml), a standalone reproduction that needs only vLLM
(repro.py) and the kvgate trace it came from (trace.yaml). This script runs
every reproduction on every release checked, each release in a venv of its
own beside the pinned set (scripts/vllm-release-venv.sh: the release installed
with --no-deps, every other package shared with the pinned venv), records what
each printed in findings/results.json, and writes the page from that record.

    python benchmarks/findings.py                 # run every release, write both
    python benchmarks/findings.py --render        # the page again from the record
    python benchmarks/findings.py --check         # rerun on the pinned release only
                                                  # and compare with the record

A reproduction's exit code says what it showed: 10 the defect is present,
0 it is absent (fixed), 77 it could not run here (the reason printed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
FINDINGS = ROOT / "findings"
RECORD = FINDINGS / "results.json"
PAGE = ROOT / "docs" / "findings.md"
RELEASES = ("0.32.0", "0.33.0", "0.34.0")
STATUS = {10: "present", 0: "absent", 77: "could not run here"}
LABEL = {
    "present": "has the defect",
    "absent": "fixed",
    "could not run here": "could not run here",
}
# A reproduction never takes this long; past it, it failed.
TIMEOUT_SECONDS = 600


@dataclass(frozen=True)
class Finding:
    slug: str
    title: str
    what: str
    effect: str
    impact: str
    expected: str
    fixed: str  # what a fixed vLLM does, and kvgate's model's arm for it

    @property
    def folder(self) -> Path:
        return FINDINGS / self.slug

    @property
    def script(self) -> str:
        return f"findings/{self.slug}/repro.py"

    @property
    def trace(self) -> str:
        return f"findings/{self.slug}/trace.yaml"


def load_findings() -> list[Finding]:
    """Every finding under findings/, by folder name."""
    found = []
    for path in sorted(FINDINGS.glob("*/finding.yaml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        fields = ("title", "what", "effect", "impact", "expected", "fixed")
        missing = [f for f in fields if not isinstance(data.get(f), str)]
        if missing:
            raise SystemExit(f"{path.relative_to(ROOT)}: {missing[0]}: missing or not text")
        found.append(Finding(path.parent.name, *(" ".join(data[f].split()) for f in fields)))
    return found


def pinned_release() -> str:
    """The vLLM release scripts/setup.sh installs (the one CI runs)."""
    text = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    match = re.search(r"vllm==([0-9][0-9.]*)", text)
    if match is None:
        raise SystemExit("scripts/setup.sh: vllm==: no pinned release")
    return match.group(1)


def python_for(release: str) -> str:
    """The Python of a venv holding `release` (made when missing)."""
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm-release-venv.sh"), release],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"vllm-release-venv.sh {release}: exit {done.returncode}: {tail}")
    return str(Path(done.stdout.strip()) / "bin" / "python")


def said(stdout: str) -> list[str]:
    """What a reproduction printed that the page shows: its expected and
    actual lines (with their continuations), or why it could not run."""
    kept: list[str] = []
    keeping = False
    for line in stdout.splitlines():
        if line.startswith(("expected:", "actual:", "could not run here:")):
            keeping = True
        elif not line.startswith(" "):
            keeping = False
        if keeping:
            kept.append(line.rstrip())
    return kept


def run_reproduction(python: str, finding: Finding) -> dict[str, Any]:
    """Run one reproduction: its status and what it said."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)  # vLLM alone: kvgate is not importable
    try:
        done = subprocess.run(
            [python, finding.script],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"status": f"failed (no exit in {TIMEOUT_SECONDS} s)", "said": []}
    status = STATUS.get(done.returncode)
    if status is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"failed (exit {done.returncode})", "said": [tail]}
    return {"status": status, "said": said(done.stdout)}


def run_release(release: str, findings: Sequence[Finding]) -> dict[str, Any]:
    """Every reproduction on `release`, all at once (each mostly waits on
    its own imports)."""
    python = python_for(release)
    print(f"vLLM {release}: {python}", file=sys.stderr)
    with concurrent.futures.ThreadPoolExecutor(len(findings) or 1) as pool:
        runs = [pool.submit(run_reproduction, python, finding) for finding in findings]
        results = {finding.slug: run.result() for finding, run in zip(findings, runs, strict=True)}
    for slug, result in results.items():
        print(f"  {slug}: {result['status']}", file=sys.stderr)
    return results


def machine() -> str:
    system = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"
    return f"{system}, Python {platform.python_version()}"


# -- the page -----------------------------------------------------------------


def cell(result: dict[str, Any] | None) -> str:
    if result is None:
        return "not checked"
    status = str(result["status"])
    return LABEL.get(status, status)


def release_rows(finding: Finding, record: dict[str, Any]) -> list[str]:
    rows = ["| vLLM | result | what the reproduction printed |", "| --- | --- | --- |"]
    for release in record["releases"]:
        result = record["results"][release].get(finding.slug)
        printed = "<br>".join(
            f"`{line.strip()}`" for line in (result or {}).get("said", [])
        ).replace("|", "\\|")
        rows.append(f"| {release} | {cell(result)} | {printed} |")
    return rows


def upstream_report(finding: Finding, record: dict[str, Any]) -> list[str]:
    pinned = record["pinned"]
    result = record["results"][pinned][finding.slug]
    has = [
        r for r in record["releases"] if record["results"][r][finding.slug]["status"] == "present"
    ]
    script = (finding.folder / "repro.py").read_text(encoding="utf-8").rstrip()
    return [
        "````markdown",
        f"Title: {finding.title}",
        "",
        "### Your current environment",
        "",
        f"vLLM {', '.join(has) if has else pinned}, CPU only (the Scheduler is built without "
        "a worker or model weights).",
        "",
        "### What happens",
        "",
        finding.what,
        "",
        f"Expected: {finding.expected}",
        "",
        f"Impact: {finding.impact}",
        "",
        f"### Reproduction (vLLM {pinned})",
        "",
        "Save as `repro.py` and run `python repro.py` (exit code 10: the defect "
        "is present, 0: fixed). It prints:",
        "",
        "```text",
        *result["said"],
        "```",
        "",
        "```python",
        script,
        "```",
        "````",
    ]


def render(findings: Sequence[Finding], record: dict[str, Any]) -> str:
    releases = record["releases"]
    lines = [
        "# Known vLLM defects",
        "",
        "kvgate's explorations found these behaviours of vLLM's Scheduler that look like "
        "defects in vLLM itself. kvgate's model follows each on purpose (but the connector "
        "admission at an exact fit, where vLLM raises and the model lets the request wait; see "
        "[what the gate cannot see](explanation/blind-spots.md#vllm-behaviours-kvgate-follows"
        "-but-does-not-vouch-for)), so a build that has them still passes the gate. Each has "
        "a standalone reproduction that needs only vLLM and runs on CPU (no GPU, no model "
        "weights); it exits 10 "
        "when the defect is present, 0 when it is fixed, 77 when it cannot run on the machine "
        "(it prints why); beside it is the kvgate trace it came from. A trace's "
        "`vllm_defects: fixed` (see [the trace format](trace-format.md)) has the model "
        "behave as a fixed vLLM would instead, as each finding's **Fixed** paragraph says; "
        "`kvgate gate` probes each defect on the build and says which behaviour the build "
        "has.",
        "",
        "This page is written by `python benchmarks/findings.py`, never by hand: it runs every "
        "reproduction on every release below, each in a venv of its own beside the pinned "
        "packages, and records what each printed in `findings/results.json`. The test suite "
        f"reruns them on the pinned release (vLLM {record['pinned']}) and fails when one no "
        "longer shows what this page says.",
        "",
        f"Generated {record['generated']} on {record['machine']}.",
        "",
        "| defect | in production | " + " | ".join(f"vLLM {r}" for r in releases) + " |",
        "| --- | --- | " + " | ".join("---" for _ in releases) + " |",
    ]
    for finding in findings:
        cells = " | ".join(cell(record["results"][r].get(finding.slug)) for r in releases)
        lines.append(f"| [{finding.title}](#{finding.slug}) | {finding.effect} | {cells} |")
    lines.append("")
    lines.append(
        '"Could not run here" means the reproduction could not run on that release on this '
        "machine, for the reason printed below (the release lacks a feature the defect needs, "
        "or cannot build its Scheduler here), not that the release is free of the defect."
    )
    for finding in findings:
        lines += [
            "",
            f"## {finding.title} {{#{finding.slug}}}",
            "",
            f"**What happens.** {finding.what}",
            "",
            f"**Expected.** {finding.expected}",
            "",
            f"**In production.** {finding.impact}",
            "",
            f"**Fixed.** {finding.fixed}",
            "",
            "**Releases checked.**",
            "",
            *release_rows(finding, record),
            "",
            "**Reproduce it** with only vLLM installed:",
            "",
            "```bash",
            f"python {finding.script}",
            "```",
            "",
            "and as kvgate found it, the trace replayed on the installed vLLM in lockstep with "
            "kvgate's model:",
            "",
            "```bash",
            f"kvgate replay --target vllm {finding.trace}",
            "```",
            "",
            "**Upstream report**, ready to file:",
            "",
            *upstream_report(finding, record),
        ]
    return "\n".join(lines) + "\n"


def read_record() -> dict[str, Any]:
    record: dict[str, Any] = json.loads(RECORD.read_text(encoding="utf-8"))
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", metavar="RELEASE", default=list(RELEASES))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--render", action="store_true", help="write the page from the record")
    mode.add_argument(
        "--check",
        action="store_true",
        help="rerun on the pinned release and compare with the record and the page",
    )
    args = parser.parse_args(argv)
    findings = load_findings()
    if args.check:
        return check(findings)
    if not args.render:
        pinned = pinned_release()
        releases = sorted(
            set(args.releases) | {pinned}, key=lambda r: [int(p) for p in r.split(".")]
        )
        record = {
            "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine(),
            "pinned": pinned,
            "releases": releases,
            "results": {r: run_release(r, findings) for r in releases},
        }
        RECORD.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    PAGE.write_text(render(findings, read_record()), encoding="utf-8")
    wrote = "" if args.render else f" and {RECORD.relative_to(ROOT)}"
    print(f"wrote {PAGE.relative_to(ROOT)}{wrote}", file=sys.stderr)
    return 0


def check(findings: Sequence[Finding]) -> int:
    """Drifts between the record, the page and the pinned release, one per line."""
    record = read_record()
    problems = []
    if PAGE.read_text(encoding="utf-8") != render(findings, record):
        problems.append("docs/findings.md is not what the record renders")
    live = run_release(record["pinned"], findings)
    for finding in findings:
        was = record["results"][record["pinned"]].get(finding.slug)
        if live[finding.slug] != was:
            problems.append(f"{finding.slug}: recorded {was}, now {live[finding.slug]}")
    for problem in problems:
        print(problem)
    if problems:
        print("regenerate with: python benchmarks/findings.py")
        return 1
    print(
        f"findings: the record, the page and vLLM {record['pinned']} agree "
        f"({len(findings)} reproductions)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
