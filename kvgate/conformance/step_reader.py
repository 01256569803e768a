"""A manager-level trace's `steps` read: each op's fields as the action
table (`ops.py`) declares them, its `expect`, and each request's life.

- Step indices count from 0: `step 3` is `steps[3]`.
- A `check` step's keys are fields of the step: `{op: check, free_blocks: 3}`.
  Its `holds` is the whole holds map (requests with `{}` count as holding
  nothing), and its group ids must be `mamba_align` groups.
- A request's life: `arrive` once; `free` with `finish`/`abort` ends it; `pop`
  leaves only `release`, which ends it. `all_of`/`prompt_of` may name any
  request that has arrived, ended or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgate.conformance.field_reader import FieldReader, got, is_count
from kvgate.conformance.limits import LimitError, over
from kvgate.vocabulary.ops import (
    ACTIONS,
    CHECK_KEYS,
    CONNECTOR_FIELDS,
    EXPECT_TYPES,
    FIELD_TYPES,
    FREE_HOW,
    Action,
    Phase,
    Step,
    next_phase,
    out_of_phase,
    read_step,
    step_state,
)
from kvgate.vocabulary.tokens import MmItem

# Every op's name, in the action table's order (an unknown op's error lists them).
_OPS = tuple(ACTIONS)
# The keys each op's step may have, in the order its error lists them.
_FIELDS = {
    name: ("op", *a.required, *a.optional, *(("expect",) if a.expect_keys else ()))
    for name, a in ACTIONS.items()
}
# The same as sets, and each op's required keys, for the common case (every key known).
_ALLOWED = {name: frozenset(keys) for name, keys in _FIELDS.items()}
_REQUIRED = {name: frozenset(a.required) for name, a in ACTIONS.items()}
# The ops whose fields read nothing of the trace so far (a prompt reads the
# requests before it and the token budget): a line of one of them that
# repeats an earlier line reads the same, so its fields are checked once.
_SELF_CONTAINED = frozenset(
    name for name, keys in _FIELDS.items() if all(FIELD_TYPES.get(k) != "prompt" for k in keys)
)
# How the validator says when a request arrived, was popped or ended.
_VERBS = {"arrive": "arrived", "pop": "popped", "release": "released"}
_ENDED_BY = {"finish": "finished", "abort": "aborted"}
# A request not yet arrived: its phase, and since when.
_ABSENT: tuple[Phase, str] = ("absent", "")


class _Line:
    """A step's line read and checked, with what each step it stands for
    needs from it: its op, fields and `expect`, the request whose life it
    moves and how, what it charges to the budget, what its steps share
    (`state`). A line of a self-contained op that repeats an earlier one
    shares it."""

    __slots__ = (
        "raw",
        "action",
        "values",
        "expect",
        "req",
        "how",
        "after",
        "arrive",
        "charge",
        "decodes",
        "accepted",
        "mm",
        "state",
    )

    def __init__(
        self, raw: object, action: Action, values: dict[str, Any], expect: dict[str, Any]
    ) -> None:
        op = action.name
        self.raw = raw  # kept alive, so that its identity names it
        self.action = action
        self.values = values
        self.expect = expect
        # The request whose life the step moves (None: it names none), and
        # its phase after the step from each phase the step is valid in.
        req = values.get("req")
        self.req: str | None = req if isinstance(req, str) and action.valid_in else None
        how = values.get("how")
        self.how: str | None = how if isinstance(how, str) else None
        self.after: dict[Phase, Phase] = {
            phase: next_phase(op, phase, self.how) for phase in action.valid_in
        }
        # What it charges to the budget: a prompt, primitive steps (a
        # `decode` is 3 a repeat), decodes and the drafts they accept.
        self.arrive = op == "arrive"
        repeats = values["steps"] if op == "decode" else 1
        self.charge: int = 3 * repeats if op == "decode" else 1
        self.decodes: int = repeats if op in ("decode", "decode1") else 0
        self.accepted: int = values.get("accepted", 0)
        self.mm: tuple[MmItem, ...] = values.get("mm", ())
        self.state = step_state(op, values)


class StepReader(FieldReader):
    """Reads a manager-level trace's steps, one at a time, in order."""

    def steps(self, raw_steps: list[Any]) -> tuple[Step, ...]:
        """Every step of a document, in order. A long trace repeats a few
        hundred distinct lines, which its loader reads into shared objects
        (`strict_yaml.load_flow_body`): each is checked once, and each step
        of it only for what depends on the steps before it (its request's
        life, the budget)."""
        read: dict[int, _Line] = {}
        step = self.step
        return tuple([step(i, raw, read) for i, raw in enumerate(raw_steps)])

    def step(
        self,
        index: int,
        raw: object,
        read: dict[int, _Line] | None = None,
    ) -> Step:
        """Step `index`; `read`, if given, keeps each line read so far (by
        the identity of its object, which it keeps alive)."""
        line = None if read is None else read.get(id(raw))
        if line is None:
            raw, op = self.op_of(index, raw, _OPS, "op")
            if op == "check":
                return self.check_step(index, raw)
            action = ACTIONS[op]
            line = _Line(raw, action, *self.step_fields(index, action, raw))
            if read is not None and op in _SELF_CONTAINED:
                read[id(raw)] = line
        if line.req is not None:
            self.track_request(index, line)
        self.count(index, line)
        if line.mm:
            self.mm_inside_prompt(index, line.values["req"], line.mm)
        return read_step(line.state, index, line.expect.copy())

    def step_fields(
        self, index: int, action: Action, raw: dict[Any, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """A step's fields and its `expect`, checked as far as they do not
        depend on the steps before it."""
        op = action.name
        if not raw.keys() <= _ALLOWED[op]:
            self.unknown_keys(index, "", raw, _FIELDS[op], f"field of {op}")
        if not _REQUIRED[op] <= raw.keys():
            self.missing_keys(index, "", raw, action.required)
        values = {
            key: self.field(index, key, value)
            for key, value in raw.items()
            if key != "op" and key != "expect"
        }
        assert self.config is not None
        if not self.config.kv_connector:
            for key in CONNECTOR_FIELDS:
                if key in values:
                    raise self.error(index, key, "needs config.kv_connector: true")
        if values.get("load_failed"):
            self.load_failure(index, op, values)
        if values.get("invalid_blocks"):
            self.block_failure(index, op, values)
        if values.get("accepted", 0) > values.get("spec", 0):
            raise self.error(
                index,
                "accepted",
                f"{values['accepted']} drafts accepted of the {values.get('spec', 0)} the step "
                "proposes (spec)",
            )
        return values, self.expect(index, action, raw.get("expect", {}))

    def load_failure(self, index: int, op: str, values: Mapping[str, Any]) -> None:
        """A failed load is written where its policy puts it: under
        `recompute` on the lookup that retries the request, under `fail` on
        the `free` that ends it (as an abort: the Scheduler's error finish
        frees the request the same way)."""
        assert self.config is not None
        policy = self.config.kv_load_failure_policy
        if op == "free":
            if policy != "fail":
                raise self.error(
                    index,
                    "load_failed",
                    f"a free for a failed load needs kv_load_failure_policy: fail (under "
                    f"{policy} the scheduler retries: write load_failed on the lookup)",
                )
            if values.get("how") != "abort":
                raise self.error(
                    index,
                    "load_failed",
                    "a request failed by its KV load ends as an abort: write how: abort",
                )
        elif policy == "fail":
            raise self.error(
                index,
                "load_failed",
                f"under kv_load_failure_policy fail the request is not retried: write "
                f"load_failed on its free (how: abort), not on a {op}",
            )

    def block_failure(self, index: int, op: str, values: Mapping[str, Any]) -> None:
        """Failed blocks of a load, where its policy puts them (as a failed
        load's): under `recompute` on the `allocate` that schedules the
        request again, under `fail` on the `free` that ends it."""
        assert self.config is not None
        config = self.config
        if not config.kv_connector:
            raise self.error(index, "invalid_blocks", "needs config.kv_connector: true")
        if len(config.groups) > 1:
            # vLLM's own refusal: block ids are per group, so its Scheduler
            # raises (RuntimeError in `_handle_invalid_blocks`) on a model
            # with several KV-cache groups.
            raise self.error(
                index,
                "invalid_blocks",
                f"vLLM refuses block-level load failures on a model with several KV-cache "
                f"groups ({len(config.groups)} here; its Scheduler raises RuntimeError): "
                "a connector reports the load failed as a whole (load_failed)",
            )
        policy = config.kv_load_failure_policy
        if op == "free":
            if policy != "fail":
                raise self.error(
                    index,
                    "invalid_blocks",
                    f"failed blocks end the request only under kv_load_failure_policy: fail "
                    f"(under {policy} write them on the request's next allocate)",
                )
            if values.get("how") != "abort" or values.get("load_failed"):
                raise self.error(
                    index,
                    "invalid_blocks",
                    "a request failed by failed blocks ends as an abort: write how: abort, "
                    "without load_failed",
                )
        elif policy == "fail":
            raise self.error(
                index,
                "invalid_blocks",
                "under kv_load_failure_policy fail the request is not rescheduled: write "
                "invalid_blocks on its free (how: abort), not on an allocate",
            )

    def mm_inside_prompt(self, index: int, req: str, items: tuple[MmItem, ...]) -> None:
        """Every placeholder ends inside the prompt, as far as its length is
        known here (a copied output's length is known at `arrive`, where the
        driver checks it again)."""
        most = self.budget.prompt_most[req]
        for i, item in enumerate(items):
            if item.end > most:
                raise self.error(
                    index,
                    f"mm[{i}]",
                    f"placeholder {item.offset}..{item.end} ends past the prompt "
                    f"(at most {most:,} tokens)",
                )

    def count(self, index: int, line: _Line) -> None:
        """Charge the step to the trace's budget (before `decode` is expanded)."""
        budget = self.budget
        try:
            if line.arrive:
                budget.arrive(line.values["req"], line.values["prompt"])
            budget.add_steps(line.charge, "steps")
            if line.decodes:
                budget.decoded(line.values["req"], line.decodes, line.accepted)
        except LimitError as error:
            raise self.error(index, error.field, error.message) from None

    def field(self, index: int, key: str, value: object) -> Any:
        kind = FIELD_TYPES[key]
        if kind == "req":
            if not isinstance(value, str) or not value:
                raise self.error(index, key, f"must be a request name (a string), got {got(value)}")
            return value
        if kind == "prompt":
            return self.prompt(index, value)
        if kind == "text":
            return self.text(index, key, value)
        if kind == "mm":
            return self.mm(index, value)
        if kind == "indices":
            if (
                not isinstance(value, list)
                or not value
                or not all(is_count(v) for v in value)
                or any(a >= b for a, b in zip(value, value[1:], strict=False))
            ):
                raise self.error(
                    index,
                    key,
                    f"must be a non-empty, increasing list of block indices >= 0, got {got(value)}",
                )
            return tuple(value)
        if kind == "bool":
            if not isinstance(value, bool):
                raise self.error(index, key, f"must be true or false, got {got(value)}")
            return value
        if kind == "int":
            if not is_count(value):
                raise self.error(index, key, f"must be an integer >= 0, got {got(value)}")
            if key in ("lookahead", "spec") and value > getattr(self.limits, key):
                raise self.error(index, key, over(key, value, self.limits))
            return value
        assert self.config is not None
        if kind == "int_or_auto":
            if value != "auto" and not (is_count(value) and value != 0):
                raise self.error(index, key, f"must be an integer >= 1 or auto, got {got(value)}")
            if isinstance(value, int) and value > self.config.max_model_len:
                raise self.error(
                    index,
                    key,
                    f"{value:,} tokens in one allocation, more than config.max_model_len "
                    f"{self.config.max_model_len:,}",
                )
            return value
        if kind == "int_or_all":
            if value != "all" and not is_count(value):
                raise self.error(index, key, f"must be an integer >= 0 or all, got {got(value)}")
            if isinstance(value, int) and value >= self.config.num_blocks:
                raise self.error(
                    index,
                    key,
                    f"{value:,} blocks, more than the pool's {self.config.num_blocks - 1:,} "
                    "(config.num_blocks less the null block)",
                )
            return value
        if value not in FREE_HOW:
            raise self.error(index, key, f"{got(value)} is not one of {', '.join(FREE_HOW)}")
        return value

    def expect(self, index: int, action: Action, raw: object) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise self.error(index, "expect", f"must be a mapping, got {got(raw)}")
        self.unknown_keys(index, "expect.", raw, action.expect_keys, f"expect key of {action.name}")
        expect: dict[str, Any] = {}
        for key, value in raw.items():
            kind = EXPECT_TYPES[key]
            field = f"expect.{key}"
            if kind == "int" and not is_count(value):
                raise self.error(index, field, f"must be an integer >= 0, got {got(value)}")
            if kind == "bool" and not isinstance(value, bool):
                raise self.error(index, field, f"must be true or false, got {got(value)}")
            if kind == "copies":
                value = self.copies(index, field, value)
            if kind == "events" and not (
                isinstance(value, list) and all(isinstance(e, str) for e in value)
            ):
                raise self.error(index, field, f"must be a list of event lines, got {got(value)}")
            if kind == "counts" and not (
                isinstance(value, list) and all(is_count(n) for n in value)
            ):
                raise self.error(index, field, f"must be a list of integers >= 0, got {got(value)}")
            expect[key] = value
        return expect

    def copies(self, index: int, field: str, raw: object) -> tuple[tuple[int, int], ...]:
        pairs = raw if isinstance(raw, list) else None
        if pairs is None or not all(
            isinstance(p, list) and len(p) == 2 and all(is_count(i) for i in p) for p in pairs
        ):
            raise self.error(
                index, field, f"must be a list of [src, dst] block-id pairs, got {got(raw)}"
            )
        return tuple((p[0], p[1]) for p in pairs)

    def check_step(self, index: int, raw: dict[Any, Any]) -> Step:
        keys = [k for k in raw if k != "op"]
        self.unknown_keys(index, "", {k: None for k in keys}, CHECK_KEYS, "check key")
        if not keys:
            raise self.error(
                index, "op", f"check compares nothing (give one of {', '.join(CHECK_KEYS)})"
            )
        check: dict[str, Any] = {}
        for key in keys:
            value = raw[key]
            if key == "pool_clean" and not isinstance(value, bool):
                raise self.error(index, key, f"must be true or false, got {got(value)}")
            if key == "free_blocks" and not is_count(value):
                raise self.error(index, key, f"must be an integer >= 0, got {got(value)}")
            if key == "holds":
                value = self.holds(index, value)
            if key == "ref":
                value = self.ref_check(index, value)
            if key == "attention_cached":
                value = self.requests_mapping(index, key, value)
                for req, n in value.items():
                    if not is_count(n):
                        raise self.error(
                            index, f"{key}.{req}", f"must be an integer >= 0, got {got(n)}"
                        )
            check[key] = value
        return Step("check", index, check=check)

    def ref_check(self, index: int, raw: object) -> dict[str, dict[int, dict[int, int | None]]]:
        """`{R: {G: {P: N or null}}}`: ref counts of states keyed at R's prefix."""
        out: dict[str, dict[int, dict[int, int | None]]] = {}
        for req, groups in self.requests_mapping(index, "ref", raw).items():
            if not isinstance(groups, dict) or not groups:
                raise self.error(
                    index, f"ref.{req}", f"must map group ids to positions, got {got(groups)}"
                )
            out[req] = {}
            for group, positions in groups.items():
                where = f"ref.{req}.{group}"
                assert self.config is not None
                if not is_count(group) or group >= len(self.config.groups):
                    raise self.error(index, where, "names no group of the config")
                if not isinstance(positions, dict) or not positions:
                    raise self.error(
                        index,
                        where,
                        f"must map token positions to ref counts, got {got(positions)}",
                    )
                for position, n in positions.items():
                    if not is_count(position) or position == 0:
                        raise self.error(
                            index, f"{where}.{position}", "must be a token position > 0"
                        )
                    if n is not None and not is_count(n):
                        raise self.error(
                            index,
                            f"{where}.{position}",
                            f"must be a ref count >= 0 or null, got {got(n)}",
                        )
                out[req][group] = dict(positions)
        return out

    def requests_mapping(self, index: int, field: str, raw: object) -> dict[str, Any]:
        """A mapping keyed by the names of requests that have arrived."""
        if not isinstance(raw, dict):
            raise self.error(index, field, f"must be a mapping of request names, got {got(raw)}")
        for req in raw:
            if not isinstance(req, str) or req not in self.requests:
                raise self.error(index, f"{field}.{req}", "names no request that has arrived")
        return dict(raw)

    def holds(self, index: int, raw: object) -> dict[str, dict[int, int]]:
        assert self.config is not None
        mamba = self.config.mamba_group_ids
        holds: dict[str, dict[int, int]] = {}
        for req, by_group in self.requests_mapping(index, "holds", raw).items():
            where = f"holds.{req}"
            if not isinstance(by_group, dict):
                raise self.error(
                    index, where, f"must be a mapping {{group: position}}, got {got(by_group)}"
                )
            for group, position in by_group.items():
                if group not in mamba or not is_count(group):
                    raise self.error(
                        index,
                        f"{where}.{group}",
                        f"is not a mamba_align group id (those are {', '.join(map(str, mamba))})",
                    )
                if not is_count(position):
                    raise self.error(
                        index,
                        f"{where}.{group}",
                        f"must be a token position >= 0, got {got(position)}",
                    )
            holds[req] = dict(by_group)
        return holds

    def track_request(self, index: int, line: _Line) -> None:
        """Enforce a request's life as the action table declares it."""
        req = line.req
        assert req is not None
        phase, since = self.requests.get(req, _ABSENT)
        after = line.after.get(phase)
        op = line.action.name
        if after is None:
            raise self.error(index, "req", out_of_phase(op, req, phase, since))
        if after == phase:
            return  # the same life since the same step (no op leaves `absent` as it is)
        if after in ("popped", "ended") or phase == "absent":
            verb = _ENDED_BY.get(str(line.how), "") if op == "free" else _VERBS[op]
            since = f"{verb} at step {index}"
        self.requests[req] = (after, since)
