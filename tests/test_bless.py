"""`kvgate bless`: a trace's expected values filled and refreshed from the
model, as an edit of only those values; with `--target vllm`, refused where
vLLM disagrees."""

from __future__ import annotations

import difflib
import re
import textwrap
from pathlib import Path

import pytest
from configs import needs_vllm

from kvgate import cli
from kvgate.conformance.trace import bundled_corpus, load_trace

# A history written without expectations (but a stale check), with comments.
NEW_TRACE = textwrap.dedent(
    """\
    format: kvgate-trace/1
    name: bless-new.hold-on
    about: >
      A1 resumes at A0's partial tail; a burst evicts every free block while
      A1 decodes; A2 extends A1 and resumes at A1's own tail.
    config:
      num_blocks: 96
      hash_unit: 8          # the prefix-match unit
      eagle: true
      retention_interval: 0
      retain_checkpoint: true   # the hold under test
      groups:
        - {kind: full_attention, block_size: 8}
        - {kind: mamba_align, block_size: 32, speculative_blocks: 3}
    steps:
      # the first turn
      - {op: arrive, req: A0, prompt: [{fresh: 150}]}
      - {op: prefill, req: A0, lookahead: 3}
      - {op: decode, req: A0, steps: 4, spec: 3}
      - {op: free, req: A0, how: finish}
      - {op: drain}
      # the second turn resumes inside a Mamba block
      - {op: arrive, req: A1, prompt: [{all_of: A0}, {fresh: 26}]}
      - {op: prefill, req: A1, lookahead: 3}
      - {op: decode, req: A1, steps: 4, spec: 3}
      - {op: evict, blocks: all}   # the burst
      - {op: free, req: A1, how: finish}
      - {op: drain}
      - {op: arrive, req: A2, prompt: [{all_of: A1}, {fresh: 22}]}
      - op: lookup      # the turn the hold is for
        req: A2
      - op: check
        attention_cached: {A1: 0}   # stale: bless refreshes it
        holds: {}
    """
)


def write(directory: Path, text: str = NEW_TRACE, name: str = "new.yaml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def bless(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["bless", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def changed_lines(before: str, after: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def test_a_new_trace_is_filled_with_the_models_values_and_its_comments_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path)
    code, out, err = bless(capsys, str(path))
    assert (code, err) == (0, "")
    assert out == f"blessed {path}: 8 values filled, 1 changed, 1 unchanged\n"
    text = path.read_text()
    # Every line written stays, but the stale check value and the steps
    # that got an `expect`; every comment among them.
    kept = [line for line in NEW_TRACE.splitlines() if line in text.splitlines()]
    assert [line for line in NEW_TRACE.splitlines() if line not in kept] == [
        "  - {op: prefill, req: A0, lookahead: 3}",
        "  - {op: drain}",
        "  - {op: prefill, req: A1, lookahead: 3}",
        "  - {op: drain}",
        "    attention_cached: {A1: 0}   # stale: bless refreshes it",
    ]
    assert text.count("#") == NEW_TRACE.count("#")
    assert "  - {op: prefill, req: A1, lookahead: 3, expect: {hit: 136, junction: 144}}" in text
    assert "    req: A2\n    expect: {hit: 168, junction: 176}\n" in text
    assert "    attention_cached: {A1: 176}   # stale: bless refreshes it\n" in text
    trace = load_trace(path)
    assert [s.expect for s in trace.steps if s.op == "drain"] == [{"copies": ()}] * 2
    assert cli.main(["replay", str(path), "--target", "model"]) == 0


def test_blessing_twice_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path)
    assert bless(capsys, str(path))[0] == 0
    once = path.read_text()
    code, out, _ = bless(capsys, str(path))
    assert (code, out) == (0, f"{path}: up to date (10 values)\n")
    assert path.read_text() == once
    assert bless(capsys, str(path), "--check")[0] == 0
    assert bless(capsys, str(path), "-q") == (0, "", "")


def test_a_stale_value_is_refreshed_and_nothing_else_moves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path)
    bless(capsys, str(path))
    blessed = path.read_text()
    stale = blessed.replace("{hit: 136, junction: 144}", "{hit: 128, junction: 144}")
    path.write_text(stale)

    code, out, _ = bless(capsys, str(path), "--check")
    assert (code, out) == (1, f"{path}: would change: 0 values filled, 1 changed, 9 unchanged\n")
    assert path.read_text() == stale  # --check writes nothing

    assert bless(capsys, str(path))[0] == 0
    assert changed_lines(stale, path.read_text()) == [
        "-  - {op: prefill, req: A1, lookahead: 3, expect: {hit: 128, junction: 144}}",
        "+  - {op: prefill, req: A1, lookahead: 3, expect: {hit: 136, junction: 144}}",
    ]


def test_a_block_style_list_is_refreshed_entry_by_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = bundled_corpus() / "kv-events.yaml"
    original = corpus.read_text()
    stale = original.replace("- 'removed g1 80'", "- 'removed g1 81'")
    assert stale != original
    path = write(tmp_path, stale, "kv-events.yaml")
    code, out, _ = bless(capsys, str(path))
    assert code == 0 and "1 changed" in out
    # Only that line moves back, in its own style; the steps without
    # expectations get theirs.
    diff = changed_lines(stale, path.read_text())
    assert "-        - 'removed g1 81'" in diff and "+        - 'removed g1 80'" in diff
    assert all("removed" not in line or line.endswith(("81'", "80'")) for line in diff)
    assert changed_lines(original, path.read_text()) == [
        line for line in diff if "removed g1" not in line
    ]


@pytest.mark.parametrize(
    ("old", "new", "blessed"),
    [
        # The keys the author wrote are kept and no others added.
        (
            "  - {op: prefill, req: A1, lookahead: 3}",
            "  - {op: prefill, req: A1, lookahead: 3, expect: {junction: 0}}",
            "  - {op: prefill, req: A1, lookahead: 3, expect: {junction: 144}}\n",
        ),
        # A ref check is refreshed number by number: the burst evicted A0's
        # tail state (null: nothing keyed there); A1's first attention block
        # waits in the free queue (ref count 0).
        (
            "    holds: {}\n",
            "    holds: {}\n    ref: {A1: {1: {136: 3}, 0: {8: 2}}}  # A0's tail\n",
            "    ref: {A1: {1: {136: null}, 0: {8: 0}}}  # A0's tail\n",
        ),
    ],
    ids=["the author's keys kept, no others added", "a ref check refreshed number by number"],
)
def test_values_the_author_wrote_are_refreshed_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, blessed: str
) -> None:
    assert old in NEW_TRACE
    path = write(tmp_path, NEW_TRACE.replace(old, new))
    assert bless(capsys, str(path))[0] == 0
    assert blessed in path.read_text()
    assert cli.main(["replay", str(path), "--target", "model"]) == 0


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (
            (bundled_corpus() / "refuse-attention-block-not-a-multiple-of-hash-unit.yaml")
            .read_text()
            .replace("name: refuse-", "name: x-"),
            "expect_refused: a refusal trace replays nothing, so it has no values to bless",
        ),
        (NEW_TRACE.replace("req: A2\n", "req: A9\n"), "step 12: req: request 'A9' is used before"),
    ],
)
def test_a_refusal_trace_or_an_invalid_one_stops_it_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str, error: str
) -> None:
    good = write(tmp_path)
    invalid = write(tmp_path, bad, "bad.yaml")
    code, out, err = bless(capsys, str(good), str(invalid))
    assert (code, out) == (2, "")
    assert err.startswith(f"kvgate: error: {invalid}: {error}")
    assert err.count("\n") == 1
    assert good.read_text() == NEW_TRACE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "new.yaml"]


def test_a_step_the_model_cannot_finish_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Eight blocks cannot hold a 150-token prompt: the model's prefill stalls.
    path = write(tmp_path, NEW_TRACE.replace("num_blocks: 96", "num_blocks: 8"))
    code, out, err = bless(capsys, str(path))
    assert (code, out) == (2, "")
    assert err.startswith(f"kvgate: error: {path}: step 1: prefill stalled: the model cannot run")
    assert path.read_text() == NEW_TRACE.replace("num_blocks: 96", "num_blocks: 8")


def test_plugin_needs_target_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path)
    code, _, err = bless(capsys, str(path), "--plugin", "kvgate.impl.hold_overlay")
    assert (code, err) == (2, "kvgate: error: --plugin: only --target vllm loads plugins\n")
    assert path.read_text() == NEW_TRACE


@needs_vllm
def test_blessed_with_vllm_the_trace_conforms_on_vllm_strict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hold_overlay_plugin: str
) -> None:
    path = write(tmp_path)
    code, out, err = bless(capsys, str(path), "--target", "vllm", "--plugin", hold_overlay_plugin)
    assert (code, err) == (0, "")
    assert out.startswith(f"blessed {path}: 8 values filled")
    replayed = cli.main(
        [
            "replay",
            str(path),
            "--target",
            "vllm",
            "--plugin",
            hold_overlay_plugin,
            "--level",
            "strict",
        ]
    )
    assert replayed == 0, capsys.readouterr().out


@needs_vllm
def test_vllm_disagreeing_refuses_the_trace_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Upstream vLLM has no hold: at A2's lookup it misses where the model,
    # with the hold the trace switches on, resumes at A1's tail.
    path = write(tmp_path)
    code, out, err = bless(capsys, str(path), "--target", "vllm")
    assert (code, out) == (1, "")
    assert err.startswith(
        f"kvgate: error: refused to bless {path}: vLLM disagrees with the model at "
        "step 12 (lookup): hit: the model 168, vLLM 0; target lacks the hold"
    )
    assert err.count("\n") == 1
    assert path.read_text() == NEW_TRACE


def test_values_shared_through_a_yaml_alias_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = NEW_TRACE.replace(
        "  - {op: prefill, req: A0, lookahead: 3}",
        "  - {op: prefill, req: A0, lookahead: 3, expect: &hit {hit: 1}}",
    ).replace("    req: A2\n", "    req: A2\n    expect: *hit\n")
    path = write(tmp_path, text)
    code, out, err = bless(capsys, str(path))
    assert (code, out) == (2, "")
    assert err == (
        f"kvgate: error: {path}: yaml: two of the values to bless share one place in the "
        "text (a YAML alias); write them out to bless them\n"
    )
    assert path.read_text() == text


# -- scheduler-level traces, and capabilities a trace must show ----------------

SCHEDULER_HOLD = (
    bundled_corpus() / "scheduler" / "sched-gdn-triton-next-turn-after-burst.hold-on.yaml"
)


def without_expectations(path: Path, name: str, cut_at: str | None = None) -> str:
    """The trace at `path` renamed, every engine step's `expect` taken out
    (and, with `cut_at`, the entries from that comment on left out)."""
    text = re.sub(r"^name: .*$", f"name: {name}", path.read_text(), count=1, flags=re.M)
    text = re.sub(r", expect: \{.*\}\}$", "}", text, flags=re.M)
    if cut_at is not None:
        text = text[: text.index(cut_at)]
    assert "expect" not in text
    return text


def test_a_scheduler_level_trace_is_filled_with_what_the_engine_steps_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(without_expectations(SCHEDULER_HOLD, "mine-next-turn.hold-on"))
    assert cli.main(["bless", str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"blessed {path}: ")
    # What the bundled trace expects, filled from the model alone.
    blessed, bundled = load_trace(path), load_trace(SCHEDULER_HOLD)
    assert [e.expect for e in blessed.engine] == [e.expect for e in bundled.engine]
    assert "cached_tokens: {A2: 168}" in path.read_text()
    assert cli.main(["bless", str(path), "--check"]) == 0
    assert cli.main(["replay", str(path), "--target", "model"]) == 0


@needs_vllm
def test_a_blessed_scheduler_level_hold_trace_lacks_the_hold_on_upstream_vllm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hold_overlay_plugin: str
) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(without_expectations(SCHEDULER_HOLD, "mine-next-turn.hold-on"))
    assert cli.main(["bless", str(path)]) == 0
    capsys.readouterr()
    code = cli.main(["replay", str(path), "--target", "vllm", "--require", "hold"])
    out = capsys.readouterr().out
    if "hold: no" in out.splitlines()[0]:
        assert code == 4 and "LACKS mine-next-turn.hold-on (hold: " in out
    else:  # a build with the hold
        assert code == 0, out
    # With the overlay, vLLM's Scheduler agrees: bless confirms it there.
    confirm = ["bless", str(path), "--target", "vllm", "--plugin", hold_overlay_plugin, "--check"]
    assert cli.main(confirm) == 0


def test_a_trace_asking_for_the_hold_that_nothing_shows_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Cut before the burst: no value differs with the hold off.
    path = tmp_path / "short.yaml"
    text = without_expectations(SCHEDULER_HOLD, "short.hold-on", cut_at="  # the burst")
    path.write_text(text)
    assert cli.main(["bless", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and path.read_text() == text
    assert err == (
        f"kvgate: error: {path}: config.retain_checkpoint: asks for the partial-tail hold, but "
        "no expectation shows it: the model without it meets every one, so a build lacking it "
        "would pass; expect a value that depends on it (a follow-up's hit or cached tokens, say)\n"
    )
    # The same trace with the hold off is blessed.
    path.write_text(text.replace("retain_checkpoint: true", "retain_checkpoint: false"))
    assert cli.main(["bless", str(path)]) == 0


def test_a_manager_level_trace_asking_for_the_hold_that_nothing_shows_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One request aborted mid-prefill: nothing it does depends on the hold.
    source = (bundled_corpus() / "abort-mid-prefill.yaml").read_text()
    assert "retain_checkpoint: false" in source
    path = tmp_path / "abort.yaml"
    text = source.replace("retain_checkpoint: false", "retain_checkpoint: true")
    path.write_text(text)
    code, out, err = bless(capsys, str(path))
    assert code == 2 and out == "" and path.read_text() == text
    assert err.startswith(f"kvgate: error: {path}: config.retain_checkpoint: asks for the ")
    assert len(err.splitlines()) == 1
