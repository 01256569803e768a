"""`kvgate shrink`: a long trace that diverges under one of the fault
campaign's faults shrinks to a small one that diverges at the same field,
for both kinds of trace; a long history of either kind whose divergence
comes late is shrunk from the prefix up to it alone, as it would be from
the whole trace; delta debugging itself; bad input.

The default run shrinks a generated trace of each kind of several hundred
steps on small pools (a few seconds each once vLLM is imported);
`KVGATE_SHRINK_LONG=1` shrinks harder ones instead: the manager-level
workload on its full pool, and engine steps whose first divergence comes
from a pool under pressure (about a minute each on two cores).
"""

from __future__ import annotations

import os
import random
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm
from scheduler_runs import Wrapped, run_vllm

from kvgate import cli, shrink_command
from kvgate.conformance.replay import ReplayResult
from kvgate.conformance.shrink import Shrinker, ddmin, step_count
from kvgate.conformance.stream import stream_trace
from kvgate.conformance.trace import (
    Trace,
    bundled_corpus,
    bundled_scheduler_corpus,
    load_trace,
)
from kvgate.conformance.writer import dump_engine_trace, dump_trace
from kvgate.errors import EXIT_INPUT, EXIT_OK
from kvgate.mutate.faults import Fault, load_faults
from kvgate.mutate.inject import injected
from kvgate.targets import gate_factories, run_scheduler_trace, run_trace, scheduler_factories
from kvgate.vocabulary.ops import Segment
from kvgate.vocabulary.scheduling import EngineSettings, EngineStep
from kvgate.workload.deployment import Deployment
from kvgate.workload.engine_trace import write_engine_trace
from kvgate.workload.generator import generate
from kvgate.workload.plan import Workload, make_plan
from kvgate.workload.runner import Arm

LONG = os.environ.get("KVGATE_SHRINK_LONG") == "1"
# One fault of vLLM's block manager, one of its Scheduler (kvgate/mutate/faults.yaml).
MANAGER_FAULT = "free-order-not-reversed"
SCHEDULER_FAULT = "sched-lookup-drops-junction"
# The shrunk trace has at most this share of the original's steps.
MOST = 0.05


def where_and_what(result: ReplayResult) -> tuple[str, str, str]:
    """The first divergence's kind of step, level and field, numbers
    (engine steps, block ids) left out: read here, not by the shrinker."""
    d = result.divergence
    assert d is not None
    return d.step.op, d.level, re.sub(r"\d+", "#", d.what.split(": ")[-1])


def fault(name: str) -> Fault:
    [found] = [f for f in load_faults() if f.name == name]
    return found


def manager_trace(directory: Path) -> Path:
    """A production-shaped agent workload, as `kvgate workload` generates it
    (upstream vLLM's config, scaled down): 296 steps on a pool of 500
    blocks, or when long 514 steps on the deployment's pool (2,910 blocks)."""
    scale = 32 if LONG else 64
    deployment = Deployment(build="upstream").scaled(scale)
    workload = Workload(sessions=3, turns=3) if LONG else Workload(sessions=2, turns=2)
    config = deployment.config(256 // scale, False, workload.sessions)
    if not LONG:
        config = replace(config, num_blocks=500)
    steps = generate(config, make_plan(workload, scale), deployment.serving(workload.system_prompt))
    path = directory / "agents.yaml"
    path.write_text(dump_trace("agents", config, steps))
    return path


def engine_trace(directory: Path) -> Path:
    """24 requests arriving at random engine steps, some sharing an earlier
    prompt, in a pool of 60 blocks: 424 engine steps. Two thirds of them,
    the first to arrive, have prompts of whole Mamba blocks (32 tokens),
    except when long."""
    requests, steps, num_blocks = 24, 400, 60
    rng = random.Random(0)
    base = load_trace(bundled_scheduler_corpus() / "sched-preempt-under-pressure-and-resume.yaml")
    engine: list[EngineStep] = []
    shared: list[str] = []  # requests with a prompt of their own, for others to share
    now = 0
    for i, at in enumerate(sorted(rng.randrange(steps * 2 // 3) for _ in range(requests))):
        engine.extend(EngineStep("step", 0) for _ in range(at - now))
        now = max(now, at)
        name = f"r{i:02d}"
        whole_blocks = not LONG and i < requests * 2 // 3
        count = rng.randint(1, 6) * 32 if whole_blocks else rng.randint(20, 200)
        prompt: tuple[Segment, ...] = (Segment("fresh", count=count),)
        if shared and rng.random() < 0.5:
            prompt = (Segment("prompt_of", req=rng.choice(shared)), *prompt)
        else:
            shared.append(name)
        engine.append(
            EngineStep("arrive", 0, req=name, prompt=prompt, max_tokens=rng.randint(4, 60))
        )
    engine.extend(EngineStep("step", 0) for _ in range(steps - now))
    config = replace(base.config, num_blocks=num_blocks)
    path = directory / "engine.yaml"
    path.write_text(dump_engine_trace("engine", config, EngineSettings(0, 8), engine))
    return path


def on_vllm(trace: Trace) -> ReplayResult:
    """The trace's replay on vLLM in lockstep with the model, as the gate runs it."""
    if trace.scheduler_level:
        model, real = scheduler_factories("vllm", None)
        outcome = run_scheduler_trace(trace, model, real, "strict")
    else:
        factory, lockstep = gate_factories("vllm")
        outcome = run_trace(trace, factory, lockstep, "strict", target_is_model=False)
    assert isinstance(outcome, ReplayResult), outcome
    return outcome


# -- delta debugging ---------------------------------------------------------


def test_ddmin_finds_the_two_items_that_matter() -> None:
    tried: list[list[int]] = []

    def passes(kept: list[int]) -> bool:
        tried.append(kept)
        return 13 in kept and 71 in kept

    assert ddmin(list(range(100)), passes) == [13, 71]
    assert len(tried) < 100  # far fewer than one candidate per subset size


def test_ddmin_keeps_what_cannot_shrink() -> None:
    assert ddmin([1, 2, 3], lambda kept: len(kept) == 3) == [1, 2, 3]


# -- shrinking a fault's divergence on vLLM -----------------------------------


@needs_vllm
@pytest.mark.parametrize(
    ("make", "fault_name"),
    [(manager_trace, MANAGER_FAULT), (engine_trace, SCHEDULER_FAULT)],
    ids=["manager-level", "scheduler-level"],
)
def test_a_long_diverging_trace_shrinks_to_a_few_steps_that_diverge_alike(
    make: object,
    fault_name: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert callable(make)
    path: Path = make(tmp_path)
    original = load_trace(path)
    out = tmp_path / "shrunk.yaml"
    with injected(fault(fault_name)):
        before = on_vllm(original)
        code = cli.main(["shrink", str(path), "--target", "vllm", "-o", str(out), "-q"])
        shrunk = load_trace(out)
        after = on_vllm(shrunk)
    printed = capsys.readouterr().out.strip().splitlines()
    assert code == EXIT_OK
    # The same kind of step, level and field, on a trace of at most 5% of the steps.
    assert where_and_what(after) == where_and_what(before)
    assert step_count(shrunk) <= MOST * step_count(original)
    print(f"{fault_name}: {printed[-1]}", file=sys.stderr)  # the numbers, with -s
    assert printed[-1].startswith(
        f"{out}: from {step_count(original)} steps to {step_count(shrunk)}, diverges on vllm at "
    )
    # Without the fault, vLLM conforms on it: the divergence is the fault's.
    assert on_vllm(shrunk).passed
    # It is a trace like any other: `kvgate replay` reads and runs it.
    assert cli.main(["replay", str(out), "--target", "model", "-q"]) == EXIT_OK


# -- the model against a trace's own expectations -----------------------------


def test_on_the_model_a_wrong_expectation_is_what_is_kept(tmp_path: Path) -> None:
    source = (bundled_corpus() / "dense-retention-multiturn.hold-off.yaml").read_text()
    wrong = source.replace("hit: 136", "hit: 135", 1)
    assert wrong != source
    path = tmp_path / "wrong.yaml"
    path.write_text(wrong)
    out = tmp_path / "small.yaml"
    assert cli.main(["shrink", str(path), "--target", "model", "-o", str(out), "-q"]) == EXIT_OK
    original, shrunk = load_trace(path), load_trace(out)
    assert step_count(shrunk) < step_count(original)
    factory, _ = gate_factories("model")
    for trace in (original, shrunk):
        result = run_trace(trace, factory, None, "strict", target_is_model=True)
        assert isinstance(result, ReplayResult)
        assert where_and_what(result) == ("lookup", "expect", "hit")


# -- bad input ----------------------------------------------------------------


def test_a_trace_that_does_not_diverge_is_told_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = bundled_corpus() / "dense-retention-multiturn.hold-off.yaml"
    out = tmp_path / "out.yaml"
    assert cli.main(["shrink", str(path), "--target", "model", "-o", str(out)]) == EXIT_INPUT
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (f"kvgate: error: {path}: does not diverge on --target model: nothing to shrink")
    assert not out.exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("format: kvgate-trace/1\nname: t\n", "{path}: config: missing"),
        (
            (bundled_corpus() / "dense-retention-multiturn.hold-off.yaml")
            .read_text()
            .replace("op: free, req: T2", "op: free, req: Z", 1),
            "{path}: step ",
        ),
    ],
    ids=["missing-config", "unknown-request"],
)
def test_an_invalid_trace_is_one_line_naming_file_step_and_field(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["shrink", str(path), "--target", "model"]) == EXIT_INPUT
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("kvgate: error: " + message.format(path=path)), line


def test_the_output_may_not_replace_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.yaml"
    path.write_text((bundled_corpus() / "dense-retention-multiturn.hold-off.yaml").read_text())
    assert cli.main(["shrink", str(path), "--target", "model", "-o", str(path)]) == EXIT_INPUT
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"kvgate: error: {path}: the output would replace the trace being shrunk"


# -- a long history, its divergence late -------------------------------------


def long_history(path: Path, sessions: int, planted: int) -> int:
    """`sessions` two-turn conversations one after the other, written one
    step a line; the second turn of session `planted` expects a hit no
    lookup can give (a single token). The index of that step."""
    head = (bundled_corpus() / "dense-retention-multiturn.hold-off.yaml").read_text()
    lines = [head.split("steps:\n")[0].replace("dense-retention-multiturn.hold-off", "long")]
    lines.append("steps:\n")
    at = -1
    for k in range(sessions):
        wrong = ", expect: {hit: 1}" if k == planted else ""
        if k == planted:
            at = len(lines) - 2 + 6
        lines += [
            f"  - {{op: arrive, req: A{k}, prompt: [{{fresh: 150}}]}}\n",
            f"  - {{op: prefill, req: A{k}, lookahead: 3}}\n",
            f"  - {{op: decode, req: A{k}, steps: 4, spec: 3}}\n",
            f"  - {{op: free, req: A{k}, how: finish}}\n",
            "  - {op: drain}\n",
            f"  - {{op: arrive, req: B{k}, prompt: [{{all_of: A{k}}}, {{fresh: 26}}]}}\n",
            f"  - {{op: prefill, req: B{k}, lookahead: 3{wrong}}}\n",
            f"  - {{op: free, req: B{k}, how: finish}}\n",
            "  - {op: drain}\n",
        ]
    path.write_text("".join(lines))
    return at


def test_a_long_history_is_shrunk_from_the_prefix_up_to_its_late_divergence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = tmp_path / "long.yaml", tmp_path / "small.yaml"
    at = long_history(path, sessions=150, planted=140)
    assert load_trace(path).steps[at].expect == {"hit": 1}
    handed: list[tuple[int, Shrinker]] = []

    class Watched(Shrinker):
        def __init__(self, trace: Trace, *args: Any) -> None:
            super().__init__(trace, *args)
            handed.append((step_count(trace), self))

    monkeypatch.setattr(shrink_command, "Shrinker", Watched)
    assert cli.main(["shrink", str(path), "--target", "model", "-o", str(out), "-q"]) == EXIT_OK
    # Found by a streamed replay: the shrinker holds the steps up to it, no more.
    [(steps, shrinker)] = handed
    assert steps == at + 1 < 150 * 9
    # The requests that ended long before are dropped in a few replays.
    assert len(shrinker.results) < 60
    shrunk = load_trace(out)
    assert step_count(shrunk) <= 5
    line = capsys.readouterr().out.strip().splitlines()[-1]
    shrunk_to = f"from {150 * 9} steps to {step_count(shrunk)}, diverges on model"
    assert line.startswith(f"{out}: {shrunk_to}")
    factory, _ = gate_factories("model")
    result = run_trace(shrunk, factory, None, "strict", target_is_model=True)
    assert isinstance(result, ReplayResult)
    assert where_and_what(result) == ("lookup", "expect", "hit")


# -- a long Scheduler-level history, its divergence late ----------------------

# The request whose cached tokens the drifted Scheduler below misreports: the
# second turn of a session on the ninth of ten days.
LATE = "d8-s01t02"


@pytest.fixture(scope="module")
def engine_history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The production workload at the Scheduler level, every token count
    divided by 64, its day played ten times: 840 engine steps on 180 lines,
    runs of idle steps written `steps: N`."""
    deployment = Deployment(build="upstream").scaled(64)
    out = tmp_path_factory.mktemp("history")
    return write_engine_trace(Workload(sessions=3, turns=3), deployment, Arm(64, False), out, 10)


class _LateCachedTokens(Wrapped):
    """vLLM's Scheduler, reporting one late request's cached tokens one block
    high at its first output."""

    def take_prefill_stats(self) -> dict[str, tuple[int, int]]:
        stats: dict[str, tuple[int, int]] = self.real.take_prefill_stats()
        return {r: (c + 64 if r == LATE else c, w) for r, (c, w) in stats.items()}


def drifted_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvgate shrink --target vllm` runs on `_LateCachedTokens`."""

    def drifted(target: str, plugin: str | None) -> Any:
        model, build = scheduler_factories(target, plugin)
        assert build is not None
        return model, lambda *settings: _LateCachedTokens(build(*settings))

    monkeypatch.setattr(shrink_command, "scheduler_factories", drifted)


def shrunk_whole_and_streamed(
    path: Path,
    line: int,
    target: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[Trace, Path, str]:
    """`path`, diverging on `target` at written entry `line`, shrunk from the
    whole trace read whole, then streamed: both shrunk alike (the same
    steps, the same account). On vLLM, every line after that entry's is made
    unreadable once the trace is validated: nothing reads them (on the
    model a missed expectation does not end the replay, which reads on).
    The prefix the streamed shrinker was handed, the streamed result and
    its line."""
    lines = path.read_text().splitlines(keepends=True)
    cut = lines.index("engine:\n") + 1 + line + 1
    assert cut + 10 < len(lines)  # late, but well before the end
    out_whole = tmp_path / "from-whole.yaml"
    with monkeypatch.context() as whole_read:
        whole_read.setattr(shrink_command, "stream_trace", lambda path, partial: load_trace(path))
        argv = ["shrink", str(path), "--target", target, "-o", str(out_whole), "-q"]
        assert cli.main(argv) == EXIT_OK
    from_whole = capsys.readouterr().out.strip().splitlines()[-1]

    spoiled, out = tmp_path / "spoiled.yaml", tmp_path / "from-prefix.yaml"
    spoiled.write_text("".join(lines))

    def validated_then_spoiled(trace_path: Path, partial: bool) -> Trace:
        trace = stream_trace(trace_path, partial=partial)
        if target == "vllm":
            rest = ["  - {op: step, steps: spoiled}\n"] * (len(lines) - cut)
            trace_path.write_text("".join(lines[:cut] + rest))
        return trace

    handed: list[Trace] = []

    class Watched(Shrinker):
        def __init__(self, trace: Trace, *args: Any) -> None:
            super().__init__(trace, *args)
            handed.append(trace)

    with monkeypatch.context() as streamed:
        streamed.setattr(shrink_command, "stream_trace", validated_then_spoiled)
        streamed.setattr(shrink_command, "Shrinker", Watched)
        argv = ["shrink", str(spoiled), "--target", target, "-o", str(out), "-q"]
        assert cli.main(argv) == EXIT_OK
    from_prefix = capsys.readouterr().out.strip().splitlines()[-1]
    assert ("steps: spoiled" in spoiled.read_text()) == (target == "vllm")
    assert out.read_text() == out_whole.read_text()
    assert from_prefix.removeprefix(f"{out}: ") == from_whole.removeprefix(f"{out_whole}: ")
    [prefix] = handed
    return prefix, out, from_prefix


@needs_vllm
def test_a_long_scheduler_level_history_is_shrunk_from_the_prefix_up_to_its_late_divergence(
    engine_history: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    whole = load_trace(engine_history)
    planted = run_vllm(whole, _LateCachedTokens)
    assert planted.divergence is not None and "prefill stats" in planted.divergence.what
    line = planted.divergence.step.index  # the written entry it was seen in
    drifted_vllm(monkeypatch)
    prefix, out, account = shrunk_whole_and_streamed(
        engine_history, line, "vllm", tmp_path, monkeypatch, capsys
    )
    # The shrinker held the written entries up to the divergence's, no more:
    # that entry a run of `steps: N` the divergence came in the middle of.
    assert prefix.engine[-1].index == line
    assert planted.steps_run < len(prefix.engine) < len(whole.engine)
    # The account counts the whole history's engine steps.
    assert account.startswith(f"{out}: from {len(whole.engine)} steps to ")
    shrunk = load_trace(out)
    assert step_count(shrunk) <= 10
    assert where_and_what(run_vllm(shrunk, _LateCachedTokens)) == where_and_what(planted)


def late_wrong_expectation(history: Path, path: Path) -> int:
    """`history` written to `path` with the first run of engine steps after
    the late request arrives split, its first step expecting that nothing
    is scheduled (two requests run then): the index of that entry."""
    lines = history.read_text().splitlines(keepends=True)
    body = lines.index("engine:\n") + 1
    arrival = next(i for i, text in enumerate(lines) if f"req: {LATE}," in text)
    at = next(i for i in range(arrival, len(lines)) if "op: step, steps: " in lines[i])
    runs = int(re.sub(r"\D", "", lines[at]))
    lines[at : at + 1] = [
        "  - {op: step, expect: {scheduled: []}}\n",
        f"  - {{op: step, steps: {runs - 1}}}\n",
    ]
    path.write_text("".join(lines))
    return at - body


def test_on_the_model_a_late_wrong_expectation_is_shrunk_from_the_prefix(
    engine_history: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "wrong.yaml"
    line = late_wrong_expectation(engine_history, path)
    prefix, out, account = shrunk_whole_and_streamed(
        path, line, "model", tmp_path, monkeypatch, capsys
    )
    assert prefix.engine[-1].index == line
    assert account.startswith(f"{out}: from {len(load_trace(path).engine)} steps to ")
    result = run_scheduler_trace(load_trace(out), *scheduler_factories("model", None), "strict")
    assert isinstance(result, ReplayResult)
    assert where_and_what(result) == ("step", "expect", "scheduled")


def test_a_scheduler_level_trace_is_cut_after_its_first_missed_expectation(
    engine_history: Path, tmp_path: Path
) -> None:
    path = tmp_path / "wrong.yaml"
    line = late_wrong_expectation(engine_history, path)
    trace = load_trace(path)
    model, _ = scheduler_factories("model", None)

    def judge(candidate: Trace) -> ReplayResult | None:
        result = run_scheduler_trace(candidate, model, None, "strict")
        return result if isinstance(result, ReplayResult) else None

    shrinker = Shrinker(trace, judge, keep_expectations=True)
    reference = shrinker.reference()
    # A missed expectation does not end the replay: it ran every entry.
    assert reference is not None and reference.steps_run == len(trace.engine)
    shrinker.cut_after_divergence()
    expecting = next(i for i, entry in enumerate(trace.engine) if entry.index == line)
    assert len(shrinker.items) == expecting + 1
