"""vLLM's real `EngineCore` (async scheduling on) with the scripted executor
of `kvgate.impl.engine_core`: the Scheduler calls the engine core makes for
a few concurrent multi-turn sessions, without drafts and with MTP drafts
of mixed acceptance, are the ones kvgate's scheduler-level replay makes for
the same history, and a drift of the replay's stepping is seen by that
comparison."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from configs import needs_vllm

from kvgate.conformance.replay import ReplayResult
from kvgate.conformance.scheduler_replay import replay_scheduler
from kvgate.conformance.trace import Trace, parse_trace
from kvgate.model.scheduler import SchedulerModel

pytestmark = needs_vllm

MAX_NUM_SEQS = 4
HEADER = """format: kvgate-trace/1
name: engine-core-async-sessions
tags: [scheduler, async]
about: >
  Written from a run of vLLM's EngineCore with the scripted executor.
config:
  num_blocks: 96
  hash_unit: 8
  eagle: false
  retention_interval: 0
  async_scheduling: true
  max_num_scheduled_tokens: 64
  max_model_len: 256
  groups:
    - {kind: full_attention, block_size: 32}
    - {kind: mamba_align, block_size: 32}
scheduler: {spec: 0, max_num_seqs: 4}
engine:
"""
# Three sessions, their turns' fresh prompt tokens: every turn after the
# first continues the last one's whole sequence. One token a turn (the
# scheduler model covers no decode past an output in flight).
SESSIONS = {"A": (100, 40, 24), "B": (70, 30), "C": (150, 20)}


@dataclass
class EngineRun:
    """A history played on vLLM's EngineCore: the trace it is, the
    Scheduler's calls, and the executor's."""

    trace: Trace
    calls: list[Any]
    executor: list[Any]


def _arrive(name: str, fresh: int, previous: str | None, max_tokens: int = 1) -> str:
    prompt = (
        f"[{{all_of: {previous}}}, {{fresh: {fresh}}}]" if previous else f"[{{fresh: {fresh}}}]"
    )
    follows = f", follows: {previous}" if previous else ""
    return f"  - {{op: arrive, req: {name}, prompt: {prompt}, max_tokens: {max_tokens}{follows}}}\n"


def config_name(header: str) -> str:
    return next(line for line in header.splitlines() if line.startswith("name: "))[6:]


def play_on_engine(
    tmp: Path,
    header: str = HEADER,
    sessions: dict[str, tuple[tuple[int, int], ...]] | None = None,
    spec: int = 0,
    script: Any = None,
) -> EngineRun:
    """Run the sessions (each turn's fresh prompt tokens and max_tokens; by
    default `SESSIONS`, one token a turn) on vLLM's EngineCore, each next
    turn arriving right after the engine step that finished the last one,
    and write what happened as a scheduler-level trace: with drafts, each
    step's `accept` says what the executor accepted in the batch the step
    scheduled."""
    from kvgate.impl.engine_core import SchedulerCalls, ScriptedEngine

    turns = sessions or {s: tuple((fresh, 1) for fresh in t) for s, t in SESSIONS.items()}
    text = header
    config = parse_trace(text + "  - {op: step}\n", tmp / "header.yaml").config
    engine = ScriptedEngine(config, spec_tokens=spec, max_num_seqs=MAX_NUM_SEQS, script=script)
    calls = SchedulerCalls(engine.scheduler)
    fresh_ids = iter(range(1, 1 << 20))
    prompts: dict[str, list[int]] = {}

    def arrive(session: str, turn: int) -> str:
        name, previous = f"{session}{turn}", f"{session}{turn - 1}" if turn else None
        fresh, max_tokens = turns[session][turn]
        tokens = [] if previous is None else [*prompts[previous], *engine.output_tokens(previous)]
        tokens += [next(fresh_ids) for _ in range(fresh)]
        prompts[name] = tokens
        engine.add_request(name, tokens, max_tokens)
        return _arrive(name, fresh, previous, max_tokens)

    for session in turns:
        text += arrive(session, 0)
    steps = 0
    while engine.has_work():
        scheduled_before = sum(c.call == "schedule" for c in calls.calls)
        finished = engine.step()
        steps += 1
        assert steps < 300, "the engine never ran out of work"
        batch = sum(c.call == "schedule" for c in calls.calls)
        accepted = {r: n for r, n in engine.accepted.get(batch, {}).items() if n}
        if batch > scheduled_before and accepted:
            pairs = ", ".join(f"{r}: {n}" for r, n in accepted.items())
            text += f"  - {{op: step, accept: {{{pairs}}}}}\n"
        else:
            text += "  - {op: step}\n"
        for name in finished:
            session, turn = name[0], int(name[1:])
            if turn + 1 < len(turns[session]):
                text += arrive(session, turn + 1)
    path = tmp / f"{config_name(header)}.yaml"
    path.write_text(text)
    engine.close()
    return EngineRun(parse_trace(text, path), calls.calls, engine.calls)


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> EngineRun:
    return play_on_engine(tmp_path_factory.mktemp("engine-core"))


def replay_on_vllm(trace: Trace, real_step: Any = None) -> tuple[ReplayResult, list[Any]]:
    """Replay `trace` on vLLM's Scheduler in lockstep with the model at
    strict level: the result and the Scheduler's calls. `real_step`
    replaces the replay's stepping of the real Scheduler."""
    from kvgate.conformance import scheduler_replay
    from kvgate.impl.engine_core import SchedulerCalls
    from kvgate.impl.vllm_scheduler import VllmScheduler

    assert trace.scheduler is not None
    real = VllmScheduler(
        trace.config,
        spec_tokens=trace.scheduler.spec,
        max_num_seqs=trace.scheduler.max_num_seqs,
    )
    calls = SchedulerCalls(real.scheduler)
    try:
        with _patched(scheduler_replay.EngineLockstep, "real_step", real_step):
            result = replay_scheduler(trace, SchedulerModel, real, "strict")
    finally:
        real.close()
    return result, calls.calls


class _patched:
    def __init__(self, owner: Any, name: str, value: Any) -> None:
        self.owner, self.name, self.value = owner, name, value

    def __enter__(self) -> None:
        self.before = getattr(self.owner, self.name)
        if self.value is not None:
            setattr(self.owner, self.name, self.value)

    def __exit__(self, *exc: object) -> None:
        setattr(self.owner, self.name, self.before)


def test_the_engine_core_runs_the_async_scheduler_with_its_batch_queue(
    engine_run: EngineRun,
) -> None:
    schedules = [c for c in engine_run.calls if c.call == "schedule"]
    updates = [c.batch for c in engine_run.calls if c.call == "update_from_output"]
    # Every batch's output processed once, oldest first.
    assert updates == [c.batch for c in schedules]
    # Two batches in flight: a batch is scheduled before the last one's
    # output is processed.
    in_flight = 0
    most = 0
    for call in engine_run.calls:
        in_flight += {"schedule": 1, "update_from_output": -1}.get(call.call, 0)
        most = max(most, in_flight)
    assert most == 2
    # Each update's batch ran on the executor, and was sampled, before it.
    ran = {c.batch for c in engine_run.executor if c.call == "execute_model"}
    assert set(updates) <= ran
    # Multi-turn: every session's every turn arrived and was served.
    added = [c.requests[0] for c in engine_run.calls if c.call == "add_request"]
    assert sorted(added) == sorted(
        f"{s}{t}" for s, turns in SESSIONS.items() for t in range(len(turns))
    )


def test_the_replay_makes_the_scheduler_calls_the_engine_core_makes(
    engine_run: EngineRun,
) -> None:
    result, calls = replay_on_vllm(engine_run.trace)
    assert result.divergence is None, result.divergence
    assert calls == engine_run.calls


def test_a_replay_that_processes_each_batch_at_once_makes_other_calls(
    engine_run: EngineRun,
) -> None:
    """The comparison sees stepping that is not the engine core's: here each
    batch's output processed in the step that scheduled it (the engine
    without its batch queue)."""
    from kvgate.conformance.scheduler_replay import EngineLockstep

    original = EngineLockstep.real_step

    def at_once(self: Any, event: Any, step: Any, real: Any, modelled: Any) -> Any:
        observed, finished = original(self, event, step, real, modelled)
        while real.batches_in_flight():
            finished += real.update({}, loaded=(), failed=())
        return observed, finished

    _, calls = replay_on_vllm(engine_run.trace, at_once)
    assert calls != engine_run.calls


def test_a_recording_of_the_engine_core_replays_on_the_model_and_on_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recorder on (`KVGATE_RECORD`, as vLLM's plugin loading registers
    it), the same sessions on the engine core: its recording, two batches
    in flight, passes at strict level on the model and on vLLM."""
    from kvgate import cli
    from kvgate.impl import recorder

    recordings = tmp_path / "recordings"
    monkeypatch.setenv(recorder.RECORD_SWITCH, str(recordings))
    recorder.register()
    try:
        run = play_on_engine(tmp_path)
    finally:
        recorder.uninstall()
    [path] = sorted(recordings.iterdir())
    recorded = parse_trace(path.read_text(), path)
    assert recorded.config.async_scheduling
    steps = [e for e in recorded.engine if e.op == "step"]
    # One entry per engine step, each with what the engine's Scheduler scheduled.
    assert len(steps) == len([e for e in run.trace.engine if e.op == "step"])
    scheduled = [[(str(r), n) for r, n in c.scheduled] for c in run.calls if c.call == "schedule"]
    assert sum(1 for s in steps if s.expect["scheduled"]) == sum(1 for s in scheduled if s)
    for target in ("model", "vllm"):
        code = cli.main(["replay", str(path), "--target", target, "--level", "strict"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert f"PASS {path.stem}" in out


DRAFTS_HEADER = """format: kvgate-trace/1
name: engine-core-async-drafts
config:
  num_blocks: 96
  hash_unit: 8
  eagle: true
  hash_lookahead_tokens: 1
  retention_interval: 0
  async_scheduling: true
  max_num_scheduled_tokens: 64
  max_model_len: 256
  groups:
    - {kind: full_attention, block_size: 32}
    - {kind: mamba_align, block_size: 32, speculative_blocks: 3}
scheduler: {spec: 3, max_num_seqs: 4}
engine:
  - {op: step}
"""
# Each turn's drafts accepted at its decodes with drafts, in order: all,
# none and some, around the Mamba block boundaries of the prompts.
ACCEPTED = {"A0": (3, 0, 2), "A1": (1, 3), "B0": (0, 0, 3), "B1": (2,), "C0": (3, 3)}
DRAFT_TURNS = {"A": ((40, 9), (30, 7)), "B": ((70, 8), (20, 5)), "C": ((33, 10),)}


def test_the_engine_core_runs_mtp_drafts_under_async_scheduling(tmp_path: Path) -> None:
    """A single MTP layer proposing three drafts, async scheduling on:
    vLLM's engine core runs the async scheduler with output placeholders for
    the drafts; each turn gets exactly its `max_tokens`, the tokens the
    executor sampled (accepted drafts kept, rejected ones rolled back)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from kvgate.impl.engine_core import Script, ScriptedEngine

    config = parse_trace(DRAFTS_HEADER, tmp_path / "drafts.yaml").config
    engine = ScriptedEngine(
        config, spec_tokens=3, max_num_seqs=MAX_NUM_SEQS, script=Script(ACCEPTED)
    )
    scheduler = engine.scheduler
    assert isinstance(scheduler, AsyncScheduler)
    # vLLM's own derivation for one MTP layer reused for every draft: three
    # lookahead slots, one prefill token read ahead, hashes one token ahead.
    assert (scheduler.num_spec_tokens, scheduler.num_lookahead_tokens) == (3, 3)
    assert (scheduler.num_prefill_lookahead, scheduler.num_hash_lookahead_tokens) == (1, 1)
    calls = SchedulerCallsOf(engine)
    prompts: dict[str, list[int]] = {}
    fresh = iter(range(1, 1 << 20))

    def arrive(session: str, turn: int) -> None:
        name = f"{session}{turn}"
        length, max_tokens = DRAFT_TURNS[session][turn]
        previous = f"{session}{turn - 1}"
        tokens = [*prompts[previous], *engine.output_tokens(previous)] if turn else []
        prompts[name] = tokens + [next(fresh) for _ in range(length)]
        engine.add_request(name, prompts[name], max_tokens)

    for session in DRAFT_TURNS:
        arrive(session, 0)
    for _ in range(300):
        if not engine.has_work():
            break
        for name in engine.step():
            if int(name[1:]) + 1 < len(DRAFT_TURNS[name[0]]):
                arrive(name[0], int(name[1:]) + 1)
    assert not engine.has_work()
    for session, turns in DRAFT_TURNS.items():
        for turn, (_, max_tokens) in enumerate(turns):
            name = f"{session}{turn}"
            output = engine.output_tokens(name)
            assert output == engine.executor_sampled[name][:max_tokens], name
            assert len(output) == max_tokens
    # Drafts were scheduled (as placeholders: the worker keeps their ids)
    # while the batch before was in flight.
    assert calls.spec_batches and all(set(d) == {-1} for d in calls.spec_batches)
    # Mixed acceptance, as the Scheduler counted it.
    assert 0 < calls.accepted < calls.drafts
    engine.close()


class SchedulerCallsOf:
    """The draft token ids each batch scheduled, per request, and the drafts
    and accepted drafts the Scheduler's stats counted."""

    def __init__(self, engine: Any) -> None:
        self.spec_batches: list[list[int]] = []
        self.drafts = self.accepted = 0
        scheduler = engine.scheduler
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def logged(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            self.spec_batches += [list(d) for d in output.scheduled_spec_decode_tokens.values()]
            return output

        def counted(*args: Any, **kwargs: Any) -> Any:
            outputs = update(*args, **kwargs)
            for engine_outputs in outputs.values():
                stats = engine_outputs.scheduler_stats
                spec = None if stats is None else stats.spec_decoding_stats
                if spec is not None:
                    self.drafts += spec.num_draft_tokens
                    self.accepted += spec.num_accepted_tokens
            return outputs

        scheduler.schedule = logged
        scheduler.update_from_output = counted


def test_no_engine_core_runs_an_attention_block_below_the_mamba_block(tmp_path: Path) -> None:
    """In align mode vLLM's worker sets the Mamba block to the attention
    block, so no worker reports an attention block (8) below the Mamba block
    (32); the scripted executor, standing in for one, refuses to, by name."""
    from kvgate.impl.engine_core import ScriptedEngine
    from kvgate.vocabulary.config import UnsupportedConfig

    header = HEADER.replace(
        "{kind: full_attention, block_size: 32}", "{kind: full_attention, block_size: 8}"
    )
    config = parse_trace(header + "  - {op: step}\n", tmp_path / "header.yaml").config
    with pytest.raises(UnsupportedConfig) as refused:
        ScriptedEngine(config, spec_tokens=0, max_num_seqs=MAX_NUM_SEQS)
    assert refused.value.field == "groups"
    assert "[8, 32]" in str(refused.value)


# A deployment asking for a 64-token attention block, a 256-token Mamba
# block and a 64-token hash unit: vLLM's worker runs its attention and Mamba
# layers at one block (the attention block, raised until its page holds a
# Mamba state; the asked Mamba block is overridden), hashing every 64 tokens.
# Here that block is 256.
SEED_LIKE = (
    HEADER.replace("hash_unit: 8", "hash_unit: 64")
    .replace("{kind: full_attention, block_size: 32}", "{kind: full_attention, block_size: 256}")
    .replace("{kind: mamba_align, block_size: 32}", "{kind: mamba_align, block_size: 256}")
)


def _block_settings(scheduler: Any) -> dict[str, Any]:
    cache = scheduler.cache_config
    return {
        "cache_config.block_size": int(cache.block_size),
        "mamba_block_size": int(cache.mamba_block_size),
        "prefix_match_unit": cache.prefix_match_unit,
        "block_size": int(scheduler.block_size),
        "hash_block_size": int(scheduler.hash_block_size),
        "groups": [
            int(m.block_size) for m in scheduler.kv_cache_manager.coordinator.single_type_managers
        ],
    }


def test_the_target_and_the_engine_core_build_the_seed_like_scheduler_alike(
    tmp_path: Path,
) -> None:
    """For the seed-like config as vLLM's worker reports it, kvgate's
    real-Scheduler target and vLLM's EngineCore build the Scheduler with the
    same block settings (the align split reads the 256-token block, hashes
    every 64 tokens), and the replay makes the engine core's calls."""
    from kvgate.impl.engine_core import ScriptedEngine
    from kvgate.impl.vllm_scheduler import VllmScheduler

    config = parse_trace(SEED_LIKE + "  - {op: step}\n", tmp_path / "header.yaml").config
    engine = ScriptedEngine(config, spec_tokens=0, max_num_seqs=MAX_NUM_SEQS)
    target = VllmScheduler(config, spec_tokens=0, max_num_seqs=MAX_NUM_SEQS)
    try:
        settings = _block_settings(engine.scheduler)
        assert settings == _block_settings(target.scheduler)
    finally:
        engine.close()
        target.close()
    assert settings["cache_config.block_size"] == settings["mamba_block_size"] == 256
    assert settings["hash_block_size"] == 64
    run = play_on_engine(tmp_path, SEED_LIKE)
    result, calls = replay_on_vllm(run.trace)
    assert result.divergence is None, result.divergence
    assert calls == run.calls


# Several concurrent multi-turn sessions, MTP drafts with mixed acceptance:
# each turn's (fresh prompt tokens, max_tokens).
DRAFT_SESSIONS: dict[str, tuple[tuple[int, int], ...]] = {
    "A": ((40, 9), (30, 7)),
    "B": ((70, 8), (20, 5)),
    "C": ((33, 10), (12, 6)),
}


@pytest.fixture(scope="module")
def drafts_run(tmp_path_factory: pytest.TempPathFactory) -> EngineRun:
    from kvgate.impl.engine_core import Script

    return play_on_engine(
        tmp_path_factory.mktemp("engine-core-drafts"),
        DRAFTS_HEADER.removesuffix("  - {op: step}\n"),
        DRAFT_SESSIONS,
        spec=3,
        script=Script(ACCEPTED),
    )


def test_the_replay_makes_the_engine_cores_calls_with_mtp_drafts(drafts_run: EngineRun) -> None:
    """Async scheduling with MTP drafts, mixed acceptance, concurrent
    sessions: the replay on vLLM's AsyncScheduler, in strict lockstep with
    the model (placeholders, tokens in flight and stale tokens compared per
    request), makes exactly the engine core's Scheduler calls."""
    accepts = [e.accept for e in drafts_run.trace.engine if e.op == "step" and e.accept]
    assert accepts, "the run accepted some drafts"
    result, calls = replay_on_vllm(drafts_run.trace)
    assert result.divergence is None, result.divergence
    assert calls == drafts_run.calls


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_recording_of_the_engine_core_with_mtp_drafts_replays_on_the_model_and_on_vllm(
    async_scheduling: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The recorder on, the engine core with MTP drafts of mixed acceptance
    (some past a turn's max_tokens, which vLLM trims) over concurrent
    multi-turn sessions, with async scheduling and without: each batch's
    accepted drafts are written on the step that scheduled it (without async
    scheduling, the one that sampled them, as the drafts kept), recording
    never stops, and the recording passes at strict level on the model and
    on vLLM."""
    from kvgate import cli
    from kvgate.impl import recorder
    from kvgate.impl.engine_core import Script

    header = DRAFTS_HEADER.removesuffix("  - {op: step}\n")
    if not async_scheduling:
        header = header.replace("async_scheduling: true", "async_scheduling: false")
    recordings = tmp_path / "recordings"
    monkeypatch.setenv(recorder.RECORD_SWITCH, str(recordings))
    recorder.register()
    try:
        run = play_on_engine(tmp_path, header, DRAFT_SESSIONS, spec=3, script=Script(ACCEPTED))
    finally:
        recorder.uninstall()
    [path] = sorted(recordings.iterdir())
    recorded = parse_trace(path.read_text(), path)
    assert recorded.config.async_scheduling == async_scheduling
    assert recorded.scheduler is not None and recorded.scheduler.spec == 3
    steps = [e for e in recorded.engine if e.op == "step"]
    assert len(steps) == len([e for e in run.trace.engine if e.op == "step"])
    # The same drafts accepted, step for step, as the engine core's run
    # (requests renamed in arrival order).
    renamed = dict(
        zip(
            [e.req for e in run.trace.engine if e.op == "arrive"],
            [e.req for e in recorded.engine if e.op == "arrive"],
            strict=True,
        )
    )
    played = [e.accept for e in run.trace.engine if e.op == "step"]
    assert any(played)
    assert [e.accept for e in steps] == [
        {renamed[r]: n for r, n in accept.items()} for accept in played
    ]
    for target in ("model", "vllm"):
        code = cli.main(["replay", str(path), "--target", target, "--level", "strict"])
        out = capsys.readouterr().out
        assert code == 0, out
        assert f"PASS {path.stem}" in out
