"""The gate's verdict per cause, its requirement policy and its exit codes,
against toy targets (the fake's follow-up hits only with the hold on)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from fake_target import HoldlessFake, LeakyFake, fake_trace_text

from kvgate import cli, targets
from kvgate.errors import EXIT_CODES, exit_code_table
from kvgate.vocabulary.config import Config, UnsupportedConfig

DOCS = Path(__file__).parents[1] / "docs" / "gate.md"

# B follows A up: the fake hits 8 of it only with the hold.
FOLLOW_UP = """\
- {op: arrive, req: A, prompt: [{fresh: 40}]}
- {op: prefill, req: A}
- {op: free, req: A, how: finish}
- {op: arrive, req: B, prompt: [{all_of: A}, {fresh: 8}]}
- {op: lookup, req: B, expect: {hit: 8}}
"""
PLAIN = """\
- {op: arrive, req: A, prompt: [{fresh: 40}]}
- {op: prefill, req: A}
- {op: free, req: A, how: finish}
"""


def trace_text(name: str, steps: str, *, hold: bool = False, num_blocks: int = 96) -> str:
    return fake_trace_text(steps, name, hold=hold, num_blocks=num_blocks)


class HoldlessLeakyFake(HoldlessFake, LeakyFake):
    """No hold, and a leak the model does not have: a divergence, whatever
    the trace asks for."""


class RefusesFiftyBlocksFake(HoldlessFake):
    """Refuses a pool of 50 blocks, as a build refuses a config it cannot run."""

    def __init__(self, config: Config) -> None:
        if config.num_blocks == 50:
            raise UnsupportedConfig("num_blocks", "this build runs no pool of 50 blocks")
        super().__init__(config)


def gate(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    corpus: Path,
    target: type,
    *args: str,
) -> tuple[int, list[str], str]:
    monkeypatch.setitem(targets.TARGETS, "model", "fake_target:FakeTarget")
    monkeypatch.setitem(targets.TARGETS, "vllm", f"{__name__}:{target.__name__}")
    code = cli.main(["gate", "--no-bundled", "--corpus", str(corpus), *args])
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    # The corpora line (the test's folder alone) is left out.
    if out[1:2] and out[1].startswith(f"corpora: {corpus}: manager-level "):
        del out[1]
    return code, out, captured.err


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    (tmp_path / "a.yaml").write_text(trace_text("follow-up.hold-on", FOLLOW_UP, hold=True))
    (tmp_path / "b.yaml").write_text(trace_text("plain", PLAIN))
    return tmp_path


def test_a_build_without_the_hold_lacks_it_and_fails_by_default(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], corpus: Path
) -> None:
    junit = corpus / "out.xml"
    code, out, err = gate(monkeypatch, capsys, corpus, HoldlessFake, "--junit-xml", str(junit))
    assert code == 4 and err == ""
    assert out[1].startswith("LACKS follow-up.hold-on (hold: ")
    assert out[2].startswith("PASS plain (")
    assert "first divergence" not in "\n".join(out)  # the gate shows the cause, not each miss
    lacks = next(line for line in out if line.startswith("lacks hold: "))
    assert lacks.startswith("lacks hold: 1 traces need the partial-tail hold, which this build")
    assert "cost: 1 lookups miss their cached prefix entirely (8 cached tokens" in lacks
    assert "remedy: serve with kvgate's hold overlay" in lacks
    assert "VLLM_E2_MAMBA_RETAIN_CHECKPOINT=1 (gate that with --plugin entry-points)" in lacks
    assert lacks.endswith("required (--require hold): fails the gate")
    assert out[-2].startswith("verdict: exit 4: ")
    assert out[-1] == "1 passed, 0 failed, 1 lacking a capability"
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("2", "1", "0")
    failure = suite.find("testcase/failure")
    assert failure is not None and failure.get("type") == "lacks a required capability: hold"


def test_require_none_gates_the_builds_own_semantics(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], corpus: Path
) -> None:
    junit = corpus / "out.xml"
    code, out, _ = gate(
        monkeypatch, capsys, corpus, HoldlessFake, "--require", "none", "--junit-xml", str(junit)
    )
    assert code == 0
    assert any(line.endswith("not required: reported only") for line in out)
    assert out[-1] == "1 passed, 0 failed, 1 lacking a capability"
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and (suite.get("failures"), suite.get("skipped")) == ("0", "1")


def test_a_divergence_from_the_model_is_never_a_missing_capability(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], corpus: Path
) -> None:
    # The trace asks for the hold the build lacks, but the build also
    # differs from the hold-off model: that is a divergence.
    code, out, _ = gate(monkeypatch, capsys, corpus, HoldlessLeakyFake, "--require", "none")
    assert code == 1
    assert out[1].startswith("FAIL follow-up.hold-on (")
    assert out[-1].startswith("0 passed, 2 failed")


def test_a_missed_expectation_of_a_trace_that_asks_for_nothing_diverges(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The same expectation without the hold asked for: the build misses it
    # for no capability's sake.
    (tmp_path / "a.yaml").write_text(trace_text("follow-up", FOLLOW_UP))
    code, out, _ = gate(monkeypatch, capsys, tmp_path, HoldlessFake, "--require", "none")
    assert code == 1 and out[1].startswith("FAIL follow-up (")
    assert not any(line.startswith("lacks ") for line in out)


def test_a_config_the_target_refuses_is_not_applicable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], corpus: Path
) -> None:
    (corpus / "c.yaml").write_text(trace_text("small-pool", PLAIN, num_blocks=50))
    code, out, err = gate(monkeypatch, capsys, corpus, RefusesFiftyBlocksFake, "--require", "none")
    assert code == 0 and err == ""
    assert out[3] == (
        f"SKIP small-pool (not applicable, the target refuses the config: {corpus / 'c.yaml'}: "
        "config.num_blocks: this build runs no pool of 50 blocks)"
    )
    assert out[-1] == "1 passed, 0 failed, 1 lacking a capability, 1 not applicable"
    # A run in which no trace applies checked nothing: bad input.
    for path in (corpus / "a.yaml", corpus / "b.yaml"):
        path.unlink()
    code, out, err = gate(monkeypatch, capsys, corpus, RefusesFiftyBlocksFake)
    assert code == 2 and err.startswith("kvgate: error: ") and err.count("\n") == 1


def test_an_unknown_requirement_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], corpus: Path
) -> None:
    code, out, err = gate(monkeypatch, capsys, corpus, HoldlessFake, "--require", "hold,speed")
    assert code == 2 and out == []
    assert err == (
        "kvgate: error: --require: unknown capability 'speed' (choose from hold, retention, none)\n"
    )


def test_the_exit_code_table_is_the_one_help_and_docs_show(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["gate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert " ".join(exit_code_table().split()) in help_text
    rows = re.findall(r"^\| `(\d)` \| (.*) \|$", DOCS.read_text(), re.MULTILINE)
    assert [(int(code), meaning) for code, meaning in rows] == list(EXIT_CODES)


def test_a_kind_of_trace_none_of_which_ran_is_said_once() -> None:
    """When the target refuses every scheduler-level trace's config (e.g. a
    release whose Scheduler needs Triton on this machine), the report says
    the Scheduler was not gated, and why, besides the count."""
    from configs import SMALL_SCHEDULER_TRACE_HEAD

    from kvgate.conformance.replay import TraceRunError
    from kvgate.conformance.report import unrun_corpus_lines
    from kvgate.conformance.trace import parse_trace

    steps = "  - {op: arrive, req: A, prompt: [{fresh: 8}], max_tokens: 1}\n"
    refused = [
        TraceRunError(
            parse_trace(SMALL_SCHEDULER_TRACE_HEAD.format(name=name) + steps, f"{name}.yaml"),
            f"{name}.yaml: config.groups: vLLM's Scheduler rejects it: needs Triton",
            bug=False,
            config_refused=True,
        )
        for name in ("s1", "s2")
    ]
    assert unrun_corpus_lines(refused) == [
        "scheduler-level traces: none of the 2 ran, the target refuses their config (the "
        "first: config.groups: vLLM's Scheduler rejects it: needs Triton); vLLM's Scheduler "
        "is not gated by this run",
        "",
    ]
    ran = parse_trace(SMALL_SCHEDULER_TRACE_HEAD.format(name="s3") + steps, "s3.yaml")
    failed = TraceRunError(ran, "s3.yaml: step 0: req: refused", bug=False)
    assert unrun_corpus_lines([*refused, failed]) == []


def test_quiet_lists_a_lacking_trace_only_when_it_fails_the_gate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], corpus: Path
) -> None:
    code, out, _ = gate(monkeypatch, capsys, corpus, HoldlessFake, "--require", "none", "-q")
    assert code == 0
    assert not any(line.startswith(("LACKS", "PASS", "target:", "corpora:")) for line in out)
    assert any(line.startswith("lacks hold: 1 traces need ") for line in out)
    assert out[-1] == "1 passed, 0 failed, 1 lacking a capability"
    code, out, _ = gate(monkeypatch, capsys, corpus, HoldlessFake, "-q")
    assert code == 4
    assert [line.split(" ")[0] for line in out if line.startswith(("LACKS", "PASS"))] == ["LACKS"]
