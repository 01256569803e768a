"""A request's hash inputs (`arrive`'s `cache_salt`, `lora`, `mm`): how the
trace reads them, the keys they give (checked against vLLM's own block
hasher), the model's events, and the installed vLLM on traces using them."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from command_runs import replay_text
from configs import needs_vllm, trace_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.conformance.trace import parse_trace
from kvgate.conformance.writer import dump_trace
from kvgate.explore.hash_inputs import VARY_EVERY, RequestInputs
from kvgate.model.request import Request
from kvgate.vocabulary.events import KvEvent
from kvgate.vocabulary.tokens import HashInputs, MmItem, prefix_keys

PROMPT = "- {op: arrive, req: A, prompt: [{fresh: 40}]"


def arrive(fields: str) -> str:
    return f"{PROMPT}, {fields}}}\n"


# (kind of mistake, trace steps, the error's `step <i>: <field>` part)
MALFORMED: list[tuple[str, str, str]] = [
    ("empty salt", arrive("cache_salt: ''"), "step 0: cache_salt"),
    ("salt with a space", arrive("cache_salt: 'a b'"), "step 0: cache_salt"),
    ("salt not a string", arrive("cache_salt: 7"), "step 0: cache_salt"),
    ("adapter not a string", arrive("lora: [x]"), "step 0: lora"),
    ("mm not a list", arrive("mm: img"), "step 0: mm"),
    ("mm empty", arrive("mm: []"), "step 0: mm"),
    ("mm item not a mapping", arrive("mm: [3]"), "step 0: mm[0]"),
    ("mm item unknown key", arrive("mm: [{offset: 0, length: 4, id: i, x: 1}]"), "step 0: mm[0].x"),
    ("mm item without id", arrive("mm: [{offset: 0, length: 4}]"), "step 0: mm[0].id"),
    ("mm length 0", arrive("mm: [{offset: 0, length: 0, id: i}]"), "step 0: mm[0].length"),
    ("mm negative offset", arrive("mm: [{offset: -1, length: 2, id: i}]"), "step 0: mm[0].offset"),
    (
        "mm overlapping",
        arrive("mm: [{offset: 0, length: 8, id: i}, {offset: 4, length: 2, id: j}]"),
        "step 0: mm[1].offset",
    ),
    (
        "mm unsorted",
        arrive("mm: [{offset: 10, length: 2, id: i}, {offset: 0, length: 2, id: j}]"),
        "step 0: mm[1].offset",
    ),
    ("mm past the prompt", arrive("mm: [{offset: 36, length: 5, id: i}]"), "step 0: mm[0]"),
    (
        # Known only at run time: B's prompt copies A's output (none yet).
        "mm past a copied prompt",
        arrive("lora: x")
        + "- {op: arrive, req: B, prompt: [{all_of: A}], mm: [{offset: 38, length: 3, id: i}]}\n",
        "step 1",
    ),
    ("hash inputs on a lookup", arrive("lora: x") + "- {op: lookup, req: A, lora: x}\n", "step 1"),
]


@pytest.mark.parametrize(
    ("steps", "where"), [(s, w) for _, s, w in MALFORMED], ids=[k for k, _, _ in MALFORMED]
)
def test_malformed_hash_inputs_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: str, where: str
) -> None:
    path, code, out, err = replay_text(tmp_path, trace_text(steps), capsys)
    assert code != 0
    text = err or out
    assert f"{path}: {where}" in text, text
    assert "Traceback" not in text
    if err:
        assert err.count("\n") == 1, err


def test_inputs_read_and_write_back() -> None:
    text = trace_text(
        arrive("cache_salt: t1, lora: ad, mm: [{offset: 2, length: 6, id: img}]")
        + "- {op: arrive, req: B, prompt: [{fresh: 8}]}\n"
    )
    trace = parse_trace(text)
    first, second = trace.steps[0], trace.steps[1]
    assert first.hash_inputs == HashInputs("t1", "ad", (MmItem(2, 6, "img"),))
    assert not second.hash_inputs
    again = parse_trace(dump_trace("t", trace.config, trace.steps))
    assert again.steps == trace.steps
    assert "cache_salt" not in dump_trace("t", trace.config, trace.steps[1:])


def test_extra_keys_follow_vllms_rules() -> None:
    inputs = HashInputs("s", "ad", (MmItem(10, 20, "img"), MmItem(30, 2, "two")))
    # The adapter in every window, the salt in the first only, an item in
    # every window it overlaps, with its offset from the window's start.
    assert inputs.extra_keys(0, 8) == (("lora", "ad"), ("cache_salt", "s"))
    assert inputs.extra_keys(8, 16) == (("lora", "ad"), ("mm", "img", 2))
    assert inputs.extra_keys(24, 32) == (("lora", "ad"), ("mm", "img", -14), ("mm", "two", 6))
    assert inputs.extra_keys(32, 40) == (("lora", "ad"),)
    assert inputs.event_extra(24, 32) == ("ad", ("img", -14), ("two", 6))
    assert HashInputs().event_extra(0, 8) is None


def test_keys_diverge_exactly_where_the_inputs_do() -> None:
    tokens = list(range(1000, 1048))  # six units of 8
    plain = prefix_keys(tokens, 8)
    salted = prefix_keys(tokens, 8, inputs=HashInputs(cache_salt="t1"))
    image = HashInputs(mm=(MmItem(20, 8, "img"),))
    other = HashInputs(mm=(MmItem(20, 8, "other"),))
    # The salt keys the first unit, and so (chained) every one after it.
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    a, b = prefix_keys(tokens, 8, inputs=image), prefix_keys(tokens, 8, inputs=other)
    assert a[:2] == b[:2] == plain[:2]  # units before the placeholder
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    # With a lookahead token, the unit right before a placeholder sees it too.
    image, other = HashInputs(mm=(MmItem(16, 8, "img"),)), HashInputs(mm=(MmItem(16, 8, "o"),))
    assert prefix_keys(tokens, 8, 0, image)[1] == prefix_keys(tokens, 8, 0, other)[1]
    la, lb = prefix_keys(tokens, 8, 1, image), prefix_keys(tokens, 8, 1, other)
    assert la[:1] == lb[:1] and la[1] != lb[1]


def test_a_copied_prompt_gets_the_keys_its_tokens_hash_to() -> None:
    """A prompt copying another request's tokens reuses its keys only where
    they are what hashing its own tokens gives: under the same inputs, and
    not from a session chunk's keys that still cover a replaced token."""
    salted = HashInputs(cache_salt="t1")
    source = Request("A", list(range(1000, 1045)), 8, 1, salted)
    source.append_output([7, 8, 9])
    for n, inputs in itertools.product((8, 9, 17, 40, 48), (salted, HashInputs())):
        tokens = source.all_token_ids[:n] + [5] * 20
        copy = Request("B", tokens, 8, 1, inputs, source.copied_keys(n, inputs))
        assert copy.keys == prefix_keys(tokens, 8, 1, inputs), (n, inputs)
    assert source.copied_keys(40, salted) == source.keys[:4]
    assert source.copied_keys(40, HashInputs()) == []
    # A session's next chunk keeps the key whose lookahead token it dropped.
    source.continue_session([3] * 10)
    assert source.copied_keys(40, salted) == []
    source.rehash()
    assert source.copied_keys(40, salted) == source.keys[:4]


# -- against vLLM's own block hasher -------------------------------------------

_ITEM_IDS = ("img-a", "img-b")


@st.composite
def _inputs(draw: st.DrawFn, length: int) -> HashInputs:
    salt = draw(st.sampled_from(("", "t1", "t2")))
    lora = draw(st.sampled_from(("", "ad1", "ad2")))
    items: list[MmItem] = []
    position = draw(st.integers(0, 12))
    while position < length - 1 and len(items) < 3 and draw(st.booleans()):
        size = draw(st.integers(1, min(12, length - position)))
        items.append(MmItem(position, size, draw(st.sampled_from(_ITEM_IDS))))
        position += size + draw(st.integers(0, 10))
    return HashInputs(salt, lora, tuple(items))


@st.composite
def _near(draw: st.DrawFn, inputs: HashInputs, length: int) -> HashInputs:
    change = draw(st.sampled_from(("shift", "id", "salt", "lora")))
    if change == "shift" and inputs.mm and inputs.mm[-1].end < length:
        return replace(inputs, mm=tuple(replace(m, offset=m.offset + 1) for m in inputs.mm))
    if change == "id" and inputs.mm:
        first = replace(inputs.mm[0], identifier="img-other")
        return replace(inputs, mm=(first, *inputs.mm[1:]))
    if change == "salt":
        return replace(inputs, cache_salt="" if inputs.cache_salt else "t1")
    return replace(inputs, lora="" if inputs.lora else "ad1")


@needs_vllm
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), lookahead=st.sampled_from((0, 1)))
def test_keys_agree_with_vllms_hashes(data: st.DataObject, lookahead: int) -> None:
    """Two requests over the same tokens share a prefix key at a unit iff
    vLLM's block hashes there are equal, whatever their hash inputs."""
    from kvgate.impl import _vllm_api
    from kvgate.impl.vllm_build import request_inputs

    api = _vllm_api.load()
    api.init_none_hash(api.sha256)
    unit, length = 4, 40
    kwargs: dict[str, Any] = {"num_hash_lookahead_tokens": lookahead} if lookahead else {}
    hasher = api.get_request_block_hasher(unit, api.sha256, **kwargs)
    tokens = list(range(1000, 1000 + length))
    drawn = [data.draw(_inputs(length), label=f"inputs {i}") for i in range(2)]
    # A near copy of the first: the same items one token later (the same id
    # at another offset) or under another id, the salt or adapter swapped.
    near = data.draw(_near(drawn[0], length), label="near copy")
    drawn.append(near)
    keys, hashes = [], []
    for i, inputs in enumerate(drawn):
        request = api.Request(
            request_id=f"r{i}",
            prompt_token_ids=tokens,
            sampling_params=api.SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=hasher,
            **request_inputs(api, inputs),
        )
        hashes.append([bytes(h) for h in request.block_hashes])
        keys.append(prefix_keys(tokens, unit, lookahead, inputs))
    for (ka, ha), (kb, hb) in itertools.combinations(zip(keys, hashes, strict=True), 2):
        assert len(ka) == len(ha) == len(kb) == len(hb)
        assert [x == y for x, y in zip(ka, kb, strict=True)] == [
            x == y for x, y in zip(ha, hb, strict=True)
        ]


# -- events ---------------------------------------------------------------------


def test_event_lines_show_the_adapter_and_the_extra_keys() -> None:
    event = KvEvent(
        "stored", 1, ("8:a", "16:b"), None, 0, 16, 8, "ad", 5, (("ad", "t1"), ("ad", ("img", -3)))
    )
    assert event.line() == "stored g1 0-16/8: 8 16 lora ad extra ad,t1;ad,img@-3"
    assert "lora_id 5" in event.exact()
    assert KvEvent("stored", 0, ("8:a",), None, 0, 8, 8).line() == "stored g0 0-8/8: 8"


# -- exploration ----------------------------------------------------------------


def test_exploration_inherits_inputs_and_varies_one_in_a_few() -> None:
    counts: Counter[str] = Counter()
    inputs = RequestInputs("all", counts)
    root = inputs.fresh("R0", 60)
    assert root.cache_salt and root.lora and root.mm[0].end <= 60
    children = [inputs.shared(f"C{i}", "R0") for i in range(2 * VARY_EVERY)]
    varied = [c for c in children if c != root]
    assert len(varied) == 2 and counts["arrive:varied"] == 2
    # Each variant changes exactly one input, a different one in turn.
    changed = [
        {k for k in ("cache_salt", "lora", "mm") if getattr(c, k) != getattr(root, k)}
        for c in varied
    ]
    assert all(len(c) == 1 for c in changed) and changed[0] != changed[1]
    assert not RequestInputs("none", Counter()).fresh("R", 60)
