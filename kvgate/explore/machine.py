"""A Hypothesis state machine over the trace ops, run on the model.

Rules are the trace format's ops as a scheduler issues them: a fresh request
or a follow-up turn of an earlier one, lookup, a chunk of prefill (admission
through `reserve` on the first one), a decode step with drafts, `step`,
`drain`, every free path, and eviction bursts. Each rule hands
`kvgate.conformance.ops.Step`s to a `Session`, which applies them (to vLLM
too in differential mode), records them and checks every invariant after
each, so a failure is a trace.

Requests live in Bundles: `live` (arrived, not ended), `popped` (deferred
free pending) and `finished` (ended, still a parent for follow-ups). Ops that
need a request in a given phase pick one of the eligible requests by index,
under a precondition that one exists: the index shrinks to the oldest.

Arguments lean toward what matters: prompt sizes are chosen by where the
prompt's partial tail lands (inside a Mamba block, on a boundary), follow-ups
extend their parent so the next turn can resume at its tail, pools are small
enough to fill, and bursts evict everything or all but a few blocks.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Any, ClassVar, Literal

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    precondition,
    rule,
)

from kvgate.conformance.config import Config, GroupConfig
from kvgate.conformance.driver import OpDriver
from kvgate.explore.session import ExploreFailure, Session, follow_up, fresh
from kvgate.model.mamba import checkpoint_position

Landing = Literal["mid-block", "boundary", "any"]

HASH_UNIT = 8
# At most this many live requests: enough to fill a small pool.
MAX_LIVE = 5
# Follow-up chains stop growing past this many tokens (they still arrive,
# as short extensions), so prompts stay within what a small pool admits.
LONG_PROMPT = 320
# Index strategy for picking one of the eligible requests.
PICK = st.integers(0, MAX_LIVE - 1)


@dataclass
class Stats:
    """What a run exercised, across examples (for the summary and tests)."""

    ops: Counter[str] = field(default_factory=Counter)
    # Configs drawn, per value of each align-mode knob ("knob=value").
    knobs: Counter[str] = field(default_factory=Counter)
    examples: int = 0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)
    # Seconds from `started` to the first failing step Hypothesis ran
    # (before any shrinking).
    first_failure: float | None = None
    on_example: Callable[[Stats], None] | None = None


@dataclass
class Mode:
    """What the machine checks and against what."""

    hold: bool
    invariants: tuple[str, ...]
    lockstep: Callable[[Config], OpDriver[Any]] | None = None
    stats: Stats = field(default_factory=Stats)
    retire: bool = False  # the production fork's retention of retired states

    def apply(self, config: Config) -> Config:
        """A drawn config with this mode's switches. With the hold on, the
        shared-prefix checkpoint stays off: there the ci profile breaks
        `no_total_miss` (a junction held, the tail after it not), an open
        question about the hold's specification, not a bug this run seeks."""
        shared = config.shared_prefix_checkpoint and not self.hold
        return replace(
            config, hold=self.hold, hold_retired=self.retire, shared_prefix_checkpoint=shared
        )


@st.composite
def configs(draw: st.DrawFn) -> Config:
    """Hybrid configs around the seed's; each choice shrinks to the seed's
    value. The hold switch is the mode's, set when the machine starts."""
    mamba_block = draw(st.sampled_from([32, 64]))
    attention_block = draw(st.sampled_from([8, 16]))
    speculative = draw(st.sampled_from([3, 0, 1]))
    mamba_groups = draw(st.sampled_from([1, 2]))
    # Prefill checkpoint blocks as deployments set them: none (GDN on
    # Triton), one on the 64-token grid (GDN on FlashInfer), one at
    # alignment 1 (Mamba2 layers); a grid of two hash units besides.
    checkpoint_blocks, alignment = draw(
        st.sampled_from([(0, None), (1, 64), (1, 1), (1, 2 * HASH_UNIT)])
    )
    groups = (
        GroupConfig("full_attention", attention_block),
        *(
            GroupConfig("mamba_align", mamba_block, speculative, checkpoint_blocks, alignment)
            for _ in range(mamba_groups)
        ),
    )
    return Config(
        num_blocks=draw(st.integers(32, 128)),
        hash_unit=HASH_UNIT,
        groups=groups,
        eagle=draw(st.booleans().map(lambda b: not b)),  # shrinks to True
        # Sparse, dense, and periodic (an interval of one block acts dense).
        retention_interval=draw(
            st.sampled_from([0, None, 2 * mamba_block, 4 * mamba_block, mamba_block])
        ),
        hold=False,
        scheduler_block_size=mamba_block,
        max_num_scheduled_tokens=draw(st.sampled_from([8192, 64, 32])),
        shared_prefix_checkpoint=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 48, mamba_block + HASH_UNIT])),
        kv_events=draw(st.booleans()),
    )


def knob_values(config: Config) -> tuple[str, ...]:
    """The config's align-mode knobs as `knob=value` (per-knob counts)."""
    mamba = config.groups[config.mamba_group_ids[0]]
    blocks = config.scheduler_block_size
    retention = config.retention_interval
    period = (
        "null" if retention is None else "0" if retention == 0 else f"{retention // blocks}x block"
    )
    return (
        f"prefill_checkpoint_blocks={mamba.prefill_checkpoint_blocks}",
        f"prefill_checkpoint_alignment={mamba.prefill_checkpoint_alignment}",
        f"retention_interval={period}",
        f"shared_prefix_checkpoint={config.shared_prefix_checkpoint}",
        f"shared_prefix_checkpoint_in_effect={config.shared_prefix_checkpoint_on}",
        f"long_prefill_token_threshold={config.long_prefill_token_threshold}",
    )


def mamba_block(config: Config) -> int:
    return max(config.groups[g].block_size for g in config.mamba_group_ids)


def tail_lands(config: Config, total: int, landing: Landing) -> bool:
    """Whether a prompt of `total` tokens keys its partial tail as asked."""
    if landing == "any":
        return True
    tail = checkpoint_position(total, config.hash_unit, config.eagle)
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


LANDINGS = st.sampled_from(["mid-block", "boundary", "any"])


class ExploreMachine(RuleBasedStateMachine):
    """Subclassed per `Mode` by `machine_class`; not run directly."""

    mode: ClassVar[Mode]

    live = Bundle("live")
    popped = Bundle("popped")
    finished = Bundle("finished")

    def __init__(self) -> None:
        super().__init__()
        self._session: Session | None = None
        self._names = count()

    @property
    def session(self) -> Session:
        assert self._session is not None, "the config rule runs first"
        return self._session

    def _run(self, op: str, **fields: Any) -> dict[str, Any]:
        stats = self.mode.stats
        stats.steps += 1
        try:
            return self.session.run(op, **fields)
        except ExploreFailure:
            if stats.first_failure is None:
                stats.first_failure = time.perf_counter() - stats.started
            raise

    def _pick(self, names: list[str], which: int) -> str:
        return names[which % len(names)]

    def _room(self) -> bool:
        return (
            self._session is not None
            and len(self.session.in_phase("waiting", "running", "decoding")) < MAX_LIVE
        )

    # -- set up -------------------------------------------------------------

    @initialize(config=configs())
    def start(self, config: Config) -> None:
        mode = self.mode
        config = mode.apply(config)
        mode.stats.knobs.update(knob_values(config))
        self._session = Session(config, mode.invariants, mode.lockstep, mode.stats.ops)

    def teardown(self) -> None:
        if self._session is not None:
            self._session.close()
        stats = self.mode.stats
        stats.examples += 1
        if stats.on_example is not None:
            stats.on_example(stats)

    # -- arrivals -----------------------------------------------------------

    @precondition(lambda self: self._room())
    @rule(
        target=live,
        blocks=st.integers(0, 4),
        jitter=st.integers(0, 40),
        landing=LANDINGS,
    )
    def arrive(self, blocks: int, jitter: int, landing: Landing) -> str:
        name = f"R{next(self._names)}"
        n = new_tokens(self.session.config, 0, blocks, jitter, landing)
        self._run("arrive", req=name, prompt=fresh(n))
        return name

    @precondition(lambda self: self._room())
    @rule(
        target=live,
        parent=st.one_of(live, finished),
        blocks=st.integers(0, 1),
        jitter=st.integers(1, 40),
        landing=LANDINGS,
    )
    def next_turn(self, parent: str, blocks: int, jitter: int, landing: Landing) -> str:
        """The parent's prompt and output so far, plus new text."""
        name = f"R{next(self._names)}"
        session = self.session
        base = session.tokens(parent)
        if base > LONG_PROMPT:
            blocks = 0
        n = new_tokens(session.config, base, blocks, jitter, landing)
        self._run("arrive", req=name, prompt=follow_up(parent, n))
        return name

    # -- scheduling ---------------------------------------------------------

    @precondition(lambda self: self._session is not None and self.session.in_phase("waiting"))
    @rule(which=PICK)
    def lookup(self, which: int) -> None:
        self._run("lookup", req=self._pick(self.session.in_phase("waiting"), which))

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
        session = self.session
        req = self._pick(session.schedulable("waiting", "running"), which)
        for round_no in range(rounds):
            if round_no:
                self._run("step")
                self._run("drain")
            state = session.requests[req]
            if state.phase == "decoding":
                break
            if state.phase == "waiting":
                self._run("lookup", req=req)
                reserved = self._run("reserve", req=req)
                if reserved["blocks"] > session.free_blocks():
                    return  # the admission gate refuses it for now
            if not self._run("allocate", req=req, tokens="auto", lookahead=lookahead)["ok"]:
                return
        if end_step:
            self._run("step")
            self._run("drain")

    @precondition(lambda self: self._session is not None and self.session.schedulable("decoding"))
    @rule(which=PICK, spec=st.sampled_from([3, 0, 1, 2]), steps=st.integers(1, 4))
    def decode(self, which: int, spec: int, steps: int) -> None:
        """Up to `steps` decode steps of one request with `spec` drafts each."""
        req = self._pick(self.session.schedulable("decoding"), which)
        for step_no in range(steps):
            if step_no:
                self._run("step")
                self._run("drain")
            if not self._run("decode1", req=req, spec=spec)["ok"]:
                return

    @precondition(lambda self: self._session is not None)
    @rule()
    def step(self) -> None:
        self._run("step")

    @precondition(lambda self: self._session is not None)
    @rule()
    def drain(self) -> None:
        self._run("drain")

    # -- ending requests ----------------------------------------------------

    @rule(target=finished, req=consumes(live), how=st.sampled_from(["finish", "abort"]))
    def free(self, req: str, how: str) -> str:
        self._run("free", req=req, how=how)
        return req

    @precondition(
        lambda self: self._session is not None and self.session.in_phase("running", "decoding")
    )
    @rule(which=PICK)
    def preempt(self, which: int) -> None:
        req = self._pick(self.session.in_phase("running", "decoding"), which)
        self._run("free", req=req, how="preempt")

    @rule(target=popped, req=consumes(live))
    def pop(self, req: str) -> str:
        self._run("pop", req=req)
        return req

    @rule(target=finished, req=consumes(popped))
    def release(self, req: str) -> str:
        self._run("release", req=req)
        return req

    @precondition(lambda self: self._session is not None and self.mode.lockstep is not None)
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

    @precondition(lambda self: self._session is not None)
    @rule(events=st.booleans())
    def observe(self, events: bool) -> None:
        """What a deployment's monitoring takes each step: the KV-cache
        events (empty unless the config queues them), or the hit stats."""
        self._run("events" if events else "stats")

    # -- other requests' prefills ---------------------------------------------

    @precondition(lambda self: self._session is not None and self.session.free_blocks() > 0)
    @rule(how=st.sampled_from(["all", "all but", "some"]), n=st.integers(0, 8))
    def evict(self, how: str, n: int) -> None:
        """A burst of concurrent prefills: all free blocks, all but a few, or a few."""
        free = self.session.free_blocks()
        if how == "all":
            self._run("evict", blocks="all")
        elif how == "all but":
            self._run("evict", blocks=max(free - n, 1))
        else:
            self._run("evict", blocks=min(n + 1, free))


def machine_class(mode: Mode) -> type[ExploreMachine]:
    """The machine for `mode` (a subclass: Hypothesis runs classes)."""
    hold = "HoldOn" if mode.hold else "HoldOff"
    kind = "Differential" if mode.lockstep is not None else "Model"
    return type(f"Explore{kind}{hold}", (ExploreMachine,), {"mode": mode})
