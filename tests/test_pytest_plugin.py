"""`pytest --kvgate`: kvgate's traces as pytest items; and exploration's state
machine in a user's own suite, as docs/gate.md shows it."""

from __future__ import annotations

import re
import shutil
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from configs import needs_vllm
from fake_target import fake_trace_text

from kvgate import cli
from kvgate.conformance.corpora import read_corpora

pytest_plugins = ("pytester",)

PLUGIN = ("-p", "kvgate.pytest_plugin", "-p", "no:cacheprovider")
# `--kvgate` collects what the gate runs: one item per trace of the bundled
# corpus, manager-level and scheduler-level.
CORPUS = len(read_corpora().traces)
DOCS = Path(__file__).parents[1] / "docs" / "gate.md"
PLAIN = """\
- {op: arrive, req: A, prompt: [{fresh: 40}]}
- {op: prefill, req: A}
- {op: free, req: A, how: finish}
"""


def on_model(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """`pytest --kvgate --kvgate-target model ARGS` in `pytester`'s folder."""
    return pytester.runpytest(*PLUGIN, "--kvgate", "--kvgate-target", "model", *args)


def corpus_alone(pytester: pytest.Pytester, corpus: Path, *args: str) -> pytest.RunResult:
    """`on_model` over the traces of `corpus` alone (the bundled corpus left out)."""
    return on_model(pytester, "--kvgate-no-bundled", "--kvgate-corpus", str(corpus), *args)


def test_without_kvgate_the_plugin_is_inert(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_own="def test_own():\n    assert True\n")
    result = pytester.runpytest(*PLUGIN, "-q")
    result.assert_outcomes(passed=1)
    assert "kvgate" not in result.stdout.str()


def test_k_selects_traces_and_junit_classes_are_family_and_arm(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_own="def test_own_seed1():\n    assert True\n")
    junit = pytester.path / "out.xml"
    result = on_model(pytester, "-k", "seed1", f"--junit-xml={junit}")
    # The traces only: the test file in the directory is not collected.
    result.assert_outcomes(passed=4, deselected=CORPUS - 4)
    assert "kvgate: corpora bundled, target model" in result.stdout.str()
    result.stdout.fnmatch_lines(
        [f"collected {CORPUS} items / {CORPUS - 4} deselected / 4 selected"]
    )
    cases = ET.parse(junit).getroot().iter("testcase")
    assert sorted((c.get("classname"), c.get("name")) for c in cases) == [
        ("kvgate.gdn-triton.fork", "seed1-next-turn-after-burst.fork.hold-off"),
        ("kvgate.gdn-triton.fork", "seed1-next-turn-after-burst.fork.hold-on"),
        ("kvgate.gdn-triton.hold-off", "seed1-next-turn-after-burst.hold-off"),
        ("kvgate.gdn-triton.hold-on", "seed1-next-turn-after-burst.hold-on"),
    ]
    # Tags are keywords; a test path named runs beside the traces.
    # (No trace's name holds "multi-turn": only the seed1 traces' tags do both.)
    tagged = on_model(pytester, "-k", "multi-turn and seed and not fork")
    tagged.assert_outcomes(passed=2, deselected=CORPUS - 2)
    named = on_model(pytester, "-k", "seed1", "test_own.py")
    named.assert_outcomes(passed=5, deselected=CORPUS - 4)


def gate_lines(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    """What `kvgate gate --target model ARGS` prints, line by line."""
    capsys.readouterr()  # what pytester's runs printed before
    cli.main(["gate", "--target", "model", *args])
    return capsys.readouterr().out.splitlines()


def test_it_collects_every_trace_the_gate_runs_with_the_gates_verdicts(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = gate_lines(capsys, "--list")
    assert listed[-1] == f"{CORPUS} traces selected"
    collected = pytester.runpytest(*PLUGIN, "--kvgate", "--collect-only", "-q")
    collected.stdout.fnmatch_lines([f"{CORPUS} tests collected*"])
    # The Scheduler-level traces too, by name, with the verdicts the gate gives.
    ran = gate_lines(capsys, "-k", "sched-async")
    words = [line.split(" ") for line in ran]
    verdicts = {w[1]: w[0] for w in words if w[0] in ("PASS", "FAIL", "LACKS", "SKIP", "ERROR")}
    assert len(verdicts) >= 2 and set(verdicts.values()) == {"PASS"}, ran
    selected = on_model(pytester, "-k", "sched-async", "-rA")
    selected.assert_outcomes(passed=len(verdicts), deselected=CORPUS - len(verdicts))
    for name in verdicts:
        selected.stdout.fnmatch_lines([f"PASSED kvgate::*::{name}"])


def test_corpus_folders_add_to_the_bundled_corpus(pytester: pytest.Pytester) -> None:
    corpus = pytester.path / "corpus" / "deeper"
    corpus.mkdir(parents=True)
    (corpus / "b.yaml").write_text(fake_trace_text(PLAIN, "b"))
    both = pytester.runpytest(
        *PLUGIN, "--kvgate", "--kvgate-corpus", str(pytester.path / "corpus"), "--collect-only"
    )
    both.stdout.fnmatch_lines([f"*{CORPUS + 1} tests collected*"])
    alone = corpus_alone(pytester, corpus)
    alone.assert_outcomes(passed=1)
    neither = pytester.runpytest(*PLUGIN, "--kvgate", "--kvgate-no-bundled")
    assert neither.ret == pytest.ExitCode.USAGE_ERROR


def test_x_stops_at_the_first_failure_and_an_invalid_trace_fails_in_one_line(
    pytester: pytest.Pytester,
) -> None:
    corpus = pytester.path / "corpus"
    corpus.mkdir()
    (corpus / "a.yaml").write_text(fake_trace_text(PLAIN, "a").replace("num_blocks: 96", "x: 1"))
    (corpus / "b.yaml").write_text(fake_trace_text(PLAIN, "b"))
    result = corpus_alone(pytester, corpus)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*invalid trace: *a.yaml: config.x: unknown config key*"])
    stopped = corpus_alone(pytester, corpus, "-x")
    stopped.assert_outcomes(passed=1, failed=1)
    shutil.copy(corpus / "a.yaml", corpus / "c.yaml")
    stopped = corpus_alone(pytester, corpus, "-x")
    stopped.assert_outcomes(passed=1, failed=1)  # the second invalid trace never ran


@pytest.fixture(scope="module")
def vllm_imported() -> None:
    """vLLM (and torch) imported before `pytester` records the modules it
    drops after each test: torch cannot be imported twice in one process."""
    from kvgate.impl import _vllm_api

    _vllm_api.load()


@needs_vllm
def test_a_missing_hold_fails_when_required_and_is_skipped_when_not(
    vllm_imported: None, pytester: pytest.Pytester
) -> None:
    selection = ("--kvgate", "-k", "seed1 and hold-on and not fork")
    required = pytester.runpytest(*PLUGIN, *selection)
    required.assert_outcomes(failed=1, deselected=CORPUS - 1)
    required.stdout.fnmatch_lines(
        ["LACKS seed1-next-turn-after-burst.hold-on (hold: *", "lacks hold: 1 traces need *"]
    )
    assert "(gate that with --kvgate-plugin entry-points)" in required.stdout.str()
    optional = pytester.runpytest(*PLUGIN, *selection, "--kvgate-require", "none")
    optional.assert_outcomes(skipped=1, deselected=CORPUS - 1)


def test_a_bad_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*PLUGIN, "--kvgate", "--kvgate-require", "speed")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvgate-require: unknown capability 'speed'*"])
    missing = pytester.runpytest(*PLUGIN, "--kvgate", "--kvgate-corpus", "nowhere")
    assert missing.ret == pytest.ExitCode.USAGE_ERROR


def docs_example() -> str:
    """The state machine example of docs/gate.md (its first python block after
    the heading)."""
    text = DOCS.read_text()
    section = text[text.index("## Hypothesis state machines") :]
    found = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert found is not None
    return found.group(1)


@needs_vllm
def test_the_docs_state_machine_example_runs(
    vllm_imported: None, pytester: pytest.Pytester
) -> None:
    example = docs_example()
    assert len(example.strip().splitlines()) <= 10
    # The docs' settings, with fewer examples: the same code, in seconds.
    quick = example.replace('profile("ci")', 'profile("dev", max_examples=5)')
    quick = quick.replace("max_examples=20", "max_examples=3")
    assert quick.count("max_examples=") == 2
    pytester.makepyfile(test_kv=quick)
    result = pytester.runpytest("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2)


def test_a_state_machine_failure_fails_the_users_test(pytester: pytest.Pytester) -> None:
    # The model with a fault the invariants catch: the user's test fails.
    pytester.makepyfile(
        test_kv=textwrap.dedent(
            """\
            import pytest
            from hypothesis import Phase
            from kvgate.explore import KVManagerMachine, profile
            from kvgate.model.pool import BlockPool

            @pytest.fixture(autouse=True)
            def leaky_free(monkeypatch):
                monkeypatch.setattr(BlockPool, "free_blocks", lambda self, blocks: None)

            # No shrinking: that the test fails is the point, in seconds.
            KVManagerMachine.TestCase.settings = profile(
                "dev", max_examples=25, phases=[Phase.generate]
            )
            TestKVManager = KVManagerMachine.TestCase
            """
        )
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(failed=1)
