"""Trace format version 1: what the reader accepts, and how it refuses the rest."""

from __future__ import annotations

import textwrap
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest
from command_runs import replay_text, run_python
from configs import EXAMPLE_TRACE_CONFIG, trace_text

from kvgate.cli import main
from kvgate.conformance.macros import prefill_lookup, prefill_round
from kvgate.conformance.trace import TraceError, bundled_corpus, load_corpus, parse_trace
from kvgate.conformance.writer import dump_trace
from kvgate.vocabulary.ops import Step

CONFIG = EXAMPLE_TRACE_CONFIG


ARRIVE = "- {op: arrive, req: A, prompt: [{fresh: 40}]}\n"

# (kind of mistake, trace text, the error's `step <i>: <field>` part)
MALFORMED: list[tuple[str, str, str]] = [
    ("yaml syntax", trace_text(ARRIVE + "- {op: lookup, req: A\n"), "yaml"),
    ("duplicate key", trace_text("- {op: arrive, req: A, req: B, prompt: [{fresh: 4}]}\n"), "yaml"),
    ("not a mapping", "- format: kvgate-trace/1\n", "document"),
    ("missing format", trace_text(ARRIVE, head=""), "format"),
    ("other version", trace_text(ARRIVE, head="format: kvgate-trace/2\n"), "format"),
    ("unknown top-level key", trace_text(ARRIVE) + "colour: red\n", "colour"),
    ("empty steps", trace_text("[]\n").replace("steps:\n  []", "steps: []"), "steps"),
    (
        "missing config key",
        trace_text(ARRIVE, CONFIG.replace("  retention_interval: 0\n", "")),
        "config.retention_interval",
    ),
    (
        "config value of the wrong type",
        trace_text(ARRIVE, CONFIG.replace("num_blocks: 96", "num_blocks: '96'")),
        "config.num_blocks",
    ),
    (
        "config flag of the wrong type",
        trace_text(
            ARRIVE,
            CONFIG.replace("  retain_checkpoint: false\n", "  retain_retired: 'yes'\n"),
        ),
        "config.retain_retired",
    ),
    (
        "unsupported config",
        trace_text(ARRIVE, CONFIG.replace("block_size: 8}", "block_size: 12}")),
        "config.scheduler_block_size",
    ),
    (
        "unknown group kind",
        trace_text(ARRIVE, CONFIG.replace("kind: mamba_align", "kind: sliding_window")),
        "config.groups[1].kind",
    ),
    ("step not a mapping", trace_text(ARRIVE + "- lookup\n"), "step 1: step"),
    ("unknown op", trace_text(ARRIVE + "- {op: teleport, req: A}\n"), "step 1: op"),
    (
        "unknown field",
        trace_text(ARRIVE + "- {op: lookup, req: A, colour: red}\n"),
        "step 1: colour",
    ),
    ("missing field", trace_text(ARRIVE + "- {op: free, req: A}\n"), "step 1: how"),
    (
        "bool for an int",
        trace_text(ARRIVE + "- {op: prefill, req: A, lookahead: true}\n"),
        "step 1: lookahead",
    ),
    ("negative int", trace_text(ARRIVE + "- {op: decode, req: A, steps: -1}\n"), "step 1: steps"),
    ("zero chunk", trace_text(ARRIVE + "- {op: allocate, req: A, tokens: 0}\n"), "step 1: tokens"),
    (
        "unknown expect key",
        trace_text(ARRIVE + "- {op: prefill, req: A, expect: {blocks: 3}}\n"),
        "step 1: expect.blocks",
    ),
    (
        "expect value of the wrong type",
        trace_text(ARRIVE + "- {op: allocate, req: A, tokens: auto, expect: {ok: 1}}\n"),
        "step 1: expect.ok",
    ),
    (
        "how outside finish/abort/preempt",
        trace_text(ARRIVE + "- {op: free, req: A, how: evaporate}\n"),
        "step 1: how",
    ),
    (
        "unknown segment kind",
        trace_text("- {op: arrive, req: A, prompt: [{stale: 4}]}\n"),
        "step 0: prompt[0]",
    ),
    (
        "empty prompt",
        trace_text("- {op: arrive, req: A, prompt: [{fresh: 0}]}\n"),
        "step 0: prompt",
    ),
    ("used before arrive", trace_text("- {op: lookup, req: A}\n"), "step 0: req"),
    ("arrives twice", trace_text(ARRIVE + ARRIVE), "step 1: req"),
    (
        "op after finish",
        trace_text(ARRIVE + "- {op: free, req: A, how: finish}\n- {op: lookup, req: A}\n"),
        "step 2: req",
    ),
    (
        "op after pop other than release",
        trace_text(ARRIVE + "- {op: pop, req: A}\n- {op: free, req: A, how: abort}\n"),
        "step 2: req",
    ),
    ("release without pop", trace_text(ARRIVE + "- {op: release, req: A}\n"), "step 1: req"),
    (
        "a line repeated after its request ended",
        trace_text(
            ARRIVE + "- {op: lookup, req: A}\n- {op: free, req: A, how: finish}\n"
            "- {op: lookup, req: A}\n"
        ),
        "step 3: req",
    ),
    (
        "all_of an unknown request",
        trace_text(ARRIVE + "- {op: arrive, req: B, prompt: [{all_of: Z}]}\n"),
        "step 1: prompt[0].all_of",
    ),
    ("unknown check key", trace_text(ARRIVE + "- {op: check, colour: red}\n"), "step 1: colour"),
    (
        "negative long-prefill threshold",
        trace_text(ARRIVE, CONFIG + "  long_prefill_token_threshold: -1\n"),
        "config.long_prefill_token_threshold",
    ),
    (
        "long-prefill threshold past max_model_len",
        trace_text(ARRIVE, CONFIG + "  max_model_len: 512\n  long_prefill_token_threshold: 513\n"),
        "config.long_prefill_token_threshold",
    ),
    (
        "junction expected of the wrong type",
        trace_text(ARRIVE + "- {op: lookup, req: A, expect: {junction: yes}}\n"),
        "step 1: expect.junction",
    ),
    (
        "hold in an attention group",
        trace_text(ARRIVE + "- {op: check, holds: {A: {0: 8}}}\n"),
        "step 1: holds.A.0",
    ),
]


@pytest.mark.parametrize(
    ("text", "where"), [(t, w) for _, t, w in MALFORMED], ids=[k for k, _, _ in MALFORMED]
)
def test_malformed_trace_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, where: str
) -> None:
    path, code, out, err = replay_text(tmp_path, text, capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1, err
    assert err.startswith(f"kvgate: error: {path}: {where}: "), err
    assert "Traceback" not in err


def test_malformed_kinds_are_many_and_distinct() -> None:
    kinds = {k for k, _, _ in MALFORMED}
    assert len(kinds) == len(MALFORMED) >= 12


def test_error_through_python_dash_m(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(trace_text(ARRIVE + "- {op: free, req: A, how: evaporate}\n"))
    run = run_python("-m", "kvgate", "replay", str(path), "--target", "vllm", timeout=120)
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.splitlines() == [
        f"kvgate: error: {path}: step 1: how: 'evaporate' is not one of finish, abort, preempt"
    ]


def test_missing_file_is_an_input_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "absent.yaml"
    assert main(["replay", str(path), "--target", "model"]) == 2
    assert capsys.readouterr().err.startswith(f"kvgate: error: {path}: file: cannot read")


def test_unknown_target_is_an_input_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(trace_text(ARRIVE))
    assert main(["replay", str(path), "--target", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvgate: error: argument --target")


def test_a_bad_trace_is_listed_and_the_valid_ones_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(trace_text(ARRIVE))
    bad.write_text(trace_text("- {op: lookup, req: A}\n").replace("name: t", "name: u"))
    assert main(["replay", str(good), str(bad), "--target", "model"]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[1].startswith("ERROR ")
    assert out.splitlines()[2].startswith("PASS t (")
    assert out.splitlines()[-1] == "1 passed, 0 failed, 1 error"
    assert err.count("\n") == 1 and f"{bad}: step 0: req:" in err


# -- what the reader accepts --------------------------------------------------

FORMAT_DOC = Path(__file__).resolve().parents[1] / "docs" / "trace-format.md"


def format_example() -> str:
    """The document's example trace: the first YAML block of docs/trace-format.md."""
    text = FORMAT_DOC.read_text()
    start = text.index("```yaml\n") + len("```yaml\n")
    return text[start : text.index("```", start)]


def test_the_format_documents_example_parses() -> None:
    trace = parse_trace(format_example(), str(FORMAT_DOC))
    assert trace.name == "partial-tail-next-turn-after-burst"
    assert trace.about.startswith("A1 resumes")
    assert trace.config.hold and trace.config.eagle
    assert [s.op for s in trace.steps][:3] == ["arrive", "prefill", "decode"]
    assert trace.steps[5].prompt[0].kind == "all_of" and trace.steps[5].prompt[0].req == "A0"
    assert trace.steps[8].blocks == "all"
    # 13 written steps; two decodes of 4 become 12 primitives each.
    assert len(trace.primitives) == 13 - 2 + 2 * 12
    assert trace.primitives[-1].expect == {"hit": 168}


def test_config_defaults() -> None:
    config = CONFIG.replace("  eagle: true\n", "").replace("  retain_checkpoint: false\n", "")
    config = config.replace(
        "speculative_blocks: 3}\n",
        "speculative_blocks: 3}\n    - {kind: mamba_align, block_size: 64}\n",
    )
    trace = parse_trace(trace_text(ARRIVE, config))
    assert trace.config.scheduler_block_size == 64  # the largest Mamba block
    assert trace.config.max_model_len == 8192
    assert trace.config.max_num_scheduled_tokens == 8192
    assert trace.config.eagle is False
    assert trace.config.hold is False
    assert trace.config.retain_retired is False
    assert trace.config.groups[2].speculative_blocks == 0


def test_retain_retired_is_read_and_written_only_when_on() -> None:
    """An additive key: on, it round-trips; off, the writer leaves it out,
    so a trace written before it existed reads and writes back unchanged."""
    on = parse_trace(trace_text(ARRIVE, CONFIG + "  retain_retired: true\n"))
    assert on.config.retain_retired is True
    assert "retain_retired: true" in dump_trace(on.name, on.config, on.steps)
    off = parse_trace(trace_text(ARRIVE))
    assert "retain_retired" not in dump_trace(off.name, off.config, off.steps)


def test_long_prefill_threshold_is_read_and_written_only_when_set() -> None:
    """Additive, default 0 (no cap); the writer leaves 0 out."""
    assert parse_trace(trace_text(ARRIVE)).config.long_prefill_token_threshold == 0
    on = parse_trace(trace_text(ARRIVE, CONFIG + "  long_prefill_token_threshold: 48\n"))
    assert on.config.long_prefill_token_threshold == 48
    text = dump_trace(on.name, on.config, on.steps)
    assert "long_prefill_token_threshold: 48" in text
    assert parse_trace(text).config == on.config
    off = parse_trace(trace_text(ARRIVE))
    assert "long_prefill_token_threshold" not in dump_trace(off.name, off.config, off.steps)


def test_adaptive_threshold_is_read_and_written_only_when_set() -> None:
    on = parse_trace(
        trace_text(
            ARRIVE,
            CONFIG
            + "  long_prefill_token_threshold: 48\n  long_prefill_token_threshold_adaptive: true\n",
        )
    )
    assert on.config.long_prefill_token_threshold_adaptive is True
    text = dump_trace(on.name, on.config, on.steps)
    assert "long_prefill_token_threshold_adaptive: true" in text
    assert parse_trace(text).config == on.config
    off = parse_trace(trace_text(ARRIVE))
    assert off.config.long_prefill_token_threshold_adaptive is False
    assert "adaptive" not in dump_trace(off.name, off.config, off.steps)


def test_retention_interval_null_means_unset() -> None:
    trace = parse_trace(
        trace_text(ARRIVE, CONFIG.replace("retention_interval: 0", "retention_interval: null"))
    )
    assert trace.config.retention_interval is None


def test_decode_expands_statically() -> None:
    trace = parse_trace(trace_text(ARRIVE + "- {op: decode, req: A, steps: 2, spec: 3}\n"))
    decode = trace.primitives[1:]
    assert [(s.op, s.part, s.origin) for s in decode] == [
        ("decode1", 1, "decode"),
        ("step", 2, "decode"),
        ("drain", 3, "decode"),
        ("decode1", 4, "decode"),
        ("step", 5, "decode"),
        ("drain", 6, "decode"),
    ]
    assert all(s.index == 1 for s in decode)
    assert decode[3].req == "A" and decode[3].spec == 3
    assert decode[3].where() == "step 1 (decode: decode1 #4)"


def test_read_steps_are_the_steps_the_constructor_builds() -> None:
    """The reader builds each step setting only the fields it has (repeated
    lines read once): equal to the step the constructor builds from the
    same fields, every field readable, and as frozen."""
    text = (bundled_corpus() / "shared-prefix-concurrent.yaml").read_text()
    trace = parse_trace(text + "  - {op: step}\n  - {op: step}\n")
    assert trace.steps[-1].index == trace.steps[-2].index + 1
    for step in trace.steps:
        values = {f.name: getattr(step, f.name) for f in fields(Step)}
        assert Step(**values) == step
        assert repr(Step(**values)) == repr(step)
        with pytest.raises(FrozenInstanceError):
            step.op = "free"  # type: ignore[misc]


def test_prefill_is_kept_whole_and_expanded_by_rounds() -> None:
    trace = parse_trace(
        trace_text(ARRIVE + "- {op: prefill, req: A, lookahead: 3, expect: {hit: 8}}\n")
    )
    (prefill,) = trace.primitives[1:]
    assert prefill.op == "prefill"
    lookup = prefill_lookup(prefill)
    assert (lookup.op, lookup.part, lookup.expect) == ("lookup", 1, {"hit": 8})
    allocate, step, drain = prefill_round(prefill, 2)
    assert (allocate.op, allocate.tokens, allocate.lookahead, allocate.part) == (
        "allocate",
        "auto",
        3,
        5,
    )
    assert allocate.expect == {}  # the hit is the lookup's
    assert (step.op, step.part, drain.op, drain.part) == ("step", 6, "drain", 7)
    assert allocate.where() == "step 1 (prefill: allocate #5)"


def test_request_life_that_is_allowed() -> None:
    steps = ARRIVE + textwrap.dedent(
        """\
        - {op: prefill, req: A}
        - {op: free, req: A, how: preempt}
        - {op: lookup, req: A}
        - {op: pop, req: A}
        - {op: release, req: A}
        - {op: arrive, req: B, prompt: [{all_of: A}, {prompt_of: A}, {tokens: [1, 2]}]}
        - {op: allocate, req: B, tokens: 16, expect: {ok: true, tokens: 16}}
        - {op: drain, expect: {copies: [[3, 4]]}}
        - {op: check, holds: {B: {1: 16}}, pool_clean: false}
        """
    )
    trace = parse_trace(trace_text(steps))
    assert trace.primitives[7].expect == {"ok": True, "tokens": 16}
    assert trace.primitives[8].expect == {"copies": ((3, 4),)}
    assert trace.primitives[9].check == {"holds": {"B": {1: 16}}, "pool_clean": False}


def test_trace_error_is_one_line() -> None:
    error = TraceError("t.yaml", 4, "req", "first\nsecond")
    assert str(error) == "t.yaml: step 4: req: first second"
    assert str(TraceError("t.yaml", None, "format", "missing")) == "t.yaml: format: missing"


def test_corpus_is_sorted_and_names_are_unique(tmp_path: Path) -> None:
    for file_name, name in (("b.yaml", "second"), ("a.yaml", "first")):
        (tmp_path / file_name).write_text(trace_text(ARRIVE).replace("name: t", f"name: {name}"))
    (tmp_path / "notes.txt").write_text("not a trace")
    assert [t.name for t in load_corpus(tmp_path)] == ["first", "second"]
    (tmp_path / "c.yaml").write_text(trace_text(ARRIVE).replace("name: t", "name: first"))
    with pytest.raises(TraceError, match="c.yaml: name: 'first' is also the name of"):
        load_corpus(tmp_path)


def test_empty_corpus_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="holds no"):
        load_corpus(tmp_path)


def test_bundled_corpus_is_valid() -> None:
    """Every trace kvgate ships reads as version 1."""
    assert load_corpus(bundled_corpus())
