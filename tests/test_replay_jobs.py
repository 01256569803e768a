"""`--jobs N` on `kvgate gate` and `kvgate replay`: the traces run in worker
processes, and the report (verdicts, divergences, order, exit code) is the
one `--jobs 1` prints; the pool itself, shared with exploration campaigns."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from kvgate import cli, workers
from kvgate.conformance.trace import bundled_corpus

TRACES = (
    "seed1-next-turn-after-burst.hold-on",
    "abort-mid-prefill",
    "attention-partial-tail-promoted",
    "scheduler/sched-async-abort-frees-after-batch",
    "scheduler/sched-abort-mid-prefill",
)


def corpus(folder: Path) -> Path:
    """A few bundled traces of both kinds, and one that fails on the model: the
    seed's hold-on trace with the hold switched off (its expectations are the
    hold's)."""
    folder.mkdir()
    for name in TRACES:
        source = bundled_corpus() / f"{name}.yaml"
        (folder / source.name).write_text(source.read_text())
    seed = (bundled_corpus() / f"{TRACES[0]}.yaml").read_text()
    failing = seed.replace("retain_checkpoint: true", "retain_checkpoint: false")
    failing = failing.replace(f"name: {TRACES[0]}", "name: seed-without-its-hold")
    assert failing != seed
    (folder / "seed-without-its-hold.yaml").write_text(failing)
    return folder


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, re.sub(r"\d+\.\d+s", "#s", out), err


def test_the_gate_on_two_jobs_reports_what_one_job_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = corpus(tmp_path / "corpus")
    gate = ["gate", "--target", "model", "--no-bundled", "--corpus", str(folder)]
    one = run([*gate, "--jobs", "1"], capsys)
    two = run([*gate, "--jobs", "2"], capsys)
    assert one == two
    code, out, _ = one
    assert code == 1
    assert "FAIL seed-without-its-hold" in out
    names = [line.split()[1] for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(names) == len(TRACES) + 1


def test_replay_on_two_jobs_reports_what_one_job_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = corpus(tmp_path / "corpus")
    paths = sorted(str(p) for p in folder.iterdir())
    replay = ["replay", "--target", "model", *paths]
    assert run([*replay, "--jobs", "2"], capsys) == run(replay, capsys)


def test_a_bad_job_count_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["gate", "--target", "model", "--jobs", "0"]) == 2
    assert "--jobs: must be at least 1, not 0" in capsys.readouterr().err
    assert cli.main(["gate", "--target", "model", "--jobs", "2", "--ray", "local"]) == 2
    assert "--ray: the traces run on the cluster's workers" in capsys.readouterr().err


def test_the_pool_runs_tasks_in_other_processes_and_puts_results_in_order() -> None:
    pids = dict(workers.in_processes(2)(os.getpid, [(), (), ()]))
    assert sorted(pids) == [0, 1, 2]
    assert os.getpid() not in pids.values()
    # One job: in this process, nothing pickled.
    assert dict(workers.in_processes(1)(os.getpid, [()])) == {0: os.getpid()}
    assert list(workers.in_order(iter([(2, "c"), (0, "a"), (1, "b")]))) == ["a", "b", "c"]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")
def test_the_gate_on_a_local_ray_cluster_reports_what_one_job_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = corpus(tmp_path / "corpus")
    gate = ["gate", "--target", "model", "--no-bundled", "--corpus", str(folder)]
    assert run([*gate, "--ray", "local:2"], capsys)[:2] == run(gate, capsys)[:2]
