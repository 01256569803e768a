"""A scheduler-level trace's `engine` entries and `scheduler` settings read:
arrivals (with what a KV connector's store holds of them), aborts, resets
and engine steps with their `expect`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgate.conformance.field_reader import FieldReader, got, is_count
from kvgate.conformance.limits import LimitError
from kvgate.vocabulary.scheduling import (
    ENGINE_EXPECT_KEYS,
    ENGINE_OPS,
    PAUSE_MODES,
    REMOTE_FIELDS,
    RESET_EXPECT_KEYS,
    EngineSettings,
    EngineStep,
    RemoteHit,
)
from kvgate.vocabulary.tokens import MmItem

# The keys of a scheduler-level trace's `scheduler` settings.
_SCHEDULER_KEYS = ("spec", "max_num_seqs")


class EngineReader(FieldReader):
    """Reads a scheduler-level trace's engine entries, one at a time, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Each multimodal item's length, by its id, as first given.
        self.mm_lengths: dict[str, int] = {}

    def engine_settings(self, raw: object) -> EngineSettings:
        if not isinstance(raw, dict):
            raise self.error(None, "scheduler", f"must be a mapping, got {got(raw)}")
        self.unknown_keys(None, "scheduler.", raw, _SCHEDULER_KEYS, "scheduler key")
        spec = raw.get("spec", 0)
        if not is_count(spec) or spec > self.limits.spec:
            raise self.error(
                None,
                "scheduler.spec",
                f"must be an integer 0..{self.limits.spec}, got {got(spec)}",
            )
        seqs = raw.get("max_num_seqs", EngineSettings.max_num_seqs)
        if not is_count(seqs) or seqs == 0:
            raise self.error(
                None, "scheduler.max_num_seqs", f"must be an integer >= 1, got {got(seqs)}"
            )
        assert self.config is not None
        if self.config.eagle and spec == 0:
            raise self.error(
                None, "scheduler.spec", "config.eagle drops blocks for drafts: give spec >= 1"
            )
        self.drafts = spec
        return EngineSettings(spec, seqs)

    def engine_step(self, index: int, raw: object) -> list[EngineStep]:
        """One `engine` entry; `step` with `steps: N` is N engine steps."""
        raw, op = self.op_of(index, raw, tuple(ENGINE_OPS), "engine op")
        required, optional = ENGINE_OPS[op]
        allowed = ("op", *required, *optional, *(("expect",) if op in ("step", "reset") else ()))
        self.unknown_keys(index, "", raw, allowed, f"field of engine op {op}")
        self.missing_keys(index, "", raw, required)
        try:
            self.budget.add_steps(1, "engine")
        except LimitError as error:
            raise self.error(index, error.field, error.message) from None
        if op == "arrive":
            return [self.engine_arrival(index, raw)]
        if op == "chunk":
            return [self.engine_chunk(index, raw)]
        if op == "abort":
            req = self.arrived(index, "req", raw["req"])
            if self.requests[req][0] == "ended":
                raise self.error(index, "req", f"{req!r} was {self.requests[req][1]}")
            self.requests[req] = ("ended", f"aborted at step {index}")
            return [EngineStep("abort", index, req=req)]
        if op == "pause":
            mode = raw["mode"]
            if mode not in PAUSE_MODES:
                raise self.error(
                    index, "mode", f"must be one of {', '.join(PAUSE_MODES)}, got {got(mode)}"
                )
            return [EngineStep("pause", index, mode=mode)]
        if op == "resume":
            return [EngineStep("resume", index)]
        if op == "reset":
            running, connector = raw.get("running", False), raw.get("connector", False)
            for key, flag in (("running", running), ("connector", connector)):
                if not isinstance(flag, bool):
                    raise self.error(index, key, f"must be true or false, got {got(flag)}")
            expect = self.reset_expect(index, raw)
            return [EngineStep("reset", index, running=running, connector=connector, expect=expect)]
        repeats = raw.get("steps", 1)
        if not is_count(repeats) or repeats == 0:
            raise self.error(index, "steps", f"must be an integer >= 1, got {got(repeats)}")
        if "expect" in raw and repeats != 1:
            raise self.error(index, "expect", "applies to one engine step: write steps: 1")
        try:
            self.budget.add_steps(repeats - 1, "steps")
        except LimitError as error:
            raise self.error(index, error.field, error.message) from None
        if "stop" in raw and repeats != 1:
            raise self.error(index, "stop", "applies to one engine step: write steps: 1")
        stop = self.stopped(index, raw.get("stop", []))
        if "accept" in raw and repeats != 1:
            raise self.error(index, "accept", "applies to one engine step: write steps: 1")
        accept = self.accepted(index, raw.get("accept", {}))
        if "abort" in raw and repeats != 1:
            raise self.error(index, "abort", "applies to one engine step: write steps: 1")
        aborted = self.aborted_mid_step(index, raw.get("abort", []), stop)
        expect = self.engine_expect(index, raw.get("expect", {}))
        return [
            EngineStep("step", index, expect=expect, stop=stop, accept=accept, aborted=aborted)
            for _ in range(repeats)
        ]

    def aborted_mid_step(self, index: int, raw: object, stop: tuple[str, ...]) -> tuple[str, ...]:
        """A step's `abort`: requests that have arrived and not ended, each
        named once, aborted after the step's `schedule()` (ended from then on)."""
        if not isinstance(raw, list):
            raise self.error(index, "abort", f"must be a list of requests, got {got(raw)}")
        names = tuple(self.arrived(index, f"abort[{i}]", r) for i, r in enumerate(raw))
        if len(set(names)) != len(names):
            raise self.error(index, "abort", f"names a request twice: {got(raw)}")
        assert self.config is not None
        if names and self.config.async_scheduling:
            raise self.error(
                index,
                "abort",
                "under async scheduling write the abort as its own entry (a batch is in flight "
                "between steps)",
            )
        for i, req in enumerate(names):
            if req in stop:
                raise self.error(index, f"abort[{i}]", f"{req!r} also stops in this step")
            if self.requests[req][0] == "ended":
                raise self.error(index, f"abort[{i}]", f"{req!r} was {self.requests[req][1]}")
            self.requests[req] = ("ended", f"aborted in step {index}")
        return names

    def accepted(self, index: int, raw: object) -> dict[str, int]:
        """A step's `accept`: requests that have arrived, each with the drafts
        accepted, 1 to the drafts a step proposes (`scheduler.spec`)."""
        if not isinstance(raw, dict) or not all(
            is_count(n) and 1 <= n <= self.drafts for n in raw.values()
        ):
            raise self.error(
                index,
                "accept",
                f"must map requests to draft tokens accepted, 1..{self.drafts} "
                f"(scheduler.spec), got {got(raw)}",
            )
        # A request in both `stop` and `accept`: without async scheduling the
        # stop is met at the last token it kept (its drafts accepted, then
        # its own); under async scheduling the two name different batches.
        return {self.arrived(index, "accept", r): n for r, n in raw.items()}

    def stopped(self, index: int, raw: object) -> tuple[str, ...]:
        """A step's `stop`: requests that have arrived, each named once."""
        if not isinstance(raw, list):
            raise self.error(index, "stop", f"must be a list of requests, got {got(raw)}")
        names = tuple(self.arrived(index, f"stop[{i}]", r) for i, r in enumerate(raw))
        if len(set(names)) != len(names):
            raise self.error(index, "stop", f"names a request twice: {got(raw)}")
        return names

    def engine_arrival(self, index: int, raw: Mapping[Any, Any]) -> EngineStep:
        req = raw["req"]
        if not isinstance(req, str) or not req:
            raise self.error(index, "req", f"must be a request name (a string), got {got(req)}")
        if req in self.requests:
            raise self.error(index, "req", f"{req!r} already {self.requests[req][1]}")
        prompt = self.prompt(index, raw["prompt"])
        max_tokens = self.output_length(index, raw)
        try:
            self.budget.arrive(req, prompt)
        except LimitError as error:
            raise self.error(index, error.field, error.message) from None
        least = self.budget.prompt_least[req]
        self.within_model_len(
            index,
            f"{least:,} prompt + {max_tokens:,} output tokens",
            least + max_tokens,
            "vLLM refuses the request",
        )
        # A follow-up's `all_of` holds at most the whole output.
        self.budget.output_most[req] = max_tokens
        salt = self.text(index, "cache_salt", raw["cache_salt"]) if "cache_salt" in raw else ""
        lora = self.engine_lora(index, raw)
        mm = self.engine_mm(index, raw["mm"], least) if "mm" in raw else ()
        follows = raw.get("follows")
        if follows is not None:
            follows = self.arrived(index, "follows", follows)
        remote = self.engine_remote(index, raw, least)
        priority = self.engine_priority(index, raw)
        resumable = self.engine_resumable(index, raw)
        skip = raw.get("skip_prefix_cache", False)
        if not isinstance(skip, bool):
            raise self.error(index, "skip_prefix_cache", f"must be true or false, got {got(skip)}")
        if resumable and mm:
            raise self.error(
                index, "mm", "encoder inputs of a streaming-input session are not modelled yet"
            )
        if resumable:
            self.sessions.add(req)
        self.requests[req] = ("waiting", f"arrived at step {index}")
        return EngineStep(
            "arrive",
            index,
            req=req,
            prompt=prompt,
            max_tokens=max_tokens,
            cache_salt=salt,
            lora=lora,
            mm=mm,
            follows=follows,
            remote=remote,
            resumable=resumable,
            priority=priority,
            skip_prefix_cache=skip,
        )

    def engine_lora(self, index: int, raw: Mapping[Any, Any]) -> str:
        """An arrival's LoRA adapter (`lora`, by name; "" for none), only
        under a LoRA config: vLLM's engine without one refuses such a
        request before the Scheduler sees it."""
        if "lora" not in raw:
            return ""
        lora = self.text(index, "lora", raw["lora"])
        assert self.config is not None
        if not self.config.max_loras:
            raise self.error(
                index,
                "lora",
                f"adapter {lora!r} needs config.max_loras of 1 or more (an engine without a "
                "LoRA config refuses a request with an adapter)",
            )
        return lora

    def engine_priority(self, index: int, raw: Mapping[Any, Any]) -> int:
        """An arrival's `priority`: an integer, other than 0 only under the
        priority policy (the FCFS one ignores it)."""
        priority = raw.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise self.error(index, "priority", f"must be an integer, got {got(priority)}")
        assert self.config is not None
        if priority and self.config.scheduling_policy != "priority":
            raise self.error(
                index,
                "priority",
                "needs config.scheduling_policy: priority (the fcfs policy ignores it)",
            )
        return priority

    def engine_mm(self, index: int, raw: object, prompt_tokens: int) -> tuple[MmItem, ...]:
        """An arrival's `mm`: placeholders inside its prompt, each item's
        length the same wherever its id appears (vLLM fails a request whose
        item disagrees with the encoder cache's copy of it)."""
        assert self.config is not None
        if self.config.async_scheduling:
            raise self.error(index, "mm", "encoder inputs under async scheduling are not modelled")
        items = self.mm(index, raw)
        for i, item in enumerate(items):
            if item.end > prompt_tokens:
                raise self.error(
                    index,
                    f"mm[{i}]",
                    f"placeholder {item.offset}..{item.end} ends past the {prompt_tokens:,} "
                    "tokens its prompt surely holds",
                )
            known = self.mm_lengths.setdefault(item.identifier, item.length)
            if known != item.length:
                raise self.error(
                    index,
                    f"mm[{i}].length",
                    f"item {item.identifier!r} is {known} tokens long where it appeared "
                    f"before, not {item.length}",
                )
        return items

    def engine_resumable(self, index: int, raw: Mapping[Any, Any]) -> bool:
        """An arrival's `resumable`: a streaming-input session, refused by
        name where the scheduler model does not follow one yet."""
        resumable = raw.get("resumable", False)
        if not isinstance(resumable, bool):
            raise self.error(index, "resumable", f"must be true or false, got {got(resumable)}")
        assert self.config is not None
        config = self.config
        unmodelled = (
            ("async_scheduling", config.async_scheduling),
            ("kv_connector", config.kv_connector),
        )
        for name, on in unmodelled:
            if resumable and on:
                raise self.error(
                    index,
                    "resumable",
                    f"a streaming-input session with config.{name} is not modelled yet",
                )
        return resumable

    def engine_chunk(self, index: int, raw: Mapping[Any, Any]) -> EngineStep:
        """A session's next input chunk (`prompt`, `max_tokens`), or its end
        (`end: true`), for a resumable request that has not ended."""
        req = self.arrived(index, "req", raw["req"])
        if req not in self.sessions:
            raise self.error(
                index, "req", f"{req!r} is not a streaming-input session (arrive with resumable)"
            )
        if self.requests[req][0] == "ended":
            raise self.error(index, "req", f"{req!r} was {self.requests[req][1]}")
        end = raw.get("end", False)
        if not isinstance(end, bool):
            raise self.error(index, "end", f"must be true or false, got {got(end)}")
        if end:
            for key in ("prompt", "max_tokens"):
                if key in raw:
                    raise self.error(index, key, "a session's end carries no input chunk")
            self.requests[req] = ("ended", f"ended its session at step {index}")
            return EngineStep("chunk", index, req=req, end=True)
        for key in ("prompt", "max_tokens"):
            if key not in raw:
                raise self.error(index, key, "missing (or write end: true to end the session)")
        prompt = self.prompt(index, raw["prompt"])
        copied = [i for i, s in enumerate(prompt) if s.req is not None]
        if copied:
            raise self.error(
                index,
                f"prompt[{copied[0]}]",
                "a chunk's prompt takes fresh and tokens segments only",
            )
        max_tokens = self.output_length(index, raw)
        written = sum(s.count + len(s.token_ids) for s in prompt)
        budget = self.budget
        # The session keeps every output token but its last, then the chunk.
        least = budget.prompt_least[req] + written
        self.within_model_len(
            index,
            f"the session's {least:,} tokens + {max_tokens:,} output tokens",
            least + max_tokens,
            "vLLM would stop the session there",
        )
        budget.prompt_least[req] = least
        budget.prompt_most[req] += max(0, budget.output_most[req] - 1) + written
        budget.output_most[req] = max_tokens
        return EngineStep("chunk", index, req=req, prompt=prompt, max_tokens=max_tokens)

    def within_model_len(self, index: int, what: str, tokens: int, why: str) -> None:
        """A request's tokens with its output within `max_model_len`."""
        assert self.config is not None
        if tokens > self.config.max_model_len:
            raise self.error(
                index,
                "max_tokens",
                f"{what}, more than config.max_model_len {self.config.max_model_len:,} ({why})",
            )

    def output_length(self, index: int, raw: Mapping[Any, Any]) -> int:
        """An entry's `max_tokens`: at least one token."""
        max_tokens = raw["max_tokens"]
        if not is_count(max_tokens) or max_tokens == 0:
            raise self.error(index, "max_tokens", f"must be an integer >= 1, got {got(max_tokens)}")
        return int(max_tokens)

    def engine_remote(
        self, index: int, raw: Mapping[Any, Any], prompt_tokens: int
    ) -> RemoteHit | None:
        """An arrival's `remote_hit`, `remote_async`, `remote_delay`,
        `remote_fails`: what the KV connector's external store holds of the
        request and how its load goes (None: nothing)."""
        given = [k for k in REMOTE_FIELDS if k in raw]
        if not given:
            return None
        assert self.config is not None
        if not self.config.kv_connector:
            raise self.error(index, given[0], "needs config.kv_connector: true")
        tokens = raw.get("remote_hit", 0)
        load_async = raw.get("remote_async", False)
        delay = raw.get("remote_delay", 0)
        if not isinstance(load_async, bool):
            raise self.error(index, "remote_async", f"must be true or false, got {got(load_async)}")
        # A real connector leaves the last prompt token to compute unless it
        # loads asynchronously.
        most = prompt_tokens if load_async else prompt_tokens - 1
        if not is_count(tokens) or tokens > most:
            raise self.error(
                index,
                "remote_hit",
                f"must be an integer 0..{most} (its prompt holds at least {prompt_tokens} tokens"
                + ("" if load_async else ", less the one a sync load leaves to compute")
                + f"), got {got(tokens)}",
            )
        if not is_count(delay) or delay > self.limits.steps:
            raise self.error(
                index,
                "remote_delay",
                f"must be an integer 0..{self.limits.steps} (engine steps), got {got(delay)}",
            )
        if delay and not load_async:
            raise self.error(index, "remote_delay", "applies to an async load: remote_async: true")
        fails = raw.get("remote_fails", False)
        if not isinstance(fails, bool):
            raise self.error(index, "remote_fails", f"must be true or false, got {got(fails)}")
        if fails and not (load_async and tokens):
            raise self.error(
                index,
                "remote_fails",
                "applies to an async load of at least one token: remote_async, remote_hit >= 1",
            )
        undecided = raw.get("remote_undecided", 0)
        if not is_count(undecided) or undecided > self.limits.steps:
            raise self.error(
                index,
                "remote_undecided",
                f'must be an integer 0..{self.limits.steps} (questions answered "not yet"), '
                f"got {got(undecided)}",
            )
        return RemoteHit(tokens, load_async, delay, fails, undecided)

    def arrived(self, index: int, field: str, value: object) -> str:
        """`value` names a request that has arrived."""
        if not isinstance(value, str) or value not in self.requests:
            raise self.error(index, field, f"names no request that has arrived: {got(value)}")
        return value

    def reset_expect(self, index: int, raw: Mapping[Any, Any]) -> dict[str, Any]:
        expect = raw.get("expect", {})
        if not isinstance(expect, dict):
            raise self.error(index, "expect", f"must be a mapping, got {got(expect)}")
        self.unknown_keys(index, "expect.", expect, RESET_EXPECT_KEYS, "expect key of reset")
        if "ok" in expect and not isinstance(expect["ok"], bool):
            raise self.error(index, "expect.ok", f"must be true or false, got {got(expect['ok'])}")
        checked = dict(expect)
        if "waiting" in expect:
            if not isinstance(expect["waiting"], list):
                raise self.error(
                    index,
                    "expect.waiting",
                    f"must be a list of request names, got {got(expect['waiting'])}",
                )
            checked["waiting"] = [
                self.arrived(index, "expect.waiting", r) for r in expect["waiting"]
            ]
        return checked

    def engine_expect(self, index: int, raw: object) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise self.error(index, "expect", f"must be a mapping, got {got(raw)}")
        self.unknown_keys(index, "expect.", raw, ENGINE_EXPECT_KEYS, "expect key of engine op step")
        expect: dict[str, Any] = {}
        for key, value in raw.items():
            field = f"expect.{key}"
            if key == "scheduled":
                if not isinstance(value, list) or not all(
                    isinstance(p, list) and len(p) == 2 and is_count(p[1]) and p[1] > 0
                    for p in value
                ):
                    raise self.error(
                        index, field, f"must be a list of [request, tokens >= 1], got {got(value)}"
                    )
                expect[key] = [(self.arrived(index, field, r), n) for r, n in value]
            elif key in ("preempted", "finished"):
                if not isinstance(value, list):
                    raise self.error(
                        index, field, f"must be a list of request names, got {got(value)}"
                    )
                expect[key] = [self.arrived(index, field, r) for r in value]
            elif key == "events":
                if not (isinstance(value, list) and all(isinstance(e, str) for e in value)):
                    raise self.error(
                        index, field, f"must be a list of event lines, got {got(value)}"
                    )
                assert self.config is not None
                if not self.config.kv_events:
                    raise self.error(
                        index, field, "needs config.kv_events: the Scheduler publishes none"
                    )
                expect[key] = list(value)
            elif key == "encoded":
                if not isinstance(value, dict) or not all(
                    isinstance(v, list) and all(is_count(i) for i in v) for v in value.values()
                ):
                    raise self.error(
                        index,
                        field,
                        f"must map request names to lists of item indices, got {got(value)}",
                    )
                expect[key] = {self.arrived(index, field, r): list(v) for r, v in value.items()}
            else:
                if not isinstance(value, dict) or not all(is_count(n) for n in value.values()):
                    raise self.error(
                        index,
                        field,
                        f"must map request names to token counts >= 0, got {got(value)}",
                    )
                expect[key] = {self.arrived(index, field, r): n for r, n in value.items()}
        return expect
