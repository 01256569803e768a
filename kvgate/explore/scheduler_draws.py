"""What the Scheduler-level machine draws: an engine (the deployment family,
its config and the engine's settings, in `engines`, the one place a new
engine draw goes) and the engine's requests (`ArrivalDraw`, `ChunkDraw`), each
draw named for what it means and drawn with a strategy of its own.

Configs come from the deployment families the manager-level differential
exploration splits its budget over (`differential.FAMILIES`), hybrid ones
only (the Scheduler target runs a hybrid model), every other knob drawn, and
reduced to what a scheduler-level trace carries: no residency metrics (the
format has no ops for them yet), a KV connector whose loads never fail. The
KV-cache events the engine publishes (none, stores and removals, or with
lookups' hits too) and whether it logs stats are drawn with each engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import strategies as st

from kvgate.explore import knobs
from kvgate.explore.differential import FAMILIES
from kvgate.vocabulary.config import MODEL_RUNNERS, Config
from kvgate.vocabulary.scheduling import EngineSettings

# Every explored request's prompt and output fit in this (a multiple of
# every Mamba block the knobs draw, so it is also the Mamba block without
# prefix caching).
MAX_MODEL_LEN = 512
# Requests one example may send, and the drafts per step it may draw.
MAX_REQUESTS = 8
MAX_SPEC = 3
MAX_SEQS = 4
# How a request's prompt is drawn: new tokens, an earlier request's prompt
# and more (a shared prefix), or an earlier request's whole sequence and
# more, as the next turn of its conversation (`follows`).
SHAPES = ("fresh", "shared", "next_turn")
# New tokens an arrival draws at most (before the pool's room cuts them).
MAX_NEW_TOKENS = 96
MAX_OUTPUT = 24
# Where a request is when its client aborts it.
ABORT_PLACES = ("waiting", "prefill", "decode")
# The second tenant's cache salt (the first sends none).
OTHER_TENANT = "tenant-b"
# The images an arrival may carry, by id (the same id is the same image:
# image-k is always MAX_IMAGE * (k + 1) / (IMAGES + 1) tokens long), and the
# encoder budget and cache sizes drawn (0: the token budget), never below
# an image's length, below two images' often.
IMAGES = 3
MAX_IMAGE = 32
ENCODER_SIZES = (0, MAX_IMAGE, MAX_IMAGE + MAX_IMAGE // 2)
# The config switches no scheduler-level op reads, kept off, and a hybrid
# model always. A KV connector is drawn (each arrival's external hit is
# then drawn too), its loads never failing: an arrival cannot script a
# failure. KV-cache events are drawn with the engine, after the knobs.
ENGINE_ONLY = {
    "kv_events": False,
    "kv_cache_metrics": False,
    "pure_mamba": False,
    "kv_load_failure_policy": "recompute",
}
# The KV-cache events an engine publishes: none, the cache's stores and
# removals, or with every lookup's hits too (`kv_events_full`).
KV_EVENTS = ("off", "on", "full")
# The scheduling policies; the scheduler model follows priority without a
# KV connector, lookahead hashes or async scheduling (fcfs there).
POLICIES = ("fcfs", "priority")
# A request's priority under the priority policy (lower runs first).
PRIORITIES = (0, 1, 2)
# A drafter with lookahead hashes has one MTP module (or is EAGLE), or K
# modules: it then drafts, hashes and reads ahead K tokens.
MTP_MODULES = (1, 2, MAX_SPEC)
# The prefill cadence (1: none), where it is modelled.
PREFILL_INTERVALS = (1, 2, 3)
# A connector's hit, in quarters of the prompt (0: none, 4: the whole of it),
# and the worker's delay of an asynchronous load, in engine steps.
REMOTE_QUARTERS = 4
MAX_REMOTE_DELAY = 2
# The LoRA adapter limits drawn with each engine (0: no LoRA config, the
# others below the adapters arrivals draw from, so the limit holds some
# back), and those adapters by name.
MAX_LORAS = (0, 1, 2)
ADAPTERS = ("adapter-1", "adapter-2", "adapter-3")
# A streaming-input session's next chunk: new tokens in multiples of this,
# up to MAX_CHUNK of them, and up to MAX_CHUNK_OUTPUT output tokens.
CHUNK_UNIT = 8
MAX_CHUNK = 6
MAX_CHUNK_OUTPUT = 6
# The engine steps one `step` rule runs at most.
MAX_STEPS = 6

# The hybrid deployment families (a pure Mamba model is another model than
# the Scheduler target's), by a short name for the summary.
HYBRID_FAMILIES: tuple[dict[str, Any], ...] = tuple(f for f in FAMILIES if not f.get("pure_mamba"))


def family_name(family: dict[str, Any]) -> str:
    """A deployment family as the summary names it."""
    if not family.get("prefix_caching", True):
        return "prefix caching off"
    lookahead = family.get("hash_lookahead_tokens", 0)
    drafter = (
        "no drafter"
        if not family.get("eagle")
        else f"multi-module MTP drafter, lookahead hashes of {lookahead} tokens"
        if lookahead > 1
        else "drafter, lookahead hashes"
        if lookahead
        else "drafter, block drop"
    )
    checkpoint = family.get("prefill_checkpoint", (0, None))[0]
    shapes = (
        "prefill checkpoints (Mamba2)" if checkpoint else "no prefill checkpoint (GDN on Triton)"
    )
    return f"{drafter}; {shapes}"


# The features the Scheduler's own KV paths branch on, each on in half the
# examples (swarm drawing would turn each on in about a quarter): a KV
# connector (its external hits go through the Scheduler's admission and
# stats), the shared-prefix checkpoint (the junction the Scheduler records at
# a lookup and splits at).
SCHEDULER_FEATURES = st.fixed_dictionaries(
    {"kv_connector": st.sampled_from(("off", "on")), "shared_prefix_checkpoint": st.booleans()}
)


def engine_configs(family: dict[str, Any]) -> st.SearchStrategy[Config]:
    """The family's configs, the Scheduler's features drawn, every other knob
    drawn by swarm, as the Scheduler target runs them."""
    return SCHEDULER_FEATURES.flatmap(
        lambda features: knobs.configs(stratum={**family, **ENGINE_ONLY, **features})
    ).map(engine_config)


def engine_config(config: Config) -> Config:
    """`config` at `MAX_MODEL_LEN`; without prefix caching, the Mamba block
    (and so the scheduler block) `MAX_MODEL_LEN` long, as vLLM's engine
    resolves mode `none`."""
    config = replace(config, max_model_len=MAX_MODEL_LEN)
    if config.prefix_caching:
        return config
    groups = tuple(
        replace(g, block_size=MAX_MODEL_LEN) if g.kind == "mamba_align" else g
        for g in config.groups
    )
    return replace(config, groups=groups, scheduler_block_size=MAX_MODEL_LEN)


def request_cap(config: Config, spec: int) -> int:
    """The longest sequence (prompt and output) a request is drawn with: one
    that fits the pool alone with room to spare (kvgate's model stops on a
    request that outgrows the pool: it would preempt itself for ever), and
    long enough that a few together press on the pool."""
    attention = min(g.block_size for g in config.groups if g.kind == "full_attention")
    mamba_blocks = sum(
        3 + g.speculative_blocks + g.prefill_checkpoint_blocks
        for g in config.groups
        if g.kind == "mamba_align"
    )
    blocks = config.num_blocks - 1 - mamba_blocks - math.ceil(spec / attention) - 2
    return max(0, min(config.max_model_len, blocks * attention * 3 // 4))


@dataclass(frozen=True)
class Engine:
    """An engine drawn: its deployment family, its config (the hold arm not
    yet applied) and its settings (drafts per step, running requests)."""

    family: dict[str, Any]
    config: Config
    settings: EngineSettings

    @property
    def by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"


def priority_followed(config: Config) -> bool:
    """The scheduler model follows the priority policy in `config`."""
    return not (config.hash_lookahead_tokens or config.kv_connector or config.async_scheduling)


@st.composite
def engines(draw: st.DrawFn) -> Engine:
    """An engine: a hybrid family's config, every engine setting drawn by
    name, then reconciled with what the scheduler model follows. A new
    engine draw goes here, after the others (so the earlier draws, and the
    examples a seed gives, change as little as can be)."""
    family = draw(st.sampled_from(HYBRID_FAMILIES))
    config = draw(engine_configs(family))
    spec = draw(st.integers(0, MAX_SPEC))
    # Several running at once (pool pressure, preemption order) first.
    max_num_seqs = draw(st.sampled_from(tuple(range(MAX_SEQS, 0, -1))))
    # The engine's model runner: what the Scheduler hands the worker
    # differs; the manager's calls must not.
    model_runner = draw(st.sampled_from(MODEL_RUNNERS))
    # Two batches in flight, recent vLLM's default.
    async_scheduling = draw(st.booleans())
    prefill_interval = draw(st.sampled_from(PREFILL_INTERVALS))
    mtp_modules = draw(st.sampled_from(MTP_MODULES))
    policy = draw(st.sampled_from(POLICIES))
    # The encoder budget and cache of the arrivals that carry images.
    encoder_budget = draw(st.sampled_from(ENCODER_SIZES))
    encoder_cache = draw(st.sampled_from(ENCODER_SIZES))
    max_loras = draw(st.sampled_from(MAX_LORAS))
    kv_events = draw(st.sampled_from(KV_EVENTS))
    disable_log_stats = draw(st.booleans())

    if config.hash_lookahead_tokens and mtp_modules > 1:
        config = replace(config, hash_lookahead_tokens=mtp_modules)
        family = {**family, "hash_lookahead_tokens": mtp_modules}
        spec = mtp_modules
    elif config.hash_lookahead_tokens > 1:
        # One MTP module per draft (the knobs drew the modules): vLLM reads
        # ahead as many tokens as it drafts, so it drafts one per module.
        spec = config.hash_lookahead_tokens
    if config.kv_connector or async_scheduling:
        prefill_interval = 1
    config = replace(
        config,
        model_runner=model_runner,
        async_scheduling=async_scheduling,
        prefill_schedule_interval=prefill_interval,
        encoder_compute_budget=encoder_budget,
        encoder_cache_size=encoder_cache,
        kv_events=kv_events != "off",
        kv_events_full=kv_events == "full",
        disable_log_stats=disable_log_stats,
        max_loras=max_loras,
    )
    followed = policy == "priority" and priority_followed(config)
    config = replace(config, scheduling_policy="priority" if followed else "fcfs")
    if config.eagle:
        spec = max(spec, 1)  # the eagle drop is for a drafter's blocks
    elif async_scheduling:
        spec = 0  # drafts come from a drafter
    return Engine(family, config, EngineSettings(spec, max_num_seqs))


# How the model runner takes the drafts of a step's decodes: it rejects
# them all, accepts them all, or accepts a drawn number of each decode's.
ACCEPTANCE = ("none", "all", "mixed")


@dataclass(frozen=True)
class AcceptanceDraw:
    """The drafts the model runner accepts in the batches a `step` rule
    schedules: `pattern` one of ACCEPTANCE; under `mixed`, the k-th decode
    with drafts (counted over the rule's steps) accepts `counts[k % len]`
    of them, at most as many as it has (0: none)."""

    pattern: str
    counts: tuple[int, ...]

    def accepted(self, drafts: int, k: int) -> int:
        """Of a decode's `drafts`, the k-th of the rule's, those accepted."""
        if self.pattern == "none":
            return 0
        if self.pattern == "all":
            return drafts
        return min(drafts, self.counts[k % len(self.counts)])


ACCEPTANCES: st.SearchStrategy[AcceptanceDraw] = st.builds(
    AcceptanceDraw,
    pattern=st.sampled_from(ACCEPTANCE),
    counts=st.lists(st.integers(0, MAX_SPEC), min_size=1, max_size=4).map(tuple),
)


@dataclass(frozen=True)
class RemoteDraw:
    """What a KV connector's store holds of a new request's prompt, drawn
    with every arrival (used only with a connector)."""

    quarters: int  # of the prompt; 0: nothing
    load_async: bool
    delay: int  # the worker's delay of an asynchronous load, in engine steps
    fails: bool  # an asynchronous load fails


@dataclass(frozen=True)
class ArrivalDraw:
    """A request arriving, as drawn."""

    shape: str  # one of SHAPES
    earlier: int  # which earlier request a shared prefix or a next turn builds on
    new_tokens: int
    max_tokens: int
    other_tenant: bool  # the other tenant's cache salt, or its conversation's tenant's
    remote: RemoteDraw
    streaming: bool  # a streaming-input session (where the model follows one)
    priority: int  # under the priority policy
    image: int  # which image among the new tokens (0: none)
    image_quarter: int  # where it begins, in quarters of the new tokens
    adapter: int  # the LoRA adapter under a LoRA config (see `SchedulerMachine.adapter`)


ARRIVALS: st.SearchStrategy[ArrivalDraw] = st.builds(
    ArrivalDraw,
    shape=st.sampled_from(SHAPES),
    earlier=st.integers(0, MAX_REQUESTS - 1),
    new_tokens=st.integers(0, MAX_NEW_TOKENS),
    max_tokens=st.integers(1, MAX_OUTPUT),
    other_tenant=st.booleans(),
    remote=st.builds(
        RemoteDraw,
        quarters=st.integers(0, REMOTE_QUARTERS),
        load_async=st.booleans(),
        delay=st.integers(0, MAX_REMOTE_DELAY),
        fails=st.booleans(),
    ),
    streaming=st.booleans(),
    priority=st.sampled_from(PRIORITIES),
    image=st.integers(0, IMAGES),
    image_quarter=st.integers(0, 3),
    adapter=st.integers(0, len(ADAPTERS)),
)


@dataclass(frozen=True)
class ChunkDraw:
    """A streaming-input session's next input, as drawn: its end, or a
    chunk of `units` x CHUNK_UNIT new tokens and `max_tokens` output."""

    end: bool
    units: int
    max_tokens: int


CHUNKS: st.SearchStrategy[ChunkDraw] = st.builds(
    ChunkDraw,
    # A session ends at one draw in four (it shrinks to going on).
    end=st.sampled_from((False, False, False, True)),
    units=st.integers(1, MAX_CHUNK),
    max_tokens=st.integers(1, MAX_CHUNK_OUTPUT),
)
