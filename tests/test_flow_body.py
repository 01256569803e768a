"""A trace body written one flow mapping a line is read as JSON once its
bare words are quoted: the values read must be the YAML loader's, and
anything YAML could read otherwise must go to the YAML loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvgate.conformance.limits import DEFAULT_LIMITS
from kvgate.conformance.strict_yaml import load_document, load_flow_body
from kvgate.conformance.trace import TraceError, bundled_corpus, parse_trace

HEAD = "format: kvgate-trace/1\nname: t\nconfig: {num_blocks: 8}\nsteps:\n"


def _yaml(text: str) -> object:
    return yaml.load(text, Loader=yaml.SafeLoader)


@pytest.mark.parametrize("path", sorted(bundled_corpus().rglob("*.yaml")), ids=lambda p: p.name)
def test_the_corpus_reads_the_same_either_way(path: Path) -> None:
    text = path.read_text()
    fast = load_flow_body(text, DEFAULT_LIMITS)
    if fast is not None:
        assert fast == _yaml(text)
        loaded = _yaml(text)
        assert isinstance(loaded, dict) and list(fast) == list(loaded)


def test_most_of_the_corpus_takes_the_fast_path() -> None:
    paths = sorted(bundled_corpus().rglob("*.yaml"))
    fast = [p for p in paths if load_flow_body(p.read_text(), DEFAULT_LIMITS) is not None]
    assert len(fast) > len(paths) // 3


@pytest.mark.parametrize(
    "line",
    [
        "{op: arrive, req: A, prompt: [{fresh: 48}]}",
        "{op: lookup, req: a-b_c, expect: {hit: 0, ok: true, done: false, x: null}}",
        "{op: free, req: y, how: n}",  # y and n: strings to PyYAML
        "{op: step, n: -0, m: -12}",
        "{}",
    ],
)
def test_plain_lines_read_as_yaml_reads_them(line: str) -> None:
    text = HEAD + f"  - {line}\n  - {line}\n"
    fast = load_flow_body(text, DEFAULT_LIMITS)
    assert fast is not None
    assert fast == _yaml(text)


@pytest.mark.parametrize(
    "line",
    [
        "{op: free, req: A, ok: yes}",  # a YAML bool
        "{op: free, req: No}",
        "{op: free, req: A, ok: True}",
        "{op: free, req: A, ok: NULL}",
        "{op: step, n: 012}",  # octal to YAML 1.1
        "{op: step, n: 1e5}",  # a string to PyYAML
        "{op: step, n: 1.5}",
        "{op: step, n: 0x1F}",
        "{op: step, n: 1_000}",
        "{op: step, n: 123456789012345678901234}",  # the loader words its refusal
        "{op: free, req: 'A'}",
        "{op: free, req: two words}",
        "{op: free, req: A, req: B}",  # a repeated key: the loader's error
        "{op: free, req: A} # a comment",
        "{op:free}",
        "{1: a}",
        "{op: [1, 2, ]}",
        "{a: {b: {c: {d: {e: {f: {g: {h: {i: {j: {k: {l: {m: {n: {o: {p: {q: 1}}}}}}}}}}}}}}}}}",
    ],
)
def test_anything_else_goes_to_the_yaml_loader(line: str) -> None:
    text = HEAD + f"  - {line}\n"
    limits = DEFAULT_LIMITS
    if line.startswith("{a: {b"):
        from dataclasses import replace

        limits = replace(limits, nesting=10)
    assert load_flow_body(text, limits) is None


def test_a_repeated_key_is_still_refused_by_name() -> None:
    text = HEAD + "  - {op: arrive, req: A, prompt: [{fresh: 8}]}\n  - {op: free, req: A, req: B}\n"
    with pytest.raises(TraceError, match="duplicate key 'req'"):
        load_document(text, Path("t.yaml"), DEFAULT_LIMITS)


def test_a_line_after_the_body_is_read_as_yaml() -> None:
    text = HEAD + "  - {op: step}\ntags: [a]\n"
    fast = load_flow_body(text, DEFAULT_LIMITS)
    assert fast == _yaml(text)
    assert list(fast or {}) == ["format", "name", "config", "steps", "tags"]
    # A comment after the body, or the body's key twice: the YAML loader's.
    assert load_flow_body(HEAD + "  - {op: step}\n# done\n", DEFAULT_LIMITS) is None
    assert load_flow_body(HEAD + "  - {op: step}\nsteps: []\n", DEFAULT_LIMITS) is None


def test_a_trace_reads_the_same_through_either_loader() -> None:
    path = bundled_corpus() / "shared-prefix-concurrent.yaml"
    text = path.read_text()
    assert load_flow_body(text, DEFAULT_LIMITS) is not None
    fast = parse_trace(text, path)
    # A comment line keeps the whole document on the YAML loader.
    slow = parse_trace(text.replace("\nsteps:\n", "\nsteps:\n  # steps\n"), path)
    assert fast.steps == slow.steps and fast.primitives == slow.primitives
