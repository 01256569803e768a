"""The bundled scenario families, generated at one deployment's config.

Each family is a short scheduler-level history written at the config a
serve command line resolves to (its blocks, hash unit, drafts, lookahead,
token budget, max_num_seqs, max_model_len): the prompts are sized in that
config's blocks and units, the requests are stepped on kvgate's scheduler
model until they finish (so the trace has as many engine steps as the
deployment takes), and `bless_engine` then writes every step's
expectations from the model. Under async scheduling with drafts each
decode's drafts are accepted in a mixed pattern (`ACCEPTANCE`), and an abort
is its own entry between steps, as async scheduling has it. The pool is the
one value a serve command line does not fix: each family takes the smallest
pool in which its requests all finish, so its pressure (a burst's
evictions, a preemption) happens at the deployment's block size, unless the
caller fixes the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvgate.conformance.bless import bless_engine
from kvgate.conformance.scheduler_replay import SchedulerModelFactory
from kvgate.conformance.trace import Trace, parse_trace
from kvgate.conformance.writer import dump_engine_trace
from kvgate.vocabulary.config import Config, UnsupportedConfig
from kvgate.vocabulary.ops import Segment
from kvgate.vocabulary.scheduling import EngineSettings, EngineStep, SchedulerModelRun
from kvgate.vocabulary.target import StepRefused

__all__ = ["ACCEPTANCE", "FAMILY_NAMES", "FamilyTrace", "generate"]

# A family whose requests have not all finished after this many engine
# steps does not fit the pool: the next pool size is tried.
_MAX_STEPS = 400


class _DoesNotFit(Exception):
    """The family's requests cannot all run to their end in this pool."""


class _NotModelled(Exception):
    """The scheduler model does not model the family at this config (in
    any pool)."""


# Under async scheduling with drafts, the drafts accepted in a request's
# successive decodes, cycling: all of them, none, then one.
ACCEPTANCE = (
    "mixed acceptance: each request's decodes accept all their drafts, then none, then one, in turn"
)


def _accepted(decode: int, drafts: int) -> int:
    """Drafts accepted in a request's `decode`-th decode (from 0) of `drafts`."""
    return (drafts, 0, min(1, drafts))[decode % 3]


@dataclass(frozen=True)
class FamilyTrace:
    """One generated trace: its name, its text with the model's
    expectations, and the trace read back."""

    name: str
    text: str
    trace: Trace


class _Script:
    """A history being written: each entry applied to the scheduler model
    as it is added, so the history steps as long as the deployment takes."""

    def __init__(self, run: SchedulerModelRun, accepting: bool, hold_arms: bool) -> None:
        self.run = run
        # Under async scheduling with drafts: accept drafts as `_accepted`
        # says, counting each request's decodes.
        self.accepting = accepting
        self.decodes: dict[str, int] = {}
        # In a family with two hold arms, a request reading another's tokens
        # from the cache accepts none: on a build lacking the hold its hit,
        # and so its decodes, differ, and the hold arm must reach that hit.
        self.hold_arms = hold_arms
        self.rejecting: set[str] = set()
        self.entries: list[EngineStep] = []
        self.finished: set[str] = set()
        self.preempted: set[str] = set()
        # Each request's prefix-cache hit when first admitted.
        self.hits: dict[str, int] = {}

    def arrive(
        self, req: str, prompt: Sequence[Segment], max_tokens: int, follows: str | None = None
    ) -> None:
        entry = EngineStep(
            "arrive",
            len(self.entries),
            req=req,
            prompt=tuple(prompt),
            max_tokens=max_tokens,
            follows=follows,
        )
        if self.hold_arms and any(seg.kind != "fresh" for seg in prompt):
            self.rejecting.add(req)
        try:
            self.run.arrive(entry.arrival())
        except (StepRefused, UnsupportedConfig) as refused:
            raise _DoesNotFit(str(refused)) from None
        self.entries.append(entry)

    def _acceptance(self) -> dict[str, int]:
        """The drafts to accept in the batch the next step schedules, by
        the requests that decode with drafts in it."""
        accept: dict[str, int] = {}
        for name, drafts in self.run.preview_next_step().drafts.items():
            if name in self.rejecting:
                continue
            decode = self.decodes.get(name, 0)
            self.decodes[name] = decode + 1
            if _accepted(decode, drafts):
                accept[name] = _accepted(decode, drafts)
        return accept

    def step(self, aborted: tuple[str, ...] = ()) -> None:
        try:
            accept = self._acceptance() if self.accepting else {}
            for name, drafts in accept.items():
                self.run.accept(name, drafts)
            outcome = self.run.step(aborted)
        except StepRefused as stuck:
            if stuck.field == "config.async_scheduling":  # not modelled, in any pool
                raise _NotModelled(f"{stuck.field}: {stuck.message}") from None
            raise _DoesNotFit(str(stuck)) from None  # the pool cannot run the family
        self.entries.append(EngineStep("step", len(self.entries), accept=accept, aborted=aborted))
        self.finished.update(outcome.finished)
        self.preempted.update(outcome.preempted)
        for req, hit in outcome.admitted:
            self.hits.setdefault(req, hit)
        if len(self.entries) > _MAX_STEPS:
            raise _DoesNotFit("too many engine steps")

    def until_finished(self, *names: str) -> None:
        while not set(names) <= self.finished:
            self.step()

    def abort(self, req: str) -> None:
        self.run.abort(req)
        self.entries.append(EngineStep("abort", len(self.entries), req=req))
        self.finished.add(req)

    def reset(self, running: bool) -> None:
        self.run.reset_prefix_cache(running)
        self.entries.append(EngineStep("reset", len(self.entries), running=running))


def _fresh(n: int) -> Segment:
    return Segment("fresh", count=max(1, n))


def _all_of(req: str) -> Segment:
    return Segment("all_of", req=req)


@dataclass(frozen=True)
class _Sizes:
    """A family's token counts in the deployment's own units."""

    block: int  # the scheduler block (the served attention and Mamba block)
    unit: int  # the hash unit
    budget: int  # tokens one engine step schedules at most
    max_len: int  # max_model_len
    seqs: int  # max_num_seqs
    spec: int  # drafts per decode step
    async_scheduling: bool

    @classmethod
    def of(cls, config: Config, settings: EngineSettings) -> _Sizes:
        return cls(
            config.scheduler_block_size,
            config.hash_unit,
            config.max_num_scheduled_tokens,
            config.max_model_len,
            settings.max_num_seqs,
            settings.spec,
            config.async_scheduling,
        )

    def prompt(self, blocks: int, extra: int = 0) -> int:
        """A prompt `blocks` blocks long plus `extra` tokens, within the
        longest a request may run (its output and drafts after it)."""
        return max(1, min(blocks * self.block + extra, self.max_len - 8 - self.spec))


def _next_turn_after_burst(s: _Script, z: _Sizes) -> None:
    # A turn ends inside a block; its follow-up resumes at that partial
    # tail; a burst of other prompts takes the pool while the follow-up
    # decodes; the turn after that finds (or, without the hold, misses) it.
    s.arrive("A0", [_fresh(z.prompt(2, z.unit + z.unit // 2 + 3))], 4)
    s.until_finished("A0")
    s.arrive("A1", [_all_of("A0"), _fresh(z.unit // 2 + 2)], 4, follows="A0")
    s.step()
    burst = [f"B{i}" for i in range(1, max(2, min(4, z.seqs)))]
    for name in burst:
        s.arrive(name, [_fresh(z.prompt(3, 7))], 1)
    s.until_finished("A1", *burst)
    s.arrive("A2", [_all_of("A1"), _fresh(z.unit // 2 + 6)], 2, follows="A1")
    s.until_finished("A2")


def _siblings(s: _Script, z: _Sizes) -> None:
    # A producer's prompt ends inside a block; siblings sharing it arrive
    # together after it, each with its own suffix.
    s.arrive("P", [_fresh(z.prompt(2, z.unit + 5))], 2)
    s.until_finished("P")
    names = [f"S{i}" for i in range(1, max(2, min(4, z.seqs)))]
    for i, name in enumerate(names):
        s.arrive(name, [Segment("prompt_of", req="P"), _fresh(z.unit // 4 + i + 1)], 3)
    s.until_finished(*names)


def _preemption_and_resume(s: _Script, z: _Sizes) -> None:
    # Requests whose prompts end just short of a block boundary decode side
    # by side in a pool too small for every next block: the Scheduler
    # preempts one, the others finish, it resumes from the prefix cache.
    names = [f"R{i}" for i in range(max(2, min(3, z.seqs)))]
    short = 2 * (z.spec + 1) + 2
    for name in names:
        s.arrive(name, [_fresh(z.prompt(2, -short))], 2 * short)
    s.until_finished(*names)
    if not s.preempted:
        raise _DoesNotFit("no preemption in this pool")


def _aborts(s: _Script, z: _Sizes) -> None:
    # One request aborted mid-prefill, one aborted inside a step while it
    # decodes; a follow-up of the second resumes from what it left cached.
    s.arrive("L", [_fresh(z.prompt(2 + 2 * z.budget // z.block, 9))], 4)
    s.arrive("D", [_fresh(z.prompt(1, z.unit + 1))], 8)
    s.step()
    s.abort("L")
    s.step()
    if z.async_scheduling:
        # With a batch always in flight, an abort inside a step and one
        # between steps are the same event: its own entry.
        s.step()
        s.abort("D")
    else:
        s.step(aborted=("D",))
        s.finished.add("D")
    s.arrive("F", [Segment("prompt_of", req="D"), _fresh(z.unit // 2)], 2, follows="D")
    s.until_finished("F")


def _resets(s: _Script, z: _Sizes) -> None:
    # A prefix-cache reset with nothing running empties the cache; one with
    # a request running preempts it first; both followed by a turn that
    # would have hit.
    s.arrive("A", [_fresh(z.prompt(1, z.unit + 2))], 2)
    s.until_finished("A")
    s.reset(running=False)
    s.arrive("B", [_all_of("A"), _fresh(z.unit // 2)], 6, follows="A")
    s.step()
    s.reset(running=True)
    s.until_finished("B")
    s.arrive("C", [_all_of("B"), _fresh(3)], 2, follows="B")
    s.until_finished("C")


def _admission_at_the_edge(s: _Script, z: _Sizes) -> None:
    # A prompt at the longest the deployment admits with its drafts, after
    # a request that holds the rest of the pool.
    s.arrive("H", [_fresh(z.prompt(1, 1))], 2)
    s.step()
    s.arrive("E", [_fresh(z.max_len - 2 - z.spec)], 1)
    s.until_finished("H", "E")


# name, hold arms, builder
_FAMILIES: tuple[tuple[str, bool, Callable[[_Script, _Sizes], None]], ...] = (
    ("next-turn-after-burst", True, _next_turn_after_burst),
    ("siblings", True, _siblings),
    ("preemption-and-resume", False, _preemption_and_resume),
    ("aborts", False, _aborts),
    ("resets", False, _resets),
    ("admission-at-the-edge", False, _admission_at_the_edge),
)
FAMILY_NAMES: tuple[str, ...] = tuple(name for name, _, _ in _FAMILIES)


def _pools(config: Config, fixed: int | None, start: int | None = None) -> Iterator[int]:
    """The pool sizes to try: the fixed one, else growing from `start` or
    the least a request with drafts can hold."""
    if fixed is not None:
        yield fixed
        return
    size = start or 4 + 2 * config.groups[-1].speculative_blocks
    while size <= 4096:
        yield size
        size += max(1, size // 8)


def _fit(
    build: Callable[[_Script, _Sizes], None],
    config: Config,
    settings: EngineSettings,
    model: SchedulerModelFactory,
    size: int,
    accepting: bool,
    hold_arms: bool,
) -> _Script | str:
    """The family played at pool `size` (drafts accepted when `accepting`),
    or why it does not fit there."""
    sized = replace(config, num_blocks=size)
    script = _Script(model(sized, settings.spec, settings.max_num_seqs), accepting, hold_arms)
    try:
        build(script, _Sizes.of(sized, settings))
    except _DoesNotFit as reason:
        return f"{reason} (pool {size})"
    return script


def _generate_arms(
    build: Callable[[_Script, _Sizes], None],
    config: Config,
    settings: EngineSettings,
    model: SchedulerModelFactory,
    pool: int | None,
    arms: tuple[bool, ...],
) -> tuple[dict[bool, _Script], int] | str:
    """Each hold arm played at one pool: the first pool where every arm fits
    and, with two arms, the hold changes a hit (what the family is about),
    else the first where every arm fits. The scripts by arm, and the pool.

    Under async scheduling with drafts the pools are first searched with
    every draft rejected (each accepted draft costs a copy of the model to
    look ahead with), then again with the drafts accepted from the pool that
    search found."""
    found = _search_pools(build, config, settings, model, _pools(config, pool), False, arms)
    if not (config.async_scheduling and settings.spec) or isinstance(found, str):
        return found
    pools = _pools(config, pool, start=found[1])
    return _search_pools(build, config, settings, model, pools, True, arms)


def _search_pools(
    build: Callable[[_Script, _Sizes], None],
    config: Config,
    settings: EngineSettings,
    model: SchedulerModelFactory,
    pools: Iterator[int],
    accepting: bool,
    arms: tuple[bool, ...],
) -> tuple[dict[bool, _Script], int] | str:
    """`_generate_arms` over `pools`, drafts accepted when `accepting`."""
    first: tuple[dict[bool, _Script], int] | None = None
    why = "no pool tried"
    for tried, size in enumerate(pools):
        if first is not None and tried > 48:
            break
        played = {
            hold: _fit(
                build, replace(config, hold=hold), settings, model, size, accepting, len(arms) > 1
            )
            for hold in arms
        }
        failed = [why for why in played.values() if isinstance(why, str)]
        if failed:
            why = failed[0]
            continue
        scripts = {hold: script for hold, script in played.items() if isinstance(script, _Script)}
        if first is None:
            first = scripts, size
        if len(arms) < 2 or scripts[True].hits != scripts[False].hits:
            return scripts, size
    return first if first is not None else why


def generate(
    config: Config,
    settings: EngineSettings,
    model: SchedulerModelFactory,
    folder: Path,
    pool: int | None = None,
) -> tuple[list[FamilyTrace], list[str]]:
    """Every family at `config`, blessed by `model`, written into `folder`
    (as `deploy-<family>[.hold-on|.hold-off].yaml`); and a line for each
    family that could not be generated there, saying why."""
    folder.mkdir(parents=True, exist_ok=True)
    traces: list[FamilyTrace] = []
    skipped: list[str] = []
    for family, two_arms, build in _FAMILIES:
        arms = (False, True) if two_arms else (config.hold,)
        try:
            made = _generate_arms(build, config, settings, model, pool, arms)
        except UnsupportedConfig as refused:
            made = f"{refused.field}: {refused.message}"
        except _NotModelled as refused:
            made = f"kvgate's model does not model it: {refused}"
        if isinstance(made, str):
            skipped.append(f"deploy-{family}: not generated at this deployment: {made}")
            continue
        scripts, size = made
        for hold, script in scripts.items():
            name = f"deploy-{family}" + ((".hold-on" if hold else ".hold-off") if two_arms else "")
            sized = replace(config, hold=hold, num_blocks=size)
            scheduling = (
                f"async scheduling, {ACCEPTANCE}, "
                if sized.async_scheduling and settings.spec
                else "async scheduling, "
                if sized.async_scheduling
                else ""
            )
            about = (
                f"The {family.replace('-', ' ')} family at the deployment's config "
                f"(block {sized.scheduler_block_size}, unit {sized.hash_unit}, "
                f"{settings.spec} drafts, {scheduling}pool {size} blocks), "
                "its expectations written by kvgate's model."
            )
            text = dump_engine_trace(
                name,
                sized,
                settings,
                script.entries,
                about,
                ("deployment", family),
                each_step=True,
            )
            path = folder / f"{name}.yaml"
            blessed = bless_engine(parse_trace(text, path), text, model)
            path.write_text(blessed.text)
            traces.append(FamilyTrace(name, blessed.text, blessed.blessed))
    return traces, skipped
