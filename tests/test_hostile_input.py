"""Hostile and absurd input (issue 13): every case the robustness audit found,
re-run by name, one test each. Each must end in one line on stderr (or an
ERROR line for a trace refused while it runs), a defined exit code and no
traceback; nothing impossible may pass.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from configs import EXAMPLE_TRACE_CONFIG, trace_text

from kvgate import cli
from kvgate.conformance.replay import RETIRE_NOTE
from kvgate.conformance.trace import bundled_corpus, parse_trace

CONFIG = EXAMPLE_TRACE_CONFIG
ARRIVE = "- {op: arrive, req: A, prompt: [{fresh: 100}]}\n"


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str
    seconds: float

    def one_error_line(self, code: int = 2) -> str:
        """The run ended with `code` and exactly one stderr line, no traceback."""
        assert self.code == code, (self.code, self.out, self.err)
        assert "Traceback" not in self.out + self.err
        assert self.err.count("\n") == 1 and self.err.endswith("\n"), self.err
        return self.err


@pytest.fixture
def kvgate(capsys: pytest.CaptureFixture[str]) -> Callable[..., Run]:
    def run(*argv: str) -> Run:
        started = time.perf_counter()
        code = cli.main(list(argv))
        seconds = time.perf_counter() - started
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err, seconds)

    return run


def write(tmp_path: Path, text: str, name: str = "t.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- 1. tracebacks --------------------------------------------------------------


def test_nesting_1000_levels_deep_is_one_line(kvgate: Callable[..., Run], tmp_path: Path) -> None:
    path = write(tmp_path, trace_text(ARRIVE) + "about: " + "[" * 1000 + "]" * 1000 + "\n")
    assert "yaml" in kvgate("replay", path, "--target", "model").one_error_line()


def test_nesting_500_levels_and_a_yaml_error_is_one_line(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    # libyaml reads this far, fails on the error, and the pure-Python loader
    # (which recurses per level) words the error: the nesting is measured first.
    path = write(tmp_path, trace_text(ARRIVE) + "about: " + "[" * 500 + "]" * 499 + "}\n")
    err = kvgate("replay", path, "--target", "model").one_error_line()
    assert "collections nest deeper than the limit nesting = 32" in err


def test_an_int_of_5000_digits_is_one_line(kvgate: Callable[..., Run], tmp_path: Path) -> None:
    path = write(tmp_path, trace_text(ARRIVE, CONFIG.replace("96", "9" * 5000)))
    err = kvgate("replay", path, "--target", "model").one_error_line()
    assert "integer of 5000 digits (at most 20)" in err


def test_dev_zero_as_a_trace_is_refused_without_reading(kvgate: Callable[..., Run]) -> None:
    run = kvgate("replay", "/dev/zero", "--target", "model")
    assert run.one_error_line() == (
        "kvgate: error: /dev/zero: file: is not a regular file; "
        "a trace is read from a regular file only\n"
    )


def test_workload_out_inside_proc_is_one_line(kvgate: Callable[..., Run]) -> None:
    run = kvgate("workload", "--target", "model", "--scale", "16", "--out", "/proc/kvgate-out")
    assert run.one_error_line().startswith("kvgate: error: --out: cannot write in /proc/kvgate-out")


def test_workload_out_at_an_existing_file_is_one_line(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    existing = write(tmp_path, "not a directory", "file.txt")
    run = kvgate("workload", "--target", "model", "--scale", "16", "--out", existing)
    assert (
        run.one_error_line() == f"kvgate: error: --out: {existing} exists and is not a directory\n"
    )


def test_workload_turns_100000_is_refused(kvgate: Callable[..., Run], tmp_path: Path) -> None:
    run = kvgate("workload", "--target", "model", "--turns", "100000", "--out", str(tmp_path))
    assert run.one_error_line() == "kvgate: error: --turns: 100000 is outside 1..16\n"


def test_prove_blocks_100000_is_refused(kvgate: Callable[..., Run]) -> None:
    run = kvgate("prove", "--blocks", "100000")
    assert run.one_error_line() == "kvgate: error: --blocks: 100000 is more than 32\n"


# -- 2. hangs and unbounded memory ----------------------------------------------


def test_a_fifo_as_a_trace_is_refused_without_blocking(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    fifo = tmp_path / "t.yaml"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    # Were the FIFO opened, the run would block for a writer: give it one
    # after a while, so a regression fails this test instead of hanging it.
    rescue = threading.Timer(10.0, lambda: fifo.open("w").close())
    rescue.start()
    try:
        run = kvgate("replay", str(fifo), "--target", "model")
    finally:
        rescue.cancel()
    assert run.one_error_line().endswith(
        "is not a regular file; a trace is read from a regular file only\n"
    )


@pytest.mark.parametrize("target", ["model", "vllm"])
def test_num_blocks_10_to_the_8_is_refused_before_any_target_runs(
    kvgate: Callable[..., Run], tmp_path: Path, target: str
) -> None:
    path = write(
        tmp_path, trace_text(ARRIVE, CONFIG.replace("num_blocks: 96", "num_blocks: 100000000"))
    )
    run = kvgate("replay", path, "--target", target)
    assert run.one_error_line() == (
        f"kvgate: error: {path}: config.num_blocks: 100,000,000 exceeds the limit "
        "num_blocks = 262,144 (raise it with --limit num_blocks=N)\n"
    )


def test_decode_steps_10_to_the_7_are_refused_before_they_expand(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    path = write(
        tmp_path,
        trace_text(ARRIVE + "- {op: prefill, req: A}\n- {op: decode, req: A, steps: 10000000}\n"),
    )
    run = kvgate("replay", path, "--target", "model")
    assert run.one_error_line() == (
        f"kvgate: error: {path}: step 2: steps: primitive steps: 30,000,002 exceeds the limit "
        "steps = 2,000,000 (raise it with --limit steps=N)\n"
    )


def test_fresh_10_to_the_9_is_refused(kvgate: Callable[..., Run], tmp_path: Path) -> None:
    path = write(tmp_path, trace_text("- {op: arrive, req: A, prompt: [{fresh: 1000000000}]}\n"))
    err = kvgate("replay", path, "--target", "model").one_error_line()
    assert "step 0: prompt[0].fresh: prompt tokens in the trace: 1,000,000,000 exceeds" in err


@pytest.mark.parametrize(
    ("steps", "digits", "limit"),
    [
        (
            "- {{op: prefill, req: A}}\n- {{op: decode1, req: A, spec: {n}}}\n",
            "yaml: line 15, column 33: integer of 31 digits (at most 20)",
            "step 2: spec: 1,000,000,000,000,000 exceeds the limit spec = 256",
        ),
        (
            "- {{op: lookup, req: A}}\n- {{op: allocate, req: A, tokens: {n}}}\n",
            "integer of 31 digits (at most 20)",
            "step 2: tokens: 1,000,000,000,000,000 tokens in one allocation, "
            "more than config.max_model_len 8,192",
        ),
    ],
    ids=["spec", "allocate-tokens"],
)
def test_a_count_of_10_to_the_30_is_refused(
    kvgate: Callable[..., Run], tmp_path: Path, steps: str, digits: str, limit: str
) -> None:
    def with_count(n: int) -> str:
        return write(tmp_path, trace_text(ARRIVE + steps.format(n=n)))

    assert digits in kvgate("replay", with_count(10**30), "--target", "model").one_error_line()
    # Within the digits YAML reads, the op's own limit.
    assert limit in kvgate("replay", with_count(10**15), "--target", "model").one_error_line()


def test_a_doubling_chain_of_all_of_is_refused(kvgate: Callable[..., Run], tmp_path: Path) -> None:
    steps = "- {op: arrive, req: R0, prompt: [{fresh: 64}]}\n" + "".join(
        f"- {{op: arrive, req: R{i}, prompt: [{{all_of: R{i - 1}}}, {{all_of: R{i - 1}}}]}}\n"
        for i in range(1, 80)
    )
    config = CONFIG.replace("hash_unit: 8", "hash_unit: 8\n  max_model_len: 1000000000000")
    run = kvgate("replay", write(tmp_path, trace_text(steps, config)), "--target", "model")
    assert "prompt tokens in the trace" in run.one_error_line()


def test_1000_aliases_of_a_million_token_segment_are_refused(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    prompt = "[&seg {fresh: 1000000}" + ", *seg" * 999 + "]"
    config = CONFIG.replace("hash_unit: 8", "hash_unit: 8\n  max_model_len: 1000000000000")
    text = trace_text(f"- {{op: arrive, req: A, prompt: {prompt}}}\n", config)
    run = kvgate("replay", write(tmp_path, text), "--target", "model")
    assert run.one_error_line().endswith(
        "step 0: prompt[16].fresh: prompt tokens in the trace: 17,000,000 exceeds the limit "
        "tokens = 16,777,216 (raise it with --limit tokens=N)\n"
    )


# -- 3. internal errors reported as divergences -----------------------------------


@pytest.mark.parametrize("target", ["model", "vllm"])
def test_scheduler_block_size_0_is_a_config_error_naming_that_field(
    kvgate: Callable[..., Run], tmp_path: Path, target: str
) -> None:
    if target == "vllm":
        pytest.importorskip("vllm")
    config = CONFIG.replace("hash_unit: 8", "hash_unit: 8\n  scheduler_block_size: 0")
    path = write(tmp_path, trace_text(ARRIVE + "- {op: prefill, req: A}\n", config))
    run = kvgate("replay", path, "--target", target)
    assert (
        run.one_error_line()
        == f"kvgate: error: {path}: config.scheduler_block_size: must be >= 1\n"
    )


def test_a_prompt_longer_than_max_model_len_is_refused(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    config = CONFIG.replace("hash_unit: 8", "hash_unit: 8\n  max_model_len: 64")
    path = write(tmp_path, trace_text(ARRIVE + "- {op: prefill, req: A}\n", config))
    assert kvgate("replay", path, "--target", "model").one_error_line() == (
        f"kvgate: error: {path}: step 0: prompt: at least 100 tokens, "
        "more than config.max_model_len 64\n"
    )


def test_a_prompt_that_grows_past_max_model_len_is_refused_when_it_arrives(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    # Known only at run time: B copies A's output too.
    config = CONFIG.replace("hash_unit: 8", "hash_unit: 8\n  max_model_len: 104")
    steps = ARRIVE + textwrap.dedent(
        """\
        - {op: prefill, req: A}
        - {op: decode, req: A, steps: 4}
        - {op: arrive, req: B, prompt: [{all_of: A}]}
        """
    )
    run = kvgate("replay", write(tmp_path, trace_text(steps, config)), "--target", "model")
    assert run.code == 2
    assert (
        "kvgate: error: " in run.err
        and "step 3: prompt: 105 tokens, more than config.max_model_len 104" in run.err
    )
    assert (
        "ERROR t (refused:" in run.out and run.out.splitlines()[-1] == "0 passed, 0 failed, 1 error"
    )


def test_token_ids_of_2_to_the_63_are_refused(kvgate: Callable[..., Run], tmp_path: Path) -> None:
    steps = f"- {{op: arrive, req: A, prompt: [{{tokens: [1, {2**63}]}}]}}\n"
    err = kvgate("replay", write(tmp_path, trace_text(steps)), "--target", "model").one_error_line()
    assert (
        "step 0: prompt[0].tokens: must be a list of token ids (integers >= 0 and < 2**63)" in err
    )


def test_an_exception_inside_the_model_is_kvgates_bug_exit_3(
    kvgate: Callable[..., Run], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvgate.model.target import ModelTarget

    def broken(self: ModelTarget, step: object) -> dict[str, object]:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(ModelTarget, "_op_lookup", broken)
    path = write(tmp_path, trace_text(ARRIVE + "- {op: lookup, req: A}\n"))
    run = kvgate("replay", path, "--target", "model")
    assert run.one_error_line(code=3) == (
        f"kvgate: internal error: {path}: step 1 (lookup): the kvgate model raised "
        "ZeroDivisionError: division by zero; this is a bug in kvgate, not in the target: "
        "please report it with this trace\n"
    )
    assert "raised by the target" not in run.out
    assert run.out.splitlines()[-1] == "0 passed, 0 failed, 1 error"


# -- 4. forged or broken reports ----------------------------------------------------


def test_a_name_with_a_newline_cannot_forge_a_pass_line(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    path = write(tmp_path, trace_text(ARRIVE, name='"x (1 steps)\\nPASS forged"'))
    run = kvgate("replay", path, "--target", "model")
    assert "name: must be one line of at most 200 printable characters" in run.one_error_line()
    assert "PASS" not in run.out


def test_a_name_starting_with_a_verdict_word_is_refused(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    # Its failure block would start with "PASS x: first divergence ...".
    path = write(tmp_path, trace_text(ARRIVE, name="PASS x"))
    err = kvgate("replay", path, "--target", "model").one_error_line()
    assert err.endswith(
        "name: may not start with a verdict word (PASS, FAIL, LACKS, SKIP, ERROR)\n"
    )


def test_a_control_character_in_a_name_leaves_the_junit_parseable(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    junit = tmp_path / "gate.xml"
    path = write(tmp_path, trace_text(ARRIVE, name='"bell\\a"'))
    run = kvgate("replay", path, "--target", "model", "--junit-xml", str(junit))
    assert "name: must be one line" in run.one_error_line()
    assert "\\x07" in run.err  # escaped, never the raw control character
    case = ET.parse(junit).getroot().find("testsuite/testcase")
    assert case is not None and case.find("error") is not None


def test_a_control_character_in_a_path_leaves_the_junit_parseable(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    junit = tmp_path / "gate.xml"
    path = write(
        tmp_path, trace_text(ARRIVE + "- {op: lookup, req: A, expect: {hit: 8}}\n"), "t\x1b[2J.yaml"
    )
    run = kvgate("replay", path, "--target", "model", "--junit-xml", str(junit))
    assert run.code == 1 and "\x1b" not in run.out + run.err
    failure = ET.parse(junit).getroot().find("testsuite/testcase/failure")
    assert failure is not None and "t\\x1b[2J.yaml" in (failure.text or "")


def test_an_error_about_a_key_holding_a_newline_is_one_physical_line(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    steps = '- {op: arrive, req: A, prompt: [{fresh: 4}], "x\\nPASS forged": 1}\n'
    err = kvgate("replay", write(tmp_path, trace_text(steps)), "--target", "model").one_error_line()
    assert "step 0: x\\nPASS forged: unknown field of arrive" in err


# -- 5. one bad trace stops the run ---------------------------------------------------


@pytest.mark.parametrize("command", ["replay", "gate"])
def test_a_trace_refused_at_run_time_is_an_error_and_the_rest_still_run(
    kvgate: Callable[..., Run], tmp_path: Path, command: str
) -> None:
    good = trace_text(ARRIVE + "- {op: prefill, req: A}\n", name="a-good")
    refused = trace_text(
        ARRIVE + "- {op: prefill, req: A}\n- {op: evict, blocks: 95}\n", name="b-refused"
    )
    paths = [
        write(tmp_path, good, "a.yaml"),
        write(tmp_path, refused, "b.yaml"),
        write(tmp_path, good.replace("a-good", "c-good"), "c.yaml"),
    ]
    junit = tmp_path / "out.xml"
    args = [*paths] if command == "replay" else ["--no-bundled", "--corpus", str(tmp_path)]
    run = kvgate(command, *args, "--target", "model", "--junit-xml", str(junit))
    lines = run.out.splitlines()
    assert run.code == 2 and "Traceback" not in run.out + run.err
    # After the target's line, and the gate's corpora line.
    first = 2 if command == "gate" else 1
    assert [line.split(" ")[0] for line in lines[first : first + 3]] == ["PASS", "ERROR", "PASS"]
    assert "step 2: blocks: 95 blocks asked, 77 free" in lines[first + 1]
    assert lines[-1] == "2 passed, 0 failed, 1 error"
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and (suite.get("tests"), suite.get("errors")) == ("3", "1")


# -- 6. inconsistencies -----------------------------------------------------------------


def test_replay_refuses_duplicate_trace_names_as_gate_does(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    first = write(tmp_path, trace_text(ARRIVE, name="same"), "a.yaml")
    second = write(tmp_path, trace_text(ARRIVE, name="same"), "b.yaml")
    run = kvgate("replay", first, second, "--target", "model")
    assert (
        run.one_error_line()
        == f"kvgate: error: {second}: name: 'same' is also the name of {first}\n"
    )


def test_yaml_merge_keys_are_read_and_written_keys_override() -> None:
    text = trace_text(
        textwrap.dedent(
            """\
            - &arrive {op: arrive, req: A, prompt: [{fresh: 40}]}
            - {<<: *arrive, req: B}
            - {<<: [*arrive], req: C, prompt: [{all_of: B}]}
            """
        )
    )
    steps = parse_trace(text).steps
    assert [(s.op, s.req) for s in steps] == [("arrive", "A"), ("arrive", "B"), ("arrive", "C")]
    assert steps[2].prompt[0].req == "B"


def test_retain_retired_on_a_target_without_it_runs_and_its_expectations_decide(
    kvgate: Callable[..., Run],
) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    # vLLM 0.33.0 retains no retired state: the lockstep model runs without it
    # (so the comparison stays exact) and the trace's own expectations miss:
    # the build lacks the retention, which fails it only when required.
    path = bundled_corpus() / "retired-state-held.fork.hold-off.yaml"
    run = kvgate("replay", str(path), "--target", "vllm")
    assert run.code == 0 and "Traceback" not in run.out + run.err
    assert run.out.splitlines()[1].startswith("LACKS retired-state-held.fork.hold-off (retention: ")
    assert f"  note:     {RETIRE_NOTE}" in run.out
    assert "level expect" in run.out
    assert kvgate("replay", str(path), "--target", "vllm", "--require", "retention").code == 4


def test_allocating_500_tokens_of_a_100_token_prompt_is_refused(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    steps = ARRIVE + "- {op: lookup, req: A}\n- {op: allocate, req: A, tokens: 500}\n"
    run = kvgate("replay", write(tmp_path, trace_text(steps)), "--target", "model")
    assert run.code == 2 and "step 2: tokens: 500 asked, 100 left to compute" in run.err
    assert "PASS" not in run.out


def test_a_lookahead_of_10_to_the_12_is_refused(kvgate: Callable[..., Run], tmp_path: Path) -> None:
    steps = ARRIVE + "- {op: prefill, req: A, lookahead: 1000000000000}\n"
    err = kvgate("replay", write(tmp_path, trace_text(steps)), "--target", "model").one_error_line()
    assert "step 1: lookahead: 1,000,000,000,000 exceeds the limit lookahead = 256" in err


# -- the limits themselves ----------------------------------------------------------------


def test_a_limit_is_raised_by_name(kvgate: Callable[..., Run], tmp_path: Path) -> None:
    steps = ARRIVE + "- {op: prefill, req: A, lookahead: 300}\n"
    path = write(tmp_path, trace_text(steps))
    assert "exceeds the limit lookahead = 256" in kvgate("replay", path, "--target", "model").err
    run = kvgate("replay", path, "--target", "model", "--limit", "lookahead=512")
    assert run.code == 0, run.out + run.err
    assert (
        kvgate("replay", path, "--target", "model", "--limit", "speed=9")
        .one_error_line()
        .startswith(
            "kvgate: error: --limit: 'speed=9' is not NAME=N with NAME one of file_bytes, nesting"
        )
    )


def test_a_trace_larger_than_file_bytes_is_refused_before_it_is_parsed(
    kvgate: Callable[..., Run], tmp_path: Path
) -> None:
    path = write(tmp_path, trace_text(ARRIVE) + "#" * 2000 + "\n")
    run = kvgate("replay", path, "--target", "model", "--limit", "file_bytes=1000")
    err = run.one_error_line()
    assert "file: 2,312 bytes exceeds the limit file_bytes = 1,000" in err


def test_any_other_exception_escaping_a_command_is_one_line_and_exit_3(
    kvgate: Callable[..., Run], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvgate.conformance import report

    def broken(*args: object) -> None:
        raise KeyError("a bug\nwith a second line")

    monkeypatch.setattr(report, "summary_line", broken)
    monkeypatch.setattr(cli, "TerminalReport", report.TerminalReport)
    path = write(tmp_path, trace_text(ARRIVE))
    assert kvgate("replay", path, "--target", "model").one_error_line(code=3) == (
        "kvgate: internal error: KeyError: 'a bug\\nwith a second line'; this is a bug in "
        "kvgate: please report it with the command (KVGATE_TRACEBACK=1 shows the traceback)\n"
    )
