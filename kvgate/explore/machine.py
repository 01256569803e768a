"""A Hypothesis state machine over the trace ops, run on the model.

Rules are the trace format's ops as a scheduler issues them: a fresh request
or a follow-up turn of an earlier one, lookup, a chunk of prefill (admission
through `reserve` on the first one), a decode step with drafts, `step`,
`drain`, every free path, and eviction bursts. Each rule hands
`kvgate.conformance.ops.Step`s to a `Session`, which applies them (to vLLM
too in differential mode), records them and checks every invariant after
each, so a failure is a trace.

Scenario rules string those ops into the situations that break managers
like this one: a producer prefilled to a partial tail; a follow-up turn that
resumes at a parent's partial tail with a burst of other prefills around its
lookup; siblings arriving at a live producer's tail in one step; a
preemption right after a copy-on-write, then re-admission; re-admission of a
popped request's follow-up before the deferred free completes.

Swarm testing: each example enables a random subset of the rules
(Hypothesis's stateful engine does that itself: it draws feature flags that
switch rules off per example) and of the config features (`knobs.KNOBS`,
drawn here), so an example dwells on a few kinds of step and config instead
of averaging over all of them. And
`hypothesis.target` steers generation toward the quantities bugs here need:
how far below a Mamba block boundary a follow-up resumes, how many blocks
requests hold or keep in flight, how close the free queue comes to empty.

Requests are picked by phase from the session (an index among the eligible
ones, under a precondition that one exists: it shrinks to the oldest).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Any, ClassVar, Literal

from hypothesis import reject, target
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.internal.conjecture.data import Status
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvgate.conformance.config import Config, GroupConfig, UnsupportedConfig
from kvgate.conformance.driver import OpDriver
from kvgate.conformance.ops import Segment
from kvgate.conformance.refusal import model_refusal, refusal_of
from kvgate.conformance.target import StepRefused
from kvgate.conformance.tokens import HashInputs
from kvgate.explore.hash_inputs import MODES, RequestInputs, arrive_fields
from kvgate.explore.knobs import Stratum, configs, rule_breaches
from kvgate.explore.session import (
    ExploreFailure,
    RefusalDivergence,
    Session,
    follow_up,
    fresh,
    share_prompt,
)
from kvgate.model.mamba import checkpoint_position
from kvgate.model.scheduler import admission_fits

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


@dataclass
class Stats:
    """What a run exercised, across examples (for the summary and tests)."""

    ops: Counter[str] = field(default_factory=Counter)
    # Configs drawn, per value of each align-mode knob ("knob=value").
    knobs: Counter[str] = field(default_factory=Counter)
    # Examples as Hypothesis counts them against `max_examples`: those it
    # ran to the end before the first failure. Not counted: `discarded`,
    # examples Hypothesis dropped part-way (its choice buffer overran, as a
    # long stateful example's draws do), which it runs but does not count;
    # `shrinking`, the runs after the first failure while it shrinks.
    examples: int = 0
    discarded: int = 0
    shrinking: int = 0
    # Examples dropped at a lookup vLLM 0.33.0 crashes on (kv_events_full).
    rejected_lookups: int = 0
    # Configs breaking one of vLLM's rules checked before the search
    # (`check_config_rules`), and how the model refused them ("field" counts).
    rule_breaches: Counter[str] = field(default_factory=Counter)
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)
    # Seconds from `started` to the first failing step Hypothesis ran
    # (before any shrinking).
    first_failure: float | None = None
    # The same in this process's CPU seconds (steadier on a shared machine).
    started_cpu: float = field(default_factory=time.process_time)
    first_failure_cpu: float | None = None
    on_example: Callable[[Stats], None] | None = None


@dataclass
class Mode:
    """What the machine checks and against what."""

    hold: bool
    invariants: tuple[str, ...]
    lockstep: Callable[[Config], OpDriver[Any]] | None = None
    stats: Stats = field(default_factory=Stats)
    retain_retired: bool = False  # the production fork's retention of retired states
    # Config features fixed for every example (a campaign's stratum).
    stratum: Stratum = field(default_factory=dict)
    # Swarm testing of config features: each example varies a random subset
    # of the knobs (Hypothesis already enables a random subset of the rules
    # per example: its stateful rule strategy draws feature flags).
    swarm: bool = True
    # A share of the configs drawn break one of vLLM's config rules
    # (`knobs.BREAKABLE`); the model and the lockstep target must refuse alike.
    refusals: bool = False

    def apply(self, config: Config) -> Config:
        """A drawn config with this mode's switches. In lockstep the KV-cache
        events are always queued, so every `events` step compares them (as
        the gate does on a trace with them)."""
        events = config.kv_events or self.lockstep is not None
        return replace(config, hold=self.hold, retain_retired=self.retain_retired, kv_events=events)


def check_config_rules(mode: Mode) -> RefusalDivergence | None:
    """Every config of `knobs.rule_breaches` (one of vLLM's config rules
    broken, or a model kvgate does not cover): the model and the lockstep
    target must refuse it alike. The search draws such configs too, one in
    `knobs.REFUSAL_ODDS`, but which rules depends on its draws."""
    assert mode.lockstep is not None, "a differential mode"
    for breach in rule_breaches():
        config = mode.apply(breach)
        refused, account = model_refusal(config)
        other, other_account, _ = refusal_of(mode.lockstep, config)
        if other != refused:
            return RefusalDivergence(config, account, other_account, refused or other or "")
        mode.stats.rule_breaches[refused or "accepted"] += 1
    return None


def knob_values(config: Config, refused: str | None = None) -> tuple[str, ...]:
    """The config's align-mode knobs as `knob=value` (per-knob counts), and
    how the model refuses it (`refused`: vLLM's field, `not modelled:
    FIELD` for kvgate's own refusal, `none` if valid)."""
    # A broken `groups` has none (`knobs.broken`): counted as no checkpoint.
    mamba = next((config.groups[i] for i in config.mamba_group_ids), GroupConfig("mamba_align", 1))
    blocks = config.scheduler_block_size
    retention = config.retention_interval
    period = (
        "null"
        if retention is None
        else "0"
        if retention == 0
        else f"{retention // blocks}x block"
        if retention > 0 and retention % blocks == 0
        else f"{retention} tokens"
    )
    return (
        f"refused={refused or 'none'}",
        f"prefill_checkpoint_blocks={mamba.prefill_checkpoint_blocks}",
        f"prefill_checkpoint_alignment={mamba.prefill_checkpoint_alignment}",
        f"retention_interval={period}",
        f"shared_prefix_checkpoint={config.shared_prefix_checkpoint}",
        f"shared_prefix_checkpoint_in_effect={config.shared_prefix_checkpoint_on}",
        f"long_prefill_token_threshold={config.long_prefill_token_threshold}",
        f"hash_lookahead_tokens={config.hash_lookahead_tokens}",
        f"kv_events_full={config.kv_events_full}",
        # vLLM's emit_cached_block_events with lookahead tokens per block.
        "kv_events_full_with_lookahead_hashes="
        + str(config.kv_events_full and bool(config.hash_lookahead_tokens)),
        f"pure_mamba={not config.has_attention}",
        f"prefix_caching={config.prefix_caching}",
        f"mamba_cache_mode={config.mamba_cache_mode}",
        "kv_connector="
        + ("divergent_hits" if config.kv_connector_divergent_hits else str(config.kv_connector)),
        f"kv_load_failure_policy={config.kv_load_failure_policy}",
        f"kv_cache_metrics={config.kv_cache_metrics}",
    )


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


Interrupt = Literal["siblings", "preempt"]
InterruptAt = Literal["none", "first chunk", "tail", "done"]


@dataclass(frozen=True)
class Producer:
    """The shape of a producer request a scenario starts with."""

    blocks: int
    jitter: int
    landing: Landing
    decodes: int
    spec: int
    # Where its prefill is interrupted: after its first chunk, at the chunk
    # that stops at the prompt's partial tail (the split always stops
    # there), or ("done", siblings only) at its last chunk; "none": never.
    # There, in the same scheduler step: "siblings", requests sharing its
    # prompt (plus
    # `sibling_extra` new tokens, 0 for a resend of the same prompt) arrive
    # and are admitted in that same scheduler step, as a burst of users
    # with one system prompt is; or "preempt", the producer is preempted
    # (memory pressure mid-prefill), a burst takes the free blocks, and it
    # is admitted again.
    interrupt_at: InterruptAt = "none"
    interrupt: Interrupt = "siblings"
    siblings: int = 1
    sibling_extra: int = 0


PRODUCERS = st.builds(
    Producer,
    blocks=st.integers(0, 3),
    jitter=st.integers(1, 40),
    landing=st.sampled_from(["mid-block", "any", "boundary", "whole blocks"]),
    # Mostly at least one: the first decode moves the partial tail. Some
    # answers run past an attention block (a partial key then gets its
    # block's full key beside it).
    decodes=st.sampled_from([1, 2, 0, 3, 12]),
    spec=st.sampled_from([0, 3, 1]),
    interrupt_at=st.sampled_from(["none", "tail", "done", "first chunk", "none"]),
    interrupt=st.sampled_from(["siblings", "preempt"]),
    siblings=st.integers(1, 2),
    sibling_extra=st.sampled_from([0, 9, 1]),
)
# A burst that evicts every free block is the one that reaches the newest
# freed (the most recently released) states: drawn most often.
BURSTS: st.SearchStrategy[Burst] = st.sampled_from(["all", "all but", "all", "some", "all", "none"])


def when(ready: Callable[[Any], bool]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A precondition: the session started and `ready(machine)`."""
    return precondition(lambda self: self._session is not None and ready(self))


class ExploreMachine(RuleBasedStateMachine):
    """Subclassed per `Mode` by `machine_class`; not run directly."""

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
        drawn = configs(mode.stratum, mode.swarm, mode.refusals)
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
        elif current_build_context().data.status in (Status.OVERRUN, Status.INVALID):
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
        return bool(self._run("allocate", req=req, tokens="auto", lookahead=lookahead)["ok"])

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

    # -- scenarios ------------------------------------------------------------

    @when(lambda self: self._room())
    @rule(shape=PRODUCERS)
    def produce(self, shape: Producer) -> None:
        self._produce(shape)

    def _produce(self, shape: Producer) -> str | None:
        """A producer: a fresh prompt (by default with its tail inside a
        Mamba block) prefilled to the end, then `decodes` decode steps (the
        first moves its partial tail to a copy block); its name once its
        prompt is computed."""
        name = self._name()
        n = new_tokens(self.session.config, 0, shape.blocks, shape.jitter, shape.landing)
        self._arrive(name, fresh(n), self._hash.fresh(name, n))
        config = self.session.config
        if shape.interrupt_at in ("tail", "first chunk"):
            tail = checkpoint_position(
                n, config.hash_unit, config.block_drop, config.hash_lookahead_tokens
            )
            if self._prefill_until(name, tail if shape.interrupt_at == "tail" else 1):
                self._interrupt(name, shape)
        if not self._prefill(name, 0, PREFILL_ROUNDS):
            return None
        if shape.interrupt_at == "done":
            self._siblings(name, shape.siblings, shape.sibling_extra)
        if shape.decodes:
            self._tick()
            self._decode(name, shape.spec, shape.decodes)
        self._tick()
        return name

    def _interrupt(self, producer: str, shape: Producer) -> None:
        """What happens to a producer in the middle of its prefill (`Producer`)."""
        if shape.interrupt == "siblings":
            self._siblings(producer, shape.siblings, shape.sibling_extra)
            self._tick()
            return
        self._tick()
        self._run("free", req=producer, how="preempt")
        self._tick()
        self._burst("all", 0)

    def _siblings(self, producer: str, count: int, extra: int) -> None:
        """`count` requests sharing `producer`'s prompt (plus `extra`, `extra +
        1`, ... new tokens) arrive and are admitted in the current scheduler
        step (a hit on a state this very step keyed is deferred)."""
        children = []
        for i in range(min(count, MAX_LIVE - self._live())):
            child = self._name()
            prompt = share_prompt(producer, extra + i)
            self._arrive(child, prompt, self._hash.shared(child, producer))
            children.append(child)
        for child in children:
            self._chunk(child, 0)

    @when(lambda self: self._room() and bool(self._computed()))
    @rule(
        which=PICK,
        extra=st.sampled_from([0, 0, 1, 9]),
        burst=st.sampled_from(["none", "some", "all"]),
        n=st.integers(0, 4),
        aligned=st.booleans(),
    )
    def resend(self, which: int, extra: int, burst: Burst, n: int, aligned: bool) -> None:
        """A prompt sent again as it was (a client's retry, parallel samples
        as separate requests), or with a few tokens more, mostly while its
        states are still cached: prefilled to the end and decoded a step.
        With `aligned`, the prompt is a whole number of hash units long
        (an earlier one, or a new templated one produced first): every
        block of it is keyed, so only the lookup's cap (the prompt less its
        last token) keeps one to compute."""
        # A retry follows its original closely: the newest first.
        computed = self._computed()[::-1]
        if aligned:
            unit = self.session.config.hash_unit
            model = self.session.model
            computed = [
                r for r in computed if model.requests[r].request.num_prompt_tokens % unit == 0
            ]
            if not computed and self._live() <= MAX_LIVE - 2:
                made = self._produce(Producer(1, 1, "whole blocks", decodes=1, spec=0))
                computed = [] if made is None else [made]
            if not computed:
                return
        producer = self._pick(computed, which)
        self._burst(burst, n)
        child = self._name()
        self._arrive(child, share_prompt(producer, extra), self._hash.shared(child, producer))
        if self._prefill(child, 0, PREFILL_ROUNDS):
            self._tick()
            self._decode(child, 0, 1)
        self._tick()

    def _computed(self) -> list[str]:
        return self.session.in_phase("decoding", "ended")

    @when(lambda self: self._room())
    @rule(
        # A new producer twice as often as an earlier request.
        parent=st.one_of(PRODUCERS, PRODUCERS, PICK),
        jitter=st.integers(1, 24),
        # Mostly a short turn; sometimes a long one (a pasted document):
        # its prefill after the resume spans several Mamba blocks.
        blocks=st.sampled_from([0, 0, 3]),
        before=BURSTS,
        after=BURSTS,
        after_admission=st.booleans(),
        n=st.integers(0, 4),
        # A resident parent mostly: its state must survive the burst.
        end_parent=st.sampled_from([False, False, True]),
    )
    def follow_up_turn(
        self,
        parent: Producer | int,
        jitter: int,
        blocks: int,
        before: Burst,
        after: Burst,
        after_admission: bool,
        n: int,
        end_parent: bool,
    ) -> None:
        """A follow-up turn that resumes at its parent's partial tail, with
        bursts of other prefills before its lookup and after it (before or
        after its admission). The parent is a new producer (when there is
        room for two) or an earlier computed request, optionally finished
        first."""
        name: str | None = None
        if isinstance(parent, Producer):
            if self._live() <= MAX_LIVE - 2:
                name = self._produce(parent)
        elif self._computed():
            name = self._pick(self._computed(), parent)
        if name is None:
            return
        if end_parent and self.session.requests[name].phase == "decoding":
            self._run("free", req=name, how="finish")
        self._burst(before, n)
        child = self._follow_up(name, blocks, jitter, "any")
        self._run("lookup", req=child)
        if not after_admission:
            self._burst(after, n)
        if self._chunk(child, 0) and after_admission:
            self._burst(after, n)
        self._tick()
        if blocks:
            self._prefill(child, 0, PREFILL_ROUNDS)
            self._tick()

    def _producers(self) -> list[str]:
        return self.session.in_phase("decoding")

    @when(lambda self: self._room() and bool(self._producers()))
    @rule(which=PICK, siblings=st.integers(2, 3), jitter=st.integers(1, 24), burst=BURSTS)
    def siblings_at_tail(self, which: int, siblings: int, jitter: int, burst: Burst) -> None:
        """Siblings at a live producer's tail: follow-ups of one decoding
        request arrive and are admitted in the same scheduler step, after a
        burst, while the producer keeps decoding."""
        producer = self._pick(self._producers(), which)
        children = [
            self._follow_up(producer, 0, jitter + i, "any")
            for i in range(min(siblings, MAX_LIVE - self._live()))
        ]
        self._burst(burst, 2)
        for child in children:
            self._chunk(child, 0)
        if producer not in self.session.allocated_since_drain:
            self._decode(producer, 0, 1)
        self._tick()

    def _resumable(self) -> list[str]:
        """Waiting follow-ups (whose lookup may hit a partial tail)."""
        session = self.session
        return [r for r in session.schedulable("waiting") if session.parent(r) is not None]

    @when(lambda self: bool(self._resumable()))
    @rule(which=PICK, drain_between=st.booleans(), readmit=st.booleans(), burst=BURSTS)
    def preempt_after_cow(
        self, which: int, drain_between: bool, readmit: bool, burst: Burst
    ) -> None:
        """A follow-up admitted at a partial-tail hit (its copy-on-write
        queued) and preempted in the same step, before or after the copy
        runs; then, after a burst, admitted again."""
        req = self._pick(self._resumable(), which)
        if not self._chunk(req, 0):
            return
        if drain_between:
            self._tick()
        self._run("free", req=req, how="preempt")
        self._tick()
        self._burst(burst, 2)
        if readmit:
            self._chunk(req, 0)
            self._tick()

    @when(lambda self: self._room() and bool(self.session.in_phase("running", "decoding")))
    @rule(which=PICK, jitter=st.integers(1, 24), release_first=st.booleans(), burst=BURSTS)
    def readmit_after_pop(self, which: int, jitter: int, release_first: bool, burst: Burst) -> None:
        """A running request is popped (its free deferred) and its follow-up
        is admitted while (or right after) the popped blocks are released."""
        req = self._pick(self.session.in_phase("running", "decoding"), which)
        self._run("pop", req=req)
        if release_first:
            self._run("release", req=req)
        child = self._follow_up(req, 0, jitter, "any")
        self._burst(burst, 2)
        self._chunk(child, 0)
        if not release_first:
            self._run("release", req=req)
        self._tick()


def machine_class(mode: Mode) -> type[ExploreMachine]:
    """The machine for `mode` (a subclass: Hypothesis runs classes)."""
    hold = "HoldOn" if mode.hold else "HoldOff"
    kind = "Differential" if mode.lockstep is not None else "Model"
    return type(f"Explore{kind}{hold}", (ExploreMachine,), {"mode": mode})
