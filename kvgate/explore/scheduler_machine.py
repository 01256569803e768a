"""The Scheduler-level machine: engine steps on kvgate's scheduler model and
vLLM's real `Scheduler`, in strict lockstep.

The manager-level machine (`machine.py`) issues manager calls as kvgate's
model of the Scheduler would; this one plays the engine instead: requests
arrive (fresh prompts, prompts sharing an earlier request's prompt, follow-up
turns extending an earlier request's whole sequence; with a cache salt or
not; some carrying images, under an encoder budget and cache drawn with the
engine; under the priority policy, with a priority; streaming-input
sessions, which later get their next input chunk or their end), the engine
steps, clients abort requests waiting, mid-prefill or mid-decode, and the
prefix cache is reset with or without preempting the running requests. What
it draws, engines and requests, is `scheduler_draws`. Every step goes through
the scheduler-level lockstep the gate replays traces with
(`conformance.scheduler_replay.SchedulerLockstep`), so what it compares is
what the gate compares, and every history is a scheduler-level trace: the
first divergence raises a `failure.SchedulerExploreFailure`, which Hypothesis
shrinks and `scheduler_runner` saves.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvgate.conformance.replay import ModelBug
from kvgate.conformance.scheduler_replay import SchedulerLockstep, model_config
from kvgate.conformance.trace import Trace, TraceError
from kvgate.explore.failure import SchedulerExploreFailure
from kvgate.explore.machine_run import example_cut_short
from kvgate.explore.mode import SchedulerMode, SchedulerStats
from kvgate.explore.scheduler_draws import (
    ACCEPTANCES,
    ADAPTERS,
    ARRIVALS,
    CHUNK_UNIT,
    CHUNKS,
    IMAGES,
    MAX_CHUNK_OUTPUT,
    MAX_IMAGE,
    MAX_REQUESTS,
    MAX_SEQS,
    MAX_STEPS,
    OTHER_TENANT,
    REMOTE_QUARTERS,
    AcceptanceDraw,
    ArrivalDraw,
    ChunkDraw,
    Engine,
    RemoteDraw,
    engines,
    family_name,
    request_cap,
)
from kvgate.explore.scheduler_triage import KNOWN_DEFECT, describe, is_exact_fit_defect
from kvgate.model.scheduler import SchedulerModel
from kvgate.model.scheduler_state import Batch, LiveRequest, SchedulerStuck
from kvgate.targets import scheduler_factories
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.ops import Segment
from kvgate.vocabulary.scheduling import (
    EngineSettings,
    EngineStep,
    NextStep,
    RemoteHit,
    SchedulerTarget,
)
from kvgate.vocabulary.tokens import MmItem


class SchedulerMachine(RuleBasedStateMachine):
    """Engine steps on kvgate's scheduler model and vLLM's `Scheduler`, for
    the arm `mode`, counting what it exercised in `stats`."""

    def __init__(self, mode: SchedulerMode, stats: SchedulerStats) -> None:
        super().__init__()
        self.mode = mode
        self.stats = stats
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

    @initialize(engine=engines())
    def start(self, engine: Engine) -> None:
        config = replace(
            engine.config, hold=self.mode.hold, retain_retired=self.mode.retain_retired
        )
        spec, max_num_seqs = engine.settings.spec, engine.settings.max_num_seqs
        self.settings = engine.settings
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
        self.stats.families[family_name(engine.family)] += 1
        if config.async_scheduling:
            self.stats.ops["engine:async"] += 1
        if engine.by_priority:
            self.stats.ops["engine:priority"] += 1
        if config.kv_events:
            self.stats.ops[f"engine:kv_events:{'full' if config.kv_events_full else 'on'}"] += 1
        if config.disable_log_stats:
            self.stats.ops["engine:stats_off"] += 1
        if config.max_loras:
            self.stats.ops[f"engine:max_loras:{config.max_loras}"] += 1

    def teardown(self) -> None:
        # Counted as the manager's exploration counts (kvgate/explore/rules.py).
        if self.stats.first_failure is not None and not self.failing:
            self.stats.shrinking += 1
        elif self.dropped or example_cut_short():
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
    @rule(arrival=ARRIVALS)
    def arrive(self, arrival: ArrivalDraw) -> None:
        name = f"R{len(self.names)}"
        assert self.config is not None
        max_tokens = min(arrival.max_tokens, self.cap - 1)
        streaming = arrival.streaming and self.takes_sessions()
        if streaming:
            # Each input of a session gets a short answer, its first as its
            # chunks (so sessions pause for their next input within a run).
            max_tokens = min(max_tokens, MAX_CHUNK_OUTPUT)
        room = self.cap - max_tokens
        shape = arrival.shape if self.names else "fresh"
        base: str | None = None
        base_length = 0
        if shape != "fresh":
            # A next turn prefers a conversation whose last turn finished.
            live = set(self.live())
            pool = [n for n in self.names if n not in live] if shape == "next_turn" else []
            pool = pool or self.names
            base = pool[arrival.earlier % len(pool)]
            base_length = self.sequence_length(base, whole=shape == "next_turn")
            if base_length >= room:
                shape, base, base_length = "fresh", None, 0
        fresh = min(arrival.new_tokens, room - base_length)
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
        if arrival.other_tenant:
            salt = OTHER_TENANT if salt == "" else ""
        self.names.append(name)
        self.salts[name] = salt
        self.stats.ops[f"arrive:{shape}"] += 1
        if salt:
            self.stats.ops["arrive:salted"] += 1
        if streaming:
            self.sessions.add(name)
            self.stats.ops["arrive:session"] += 1
        priority = arrival.priority if self.config.scheduling_policy == "priority" else 0
        if priority:
            self.stats.ops[f"arrive:priority:{priority}"] += 1
        lora = self.adapter(base, arrival.adapter)
        self.adapters[name] = lora
        if lora:
            self.stats.ops["arrive:lora"] += 1
        prompt_length = base_length + max(fresh, 1 if base is None else 0)
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
                remote=self.remote_hit(prompt_length, arrival.remote),
                mm=self.images(base_length, fresh, arrival, streaming),
                resumable=streaming,
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

    def images(
        self, start: int, fresh: int, arrival: ArrivalDraw, session: bool
    ) -> tuple[MmItem, ...]:
        """The images an arrival carries among its `fresh` new tokens, which
        begin at `start` (the arrival's image, 0 for none, beginning at its
        quarter of the new tokens; at the first token, the next image follows
        it, so one chunk needs both); none where the encoder is not modelled
        (async scheduling, a streaming-input `session`), and only those that
        fit."""
        assert self.config is not None
        which, quarter = arrival.image, arrival.image_quarter
        if not which or session or self.config.async_scheduling:
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

    def remote_hit(self, prompt: int, drawn: RemoteDraw) -> RemoteHit | None:
        """With a KV connector: what its store holds of a new request's
        `prompt` tokens, within what a real connector would load."""
        assert self.config is not None
        if not self.config.kv_connector or drawn.quarters == 0:
            return None
        # Asynchronous loads under async scheduling are not modelled.
        load_async = drawn.load_async and not self.config.async_scheduling
        # A synchronous load leaves the last token to compute.
        tokens = min(
            prompt * drawn.quarters // REMOTE_QUARTERS, prompt if load_async else prompt - 1
        )
        if tokens <= 0:
            return None
        self.stats.ops[f"arrive:remote:{'async' if load_async else 'sync'}"] += 1
        fails = drawn.fails and load_async
        if fails:
            self.stats.ops["arrive:remote:fails"] += 1
        return RemoteHit(tokens, load_async, drawn.delay if load_async else 0, fails)

    def open_sessions(self, paused: bool) -> list[LiveRequest]:
        """The open streaming-input sessions the engine can send input now:
        the `paused` ones, or the running ones with nothing queued."""
        assert self.model is not None
        model = self.model
        if not paused:
            return [r for r in model.running if r.name in self.sessions and not r.chunks]
        parked = (*model.waiting, *model.holding)
        return [r for r in parked if r.name in self.sessions and r.waiting_for_streaming_req]

    def send_chunk(self, live: LiveRequest, chunk: ChunkDraw) -> None:
        """To the session `live`: a chunk, or its end, also when the chunk
        would not fit (at its stop the session holds at most its prompt and
        output)."""
        name = live.name
        room = self.cap - live.request.num_prompt_tokens - live.max_tokens
        fresh = CHUNK_UNIT * chunk.units
        if chunk.end or fresh + chunk.max_tokens > room:
            self.stats.ops["chunk:end"] += 1
            self.sessions.discard(name)
            self.apply(EngineStep("chunk", 0, req=name, end=True))
            return
        self.stats.ops["chunk:paused" if live.waiting_for_streaming_req else "chunk:queued"] += 1
        prompt = (Segment("fresh", count=fresh),)
        self.apply(EngineStep("chunk", 0, req=name, prompt=prompt, max_tokens=chunk.max_tokens))

    @precondition(lambda self: self.lockstep is not None and bool(self.open_sessions(False)))
    @rule(session=st.integers(0, MAX_SEQS - 1), chunk=CHUNKS)
    def chunk_queued(self, session: int, chunk: ChunkDraw) -> None:
        """The client of the running session `session` picks (one with
        nothing queued yet) queues its next input behind its current one."""
        running = self.open_sessions(False)
        self.send_chunk(running[session % len(running)], chunk)

    @precondition(lambda self: self.lockstep is not None)
    @rule(
        steps=st.integers(1, MAX_STEPS),
        stop=st.integers(0, 2 * MAX_SEQS - 1),
        resume=CHUNKS,
        answer_at_once=st.booleans(),
        data=st.data(),
    )
    def step(
        self,
        steps: int,
        stop: int,
        resume: ChunkDraw,
        answer_at_once: bool,
        data: st.DataObject,
    ) -> None:
        """`steps` engine steps; in the first, a stop condition ends the
        running request `stop` picks (in half the draws: none). Before them,
        the client of each paused streaming-input session answers with its
        next input, `resume` (a chunk, or the session's end); with
        `answer_at_once`, the sessions these steps paused get it after them
        too (the others stay paused through the rules that follow), and the
        sessions still running get it queued. Under
        async scheduling with drafts, the model runner takes each batch's
        drafts as an acceptance drawn for the rule says (drawn there only,
        so the other engines' examples draw as they did without it)."""
        assert self.model is not None and self.config is not None
        for live in self.open_sessions(True):
            self.send_chunk(live, resume)
        running = [r.name for r in self.model.running]
        drafting = self.settings.spec > 0
        # Only an engine with drafts or batches in flight needs the preview.
        previewing = drafting or self.config.async_scheduling
        preview = self.preview() if previewing else NextStep({}, set())
        if self.config.async_scheduling:
            # A stop applies to the output the step processes: only a request
            # sampling in that batch can meet one.
            running = [name for name in running if name in preview.samples]
        stopped = (running[stop],) if stop < len(running) and stop < MAX_SEQS else ()
        decodes = 0
        acceptance: AcceptanceDraw | None = data.draw(ACCEPTANCES) if drafting else None
        for position in range(steps):
            self.stats.engine_steps += 1
            self.stats.ops["step"] += 1
            first = position == 0 and stopped
            if first:
                self.stats.ops["step:stop"] += 1
                if self.config.async_scheduling:
                    self.stats.ops["step:stop:async"] += 1
            accept: dict[str, int] = {}
            if acceptance is not None:
                if position:
                    preview = self.preview()
                for name, count in preview.drafts.items():
                    accepted = min(acceptance.accepted(count, decodes), self.room(name))
                    decodes += 1
                    if accepted:
                        accept[name] = accepted
                if accept and not self.config.async_scheduling:
                    self.stats.ops["step:drafts_accepted:sync"] += 1
                    if position == 0 and set(stopped) & accept.keys():
                        self.stats.ops["step:stop:accepting"] += 1
            in_flight = self.outputs_in_flight()
            batches = list(self.model.in_flight)
            self.apply(EngineStep("step", 0, stop=stopped if first else (), accept=accept))
            self.count_in_flight(in_flight, batches)
            self.count_adapters_held_back()
        if answer_at_once:
            for live in self.open_sessions(True):
                self.send_chunk(live, resume)
            # An eager client queues its next input while its session runs.
            for live in self.open_sessions(False):
                self.send_chunk(live, resume)

    def room(self, name: str) -> int:
        """The drafts `name` may accept in a synchronous step: its output
        stays within its `max_tokens` (a trace writes the drafts vLLM's
        engine keeps). Under async scheduling the Scheduler trims them."""
        assert self.model is not None and self.config is not None
        if self.config.async_scheduling:
            return self.settings.spec
        live = next((r for r in self.model.running if r.name == name), None)
        if live is None:
            return 0
        return max(0, live.max_tokens - len(live.request.output) - 1)

    def preview(self) -> NextStep:
        """What the next engine step will do, as the scheduler model runs it."""
        assert self.model is not None
        try:
            return self.model.preview_next_step()
        except Exception:
            # The real step meets it (a refusal, a model bug) and says so.
            return NextStep({}, set())

    def outputs_in_flight(self) -> dict[str, tuple[int, int]]:
        """Each live request's preemptions and output placeholders (an output
        in flight when above 0)."""
        assert self.model is not None
        return {
            r.name: (r.request.num_preemptions, r.placeholders)
            for r in (*self.model.running, *self.model.waiting, *self.model.holding)
        }

    def count_in_flight(self, before: dict[str, tuple[int, int]], batches: list[Batch]) -> None:
        """Count what an engine step under async scheduling did with outputs
        in flight (`before` and `batches`: each request's preemptions and
        placeholders, and the batches in flight, before it): a request
        decoding past its output in flight, one preempted with an output in
        flight, a batch's output processed with drafts rejected (taken back
        from what the request keeps) or accepted."""
        assert self.model is not None and self.config is not None
        if not self.config.async_scheduling:
            return
        model = self.model
        self.count_preempted_in_flight(before, "step")
        newest = model.in_flight[-1] if model.in_flight else None
        scheduled = newest is not None and newest.number == model.batches_scheduled
        if newest is not None and scheduled and all(b is not newest for b in batches):
            past = [n for n in newest.samples if before.get(n, (0, 0))[1]]
            self.stats.ops["step:decode_past_in_flight"] += bool(past)
            batches = [*batches, newest]
        for batch in batches:
            if any(batch is b for b in model.in_flight):
                continue
            for name, drafts in batch.drafts.items():
                accepted = batch.accepted.get(name, 0)
                self.stats.ops["step:drafts_rejected"] += accepted < drafts
                self.stats.ops["step:drafts_accepted"] += accepted > 0

    def count_preempted_in_flight(self, before: dict[str, tuple[int, int]], rule: str) -> None:
        """Count the requests `rule` preempted with an output in flight
        (`before`: each request's preemptions and placeholders before it)."""
        now = self.outputs_in_flight()
        for name, (preemptions, placeholders) in before.items():
            if placeholders and now.get(name, (preemptions, 0))[0] > preemptions:
                self.stats.ops[f"{rule}:preempted_in_flight"] += 1

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
    @rule(victim=st.integers(0, MAX_REQUESTS - 1))
    def abort(self, victim: int) -> None:
        """The client aborts the live request `victim` picks."""
        assert self.model is not None
        live = self.live()
        name = live[victim % len(live)]
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
        config = self.config
        assert config is not None
        if running and config.async_scheduling and config.kv_connector and self.model.in_flight:
            # Not modelled under async scheduling (vLLM defers the free of a
            # request in flight with a KV connector, which the reset's
            # preemption would have to follow): not drawn.
            self.stats.ops["reset:skipped"] += 1
            return
        busy = "busy" if self.model.running else "idle"
        self.stats.ops[f"reset:{'running' if running else 'kept'}:{busy}"] += 1
        before = self.outputs_in_flight()
        self.apply(EngineStep("reset", 0, running=running))
        self.count_preempted_in_flight(before, "reset")
