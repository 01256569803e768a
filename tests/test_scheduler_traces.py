"""Scheduler-level traces: the reader's validation, the bundled corpus on
the model and on vLLM's real `Scheduler`, and drifts the replay catches."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from configs import SMALL_SCHEDULER_TRACE_HEAD, needs_vllm
from scheduler_runs import Wrapped, read_error, run_model, run_vllm

from kvgate.conformance.replay import HOLD_NOTE, ReplayResult
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import (
    Trace,
    TraceError,
    bundled_scheduler_corpus,
    load_corpus,
    parse_trace,
)
from kvgate.conformance.writer import dump_engine_trace
from kvgate.model.scheduler import SchedulerModel
from kvgate.vocabulary.scheduling import EngineSettings, EngineStep, RemoteHit

CORPUS = load_corpus(bundled_scheduler_corpus())
ROOT = Path(__file__).resolve().parent.parent


def ids(traces: list[Trace]) -> list[str]:
    return [t.name for t in traces]


def first_failure(result: ReplayResult) -> tuple[int, str, str]:
    """Where a replay first failed: (engine entry, level, what)."""
    divergence = result.divergence
    assert divergence is not None
    return divergence.step.index, divergence.level, divergence.what


def by_name(name: str) -> Trace:
    [trace] = [t for t in CORPUS if t.name == name]
    return trace


# -- the reader ---------------------------------------------------------------

VALID = (
    SMALL_SCHEDULER_TRACE_HEAD.format(name="small")
    + """\
  - {op: arrive, req: A, prompt: [{fresh: 40}], max_tokens: 2}
  - {op: step, expect: {scheduled: [[A, 32]]}}
  - {op: arrive, req: B, prompt: [{all_of: A}, {fresh: 8}], max_tokens: 1, follows: A}
  - {op: step, steps: 3}
  - {op: abort, req: B}
"""
)


def malformed(edit: Callable[[dict[str, Any]], None]) -> str:
    doc = yaml.safe_load(VALID)
    edit(doc)
    return str(yaml.safe_dump(doc, sort_keys=False))


def engine(index: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    """An edit of engine step `index`: each field set (None: removed)."""

    def edit(doc: dict[str, Any]) -> None:
        for key, value in fields.items():
            if value is None:
                del doc["engine"][index][key]
            else:
                doc["engine"][index][key] = value

    return edit


def top(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc.update(fields)

    return edit


def with_connector(index: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    """`engine(index, **fields)` on the valid trace with a KV connector."""

    def edit(doc: dict[str, Any]) -> None:
        doc["config"]["kv_connector"] = True
        engine(index, **fields)(doc)

    return edit


# (an edit of the valid trace, the step it names (None: the document), the field)
MALFORMED: dict[str, tuple[Callable[[dict[str, Any]], None], int | None, str]] = {
    "engine not a list": (top(engine={"op": "step"}), None, "engine"),
    "steps beside engine": (top(steps=[{"op": "step"}]), None, "steps"),
    "unknown scheduler key": (top(scheduler={"spec": 0, "seqs": 4}), None, "scheduler.seqs"),
    "spec not a count": (top(scheduler={"spec": -1}), None, "scheduler.spec"),
    "max_num_seqs zero": (top(scheduler={"max_num_seqs": 0}), None, "scheduler.max_num_seqs"),
    "unknown engine op": (engine(1, op="decode"), 1, "op"),
    "unknown field": (engine(0, lookahead=3), 0, "lookahead"),
    "missing max_tokens": (engine(0, max_tokens=None), 0, "max_tokens"),
    "max_tokens zero": (engine(0, max_tokens=0), 0, "max_tokens"),
    "past max_model_len": (engine(0, max_tokens=500), 0, "max_tokens"),
    "prompt of no request": (engine(2, prompt=[{"all_of": "Z"}]), 2, "prompt[0].all_of"),
    "follows no request": (engine(2, follows="Z"), 2, "follows"),
    "arrives twice": (engine(2, req="A"), 2, "req"),
    "bad cache salt": (engine(0, cache_salt="a b"), 0, "cache_salt"),
    "steps zero": (engine(3, steps=0), 3, "steps"),
    "expect over repeats": (engine(3, expect={"finished": ["A"]}), 3, "expect"),
    "unknown expect key": (engine(1, expect={"hits": 3}), 1, "expect.hits"),
    "scheduled malformed": (engine(1, expect={"scheduled": [["A"]]}), 1, "expect.scheduled"),
    "scheduled unknown request": (
        engine(1, expect={"scheduled": [["Z", 4]]}),
        1,
        "expect.scheduled",
    ),
    "preempted not a list": (engine(1, expect={"preempted": "A"}), 1, "expect.preempted"),
    "cached_tokens not counts": (
        engine(1, expect={"cached_tokens": {"A": "x"}}),
        1,
        "expect.cached_tokens",
    ),
    "remote hit without a connector": (engine(0, remote_hit=8), 0, "remote_hit"),
    "remote hit not a count": (with_connector(0, remote_hit=-1), 0, "remote_hit"),
    # A sync load leaves the last of the prompt's 40 tokens to compute.
    "sync remote hit of the whole prompt": (with_connector(0, remote_hit=40), 0, "remote_hit"),
    "async remote hit past the prompt": (
        with_connector(0, remote_hit=41, remote_async=True),
        0,
        "remote_hit",
    ),
    "remote async not a flag": (with_connector(0, remote_async="yes"), 0, "remote_async"),
    "remote delay of a sync load": (with_connector(0, remote_delay=1), 0, "remote_delay"),
    "remote fails not a flag": (
        with_connector(0, remote_hit=8, remote_async=True, remote_fails=1),
        0,
        "remote_fails",
    ),
    "remote fails of a sync load": (
        with_connector(0, remote_hit=8, remote_fails=True),
        0,
        "remote_fails",
    ),
    "accept without drafts": (engine(1, accept={"A": 1}), 1, "accept"),
    "accept over repeats": (engine(3, accept={"A": 1}), 3, "accept"),
    "skip_prefix_cache not a flag": (engine(0, skip_prefix_cache=1), 0, "skip_prefix_cache"),
    "remote undecided without a connector": (engine(0, remote_undecided=1), 0, "remote_undecided"),
    "remote undecided not a count": (
        with_connector(0, remote_undecided=-1),
        0,
        "remote_undecided",
    ),
    "abort of no request": (engine(4, req="Z"), 4, "req"),
    "reset running not a flag": (engine(4, op="reset", req=None, running="yes"), 4, "running"),
    "reset expects a step's key": (
        engine(4, op="reset", req=None, expect={"finished": []}),
        4,
        "expect.finished",
    ),
    "reset connector not a flag": (
        engine(4, op="reset", req=None, connector="yes"),
        4,
        "connector",
    ),
    "reset ok not a flag": (engine(4, op="reset", req=None, expect={"ok": 1}), 4, "expect.ok"),
    "reset waiting unknown": (
        engine(4, op="reset", req=None, expect={"waiting": ["Z"]}),
        4,
        "expect.waiting",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_a_malformed_scheduler_trace_is_one_error_naming_step_and_field(case: str) -> None:
    edit, step, field = MALFORMED[case]
    error = read_error(malformed(edit))
    assert (error.step_index, error.field) == (step, field), str(error)


def test_an_arrivals_remote_hit_reads_as_the_connectors_answer() -> None:
    doc = yaml.safe_load(VALID)
    with_connector(0, remote_hit=40, remote_async=True, remote_delay=2)(doc)
    trace = parse_trace(yaml.safe_dump(doc))
    assert trace.engine[0].remote == RemoteHit(40, True, 2)
    assert trace.engine[2].remote is None
    with_connector(0, remote_fails=True)(doc)
    assert parse_trace(yaml.safe_dump(doc)).engine[0].remote == RemoteHit(40, True, 2, fails=True)


def test_an_abort_after_an_abort_and_eagle_without_drafts_are_refused() -> None:
    twice = VALID + "  - {op: abort, req: B}\n"
    with pytest.raises(TraceError, match=r"step 5: req: 'B' was aborted at step 4"):
        parse_trace(twice)
    eagle = VALID.replace("eagle: false", "eagle: true")
    with pytest.raises(TraceError, match=r"scheduler.spec: config.eagle"):
        parse_trace(eagle)


def test_the_valid_trace_reads_as_engine_steps() -> None:
    trace = parse_trace(VALID)
    assert trace.scheduler_level and not trace.steps
    assert [(e.op, e.index) for e in trace.engine] == [
        ("arrive", 0),
        ("step", 1),
        ("arrive", 2),
        ("step", 3),
        ("step", 3),
        ("step", 3),
        ("abort", 4),
    ]
    assert trace.engine[2].follows == "A"


def test_the_command_line_reports_a_malformed_trace_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(malformed(engine(1, expect={"hits": 3})))
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "replay", str(path), "--target", "model"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"kvgate: error: {path}: step 1: expect.hits: unknown expect key of engine op step "
        "(expected one of scheduled, preempted, cached_tokens, finished, encoded, events)"
    ]
    assert "Traceback" not in done.stderr


# -- the bundled corpus on the model ------------------------------------------


def test_the_corpus_covers_the_families_both_arms_and_the_scheduler_paths() -> None:
    names = set(ids(CORPUS))
    for family in ("gdn-triton", "gdn-flashinfer", "mamba2"):
        for arm in ("hold-on", "hold-off", "fork.hold-on", "fork.hold-off"):
            assert f"sched-{family}-next-turn-after-burst.{arm}" in names
    assert {
        "sched-preempt-under-pressure-and-resume",
        "sched-abort-mid-prefill",
        "sched-long-prefill-threshold",
        "sched-prefix-cache-reset-with-running",
        "sched-model-runner-v2-preempt-and-resume",
        "sched-connector-divergent-local-hits",
        "sched-connector-async-load-fails-and-retries",
        "sched-connector-async-load-fails-the-request",
        "sched-prefill-cadence",
        "sched-connector-abort-during-async-load",
    } <= names
    preempted = by_name("sched-preempt-under-pressure-and-resume")
    assert any(e.expect.get("preempted") for e in preempted.engine)


@pytest.mark.parametrize("trace", CORPUS, ids=ids(CORPUS))
def test_every_scheduler_trace_conforms_on_the_model(trace: Trace) -> None:
    result = run_model(trace)
    assert result.passed, result.divergence


def cached_a2(trace: Trace) -> list[int]:
    """The follow-up A2's expected cached tokens."""
    return [
        e.expect["cached_tokens"]["A2"]
        for e in trace.engine
        if "A2" in e.expect.get("cached_tokens", {})
    ]


def test_each_hold_on_trace_shows_the_hold() -> None:
    """Its follow-up A2 has cached tokens with the hold, none without."""
    for trace in CORPUS:
        if not trace.config.hold or trace.config.retain_retired:
            continue
        if "next-turn-after-burst" not in trace.name:
            continue  # the other hold arms show it otherwise (their own tests)
        off = by_name(trace.name.replace(".hold-on", ".hold-off"))
        with_hold = cached_a2(trace)
        without = cached_a2(off)
        assert with_hold[0] > 0 and without == [0], trace.name


def test_the_forks_retention_alone_resumes_where_prefill_checkpoints_export_the_tail() -> None:
    """Without the hold, the fork's retention resumes A2 at A1's tail on
    Mamba2 and GDN on FlashInfer (as the hold does), and not on Triton."""
    for family, resumes in (("mamba2", True), ("gdn-flashinfer", True), ("gdn-triton", False)):
        name = f"sched-{family}-next-turn-after-burst"
        with_hold = cached_a2(by_name(f"{name}.hold-on"))
        assert cached_a2(by_name(f"{name}.fork.hold-on")) == with_hold
        fork_alone = cached_a2(by_name(f"{name}.fork.hold-off"))
        assert fork_alone == (with_hold if resumes else [0]), name


def test_without_drafts_the_lookahead_trace_runs_both_prompts_at_once() -> None:
    """The draft slots are what keep B0 waiting: with no drafts the model
    schedules A0 and B0 in the first step, against the trace's expectation."""
    name = "sched-mamba2-spec-lookahead-holds-admission"
    text = (bundled_scheduler_corpus() / f"{name}.yaml").read_text()
    no_drafts = (
        text.replace("spec: 3,", "spec: 0,")
        .replace("eagle: true", "eagle: false")
        .replace(", speculative_blocks: 3", "")
    )
    trace = parse_trace(no_drafts, name)
    result = run_model(trace)
    first_step = next(e for e in trace.engine if e.op == "step")
    assert first_failure(result) == (first_step.index, "expect", "scheduled")
    divergence = result.divergence
    assert divergence is not None and divergence.actual == [("A0", 60), ("B0", 60)]


def test_a_model_that_reports_cached_tokens_wrongly_misses_the_expectation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reported = SchedulerModel._prefill_stats
    monkeypatch.setattr(
        SchedulerModel,
        "_prefill_stats",
        lambda self, live, preempted: (
            reported(self, live, preempted)[0] + 8,
            reported(self, live, preempted)[1],
        ),
    )
    trace = by_name("sched-gdn-triton-next-turn-after-burst.hold-on")
    result = run_model(trace)
    first = next(e for e in trace.engine if "cached_tokens" in e.expect)
    assert first_failure(result) == (first.index, "expect", "cached_tokens")


# -- on vLLM's real Scheduler ---------------------------------------------------


@needs_vllm
@pytest.mark.parametrize("trace", CORPUS, ids=ids(CORPUS))
def test_every_scheduler_trace_conforms_on_vllm_at_strict_level(overlay: Any, trace: Trace) -> None:
    result = run_vllm(trace)
    assert not result.notes  # the hold where the trace asks for it
    assert result.passed, result.divergence


class _WrongCachedTokens(Wrapped):
    """vLLM's Scheduler, reporting each first output's cached tokens one block high."""

    def take_prefill_stats(self) -> dict[str, tuple[int, int]]:
        stats = self.real.take_prefill_stats()
        return {r: (cached + 8, written) for r, (cached, written) in stats.items()}


class _LocalHitsCountExternal(Wrapped):
    """vLLM's Scheduler, its prefix-cache stats counting a KV connector's
    tokens as local hits (as if it recorded the whole hit)."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        self.external = 0

    def schedule(self) -> Any:
        step = self.real.schedule()
        self.external += sum(external for _, _, external, _ in step.taken)
        return step

    def take_prefix_cache_stats(self) -> dict[str, int | bool] | None:
        stats: dict[str, int | bool] | None = self.real.take_prefix_cache_stats()
        if stats is not None:
            stats = {**stats, "hits": int(stats["hits"]) + self.external}
            self.external = 0
        return stats


@needs_vllm
def test_a_scheduler_whose_prefix_cache_stats_count_external_hits_diverges() -> None:
    trace = by_name("sched-connector-sync-hit-cached-tokens")
    assert run_vllm(trace).passed
    index, level, what = first_failure(run_vllm(trace, _LocalHitsCountExternal))
    assert level == "api" and what.endswith("prefix-cache stats"), what
    [admission] = [e for e in trace.engine if e.op == "step"][3:4]
    assert index == admission.index


@needs_vllm
def test_a_scheduler_that_reports_cached_tokens_wrongly_diverges(overlay: Any) -> None:
    trace = by_name("sched-gdn-triton-next-turn-after-burst.hold-off")
    result = run_vllm(trace, _WrongCachedTokens)
    first = next(e for e in trace.engine if "cached_tokens" in e.expect)
    assert first_failure(result) == (first.index, "expect", "cached_tokens")
    # And the lockstep with the model names it too, at the same step.
    [lockstep] = [d for d in result.also if d.level == "api"]
    assert lockstep.step.index == first.index
    assert "prefill stats" in lockstep.what


@needs_vllm
def test_the_v2_model_runner_trace_runs_vllms_scheduler_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`model_runner: v2` builds vLLM's Scheduler for the v2 runner, and
    leaves the environment as it was; a Scheduler built for the other runner
    (the switch not reaching vLLM) is refused by the field's name."""
    import os

    from kvgate.impl import vllm_scheduler, vllm_scheduler_config
    from kvgate.vocabulary.config import UnsupportedConfig

    trace = by_name("sched-model-runner-v2-preempt-and-resume")
    switch = vllm_scheduler_config.MODEL_RUNNER_SWITCH
    monkeypatch.delenv(switch, raising=False)
    real = vllm_scheduler.VllmScheduler(trace.config, spec_tokens=0, max_num_seqs=4)
    try:
        assert real.scheduler.use_v2_model_runner is True
    finally:
        real.close()
    assert switch not in os.environ
    monkeypatch.setattr(vllm_scheduler_config, "MODEL_RUNNER_SWITCH", "KVGATE_NOT_VLLMS_SWITCH")
    with pytest.raises(UnsupportedConfig) as refused:
        vllm_scheduler.VllmScheduler(trace.config, spec_tokens=0, max_num_seqs=4)
    assert refused.value.field == "model_runner"


@needs_vllm
@pytest.mark.parametrize(
    "name",
    [
        "sched-connector-async-load-fails-and-retries",
        "sched-connector-async-load-fails-the-request",
    ],
)
def test_a_scheduler_that_takes_a_failed_load_for_done_diverges(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's Scheduler ignoring the worker's failed receives (the load
    taken for done, its KV used as loaded): the lockstep with the model, or
    the trace's own expectations, fail within a step or two of the report."""
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_handle_failed_recving", lambda self, failed: set())
    trace = by_name(name)
    result = run_vllm(trace)
    assert result.divergence is not None
    reported = (
        next(e.index for e in trace.engine if e.remote is not None and e.remote.fails) + 2
    )  # the load's allocation, then the step whose output reports it failed
    assert reported <= result.divergence.step.index <= reported + 2, result.divergence


@needs_vllm
def test_a_scheduler_that_keeps_a_diverged_local_hit_unbacked_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's per-group lookup never flagging a hit deeper than the Mamba
    group's: the Scheduler admits B at the attention group's 200 tokens with
    no Mamba state there, and the lockstep names B's admission."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    per_group = KVCacheManager.get_computed_blocks_for_connector

    def never_diverged(self: Any, request: Any, *args: Any) -> Any:
        blocks, tokens, boundary, _ = per_group(self, request, *args)
        return blocks, tokens, boundary, False

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks_for_connector", never_diverged)
    trace = by_name("sched-connector-divergent-local-hits")
    result = run_vllm(trace)
    divergence = result.divergence
    assert divergence is not None
    b_admitted = next(e.index for e in trace.engine if e.req == "B") + 1
    assert divergence.step.index == b_admitted, divergence


@needs_vllm
def test_a_scheduler_whose_prefill_cadence_never_holds_diverges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's Scheduler taking every step for a capacity-bound one (the
    cadence's escape always on): B's prefill runs at once beside A's decode,
    and the trace fails at the first step after B arrives."""
    from vllm.v1.core.sched.scheduler import Scheduler

    always = property(lambda self: True, lambda self, value: None)
    monkeypatch.setattr(Scheduler, "prefill_capacity_bound", always, raising=False)
    trace = by_name("sched-prefill-cadence")
    result = run_vllm(trace)
    divergence = result.divergence
    assert divergence is not None
    b_arrives = next(e.index for e in trace.engine if e.req == "B")
    assert divergence.step.index == b_arrives + 1, divergence


def test_a_prefill_cadence_with_a_connector_is_refused_by_name() -> None:
    from kvgate.vocabulary.config import NotModelled

    trace = by_name("sched-prefill-cadence")
    with pytest.raises(NotModelled) as refused:
        SchedulerModel(replace(trace.config, kv_connector=True), 0, 4)
    assert refused.value.field == "prefill_schedule_interval"


@needs_vllm
def test_a_scheduler_that_frees_in_another_order_diverges_at_strict_level(
    overlay: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's manager freeing a finished request's blocks head first (it
    frees them tail first, so the tail is evicted first): the free queue
    differs from the model's at the step the first request finishes."""
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    def free_head_first(self: Any, request_id: str) -> None:
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))

    monkeypatch.setattr(SingleTypeKVCacheManager, "free", free_head_first)
    trace = by_name("sched-long-prefill-threshold")
    result = run_vllm(trace)
    divergence = result.divergence
    assert divergence is not None
    first_finish = next(e for e in trace.engine if e.expect.get("finished"))
    assert (divergence.step.index, divergence.level) == (first_finish.index, "strict")
    assert "free queue" in divergence.what


@needs_vllm
@pytest.mark.usefixtures("upstream")
def test_a_hold_on_trace_fails_its_expectations_on_upstream_vllm() -> None:
    """Without the hold the lockstep model runs with it off (and says so):
    the two schedulers agree, and the trace's own expectations (A2's cached
    tokens) fail."""
    from kvgate.impl.vllm_scheduler import VllmScheduler

    trace = by_name("sched-gdn-triton-next-turn-after-burst.hold-on")
    assert trace.scheduler is not None
    real = VllmScheduler(trace.config, spec_tokens=trace.scheduler.spec, max_num_seqs=8)
    try:
        result = replay_scheduler(trace, SchedulerModel, real, "strict")
    finally:
        real.close()
    assert result.notes == (HOLD_NOTE,)
    assert result.failures and all(d.level == "expect" for d in result.failures)
    assert "cached_tokens" in {d.what for d in result.failures}
    # What it costs, in the production symptom's terms: the follow-up turn
    # reports no cached token, at whichever step vLLM reports it.
    from kvgate.conformance.verdict import Cost, cost

    (expected,) = [
        e.expect["cached_tokens"]["A2"]
        for e in trace.engine
        if "A2" in getattr(e, "expect", {}).get("cached_tokens", {})
    ]
    assert result.cached_tokens["A2"] == 0
    assert cost([result]) == Cost(traces=1, short_lookups=1, total_misses=1, tokens=expected)


@needs_vllm
@pytest.mark.usefixtures("upstream")
def test_a_fork_trace_lacks_the_retention_on_upstream_vllm() -> None:
    """Without the retention the lockstep model runs with it off (and says
    so): only the trace's own expectations fail, so the verdict is LACKS."""
    from kvgate.conformance.replay import RETIRE_NOTE
    from kvgate.conformance.verdict import Verdict, verdict
    from kvgate.impl.vllm_scheduler import VllmScheduler

    trace = by_name("sched-mamba2-next-turn-after-burst.fork.hold-off")
    assert trace.scheduler is not None
    real = VllmScheduler(
        trace.config, spec_tokens=trace.scheduler.spec, max_num_seqs=trace.scheduler.max_num_seqs
    )
    try:
        result = replay_scheduler(trace, SchedulerModel, real, "strict")
    finally:
        real.close()
    assert result.notes == (RETIRE_NOTE,)
    assert "cached_tokens" in {d.what for d in result.failures}
    assert verdict(result) is Verdict.LACKS


def test_a_manager_replay_refuses_a_scheduler_level_trace() -> None:
    """Its engine steps are no manager calls: replayed as a manager-level
    trace it would run nothing and pass."""
    from kvgate.conformance.replay import replay
    from kvgate.model import ModelTarget

    trace = CORPUS[0]
    with pytest.raises(TraceError, match="engine: a scheduler-level trace replays on a whole"):
        replay(trace, ModelTarget(trace.config), None, "strict")


def test_a_model_that_requeues_in_another_order_after_a_reset_misses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reset = SchedulerModel.reset_prefix_cache

    def reversed_queue(
        self: SchedulerModel, running: bool, connector: bool = False
    ) -> tuple[bool, list[str]]:
        ok, waiting = reset(self, running, connector)
        return ok, waiting[::-1]

    monkeypatch.setattr(SchedulerModel, "reset_prefix_cache", reversed_queue)
    trace = by_name("sched-prefix-cache-reset-with-running")
    result = run_model(trace)
    [reset_with_running] = [e for e in trace.engine if e.op == "reset" and e.running]
    assert first_failure(result) == (reset_with_running.index, "expect", "waiting")


def _engine_fields(trace: Trace) -> list[tuple[object, ...]]:
    return [
        (
            e.op,
            e.req,
            e.prompt,
            e.max_tokens,
            e.cache_salt,
            e.lora,
            e.follows,
            e.remote,
            e.priority,
            e.running,
            e.mode,
            e.stop,
            e.accept,
            e.expect,
        )
        for e in trace.engine
    ]


@pytest.mark.parametrize("trace", CORPUS, ids=ids(CORPUS))
def test_the_writer_writes_every_bundled_trace_back_as_read(trace: Trace) -> None:
    text = dump_engine_trace(
        trace.name, trace.config, trace.scheduler or EngineSettings(), trace.engine, trace.about
    )
    back = parse_trace(text)
    assert back.config == trace.config and back.scheduler == trace.scheduler
    assert _engine_fields(back) == _engine_fields(trace)


def test_the_writer_runs_plain_steps_together_but_never_into_a_stop() -> None:
    """A step with a stop condition applies to one step: the plain steps
    after it are written as a run of their own."""
    head = next(t for t in CORPUS if t.name == "sched-session-next-chunk-while-waiting")
    engine = (
        EngineStep("arrive", 0, req="A", prompt=head.engine[0].prompt, max_tokens=3),
        EngineStep("step", 1, stop=("A",)),
        EngineStep("step", 2),
        EngineStep("step", 3),
    )
    text = dump_engine_trace("t", head.config, EngineSettings(), engine)
    assert "{op: step, stop: [A]}" in text and "{op: step, steps: 2}" in text
    back = parse_trace(text)
    assert [e.stop for e in back.engine if e.op == "step"] == [("A",), (), ()]


@needs_vllm
def test_a_prefill_one_token_past_a_mamba_block_never_completes_with_two_lookahead_tokens() -> None:
    """A vLLM defect the model follows: with a drafter reading 2 prefill
    tokens ahead, B (A's 33-token prompt, 24 of it cached) runs to token
    31; its next chunk must end at the Mamba block's end (32), which would
    leave 1 prompt token, fewer than the 2 the drafter reads, so the chunk
    is cut to nothing. B is passed over at every step and never finishes
    (both sides agree, step for step)."""
    name = "sched-mtp2-state-keyed-by-the-last-output-is-not-this-steps"
    (trace,) = [t for t in CORPUS if t.name == name]
    text = trace.path.read_text()
    stuck = text.replace(
        "  - {op: abort, req: B}\n  - {op: step, expect: {scheduled: []}}\n",
        "  - {op: step, expect: {scheduled: []}}\n" * 20,
    )
    assert stuck != text
    result = run_vllm(parse_trace(stuck, trace.path))
    assert result.passed, result.divergence


@needs_vllm
def test_a_victim_dropped_from_the_step_finds_its_never_encoded_image_cached() -> None:
    """What looks like a vLLM defect the model follows: the Scheduler
    allocated L's image in the encoder cache when it scheduled L's chunk,
    then dropped the chunk with L (the priority policy's victim), so the
    image was never encoded; the preemption leaves the entry cached, and
    when L runs again its chunk over the image encodes nothing (the worker
    is then asked for an encoder output it never computed)."""
    name = "sched-priority-victim-drops-its-image-from-the-step"
    (trace,) = [t for t in CORPUS if t.name == name]
    text = trace.path.read_text()
    resumed = text.replace("  - {op: abort, req: L}\n", "").replace(
        "  - {op: step, expect: {scheduled: []}}\n",
        # L again, from its 288 cached tokens: inside its image (256 to 296).
        "  - {op: step, expect: {scheduled: [[L, 8]], encoded: {}}}\n",
    )
    assert resumed != text
    result = run_vllm(parse_trace(resumed, trace.path))
    assert result.passed, result.divergence
