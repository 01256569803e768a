"""Every benchmark runs, at a tiny size, so none can rot unnoticed: each
starts, runs and prints the line its measurement ends in. The sizes here
are smoke sizes (seconds); the real ones are each script's defaults."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvgate.conformance.trace import bundled_corpus

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
HAS_VLLM = importlib.util.find_spec("vllm") is not None

# Benchmark -> (its arguments at a smoke size, a line its result prints,
# whether it needs vLLM). "{corpus}" stands for a copy of three of the
# bundled corpus's traces, a refusal trace among them.
SMOKE: dict[str, tuple[list[str], str, bool]] = {
    "replay_speed.py": (["--rounds", "1", "--corpus", "{corpus}"], "model/vllm ", True),
    "model_alone.py": (
        ["--rounds", "1", "--trace", "{corpus}/kv-events-full-report.yaml"],
        "vLLM api / model: ",
        True,
    ),
    "explore_campaign_scaling.py": (
        ["--cells", "1", "--shards", "1", "--examples", "2", "--no-ray", "--busy-seconds", "0.05"],
        "x ",  # the rate against one job
        False,
    ),
    "explore_fault_reach.py": (
        ["--faults", "evict-keeps-partial-keys", "--seeds", "1", "--cap", "2", "--families", "0"],
        "evict-keeps-partial-keys ",
        True,
    ),
    "explore_first_counterexample.py": (
        ["--seeds", "1", "--examples", "300"],
        "time to first counterexample over 1 seeds",
        False,
    ),
    "mutate_time.py": (
        ["--faults", "free-cached-to-head", "--explore", "0", "--no-scheduler-stage"]
        + ["--corpus", "{corpus}"],
        "per fault: wall mean ",
        True,
    ),
    "findings.py": (["--check"], "findings: the record, the page and vLLM ", True),
    # The hunt itself is minutes on vLLM (benchmarks/results.py hunting): here,
    # its record printed as the results page shows it.
    "hunting.py": (["--render"], "divergences on stock vLLM: ", False),
    "gate_cost.py": (
        ["--rounds", "1", "--manager", "{corpus}", "--scheduler", "{corpus}"],
        "scheduler-level / manager-level: ",
        True,
    ),
    "corpus_memory.py": (["--sessions", "20", "--copies", "2"], "one step a line ", False),
    "recorder_overhead.py": (
        ["--scale", "64", "--sessions", "1", "--turns", "2", "--rounds", "1"],
        "recorder time / Scheduler's own time: ",
        True,
    ),
    # Measuring needs the served environment and two servers (minutes):
    # the smoke run prints the record.
    "served_overhead.py": (["--render"], "recorder on / off, median tokens per second: ", False),
    "prove_scaling.py": (
        ["--blocks", "4", "--requests", "1", "--groups", "2"]
        + ["--props", "no_leak", "--ops", "arrive"],
        "unbounded ",
        False,
    ),
    # It regenerates the docs' results page from the commands (minutes):
    # the smoke run lists its sections.
    "results.py": (["--list"], "benchmarks   Benchmark ratios (about ", False),
    "scale.py": (
        ["--scale", "64", "--lengths", "1,2", "--units", "4096", "--history-unit", "4096"]
        + ["--model-only", "--out", "{corpus}/scale", "--plot", "{corpus}/scale.png"]
        + ["--scheduler", "--scheduler-sessions", "1"],
        "ratio history: x2 / x1 (peak memory): ",
        False,
    ),
    "workload.py": (
        ["--scale", "64", "--units", "4096", "--sessions", "1", "--turns", "2"],
        "ratio ",
        True,
    ),
    "workload_scheduler.py": (
        ["--scale", "64", "--units", "4096", "--sessions", "1", "--turns", "2"],
        "ratio: ",
        True,
    ),
}
CORPUS_SAMPLE = (
    "kv-events-full-report.yaml",
    "mamba2-residency-metrics.hold-off.yaml",
    "refuse-kv-cache-metrics-sample-zero.yaml",
)


def test_every_benchmark_has_a_smoke_run() -> None:
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert scripts == sorted(SMOKE)


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmark_{name[:-3]}", BENCHMARKS / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered as imported: a dataclass in it looks its module up there.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_the_benchmark_runs_at_a_smoke_size(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    argv, result_line, needs_vllm = SMOKE[name]
    if needs_vllm and not HAS_VLLM:
        pytest.skip("vLLM is not installed")
    if needs_vllm:
        # A benchmark may load the hold overlay into this process: put vLLM
        # back afterwards, or later tests would gate an overlaid vLLM.
        request.getfixturevalue("hold_overlay_plugin")
    for trace in CORPUS_SAMPLE:
        shutil.copy(bundled_corpus() / trace, tmp_path / trace)
    argv = [arg.replace("{corpus}", str(tmp_path)) for arg in argv]
    code = _load(name).main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert any(result_line in line for line in out.splitlines()), out
