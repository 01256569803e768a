"""The exploration machine's state and its basic rules.

Rules are the trace format's ops as a scheduler issues them: a fresh request
or a follow-up turn of an earlier one, lookup, a chunk of prefill (admission
through `reserve` on the first one), a decode step with drafts, `step`,
`drain`, every free path, and eviction bursts. Each rule hands
`kvgate.vocabulary.ops.Step`s to a `Session`, which applies them (to vLLM
too in differential mode), records them and checks every invariant after
each, so a failure is a trace. The scenario rules (`scenarios.py`) string
the same helpers into longer situations.

Requests are picked by phase from the session (an index among the eligible
ones, under a precondition that one exists: it shrinks to the oldest).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import count
from typing import Any, ClassVar, Literal

from hypothesis import reject, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvgate.conformance.refusal import model_refusal, refusal_of
from kvgate.driver.op_driver import NothingToRun
from kvgate.explore.hash_inputs import MODES, RequestInputs, arrive_fields
from kvgate.explore.knobs import configs
from kvgate.explore.machine_run import example_cut_short
from kvgate.explore.mode import Mode, knob_values
from kvgate.explore.session import (
    ExploreFailure,
    RefusalDivergence,
    Session,
    follow_up,
    fresh,
)
from kvgate.model.mamba import checkpoint_position
from kvgate.model.scheduler_state import admission_fits
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.ops import Segment
from kvgate.vocabulary.target import StepRefused
from kvgate.vocabulary.tokens import HashInputs

Landing = Literal["mid-block", "boundary", "whole blocks", "any"]
Burst = Literal["all", "all but", "some", "none"]

# At most this many live requests: enough to fill a small pool.
MAX_LIVE = 5
# Follow-up chains stop growing past this many tokens (they still arrive,
# as short extensions), so prompts stay within what a small pool admits.
LONG_PROMPT = 320
# Index strategy for picking one of the eligible requests.
PICK = st.integers(0, MAX_LIVE - 1)
# Prefill rounds a scenario runs at most to compute a prompt.
PREFILL_ROUNDS = 12


def mamba_block(config: Config) -> int:
    return max(config.groups[g].block_size for g in config.mamba_group_ids)


def tail_lands(config: Config, total: int, landing: Landing) -> bool:
    """Whether a prompt of `total` tokens keys its partial tail as asked."""
    if landing == "any":
        return True
    if landing == "whole blocks":  # the prompt itself, as templated prompts often are
        return total % mamba_block(config) == 0
    tail = checkpoint_position(
        total, config.hash_unit, config.block_drop, config.hash_lookahead_tokens
    )
    block = mamba_block(config)
    if landing == "boundary":
        return tail > 0 and tail % block == 0
    return tail % block != 0


def new_tokens(config: Config, base: int, blocks: int, jitter: int, landing: Landing) -> int:
    """New text for a prompt that starts with `base` tokens: about `blocks`
    Mamba blocks plus `jitter`, grown until the tail lands as asked."""
    n = max(1, blocks * mamba_block(config) + jitter)
    for extra in range(2 * mamba_block(config)):
        if tail_lands(config, base + n + extra, landing):
            return n + extra
    return n


LANDINGS = st.sampled_from(["mid-block", "boundary", "any", "whole blocks"])


# A burst that evicts every free block is the one that reaches the newest
# freed (the most recently released) states: drawn most often.
BURSTS: st.SearchStrategy[Burst] = st.sampled_from(["all", "all but", "all", "some", "all", "none"])


def when(ready: Callable[[Any], bool]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A precondition: the session started and `ready(machine)`."""
    return precondition(lambda self: self._session is not None and ready(self))


class BasicRules(RuleBasedStateMachine):
    """The machine's state, its set-up and teardown, and the rules that issue
    one kind of op each (with what a scheduler does around it)."""

    mode: ClassVar[Mode]

    def __init__(self) -> None:
        super().__init__()
        self._session: Session | None = None
        # The field a drawn config was refused by, on both sides alike: the
        # example runs nothing more.
        self._refused: str | None = None
        self._names = count()
        # Each request's salt, adapter and images (`hash_inputs`).
        self._hash = RequestInputs("none", self.mode.stats.ops)
        # What `hypothesis.target` maximizes, at the end of the example.
        self.first_failing = False  # this example raised the run's first failure
        self.resume_depth = 0
        self.pinned = 0
        self.pressure = 0.0

    @property
    def session(self) -> Session:
        assert self._session is not None, "the config rule runs first"
        return self._session

    def _run(self, op: str, **fields: Any) -> dict[str, Any]:
        stats = self.mode.stats
        stats.steps += 1
        try:
            observed = self.session.run(op, **fields)
        except ExploreFailure:
            self._failing()
            raise
        except StepRefused as refused:
            if refused.field != "kv_events_full":
                raise
            # The model refuses (before either side runs it) a lookup that
            # vLLM 0.33.0 raises IndexError on when reporting its hit: a known
            # crash of vLLM, not a history to explore further.
            stats.rejected_lookups += 1
            reject()
        self._measure(op, fields.get("req"))
        return observed

    def _measure(self, op: str, req: str | None) -> None:
        """Update the targeted quantities after a step."""
        session = self.session
        config = session.config
        free = session.free_blocks()
        self.pressure = max(self.pressure, 1.0 - free / max(1, config.num_blocks - 1))
        if op in ("allocate", "decode1", "drain", "evict"):
            snapshot = session.last
            held = sum(len(groups) for groups in snapshot.holds.values())
            self.pinned = max(self.pinned, held + len(snapshot.pending_copies))
        if op == "lookup" and req is not None:
            parent = session.parent(req)
            if parent is not None:
                # How far inside a Mamba block the parent's reusable state sits.
                tail = checkpoint_position(
                    session.tokens(parent),
                    config.hash_unit,
                    config.block_drop,
                    config.hash_lookahead_tokens,
                )
                depth = tail % mamba_block(config)
                self.resume_depth = max(self.resume_depth, depth)

    def _pick(self, names: list[str], which: int) -> str:
        return names[which % len(names)]

    def _live(self) -> int:
        return len(self.session.in_phase("waiting", "running", "decoding"))

    def _room(self) -> bool:
        return self._session is not None and self._live() < MAX_LIVE

    def _name(self) -> str:
        return f"R{next(self._names)}"

    # -- set up -------------------------------------------------------------

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        mode = self.mode
        drawn = (
            configs(mode.stratum, mode.swarm, mode.refusals)
            if mode.config is None
            else st.just(mode.config)
        )
        config = mode.apply(data.draw(drawn, label="config"))
        inputs = data.draw(st.sampled_from(MODES), label="hash inputs")
        self._hash = RequestInputs(inputs, mode.stats.ops, config.hash_unit)
        refused, account = model_refusal(config)
        mode.stats.knobs.update(knob_values(config, refused))
        mode.stats.knobs[f"hash_inputs={inputs}"] += 1
        if refused is not None:
            if mode.lockstep is not None:
                other, other_account, _ = refusal_of(mode.lockstep, config)
                if other != refused:
                    self._failing()
                    raise RefusalDivergence(config, account, other_account, refused)
            self._refused = refused
            return
        try:
            self._session = Session(config, mode.invariants, mode.lockstep, mode.stats.ops)
        except UnsupportedConfig as error:  # the lockstep target refuses it alone
            self._failing()
            target = f"refused by {error.field}: {error.message}"
            raise RefusalDivergence(config, account, target, error.field) from None

    def _failing(self) -> None:
        """This example raises a failure: the first, if none was before."""
        stats = self.mode.stats
        if stats.first_failure is None:
            self.first_failing = True
            stats.first_failure = time.perf_counter() - stats.started
            stats.first_failure_cpu = time.process_time() - stats.started_cpu

    @precondition(lambda self: self._refused is not None)
    @rule()
    def config_refused(self) -> None:
        """Nothing runs on a config both sides refused (a rule must be
        available, or Hypothesis calls the machine stuck)."""

    def teardown(self) -> None:
        if self._session is not None:
            self._session.close()
            target(float(self.resume_depth), label="resume depth below the block")
            target(float(self.pinned), label="held and in-flight blocks")
            target(self.pressure, label="free-queue pressure")
        stats = self.mode.stats
        if stats.first_failure is not None and not self.first_failing:
            stats.shrinking += 1
        elif example_cut_short():
            stats.discarded += 1
        else:
            stats.examples += 1
        if stats.on_example is not None:
            stats.on_example(stats)

    # -- arrivals -----------------------------------------------------------

    @precondition(lambda self: self._room())
    @rule(blocks=st.integers(0, 4), jitter=st.integers(0, 40), landing=LANDINGS)
    def arrive(self, blocks: int, jitter: int, landing: Landing) -> None:
        name = self._name()
        n = new_tokens(self.session.config, 0, blocks, jitter, landing)
        self._arrive(name, fresh(n), self._hash.fresh(name, n))

    def _arrive(self, name: str, prompt: tuple[Segment, ...], inputs: HashInputs) -> None:
        self._run("arrive", req=name, prompt=prompt, **arrive_fields(inputs))

    def _parents(self) -> list[str]:
        return self.session.in_phase("waiting", "running", "decoding", "ended")

    def _follow_up(self, parent: str, blocks: int, jitter: int, landing: Landing) -> str:
        """The parent's prompt and output so far, plus new text."""
        name = self._name()
        session = self.session
        base = session.tokens(parent)
        if base > LONG_PROMPT:
            blocks = 0
        n = new_tokens(session.config, base, blocks, jitter, landing)
        self._arrive(name, follow_up(parent, n), self._hash.shared(name, parent))
        return name

    @when(lambda self: self._room() and bool(self._parents()))
    @rule(
        which=st.integers(0, 2 * MAX_LIVE),
        blocks=st.integers(0, 1),
        jitter=st.integers(1, 40),
        landing=LANDINGS,
    )
    def next_turn(self, which: int, blocks: int, jitter: int, landing: Landing) -> None:
        self._follow_up(self._pick(self._parents(), which), blocks, jitter, landing)

    # -- scheduling ---------------------------------------------------------

    @precondition(lambda self: self._session is not None and self.session.in_phase("waiting"))
    @rule(which=PICK)
    def lookup(self, which: int) -> None:
        self._run("lookup", req=self._pick(self.session.in_phase("waiting"), which))

    def _chunk(self, req: str, lookahead: int) -> bool:
        """One allocation of `req` (admitting it first if waiting); whether it
        ran (not if it already allocated in this scheduler step)."""
        session = self.session
        if req in session.allocated_since_drain:
            return False
        if session.requests[req].phase == "waiting":
            self._run("lookup", req=req)
            reserved = self._run("reserve", req=req)
            # The admission gate refuses it for now; with the full-sequence
            # gate on, exploration leaves that to the allocation itself (its
            # refusal is the manager's to check).
            gate_in_allocation = session.config.reserve_full_sequence
            fits = admission_fits(reserved["blocks"], session.free_blocks())
            if not fits and not gate_in_allocation:
                return False
        try:
            return bool(self._run("allocate", req=req, tokens="auto", lookahead=lookahead)["ok"])
        except NothingToRun:
            return False  # the Scheduler passes it over this step

    def _prefill(self, req: str, lookahead: int, rounds: int) -> bool:
        """Up to `rounds` chunks of `req`, a scheduler step apart (no step
        after the last); whether its prompt is computed."""
        for round_no in range(rounds):
            if round_no:
                self._tick()
            if self.session.requests[req].phase == "decoding":
                return True
            if req in self.session.allocated_since_drain or not self._chunk(req, lookahead):
                return False
        return self.session.requests[req].phase == "decoding"

    def _prefill_until(self, req: str, tokens: int) -> bool:
        """Chunks of `req`, a scheduler step apart (no step after the last),
        until at least `tokens` are computed; whether it stopped there with
        its prompt still being computed."""
        session = self.session
        for round_no in range(PREFILL_ROUNDS):
            if round_no:
                self._tick()
            if not self._chunk(req, 0):
                return False
            phase = session.requests[req].phase
            computed = session.model.requests[req].request.num_computed_tokens
            if phase != "running" or computed >= tokens:
                return phase == "running"
        return False

    def _tick(self) -> None:
        """The end of a scheduler step: `step`, then the copies run, then
        what an engine reads every step: the KV-cache events it publishes
        (when the config queues them) and the hit stats it logs. In
        lockstep both are compared, as the gate compares them."""
        self._run("step")
        self._run("drain")
        if self.session.config.kv_events:
            self._run("events")
        self._run("stats")

    def _decode(self, req: str, spec: int, steps: int) -> None:
        for step_no in range(steps):
            if step_no:
                self._tick()
            if self.session.requests[req].phase != "decoding":
                return
            if req in self.session.allocated_since_drain:
                return
            if not self._run("decode1", req=req, spec=spec)["ok"]:
                return

    def _burst(self, how: Burst, n: int) -> None:
        """A burst of concurrent prefills: all free blocks, all but a few, or a few."""
        free = self.session.free_blocks()
        if how == "none" or free == 0:
            return
        if how == "all":
            self._run("evict", blocks="all")
        elif how == "all but":
            self._run("evict", blocks=max(free - n, 1))
        else:
            self._run("evict", blocks=min(n + 1, free))

    @precondition(
        lambda self: self._session is not None and self.session.schedulable("waiting", "running")
    )
    @rule(
        which=PICK,
        lookahead=st.sampled_from([3, 0, 1]),
        rounds=st.integers(1, 8),
        end_step=st.booleans(),
    )
    def prefill_chunk(self, which: int, lookahead: int, rounds: int, end_step: bool) -> None:
        """Up to `rounds` chunks of one request, a scheduler step apart
        (`step`, `drain` between them, and after the last with `end_step`;
        without it the last chunk's copies stay queued); a waiting request is
        admitted first (lookup, reserve, the full-sequence gate)."""
        req = self._pick(self.session.schedulable("waiting", "running"), which)
        self._prefill(req, lookahead, rounds)
        if end_step:
            self._tick()

    @when(
        lambda self: self.session.config.kv_connector and bool(self.session.schedulable("waiting"))
    )
    @rule(
        which=PICK,
        short=st.sampled_from([0, 1, 8, 32, 40, 9999]),
        load_async=st.booleans(),
        peek=st.booleans(),
        burst=BURSTS,
        n=st.integers(0, 4),
        rounds=st.integers(1, 8),
        fail=st.sampled_from([False, False, True]),
        bad_block=st.sampled_from([False, False, True]),
    )
    def connector_admit(
        self,
        which: int,
        short: int,
        load_async: bool,
        peek: bool,
        burst: Burst,
        n: int,
        rounds: int,
        fail: bool,
        bad_block: bool,
    ) -> None:
        """A waiting request admitted with a KV connector holding its first
        tokens (all but `short` of them, at most what the connector may
        report), loaded sync or async. An async load stays in flight for a
        scheduler step: another waiting request may look up (`peek`: it must
        not see the unloaded blocks) and a burst may take the free blocks;
        then the load completes at the request's next allocation (or, with
        `fail`, it failed: under policy recompute the request is looked up
        afresh first, under policy fail it ends), and its prefill goes on for
        up to `rounds` chunks. With `bad_block` on a single-group model (the
        one layout vLLM takes block-level failures on), the worker reports
        the block holding the loaded state invalid instead: the request goes
        on from the block before it (policy recompute) or ends (fail)."""
        session = self.session
        config = session.config
        req = self._pick(session.schedulable("waiting"), which)
        total = session.tokens(req)
        remote = max(0, min(total - short, total if load_async else total - 1))
        found = self._run("lookup", req=req, remote_hit=remote, remote_async=load_async)
        reserved = self._run("reserve", req=req)
        fits = admission_fits(reserved["blocks"], session.free_blocks())
        if not fits and not config.reserve_full_sequence:
            return
        observed = self._run("allocate", req=req, tokens="auto")
        # The loaded tokens' last block holds the loaded Mamba state (in
        # align mode the blocks before it in the load are null).
        loaded_end = found["hit"] + found["external"]
        bad = (loaded_end - 1) // config.scheduler_block_size
        bad_block = bad_block and len(config.groups) == 1 and found["external"] > 0
        policy_fails = config.kv_load_failure_policy == "fail"
        if observed.get("loading") is True:
            self._tick()
            others = [r for r in session.schedulable("waiting") if r != req]
            if peek and others:
                self._run("lookup", req=others[0])
            self._burst(burst, n)
            if (fail or bad_block) and policy_fails:
                # The Scheduler fails the request (an error finish).
                failure = {"invalid_blocks": (bad,)} if bad_block else {"load_failed": True}
                self._run("free", req=req, how="abort", **failure)
                return
            partial: dict[str, Any] = {}
            if bad_block and bad > 0:
                partial = {"invalid_blocks": (bad,)}
            elif fail or bad_block:
                self._run("lookup", req=req, load_failed=True)
            if not self._run("allocate", req=req, tokens="auto", **partial)["ok"]:
                return
        elif not observed["ok"]:
            return
        elif bad_block:
            self._tick()
            if policy_fails:
                self._run("free", req=req, how="abort", invalid_blocks=(bad,))
                return
            if not self._run("allocate", req=req, tokens="auto", invalid_blocks=(bad,))["ok"]:
                return
        self._tick()
        self._prefill(req, 0, rounds)

    @when(lambda self: bool(self.session.schedulable("decoding")))
    @rule(which=PICK, spec=st.sampled_from([3, 0, 1, 2]), steps=st.sampled_from([1, 2, 3, 4, 12]))
    def decode(self, which: int, spec: int, steps: int) -> None:
        """Up to `steps` decode steps of one request with `spec` drafts each
        (sometimes a longer answer, past an attention block's end)."""
        self._decode(self._pick(self.session.schedulable("decoding"), which), spec, steps)

    @precondition(lambda self: self._session is not None)
    @rule()
    def step(self) -> None:
        self._run("step")

    @precondition(lambda self: self._session is not None)
    @rule()
    def drain(self) -> None:
        self._run("drain")

    # -- ending requests ----------------------------------------------------

    @when(lambda self: bool(self.session.in_phase("waiting", "running", "decoding")))
    @rule(which=PICK, how=st.sampled_from(["finish", "abort"]))
    def free(self, which: int, how: str) -> None:
        req = self._pick(self.session.in_phase("waiting", "running", "decoding"), which)
        self._run("free", req=req, how=how)

    @when(lambda self: bool(self.session.in_phase("running", "decoding")))
    @rule(which=PICK, readmit=st.booleans(), burst=BURSTS)
    def preempt(self, which: int, readmit: bool, burst: Burst) -> None:
        """A running or decoding request preempted; with `readmit`, the
        scheduler admits it again after the step (and a burst): its lookup
        then covers its output so far too."""
        req = self._pick(self.session.in_phase("running", "decoding"), which)
        self._run("free", req=req, how="preempt")
        if readmit:
            self._tick()
            self._burst(burst, 2)
            self._prefill(req, 0, PREFILL_ROUNDS)
            self._tick()

    @when(lambda self: bool(self.session.in_phase("waiting", "running", "decoding")))
    @rule(which=PICK)
    def pop(self, which: int) -> None:
        req = self._pick(self.session.in_phase("waiting", "running", "decoding"), which)
        self._run("pop", req=req)

    @precondition(lambda self: self._session is not None and self.session.in_phase("popped"))
    @rule(which=PICK)
    def release(self, which: int) -> None:
        self._run("release", req=self._pick(self.session.in_phase("popped"), which))

    @when(lambda self: self.mode.lockstep is not None)
    @rule(keys=st.sampled_from([("free_blocks",), ("pool_clean", "holds"), ("holds",)]))
    def check(self, keys: tuple[str, ...]) -> None:
        """A `check` step, in differential mode: the model's values go into
        the trace and are compared with the lockstep target's. (The model
        alone checks every invariant after every step already.)"""
        self._run("check", check={k: {} if k == "holds" else 0 for k in keys})

    # -- what a deployment calls besides scheduling -----------------------------

    @precondition(lambda self: self._session is not None)
    @rule(preempt_running=st.booleans())
    def reset(self, preempt_running: bool) -> None:
        """`reset_prefix_cache`, optionally as the scheduler's reset with
        `reset_running_requests`: every running request preempted, the
        step's copies drained, then the reset (refused while anything else
        still holds a block: a popped request, a waiting one's queued copy)."""
        if preempt_running:
            session = self.session
            for req in session.in_phase("running", "decoding"):
                self._run("free", req=req, how="preempt")
            self._run("drain")
        self._run("reset")

    @when(lambda self: bool(self.session.in_phase("running", "decoding", "popped")))
    @rule(preempt_running=st.booleans())
    def reset_in_flight(self, preempt_running: bool) -> None:
        """A reset asked for while requests hold blocks (a weight update
        between batches): refused while anything is in use; then, with
        `preempt_running`, the scheduler's reset that preempts the running
        requests first."""
        self._run("reset")
        if preempt_running:
            self.reset(True)

    @precondition(lambda self: self._session is not None)
    @rule(events=st.booleans())
    def observe(self, events: bool) -> None:
        """What a deployment's monitoring takes each step: the KV-cache
        events (empty unless the config queues them), or the hit stats."""
        self._run("events" if events else "stats")

    @precondition(lambda self: self._session is not None)
    @rule()
    def observe_residency(self) -> None:
        """The residency metrics' eviction events the Scheduler's stats drain
        (none unless the config has `kv_cache_metrics`); in lockstep, each
        event's block and reuse gaps are compared."""
        self._run("residency")

    # -- other requests' prefills ---------------------------------------------

    @when(lambda self: self.session.free_blocks() > 0)
    @rule(how=st.sampled_from(["all", "all but", "some"]), n=st.integers(0, 8))
    def evict(self, how: Burst, n: int) -> None:
        self._burst(how, n)
