"""The known vLLM defects, probed on the build under test for `kvgate gate`.

Each defect kvgate found in vLLM itself has a folder under `findings/` in
kvgate's source tree, shipped in the package as `kvgate/findings` (the
source tree links it there, so there is one copy): its description
(`finding.yaml`) and a standalone reproduction (`repro.py`, vLLM only) that
exits 10 when the defect is present, 0 when it is absent, 77 when it cannot
run here. The gate runs each reproduction with its own Python (so on the
same vLLM), all at once while the traces replay, and reports them as a
group of their own: present, with what it costs in production; absent; or
not probed, with why. The policy (`--known-defects`) says whether a present
defect fails the gate.
"""

from __future__ import annotations

import argparse
import atexit
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import yaml

from kvgate.errors import InputError

__all__ = ["POLICIES", "DefectProbe", "Probe", "default_policy", "findings_dir", "start"]

Policy = Literal["report", "fail", "skip"]
POLICIES: tuple[Policy, ...] = ("report", "fail", "skip")
# Sets the policy's default (the flag still overrides it): a test suite or a CI
# job that gates many times may probe once, or never.
POLICY_VARIABLE = "KVGATE_KNOWN_DEFECTS"
POLICY_HELP = (
    "the known vLLM defects (docs/findings.md), probed on the build by their standalone "
    "reproductions: report lists each (present with its production impact, or absent), "
    f"fail also fails the gate (exit 1) when one is present, skip probes none "
    f"(default: ${POLICY_VARIABLE} when set, else report)"
)
PRESENT, ABSENT, CANNOT_RUN = 10, 0, 77
# A reproduction builds one Scheduler and runs a few steps; past this it failed.
TIMEOUT_SECONDS = 900


def default_policy() -> Policy:
    """The policy when the flag is not given: $KVGATE_KNOWN_DEFECTS, or report."""
    value = os.environ.get(POLICY_VARIABLE, "report")
    for policy in POLICIES:
        if value == policy:
            return policy
    raise InputError(f"{POLICY_VARIABLE}={value!r}: not one of {', '.join(POLICIES)}")


def policy_of(args: argparse.Namespace) -> Policy:
    """The policy a command's arguments ask for: `--known-defects`, else the
    default; a command without the option (replay) probes nothing."""
    if not hasattr(args, "known_defects"):
        return "skip"
    chosen: Policy | None = args.known_defects
    return chosen if chosen is not None else default_policy()


def findings_dir() -> Path | None:
    """The reproductions' folder: `kvgate/findings`, shipped in the package
    (in a source tree, a link to its `findings/`). None when absent."""
    folder = Path(__file__).resolve().parent / "findings"
    return folder.resolve() if folder.is_dir() else None


@dataclass(frozen=True)
class Probe:
    """One defect's probe: `status` present, absent or not probed."""

    slug: str
    title: str
    impact: str  # in production, in a few words
    status: str
    detail: str = ""


class DefectProbe:
    """The reproductions, started at once in child processes; `finish`
    waits for them and reads their verdicts."""

    def __init__(self, folder: Path, python: str = sys.executable) -> None:
        self._running: list[tuple[str, str, str, subprocess.Popen[bytes], IO[bytes]]] = []
        env = {**os.environ, "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu")}
        for path in sorted(folder.glob("*/finding.yaml")):
            about = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            title = " ".join(str(about.get("title", path.parent.name)).split())
            impact = " ".join(str(about.get("effect", "")).split())
            # Closed in `finish`, once the child has written it.
            out = tempfile.TemporaryFile()  # noqa: SIM115
            child = subprocess.Popen(
                [python, str(path.parent / "repro.py")],
                cwd=path.parent,
                env=env,
                stdout=out,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
            )
            self._running.append((path.parent.name, title, impact, child, out))
        # A gate that stops before reading them (an error, an interrupt)
        # leaves no reproduction running behind it.
        atexit.register(self.close)

    def close(self) -> None:
        """Stop every reproduction still running (its verdict is lost)."""
        for _, _, _, child, _ in self._running:
            if child.poll() is None:
                child.kill()
                child.wait()

    def finish(self) -> list[Probe]:
        probes = []
        for slug, title, impact, child, out in self._running:
            try:
                code = child.wait(TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                code = None
            out.seek(0)
            printed = out.read().decode(errors="replace").splitlines()
            out.close()
            if code == PRESENT:
                actual = next((line for line in printed if line.startswith("actual:")), "")
                detail = actual.removeprefix("actual:").strip()
                probes.append(Probe(slug, title, impact, "present", detail))
            elif code == ABSENT:
                probes.append(Probe(slug, title, impact, "absent"))
            else:
                why = next(
                    (line for line in printed if line.startswith("could not run here:")),
                    f"its reproduction exited {code}" if code is not None else "it timed out",
                )
                reason = why.removeprefix("could not run here:").strip()
                probes.append(Probe(slug, title, impact, "not probed", reason))
        return probes


def start(policy: Policy, target: str) -> DefectProbe | None:
    """The probe the gate runs for `policy` on `target` (None: no probe: the
    policy skips it, the target is kvgate's model, or the package lacks its
    findings)."""
    folder = findings_dir()
    if policy == "skip" or target != "vllm" or folder is None:
        return None
    return DefectProbe(folder)


def lines(probes: list[Probe], policy: Policy) -> list[str]:
    """The group the gate's report shows."""
    present = [p for p in probes if p.status == "present"]
    rule = "fails the gate (--known-defects fail)" if policy == "fail" else "reported only"
    shown = [
        f"known vLLM defects: {len(present)} of {len(probes)} present on this build; {rule}; "
        "each with its reproduction: docs/findings.md"
    ]
    for probe in probes:
        if probe.status == "present":
            shown.append(f"  present: {probe.title} (impact: {probe.impact})")
        elif probe.status == "absent":
            # The bundled traces stop short of every defect, so they pass
            # whichever arm the model takes; the probe says which the build has.
            shown.append(
                f"  absent: {probe.title} (this build behaves as a fixed vLLM, the model's "
                "`vllm_defects: fixed`; the traces pass either way)"
            )
        else:
            shown.append(f"  not probed: {probe.title}: {probe.detail}")
    return shown


def fails(probes: list[Probe], policy: Policy) -> bool:
    return policy == "fail" and any(p.status == "present" for p in probes)
