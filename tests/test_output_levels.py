"""Output levels: vLLM's log lines are kept per trace and counted by
default, shown as they happen with -v, and shown for a failing trace."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

import pytest

from kvgate import cli
from kvgate.conformance.trace import bundled_corpus
from kvgate.output import VLLM_LOGGER, VllmLogs, vllm_logs

# A trace that makes vLLM refuse a prefix-cache reset on purpose (it logs
# a warning), and one that does not log.
LOGGING_TRACE = "mamba2-residency-metrics.hold-off.yaml"
QUIET_TRACE = "kv-events-full-report.yaml"
VLLM_LINE = "Failed to reset prefix cache"

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)


def _corpus(tmp_path: Path, *names: str) -> Path:
    for name in names:
        shutil.copy(bundled_corpus() / name, tmp_path / name)
    return tmp_path


@needs_vllm
def test_gate_on_vllm_keeps_vllms_lines_and_counts_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _corpus(tmp_path, LOGGING_TRACE, QUIET_TRACE)
    assert cli.main(["gate", "--target", "vllm", "--no-bundled", "--corpus", str(corpus)]) == 0
    out, err = capsys.readouterr()
    assert VLLM_LINE not in out + err
    assert "vllm WARNING" not in out + err
    assert "PASS mamba2-residency-metrics.hold-off" in out
    assert "vLLM logged 1 warning (all from traces); -v shows them" in out
    # The counts stay the last line, for CI parsers.
    assert out.splitlines()[-1] == "2 passed, 0 failed"


@needs_vllm
def test_gate_verbose_shows_vllms_lines_as_they_happen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = _corpus(tmp_path, LOGGING_TRACE)
    assert (
        cli.main(["gate", "--target", "vllm", "--no-bundled", "--corpus", str(corpus), "-v"]) == 0
    )
    out, err = capsys.readouterr()
    assert f"vllm WARNING: {VLLM_LINE}" in err
    assert "vLLM logged 1 warning (all from traces)" in out
    assert "-v shows them" not in out


@needs_vllm
def test_a_failing_trace_shows_the_vllm_lines_it_caused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (bundled_corpus() / LOGGING_TRACE).read_text()
    # The residency after the refused reset: one eviction more than vLLM ends.
    drifted = text.replace("expect: {evicted: 17,", "expect: {evicted: 18,", 1)
    assert drifted != text
    (tmp_path / LOGGING_TRACE).write_text(drifted)
    assert cli.main(["gate", "--target", "vllm", "--no-bundled", "--corpus", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "vLLM logged during trace mamba2-residency-metrics.hold-off:" in err
    assert f"  vllm WARNING: {VLLM_LINE}" in err


@needs_vllm
def test_a_trace_lacking_a_capability_does_not_show_vllms_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Upstream vLLM lacks the hold: the hold-on trace is reported as lacking
    it, not as failing, so its vLLM lines stay counted, not shown."""
    corpus = _corpus(tmp_path, LOGGING_TRACE.replace("hold-off", "hold-on"))
    assert cli.main(["gate", "--target", "vllm", "--no-bundled", "--corpus", str(corpus)]) == 4
    out, err = capsys.readouterr()
    assert "vLLM logged during" not in err and VLLM_LINE not in err
    assert "vLLM logged 1 warning (all from traces); -v shows them" in out


@needs_vllm
def test_quiet_prints_no_passing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = _corpus(tmp_path, QUIET_TRACE)
    assert (
        cli.main(["gate", "--target", "vllm", "--no-bundled", "--corpus", str(corpus), "-q"]) == 0
    )
    out, _ = capsys.readouterr()
    assert "PASS" not in out
    assert "1 passed, 0 failed" in out


def test_summary_names_where_the_lines_came_from(capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger(VLLM_LOGGER + ".v1.core")
    with vllm_logs() as logs:
        with logs.unit("refusal traces"):
            logger.warning("one")
            logger.warning("two")
        with logs.unit("traces") as captured:
            logger.error("three")
        logs.show(captured, "trace t")
        logger.info("below the default level: not even made")
        line = logs.summary()
    _, err = capsys.readouterr()
    assert line == (
        "vLLM logged 2 warnings, 1 error (2 from refusal traces, 1 from traces); -v shows them"
    )
    assert err == "vLLM logged during trace t:\n  vllm ERROR: three\n"
    # Uninstalled: vLLM's logger is as it was.
    assert all(not isinstance(h, VllmLogs) for h in logging.getLogger(VLLM_LOGGER).handlers)


# -- -q means the same on every command: failures and the verdict or summary.


def test_prove_quiet_prints_only_the_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["prove", "--blocks", "2", "--requests", "1"]) == 0
    loud = capsys.readouterr().out.splitlines()
    assert len(loud) > 10 and "proved" in loud[2]
    assert cli.main(["prove", "--blocks", "2", "--requests", "1", "-q"]) == 0
    [count] = capsys.readouterr().out.splitlines()
    assert count.startswith(f"{loud[-1].split(' proved')[0]} proved in ")


def test_workload_quiet_prints_no_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["workload", "--target", "model", "--scale", "64", "--units", "4096", "--hold", "on"]
    assert cli.main([*argv, "--sessions", "2", "--turns", "2", "--out", str(tmp_path), "-q"]) == 0
    out, err = capsys.readouterr()
    assert "done in" not in err and "[" not in err
    assert out.startswith("kvgate workload: ")


def test_explore_quiet_prints_the_count_and_the_verdict_and_the_budget_is_kept(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["explore", "--budget", "7", "-q"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    count, verdict = out.splitlines()
    assert count.startswith("7 examples, ") and verdict == "no failure found"


@needs_vllm
def test_the_scheduler_level_budget_counts_the_examples_that_ran(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Examples a side refused, or Hypothesis dropped, are counted apart.
    assert cli.main(["explore", "--scope", "scheduler", "--budget", "4", "-q"]) == 0
    count, verdict = capsys.readouterr().out.splitlines()
    assert count.startswith("4 examples, ") and "dropped part-way" in count
    assert verdict == "no divergence found"
