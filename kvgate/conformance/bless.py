"""Fill or refresh a trace's expected values from the model (`kvgate bless`).

The model replays the trace as the target (`replay.replay`, told what each
step observed), and what it reports becomes the steps' values:

- a step with `expect` keeps exactly the keys written, their values refreshed;
- a step without `expect` (or with an empty one) gets every value its op
  reports (the action table's `expect` keys), except a lookup's connector
  values (`local_hit`, `external`) in a trace without a KV connector;
- a `check` step keeps its keys, their values refreshed;
- ops that report nothing (`arrive`, `step`, `decode`, ...) are left alone.

A scheduler-level trace's engine entries are blessed alike (`bless_engine`):
an engine `step` with `expect` keeps its keys (`cached_tokens` and `encoded`
their requests), one without gets what the step scheduled and every other
value the step reported (its preemptions, finished requests, prefills'
cached tokens, encoder inputs, KV-cache events); a prefix-cache `reset`
gets whether it reset and the waiting queue. An entry of several steps
(`steps: N`) expects nothing and is left alone.

A trace that asks for a capability (the hold, the retained-state
retention) must show it: `check_shows_capabilities` refuses one whose
expectations the model meets without the capability too, since a build
lacking it would pass such a trace.

The file is edited as text, at the places PyYAML's node marks give, so
comments, key order, macros and token notation stay as written. A value that
did not change is not touched; a nested one (a `ref` check, a list of
events) is edited element by element while its shape is unchanged. The new
text is read back through the trace reader, and must carry exactly the
values intended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

import yaml
from yaml.nodes import CollectionNode, MappingNode, Node, ScalarNode, SequenceNode

from kvgate.conformance.compare import holding, same, same_check
from kvgate.conformance.replay import replay
from kvgate.conformance.scheduler_replay import SchedulerModelFactory, replay_scheduler
from kvgate.conformance.trace import Trace, TraceError, parse_trace
from kvgate.conformance.writer import plain
from kvgate.vocabulary.ops import ACTIONS, Step
from kvgate.vocabulary.scheduling import ENGINE_EXPECT_KEYS, RESET_EXPECT_KEYS, EngineStep
from kvgate.vocabulary.target import Target

# A lookup's values that only a KV connector gives meaning to: not filled
# into a trace without one (the model reports them as 0 there).
CONNECTOR_ONLY_KEYS: tuple[str, ...] = ("local_hit", "external")


@dataclass(frozen=True)
class Blessing:
    """A trace with its values from the model: the new text, read back."""

    trace: Trace  # as it was read
    text: str  # the file's new text (the old one when nothing changed)
    blessed: Trace  # the new text, validated by the trace reader
    filled: int  # values the trace did not have
    changed: int  # values the trace had, with another value
    kept: int  # values the trace had, unchanged

    @property
    def changes(self) -> bool:
        return self.filled + self.changed > 0

    def account(self) -> str:
        """`7 values filled, 2 changed, 5 unchanged`."""
        plural = "" if self.filled == 1 else "s"
        return f"{self.filled} value{plural} filled, {self.changed} changed, {self.kept} unchanged"


def bless(trace: Trace, text: str, model: Target) -> Blessing:
    """`trace` (read from `text`) with its values from `model`, a model
    target built for its config; the caller owns (and closes) `model`.

    Raises `TraceError` for a trace that cannot be blessed (a refusal trace,
    a step the model refuses or cannot finish) and `ModelBug` when the model
    raises.
    """
    check_blessable(trace)
    observed = _observe(trace, model)
    editor, wanted = _edit(
        text,
        trace,
        (
            (step.index, _wanted(trace, step, observed.get(step.index)), step.op, step.expect)
            for step in trace.steps
        ),
    )
    new_text = editor.result()
    blessed = parse_trace(new_text, trace.path)
    _read_back(blessed, wanted)
    return Blessing(trace, new_text, blessed, editor.filled, editor.changed, editor.kept)


def bless_engine(trace: Trace, text: str, model: SchedulerModelFactory) -> Blessing:
    """Scheduler-level `trace` (read from `text`) with its engine entries'
    values from kvgate's scheduler model (`model`, its factory).

    Raises `TraceError` for a trace the model refuses or cannot finish, and
    `ModelBug` when the model raises."""
    check_blessable(trace)
    repeated = {i for i, n in Counter(e.index for e in trace.engine).items() if n > 1}
    observed: dict[int, dict[str, Any]] = {}

    def observe(event: EngineStep, values: dict[str, Any]) -> None:
        if event.index not in repeated:
            observed[event.index] = values

    replay_scheduler(trace, model, None, "strict", observe)
    editor, wanted = _edit(
        text,
        trace,
        (
            (event.index, _engine_wanted(trace, event, observed.get(event.index)), "", event.expect)
            for event in trace.engine
        ),
    )
    new_text = editor.result()
    blessed = parse_trace(new_text, trace.path)
    for event in blessed.engine:
        if event.index in wanted and _engine_values(event.expect) != wanted[event.index]:
            raise RuntimeError(
                f"{blessed.path}: engine entry {event.index}: the edited trace reads back "
                f"{event.expect!r}, not {wanted[event.index]!r}"
            )
    return Blessing(trace, new_text, blessed, editor.filled, editor.changed, editor.kept)


def _engine_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """An engine entry's expected values in the trace's form (preemptions sorted)."""
    return {k: plain(sorted(v) if k == "preempted" else v) for k, v in values.items()}


def _engine_wanted(
    trace: Trace, event: EngineStep, observed: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The values to write at engine entry `event`, by key, in the trace's form."""
    if observed is None:
        return {}
    if event.op == "reset":
        return _engine_values({k: observed[k] for k in event.expect or RESET_EXPECT_KEYS})
    if event.op != "step":
        return {}
    if not event.expect:
        # What the step scheduled, and every other value it reported.
        filled = {k: observed[k] for k in ENGINE_EXPECT_KEYS if observed[k]}
        return _engine_values({"scheduled": observed["scheduled"], **filled})
    values: dict[str, Any] = {}
    for key, written in event.expect.items():
        if key == "cached_tokens":
            unreported = [r for r in written if r not in observed[key]]
            if unreported:
                raise TraceError(
                    trace.path,
                    event.index,
                    f"expect.cached_tokens.{unreported[0]}",
                    "the model reports no prefill of it at this step",
                )
            values[key] = {r: observed[key][r] for r in written}
        elif key == "encoded":
            values[key] = {r: observed[key].get(r, []) for r in written}
        else:
            values[key] = observed[key]
    return _engine_values(values)


# The capabilities a trace may ask for: the config switch, its trace field,
# and how a refusal names it.
_CAPABILITIES: tuple[tuple[str, str, str], ...] = (
    ("hold", "retain_checkpoint", "the partial-tail hold"),
    ("retain_retired", "retain_retired", "the retained-state retention"),
)


def check_shows_capabilities(trace: Trace, meets: Callable[[Trace], bool]) -> None:
    """`TraceError` when `trace` asks for a capability none of its
    expectations shows: `meets(t)` (the model replaying `t` meets all of its
    expectations) holds with the capability switched off too, so a build
    without it would pass the trace."""
    for switch, field_name, name in _CAPABILITIES:
        if not getattr(trace.config, switch):
            continue
        if switch == "hold":
            # The retention is under the hold's switch.
            config = replace(trace.config, hold=False, retain_retired=False)
        else:
            config = replace(trace.config, retain_retired=False)
        without = replace(trace, config=config)
        if meets(without):
            raise TraceError(
                trace.path,
                None,
                f"config.{field_name}",
                f"asks for {name}, but no expectation shows it: the model without it meets "
                "every one, so a build lacking it would pass; expect a value that depends "
                "on it (a follow-up's hit or cached tokens, say)",
            )


def check_blessable(trace: Trace) -> None:
    """`TraceError` for a trace without values to bless (a refusal trace)."""
    if trace.expect_refused is not None:
        raise TraceError(
            trace.path,
            None,
            "expect_refused",
            "a refusal trace replays nothing, so it has no values to bless",
        )


def _observe(trace: Trace, model: Target) -> dict[int, dict[str, Any]]:
    """What the model reported at each written step: a primitive's
    observation, a prefill's lookup, a check's values."""
    seen: dict[int, dict[str, Any]] = {}

    def observe(step: Step, values: Mapping[str, Any]) -> None:
        if step.origin is None or (step.origin == "prefill" and step.op == "lookup"):
            seen[step.index] = dict(values)

    result = replay(trace, model, None, "strict", target_is_model=True, observe=observe)
    if result.stopped is not None:
        stop = result.stopped
        raise TraceError(
            trace.path,
            stop.step.index,
            stop.what,
            f"the model cannot run it ({stop.note or stop.expected}: {stop.actual}); "
            "there is nothing to bless",
        )
    return seen


def _wanted(trace: Trace, step: Step, observed: dict[str, Any] | None) -> dict[str, Any]:
    """The values to write at `step`, by key, in the trace's form."""
    if observed is None:
        return {}
    if step.op == "check":
        return {k: plain(holding(observed[k]) if k == "holds" else observed[k]) for k in step.check}
    keys = list(step.expect) or [
        k
        for k in ACTIONS[step.op].expect_keys
        if k in observed and (trace.config.kv_connector or k not in CONNECTOR_ONLY_KEYS)
    ]
    for key in keys:
        if key not in observed:
            raise TraceError(
                trace.path, step.index, f"expect.{key}", "the model does not report it"
            )
    return {k: plain(observed[k]) for k in keys}


def _edit(
    text: str,
    trace: Trace,
    rows: Iterable[tuple[int, dict[str, Any] | None, str, Mapping[str, Any]]],
) -> tuple[_Editor, dict[int, dict[str, Any]]]:
    """`text` edited with each row's values (index, values, op, expect): a
    check step's refreshed, values the entry already expects refreshed, the
    rest filled in; and the values written, by index, to read back."""
    editor = _Editor(text, trace)
    wanted: dict[int, dict[str, Any]] = {}
    for index, values, op, expect in rows:
        if not values:
            continue
        wanted[index] = values
        if op == "check":
            editor.refresh(index, values, check=True)
        elif expect:
            editor.refresh(index, values, check=False)
        else:
            editor.fill(index, values)
    return editor, wanted


def _read_back(blessed: Trace, wanted: Mapping[int, Mapping[str, Any]]) -> None:
    """The edited text must carry exactly the values meant: anything else is
    a bug in the editor, never written."""
    for index, values in wanted.items():
        step = blessed.steps[index]
        written = step.check if step.op == "check" else step.expect
        for key, value in values.items():
            if key not in written or not same_check(key, value, written[key]):
                raise RuntimeError(
                    f"{blessed.path}: step {index}: {key}: the edited trace reads back "
                    f"{written.get(key)!r}, not {value!r}"
                )


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: str


@dataclass
class _Editor:
    """Text edits of one trace's `expect` and `check` values."""

    text: str
    trace: Trace
    edits: list[_Edit] = field(default_factory=list)
    filled: int = 0
    changed: int = 0
    kept: int = 0

    def __post_init__(self) -> None:
        # The reader has validated the text: one mapping with a `steps` list.
        root = yaml.compose(self.text, Loader=yaml.SafeLoader)
        assert isinstance(root, MappingNode)
        steps = _value_node(root, "engine" if self.trace.scheduler_level else "steps")
        assert isinstance(steps, SequenceNode)
        self.steps: list[Node] = steps.value

    def step_node(self, index: int) -> MappingNode:
        node = self.steps[index]
        assert isinstance(node, MappingNode), "the reader accepts only mapping steps"
        return node

    def refresh(self, index: int, values: Mapping[str, Any], *, check: bool) -> None:
        """New values for keys the step has (under `expect`, or a check's own)."""
        node = self.step_node(index)
        if not check:
            expect = _value_node(node, "expect")
            if expect is None or not isinstance(expect, MappingNode):
                raise self.unwritable(index, "expect")
            node = expect
        for key, value in values.items():
            value_node = _value_node(node, key)
            if value_node is None:
                raise self.unwritable(index, key if check else f"expect.{key}")
            if same_check(key, _construct(value_node), value):
                self.kept += 1
            else:
                self.changed += 1
                self.replace(value_node, value)

    def fill(self, index: int, values: Mapping[str, Any]) -> None:
        """`expect` for a step written without values (or with `expect: {}`)."""
        node = self.step_node(index)
        expect = _value_node(node, "expect")
        if expect is None:
            self.insert(node, "expect", values)
        elif isinstance(expect, MappingNode) and not expect.value:
            self.edits.append(_Edit(expect.start_mark.index, _end(expect), _flow(dict(values))))
        else:
            raise self.unwritable(index, "expect")
        self.filled += len(values)

    def unwritable(self, index: int, where: str) -> TraceError:
        # The reader saw the value (through a YAML merge key, say) where the
        # text has none to edit.
        return TraceError(
            self.trace.path,
            index,
            where,
            "is not written in the step itself (a YAML merge key or alias?); "
            "write it out to bless it",
        )

    def replace(self, node: Node, value: Any) -> None:
        """`node`'s text now says `value`; of a mapping with the same keys or
        a list of the same length, only the entries that changed."""
        old = _construct(node)
        if same(old, value):
            return
        if (
            isinstance(node, MappingNode)
            and isinstance(value, Mapping)
            and isinstance(old, Mapping)
            and old.keys() == value.keys()
            and len(node.value) == len(value)
        ):
            for key_node, value_node in node.value:
                self.replace(value_node, value[_construct(key_node)])
            return
        if (
            isinstance(node, SequenceNode)
            and isinstance(value, list)
            and len(value) == len(node.value)
        ):
            for child, item in zip(node.value, value, strict=True):
                self.replace(child, item)
            return
        self.edits.append(_Edit(node.start_mark.index, _end(node), self.render(node, value)))

    def render(self, node: Node, value: Any) -> str:
        """`value` in the style `node` was written in."""
        if isinstance(node, CollectionNode) and not node.flow_style and value:
            # Block style, continuation lines at the node's own indentation.
            block = yaml.safe_dump(value, default_flow_style=False, sort_keys=False, width=10**6)
            indent = "\n" + " " * node.start_mark.column
            return indent.join(block.rstrip("\n").split("\n"))
        if isinstance(node, ScalarNode) and isinstance(value, str) and node.style in ("'", '"'):
            return _scalar(yaml.safe_dump(value, default_style=node.style, width=10**6))
        return _flow(value)

    def insert(self, mapping: MappingNode, key: str, value: Any) -> None:
        """Add `key: value` at the end of `mapping`."""
        entry = f"{key}: {_flow(value)}"
        if mapping.flow_style:
            start, close = mapping.start_mark.index, mapping.end_mark.index - 1
            assert self.text[close] == "}"
            at = close
            while at > start + 1 and self.text[at - 1] in " \t\r\n":
                at -= 1
            separator = ", " if at > start + 1 else ""
            self.edits.append(_Edit(at, at, separator + entry))
            return
        # Block style: a line after the mapping's last, at its keys' indentation.
        end = _end(mapping)
        line_end = self.text.find("\n", end)
        at = len(self.text) if line_end < 0 else line_end
        indent = " " * mapping.value[0][0].start_mark.column
        self.edits.append(_Edit(at, at, f"\n{indent}{entry}"))

    def result(self) -> str:
        """The text with every edit applied; overlapping edits (one value
        shared through a YAML alias) are refused."""
        ordered = sorted(self.edits, key=lambda e: (e.start, e.end))
        for before, after in zip(ordered, ordered[1:], strict=False):
            if after.start < before.end:
                raise TraceError(
                    self.trace.path,
                    None,
                    "yaml",
                    "two of the values to bless share one place in the text "
                    "(a YAML alias); write them out to bless them",
                )
        text = self.text
        for edit in reversed(ordered):
            text = text[: edit.start] + edit.text + text[edit.end :]
        return text


def _value_node(mapping: MappingNode, key: object) -> Node | None:
    """The node of `key`'s value in `mapping` as written (merge keys aside)."""
    for key_node, value_node in mapping.value:
        if isinstance(key_node, ScalarNode) and _construct(key_node) == key:
            return cast(Node, value_node)
    return None


def _construct(node: Node) -> Any:
    return yaml.constructor.SafeConstructor().construct_object(node, deep=True)


def _end(node: Node) -> int:
    """Where `node`'s own text ends: a block collection's mark runs on to the
    next token (past comments and blank lines), so its last entry's end."""
    if isinstance(node, CollectionNode) and not node.flow_style and node.value:
        last = node.value[-1]
        return _end(last[1] if isinstance(node, MappingNode) else last)
    return int(node.end_mark.index)


def _flow(value: Any) -> str:
    """`value` as one line of flow YAML, as traces write their steps."""
    return _scalar(yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6))


def _scalar(dumped: str) -> str:
    # A lone scalar is dumped as a document: drop its end marker.
    text = dumped.rstrip("\n")
    return text.removesuffix("\n...").rstrip("\n")
