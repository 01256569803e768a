"""Exploration at the Scheduler level: engine steps, kvgate's scheduler model
and vLLM's real `Scheduler` in strict lockstep.

The manager-level machine (`machine.py`) issues manager calls as kvgate's
model of the Scheduler would; this one plays the engine instead: requests
arrive (fresh prompts, prompts sharing an earlier request's prompt, follow-up
turns extending an earlier request's whole sequence; with a cache salt or
not; some carrying images, under an encoder budget and cache drawn with the
engine; under the priority policy, drawn with some engines, with a priority;
streaming-input sessions, which later get their next input chunk or
their end), the engine steps, clients abort requests waiting, mid-prefill or
mid-decode, and the prefix cache is reset with or without preempting the
running requests. Every step goes through the scheduler-level lockstep the
gate replays traces with (`conformance.scheduler_replay.SchedulerLockstep`),
so what it compares is what the gate compares, and every history is a
scheduler-level trace: the first divergence is shrunk by Hypothesis and saved
as one, which `kvgate replay FILE --target vllm` shows diverging.

Configs come from the deployment families the manager-level differential
exploration splits its budget over (`differential.FAMILIES`), hybrid ones
only (the Scheduler target runs a hybrid model), every other knob drawn, and
reduced to what a scheduler-level trace carries: no residency metrics (the
format has no ops for them yet), a KV connector whose loads never fail. The
KV-cache events the engine publishes (none, stores and removals, or with
lookups' hits too) and whether it logs stats are drawn with each engine.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, NoReturn

from hypothesis import reject
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.internal.conjecture.data import Status
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    precondition,
    rule,
)

from kvgate.conformance.replay import Divergence, ModelBug
from kvgate.conformance.scheduler_replay import SchedulerLockstep, model_config
from kvgate.conformance.trace import Trace, TraceError
from kvgate.conformance.writer import dump_engine_trace, engine_step_dicts, save_engine_trace
from kvgate.explore import knobs
from kvgate.explore.differential import FAMILIES, HOLD_OVERLAY
from kvgate.explore.profiles import draws_from_the_seed_alone
from kvgate.explore.runner import RunOutcome
from kvgate.model.scheduler import SchedulerModel
from kvgate.model.scheduler_state import LiveRequest, SchedulerStuck
from kvgate.targets import scheduler_factories
from kvgate.vocabulary.config import MODEL_RUNNERS, Config, ModelRunner, UnsupportedConfig
from kvgate.vocabulary.ops import Segment
from kvgate.vocabulary.scheduling import (
    EngineSettings,
    EngineStep,
    RemoteHit,
    SchedulerTarget,
)
from kvgate.vocabulary.tokens import MmItem

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
# failure. KV-cache events are drawn with the engine (`TELEMETRY`), after
# the knobs.
ENGINE_ONLY = {
    "kv_events": False,
    "kv_cache_metrics": False,
    "pure_mamba": False,
    "kv_load_failure_policy": "recompute",
}
# The engine's telemetry: the KV-cache events it publishes (none, the
# cache's stores and removals, or with every lookup's hits too,
# `kv_events_full`), and whether it logs stats (off: `disable_log_stats`).
TELEMETRY: tuple[tuple[str, bool], ...] = (
    ("off", False),
    ("on", False),
    ("full", False),
    ("on", True),
    ("off", True),
)
# A connector's hit, in quarters of the prompt (0: none, 4: the whole of it).
REMOTE_QUARTERS = 4
# The LoRA adapter limits drawn with each engine (0: no LoRA config, the
# others below the adapters arrivals draw from, so the limit holds some
# back), and those adapters by name.
MAX_LORAS = (0, 1, 2)
ADAPTERS = ("adapter-1", "adapter-2", "adapter-3")

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


@dataclass(frozen=True)
class SchedulerMode:
    """The arm explored: vLLM's Scheduler as installed (hold off), or with
    kvgate's hold overlay (hold on; `retire`: the fork's retention too)."""

    hold: bool = False
    retain_retired: bool = False

    @property
    def plugin(self) -> str | None:
        return HOLD_OVERLAY if self.hold or self.retain_retired else None

    def replay_command(self, path: Path) -> str:
        plugin = f" --plugin {self.plugin}" if self.plugin else ""
        return f"kvgate replay {path} --target vllm{plugin}"


@dataclass
class SchedulerStats:
    """What one run exercised."""

    examples: int = 0
    # Examples dropped part-way (refused, or past Hypothesis's buffer), and
    # the runs while Hypothesis shrinks a failure: not among `examples`.
    discarded: int = 0
    shrinking: int = 0
    engine_steps: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    families: Counter[str] = field(default_factory=Counter)
    # Configs or requests the real Scheduler refused (examples dropped), by field.
    refused: Counter[str] = field(default_factory=Counter)
    preemptions: int = 0
    first_failure: float | None = None
    started: float = field(default_factory=time.perf_counter)


class SchedulerExploreFailure(AssertionError):
    """The lockstep diverged (or the model raised) after `events`."""

    def __init__(
        self,
        kind: str,
        message: str,
        config: Config,
        settings: EngineSettings,
        events: list[EngineStep],
        mode: SchedulerMode,
    ) -> None:
        self.kind = kind
        self.message = message
        self.config = config
        self.settings = settings
        self.events = tuple(events)  # the diverging one last
        self.mode = mode
        super().__init__(f"{kind}: {message}")

    def __str__(self) -> str:
        # Built on demand: Hypothesis raises many of these while it shrinks.
        return f"{self.kind} after {len(self.events)} engine entries: {self.message}\n" + (
            "\n".join(self.runnable())
        )

    @property
    def name(self) -> str:
        body = dump_engine_trace("explore", self.config, self.settings, self.events)
        return f"explore-sched-{hashlib.blake2b(body.encode(), digest_size=4).hexdigest()}"

    def about(self) -> str:
        hold = "on" if self.config.hold else "off"
        return (
            f"Found by kvgate explore --scope scheduler (hold {hold}) against vLLM's "
            f"Scheduler: {self.kind}: {self.message}"
        )

    def yaml(self) -> str:
        return dump_engine_trace(self.name, self.config, self.settings, self.events, self.about())

    def save(self, directory: Path) -> Path:
        return save_engine_trace(
            directory, self.name, self.config, self.settings, self.events, self.about()
        )

    def runnable(self) -> list[str]:
        """The history as the trace's engine entries, one a line, in order."""
        body = dump_engine_trace("x", self.config, self.settings, self.events)
        return body[body.index("engine:") :].rstrip("\n").splitlines()

    def entries(self) -> int:
        return len(engine_step_dicts(self.events))


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


class SchedulerMachine(RuleBasedStateMachine):
    """Engine steps on kvgate's scheduler model and vLLM's `Scheduler`."""

    mode: ClassVar[SchedulerMode]
    stats: ClassVar[SchedulerStats]

    def __init__(self) -> None:
        super().__init__()
        self.events: list[EngineStep] = []
        self.names: list[str] = []
        self.salts: dict[str, str] = {}
        self.adapters: dict[str, str] = {}
        # Streaming-input sessions not yet ended.
        self.sessions: set[str] = set()
        self.real: SchedulerTarget | None = None
        self.model: SchedulerModel | None = None
        self.lockstep: SchedulerLockstep | None = None
        self.config: Config | None = None
        self.settings = EngineSettings()
        self.cap = 0
        # Dropped (refused by a side, or drawn past Hypothesis's buffer): not
        # counted among the examples `--budget` asks for, as Hypothesis does not.
        self.dropped = False
        self.failing = False

    def _drop(self, field: str) -> NoReturn:
        """Drop this example: a config or request a side refused, by field."""
        self.stats.refused[field] += 1
        self.dropped = True
        reject()

    # -- setup ----------------------------------------------------------------

    @initialize(
        drawn=st.sampled_from(HYBRID_FAMILIES).flatmap(
            lambda family: st.tuples(st.just(family), engine_configs(family))
        ),
        spec=st.integers(0, MAX_SPEC),
        # Several running at once (pool pressure, preemption order) first.
        max_num_seqs=st.sampled_from(tuple(range(MAX_SEQS, 0, -1))),
        # The engine's model runner: what the Scheduler hands the worker
        # differs; the manager's calls must not.
        model_runner=st.sampled_from(MODEL_RUNNERS),
        # Async scheduling (two batches in flight), recent vLLM's default.
        async_scheduling=st.booleans(),
        # The prefill cadence (1: none), where it is modelled.
        prefill_interval=st.sampled_from((1, 2, 3)),
        # A drafter with lookahead hashes has one MTP module (or is EAGLE),
        # or K modules: it then drafts, hashes and reads ahead K tokens.
        # Without lookahead hashes the draw picks the scheduling policy
        # instead (the largest: priority), so the draws stay as they were.
        mtp_modules=st.sampled_from((1, 2, MAX_SPEC)),
        # Drawn last, so the draws before it stay as they were: the encoder
        # budget and cache of the arrivals that carry images.
        encoder=st.tuples(st.sampled_from(ENCODER_SIZES), st.sampled_from(ENCODER_SIZES)),
        # After it, for the same reason: the LoRA adapter limit (0: no LoRA
        # config), then the engine's telemetry, the KV-cache events it
        # publishes (off, on, or with lookups' hits too) and whether it logs
        # stats.
        max_loras=st.sampled_from(MAX_LORAS),
        telemetry=st.sampled_from(TELEMETRY),
    )
    def start(
        self,
        drawn: tuple[dict[str, Any], Config],
        spec: int,
        max_num_seqs: int,
        model_runner: ModelRunner,
        async_scheduling: bool,
        prefill_interval: int,
        mtp_modules: int,
        encoder: tuple[int, int] = (0, 0),
        max_loras: int = 0,
        telemetry: tuple[str, bool] = ("off", False),
    ) -> None:
        family, config = drawn
        if config.hash_lookahead_tokens and mtp_modules > 1:
            config = replace(config, hash_lookahead_tokens=mtp_modules)
            family = {**family, "hash_lookahead_tokens": mtp_modules}
            spec = mtp_modules
        if async_scheduling and config.eagle:
            async_scheduling = False  # the scheduler model runs it without drafts
        if config.kv_connector or async_scheduling:
            prefill_interval = 1
        # The priority policy where the scheduler model follows it.
        by_priority = mtp_modules == MAX_SPEC and not (
            config.hash_lookahead_tokens or config.kv_connector or async_scheduling
        )
        config = replace(
            config,
            hold=self.mode.hold,
            retain_retired=self.mode.retain_retired,
            model_runner=model_runner,
            async_scheduling=async_scheduling,
            prefill_schedule_interval=prefill_interval,
            scheduling_policy="priority" if by_priority else "fcfs",
            encoder_compute_budget=encoder[0],
            encoder_cache_size=encoder[1],
            kv_events=telemetry[0] != "off",
            kv_events_full=telemetry[0] == "full",
            disable_log_stats=telemetry[1],
            max_loras=max_loras,
        )
        if config.eagle:
            spec = max(spec, 1)  # the eagle drop is for a drafter's blocks
        if async_scheduling:
            spec = 0
        self.settings = EngineSettings(spec, max_num_seqs)
        self.cap = request_cap(config, spec)
        if self.cap < 2:
            self._drop("num_blocks")
        model_factory, real_factory = scheduler_factories("vllm", self.mode.plugin)
        assert real_factory is not None
        try:
            self.real = real_factory(config, spec, max_num_seqs)
        except UnsupportedConfig as error:
            self._drop(error.field)
        trace = Trace(
            name="explore",
            about="",
            config=config,
            steps=(),
            primitives=(),
            path=Path("<explored>"),
            engine=(),
            scheduler=self.settings,
        )
        modelled, _ = model_config(trace, self.real.capabilities)
        try:
            model = model_factory(modelled, spec, max_num_seqs)
        except UnsupportedConfig as error:
            self._drop(error.field)
        assert isinstance(model, SchedulerModel)
        self.model = model
        self.config = config
        self.lockstep = SchedulerLockstep(trace, model, self.real, "strict")
        self.stats.families[family_name(family)] += 1
        if config.async_scheduling:
            self.stats.ops["engine:async"] += 1
        if by_priority:
            self.stats.ops["engine:priority"] += 1
        if config.kv_events:
            self.stats.ops[f"engine:kv_events:{telemetry[0]}"] += 1
        if config.disable_log_stats:
            self.stats.ops["engine:stats_off"] += 1
        if max_loras:
            self.stats.ops[f"engine:max_loras:{max_loras}"] += 1

    def teardown(self) -> None:
        # Counted as the manager's exploration counts (kvgate/explore/rules.py).
        if self.stats.first_failure is not None and not self.failing:
            self.stats.shrinking += 1
        elif self.dropped or current_build_context().data.status in (
            Status.OVERRUN,
            Status.INVALID,
        ):
            self.stats.discarded += 1
        else:
            self.stats.examples += 1
        if self.model is not None:
            self.stats.preemptions += sum(
                r.request.num_preemptions for r in self.model.oracle.requests.values()
            )
        if self.real is not None:
            self.real.close()

    # -- the engine's side ----------------------------------------------------

    def live(self) -> list[str]:
        """Requests arrived and not yet finished or aborted, in arrival order."""
        assert self.model is not None
        queued = {r.name for r in (*self.model.running, *self.model.waiting, *self.model.holding)}
        return [name for name in self.names if name in queued]

    def sequence_length(self, name: str, whole: bool) -> int:
        assert self.model is not None
        request = self.model.oracle.requests[name].request
        return len(request.all_token_ids) if whole else request.num_prompt_tokens

    def apply(self, event: EngineStep) -> None:
        assert self.lockstep is not None and self.config is not None
        assert self.model is not None
        event = replace(event, index=len(self.events))
        self.events.append(event)
        manager = self.model.oracle.manager
        refused_before = manager.external_admissions_refused
        try:
            divergence = self.lockstep.apply(event)
        except TraceError as error:
            # A request the real Scheduler refused: not one the machine
            # means to draw; counted and dropped.
            self._drop(error.field or "request")
        except ModelBug as bug:
            if isinstance(bug.__cause__, SchedulerStuck):
                self._drop("stuck")
            self.fail("crash", str(bug))
        if divergence is not None and is_exact_fit_defect(
            divergence, manager.external_admissions_refused > refused_before
        ):
            # A vLLM defect found already (docs/explanation/blind-spots.md):
            # counted and dropped, so a run explores past it.
            self._drop(KNOWN_DEFECT)
        if divergence is not None:
            self.fail("divergence", describe(divergence))

    def fail(self, kind: str, message: str) -> None:
        assert self.config is not None
        if self.stats.first_failure is None:
            self.failing = True
            self.stats.first_failure = time.perf_counter() - self.stats.started
        raise SchedulerExploreFailure(
            kind, message, self.config, self.settings, self.events, self.mode
        )

    @precondition(lambda self: self.lockstep is not None and len(self.names) < MAX_REQUESTS)
    @rule(
        shape=st.sampled_from(SHAPES),
        pick=st.integers(0, MAX_REQUESTS - 1),
        fresh=st.integers(0, 96),
        max_tokens=st.integers(1, 24),
        other_tenant=st.booleans(),
        remote=st.tuples(
            st.integers(0, REMOTE_QUARTERS), st.booleans(), st.integers(0, 2), st.booleans()
        ),
        # Drawn last: an image among the new tokens (0: none), and where.
        image=st.tuples(st.integers(0, IMAGES), st.integers(0, 3)),
        # Drawn after it: the request's LoRA adapter under a LoRA config
        # (see `adapter`).
        adapter=st.integers(0, len(ADAPTERS)),
    )
    def arrive(
        self,
        shape: str,
        pick: int,
        fresh: int,
        max_tokens: int,
        other_tenant: bool,
        remote: tuple[int, bool, int, bool],
        image: tuple[int, int] = (0, 0),
        adapter: int = 0,
    ) -> None:
        name = f"R{len(self.names)}"
        assert self.config is not None
        # Under async scheduling the scheduler model runs prefills in flight,
        # not decodes past an output still being sampled.
        max_tokens = 1 if self.config.async_scheduling else min(max_tokens, self.cap - 1)
        room = self.cap - max_tokens
        if not self.names:
            shape = "fresh"
        base: str | None = None
        base_length = 0
        if shape != "fresh":
            # A next turn prefers a conversation whose last turn finished.
            live = set(self.live())
            pool = [n for n in self.names if n not in live] if shape == "next_turn" else []
            pool = pool or self.names
            base = pool[pick % len(pool)]
            base_length = self.sequence_length(base, whole=shape == "next_turn")
            if base_length >= room:
                shape, base, base_length = "fresh", None, 0
        fresh = min(fresh, room - base_length)
        prompt: tuple[Segment, ...] = ()
        follows = None
        if base is not None:
            turn = shape == "next_turn"
            prompt = (Segment("all_of" if turn else "prompt_of", req=base),)
            follows = base if shape == "next_turn" else None
        if fresh or not prompt:
            prompt = (*prompt, Segment("fresh", count=max(fresh, 1)))
        # A conversation keeps its tenant unless drawn otherwise.
        salt = self.salts.get(base, "") if base is not None else ""
        if other_tenant:
            salt = OTHER_TENANT if salt == "" else ""
        self.names.append(name)
        self.salts[name] = salt
        self.stats.ops[f"arrive:{shape}"] += 1
        if salt:
            self.stats.ops["arrive:salted"] += 1
        # Without a KV connector the connector's draws are free: its
        # asynchronous-load flag makes the request a streaming-input session
        # (so the draws stay as they were).
        resumable = remote[1] and not self.config.kv_connector and self.takes_sessions()
        if resumable:
            self.sessions.add(name)
            self.stats.ops["arrive:session"] += 1
        # Under the priority policy (never with a connector) the worker's
        # delay draw is the request's priority.
        priority = remote[2] if self.config.scheduling_policy == "priority" else 0
        if priority:
            self.stats.ops[f"arrive:priority:{priority}"] += 1
        lora = self.adapter(base, adapter)
        self.adapters[name] = lora
        if lora:
            self.stats.ops["arrive:lora"] += 1
        self.apply(
            EngineStep(
                "arrive",
                0,
                req=name,
                prompt=prompt,
                max_tokens=max_tokens,
                cache_salt=salt,
                lora=lora,
                follows=follows,
                remote=self.remote_hit(base_length + max(fresh, 1 if base is None else 0), remote),
                mm=self.image(base_length, fresh, image, resumable),
                resumable=resumable,
                priority=priority,
            )
        )

    def adapter(self, base: str | None, drawn: int) -> str:
        """An arrival's LoRA adapter under a LoRA config ("" without one):
        none when `drawn` is its largest; for 0, its conversation's adapter
        if it has one; otherwise one counted from `drawn` and the arrival's
        number, so arrivals drawing alike still bring different adapters,
        which the limit then holds back."""
        assert self.config is not None
        if not self.config.max_loras or drawn == len(ADAPTERS):
            return ""
        inherited = self.adapters.get(base, "") if base is not None else ""
        if drawn == 0 and inherited:
            return inherited
        return ADAPTERS[(drawn + len(self.names)) % len(ADAPTERS)]

    def image(
        self, start: int, fresh: int, drawn: tuple[int, int], session: bool
    ) -> tuple[MmItem, ...]:
        """The images an arrival carries among its `fresh` new tokens, which
        begin at `start` (`drawn`: which image, 0 for none, and where it
        begins, in quarters of the new tokens; at the first token, the next
        image follows it, so one chunk needs both); none where the encoder
        is not modelled (async scheduling, a streaming-input `session`), and
        only those that fit."""
        assert self.config is not None
        which, quarter = drawn
        config = self.config
        if not which or session or config.async_scheduling:
            return ()
        items: list[MmItem] = []
        offset = start + fresh * quarter // 4
        for image in (which, which % IMAGES + 1) if quarter == 0 else (which,):
            length = MAX_IMAGE * (image + 1) // (IMAGES + 1)
            if offset + length > start + fresh:
                break
            items.append(MmItem(offset, length, f"image-{image}"))
            offset += length + 1
        self.stats.ops["arrive:image"] += bool(items)
        self.stats.ops["arrive:images"] += len(items) > 1
        return tuple(items)

    def takes_sessions(self) -> bool:
        """The config is one the scheduler model follows a streaming-input
        session in (the reader refuses the others by name)."""
        assert self.config is not None
        config = self.config
        return not (
            config.async_scheduling or config.kv_connector or config.scheduling_policy == "priority"
        )

    def open_sessions(self) -> list[str]:
        return [name for name in self.live() if name in self.sessions]

    def send_chunks(self, steps: int, stop: str | None) -> None:
        """Before a `step` rule's steps, the engine's side of each open
        session, from that rule's own draws (so the draws stay as they were):
        a paused session gets its next chunk (8 x `steps` tokens, `steps`
        output tokens), or its end when `steps` is 6 or the chunk would not
        fit; a running one with nothing queued gets a chunk queued when
        `stop` names it or `steps` is 1, or its end queued when `steps` is 5."""
        assert self.model is not None
        for name in self.open_sessions():
            live = self.session(name)
            queue = not live.waiting_for_streaming_req and not live.chunks
            if queue and not (name == stop or steps in (1, 5)):
                continue
            if not (live.waiting_for_streaming_req or queue):
                continue
            # At its stop the session holds at most its prompt and output.
            room = self.cap - live.request.num_prompt_tokens - live.max_tokens
            fresh = 8 * steps
            if steps == (5 if queue else 6) or fresh + steps > room:
                self.stats.ops["chunk:end"] += 1
                self.sessions.discard(name)
                self.apply(EngineStep("chunk", 0, req=name, end=True))
                continue
            self.stats.ops["chunk:queued" if queue else "chunk:paused"] += 1
            prompt = (Segment("fresh", count=fresh),)
            self.apply(EngineStep("chunk", 0, req=name, prompt=prompt, max_tokens=steps))

    def session(self, name: str) -> LiveRequest:
        assert self.model is not None
        model = self.model
        [live] = [r for r in (*model.running, *model.waiting, *model.holding) if r.name == name]
        return live

    def remote_hit(self, prompt: int, drawn: tuple[int, bool, int, bool]) -> RemoteHit | None:
        """With a KV connector: what its store holds of a new request's prompt
        (`drawn`: quarters of the prompt, whether the load is asynchronous,
        the worker's delay, whether an async load fails), within what a real
        connector would load."""
        assert self.config is not None
        quarters, load_async, delay, fails = drawn
        if not self.config.kv_connector or quarters == 0:
            return None
        # Asynchronous loads under async scheduling are not modelled.
        load_async = load_async and not self.config.async_scheduling
        # A synchronous load leaves the last token to compute.
        tokens = min(prompt * quarters // REMOTE_QUARTERS, prompt if load_async else prompt - 1)
        if tokens <= 0:
            return None
        self.stats.ops[f"arrive:remote:{'async' if load_async else 'sync'}"] += 1
        fails = fails and load_async
        if fails:
            self.stats.ops["arrive:remote:fails"] += 1
        return RemoteHit(tokens, load_async, delay if load_async else 0, fails)

    @precondition(lambda self: self.lockstep is not None)
    @rule(steps=st.integers(1, 6), stop=st.integers(0, 2 * MAX_SEQS - 1))
    def step(self, steps: int, stop: int) -> None:
        """`steps` engine steps; in the first, a stop condition ends the
        running request `stop` picks (in half the draws: none)."""
        assert self.model is not None and self.config is not None
        running = [r.name for r in self.model.running]
        stopped = (running[stop],) if stop < len(running) and stop < MAX_SEQS else ()
        if self.config.async_scheduling:
            stopped = ()  # a stop condition under async scheduling is not modelled
        self.send_chunks(steps, stopped[0] if stopped else None)
        for position in range(steps):
            self.stats.engine_steps += 1
            self.stats.ops["step"] += 1
            first = position == 0 and stopped
            if first:
                self.stats.ops["step:stop"] += 1
            self.apply(EngineStep("step", 0, stop=stopped if first else ()))
            self.count_adapters_held_back()

    def count_adapters_held_back(self) -> None:
        """Count a step after which a waiting request's adapter is held back
        by the LoRA adapter limit (the running requests hold as many others)."""
        assert self.model is not None and self.config is not None
        limit = self.config.max_loras
        if not limit:
            return
        model = self.model
        running = {r.request.inputs.lora for r in model.running if r.request.inputs.lora}
        waiting = {r.request.inputs.lora for r in (*model.waiting, *model.holding)}
        if len(running) >= limit and waiting - running - {""}:
            self.stats.ops["step:lora:held_back"] += 1

    @precondition(lambda self: self.lockstep is not None and bool(self.live()))
    @rule(pick=st.integers(0, MAX_REQUESTS - 1))
    def abort(self, pick: int) -> None:
        assert self.model is not None
        live = self.live()
        name = live[pick % len(live)]
        running = {r.name: r for r in self.model.running}
        where = "waiting"
        if name in running:
            where = "decode" if running[name].decoding else "prefill"
        self.stats.ops[f"abort:{where}"] += 1
        self.apply(EngineStep("abort", 0, req=name))

    @precondition(lambda self: self.lockstep is not None and bool(self.names))
    @rule(running=st.booleans())
    def reset(self, running: bool) -> None:
        assert self.model is not None
        if running and self.model.blocks_held_off_the_running_queue() is not None:
            # vLLM 0.33.0 refuses (raises) a reset that preempts running
            # requests while blocks are held outside the running queue (a KV
            # connector's load in flight, a paused streaming-input session):
            # "not supported yet". The model refuses it as a trace; an engine
            # does not ask for it, and neither does this.
            self.stats.ops["reset:skipped"] += 1
            return
        busy = "busy" if self.model.running else "idle"
        self.stats.ops[f"reset:{'running' if running else 'kept'}:{busy}"] += 1
        self.apply(EngineStep("reset", 0, running=running))


# How the summary counts the examples dropped at vLLM 0.33.0's exact-fit
# defect: an admission with a KV connector's tokens whose state block does
# not fit raises in `schedule()`, where the model leaves the request waiting.
KNOWN_DEFECT = "known vLLM defect (connector admission at an exact fit)"


def is_exact_fit_defect(divergence: Divergence, model_left_one_waiting: bool) -> bool:
    """`divergence` is that defect: vLLM's `schedule()` ran out of blocks in
    a step where the model left such an admission waiting."""
    return (
        model_left_one_waiting
        and divergence.what.endswith(": schedule() raised")
        and str(divergence.actual).startswith("ValueError: Cannot get")
    )


def describe(divergence: Divergence) -> str:
    """A divergence in one line: where, what, the model's and vLLM's value."""
    return (
        f"{divergence.step.where()}: {divergence.what}: kvgate's model "
        f"{divergence.expected!r}, vLLM's Scheduler {divergence.actual!r}"
    )


# The Scheduler-level exploration's.
SchedulerOutcome = RunOutcome[SchedulerExploreFailure, SchedulerStats]


def machine_class(mode: SchedulerMode, stats: SchedulerStats) -> type[SchedulerMachine]:
    """The machine for `mode` (a subclass: Hypothesis runs classes)."""
    hold = "HoldOn" if mode.hold else "HoldOff"
    attributes = {"mode": mode, "stats": stats}
    return type(f"SchedulerLockstep{hold}", (SchedulerMachine,), attributes)


def explore_scheduler(
    mode: SchedulerMode,
    settings: Settings,
    *,
    out: Path | None = None,
    seed: int | None = None,
    seconds: float | None = None,
    on_round: Callable[[SchedulerStats], None] | None = None,
) -> SchedulerOutcome:
    """Rounds of `settings.max_examples` examples until one fails or, with
    `seconds`, the time is spent (one round otherwise); round k uses seed
    `seed + k` (a derandomized profile ignores it). The first failure,
    shrunk by Hypothesis, is saved in `out` as a scheduler-level trace."""
    stats = SchedulerStats()
    machine = machine_class(mode, stats)
    failure: SchedulerExploreFailure | None = None
    rounds = 0
    while failure is None:
        test = get_state_machine_test(machine, settings=settings)
        if seed is not None:
            # What @seed does: get_state_machine_test returns the @given test.
            test._hypothesis_internal_use_seed = seed + rounds  # type: ignore[attr-defined]
        try:
            with draws_from_the_seed_alone():
                test()
        except SchedulerExploreFailure as found:
            failure = found
        rounds += 1
        if on_round is not None:
            on_round(stats)
        spent = time.perf_counter() - stats.started
        if seconds is None or spent >= seconds or settings.derandomize:
            break
    saved = failure.save(out) if failure is not None and out is not None else None
    return SchedulerOutcome(failure, saved, stats, time.perf_counter() - stats.started, rounds)
