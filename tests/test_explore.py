"""Stateful exploration of the model: what it finds, what it must not, and
that what it saves replays as a failing trace."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from configs import hybrid_config
from conftest import Found
from hypothesis import Phase

from kvgate import cli
from kvgate.conformance.replay import replay
from kvgate.conformance.trace import Trace, load_trace
from kvgate.explore.command import parse_budget
from kvgate.explore.mode import Mode
from kvgate.explore.profiles import profile
from kvgate.explore.rules import new_tokens, tail_lands
from kvgate.explore.runner import Outcome, explore, model_mode
from kvgate.explore.session import (
    ALL_INVARIANTS,
    REPLAYED_FIELDS,
    ExploreFailure,
    Session,
    Unrealistic,
    follow_up,
    fresh,
    replayed_fields,
    shrink,
)
from kvgate.invariants.predicates import hash_map_consistent, one_hold
from kvgate.model import ModelTarget
from kvgate.model.groups import GroupManager
from kvgate.model.hold import Holds
from kvgate.model.pool import BlockPool
from kvgate.vocabulary.config import Config, GroupConfig
from kvgate.vocabulary.ops import FREE_HOW, PRIMITIVE_OPS, Segment, Step
from kvgate.vocabulary.snapshot import BlockView, Snapshot
from kvgate.vocabulary.tokens import MmItem

# The seed's config: the hold under test is off here; modes set it.
SEED = hybrid_config(
    GroupConfig("full_attention", 8), GroupConfig("mamba_align", 32, 3), eagle=True
)
# Searches that must find a planted failure: a fixed seed keeps them
# deterministic, the budget is far above what they need, and Hypothesis's own
# shrinking is skipped (slow here; the trace shrinker still runs).
SEARCH = profile("dev", max_examples=3000, phases=(Phase.explicit, Phase.generate))


def model_replay(trace: Trace, hold: bool | None = None) -> tuple[bool, list[str]]:
    """Replay on the model alone (the trace's own expectations judge it)."""
    if hold is not None:
        trace = replace(trace, config=replace(trace.config, hold=hold))
    with closing(ModelTarget(trace.config)) as target:
        result = replay(trace, target, None, "api")
    failures = result.failures
    return result.passed, [f"{d.step.op}:{d.what}:{d.expected}:{d.actual}" for d in failures]


def search(mode: Mode, out: Path, seed: int) -> Outcome:
    return explore(mode, SEARCH, out=out, seed=seed)


# -- (a) hold off: the known total miss, found from scratch -----------------------


def test_hold_off_ci_profile_finds_the_total_miss(total_miss: Found) -> None:
    """The exploration a user's CI runs (derandomized, the ci profile's own
    budget) finds the bug the hold exists for."""
    assert total_miss.code == 1
    assert "profile ci, 400 examples" in total_miss.out
    assert "FAIL invariant no_total_miss" in total_miss.out
    assert "hit 0" in total_miss.out
    assert f"saved: {total_miss.saved}" in total_miss.out
    steps = load_trace(total_miss.saved).steps
    # Shrunk: a handful of steps, the lookup that missed just before the check.
    assert len(steps) <= 12
    assert steps[-2].op == "lookup" and steps[-1].op == "check"


def test_the_saved_total_miss_replays_failing_on_the_model(total_miss: Found) -> None:
    trace = load_trace(total_miss.saved)
    passed, failures = model_replay(trace)
    assert not passed
    lookup = [f for f in failures if f.startswith("lookup:hit:")]
    assert lookup and lookup[0].endswith(":0")  # expected the parent's state, got 0
    # The same trace with the hold on resumes where the invariant demands.
    assert model_replay(trace, hold=True) == (True, [])


def test_kvgate_replay_shows_the_saved_miss(
    total_miss: Found, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["replay", str(total_miss.saved), "--target", "model"]) == 1
    out = capsys.readouterr().out
    assert "what:     hit" in out and "actual:   0" in out


# -- (b) hold on: nothing fails ------------------------------------------------------


def test_hold_on_ci_profile_finds_nothing(tmp_path: Path) -> None:
    """With the hold on (and every knob drawn, the shared-prefix checkpoint
    included), the ci profile finds nothing (not shrunk if it did:
    Hypothesis can take minutes)."""
    settings = profile("ci", phases=(Phase.explicit, Phase.generate, Phase.target))
    outcome = explore(model_mode(hold=True), settings, shrink=False)
    failure = outcome.failure
    assert failure is None, failure.summary()
    assert outcome.stats.knobs["shared_prefix_checkpoint_in_effect=True"] > 0
    ops = outcome.stats.ops
    # Everything but `check` (the model alone checks invariants every step).
    assert [op for op in PRIMITIVE_OPS if op != "check" and not ops[op]] == []
    assert all(ops[f"free:{how}"] for how in FREE_HOW)


# -- the reservation invariant: the hold without its +1 breaks it ----------------------


def test_hold_without_its_admission_block_breaks_the_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Holds, "admission_extra", lambda self, *args, **kwargs: 0)
    outcome = search(model_mode(hold=True), tmp_path, seed=2)
    failure = outcome.failure
    assert failure is not None and failure.invariant == "reservation_covers_tail_swap"
    assert outcome.saved is not None
    trace = load_trace(outcome.saved)
    passed, failures = model_replay(trace)
    assert not passed and any(f.startswith("reserve:blocks:") for f in failures)
    # The real hold reserves exactly what the witness asks for.
    monkeypatch.undo()
    assert model_replay(trace) == (True, [])


# -- a leak is caught by the snapshot invariants and shown by a check step -------------


def test_a_leaking_free_path_is_found_and_replays_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def leaky_free(self: GroupManager, request_id: str) -> None:
        blocks = self.pop_blocks(request_id)
        self.pool.free_blocks(reversed(blocks[:-1]))  # the last block leaks

    monkeypatch.setattr(GroupManager, "free", leaky_free)
    outcome = search(model_mode(hold=True), tmp_path, seed=0)
    failure = outcome.failure
    assert failure is not None and failure.invariant in ("no_leak", "free_queue_exact")
    assert outcome.saved is not None
    passed, failures = model_replay(load_trace(outcome.saved))
    assert not passed and any(f.startswith("check:check free_blocks") for f in failures)


def test_a_step_the_model_raises_in_is_a_crash_with_a_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception inside a realistic step (here every free raises) is a
    finding, saved and shrunk like any other, not a Hypothesis traceback."""
    real_free = GroupManager.free

    def free_that_raises_on_abort(self: GroupManager, request_id: str) -> None:
        raise RuntimeError(f"free of {request_id} failed")

    monkeypatch.setattr(GroupManager, "free", free_that_raises_on_abort)
    outcome = search(model_mode(hold=False), tmp_path, seed=0)
    failure = outcome.failure
    assert failure is not None and (failure.kind, failure.invariant) == ("crash", "raised")
    assert "RuntimeError: free of" in failure.message
    assert failure.steps[-1].op == "free"
    assert outcome.saved is not None
    trace = load_trace(outcome.saved)
    passed, failures = model_replay(trace)
    assert not passed and any("RuntimeError" in f for f in failures)
    monkeypatch.setattr(GroupManager, "free", real_free)
    assert model_replay(trace) == (True, [])


# -- the session -------------------------------------------------------------------------


@pytest.fixture
def session() -> Iterator[Session]:
    run = Session(SEED)
    yield run
    run.close()


def test_the_session_refuses_what_a_scheduler_never_does(session: Session) -> None:
    session.run("arrive", req="A", prompt=fresh(40))
    session.run("allocate", req="A", tokens="auto")
    with pytest.raises(Unrealistic, match="twice in one scheduler step"):
        session.run("allocate", req="A", tokens="auto")
    session.run("drain")
    with pytest.raises(Unrealistic, match="before its prompt is computed"):
        session.run("decode1", req="A")
    session.run("free", req="A", how="finish")
    with pytest.raises(Unrealistic, match="has ended"):
        session.run("lookup", req="A")


def seed_miss(session: Session, noise: bool) -> ExploreFailure:
    """The seed's miss in a few steps, optionally padded with steps it does not need."""
    with pytest.raises(ExploreFailure) as caught:
        session.run("arrive", req="P", prompt=fresh(16))
        if noise:
            session.run("arrive", req="X", prompt=fresh(24))
            session.run("step")
        session.run("allocate", req="P", tokens="auto")
        session.run("drain")
        session.run("allocate", req="P", tokens="auto")
        session.run("drain")
        if noise:
            session.run("lookup", req="X")
            session.run("drain")
        session.run("evict", blocks="all")
        session.run("arrive", req="F", prompt=follow_up("P", 1))
        session.run("lookup", req="F")
    return caught.value


def test_trace_shrinking_drops_steps_the_failure_does_not_need(session: Session) -> None:
    padded = seed_miss(session, noise=True)
    shrunk = shrink(padded, lambda config: Session(config))
    assert shrunk.invariant == padded.invariant == "no_total_miss"
    assert len(shrunk.steps) < len(padded.steps)
    assert not any(s.req == "X" for s in shrunk.steps)


def test_a_failure_is_a_trace_with_its_witness(session: Session, tmp_path: Path) -> None:
    failure = seed_miss(session, noise=False)
    steps = failure.trace_steps()
    assert steps[-2].op == "lookup" and steps[-2].expect == {"hit": 8}
    assert steps[-1].op == "check" and steps[-1].check == {"attention_cached": {"F": 16}}
    assert [s.index for s in steps] == list(range(len(steps)))
    saved = failure.save(tmp_path)
    assert load_trace(saved).name == failure.name
    assert "kvgate-trace/1" in str(failure)


def test_the_hold_keeps_the_parent_state() -> None:
    held = Session(replace(SEED, hold=True))
    try:
        held.run("arrive", req="P", prompt=fresh(16))
        for _ in range(2):
            held.run("allocate", req="P", tokens="auto")
            held.run("drain")
        held.run("evict", blocks="all")
        held.run("arrive", req="F", prompt=follow_up("P", 1))
        assert held.run("lookup", req="F")["hit"] == 8
    finally:
        held.close()


def test_unknown_invariants_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown invariants: nope"):
        Session(SEED, (*ALL_INVARIANTS, "nope"))


# -- predicates added for exploration ----------------------------------------------------


def test_hash_map_consistency_names_the_broken_block() -> None:
    pool = BlockPool(8, 8)
    block = pool.get_new_blocks(1)[0]
    pool.add_key((1, "8:k"), block, 8)
    assert hash_map_consistent(pool) == []
    del pool.cached[(1, "8:k")]
    [violation] = hash_map_consistent(pool)
    assert f"block {block.block_id} carries 1/8:k" in violation.message
    pool.cached[(1, "16:j")] = {block.block_id: block}
    assert any("cached under 1/16:j" in v.message for v in hash_map_consistent(pool))


def test_holds_live_in_mamba_groups_only() -> None:
    snapshot = Snapshot(
        free_queue=(),
        blocks=(BlockView(0), BlockView(1, ("g0/8:k",)), BlockView(1, ("g1/8:k",))),
        tables={},
        holds={"A": {0: (8, 1)}, "B": {1: (8, 2), 2: (8, 2)}},
        pending_copies=(),
        popped={},
    )
    messages = [v.message for v in one_hold(snapshot, (1, 2))]
    assert messages == [
        "A holds a block in group 0, not a Mamba group",
        "B holds block 2 in 2 groups",
    ]


# -- arguments and the command line ------------------------------------------------------


@pytest.mark.parametrize("landing", ["mid-block", "boundary"])
def test_prompt_sizes_land_the_tail_as_asked(landing: str) -> None:
    for base in (0, 17, 150):
        for blocks in range(3):
            n = new_tokens(SEED, base, blocks, 5, landing)  # type: ignore[arg-type]
            assert tail_lands(SEED, base + n, landing)  # type: ignore[arg-type]


def test_budget_parsing() -> None:
    assert parse_budget("500") == (500, None)
    assert parse_budget("90s") == (None, 90.0)
    assert parse_budget("2m") == (None, 120.0)
    assert parse_budget(None) == (None, None)


@pytest.mark.parametrize(
    "bad",
    [
        ["--budget", "soon"],
        ["--budget", "0"],
        ["--hold", "maybe"],
        ["--target", "vllm", "--hold", "off", "--retired", "on"],
    ],
)
def test_bad_explore_arguments_exit_2(
    bad: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["explore", "--out", str(tmp_path), *bad]) == 2
    assert capsys.readouterr().err.startswith("kvgate: error:")


def test_explore_command_summarises_the_ops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        ["explore", "--hold", "on", "--budget", "30", "--seed", "3", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ops exercised:" in out and "no failure found" in out
    for op in ("arrive", "allocate", "evict"):
        assert f"  {op} " in out


def test_explore_runs_the_fork_retention_on_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--retired on`: every session's config retains retired states."""
    from kvgate.explore.session import Session

    seen: list[bool] = []
    original = Session.__init__

    def recording(self: Session, config: Config, *args: Any, **kwargs: Any) -> None:
        seen.append(config.retain_retired)
        original(self, config, *args, **kwargs)

    monkeypatch.setattr(Session, "__init__", recording)
    cli.main(["explore", "--retired", "on", "--budget", "3", "--out", str(tmp_path)])
    assert "retired on" in capsys.readouterr().out
    assert seen and all(seen)


def test_the_shrinker_replays_every_field_of_a_step() -> None:
    """A step replayed while shrinking keeps every op field (a connector's
    answers, `sample`, `skip_prefix_cache`, the hash inputs), so a shrunk trace is a
    sub-history of the failing one, not a different history."""
    step = Step(
        "allocate",
        3,
        req="A",
        prompt=(Segment("fresh", count=8),),
        tokens=16,
        lookahead=1,
        spec=2,
        accepted=1,
        sample=1,
        how="finish",
        blocks=2,
        skip_prefix_cache=True,
        cache_salt="tenant-a",
        lora="adapter-1",
        mm=(MmItem(2, 4, "image-1"),),
        remote_hit=40,
        remote_async=True,
        load_failed=True,
        pad=2,
        reserved=3,
        complete_only=True,
        invalid_blocks=(3,),
        in_flight=4,
        keep_retained=True,
        release_retained=True,
        defer_recache=True,
    )
    defaults = Step("allocate", 3)
    # Every replayed field is set away from its default above.
    assert all(getattr(step, name) != getattr(defaults, name) for name in REPLAYED_FIELDS)
    assert Step("allocate", 3, **replayed_fields(step)) == step


def test_explore_on_vllm_defaults_to_hold_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream vLLM has no hold: `--target vllm` alone runs the hold-off
    arm (it used to stop at once on `--hold on`, its default)."""
    from kvgate.errors import InputError
    from kvgate.explore import command

    def reached(*_: object, **__: object) -> None:
        raise InputError("stopped by the test where exploration starts")

    monkeypatch.setattr(command, "explore", reached)
    assert cli.main(["explore", "--target", "vllm", "--budget", "1", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "explore: target vllm, hold off" in out
    assert "stopped by the test where exploration starts" in err
