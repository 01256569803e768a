"""The Z3 transition relation admits every step the model takes (no drift).

Hypothesis generates small configurations and scheduler-like op sequences;
each op runs on the executable model, both states are abstracted into the
Z3 vocabulary (`abstraction.observe`), and the op's transition must relate
them with every observed value fixed (ghosts carried along). Every abstract
state reached must also satisfy every proved property: the proofs are about
the machine the gate replays.

The runs keep the encoding's one assumption about traces: a waiting
request's `lookup` is followed by its `allocate` (the scheduler's
`get_computed_blocks` then `allocate_slots`), so no hit goes stale in
between.

Two generators: `configs` with random op mixes (the hold, the fork's
retention, eagle, sparse, dense and periodic retention), and
`knob_configs` with request lives (a producer, then siblings diverging
inside its prompt) under the align-mode knobs the encoding's
`more_partial_states` switch covers: prefill checkpoint blocks, the
shared-prefix checkpoint, periodic retention, the prefill threshold, and
(besides) lookahead block hashes and the `reset`, `events` and `stats` ops.
Fixed runs witness each knob's path (a test that could pass without
reaching it would prove nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from configs import hybrid_config
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from kvgate.conformance.writer import dump_trace
from kvgate.invariants.z3.abstraction import Drift, acting, bounds_of, observe
from kvgate.invariants.z3.vocabulary import RUNNING, Values
from kvgate.model.target import ModelTarget
from kvgate.vocabulary.config import Config, GroupConfig
from kvgate.vocabulary.ops import LIVE, Segment, Step
from kvgate.vocabulary.target import StepRefused

MAX_REQUESTS = 3
UNIT = 8


@st.composite
def configs(draw: st.DrawFn) -> Config:
    mamba = [32] + draw(st.sampled_from([[], [32], [16]]))  # one spec, two, two specs
    spec = draw(st.integers(0, 1))
    return Config(
        num_blocks=draw(st.sampled_from([8, 10])),  # few bounds: solvers are reused
        hash_unit=UNIT,
        groups=(
            GroupConfig("full_attention", draw(st.sampled_from([8, 16, 32, 32]))),
            *[GroupConfig("mamba_align", size, speculative_blocks=spec) for size in mamba],
        ),
        eagle=draw(st.booleans()),
        # Periodic retention (64) only changes which own blocks a chunk keys.
        retention_interval=draw(st.sampled_from([None, 0, 64])),
        hold=draw(st.sampled_from([True, True, False])),
        retain_retired=draw(st.booleans()),  # the production fork's retention
        scheduler_block_size=32,
        max_num_scheduled_tokens=draw(st.sampled_from([16, 32, 8192])),
        # Prefix caching off (the no-prefix-cache coordinator): no lookup
        # hits and no chunk keys anything, a sub-case of the encoding.
        prefix_caching=draw(st.sampled_from([True, True, True, False])),
    )


@dataclass(frozen=True)
class AbstractStep:
    op: str
    r: int | None
    pre: Values
    post: Values


def _with_ghosts(ghosts: Values, observed: Values) -> Values:
    """Every field: the observed values, the carried ghosts for the rest
    (`block_group` is partly observed, as `Drift.step` merges it)."""
    out = {name: dict(values) for name, values in ghosts.items()}
    for name, values in observed.items():
        out[name] = {**out.get(name, {}), **values}
    return out


@dataclass
class Run:
    config: Config
    model: ModelTarget = field(init=False)
    drift: Drift = field(init=False)
    names: dict[str, int] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)  # what the run exercised
    tails: dict[tuple[int, int], int] = field(default_factory=dict)  # keyed this life
    in_hypothesis: bool = True  # report what the run exercised as Hypothesis events
    # Each admitted step in the bounded vocabulary, ghosts included (as the
    # bounded transition that admitted it chose them).
    abstract_steps: list[AbstractStep] = field(default_factory=list)

    requests: int = MAX_REQUESTS  # the encoding's request slots

    def __post_init__(self) -> None:
        self.model = ModelTarget(self.config)
        self.bounds = bounds_of(self.config, self.requests)
        self.drift = Drift(self.bounds)

    def names_for(self, step: Step) -> dict[str, int]:
        if step.op == "arrive" and step.req is not None:
            self.names.setdefault(step.req, len(self.names))
        return self.names

    def apply(self, step: Step) -> dict[str, object] | None:
        """Run one op on the model and check it against the encoding;
        None if the driver refuses it (an op this state cannot take)."""
        names = self.names_for(step)
        before = observe(self.model, names, self.bounds)
        try:
            seen = self.model.apply(step)
        except StepRefused:
            return None
        self.steps.append(step)
        after = observe(self.model, names, self.bounds)
        ghosts = self.drift.ghosts
        verdict = self.drift.step(step.op, acting(step.op, step.req, names), before, after)
        self.abstract_steps.append(
            AbstractStep(
                step.op,
                acting(step.op, step.req, names),
                _with_ghosts(ghosts, before),
                _with_ghosts(self.drift.ghosts, after),
            )
        )
        assert not verdict.not_admitted, self.report(f"not admitted: {verdict.not_admitted}")
        assert not verdict.violated, self.report(f"properties violated: {verdict.violated}")
        moved = step.op in ("allocate", "decode1") and any(
            v and not after["pending_tail"][k] for k, v in before["pending_tail"].items()
        )
        for what, happened in (
            ("a tail moved", moved),
            ("a request holds a block", any(after["hold"].values())),
            (
                "a retired state is held",  # the fork's retention: a table block becomes a hold
                any(v and before["table"][k] for k, v in after["hold"].items()),
            ),
            ("a copy is pending", any(after["copy_ends"].values())),
            ("blocks are popped", any(after["popped"].values())),
            (
                # A sub-block state on a table block that no chunk moves: a
                # prefill checkpoint exported into its spare column.
                "a prefill checkpoint is keyed",
                any(
                    after["tail_keyed"][b] and after["table"][r, m, b] and not pending
                    for (r, m, b), pending in after["pending_tail"].items()
                ),
            ),
            (
                "the tail hold takes a retired checkpoint",
                not self.config.retain_retired
                and any(v and before["table"][k] for k, v in after["hold"].items()),
            ),
            ("two partial tails in one life", self._second_tail(before, after)),
            (
                "reset forgets the keys",
                step.op == "reset"
                and any(before["keyed"].values())
                and not any(after["keyed"].values()),
            ),
        ):
            if happened and what not in self.seen:
                self.seen.add(what)
                if self.in_hypothesis:
                    event(what)
        return seen

    def _second_tail(self, before: Values, after: Values) -> bool:
        """Whether a request keyed a second pending tail in one life (the
        shared-prefix junction's, then its prompt's)."""
        second = False
        for (r, m, b), pending in after["pending_tail"].items():
            if after["phase"][r] != RUNNING:
                self.tails.pop((r, m), None)
            elif pending and not before["pending_tail"][r, m, b]:
                self.tails[r, m] = self.tails.get((r, m), 0) + 1
                second = second or self.tails[r, m] >= 2
        return second

    def report(self, what: str) -> str:
        trace = dump_trace("drift", self.config, self.steps)
        return f"{what} at step {len(self.steps) - 1} of this run:\n{trace}"


def live(run: Run) -> list[str]:
    return [n for n, p in run.model.requests.items() if p.phase in LIVE]


def waiting(run: Run) -> list[str]:
    return [n for n, p in run.model.requests.items() if p.phase == "waiting"]


def running(run: Run) -> list[str]:
    """Requests with blocks: prefilling or decoding (the action table's phases)."""
    return [n for n, p in run.model.requests.items() if p.phase in ("running", "decoding")]


# Long stateful examples: no deadline, and no health check on their size.
DRIFT = settings(
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(DRIFT, max_examples=25)
@given(config=configs(), data=st.data())
def test_every_model_step_is_a_transition(config: Config, data: st.DataObject) -> None:
    run = Run(config)
    spec = config.groups[1].speculative_blocks
    for _ in range(data.draw(st.integers(6, 30), label="ops")):
        # Weighted toward requests making progress, so runs reach partial
        # tails, their moves, holds and follow-up turns.
        choices = ["arrive"] * 2 if len(run.model.requests) < MAX_REQUESTS else []
        choices += ["admit"] * 4 if waiting(run) else []
        choices += ["run"] * 6 + ["free", "pop"] if running(run) else []
        choices += ["release"] if run.model.popped else []
        choices += ["step", "drain", "drain", "evict"]
        kind = data.draw(st.sampled_from(choices), label="op")
        if kind == "arrive":
            name = f"R{len(run.model.requests)}"
            # Prompts the pool can hold: a few blocks each.
            fresh = Segment("fresh", count=data.draw(st.integers(1, 40)))
            earlier = list(run.model.requests)
            prompt: tuple[Segment, ...] = (fresh,)
            if earlier and data.draw(st.sampled_from([True, True, False])):
                base = data.draw(st.sampled_from(earlier))
                copied: Literal["all_of", "prompt_of"] = data.draw(
                    st.sampled_from(["all_of", "prompt_of"])
                )
                prompt = (Segment(copied, req=base), fresh)
            run.apply(Step("arrive", 0, req=name, prompt=prompt))
        elif kind == "admit":
            # The scheduler: look up, maybe count, then allocate at once.
            name = data.draw(st.sampled_from(waiting(run)))
            run.apply(Step("lookup", 0, req=name))
            if data.draw(st.booleans()):
                run.apply(Step("reserve", 0, req=name))
            run.apply(Step("allocate", 0, req=name, tokens="auto", lookahead=spec))
        elif kind == "run":
            name = data.draw(st.sampled_from(running(run)))
            request = run.model.requests[name].request
            if request.num_computed_tokens < request.num_tokens:
                run.apply(Step("allocate", 0, req=name, tokens="auto", lookahead=spec))
            else:
                run.apply(Step("decode1", 0, req=name, spec=data.draw(st.integers(0, spec))))
        elif kind in ("free", "pop"):
            name = data.draw(st.sampled_from(running(run) + waiting(run)))
            how = data.draw(st.sampled_from(["finish", "abort", "preempt"]))
            run.apply(Step(kind, 0, req=name, how=how if kind == "free" else None))
        elif kind == "release":
            run.apply(Step("release", 0, req=data.draw(st.sampled_from(list(run.model.popped)))))
        elif kind == "evict":
            free = run.model.num_free_blocks()
            blocks: int | Literal["all"] = data.draw(
                st.one_of(st.just("all"), st.integers(0, free))
            )
            run.apply(Step("evict", 0, blocks=blocks))
        else:
            run.apply(Step(kind, 0))


# -- the align-mode knobs ---------------------------------------------------------


# (prefill_checkpoint_blocks, prefill_checkpoint_alignment) as deployments
# set them (none: GDN on Triton; one at alignment 1: Mamba2 layers; one on
# a grid: GDN on FlashInfer, here two units), and two blocks.
CHECKPOINT_BLOCKS = [(0, None), (1, 1), (1, 2 * UNIT), (1, UNIT), (2, UNIT)]


@st.composite
def knob_configs(draw: st.DrawFn) -> Config:
    blocks, alignment = draw(st.sampled_from(CHECKPOINT_BLOCKS))
    mamba = [32] + draw(st.sampled_from([[], [], [32], [16]]))
    spec = draw(st.integers(0, 1))
    eagle = draw(st.sampled_from([True, True, False]))  # the junction needs eagle
    # Lookahead block hashes (an EAGLE/MTP drafter's): keys cover the next token.
    lookahead = draw(st.sampled_from([0, 0, 1])) if eagle else 0
    return Config(
        num_blocks=10,
        hash_unit=UNIT,
        groups=(
            GroupConfig("full_attention", draw(st.sampled_from([16, 32]))),
            *[
                GroupConfig(
                    "mamba_align",
                    size,
                    speculative_blocks=spec,
                    prefill_checkpoint_blocks=blocks,
                    prefill_checkpoint_alignment=alignment,
                )
                for size in mamba
            ],
        ),
        eagle=eagle,
        retention_interval=draw(st.sampled_from([None, 0, 64])),
        hold=draw(st.sampled_from([True, True, False])),
        retain_retired=draw(st.booleans()),
        scheduler_block_size=32,
        max_num_scheduled_tokens=draw(st.sampled_from([16, 32, 8192])),
        shared_prefix_checkpoint=draw(st.sampled_from([True, True, False])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 16, 40])),
        kv_events=draw(st.booleans()),
        kv_cache_metrics=draw(st.booleans()),
        hash_lookahead_tokens=lookahead,
    )


def produce(run: Run, name: str, prompt: tuple[Segment, ...], decodes: int) -> None:
    """A request's life up to `decodes` decodes: arrive, admit, prefill chunk
    by chunk (each step's copies drained), decode; it stops where the pool
    is short."""
    spec = run.config.groups[1].speculative_blocks
    run.apply(Step("arrive", 0, req=name, prompt=prompt))
    for _ in range(6 + decodes):
        pending = run.model.requests[name]
        if pending.phase not in LIVE:
            return
        request = pending.request
        if pending.phase == "waiting":
            run.apply(Step("lookup", 0, req=name))
            seen = run.apply(Step("allocate", 0, req=name, tokens="auto", lookahead=spec))
        elif request.num_computed_tokens < request.num_tokens:
            seen = run.apply(Step("allocate", 0, req=name, tokens="auto", lookahead=spec))
        elif decodes > 0:
            decodes -= 1
            seen = run.apply(Step("decode1", 0, req=name, spec=spec))
        else:
            return
        run.apply(Step("drain", 0))
        run.apply(Step("step", 0))
        if seen is not None and seen.get("ok") is False:
            return


@settings(DRIFT, max_examples=20)
@given(config=knob_configs(), data=st.data())
def test_every_knob_step_is_a_transition(config: Config, data: st.DataObject) -> None:
    run = Run(config)
    for i in range(MAX_REQUESTS):
        name, fresh = f"R{i}", Segment("fresh", count=data.draw(st.integers(1, 40)))
        prompt: tuple[Segment, ...] = (Segment("fresh", count=data.draw(st.integers(33, 64))),)
        if i > 0:
            base = run.model.requests[f"R{i - 1}"].request
            kind = data.draw(st.sampled_from(["sibling", "sibling", "all_of", "fresh"]))
            if kind == "sibling":  # diverges inside the base's prompt: a junction
                cut = data.draw(st.integers(1, base.num_prompt_tokens))
                prompt = (Segment("tokens", token_ids=tuple(base.prompt[:cut])), fresh)
            elif kind == "all_of":
                prompt = (Segment("all_of", req=f"R{i - 1}"), fresh)
            else:
                prompt = (fresh,)
        produce(run, name, prompt, data.draw(st.integers(0, 2)))
        for _ in range(data.draw(st.integers(0, 3))):
            kind = data.draw(
                st.sampled_from(
                    ["free", "pop", "release", "evict", "reset", "events", "stats", "residency"]
                )
            )
            if kind in ("free", "pop") and live(run):
                victim = data.draw(st.sampled_from(live(run)))
                how = data.draw(st.sampled_from(["finish", "abort", "preempt"]))
                run.apply(Step(kind, 0, req=victim, how=how if kind == "free" else None))
            elif kind == "release" and run.model.popped:
                run.apply(Step(kind, 0, req=data.draw(st.sampled_from(list(run.model.popped)))))
            elif kind == "evict":
                free = run.model.num_free_blocks()
                run.apply(Step(kind, 0, blocks=data.draw(st.integers(0, free))))
            elif kind in ("reset", "events", "stats", "residency"):
                run.apply(Step(kind, 0))


def witness_config(**fields: Any) -> Config:
    """The fixed witnesses' hybrid: 10 blocks, attention blocks of 16 at a
    unit of 8, Mamba blocks of 32, eagle on; `fields` set the rest."""
    return hybrid_config(
        GroupConfig("full_attention", 16),
        GroupConfig("mamba_align", 32),
        num_blocks=10,
        hash_unit=UNIT,
        eagle=True,
        **fields,
    )


def witness(config: Config) -> Run:
    return Run(config, in_hypothesis=False)


def test_a_retired_prefill_checkpoint_is_a_transition() -> None:
    """Mamba2-style checkpoint blocks (one, alignment 1): the prompt's
    checkpoint is exported mid-block into the spare column, and when that
    column leaves the table the tail hold takes it."""
    run = witness(
        Config(
            num_blocks=10,
            hash_unit=UNIT,
            groups=(
                GroupConfig("full_attention", 32),
                GroupConfig(
                    "mamba_align", 32, prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1
                ),
            ),
            eagle=False,
            retention_interval=None,
            hold=True,
            scheduler_block_size=32,
        )
    )
    produce(run, "R0", (Segment("fresh", count=50),), decodes=1)
    assert {"a prefill checkpoint is keyed", "the tail hold takes a retired checkpoint"} <= run.seen


def test_a_junction_and_a_tail_in_one_life_are_transitions() -> None:
    """The shared-prefix checkpoint: a sibling diverging at 40 keys its
    junction mid-block and moves it, then its own prompt's tail; then the
    pool, idle, is reset, and the events, stats and residency ops change
    nothing."""
    run = witness(
        witness_config(
            retention_interval=0,
            hold=True,
            shared_prefix_checkpoint=True,
            kv_events=True,
            kv_cache_metrics=True,
        )
    )
    produce(run, "R0", (Segment("fresh", count=64),), decodes=0)
    run.apply(Step("free", 0, req="R0", how="finish"))
    shared = tuple(run.model.requests["R0"].request.prompt[:40])
    produce(run, "R1", (Segment("tokens", token_ids=shared), Segment("fresh", count=20)), 0)
    assert "two partial tails in one life" in run.seen
    for op in ("events", "stats", "residency"):
        run.apply(Step(op, 0))
    run.apply(Step("free", 0, req="R1", how="finish"))
    run.apply(Step("drain", 0))
    run.apply(Step("reset", 0))
    assert "reset forgets the keys" in run.seen


def test_prefix_caching_off_runs_are_transitions() -> None:
    """Prefix caching off (the no-prefix-cache coordinator), the hold and the
    fork's retention switched on: a producer, then a sibling of its prompt
    that finds nothing, each step admitted, and nothing ever keyed or held."""
    run = witness(
        witness_config(
            retention_interval=None,
            hold=True,
            retain_retired=True,
            prefix_caching=False,
        )
    )
    produce(run, "R0", (Segment("fresh", count=50),), decodes=1)
    run.apply(Step("free", 0, req="R0", how="finish"))
    produce(run, "R1", (Segment("prompt_of", req="R0"), Segment("fresh", count=9)), decodes=1)
    assert run.model.requests["R1"].request.num_computed_tokens > 0
    state = observe(run.model, run.names, run.bounds)
    assert not any(state["keyed"].values()) and not any(state["hold"].values())
