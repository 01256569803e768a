"""Replay in lockstep, the report and the command line, against toy targets."""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from command_runs import run_python
from fake_target import (
    FakeTarget,
    HoldlessFake,
    IdleFake,
    IntOkFake,
    LeakyFake,
    RaisingFake,
    RefusingFake,
    ReversedQueueFake,
    SilentFake,
    StingyFake,
    fake_trace_text,
)

from kvgate import cli, targets
from kvgate.conformance.compare import NOT_REPORTED, same
from kvgate.conformance.replay import (
    HOLD_NOTE,
    Divergence,
    Level,
    ModelBug,
    ReplayResult,
    TargetFactory,
    replay,
)
from kvgate.conformance.report import (
    divergence_lines,
    show_pair,
    summary_line,
    trace_line,
    write_junit,
)
from kvgate.conformance.trace import Trace, TraceError, parse_trace
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.target import Target


def make_trace(steps: str, *, num_blocks: int = 96, hold: bool = False, name: str = "t") -> Trace:
    return parse_trace(
        fake_trace_text(steps, name, hold=hold, num_blocks=num_blocks), f"{name}.yaml"
    )


# A's prompt is 150 tokens: the fake computes it in chunks of 64, 64 and 22.
LIFE = """\
- {op: arrive, req: A, prompt: [{fresh: 150}]}
- {op: prefill, req: A, lookahead: 3, expect: {hit: 0}}
- {op: decode, req: A, steps: 2, spec: 3}
- {op: free, req: A, how: finish}
- {op: drain}
- {op: check, pool_clean: true, free_blocks: 95, holds: {}}
"""

FOLLOW_UP = """\
- {op: arrive, req: A, prompt: [{fresh: 40}]}
- {op: prefill, req: A}
- {op: free, req: A, how: finish}
- {op: arrive, req: B, prompt: [{all_of: A}, {fresh: 8}]}
"""


def run(
    steps: str,
    target: type[FakeTarget] = FakeTarget,
    model: TargetFactory | None = FakeTarget,
    level: Level = "strict",
    **trace_options: int | bool,
) -> tuple[ReplayResult, FakeTarget]:
    trace = make_trace(steps, **trace_options)  # type: ignore[arg-type]
    instance = target(trace.config)
    return replay(trace, instance, model, level), instance


def diverges(
    steps: str,
    target: type[FakeTarget] = FakeTarget,
    model: TargetFactory | None = FakeTarget,
    level: Level = "strict",
    **trace_options: int | bool,
) -> Divergence:
    """The first divergence of `run`, which must diverge."""
    result, _ = run(steps, target, model, level, **trace_options)
    assert result.divergence is not None
    return result.divergence


def test_a_conforming_trace_passes() -> None:
    result, target = run(LIFE)
    assert result.passed and result.divergence is None
    # arrive, prefill (lookup + 3 rounds of 3), 2 decodes of 3, free, drain, check
    assert result.steps_run == 1 + 10 + 6 + 3
    assert result.capabilities == target.capabilities
    assert result.notes == ()


def test_prefill_repeats_its_round_until_the_target_reports_the_prompt_done() -> None:
    _, target = run(LIFE)
    assert target.seen[1:11] == [
        "step 1 (prefill: lookup #1)",
        "step 1 (prefill: allocate #2)",
        "step 1 (prefill: step #3)",
        "step 1 (prefill: drain #4)",
        "step 1 (prefill: allocate #5)",
        "step 1 (prefill: step #6)",
        "step 1 (prefill: drain #7)",
        "step 1 (prefill: allocate #8)",
        "step 1 (prefill: step #9)",
        "step 1 (prefill: drain #10)",
    ]
    assert target.seen[11] == "step 2 (decode: decode1 #1)"


def test_an_expect_value_the_target_misses_is_a_divergence_at_level_expect() -> None:
    result, _ = run(LIFE.replace("expect: {hit: 0}", "expect: {hit: 8}"))
    d = result.divergence
    assert d is not None
    assert (d.level, d.what, d.expected, d.actual) == ("expect", "hit", 8, 0)
    assert d.step.where() == "step 1 (prefill: lookup #1)"
    assert d.trace == "t" and d.path == Path("t.yaml")
    # A missed expectation desynchronises nothing: the replay runs to the end.
    assert result.steps_run == 20 and not result.passed and result.also == ()


def test_later_missed_expectations_are_kept_after_the_first() -> None:
    trace = LIFE.replace("expect: {hit: 0}", "expect: {hit: 8}").replace(
        "free_blocks: 95", "free_blocks: 90"
    )
    result, _ = run(trace)
    assert result.divergence is not None and result.divergence.what == "hit"
    assert [(d.what, d.expected, d.actual) for d in result.also] == [("check free_blocks", 90, 95)]


def test_expect_compares_booleans_as_booleans() -> None:
    steps = "- {op: arrive, req: A, prompt: [{fresh: 8}]}\n"
    steps += "- {op: allocate, req: A, tokens: 8, expect: {ok: true, tokens: 8}}\n"
    assert run(steps)[0].passed
    failing, _ = run(steps, IntOkFake, None)
    d = failing.divergence
    assert d is not None and (d.what, d.expected, d.actual) == ("ok", True, 1)


def test_same_is_equality_of_observed_values() -> None:
    assert same([[1, 2]], ((1, 2),))
    assert same({"A": {1: 8}}, {"A": {1: 8}})
    assert not same(True, 1)
    assert not same([0], [False])
    assert not same([1, 2], [1, 2, 3])


def test_the_model_catches_what_the_trace_does_not_say_at_level_api() -> None:
    result, _ = run(
        LIFE.replace("- {op: check, pool_clean: true, free_blocks: 95, holds: {}}\n", ""), LeakyFake
    )
    d = result.divergence
    assert d is not None
    assert (d.level, d.what, d.expected, d.actual) == ("api", "free_blocks", 95, 94)
    assert d.step.where() == "step 3 (free)"
    # Without the lockstep model nothing compares free_blocks there.
    alone, _ = run(
        LIFE.replace("- {op: check, pool_clean: true, free_blocks: 95, holds: {}}\n", ""),
        LeakyFake,
        None,
    )
    assert alone.passed


def test_strict_compares_snapshots_that_api_does_not() -> None:
    assert run(LIFE, ReversedQueueFake, level="api")[0].passed
    d = diverges(LIFE, ReversedQueueFake, level="strict")
    assert (d.level, d.what) == ("strict", "free queue")
    assert d.step.where() == "step 0 (arrive)"


def test_an_exception_in_the_target_is_a_divergence_not_a_crash() -> None:
    d = diverges(LIFE, RaisingFake)
    assert (d.level, d.what, d.actual) == ("api", "exception", "RuntimeError: boom in decode")
    assert d.note == "raised by the target"
    assert d.step.where() == "step 2 (decode: decode1 #1)"


def test_an_exception_in_the_model_is_kvgates_bug_not_the_targets() -> None:
    with pytest.raises(ModelBug) as bug:
        run(LIFE, FakeTarget, RaisingFake)
    assert str(bug.value) == (
        "t.yaml: step 2 (decode: decode1 #1): the kvgate model raised RuntimeError: "
        "boom in decode; this is a bug in kvgate, not in the target: please report it "
        "with this trace"
    )


SHORT_POOL = """\
- {op: arrive, req: A, prompt: [{fresh: 150}]}
- {op: prefill, req: A}
"""


@pytest.mark.parametrize("model", [FakeTarget, None])
def test_a_prefill_that_cannot_allocate_stalls(model: TargetFactory | None) -> None:
    # Two usable blocks: the third chunk finds none, on both sides.
    d = diverges(SHORT_POOL, FakeTarget, model, num_blocks=3)
    assert (d.level, d.what) == ("expect", "prefill stalled")
    assert d.step.where() == "step 1 (prefill: allocate #8)"


def test_an_allocate_that_computes_nothing_stalls_the_prefill() -> None:
    d = diverges(SHORT_POOL, IdleFake, None)
    assert (d.what, d.actual) == ("prefill stalled", "ok True, tokens 0")
    assert d.step.where() == "step 1 (prefill: allocate #2)"


def test_allocate_must_report_prompt_done() -> None:
    d = diverges(SHORT_POOL, SilentFake, None)
    assert (d.level, d.what, d.actual) == ("api", "prompt_done", NOT_REPORTED)


def test_a_failed_allocate_the_model_ran_is_an_api_divergence() -> None:
    d = diverges(SHORT_POOL, StingyFake)
    assert (d.level, d.what, d.expected, d.actual) == ("api", "ok", True, False)


BURST = """\
- {op: arrive, req: A, prompt: [{fresh: 150}]}
- {op: prefill, req: A}
- {op: evict, blocks: 95}
"""


@pytest.mark.parametrize("model", [FakeTarget, None])
def test_a_refused_step_is_the_traces_fault(model: TargetFactory | None) -> None:
    with pytest.raises(TraceError) as error:
        run(BURST, FakeTarget, model)
    assert str(error.value) == "t.yaml: step 2: blocks: 95 blocks asked, 92 free"


def test_a_target_refusing_what_the_model_ran_diverges() -> None:
    d = diverges(BURST.replace("95}", "5}"), RefusingFake)
    assert (d.level, d.what) == ("api", "refused")
    assert d.actual == "blocks: this target refuses every burst"


def test_a_check_compares_the_targets_values_with_the_trace() -> None:
    d = diverges(LIFE.replace("free_blocks: 95", "free_blocks: 90"))
    assert (d.level, d.what, d.expected, d.actual) == ("expect", "check free_blocks", 90, 95)
    assert d.step.where() == "step 5 (check)"


def test_a_check_key_the_target_cannot_observe_is_refused_by_name() -> None:
    with pytest.raises(TraceError, match=r"t.yaml: step 5: ref: not observable on fake"):
        run(LIFE.replace("holds: {}", "ref: {A: {1: {8: 0}}}"))


def test_a_target_without_the_hold_gets_a_lockstep_model_without_it() -> None:
    built: list[Config] = []

    def model(config: Config) -> Target:
        built.append(config)
        return FakeTarget(config)

    # No expectation: the target and the hold-off model agree (hit 0), so it passes;
    # a hold-on model would have hit 8 at B's lookup.
    steps = FOLLOW_UP + "- {op: lookup, req: B}\n"
    result, _ = run(steps, HoldlessFake, model, hold=True)
    assert result.passed
    assert built[0].hold is False
    assert result.notes == (HOLD_NOTE,)
    # The trace's own expectation still judges the target.
    failing, _ = run(
        steps.replace("req: B}", "req: B, expect: {hit: 8}}"), HoldlessFake, model, hold=True
    )
    d = failing.divergence
    assert d is not None and (d.level, d.what, d.expected, d.actual) == ("expect", "hit", 8, 0)
    assert failing.notes == (HOLD_NOTE,)


def test_a_target_with_the_hold_keeps_it_in_the_model() -> None:
    built: list[Config] = []

    def model(config: Config) -> Target:
        built.append(config)
        return FakeTarget(config)

    result, _ = run(
        FOLLOW_UP + "- {op: lookup, req: B, expect: {hit: 8}}\n", FakeTarget, model, hold=True
    )
    assert result.passed and result.notes == ()
    assert built[0].hold is True


# -- report -------------------------------------------------------------------


def test_report_lines() -> None:
    passed, _ = run(LIFE)
    failed, _ = run(LIFE, RaisingFake)
    assert trace_line(passed).startswith("PASS t (20 steps, ")
    assert trace_line(failed).startswith("FAIL t (")
    assert summary_line([passed, failed, passed]) == "2 passed, 1 failed"
    lines = divergence_lines(failed)
    assert lines[0] == "t: first divergence at step 2 (decode: decode1 #1), level api"
    assert "RuntimeError: boom in decode" in lines[3]
    assert divergence_lines(passed) == []


def test_long_sequences_show_only_where_they_differ() -> None:
    expected = tuple(range(100))
    actual = expected[:40] + (999,) + expected[41:]
    shown_expected, shown_actual = show_pair(expected, actual)
    assert shown_expected == "len 100: [40]=40"
    assert shown_actual == "len 100: [40]=999"
    assert show_pair(3, 4) == ("3", "4")


def test_junit_has_one_testcase_per_trace(tmp_path: Path) -> None:
    passed, _ = run(LIFE)
    failed, _ = run(LIFE, RaisingFake)
    path = tmp_path / "junit.xml"
    write_junit([passed, failed], path)
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1")
    cases = suite.findall("testcase")
    assert [c.find("failure") is None for c in cases] == [True, False]
    failure = cases[1].find("failure")
    assert failure is not None
    assert "RuntimeError: boom in decode" in (failure.get("message") or "")


# -- command line ---------------------------------------------------------------


@pytest.fixture
def fake_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(targets.TARGETS, "model", "fake_target:FakeTarget")
    monkeypatch.setitem(targets.TARGETS, "vllm", "fake_target:PluginFake")


def write(path: Path, steps: str, name: str) -> Path:
    header = make_trace(steps, name=name)  # validate before writing
    assert header.name == name
    text = textwrap.dedent(
        f"""\
        format: kvgate-trace/1
        name: {name}
        config:
          num_blocks: 96
          hash_unit: 8
          retention_interval: 0
          groups:
            - {{kind: full_attention, block_size: 8}}
            - {{kind: mamba_align, block_size: 32, speculative_blocks: 3}}
        steps:
        """
    )
    path.write_text(text + textwrap.indent(textwrap.dedent(steps), "  "))
    return path


@pytest.mark.usefixtures("fake_targets")
def test_gate_passes_a_conforming_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path / "a.yaml", LIFE, "life")
    junit = tmp_path / "out.xml"
    code = cli.main(
        [
            "gate",
            "--no-bundled",
            "--corpus",
            str(tmp_path),
            "--plugin",
            "my.hold",
            "--junit-xml",
            str(junit),
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0] == "target: fake (partial hits: yes, hold: yes (plugin my.hold))"
    assert out[1] == f"corpora: {tmp_path}: manager-level 1 traces, scheduler-level 0 traces"
    assert out[2].startswith("PASS life (20 steps, ")
    assert out[-1] == "1 passed, 0 failed"
    assert junit.exists()


@pytest.mark.usefixtures("fake_targets")
def test_gate_exits_1_on_a_divergence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(targets.TARGETS, "vllm", "fake_target:RaisingFake")
    write(tmp_path / "a.yaml", LIFE, "life")
    write(tmp_path / "b.yaml", FOLLOW_UP, "follow-up")
    assert cli.main(["gate", "--no-bundled", "--corpus", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    out = captured.out.splitlines()
    assert out[2].startswith("FAIL life (")
    assert out[3].startswith("PASS follow-up (")
    assert "  actual:   RuntimeError: boom in decode" in out
    assert out[-1] == "1 passed, 1 failed"


@pytest.mark.usefixtures("fake_targets")
@pytest.mark.parametrize(
    ("target", "error"),
    [
        # The target refuses the trace's config.
        (
            "fake_target:GroupsRefusedFake",
            "{path}: config.groups: this target runs no Mamba groups\n",
        ),
        # The target cannot be imported here.
        ("kvgate.no_such_module:Target", "--target vllm: not available here (ModuleNotFoundError"),
    ],
    ids=["config refused", "unavailable"],
)
def test_a_target_that_cannot_run_the_trace_is_an_input_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    target: str,
    error: str,
) -> None:
    monkeypatch.setitem(targets.TARGETS, "vllm", target)
    path = write(tmp_path / "a.yaml", LIFE, "life")
    assert cli.main(["replay", str(path), "--target", "vllm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate: error: " + error.format(path=path)), err
    assert err.count("\n") == 1, err


@pytest.mark.usefixtures("fake_targets")
def test_plugin_only_applies_to_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "a.yaml", LIFE, "life")
    assert cli.main(["replay", str(path), "--target", "model", "--plugin", "x"]) == 2
    assert capsys.readouterr().err == "kvgate: error: --plugin: only --target vllm loads plugins\n"


def test_target_model_does_not_import_vllm(tmp_path: Path) -> None:
    path = write(tmp_path / "a.yaml", LIFE, "life")
    program = textwrap.dedent(
        f"""\
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from kvgate import cli, targets
        targets.TARGETS["model"] = "fake_target:FakeTarget"
        code = cli.main(["replay", {str(path)!r}, "--target", "model"])
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch"))
        print("exit", code, "loaded", loaded)
        """
    )
    run_ = run_python("-c", program, timeout=120)
    assert run_.stdout.splitlines()[-1] == "exit 0 loaded []", run_.stdout + run_.stderr
