"""The same campaign over vLLM 0.33.0's own manager and scheduler tests, for comparison.

Each fault runs in its own pytest process with `kvgate.mutate.pytest_plugin`
applying it at session start; `-x` stops a session at the first failing
test, which is all a kill needs. The baseline session (no fault) runs first:
a test that fails there cannot catch anything and is deselected from every
fault's session, exactly as the gate only counts traces that pass unmutated.

The tests come from vLLM's sdist (`scripts/fetch-vllm-tests.sh`). When the
project's `scripts/vllm-own-tests.sh` exists it runs them (it installs their
extra dependencies and uses their own pytest config); otherwise pytest runs
in the tests folder directly. Either way the selection is `SELECTION`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvgate.errors import KvgateError
from kvgate.mutate.faults import FAULT_ENV, NOT_APPLICABLE_EXIT, REPORT_ENV, Fault

SELECTION_ROOT = "tests/v1/core/"
# The one list of vLLM's own tests that kvgate compares itself with: the
# campaign runs all of them and scripts/coverage-report.sh measures each
# group as a column (it prints them with `python -m kvgate.mutate.own_suite`).
# vLLM's own tests of the block manager.
MANAGER_TESTS: tuple[str, ...] = (
    "tests/v1/core/prefix_cache/",
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
)
# Its tests of the Scheduler: the files that build one (test_prefix_caching.py
# builds one too and stays with the manager's) and the align split's tests,
# which call the Scheduler's split directly. The sliding-window file stays
# in: kvgate does not count sliding-window code, but the Scheduler lines its
# tests reach count for vLLM's column as for any other test.
SCHEDULER_TESTS: tuple[str, ...] = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/core/test_prefix_replay.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_worker_slot_overflow.py",
)
SELECTION: tuple[str, ...] = MANAGER_TESTS + SCHEDULER_TESTS
# Starts an OpenAI server on a downloaded model: an end-to-end test, not a
# test of the manager, and it cannot run offline.
IGNORED: tuple[str, ...] = ("tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py",)
# The project's runner for these tests, relative to a checkout's root.
RUNNER_SCRIPT = Path("scripts/vllm-own-tests.sh")

SuiteVerdict = Literal["caught", "missed", "not applicable", "hung", "error"]


@dataclass(frozen=True)
class SuiteRun:
    exit_code: int
    report: dict[str, Any]
    seconds: float
    output_tail: str

    @property
    def failed(self) -> list[dict[str, str]]:
        return list(self.report.get("failed", []))


@dataclass(frozen=True)
class SuiteResult:
    fault: Fault
    verdict: SuiteVerdict
    by: str  # the first failing test, or why there is no verdict
    seconds: float
    message: str = ""  # the first failing test's last error line


@dataclass(frozen=True)
class Suite:
    """How to run vLLM's own tests here."""

    tests_dir: Path  # the folder holding `tests/`
    runner: tuple[str, ...]  # the command, before pytest arguments
    timeout: float

    @staticmethod
    def locate(tests_dir: Path, root: Path | None, timeout: float) -> Suite:
        """Prefer the project's runner script; else pytest itself."""
        script = None if root is None else root / RUNNER_SCRIPT
        if script is not None and script.is_file():
            return Suite(tests_dir, ("bash", str(script)), timeout)
        return Suite(tests_dir, (sys.executable, "-m", "pytest", f"--rootdir={tests_dir}"), timeout)

    def run(self, fault: Fault | None, deselect: Sequence[str], stop_first: bool) -> SuiteRun:
        with tempfile.TemporaryDirectory(prefix="kvgate-mutate-") as tmp:
            report_path = Path(tmp) / "report.json"
            env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
            # Offline, a test that needs a model's files fails at once instead
            # of retrying the hub for minutes (the baseline then leaves it out).
            env.setdefault("HF_HUB_OFFLINE", "1")
            env[REPORT_ENV] = str(report_path)
            env.pop(FAULT_ENV, None)
            if fault is not None:
                env[FAULT_ENV] = fault.name
            command = [
                *self.runner,
                "-p",
                "kvgate.mutate.pytest_plugin",
                "-p",
                "no:cacheprovider",
                "-q",
                "-W",
                "ignore",
                *(["-x"] if stop_first else []),
                *(f"--deselect={nodeid}" for nodeid in deselect),
                *SELECTION,
                *(f"--ignore={path}" for path in IGNORED),
            ]
            started = time.perf_counter()
            try:
                done = subprocess.run(
                    command,
                    cwd=self.tests_dir,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    timeout=self.timeout,
                )
                code, output = done.returncode, done.stdout
            except subprocess.TimeoutExpired as expired:
                code = -1
                raw = expired.stdout or b""
                output = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            seconds = time.perf_counter() - started
            report: dict[str, Any] = {}
            if report_path.is_file():
                report = json.loads(report_path.read_text(encoding="utf-8"))
        tail = "\n".join(output.strip().splitlines()[-5:])
        return SuiteRun(code, report, seconds, tail)


class SuiteError(KvgateError):
    """vLLM's tests could not run unmutated: nothing to compare."""


def run_suite_campaign(
    faults: Sequence[Fault],
    suite: Suite,
    jobs: int,
    on_baseline: Callable[[SuiteRun], None] | None = None,
    on_result: Callable[[SuiteResult], None] | None = None,
) -> tuple[SuiteRun, list[SuiteResult]]:
    """The baseline session, then one session per fault, `jobs` at a time."""
    baseline = suite.run(None, (), stop_first=False)
    if baseline.exit_code not in (0, 1) or "fault" not in baseline.report:
        raise SuiteError(
            f"vLLM's tests did not run unmutated (exit {baseline.exit_code}): "
            + (baseline.output_tail.splitlines() or ["no output"])[-1]
        )
    if on_baseline is not None:
        on_baseline(baseline)
    known_bad = [f["test"] for f in baseline.failed]
    from concurrent.futures import ThreadPoolExecutor

    # Threads only wait on pytest processes: the work is in those.
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(suite.run, f, known_bad, True) for f in faults]
        results = []
        for fault, future in zip(faults, futures, strict=True):
            result = judge_suite(fault, future.result())
            results.append(result)
            if on_result is not None:
                on_result(result)
    return baseline, results


def judge_suite(fault: Fault, run: SuiteRun) -> SuiteResult:
    if run.exit_code == NOT_APPLICABLE_EXIT or "not_applicable" in run.report:
        return SuiteResult(
            fault, "not applicable", str(run.report.get("not_applicable", "")), run.seconds
        )
    if run.exit_code == -1:
        return SuiteResult(fault, "hung", "pytest did not finish in time", run.seconds)
    if run.report.get("fault") != fault.name:
        return SuiteResult(fault, "error", f"fault not applied (exit {run.exit_code})", run.seconds)
    failed = run.failed
    if run.exit_code == 1 and failed:
        first = failed[0]
        return SuiteResult(fault, "caught", first["test"], run.seconds, first["message"])
    if run.exit_code == 0:
        return SuiteResult(fault, "missed", "", run.seconds)
    last = (run.output_tail.splitlines() or [""])[-1]
    return SuiteResult(fault, "error", f"pytest exit {run.exit_code}: {last}", run.seconds)


def main(argv: Sequence[str]) -> int:
    """Print one group's test paths, a line each, for the coverage script."""
    groups = {"manager": MANAGER_TESTS, "scheduler": SCHEDULER_TESTS}
    if len(argv) != 1 or argv[0] not in groups:
        print(f"usage: python -m kvgate.mutate.own_suite {{{','.join(groups)}}}", file=sys.stderr)
        return 2
    print("\n".join(groups[argv[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
