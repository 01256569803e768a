"""KV connectors at the manager level: the format's fields and their
refusals, the Scheduler's connector branch as the driver runs it on the
model (truncation of a local sub-block tail, reconciliation of a diverged
per-group hit, async loads and their completion), the corpus traces, and a
differential exploration against vLLM with the connector drawn."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import EXAMPLE_TRACE_CONFIG, needs_vllm, trace_text
from hypothesis import Phase

from kvgate.conformance.macros import expand, prefill_steps
from kvgate.conformance.replay import replay
from kvgate.conformance.trace import Trace, TraceError, bundled_corpus, load_corpus, parse_trace
from kvgate.conformance.writer import dump_trace
from kvgate.explore.differential import differential_mode
from kvgate.explore.profiles import profile
from kvgate.explore.runner import explore
from kvgate.model import ModelTarget
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.target import StepRefused

# The shared example config with a KV connector (the connector fields below
# are refused without it, so a config missing it fails every test here).
CONNECTOR_CONFIG = EXAMPLE_TRACE_CONFIG.replace(
    "  groups:\n", "  kv_connector: true\n  groups:\n", 1
)

# The same with vLLM's other load-failure policy.
FAIL_CONFIG = CONNECTOR_CONFIG.replace(
    "kv_connector: true\n", "kv_connector: true\n  kv_load_failure_policy: fail\n", 1
)

CONNECTOR_TRACES = [t for t in load_corpus(bundled_corpus()) if "-connector-" in t.name]

# A0 computed, then A1 resumes at A0's partial tail (136, inside a block).
PRODUCER = """\
- {op: arrive, req: A0, prompt: [{fresh: 150}]}
- {op: prefill, req: A0, lookahead: 3}
- {op: decode, req: A0, steps: 2, spec: 3}
- {op: free, req: A0, how: finish}
- {op: drain}
- {op: arrive, req: A1, prompt: [{all_of: A0}, {fresh: 26}]}
"""


def test_lookahead_hashes_with_a_connector_are_not_modelled() -> None:
    """vLLM keeps legacy block hashes under any KV connector, so the pair is a
    history production never runs: refused by name (the real-Scheduler
    target's refusal checks vLLM's own derived value), and exploration keeps
    the connector off where it drew lookahead hashes."""
    from kvgate.explore import knobs
    from kvgate.model.scope import validate
    from kvgate.vocabulary.config import NotModelled

    config = parse_trace(trace_text("- {op: step}\n", CONNECTOR_CONFIG)).config
    with pytest.raises(NotModelled) as refused:
        validate(replace(config, hash_lookahead_tokens=1))
    assert refused.value.field == "hash_lookahead_tokens"
    drawn = {"eagle": True, "kv_connector": "on"}
    assert not knobs.build({**drawn, "hash_lookahead_tokens": 1}).kv_connector
    assert knobs.build({**drawn, "hash_lookahead_tokens": 0}).kv_connector


# ------------------------------------------------------------------ format


@pytest.mark.parametrize(
    ("steps", "config", "field"),
    [
        # The lookup's connector fields need a connector.
        ("- {op: lookup, req: A1, remote_hit: 160}\n", None, "remote_hit"),
        ("- {op: prefill, req: A1, remote_async: true}\n", None, "remote_async"),
        ("- {op: lookup, req: A1, remote_hit: -1}\n", CONNECTOR_CONFIG, "remote_hit"),
        ("- {op: lookup, req: A1, remote_async: 1}\n", CONNECTOR_CONFIG, "remote_async"),
        ("- {op: allocate, req: A1, tokens: 1, remote_hit: 8}\n", CONNECTOR_CONFIG, "remote_hit"),
        (
            "- {op: lookup, req: A1}\n",
            CONNECTOR_CONFIG.replace("kv_connector: true", "kv_connector_divergent_hits: true"),
            "kv_connector_divergent_hits",
        ),
        (
            "- {op: lookup, req: A1}\n",
            CONNECTOR_CONFIG.replace("kv_connector: true", "kv_connector: yes please"),
            "config.kv_connector",
        ),
        # The load-failure policy: its values, its connector, and where each
        # policy puts a failed load (the retrying lookup; the ending free).
        (
            "- {op: lookup, req: A1}\n",
            FAIL_CONFIG.replace(": fail", ": retry"),
            "kv_load_failure_policy",
        ),
        (
            "- {op: lookup, req: A1}\n",
            FAIL_CONFIG.replace(": fail", ": [fail]"),
            "config.kv_load_failure_policy",
        ),
        (
            "- {op: lookup, req: A1}\n",
            FAIL_CONFIG.replace("  kv_connector: true\n", ""),
            "kv_load_failure_policy",
        ),
        ("- {op: free, req: A1, how: abort, load_failed: true}\n", CONNECTOR_CONFIG, "load_failed"),
        ("- {op: free, req: A1, how: finish, load_failed: true}\n", FAIL_CONFIG, "load_failed"),
        ("- {op: lookup, req: A1, load_failed: true}\n", FAIL_CONFIG, "load_failed"),
        ("- {op: prefill, req: A1, load_failed: true}\n", FAIL_CONFIG, "load_failed"),
        # Block-level failures: vLLM refuses them with several KV-cache
        # groups (its Scheduler raises RuntimeError), so a hybrid's trace
        # cannot write them; the list's shape; and where each policy puts them.
        (
            "- {op: allocate, req: A1, tokens: 8, invalid_blocks: [3]}\n",
            CONNECTOR_CONFIG,
            "invalid_blocks",
        ),
        ("- {op: free, req: A1, how: abort, invalid_blocks: [3]}\n", FAIL_CONFIG, "invalid_blocks"),
    ],
)
def test_malformed_connector_fields_are_one_line_errors(
    steps: str, config: str | None, field: str
) -> None:
    with pytest.raises(TraceError) as error:
        parse_trace(trace_text(PRODUCER + steps, config or EXAMPLE_TRACE_CONFIG), "bad.yaml")
    message = str(error.value)
    assert field in message and "bad.yaml" in message and "\n" not in message


# A pure Mamba model (one group, hashed at its block) behind a connector: the
# one layout vLLM takes block-level load failures on.
PURE_CONFIG = """\
config:
  num_blocks: 32
  hash_unit: 32
  eagle: false
  retention_interval: 0
  kv_connector: true
  groups:
    - {kind: mamba_align, block_size: 32, prefill_checkpoint_blocks: 1, \
prefill_checkpoint_alignment: 1}
"""
PURE_FAIL_CONFIG = PURE_CONFIG.replace(
    "kv_connector: true\n", "kv_connector: true\n  kv_load_failure_policy: fail\n"
)
# A0 computed; A1, its next turn, hits 128 locally and loads 96 tokens
# synchronously, 8 more computed: block 6 holds the loaded state.
PURE_LOAD = """\
- {op: arrive, req: A0, prompt: [{fresh: 150}]}
- {op: prefill, req: A0}
- {op: decode, req: A0, steps: 2}
- {op: free, req: A0, how: finish}
- {op: drain}
- {op: arrive, req: A1, prompt: [{all_of: A0}, {fresh: 90}]}
- {op: lookup, req: A1, remote_hit: 224}
- {op: allocate, req: A1, tokens: 8}
- {op: step}
- {op: drain}
"""


@pytest.mark.parametrize(
    ("steps", "config"),
    [
        ("- {op: allocate, req: A1, tokens: 8, invalid_blocks: []}\n", PURE_CONFIG),
        ("- {op: allocate, req: A1, tokens: 8, invalid_blocks: [6, 5]}\n", PURE_CONFIG),
        ("- {op: allocate, req: A1, tokens: 8, invalid_blocks: [-1]}\n", PURE_CONFIG),
        ("- {op: allocate, req: A1, tokens: 8, invalid_blocks: 6}\n", PURE_CONFIG),
        ("- {op: allocate, req: A1, tokens: 8, invalid_blocks: [6]}\n", PURE_FAIL_CONFIG),
        ("- {op: free, req: A1, how: abort, invalid_blocks: [6]}\n", PURE_CONFIG),
        ("- {op: free, req: A1, how: finish, invalid_blocks: [6]}\n", PURE_FAIL_CONFIG),
    ],
)
def test_malformed_failed_blocks_are_one_line_errors(steps: str, config: str) -> None:
    with pytest.raises(TraceError) as error:
        parse_trace(trace_text(PURE_LOAD + steps, config), "bad.yaml")
    message = str(error.value)
    assert "invalid_blocks" in message and "bad.yaml" in message and "\n" not in message
    assert "step 10" in message


@pytest.mark.parametrize(
    ("steps", "why"),
    [
        # Blocks 4 and 5 of the load are null in align mode; 7 is past it.
        ("- {op: allocate, req: A1, tokens: auto, invalid_blocks: [5]}\n", "not one the KV load"),
        ("- {op: allocate, req: A1, tokens: auto, invalid_blocks: [7]}\n", "not one the KV load"),
        # Only the step after a sync load's admission reports its blocks.
        (
            "- {op: allocate, req: A1, tokens: auto}\n- {op: step}\n- {op: drain}\n"
            "- {op: allocate, req: A1, tokens: auto, invalid_blocks: [6]}\n",
            "loaded no KV",
        ),
    ],
)
def test_failed_blocks_the_load_did_not_fill_are_refused(steps: str, why: str) -> None:
    trace = parse_trace(trace_text(PURE_LOAD + steps, PURE_CONFIG), "c.yaml")
    with pytest.raises(StepRefused) as refused:
        observe(ModelTarget(trace.config), trace.steps)
    assert refused.value.field == "invalid_blocks" and why in refused.value.message


def test_a_failed_block_another_request_holds_is_refused_by_name() -> None:
    """B hits A1's loaded state (keyed when A1's sync load was allocated)
    before the failure: vLLM would keep it computed for B; not modelled."""
    steps = (
        "- {op: arrive, req: B, prompt: [{prompt_of: A1}, {fresh: 4}]}\n"
        "- {op: lookup, req: B}\n"
        "- {op: allocate, req: B, tokens: 8}\n"
        "- {op: allocate, req: A1, tokens: auto, invalid_blocks: [6]}\n"
    )
    trace = parse_trace(trace_text(PURE_LOAD + steps, PURE_CONFIG), "c.yaml")
    with pytest.raises(StepRefused) as refused:
        observe(ModelTarget(trace.config), trace.steps)
    assert refused.value.field == "invalid_blocks" and "'B'" in refused.value.message


@needs_vllm
def test_no_request_can_take_a_sync_loaded_state_before_its_failure_is_reported() -> None:
    """Why a failed block is never shared on a single group: B hits A1's
    loaded state in the step that keyed it, and vLLM (the model in
    lockstep) defers B's admission to the next step, after that step's
    output reported the failure."""
    from kvgate.impl.vllm_target import VllmTarget

    same_step = PURE_LOAD.replace(
        "- {op: step}\n- {op: drain}\n",
        "- {op: arrive, req: B, prompt: [{prompt_of: A1}, {fresh: 10}]}\n"
        "- {op: lookup, req: B, expect: {hit: 224}}\n"
        "- {op: allocate, req: B, tokens: auto, expect: {ok: false}}\n"
        "- {op: step}\n- {op: drain}\n",
    )
    trace = parse_trace(trace_text(same_step, PURE_CONFIG.replace("32\n", "64\n", 1)), "s.yaml")
    target = VllmTarget(trace.config)
    try:
        result = replay(trace, target, ModelTarget, "strict")
    finally:
        target.close()
    assert result.passed, result.divergence


def test_failed_blocks_truncate_under_recompute_and_evict_under_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Recompute: A1 computes again from its failed block's start, the
    block stays keyed. Fail: the failed block and every later one of A1
    leave the prefix cache (refs kept) before A1 is freed."""
    recompute = parse_trace(
        trace_text(
            PURE_LOAD + "- {op: allocate, req: A1, tokens: 1, invalid_blocks: [6]}\n", PURE_CONFIG
        )
    )
    target = ModelTarget(recompute.config)
    seen = observe(target, recompute.steps)
    assert seen[-1][1]["ok"]
    assert target.requests["A1"].request.num_computed_tokens == 6 * 32 + 1
    keyed = {b.block_id for b in target.manager.block_pool.blocks if b.hash is not None}
    failed = target.manager.get_block_ids("A1")[0][6]
    assert failed in keyed
    fail = parse_trace(
        trace_text(
            PURE_LOAD + "- {op: free, req: A1, how: abort, invalid_blocks: [6]}\n", PURE_FAIL_CONFIG
        )
    )
    target = ModelTarget(fail.config)
    evicted: list[set[int]] = []
    original = target.manager.block_pool.evict_blocks

    def watched(ids: Iterable[int]) -> None:
        ids = set(ids)
        refs = {i: target.manager.block_pool.blocks[i].ref for i in ids}
        original(ids)
        assert {i: target.manager.block_pool.blocks[i].ref for i in ids} == refs
        evicted.append(set(ids))

    monkeypatch.setattr(target.manager.block_pool, "evict_blocks", watched)
    observe(target, fail.steps[:-1])
    table = target.manager.get_block_ids("A1")[0]
    observe(target, fail.steps[-1:])
    assert evicted == [set(table[6:])]
    assert table[6] not in {b.block_id for b in target.manager.block_pool.blocks if b.hash}


def test_the_fields_read_back_as_written() -> None:
    text = trace_text(
        PRODUCER + "- {op: lookup, req: A1, remote_hit: 160, remote_async: true}\n",
        CONNECTOR_CONFIG.replace(
            "kv_connector: true", "kv_connector: true\n  kv_connector_divergent_hits: true"
        ),
    )
    trace = parse_trace(text, "c.yaml")
    assert trace.config.kv_connector and trace.config.kv_connector_divergent_hits
    again = parse_trace(dump_trace("c", trace.config, trace.steps), "again.yaml")
    assert again.steps == trace.steps and again.config == trace.config
    lookup = again.steps[-1]
    assert (lookup.remote_hit, lookup.remote_async) == (160, True)


# ------------------------------------------------------------- the branch


def observe(target: ModelTarget, steps: tuple[Step, ...]) -> list[tuple[Step, dict[str, Any]]]:
    """Each primitive the steps stand for on `target`, with what it reported
    (a `prefill` run as the replayer runs it)."""
    seen: list[tuple[Step, dict[str, Any]]] = []
    for step in steps:
        if step.op == "check":
            continue
        if step.op == "decode":
            seen += [(p, target.apply(p)) for p in expand(step)]
            continue
        if step.op != "prefill":
            seen.append((step, target.apply(step)))
            continue
        primitives = prefill_steps(step)
        primitive = next(primitives)
        while True:
            observed = target.apply(primitive)
            seen.append((primitive, observed))
            try:
                if primitive.op == "allocate":
                    primitive = primitives.send(observed["prompt_done"])
                else:
                    primitive = next(primitives)
            except StopIteration:
                break
    return seen


def connector_trace(steps: str) -> Trace:
    return parse_trace(trace_text(PRODUCER + steps, CONNECTOR_CONFIG), "c.yaml")


def lookup(steps: str) -> dict[str, Any]:
    """What the last lookup of the steps (after the producer) reported."""
    trace = connector_trace(steps)
    seen = observe(ModelTarget(trace.config), trace.steps)
    return next(observed for step, observed in reversed(seen) if step.op == "lookup")


@pytest.mark.parametrize(
    ("remote", "hit", "external"),
    [
        (0, 136, 0),  # nothing remote: the local tail stays
        (136, 136, 0),  # remote reaches the tail, not past it: no load
        (137, 128, 9),  # one token past it: the remote hit wins
        (160, 128, 32),  # strictly past the tail: cut back to the block, load the rest
        (177, 128, 49),
    ],
)
def test_a_remote_hit_replaces_a_local_tail_only_when_strictly_longer(
    remote: int, hit: int, external: int
) -> None:
    observed = lookup(f"- {{op: lookup, req: A1, remote_hit: {remote}}}\n")
    assert (observed["local_hit"], observed["hit"], observed["external"]) == (136, hit, external)


def test_an_async_load_allocates_without_computing_then_completes_at_the_next_allocate() -> None:
    trace = connector_trace(
        "- {op: lookup, req: A1, remote_hit: 178, remote_async: true}\n"
        "- {op: allocate, req: A1, tokens: auto}\n"
        "- {op: step}\n- {op: drain}\n"
        "- {op: allocate, req: A1, tokens: auto}\n"
    )
    target = ModelTarget(trace.config)
    seen = [observed for _, observed in observe(target, trace.steps)]
    request = target.requests["A1"].request
    load, drain, done = seen[-4], seen[-2], seen[-1]
    assert load == {
        "ok": True, "tokens": 0, "prompt_done": False, "loading": True,
        "free_blocks": load["free_blocks"],
    }  # fmt: skip
    # Nothing zeroed: the connector writes the loaded blocks.
    assert drain["zeroed"] == []
    # The whole prompt was loaded: its last token is computed again.
    assert done["ok"] and done["tokens"] == 1 and done["prompt_done"]
    assert request.num_computed_tokens == request.num_tokens


@pytest.mark.parametrize(
    ("op", "field"),
    [
        ("- {op: lookup, req: A1}", "req"),
        ("- {op: free, req: A1, how: preempt}", "how"),
        ("- {op: decode1, req: A1}", "req"),
    ],
)
def test_a_request_whose_load_is_in_flight_refuses_what_the_scheduler_never_does(
    op: str, field: str
) -> None:
    trace = connector_trace(
        "- {op: lookup, req: A1, remote_hit: 160, remote_async: true}\n"
        "- {op: allocate, req: A1, tokens: auto}\n" + op + "\n"
    )
    target = ModelTarget(trace.config)
    observe(target, trace.steps[:-1])
    with pytest.raises(StepRefused) as refused:
        observe(target, trace.steps[-1:])
    assert refused.value.field == field and "in flight" in str(refused.value)


@pytest.mark.parametrize("load_async", [False, True])
def test_a_remote_hit_past_what_a_connector_may_report_is_refused(load_async: bool) -> None:
    """A sync load leaves the last token to compute; an async one may load
    every token (the completion then computes the last again)."""
    flag = str(load_async).lower()
    producer = connector_trace("")
    target = ModelTarget(producer.config)
    observe(target, producer.steps)
    total = len(target.requests["A1"].request.all_token_ids)
    most = total if load_async else total - 1
    for remote, refused in ((most, False), (most + 1, True)):
        trace = connector_trace(
            f"- {{op: lookup, req: A1, remote_hit: {remote}, remote_async: {flag}}}\n"
        )
        if not refused:
            observe(ModelTarget(trace.config), trace.steps)
            continue
        with pytest.raises(StepRefused) as error:
            observe(ModelTarget(trace.config), trace.steps)
        assert error.value.field == "remote_hit"


def test_a_diverged_per_group_hit_is_reconciled_without_external_tokens() -> None:
    name = "gdn-triton-connector-diverged-hit.hold-off"
    trace = next(t for t in CONNECTOR_TRACES if t.name == name)
    lookups: list[dict[str, Any]] = []

    class Recording(ModelTarget):
        def apply(self, step: Step) -> dict[str, Any]:
            observed = super().apply(step)
            if step.op == "lookup":
                lookups.append(observed)
            return observed

    assert replay(trace, Recording(trace.config), None, "strict").passed
    # S3: attention's 192 kept, the rest loaded; S2: nothing external, the
    # per-group hit (192) reconciled to the agreed one (0, junction 192).
    s3, s2 = lookups[1], lookups[2]
    assert (s3["local_hit"], s3["hit"], s3["external"]) == (192, 192, 38)
    assert (s2["local_hit"], s2["hit"], s2["junction"], s2["external"]) == (192, 0, 192, 0)


def test_a_failed_load_frees_the_request_and_admits_it_afresh() -> None:
    trace = connector_trace(
        "- {op: lookup, req: A1, remote_hit: 160, remote_async: true}\n"
        "- {op: allocate, req: A1, tokens: auto}\n"
        "- {op: step}\n- {op: drain}\n"
        "- {op: lookup, req: A1, load_failed: true}\n"
        "- {op: allocate, req: A1, tokens: auto}\n"
    )
    target = ModelTarget(trace.config)
    seen = observe(target, trace.steps)
    relookup, admitted = seen[-2][1], seen[-1][1]
    # A0's tail is still cached; nothing external this time.
    assert (relookup["hit"], relookup["external"]) == (136, 0)
    assert admitted["ok"] and admitted["tokens"] > 0
    assert target.requests["A1"].request.num_computed_tokens == 136 + admitted["tokens"]
    # Only a request whose load is in flight can have it fail.
    with pytest.raises(StepRefused) as refused:
        observe(target, connector_trace("- {op: lookup, req: A1, load_failed: true}\n").steps[-1:])
    assert refused.value.field == "load_failed"


def test_under_policy_fail_a_failed_load_ends_the_request() -> None:
    """The free that ends a request for its failed load frees what it no
    longer needs, then its blocks, as any end does; nothing is counted
    again in the stats, and only a load in flight can fail."""
    load = (
        "- {op: lookup, req: A1, remote_hit: 160, remote_async: true}\n"
        "- {op: allocate, req: A1, tokens: auto}\n"
        "- {op: step}\n- {op: drain}\n"
    )
    ends = "- {op: free, req: A1, how: abort, load_failed: true}\n- {op: stats}\n"
    failed = parse_trace(trace_text(PRODUCER + load + ends, FAIL_CONFIG), "f.yaml")
    aborted = parse_trace(
        trace_text(PRODUCER + load + ends.replace(", load_failed: true", ""), CONNECTOR_CONFIG)
    )
    failing, aborting = ModelTarget(failed.config), ModelTarget(aborted.config)
    seen, plain = observe(failing, failed.steps), observe(aborting, aborted.steps)
    assert seen[-1][1] == plain[-1][1] and seen[-1][1]["requests"] == 2
    assert failing.snapshot() == aborting.snapshot()
    assert "A1" not in failing.snapshot().tables
    fresh = ModelTarget(failed.config)
    early = parse_trace(trace_text(PRODUCER + ends, FAIL_CONFIG)).steps
    with pytest.raises(StepRefused) as refused:
        observe(fresh, early)
    assert refused.value.field == "load_failed"


def test_every_family_has_connector_traces_in_both_arms() -> None:
    names = {t.name for t in CONNECTOR_TRACES}
    for family in ("gdn-triton-", "gdn-flashinfer-", "mamba2-"):
        arms = {n.rsplit(".", 1)[-1] for n in names if n.startswith(family)}
        assert arms == {"hold-on", "hold-off"}, family
    assert any(t.config.kv_connector_divergent_hits for t in CONNECTOR_TRACES)
    assert any(s.remote_async for t in CONNECTOR_TRACES for s in t.steps)
    assert any(s.load_failed for t in CONNECTOR_TRACES for s in t.steps)
    # The fail policy's whole-load failure, in every family and both arms.
    for family in ("gdn-triton-", "gdn-flashinfer-", "mamba2-"):
        failing = {
            t.name.rsplit(".", 1)[-1]
            for t in CONNECTOR_TRACES
            if t.name.startswith(family)
            and t.config.kv_load_failure_policy == "fail"
            and any(s.op == "free" and s.load_failed for s in t.steps)
        }
        assert failing == {"hold-on", "hold-off"}, family


# ------------------------------------------------------------- on vLLM


# Every connector trace on vLLM 0.33.0 at strict level: hold-off ones in
# tests/test_corpus_gate.py, hold-on ones with the overlay in
# tests/test_hold_overlay.py (both take every corpus trace).


@needs_vllm
def test_differential_exploration_with_a_connector(tmp_path: Path) -> None:
    mode = replace(differential_mode(), stratum={"kv_connector": "divergent_hits"})
    settings = profile("ci", max_examples=30, phases=(Phase.explicit, Phase.generate, Phase.target))
    outcome = explore(mode, settings, out=tmp_path, shrink=False)
    assert outcome.failure is None, outcome.failure.summary()
    assert outcome.stats.knobs["kv_connector=divergent_hits"] > 0
    assert outcome.stats.ops["lookup:connector"] > 0


@needs_vllm
@pytest.mark.parametrize(
    ("policy", "failure_on"),
    [("fail", "load_failure:blocks:free"), ("recompute", "load_failure:blocks:allocate")],
)
def test_differential_exploration_draws_load_failures_on_a_single_group(
    tmp_path: Path, policy: str, failure_on: str
) -> None:
    """Pure Mamba behind a connector, against vLLM's manager: the connector
    rule's failures of the loaded state's block under each policy (the
    request ends with an error, or goes on from the block before) keep the
    two in lockstep."""
    stratum = {
        "mamba_groups": 1,
        "pure_mamba": True,
        "kv_connector": "on",
        "kv_load_failure_policy": policy,
    }
    mode = replace(differential_mode(), stratum=stratum)
    settings = profile("ci", max_examples=80, phases=(Phase.explicit, Phase.generate, Phase.target))
    outcome = explore(mode, settings, out=tmp_path, shrink=False)
    assert outcome.failure is None, outcome.failure.summary()
    assert outcome.stats.knobs[f"kv_load_failure_policy={policy}"] > 0
    failures = {k: n for k, n in outcome.stats.ops.items() if k.startswith("load_failure:")}
    assert failures.get(failure_on, 0) > 0, failures
