"""vLLM's real `Scheduler` with kvgate's scripted KV connector.

The connector (`kvgate.impl.vllm_connector`) answers only what a test
scripts; vLLM's factory builds it from `kv_transfer_config`, the Scheduler
drives it, and the fake model runner reports the worker's finished loads.
The first tests pin the Scheduler's connector branch directly: what it
presents to the connector, when a remote hit supersedes a local sub-block
tail, an asynchronous load's allocation and completion. The lockstep tests
run the workload with drawn external hits (`--kv-connector`) on the real
Scheduler beside kvgate's driver and model at strict level, and show that a
driver drifting from the Scheduler's connector branch diverges.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from configs import EXAMPLE_CONFIG, needs_vllm

from kvgate import targets
from kvgate.conformance.replay import replay
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import Trace, TraceError, parse_trace
from kvgate.model.scheduler import SchedulerModel
from kvgate.vocabulary.config import UnsupportedConfig
from kvgate.vocabulary.scheduling import ScheduledStep
from kvgate.workload.deployment import Deployment
from kvgate.workload.lockstep import scheduler_arm
from kvgate.workload.plan import Workload
from kvgate.workload.progress import Progress
from kvgate.workload.runner import Arm, ArmResult

pytestmark = needs_vllm

# The seed's config, hold off: attention blocks of 8, Mamba blocks of 32.
CONFIG = dataclasses.replace(EXAMPLE_CONFIG, hold=False)
SPEC = 3
# A follow-up of a 100-token prompt that ran 2 output tokens hits this much
# locally: A's prompt tail state, kept at the hash unit (sparse retention,
# the eagle drop taking the last unit), 24 tokens into a Mamba block.
LOCAL_TAIL_HIT = 88
_tokens = itertools.count(1)


def _fresh(n: int) -> list[int]:
    return [next(_tokens) for _ in range(n)]


@pytest.fixture
def scheduler() -> Iterator[object]:
    from kvgate.impl.vllm_scheduler import VllmScheduler
    from kvgate.impl.vllm_scheduler_config import ConnectorSettings

    target = VllmScheduler(CONFIG, spec_tokens=SPEC, max_num_seqs=4, connector=ConnectorSettings())
    yield target
    target.close()


def _step(
    target: object, *, loaded: tuple[str, ...] = (), failed: tuple[str, ...] = ()
) -> ScheduledStep:
    """One engine step: each request whose prompt the step completes (or
    that decodes) samples one token."""
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert isinstance(target, VllmScheduler)
    step = target.schedule()
    requests = target.scheduler.requests
    sampled = {
        name: [next(_tokens)]
        for name, _ in step.scheduled
        if requests[name].num_computed_tokens >= requests[name].num_tokens
    }
    target.update(sampled, loaded=loaded, failed=failed)
    return step


def _follow_up_of_a_finished_turn(target: object) -> list[int]:
    """Runs a 100-token turn A to its end (its partial tail cached at
    `LOCAL_TAIL_HIT`), clears the connector's record, and returns a follow-up
    prompt: A's prompt and output, then 30 fresh tokens."""
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert isinstance(target, VllmScheduler)
    prompt = _fresh(100)
    target.add_request("A", prompt, 2, None)
    while "A" in target.scheduler.requests:
        _step(target)
    target.connector_script.take()
    return prompt + list(target._requests["A"].output_token_ids) + _fresh(30)


def test_a_sync_remote_hit_is_admitted_with_the_external_tokens(scheduler: object) -> None:
    from kvgate.impl.vllm_connector import Allocated, ExternalHit
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert isinstance(scheduler, VllmScheduler)
    script = scheduler.connector_script
    script.hits["A"] = ExternalHit(64)
    scheduler.add_request("A", _fresh(100), 4, None)
    step = _step(scheduler)
    _, allocations, _ = script.take()
    # Nothing cached locally: the Scheduler presents 0, the store has 64.
    assert step.connector_queries == [("A", 0, 64, False)]
    [allocated] = allocations
    assert allocated.request == "A" and allocated.external == 64
    assert isinstance(allocated, Allocated)
    # The chunk starts after the external tokens (the split stops at the
    # prompt's last cacheable block end, 88).
    assert step.scheduled == [("A", 24)]
    assert scheduler.scheduler.requests["A"].num_computed_tokens == 88


def test_an_async_load_runs_nothing_until_the_worker_reports_it(scheduler: object) -> None:
    from kvgate.impl.vllm_connector import ExternalHit
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert isinstance(scheduler, VllmScheduler)
    script = scheduler.connector_script
    script.hits["B"] = ExternalHit(96, load_async=True)
    scheduler.add_request("B", _fresh(100), 4, None)
    first = _step(scheduler)
    _, allocations, _ = script.take()
    assert first.connector_queries == [("B", 0, 96, True)]
    # Blocks for the load, nothing scheduled: the request waits for its KV.
    assert [a.external for a in allocations] == [96]
    assert first.scheduled == [] and first.lookups == [("B", 0)]
    request = scheduler.scheduler.requests["B"]
    assert request.num_computed_tokens == 96
    assert request.status == scheduler._api.RequestStatus.WAITING_FOR_REMOTE_KVS
    # Not reported yet: still waiting, no lookup again.
    second = _step(scheduler)
    assert second.scheduled == [] and second.lookups == []
    # Reported in this step's output: the next step admits it without a
    # lookup, from the loaded tokens.
    _step(scheduler, loaded=("B",))
    third = _step(scheduler)
    assert third.lookups == []
    assert third.scheduled == [("B", 4)]
    _, allocations, _ = script.take()
    # The completing admission allocates with no external tokens.
    assert [a.external for a in allocations] == [0]


def test_a_longer_remote_hit_supersedes_a_local_sub_block_tail(scheduler: object) -> None:
    from kvgate.impl.vllm_connector import ExternalHit
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert isinstance(scheduler, VllmScheduler)
    script = scheduler.connector_script
    follow_up = _follow_up_of_a_finished_turn(scheduler)
    script.hits["F"] = ExternalHit(len(follow_up) - 1)
    scheduler.add_request("F", follow_up, 2, "A")
    step = _step(scheduler)
    [(name, local)] = step.lookups
    _, allocations, _ = script.take()
    # A local hit ending inside a Mamba block (the prompt's partial tail).
    tail = local % CONFIG.scheduler_block_size
    assert name == "F" and tail
    [(_, presented, answered, _)] = step.connector_queries
    assert local == LOCAL_TAIL_HIT
    assert presented == local - tail
    assert answered == len(follow_up) - 1 - (local - tail) > tail
    # The local tail is dropped (no copy-on-write), the load covers it.
    assert step.copies == []
    [allocated] = allocations
    assert allocated.external == answered
    # One token left: the Scheduler pads the admission to a whole
    # speculative step (1 + K rows), as it pads any new request with one
    # token left to compute.
    assert step.scheduled == [("F", 1 + SPEC)]


def test_a_remote_hit_no_longer_than_the_local_tail_keeps_the_tail(scheduler: object) -> None:
    from kvgate.impl.vllm_connector import ExternalHit
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert isinstance(scheduler, VllmScheduler)
    script = scheduler.connector_script
    follow_up = _follow_up_of_a_finished_turn(scheduler)
    # Exactly the local hit: the remote store does not exceed it.
    script.hits["F"] = ExternalHit(LOCAL_TAIL_HIT, load_async=True)
    scheduler.add_request("F", follow_up, 2, "A")
    step = _step(scheduler)
    [(_, local)] = step.lookups
    _, allocations, _ = script.take()
    assert local == LOCAL_TAIL_HIT
    [(_, _, answered, load_async)] = step.connector_queries
    assert answered == local % CONFIG.scheduler_block_size
    assert load_async  # the connector said async; the Scheduler loads nothing
    [allocated] = allocations
    assert allocated.external == 0
    assert step.copies  # the tail's copy-on-write still runs


def test_a_failed_async_load_is_recomputed_from_the_start(scheduler: object) -> None:
    from kvgate.impl.vllm_connector import ExternalHit
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert isinstance(scheduler, VllmScheduler)
    script = scheduler.connector_script
    script.hits["B"] = ExternalHit(64, load_async=True)
    scheduler.add_request("B", _fresh(100), 4, None)
    _step(scheduler, failed=("B",))
    # Load-failure policy recompute: the blocks are freed and the request
    # looks up (and asks the connector) again.
    script.hits["B"] = ExternalHit(0)
    step = _step(scheduler)
    assert step.lookups == [("B", 0)]
    assert step.scheduled and step.scheduled[0][0] == "B"


def test_a_block_level_load_failure_is_refused_on_a_hybrid_model(scheduler: object) -> None:
    """vLLM's own rule: block ids are per group, so `invalid_block_ids` from a
    connector on a model with several KV-cache groups is an error; failures
    must come per request (`failed_recving`)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvgate.impl.vllm_connector import ExternalHit
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert isinstance(scheduler, VllmScheduler)
    scheduler.connector_script.hits["A"] = ExternalHit(64)
    scheduler.add_request("A", _fresh(100), 4, None)
    output = scheduler.scheduler.schedule()
    runner = ModelRunnerOutput(
        req_ids=["A"],
        req_id_to_index={"A": 0},
        sampled_token_ids=[[]],
        kv_connector_output=KVConnectorOutput(invalid_block_ids={1}),
    )
    with pytest.raises(RuntimeError, match="multiple KV cache groups"):
        scheduler.scheduler.update_from_output(output, runner)


def test_a_vllm_without_connector_support_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvgate.impl import vllm_connector
    from kvgate.impl.vllm_scheduler import VllmScheduler
    from kvgate.impl.vllm_scheduler_config import ConnectorSettings

    monkeypatch.setattr(
        vllm_connector,
        "_REQUIRED",
        (*vllm_connector._REQUIRED, ("vllm.v1.outputs", "NoSuchConnectorOutput")),
    )
    with pytest.raises(UnsupportedConfig) as refused:
        VllmScheduler(CONFIG, spec_tokens=SPEC, max_num_seqs=4, connector=ConnectorSettings())
    assert refused.value.field == "kv_connector"
    assert "vllm.v1.outputs.NoSuchConnectorOutput" in refused.value.message
    assert "\n" not in refused.value.message


def test_without_a_connector_the_scheduler_has_none() -> None:
    from kvgate.impl.vllm_scheduler import VllmScheduler

    target = VllmScheduler(CONFIG, spec_tokens=SPEC, max_num_seqs=4)
    try:
        assert target.scheduler.connector is None
        with pytest.raises(RuntimeError):
            target.connector_script  # noqa: B018
    finally:
        target.close()


# -- the workload with a connector, in lockstep ---------------------------------

SCALE = 32
WORKLOAD = Workload(sessions=8, turns=4, seed=0)
# Seed 0, upstream, unit 256/32: every connector path of the generator
# (sync and async loads, one failing, a remote hit superseding a local
# tail, padded admissions, a load completed with nothing to run). The same
# seed at the Mamba block (4096/32) on GPUs of 18 GiB instead of 24: a pool
# tight enough that the blocks an async load keeps free for the in-flight
# prefills decide admissions.
EVERY_PATH = (WORKLOAD, 256 // SCALE, 24.0, False)
TIGHT_POOL = (WORKLOAD, 4096 // SCALE, 18.0, False)
# A connector restoring lagging Mamba states (NIXL's kind): per-group local
# lookups, reconciled when nothing external backs attention's deeper hit.
PER_GROUP = (WORKLOAD, 256 // SCALE, 24.0, True)


Case = tuple[Workload, int, float, bool]


def _connector_arm(tmp_path: Path, case: Case) -> ArmResult:
    workload, unit, gpu_memory_gib, divergent_hits = case
    deployment = Deployment(
        build="upstream",
        kv_connector=True,
        kv_connector_divergent_hits=divergent_hits,
        gpu_memory_gib=gpu_memory_gib,
    ).scaled(SCALE)
    factory: Any = targets.target_factory("vllm-scheduler")
    return scheduler_arm(
        workload,
        deployment,
        Arm(unit, False),
        factory,
        tmp_path,
        "strict",
        Progress(stream=io.StringIO()),
    )


def _paths(trace: Trace) -> dict[str, int]:
    """How often the trace takes each connector path."""
    counts = dict.fromkeys(
        ("sync", "async", "superseded", "pad", "complete_only", "reserved", "load_failed"), 0
    )
    for step in trace.primitives:
        if step.op == "lookup":
            external = step.expect.get("external", 0)
            if external:
                counts["async" if step.remote_async else "sync"] += 1
            if step.expect.get("hit", 0) < step.expect.get("local_hit", 0):
                # Cut to whole blocks for a longer remote hit, or (per-group
                # lookups only) looked up again with nothing external.
                path = "superseded" if external else "reconciled"
                counts[path] = counts.get(path, 0) + 1
            counts["load_failed"] += step.load_failed
        elif step.op == "allocate":
            counts["pad"] += bool(step.pad)
            counts["complete_only"] += step.complete_only
            counts["reserved"] += bool(step.reserved)
    return counts


@pytest.mark.parametrize(
    "case", [EVERY_PATH, TIGHT_POOL, PER_GROUP], ids=["every-path", "tight-pool", "per-group"]
)
def test_the_connector_workload_keeps_lockstep_with_the_real_scheduler(
    tmp_path: Path, case: Case
) -> None:
    result = _connector_arm(tmp_path, case)
    assert result.replay is not None
    assert result.replay.passed, result.replay.divergence
    paths = _paths(result.trace)
    if case is EVERY_PATH:
        assert all(paths.values()), paths
    elif case is TIGHT_POOL:
        assert paths["reserved"], paths
    else:
        assert paths["reconciled"], paths
    # The trace it wrote replays on vLLM's KVCacheManager too, strict.
    from kvgate.impl.vllm_target import VllmTarget

    target = VllmTarget(result.trace.config)
    try:
        model = targets.target_factory("model")
        replayed = replay(result.trace, target, model, "strict")
    finally:
        target.close()
    assert replayed.passed, replayed.divergence


@pytest.mark.parametrize(
    ("drift", "case", "seen"),
    [
        # The driver forgets an async load's reserved blocks: vLLM refuses
        # the load's allocation the model makes.
        ("reserved", TIGHT_POOL, "lookups (request, hit)"),
        # The driver keeps a local sub-block tail a longer remote hit
        # supersedes: the manager's state differs.
        ("truncate", EVERY_PATH, ""),
        # The scheduler model forgets the Scheduler's speculative padding.
        ("pad", EVERY_PATH, "scheduled (request, tokens)"),
        # The driver keeps a failed load's blocks.
        ("load_failed", EVERY_PATH, ""),
    ],
)
def test_a_driver_that_drifts_from_the_schedulers_connector_branch_diverges(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    drift: str,
    case: Case,
    seen: str,
) -> None:
    from kvgate.driver import kv_loads
    from kvgate.driver.op_driver import OpDriver
    from kvgate.model import scheduler as scheduler_model

    if drift == "reserved":
        monkeypatch.setattr(
            scheduler_model.SchedulerModel, "_reserved_blocks", lambda self, skipped: 0
        )
    elif drift == "truncate":
        monkeypatch.setattr(OpDriver, "truncate_computed_blocks", lambda self, blocks, n: blocks)
    elif drift == "load_failed":

        def keep_blocks(driver: Any, pending: Any) -> None:
            driver.set_num_computed(pending.request, 0)
            pending.loading = pending.after_load = False

        monkeypatch.setattr(kv_loads, "fail_load", keep_blocks)
    else:
        chunk = scheduler_model.SchedulerModel._chunk
        monkeypatch.setattr(
            scheduler_model.SchedulerModel,
            "_admission_chunk",
            lambda self, live, hit, budget: chunk(self, live.request, hit, budget),
        )
    result = _connector_arm(tmp_path, case)
    assert result.replay is not None
    divergence = result.replay.divergence
    assert divergence is not None
    assert seen in divergence.what


@pytest.mark.parametrize("driver_frees_first", [True, False])
def test_an_ended_request_frees_its_skipped_states_before_the_connector_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver_frees_first: bool
) -> None:
    """With a connector vLLM's Scheduler calls `remove_skipped_blocks` when a
    request ends, before freeing it: a last step that crossed a Mamba block
    frees its state two steps back first, which moves it in the free queue.
    A 100-token prompt with 30 output tokens ends at 129 computed tokens,
    one past the fourth 32-token block."""
    from kvgate.driver.op_driver import OpDriver
    from kvgate.impl.vllm_scheduler import VllmScheduler
    from kvgate.workload.deployment import Serving
    from kvgate.workload.lockstep import run_on_scheduler
    from kvgate.workload.plan import Session, Turn

    if not driver_frees_first:
        monkeypatch.setattr(OpDriver, "remove_skipped_blocks", lambda self, request, n: None)
    config = dataclasses.replace(CONFIG, kv_connector=True)
    real = VllmScheduler(config, spec_tokens=SPEC, max_num_seqs=4)
    try:
        result = run_on_scheduler(
            config,
            [Session(0, (Turn(fresh=100, output=30, delay=0),))],
            Serving(system_prompt=0, spec=SPEC, max_num_seqs=4),
            real=real,
            name="finish-frees-skipped",
            out=tmp_path,
            about="",
            level="strict",
        )
    finally:
        real.close()
    divergence = result.replay.divergence
    if driver_frees_first:
        assert divergence is None, divergence
    else:
        assert divergence is not None and divergence.what.endswith("free queue")


@pytest.mark.parametrize("num_blocks", [24, 40])
def test_a_failed_async_load_keeps_reserving_for_itself(num_blocks: int) -> None:
    """vLLM 0.33.0 behaviour, documented: a failed async load (policy
    recompute, nothing valid) frees the request's blocks but leaves it among
    the Scheduler's in-flight prefills, so when its retry is again an async
    load, the blocks reserved for in-flight prefills include its own whole
    sequence. On a pool under about twice its need it is then never admitted:
    alone in the engine, nothing runs, step after step. With room for both,
    the retry loads."""
    from kvgate.impl.vllm_scheduler import VllmScheduler
    from kvgate.impl.vllm_scheduler_config import ConnectorSettings

    config = dataclasses.replace(CONFIG, num_blocks=num_blocks)
    target = VllmScheduler(config, spec_tokens=SPEC, max_num_seqs=4, connector=ConnectorSettings())
    try:
        target.script_external("A", 64, True)
        target.add_request("A", _fresh(100), 4, None)
        first = target.schedule()
        assert first.taken == [("A", 0, 64, True)]  # the first load fits
        target.update({}, failed=["A"])
        retried = target.schedule()
        target.update({})
        scheduler = target.scheduler
        request = scheduler.requests["A"]
        if num_blocks == 24:
            for _ in range(3):
                stalled = target.schedule()
                target.update({})
                assert stalled.scheduled == [] and stalled.taken == []
            assert retried.taken == []
            assert request.num_computed_tokens == 0
            assert not any(b for g in target.snapshot().tables.get("A", ()) for b in g)
            own = scheduler._request_remaining_blocks(request)
            assert scheduler._inflight_prefill_reserved_blocks() == own
        else:
            assert retried.taken == [("A", 0, 64, True)]
    finally:
        target.close()


def test_per_group_lookups_without_a_connector_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from kvgate import cli

    argv = ["workload", "--target", "model", "--kv-connector-divergent-hits"]
    argv += ["--out", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kvgate: error: --kv-connector-divergent-hits: needs --kv-connector"
    ]


def test_lookahead_hashes_with_a_connector_are_refused_by_name() -> None:
    """vLLM runs legacy block hashes under any KV connector
    (`VllmConfig.num_hash_lookahead_tokens` is 0 then)."""
    from kvgate.impl.vllm_scheduler import VllmScheduler

    config = dataclasses.replace(CONFIG, kv_connector=True, hash_lookahead_tokens=1)
    with pytest.raises(UnsupportedConfig) as refused:
        VllmScheduler(config, spec_tokens=SPEC, max_num_seqs=4)
    assert refused.value.field == "hash_lookahead_tokens"


def test_the_workload_names_the_stall_after_a_failed_load() -> None:
    """On GPUs of 16 GiB (a pool of 56 blocks at the Mamba block) seed 0
    stalls as vLLM does (the lockstep agrees up to there): a failed load's
    retry reserves its own blocks. The error says so instead of blaming the
    pool."""
    from kvgate.workload.generator import WorkloadStuck, generate
    from kvgate.workload.plan import make_plan

    deployment = Deployment(build="upstream", kv_connector=True, gpu_memory_gib=16.0).scaled(SCALE)
    config = deployment.config(4096 // SCALE, False, WORKLOAD.sessions)
    serving = deployment.serving(WORKLOAD.system_prompt, WORKLOAD.seed)
    with pytest.raises(WorkloadStuck, match="its async load failed"):
        generate(config, make_plan(WORKLOAD, SCALE), serving)


def test_a_failed_async_load_under_policy_fail_ends_the_request_as_the_driver_does() -> None:
    """`kv_load_failure_policy: fail`: the worker reports an async load
    failed and the real Scheduler fails the request (FINISHED_ERROR). The
    driver's `free how: abort, load_failed: true` on the model leaves the
    same pool: the same free queue, every block at ref 0, no table."""
    from vllm.v1.request import RequestStatus

    from kvgate.conformance.trace import parse_trace
    from kvgate.conformance.writer import dump_trace
    from kvgate.impl.vllm_scheduler import VllmScheduler
    from kvgate.impl.vllm_scheduler_config import ConnectorSettings
    from kvgate.model import ModelTarget
    from kvgate.vocabulary.ops import Segment, Step

    config = dataclasses.replace(CONFIG, kv_connector=True, kv_load_failure_policy="fail")
    real = VllmScheduler(
        config,
        spec_tokens=SPEC,
        max_num_seqs=4,
        connector=ConnectorSettings(load_failure_policy="fail"),
    )
    try:
        real.script_external("B", 96, True)
        real.add_request("B", _fresh(100), 4, None)
        first = real.schedule()
        assert first.taken == [("B", 0, 96, True)]
        real.update({}, failed=["B"])
        assert "B" not in real.scheduler.requests
        assert real._requests["B"].status == RequestStatus.FINISHED_ERROR
        after = real.snapshot()
    finally:
        real.close()
    steps = (
        Step("arrive", 0, req="B", prompt=(Segment("fresh", 100),)),
        Step("lookup", 1, req="B", remote_hit=96, remote_async=True),
        Step("allocate", 2, req="B", tokens="auto"),
        Step("free", 3, req="B", how="abort", load_failed=True),
    )
    # Written and read back: the trace a person would write for it.
    text = dump_trace("fail", config, steps)
    trace = parse_trace(text, "fail.yaml")
    model = ModelTarget(trace.config)
    for step in trace.primitives:
        model.apply(step)
    mine = model.snapshot()
    assert mine.free_queue == after.free_queue
    assert all(b.ref == 0 for b in after.blocks) and not after.tables
    assert list(mine.differences(after)) == []


# Policy fail: 4 sessions x 3 turns, seed 4, unit 256/32: two async loads
# fail, each ending its request (the session's next turn still arrives).
FAIL_WORKLOAD = Workload(sessions=4, turns=3, seed=4)


def _fail_arm(tmp_path: Path, real_policy: Literal["recompute", "fail"]) -> ArmResult:
    """The `--kv-load-failure-policy fail` workload's arm on vLLM's real
    Scheduler, its connector built with `real_policy`."""
    from kvgate.impl.vllm_scheduler import VllmScheduler
    from kvgate.impl.vllm_scheduler_config import ConnectorSettings

    deployment = Deployment(
        build="upstream", kv_connector=True, kv_load_failure_policy="fail"
    ).scaled(SCALE)
    factory: Any = functools.partial(
        VllmScheduler, connector=ConnectorSettings(load_failure_policy=real_policy)
    )
    return scheduler_arm(
        FAIL_WORKLOAD,
        deployment,
        Arm(256 // SCALE, False),
        factory,
        tmp_path,
        "strict",
        Progress(stream=io.StringIO()),
    )


def test_the_workload_under_policy_fail_keeps_lockstep_and_a_drift_diverges(
    tmp_path: Path,
) -> None:
    result = _fail_arm(tmp_path / "fail", "fail")
    assert result.replay is not None
    assert result.replay.passed, result.replay.divergence
    assert result.trace.config.kv_load_failure_policy == "fail"
    failed = [s.req for s in result.trace.primitives if s.op == "free" and s.load_failed]
    assert len(failed) == 2, failed
    # Nothing is looked up again after a failure under fail.
    assert not any(s.load_failed for s in result.trace.primitives if s.op == "lookup")
    # A Scheduler that retries failed loads (policy recompute) beside the
    # same scheduler model: at the step the first failure is reported it
    # keeps the request's blocks (waiting for its retry) where the model
    # freed them, which the pool's usage shows at once.
    drifted = _fail_arm(tmp_path / "drift", "recompute")
    assert drifted.replay is not None
    divergence = drifted.replay.divergence
    assert divergence is not None and divergence.level == "api"
    assert divergence.what.endswith("KV-cache usage"), divergence.what
    assert divergence.step.op == "free" and divergence.step.req == failed[0]


def test_an_async_load_of_a_one_token_prompt_is_refused_as_vllm_loads_it_forever(
    scheduler: object,
) -> None:
    """After an async load of every token the Scheduler leaves the last one
    to compute; for a one-token prompt that leaves nothing computed, so it
    looks the request up again and loads it again, step after step, and
    the request never runs. The model refuses such a trace by name."""
    from kvgate.impl.vllm_connector import ExternalHit
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert isinstance(scheduler, VllmScheduler)
    scheduler.connector_script.hits["A"] = ExternalHit(1, load_async=True)
    scheduler.add_request("A", _fresh(1), 1, None)
    steps = [_step(scheduler, loaded=("A",)) for _ in range(4)]
    assert all(step.scheduled == [] for step in steps)
    assert all(step.lookups == [("A", 0)] for step in steps)

    trace = parse_trace(
        "format: kvgate-trace/1\nname: one-token-load\nconfig:\n"
        "  num_blocks: 32\n  hash_unit: 8\n  eagle: false\n  retention_interval: 0\n"
        "  retain_checkpoint: false\n  kv_connector: true\n  max_num_scheduled_tokens: 64\n"
        "  max_model_len: 512\n  groups:\n    - {kind: full_attention, block_size: 8}\n"
        "    - {kind: mamba_align, block_size: 32}\n"
        "scheduler: {spec: 0, max_num_seqs: 4}\nengine:\n"
        "  - {op: arrive, req: A, prompt: [{fresh: 1}], max_tokens: 1, remote_hit: 1,"
        " remote_async: true}\n  - {op: step}\n",
        "one.yaml",
    )
    with pytest.raises(TraceError) as refused:
        replay_scheduler(trace, SchedulerModel, None, "strict")
    assert refused.value.field == "remote_hit" and "one-token prompt" in str(refused.value)


EXACT_FIT_WITH_EXTERNAL_TOKENS = """\
format: kvgate-trace/1
name: exact-fit-with-external-tokens
config:
  num_blocks: 32
  hash_unit: 8
  scheduler_block_size: 32
  max_model_len: 512
  max_num_scheduled_tokens: 8192
  eagle: false
  retention_interval: 0
  retain_checkpoint: false
  kv_connector: true
  groups:
  - {kind: full_attention, block_size: 16}
  - {kind: mamba_align, block_size: 32, speculative_blocks: 3}
scheduler: {spec: 1, max_num_seqs: 4}
engine:
  - {op: arrive, req: R0, prompt: [{fresh: 1}], max_tokens: 7}
  - {op: step, steps: 4}
  - {op: arrive, req: R1, prompt: [{prompt_of: R0}, {fresh: 12}], max_tokens: 3}
  - {op: arrive, req: R2, prompt: [{prompt_of: R1}, {fresh: 52}], max_tokens: 1}
  - {op: reset, running: true}
  - {op: step, steps: 3}
  - {op: arrive, req: R3, prompt: [{all_of: R0}, {fresh: 14}], max_tokens: 1, follows: R0}
  - {op: arrive, req: R4, prompt: [{prompt_of: R3}, {fresh: 43}], max_tokens: 1, remote_hit: 32}
  # R4's 9 counted blocks are free, the 10 it takes are not: it waits
  - {op: step, expect: {scheduled: [[R1, 2], [R2, 32], [R3, 16]]}}
  - {op: step}
"""


def test_an_admission_whose_external_state_block_does_not_fit_waits() -> None:
    """R4's connector tokens need a Mamba block for their state besides the
    step's blocks, which vLLM's count (`get_num_blocks_to_allocate`) leaves
    out for a new request: its 9 counted blocks are free, its allocation
    takes 10. The model admits only what it can allocate, so R4 waits; vLLM
    0.33.0's allocation runs out of blocks in `schedule()` instead, which the
    lockstep reports as a divergence (a build that fixes it conforms)."""
    from kvgate.impl.vllm_scheduler import VllmScheduler

    trace = parse_trace(EXACT_FIT_WITH_EXTERNAL_TOKENS, "fit.yaml")
    alone = replay_scheduler(trace, SchedulerModel, None, "strict")
    assert alone.passed, alone.divergence
    assert trace.scheduler is not None
    real = VllmScheduler(trace.config, spec_tokens=1, max_num_seqs=4)
    try:
        result = replay_scheduler(trace, SchedulerModel, real, "strict")
    finally:
        real.close()
    divergence = result.divergence
    if divergence is not None:
        assert divergence.what.endswith(": schedule() raised"), divergence
        assert str(divergence.actual).startswith("ValueError"), divergence


@needs_vllm
def test_exploration_tells_the_exact_fit_defect_apart() -> None:
    """The divergence at that defect, fed step by step as exploration feeds
    it: the model left an admission waiting in the very step vLLM's
    `schedule()` ran out of blocks, which exploration counts and drops; a
    ValueError in a step where the model left none waiting is not it."""
    from kvgate.conformance.scheduler_replay import SchedulerLockstep
    from kvgate.explore.scheduler_triage import is_exact_fit_defect
    from kvgate.impl.vllm_scheduler import VllmScheduler

    trace = parse_trace(EXACT_FIT_WITH_EXTERNAL_TOKENS, "fit.yaml")
    assert trace.scheduler is not None
    model = SchedulerModel(trace.config, trace.scheduler.spec, trace.scheduler.max_num_seqs)
    real = VllmScheduler(trace.config, spec_tokens=1, max_num_seqs=4)
    try:
        lockstep = SchedulerLockstep(trace, model, real, "strict")
        manager = model.oracle.manager
        for event in trace.engine:
            before = manager.external_admissions_refused
            divergence = lockstep.apply(event)
            if divergence is not None:
                break
    finally:
        real.close()
    assert divergence is not None
    assert is_exact_fit_defect(divergence, manager.external_admissions_refused > before)
    assert not is_exact_fit_defect(divergence, False)
