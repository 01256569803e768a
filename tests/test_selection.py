"""Selecting traces (`-k`, `--arm`, `--family`, `--list`) and listing every
invalid one while the valid ones still run."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from fake_target import fake_trace_text

from kvgate import cli, targets
from kvgate.conformance.selection import (
    SelectionError,
    arm,
    classname,
    family,
    keyword_matcher,
    trace_family,
)
from kvgate.conformance.trace import TraceError, bundled_corpus, load_trace, parse_trace

PLAIN = """\
- {op: arrive, req: A, prompt: [{fresh: 40}]}
- {op: prefill, req: A}
- {op: free, req: A, how: finish}
"""


@pytest.mark.parametrize(
    ("expression", "selected"),
    [
        ("seed1", ["seed1-turn.hold-on", "seed1-turn.hold-off"]),
        ("SEED1 and not hold-on", ["seed1-turn.hold-off"]),
        ("agent", ["seed1-turn.hold-on", "other"]),
        ("(seed1 or other) and not agent", ["seed1-turn.hold-off"]),
        ("not not other", ["other"]),
        ("", ["seed1-turn.hold-on", "seed1-turn.hold-off", "other"]),
        ("seed", ["seed1-turn.hold-on", "seed1-turn.hold-off"]),
    ],
)
def test_k_matches_substrings_of_names_and_tags_as_pytest_does(
    expression: str, selected: list[str]
) -> None:
    keywords = {
        "seed1-turn.hold-on": ("seed1-turn.hold-on", "agent"),
        "seed1-turn.hold-off": ("seed1-turn.hold-off",),
        "other": ("other", "agent"),
    }
    matches = keyword_matcher(expression)
    assert [name for name, words in keywords.items() if matches(words)] == selected


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("seed1 and", "'seed1 and': ends where a word was expected"),
        ("(seed1 or x", "'(seed1 or x': ends where a word was expected"),
        ("seed1 )", "'seed1 )': unexpected ')'"),
        ("a & b", "'a & b': unexpected character '&'"),
        ("and a", "'and a': unexpected 'and'"),
    ],
)
def test_an_unreadable_k_is_one_line(expression: str, error: str) -> None:
    with pytest.raises(SelectionError) as raised:
        keyword_matcher(expression)
    assert str(raised.value) == error


def test_family_and_arm_come_from_the_config_not_the_file_name(tmp_path: Path) -> None:
    # A hold-on FlashInfer trace in a file named like a hold-off Triton one.
    source = bundled_corpus() / "gdn-flashinfer-next-turn-after-burst.hold-on.yaml"
    misnamed = tmp_path / "gdn-triton-x.hold-off.yaml"
    shutil.copy(source, misnamed)
    trace = load_trace(misnamed)
    assert (family(trace.config), arm(trace.config)) == ("gdn-flashinfer", "hold-on")
    fork = load_trace(bundled_corpus() / "seed1-next-turn-after-burst.fork.hold-off.yaml")
    assert (family(fork.config), arm(fork.config)) == ("gdn-triton", "fork")
    mamba2 = load_trace(bundled_corpus() / "mamba2-next-turn-after-burst.hold-off.yaml")
    assert (family(mamba2.config), arm(mamba2.config)) == ("mamba2", "hold-off")


RECORDING = """\
format: kvgate-trace/1
name: rec
config:
  num_blocks: 16
  hash_unit: 16
  eagle: false
  retention_interval: 0
  retain_checkpoint: false
  groups:
  - {kind: mamba_align, block_size: 16, speculative_blocks: 0}
  - {kind: full_attention, block_size: 16}
scheduler: {spec: 0, max_num_seqs: 4}
recording: {vllm: 0.32.0, part: 1, device: cpu}
engine:
  - {op: arrive, req: r0, prompt: [{fresh: 20}], max_tokens: 2}
end: {entries: 1}
"""


def test_a_recording_of_vllm_s_cpu_build_is_of_the_gdn_cpu_family() -> None:
    """A GDN hybrid without prefill checkpoints is `gdn-triton` by its config;
    recorded on vLLM's CPU build (its header names the device) its layers ran
    on the CPU kernels: `gdn-cpu`, in the JUnit class and for `--family`."""
    cpu = parse_trace(RECORDING)
    assert (family(cpu.config), trace_family(cpu)) == ("gdn-triton", "gdn-cpu")
    assert classname(cpu) == "kvgate.gdn-cpu.hold-off"
    unnamed = parse_trace(RECORDING.replace(", device: cpu", ""))
    assert (unnamed.device, classname(unnamed)) == ("", "kvgate.gdn-triton.hold-off")
    cuda = parse_trace(RECORDING.replace("device: cpu", "device: cuda"))
    assert classname(cuda) == "kvgate.gdn-triton.hold-off"
    with pytest.raises(TraceError, match=r"recording\.device: must be a device name"):
        parse_trace(RECORDING.replace("device: cpu", "device: CPU!"))


def test_list_prints_the_selection_and_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        ["gate", "--collect-only", "-k", "seed and multi-turn", "--arm", "hold-on", "--arm", "fork"]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line.split(" ")[:2] for line in out[:-1]] == [
        ["seed1-next-turn-after-burst.fork.hold-off", "(kvgate.gdn-triton.fork,"],
        ["seed1-next-turn-after-burst.fork.hold-on", "(kvgate.gdn-triton.fork,"],
        ["seed1-next-turn-after-burst.hold-on", "(kvgate.gdn-triton.hold-on,"],
    ]
    assert out[-1] == "3 traces selected"
    cli.main(["gate", "--list", "--family", "mamba2", "--arm", "fork"])
    listed = capsys.readouterr().out.splitlines()
    # Three manager-level traces and two scheduler-level ones (on Triton the
    # retention alone changes nothing, so that family has no fork-only one).
    assert listed[-1] == "5 traces selected"
    assert sum(line.startswith("sched-mamba2-") for line in listed) == 2
    assert all("(kvgate.mamba2.fork" in line for line in listed[:-1])


def test_tags_must_be_words() -> None:
    text = fake_trace_text(PLAIN, "t")
    assert parse_trace(text.replace("name: t\n", "name: t\ntags: [a, b-c]\n")).tags == ("a", "b-c")
    for tags, error in [
        ("a", "tags: must be a list of words, got 'a'"),
        ("[a, 'b c']", "tags[1]: must be a word of letters, digits and _ . + -"),
        ("[a, a]", "tags[1]: 'a' is listed twice"),
    ]:
        with pytest.raises(TraceError) as raised:
            parse_trace(text.replace("name: t\n", f"name: t\ntags: {tags}\n"))
        assert error in str(raised.value)


def test_a_selection_of_nothing_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["gate", "-k", "no-such-trace", "--target", "model"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "kvgate: error: no trace selected (-k, --arm, --family): nothing to gate\n"
    )
    assert cli.main(["gate", "-k", "a and", "--target", "model"]) == 2
    assert capsys.readouterr().err == (
        "kvgate: error: -k: 'a and': ends where a word was expected\n"
    )


# Ten ways to break a trace, each a one-line error naming file, step, field.
BROKEN: list[tuple[str, str]] = [
    ("not: [yaml", "yaml"),
    ("format: kvgate-trace/2\nname: x\nconfig: {}\nsteps: []\n", "format:"),
    (fake_trace_text(PLAIN, "b03").replace("num_blocks: 96", "num_blocks: -1"), "num_blocks"),
    (fake_trace_text("- {op: lookup, req: A}\n", "b04"), "step 0: req:"),
    (fake_trace_text("- {op: fly, req: A}\n", "b05"), "step 0: op:"),
    (fake_trace_text(PLAIN, "b06").replace("name: b06\n", "name: b06\nshape: round\n"), "shape"),
    (fake_trace_text(PLAIN, "PASS b07"), "name: may not start with a verdict word"),
    (fake_trace_text(PLAIN, "b08").replace("name: b08\n", "name: b08\ntags: [a, a]\n"), "tags[1]"),
    (fake_trace_text(PLAIN, "a-good"), "name: 'a-good' is also the name of"),
    (fake_trace_text(PLAIN + "- {op: free, req: A, how: finish}\n", "b10"), "step 3"),
]


def test_every_invalid_trace_is_listed_and_every_valid_one_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(targets.TARGETS, "model", "fake_target:FakeTarget")
    monkeypatch.setitem(targets.TARGETS, "vllm", "fake_target:FakeTarget")
    (tmp_path / "a-good.yaml").write_text(fake_trace_text(PLAIN, "a-good"))
    (tmp_path / "z-good.yaml").write_text(fake_trace_text(PLAIN, "z-good", hold=True))
    for i, (text, _) in enumerate(BROKEN):
        (tmp_path / f"b{i:02}.yaml").write_text(text)
    junit = tmp_path.parent / "gate.xml"
    code = cli.main(["gate", "--no-bundled", "--corpus", str(tmp_path), "--junit-xml", str(junit)])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.out + captured.err
    errors = captured.err.splitlines()
    assert len(errors) == len(BROKEN)
    for i, (line, (_, field)) in enumerate(zip(errors, BROKEN, strict=True)):
        assert line.startswith(f"kvgate: error: {tmp_path / f'b{i:02}.yaml'}: "), line
        assert field in line, (line, field)
    out = captured.out.splitlines()
    assert sum(line.startswith("ERROR ") for line in out) == len(BROKEN)
    assert [line.split(" ")[:2] for line in out if line.startswith("PASS")] == [
        ["PASS", "a-good"],
        ["PASS", "z-good"],
    ]
    assert out[-1] == "2 passed, 0 failed, 10 errors"
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and (suite.get("tests"), suite.get("errors")) == ("12", "10")
    classes = sorted({case.get("classname", "") for case in suite.iter("testcase")})
    assert classes == ["kvgate.gdn-triton.hold-off", "kvgate.gdn-triton.hold-on", "kvgate.invalid"]
    # `--list` lists them too, and exits 2 as pytest's collection does.
    assert cli.main(["gate", "--no-bundled", "--corpus", str(tmp_path), "--list"]) == 2
    listed = capsys.readouterr()
    assert listed.out.splitlines()[-1] == "2 traces selected, 10 invalid"
    assert len(listed.err.splitlines()) == len(BROKEN)
    # `replay` of named files: the same.
    paths = sorted(str(p) for p in tmp_path.glob("*.yaml"))
    assert cli.main(["replay", *paths, "--target", "model"]) == 2
    replayed = capsys.readouterr()
    assert replayed.out.splitlines()[-1] == "2 passed, 0 failed, 10 errors"
