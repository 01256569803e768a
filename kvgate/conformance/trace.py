"""Trace format version 1: read a YAML trace, validate all of it, expand macros.

The format (trace-format.md) is a contract; this module is its only reader.
Everything is checked before anything is replayed, and every problem is a
`TraceError` that names the file, the step and the field in one line.

Choices the format leaves to the reader, fixed here:

- `config`: each field's default is its row's in `schema.CONFIG_FIELDS`
  (docs/reference/knobs.md lists them). `retention_interval` must be
  written (`null` = unset), because null and 0 are different modes and a
  silent default would hide which one a trace tests.
- Step indices count from 0: `step 3` is `steps[3]`.
- A `check` step's keys are fields of the step: `{op: check, free_blocks: 3}`.
  Its `holds` is the whole holds map (requests with `{}` count as holding
  nothing), and its group ids must be `mamba_align` groups.
- A request's life: `arrive` once; `free` with `finish`/`abort` ends it; `pop`
  leaves only `release`, which ends it. `all_of`/`prompt_of` may name any
  request that has arrived, ended or not.

Macros expand in `macros.py`: `Trace.primitives` has each `decode`
expanded and each `prefill` kept whole, since its loop's length depends on
the target's chunk split.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard, cast

import yaml
from yaml.nodes import MappingNode

from kvgate.conformance.config import (
    GROUP_KINDS,
    Config,
    GroupConfig,
    GroupKind,
    UnsupportedConfig,
    validate,
)
from kvgate.conformance.limits import (
    DEFAULT_LIMITS,
    INT_DIGITS,
    TOKEN_ID_BOUND,
    LimitError,
    Limits,
    TraceBudget,
    over,
    read_bounded,
)
from kvgate.conformance.macros import expand
from kvgate.conformance.ops import (
    ACTIONS,
    CHECK_KEYS,
    CONNECTOR_FIELDS,
    EXPECT_TYPES,
    FIELD_TYPES,
    FREE_HOW,
    Action,
    Phase,
    Segment,
    Step,
    next_phase,
    out_of_phase,
)
from kvgate.conformance.scheduling import (
    ENGINE_EXPECT_KEYS,
    ENGINE_OPS,
    RESET_EXPECT_KEYS,
    EngineSettings,
    EngineStep,
    RemoteHit,
)
from kvgate.conformance.schema import (
    CONFIG_FIELDS,
    CONFIG_KEYS,
    FORMAT,
    GROUP_KEYS,
    REQUIRED_KEYS,
    ConfigField,
)
from kvgate.conformance.tokens import MmItem
from kvgate.errors import KvgateError, printable

_REQUIRED_KEYS = ("format", "name", "config", "steps")
_OPTIONAL_KEYS = ("about", "expect_refused", "tags")
# A scheduler-level trace: engine steps instead of manager steps.
_ENGINE_REQUIRED_KEYS = ("format", "name", "config", "engine")
_ENGINE_OPTIONAL_KEYS = ("about", "tags", "scheduler", "recording", "end")
_SCHEDULER_KEYS = ("spec", "max_num_seqs")
# A recording (kvgate's recorder wrote it): where it came from, and its last
# line, `end`, which counts its `engine` entries so a cut file is detected.
_RECORDING_KEYS = ("vllm", "part", "warm")
_END_KEYS = ("entries",)
# A recording's entry lines, as the recorder writes them: one flow mapping each.
_ENTRY_PREFIX = "  - {"
PARTIAL_HINT = "--partial replays the {n} entries recorded before it"

# The config keys as errors list them: the required ones first.
_CONFIG_KEYS = REQUIRED_KEYS + tuple(k for k in CONFIG_KEYS if k not in REQUIRED_KEYS)
_SEGMENT_KINDS = ("fresh", "all_of", "prompt_of", "tokens")

# How much of a field (a key path, perhaps a hostile key) an error line shows.
FIELD_WIDTH = 80
# How long a trace name may be: it heads report lines and names JUnit cases.
NAME_WIDTH = 200
# A tag: a word `-k` can select by (letters, digits, `_ . + -`), and how
# many a trace may carry.
TAG_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
MAX_TAGS = 32
# The words a report's verdict lines start with (report.trace_line).
VERDICT_WORDS = ("PASS", "FAIL", "LACKS", "SKIP", "ERROR")


class TraceError(KvgateError, ValueError):
    """An invalid trace: one line, `<file>: step <i>: <field>: <message>`.

    `step_index` is None for document-level problems (the `step <i>` part is
    then left out). Raised by the loader, and by a replay when a target
    refuses a step the trace should not have asked for.
    """

    def __init__(self, path: str | Path, step_index: int | None, field: str, message: str) -> None:
        # One line whatever the message holds (YAML errors span several).
        self.path = Path(path)
        self.step_index = step_index
        self.field = field
        self.message = " ".join(message.split())
        super().__init__(str(self))

    def __str__(self) -> str:
        # A key or a path from the input may hold a newline or an escape
        # sequence: escaped, the error stays one physical line that says
        # only what it means. A field is a key path, short unless hostile.
        step = "" if self.step_index is None else f"step {self.step_index}: "
        field = self.field if len(self.field) <= FIELD_WIDTH else self.field[:FIELD_WIDTH] + "..."
        return printable(f"{self.path}: {step}{field}: {self.message}")

    @classmethod
    def unsupported(cls, path: str | Path, error: UnsupportedConfig) -> TraceError:
        """A config a target (or the model, or `validate`) will not run."""
        return cls(path, None, f"config.{error.field}", error.message)


@dataclass(frozen=True)
class Trace:
    """A validated trace.

    `steps` are the steps as written, macros included; `primitives` are what
    the replayer runs: primitive ops, `decode` expanded, `prefill` kept whole.
    """

    name: str
    about: str
    config: Config
    steps: tuple[Step, ...]
    primitives: tuple[Step, ...]
    path: Path
    # A refusal trace (`expect_refused`): the config key every target must
    # refuse the config by (vLLM's own refusal; the model states the rule).
    # Such a trace has no steps.
    expect_refused: str | None = None
    # Words `-k` selects by besides the name (optional field `tags`).
    tags: tuple[str, ...] = ()
    # A scheduler-level trace (`engine` instead of `steps`): its engine
    # steps and settings; `steps` and `primitives` are then empty.
    engine: tuple[EngineStep, ...] = ()
    scheduler: EngineSettings | None = None
    # A recording read with `partial`: what cut it short (its entries before
    # the cut are `engine`); empty for a whole trace.
    cut: str = ""

    @property
    def scheduler_level(self) -> bool:
        """Replayed on a whole scheduler, not on a manager."""
        return self.scheduler is not None


def load_trace(path: str | Path, limits: Limits = DEFAULT_LIMITS, partial: bool = False) -> Trace:
    """Read and validate the trace in file `path` (a regular file within the
    limits: a FIFO or a device is refused without being read); `partial`: a
    recording cut short is read up to the cut (`parse_trace`)."""
    path = Path(path)
    try:
        text = read_bounded(path, limits).decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(path, None, "file", "is not UTF-8 text") from None
    except LimitError as error:
        raise TraceError(path, None, error.field, error.message) from None
    return parse_trace(text, path, limits, partial)


def parse_trace(
    text: str,
    path: str | Path = "<string>",
    limits: Limits = DEFAULT_LIMITS,
    partial: bool = False,
) -> Trace:
    """Parse a trace from YAML text; `path` is only used to name errors.

    A recording (a scheduler-level trace with `recording:`) is written one
    entry a line and ends with its `end` line, so a file cut short (by a
    crash, a full disk, a copy) is one error naming the entry where it was
    cut: a line that does not parse, an entry this reader does not know, or
    no `end` line. With `partial` the entries before the cut are read
    instead, and `Trace.cut` says what cut it."""
    path = Path(path)
    try:
        return _Reader(path, limits).trace(_load_yaml(text, path, limits))
    except TraceError as error:
        if not _RECORDING_HEAD.search(text):
            raise
        head, lines, cut = _recording_lines(text)
        if error.field == "yaml":
            if cut is None:  # the head itself is broken
                raise
            error = TraceError(
                path,
                cut,
                "engine",
                f"the recording is cut at entry {cut} (line {head.count(chr(10)) + cut + 1} "
                "does not parse)",
            )
        if error.step_index is None:
            raise
        at = error.step_index
        if not partial or at == 0:
            hint = PARTIAL_HINT.format(n=at) if at else "nothing was recorded before it"
            raise TraceError(path, at, error.field, f"{error.message}; {hint}") from None
        trace = _Reader(path, limits, partial=True).trace(
            _load_yaml(head + "".join(lines[:at]), path, limits)
        )
        return replace(trace, cut=f"entry {at}: {error.field}: {error.message}")


# A recording's head has a top-level `recording:` mapping.
_RECORDING_HEAD = re.compile(r"^recording:", re.MULTILINE)


def _recording_lines(text: str) -> tuple[str, list[str], int | None]:
    """A recording's head (up to its `engine:` line), its entry lines, and
    the index of the first entry line cut short (None: none is)."""
    lines = text.splitlines(keepends=True)
    try:
        start = lines.index("engine:\n") + 1
    except ValueError:
        return text, [], None
    head, entries = "".join(lines[:start]), lines[start:]
    for index, line in enumerate(entries):
        last = line.startswith("end:")
        if not line.startswith("end: {" if last else _ENTRY_PREFIX) or not line.endswith("}\n"):
            return head, entries[:index], index
        try:
            yaml.load(line[4:], Loader=_StrictCLoader if yaml.__with_libyaml__ else _StrictLoader)
        except yaml.YAMLError:
            return head, entries[:index], index
        if last:
            return head, entries[:index], None
    return head, entries, None


def load_corpus(directory: str | Path, limits: Limits = DEFAULT_LIMITS) -> list[Trace]:
    """Every `*.yaml` trace in `directory`, sorted by file name; the first
    invalid one is raised (`read_corpus` lists them all).

    An empty corpus is an error: a gate that checks nothing must not pass.
    """
    traces, invalid = read_corpus(directory, limits)
    if invalid:
        raise invalid[0]
    return traces


def read_corpus(
    directory: str | Path, limits: Limits = DEFAULT_LIMITS, partial: bool = False
) -> tuple[list[Trace], list[TraceError]]:
    """Every `*.yaml` trace in `directory`, sorted by file name, and each
    invalid one's error (a second trace of a name already read is one).

    A directory that is missing or holds no trace raises: there is nothing
    to list."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TraceError(directory, None, "corpus", "is not a directory")
    paths = sorted(directory.glob("*.yaml"))
    if not paths:
        raise TraceError(directory, None, "corpus", "holds no *.yaml traces")
    return read_traces(paths, limits, partial)


def read_traces(
    paths: Sequence[str | Path], limits: Limits = DEFAULT_LIMITS, partial: bool = False
) -> tuple[list[Trace], list[TraceError]]:
    """The traces in `paths` that are valid, and each other one's error
    (`partial`: recordings cut short are read up to the cut)."""
    traces: list[Trace] = []
    invalid: list[TraceError] = []
    first_path: dict[str, Path] = {}
    for path in paths:
        try:
            trace = load_trace(path, limits, partial)
            _check_new_name(trace, first_path)
        except TraceError as error:
            invalid.append(error)
            continue
        traces.append(trace)
    return traces, invalid


def check_unique_names(traces: Sequence[Trace]) -> None:
    """Refuse two traces of one name: a report line or a JUnit case would
    not say which of them passed."""
    first_path: dict[str, Path] = {}
    for trace in traces:
        _check_new_name(trace, first_path)


def _check_new_name(trace: Trace, first_path: dict[str, Path]) -> None:
    """`trace`'s name is not in `first_path` (name -> the file that has it); add it."""
    if trace.name in first_path:
        raise TraceError(
            trace.path, None, "name", f"{trace.name!r} is also the name of {first_path[trace.name]}"
        )
    first_path[trace.name] = trace.path


def bundled_corpus() -> Path:
    """The corpus shipped inside the package (package data)."""
    return Path(__file__).with_name("corpus")


def bundled_scheduler_corpus() -> Path:
    """The scheduler-level corpus shipped inside the package, beside the
    manager-level one (`kvgate gate` runs both by default)."""
    return bundled_corpus() / "scheduler"


_MERGE_TAG = "tag:yaml.org,2002:merge"
_INT_TAG = "tag:yaml.org,2002:int"


class _NoDuplicateKeys(yaml.constructor.SafeConstructor):
    """PyYAML's safe constructor, except that a repeated mapping key is an
    error (an integer has at most `INT_DIGITS` digits: `_bounded_int`).

    PyYAML silently keeps the last of two equal keys, which would let
    `{req: A, req: B}` through as a valid step. Merge keys (`<<: *base`) are
    YAML's own way to repeat keys: they are not duplicates, and the keys
    written beside them override the merged ones, as YAML says.
    """

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            if isinstance(key, Hashable):
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _StrictLoader(_NoDuplicateKeys, yaml.SafeLoader):
    """The pure-Python strict loader: the one that words every YAML error."""


class _StrictCLoader(_NoDuplicateKeys, yaml.CSafeLoader):
    """The same constructor on libyaml's parser: several times faster on the
    long traces the workload generator writes (same documents)."""


def _bounded_int(loader: Any, node: yaml.ScalarNode) -> int:
    # Python refuses to convert ints of more than 4,300 digits with a
    # ValueError (not a YAML error), and no trace needs a tenth of that.
    digits = sum(c.isalnum() for c in str(node.value))
    if digits > INT_DIGITS + 2:  # a 0x/0o/0b prefix
        raise yaml.constructor.ConstructorError(
            None, None, f"integer of {digits} digits (at most {INT_DIGITS})", node.start_mark
        )
    return cast(int, loader.construct_yaml_int(node))


for _loader in (_StrictLoader, _StrictCLoader):
    _loader.add_constructor(_INT_TAG, _bounded_int)


def _load_yaml(text: str, path: Path, limits: Limits) -> object:
    documents = _load_with_libyaml(text)
    try:
        if documents is None:
            # The pure-Python composer recurses once per nesting level: the
            # event stream (no recursion) is measured first.
            _check_nesting(text, path, limits)
            documents = list(yaml.load_all(text, Loader=_StrictLoader))
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise TraceError(path, None, "yaml", f"{where}{error.problem or error}") from None
    except yaml.YAMLError as error:
        raise TraceError(path, None, "yaml", str(error)) from None
    except (ValueError, RecursionError) as error:
        # Not reachable on any input tried; kept so that nothing a YAML
        # library raises about its input ever leaves as a traceback.
        raise TraceError(path, None, "yaml", f"{type(error).__name__}: {error}") from None
    if len(documents) != 1:
        raise TraceError(path, None, "document", f"holds {len(documents)} YAML documents, not one")
    return documents[0]


def _check_nesting(text: str, path: Path, limits: Limits) -> None:
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > limits.nesting:
                mark = event.start_mark
                where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
                raise TraceError(
                    path,
                    None,
                    "yaml",
                    f"{where}collections nest deeper "
                    f"than the limit nesting = {limits.nesting} (raise it with --limit nesting=N)",
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _load_with_libyaml(text: str) -> list[object] | None:
    """The documents as libyaml parses them; None when PyYAML lacks libyaml or
    the text fails to load, so the pure-Python loader words the error as
    it always has."""
    if not yaml.__with_libyaml__:
        return None
    try:
        return list(yaml.load_all(text, Loader=_StrictCLoader))
    except (yaml.YAMLError, ValueError, RecursionError):
        return None


class _Reader:
    """Validates one trace document, step by step, tracking each request's life."""

    def __init__(self, path: Path, limits: Limits, partial: bool = False) -> None:
        self.path = path
        self.limits = limits
        # A recording's entries before a cut: no `end` line to check.
        self.partial = partial
        self.requests: dict[str, tuple[Phase, str]] = {}  # name -> (phase, since when)
        self.config: Config | None = None
        self._budget: TraceBudget | None = None

    @property
    def budget(self) -> TraceBudget:
        assert self._budget is not None, "the config is read first"
        return self._budget

    def error(self, index: int | None, field: str, message: str) -> TraceError:
        return TraceError(self.path, index, field, message)

    # -- document ---------------------------------------------------------

    def trace(self, doc: object) -> Trace:
        if not isinstance(doc, dict):
            raise self.error(None, "document", f"must be a mapping, got {_got(doc)}")
        if "format" not in doc:
            raise self.error(None, "format", f"missing (write `format: {FORMAT}`)")
        if doc["format"] != FORMAT:
            raise self.error(
                None,
                "format",
                f"{_got(doc['format'])} is not supported (this reader reads {FORMAT})",
            )
        if "engine" in doc:
            return self.engine_trace(doc)
        self.unknown_keys(None, "", doc, _REQUIRED_KEYS + _OPTIONAL_KEYS, "top-level key")
        refused = self.expect_refused(doc)
        self.missing_keys(
            None, "", doc, tuple(k for k in _REQUIRED_KEYS if refused is None or k != "steps")
        )
        name = self.name(doc["name"])
        about = doc.get("about", "")
        if not isinstance(about, str):
            raise self.error(None, "about", f"must be a string, got {_got(about)}")
        tags = self.tags(doc.get("tags", []))
        self.config = self.read_config(doc["config"], refused)
        if refused is not None:
            return Trace(name, about, self.config, (), (), self.path, refused, tags)
        self._budget = TraceBudget(self.limits, self.config.max_model_len)
        raw_steps = doc["steps"]
        if not isinstance(raw_steps, list) or not raw_steps:
            raise self.error(None, "steps", f"must be a non-empty list, got {_got(raw_steps)}")
        if len(raw_steps) > self.limits.steps:
            raise self.error(None, "steps", over("steps", len(raw_steps), self.limits))
        steps = tuple(self.step(i, raw) for i, raw in enumerate(raw_steps))
        return Trace(
            name=name,
            about=about,
            config=self.config,
            steps=steps,
            primitives=tuple(p for s in steps for p in expand(s)),
            path=self.path,
            tags=tags,
        )

    def name(self, name: object) -> str:
        if not isinstance(name, str) or not name.strip():
            raise self.error(None, "name", f"must be a non-empty string, got {_got(name)}")
        if not name.isprintable() or len(name) > NAME_WIDTH:
            # It heads a report line: a newline in it would print a line of its own.
            raise self.error(
                None,
                "name",
                f"must be one line of at most {NAME_WIDTH} printable characters, got {_got(name)}",
            )
        if name.split(" ", 1)[0] in VERDICT_WORDS:
            # A failing trace's report block starts with its name: this one
            # would start a line a CI parser reads as a verdict.
            raise self.error(
                None, "name", f"may not start with a verdict word ({', '.join(VERDICT_WORDS)})"
            )
        return name

    # -- scheduler-level traces -------------------------------------------

    def engine_trace(self, doc: Mapping[Any, Any]) -> Trace:
        """A scheduler-level trace: `engine` steps replayed on a whole
        scheduler (docs/scheduler-traces.md)."""
        self.unknown_keys(
            None, "", doc, _ENGINE_REQUIRED_KEYS + _ENGINE_OPTIONAL_KEYS, "top-level key"
        )
        self.missing_keys(None, "", doc, _ENGINE_REQUIRED_KEYS)
        name = self.name(doc["name"])
        about = doc.get("about", "")
        if not isinstance(about, str):
            raise self.error(None, "about", f"must be a string, got {_got(about)}")
        tags = self.tags(doc.get("tags", []))
        self.config = self.read_config(doc["config"])
        settings = self.engine_settings(doc.get("scheduler", {}))
        self._budget = TraceBudget(self.limits, self.config.max_model_len)
        raw_steps = doc["engine"]
        if not isinstance(raw_steps, list) or not raw_steps:
            raise self.error(None, "engine", f"must be a non-empty list, got {_got(raw_steps)}")
        if len(raw_steps) > self.limits.steps:
            raise self.error(None, "engine", over("steps", len(raw_steps), self.limits))
        engine = tuple(e for i, raw in enumerate(raw_steps) for e in self.engine_step(i, raw))
        self.recording(doc, len(raw_steps))
        return Trace(
            name=name,
            about=about,
            config=self.config,
            steps=(),
            primitives=(),
            path=self.path,
            tags=tags,
            engine=engine,
            scheduler=settings,
        )

    def recording(self, doc: Mapping[Any, Any], entries: int) -> None:
        """A recording's `recording` header and its `end` line."""
        if "recording" not in doc:
            if "end" in doc:
                raise self.error(
                    None, "end", "only a recording (with `recording:`) has an end line"
                )
            return
        raw = doc["recording"]
        if not isinstance(raw, dict):
            raise self.error(None, "recording", f"must be a mapping, got {_got(raw)}")
        self.unknown_keys(None, "recording.", raw, _RECORDING_KEYS, "recording key")
        if not isinstance(raw.get("vllm", ""), str):
            raise self.error(None, "recording.vllm", f"must be a string, got {_got(raw['vllm'])}")
        part = raw.get("part", 1)
        if not _is_count(part) or part == 0:
            raise self.error(None, "recording.part", f"must be an integer >= 1, got {_got(part)}")
        if not isinstance(raw.get("warm", False), bool):
            raise self.error(
                None, "recording.warm", f"must be true or false, got {_got(raw['warm'])}"
            )
        if self.partial:
            return
        end = doc.get("end")
        if end is None:
            raise self.error(
                entries,
                "end",
                f"missing: the recording was cut after {entries} entries "
                "(the file ends without its end line)",
            )
        if not isinstance(end, dict):
            raise self.error(None, "end", f"must be a mapping, got {_got(end)}")
        self.unknown_keys(None, "end.", end, _END_KEYS, "end key")
        if end.get("entries") != entries:
            raise self.error(
                min(entries, end["entries"]) if _is_count(end.get("entries")) else None,
                "end.entries",
                f"says {_got(end.get('entries'))} entries, the file holds {entries}",
            )

    def engine_settings(self, raw: object) -> EngineSettings:
        if not isinstance(raw, dict):
            raise self.error(None, "scheduler", f"must be a mapping, got {_got(raw)}")
        self.unknown_keys(None, "scheduler.", raw, _SCHEDULER_KEYS, "scheduler key")
        spec = raw.get("spec", 0)
        if not _is_count(spec) or spec > self.limits.spec:
            raise self.error(
                None,
                "scheduler.spec",
                f"must be an integer 0..{self.limits.spec}, got {_got(spec)}",
            )
        seqs = raw.get("max_num_seqs", EngineSettings.max_num_seqs)
        if not _is_count(seqs) or seqs == 0:
            raise self.error(
                None, "scheduler.max_num_seqs", f"must be an integer >= 1, got {_got(seqs)}"
            )
        assert self.config is not None
        if self.config.eagle and spec == 0:
            raise self.error(
                None, "scheduler.spec", "config.eagle drops blocks for drafts: give spec >= 1"
            )
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
        if op == "abort":
            req = self.arrived(index, "req", raw["req"])
            if self.requests[req][0] == "ended":
                raise self.error(index, "req", f"{req!r} was {self.requests[req][1]}")
            self.requests[req] = ("ended", f"aborted at step {index}")
            return [EngineStep("abort", index, req=req)]
        if op == "reset":
            running = raw.get("running", False)
            if not isinstance(running, bool):
                raise self.error(index, "running", f"must be true or false, got {_got(running)}")
            return [
                EngineStep("reset", index, running=running, expect=self.reset_expect(index, raw))
            ]
        repeats = raw.get("steps", 1)
        if not _is_count(repeats) or repeats == 0:
            raise self.error(index, "steps", f"must be an integer >= 1, got {_got(repeats)}")
        if "expect" in raw and repeats != 1:
            raise self.error(index, "expect", "applies to one engine step: write steps: 1")
        try:
            self.budget.add_steps(repeats - 1, "steps")
        except LimitError as error:
            raise self.error(index, error.field, error.message) from None
        if "stop" in raw and repeats != 1:
            raise self.error(index, "stop", "applies to one engine step: write steps: 1")
        stop = self.stopped(index, raw.get("stop", []))
        expect = self.engine_expect(index, raw.get("expect", {}))
        return [EngineStep("step", index, expect=expect, stop=stop) for _ in range(repeats)]

    def stopped(self, index: int, raw: object) -> tuple[str, ...]:
        """A step's `stop`: requests that have arrived, each named once."""
        if not isinstance(raw, list):
            raise self.error(index, "stop", f"must be a list of requests, got {_got(raw)}")
        names = tuple(self.arrived(index, f"stop[{i}]", r) for i, r in enumerate(raw))
        if len(set(names)) != len(names):
            raise self.error(index, "stop", f"names a request twice: {_got(raw)}")
        return names

    def engine_arrival(self, index: int, raw: Mapping[Any, Any]) -> EngineStep:
        req = raw["req"]
        if not isinstance(req, str) or not req:
            raise self.error(index, "req", f"must be a request name (a string), got {_got(req)}")
        if req in self.requests:
            raise self.error(index, "req", f"{req!r} already {self.requests[req][1]}")
        prompt = self.prompt(index, raw["prompt"])
        max_tokens = raw["max_tokens"]
        if not _is_count(max_tokens) or max_tokens == 0:
            raise self.error(
                index, "max_tokens", f"must be an integer >= 1, got {_got(max_tokens)}"
            )
        try:
            self.budget.arrive(req, prompt)
        except LimitError as error:
            raise self.error(index, error.field, error.message) from None
        assert self.config is not None
        least = self.budget.prompt_least[req]
        if least + max_tokens > self.config.max_model_len:
            raise self.error(
                index,
                "max_tokens",
                f"{least:,} prompt + {max_tokens:,} output tokens, more than config.max_model_len "
                f"{self.config.max_model_len:,} (vLLM refuses the request)",
            )
        # A follow-up's `all_of` holds at most the whole output.
        self.budget.output_most[req] = max_tokens
        salt = self.text(index, "cache_salt", raw["cache_salt"]) if "cache_salt" in raw else ""
        follows = raw.get("follows")
        if follows is not None:
            follows = self.arrived(index, "follows", follows)
        remote = self.engine_remote(index, raw, least)
        self.requests[req] = ("waiting", f"arrived at step {index}")
        return EngineStep(
            "arrive",
            index,
            req=req,
            prompt=prompt,
            max_tokens=max_tokens,
            cache_salt=salt,
            follows=follows,
            remote=remote,
        )

    def engine_remote(
        self, index: int, raw: Mapping[Any, Any], prompt_tokens: int
    ) -> RemoteHit | None:
        """An arrival's `remote_hit`, `remote_async`, `remote_delay`: what the
        KV connector's external store holds of the request (None: nothing)."""
        given = [k for k in ("remote_hit", "remote_async", "remote_delay") if k in raw]
        if not given:
            return None
        assert self.config is not None
        if not self.config.kv_connector:
            raise self.error(index, given[0], "needs config.kv_connector: true")
        tokens = raw.get("remote_hit", 0)
        load_async = raw.get("remote_async", False)
        delay = raw.get("remote_delay", 0)
        if not isinstance(load_async, bool):
            raise self.error(
                index, "remote_async", f"must be true or false, got {_got(load_async)}"
            )
        # A real connector leaves the last prompt token to compute unless it
        # loads asynchronously.
        most = prompt_tokens if load_async else prompt_tokens - 1
        if not _is_count(tokens) or tokens > most:
            raise self.error(
                index,
                "remote_hit",
                f"must be an integer 0..{most} (its prompt holds at least {prompt_tokens} tokens"
                + ("" if load_async else ", less the one a sync load leaves to compute")
                + f"), got {_got(tokens)}",
            )
        if not _is_count(delay) or delay > self.limits.steps:
            raise self.error(
                index,
                "remote_delay",
                f"must be an integer 0..{self.limits.steps} (engine steps), got {_got(delay)}",
            )
        if delay and not load_async:
            raise self.error(index, "remote_delay", "applies to an async load: remote_async: true")
        return RemoteHit(tokens, load_async, delay)

    def arrived(self, index: int, field: str, value: object) -> str:
        """`value` names a request that has arrived."""
        if not isinstance(value, str) or value not in self.requests:
            raise self.error(index, field, f"names no request that has arrived: {_got(value)}")
        return value

    def reset_expect(self, index: int, raw: Mapping[Any, Any]) -> dict[str, Any]:
        expect = raw.get("expect", {})
        if not isinstance(expect, dict):
            raise self.error(index, "expect", f"must be a mapping, got {_got(expect)}")
        self.unknown_keys(index, "expect.", expect, RESET_EXPECT_KEYS, "expect key of reset")
        if "ok" in expect and not isinstance(expect["ok"], bool):
            raise self.error(index, "expect.ok", f"must be true or false, got {_got(expect['ok'])}")
        checked = dict(expect)
        if "waiting" in expect:
            if not isinstance(expect["waiting"], list):
                raise self.error(
                    index,
                    "expect.waiting",
                    f"must be a list of request names, got {_got(expect['waiting'])}",
                )
            checked["waiting"] = [
                self.arrived(index, "expect.waiting", r) for r in expect["waiting"]
            ]
        return checked

    def engine_expect(self, index: int, raw: object) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise self.error(index, "expect", f"must be a mapping, got {_got(raw)}")
        self.unknown_keys(index, "expect.", raw, ENGINE_EXPECT_KEYS, "expect key of engine op step")
        expect: dict[str, Any] = {}
        for key, value in raw.items():
            field = f"expect.{key}"
            if key == "scheduled":
                if not isinstance(value, list) or not all(
                    isinstance(p, list) and len(p) == 2 and _is_count(p[1]) and p[1] > 0
                    for p in value
                ):
                    raise self.error(
                        index, field, f"must be a list of [request, tokens >= 1], got {_got(value)}"
                    )
                expect[key] = [(self.arrived(index, field, r), n) for r, n in value]
            elif key in ("preempted", "finished"):
                if not isinstance(value, list):
                    raise self.error(
                        index, field, f"must be a list of request names, got {_got(value)}"
                    )
                expect[key] = [self.arrived(index, field, r) for r in value]
            else:
                if not isinstance(value, dict) or not all(_is_count(n) for n in value.values()):
                    raise self.error(
                        index,
                        field,
                        f"must map request names to token counts >= 0, got {_got(value)}",
                    )
                expect[key] = {self.arrived(index, field, r): n for r, n in value.items()}
        return expect

    def tags(self, raw: object) -> tuple[str, ...]:
        if not isinstance(raw, list):
            raise self.error(None, "tags", f"must be a list of words, got {_got(raw)}")
        if len(raw) > MAX_TAGS:
            raise self.error(None, "tags", f"{len(raw)} tags, more than {MAX_TAGS}")
        for i, tag in enumerate(raw):
            if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
                raise self.error(
                    None,
                    f"tags[{i}]",
                    "must be a word of letters, digits and _ . + - (at most 64, "
                    f"starting with a letter or digit), got {_got(tag)}",
                )
            if tag in raw[:i]:
                raise self.error(None, f"tags[{i}]", f"{tag!r} is listed twice")
        return tuple(raw)

    def expect_refused(self, doc: Mapping[Any, Any]) -> str | None:
        """The config key a refusal trace names; such a trace has no steps
        (nothing of it is replayed: it passes only by being refused)."""
        if "expect_refused" not in doc:
            return None
        field = doc["expect_refused"]
        keys = _CONFIG_KEYS
        if not isinstance(field, str) or field not in keys:
            raise self.error(
                None, "expect_refused", f"{_got(field)} is not a config key ({', '.join(keys)})"
            )
        if "steps" in doc:
            raise self.error(
                None, "steps", "a refusal trace (expect_refused) has no steps: nothing is replayed"
            )
        return field

    def unknown_keys(
        self,
        index: int | None,
        prefix: str,
        mapping: Mapping[Any, Any],
        allowed: tuple[str, ...],
        what: str,
    ) -> None:
        for key in mapping:
            if key not in allowed:
                raise self.error(
                    index,
                    f"{prefix}{key}",
                    f"unknown {what} (expected one of {', '.join(allowed)})",
                )

    def missing_keys(
        self, index: int | None, prefix: str, mapping: Mapping[Any, Any], required: tuple[str, ...]
    ) -> None:
        for key in required:
            if key not in mapping:
                raise self.error(index, f"{prefix}{key}", "missing")

    # -- config -----------------------------------------------------------

    def read_config(self, raw: object, refused: str | None = None) -> Config:
        if not isinstance(raw, dict):
            raise self.error(None, "config", f"must be a mapping, got {_got(raw)}")
        self.unknown_keys(None, "config.", raw, _CONFIG_KEYS, "config key")
        self.missing_keys(None, "config.", raw, REQUIRED_KEYS)

        groups = self.read_groups(raw["groups"])
        values: dict[str, Any] = {"groups": groups}
        for field in CONFIG_FIELDS:
            if field.read_as != "groups":
                values[field.attribute] = self.config_value(raw, field, groups)
        config = Config(**values)
        try:
            # A refusal trace's config is the verdict's to refuse, by which
            # field (`refusal.py`), not the reader's.
            if refused is None:
                validate(config)
        except UnsupportedConfig as error:
            raise TraceError.unsupported(self.path, error) from None
        if config.num_blocks > self.limits.num_blocks:
            raise self.error(
                None, "config.num_blocks", over("num_blocks", config.num_blocks, self.limits)
            )
        return config

    def config_value(
        self, raw: Mapping[Any, Any], field: ConfigField, groups: tuple[GroupConfig, ...]
    ) -> Any:
        """One config field's value, as its row says to read it."""
        if field.key in raw:
            value = raw[field.key]
        elif field.derive_default is not None:
            value = field.derive_default(groups)
        else:
            value = field.default
        where = f"config.{field.key}"
        if field.read_as == "count" and not _is_count(value):
            raise self.error(None, where, f"must be an integer >= 0, got {_got(value)}")
        if field.read_as == "flag" and not isinstance(value, bool):
            raise self.error(None, where, f"must be true or false, got {_got(value)}")
        if field.read_as == "word" and not isinstance(value, str):
            # Any string reads: one outside `choices` is refused by name (`validate`).
            raise self.error(None, where, f"must be a string, got {_got(value)}")
        if field.read_as == "rate":
            # Any number reads: one outside (0, 1] is vLLM's to refuse.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self.error(None, where, f"must be a number, got {_got(value)}")
            return float(value)
        # Any integer reads: a negative one is vLLM's to refuse (`validate`).
        if field.read_as == "interval" and value is not None and type(value) is not int:
            raise self.error(None, where, f"must be null or an integer, got {_got(value)}")
        return value

    def read_groups(self, raw: object) -> tuple[GroupConfig, ...]:
        if not isinstance(raw, list):
            raise self.error(None, "config.groups", f"must be a list, got {_got(raw)}")
        groups = []
        for i, group in enumerate(raw):
            where = f"config.groups[{i}]"
            if not isinstance(group, dict):
                raise self.error(None, where, f"must be a mapping, got {_got(group)}")
            self.unknown_keys(None, f"{where}.", group, GROUP_KEYS, "group key")
            self.missing_keys(None, f"{where}.", group, ("kind", "block_size"))
            kind = group["kind"]
            if kind not in GROUP_KINDS:
                raise self.error(
                    None, f"{where}.kind", f"{_got(kind)} is not one of {', '.join(GROUP_KINDS)}"
                )
            sizes: list[int] = []
            for key in ("block_size", "speculative_blocks", "prefill_checkpoint_blocks"):
                value = group.get(key, 0)
                if not _is_count(value):
                    raise self.error(
                        None, f"{where}.{key}", f"must be an integer >= 0, got {_got(value)}"
                    )
                sizes.append(value)
            alignment = group.get("prefill_checkpoint_alignment")
            if alignment is not None and (not _is_count(alignment) or alignment < 1):
                raise self.error(
                    None,
                    f"{where}.prefill_checkpoint_alignment",
                    f"must be an integer >= 1, got {_got(alignment)}",
                )
            groups.append(
                GroupConfig(
                    cast(GroupKind, kind),
                    block_size=sizes[0],
                    speculative_blocks=sizes[1],
                    prefill_checkpoint_blocks=sizes[2],
                    prefill_checkpoint_alignment=alignment,
                )
            )
        return tuple(groups)

    # -- steps ------------------------------------------------------------

    def op_of(
        self, index: int, raw: object, known: tuple[str, ...], what: str
    ) -> tuple[dict[Any, Any], str]:
        """A step's mapping and its `op`, one of `known`."""
        if not isinstance(raw, dict):
            raise self.error(index, "step", f"must be a mapping with an `op`, got {_got(raw)}")
        op = raw.get("op")
        if op is None:
            raise self.error(index, "op", "missing")
        if not isinstance(op, str) or op not in known:
            raise self.error(
                index, "op", f"unknown {what} {_got(op)} (expected one of {', '.join(known)})"
            )
        return raw, op

    def step(self, index: int, raw: object) -> Step:
        raw, op = self.op_of(index, raw, tuple(ACTIONS), "op")
        action = ACTIONS[op]
        if op == "check":
            return self.check_step(index, raw)
        fields = ("op", *action.required, *action.optional)
        self.unknown_keys(
            index, "", raw, fields + (("expect",) if action.expect_keys else ()), f"field of {op}"
        )
        self.missing_keys(index, "", raw, action.required)
        values = {
            key: self.field(index, key, value)
            for key, value in raw.items()
            if key not in ("op", "expect")
        }
        assert self.config is not None
        for key in CONNECTOR_FIELDS:
            if key in values and not self.config.kv_connector:
                raise self.error(index, key, "needs config.kv_connector: true")
        if values.get("load_failed"):
            self.load_failure(index, op, values)
        if values.get("invalid_blocks"):
            self.block_failure(index, op, values)
        expect = self.expect(index, action, raw.get("expect", {}))
        self.track_request(index, action, values)
        self.count(index, op, values)
        if values.get("mm"):
            self.mm_inside_prompt(index, values["req"], values["mm"])
        return Step(op, index, **values, expect=expect)

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

    def count(self, index: int, op: str, values: Mapping[str, Any]) -> None:
        """Charge the step to the trace's budget (before `decode` is expanded)."""
        try:
            if op == "arrive":
                self.budget.arrive(values["req"], values["prompt"])
            repeats = values["steps"] if op == "decode" else 1
            self.budget.add_steps(3 * repeats if op == "decode" else 1, "steps")
            if op in ("decode", "decode1"):
                self.budget.decoded(values["req"], repeats)
        except LimitError as error:
            raise self.error(index, error.field, error.message) from None

    def field(self, index: int, key: str, value: object) -> Any:
        kind = FIELD_TYPES[key]
        if kind == "req":
            if not isinstance(value, str) or not value:
                raise self.error(
                    index, key, f"must be a request name (a string), got {_got(value)}"
                )
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
                or not all(_is_count(v) for v in value)
                or any(a >= b for a, b in zip(value, value[1:], strict=False))
            ):
                raise self.error(
                    index,
                    key,
                    "must be a non-empty, increasing list of block indices >= 0, "
                    f"got {_got(value)}",
                )
            return tuple(value)
        if kind == "bool":
            if not isinstance(value, bool):
                raise self.error(index, key, f"must be true or false, got {_got(value)}")
            return value
        if kind == "int":
            if not _is_count(value):
                raise self.error(index, key, f"must be an integer >= 0, got {_got(value)}")
            if key in ("lookahead", "spec") and value > getattr(self.limits, key):
                raise self.error(index, key, over(key, value, self.limits))
            return value
        assert self.config is not None
        if kind == "int_or_auto":
            if value != "auto" and not (_is_count(value) and value != 0):
                raise self.error(index, key, f"must be an integer >= 1 or auto, got {_got(value)}")
            if isinstance(value, int) and value > self.config.max_model_len:
                raise self.error(
                    index,
                    key,
                    f"{value:,} tokens in one allocation, more than config.max_model_len "
                    f"{self.config.max_model_len:,}",
                )
            return value
        if kind == "int_or_all":
            if value != "all" and not _is_count(value):
                raise self.error(index, key, f"must be an integer >= 0 or all, got {_got(value)}")
            if isinstance(value, int) and value >= self.config.num_blocks:
                raise self.error(
                    index,
                    key,
                    f"{value:,} blocks, more than the pool's {self.config.num_blocks - 1:,} "
                    "(config.num_blocks less the null block)",
                )
            return value
        if value not in FREE_HOW:
            raise self.error(index, key, f"{_got(value)} is not one of {', '.join(FREE_HOW)}")
        return value

    def text(self, index: int, field: str, value: object) -> str:
        if (
            not isinstance(value, str)
            or not value
            or not value.isprintable()
            or (value != "".join(value.split()))
        ):
            raise self.error(
                index,
                field,
                f"must be a non-empty string of printable characters without spaces, "
                f"got {_got(value)}",
            )
        return value

    def mm(self, index: int, raw: object) -> tuple[MmItem, ...]:
        """Multimodal placeholders: sorted by offset, disjoint, each at least
        one token (vLLM's hasher assumes the order)."""
        if not isinstance(raw, list) or not raw:
            raise self.error(
                index, "mm", f"must be a non-empty list of {{offset, length, id}}, got {_got(raw)}"
            )
        items: list[MmItem] = []
        for i, entry in enumerate(raw):
            where = f"mm[{i}]"
            if not isinstance(entry, dict):
                raise self.error(
                    index, where, f"must be a mapping {{offset, length, id}}, got {_got(entry)}"
                )
            self.unknown_keys(index, where + ".", entry, ("offset", "length", "id"), "key")
            self.missing_keys(index, where + ".", entry, ("offset", "length", "id"))
            offset, length = entry["offset"], entry["length"]
            if not _is_count(offset):
                raise self.error(
                    index, f"{where}.offset", f"must be an integer >= 0, got {_got(offset)}"
                )
            if not _is_count(length) or length == 0:
                raise self.error(
                    index, f"{where}.length", f"must be an integer >= 1, got {_got(length)}"
                )
            identifier = self.text(index, f"{where}.id", entry["id"])
            if items and offset < items[-1].end:
                raise self.error(
                    index,
                    f"{where}.offset",
                    f"{offset} is inside or before mm[{i - 1}] ({items[-1].offset}.."
                    f"{items[-1].end}): placeholders must be sorted and disjoint",
                )
            items.append(MmItem(offset, length, identifier))
        return tuple(items)

    def prompt(self, index: int, raw: object) -> tuple[Segment, ...]:
        if not isinstance(raw, list) or not raw:
            raise self.error(
                index, "prompt", f"must be a non-empty list of segments, got {_got(raw)}"
            )
        segments = tuple(self.segment(index, f"prompt[{i}]", s) for i, s in enumerate(raw))
        # Another request's prompt is never empty, so only literal segments can be.
        if all(s.kind in ("fresh", "tokens") for s in segments) and not any(
            s.count or s.token_ids for s in segments
        ):
            raise self.error(index, "prompt", "has no tokens")
        return segments

    def segment(self, index: int, where: str, raw: object) -> Segment:
        if not isinstance(raw, dict) or len(raw) != 1:
            raise self.error(
                index,
                where,
                f"must be one of {{fresh: N}}, {{all_of: R}}, {{prompt_of: R}}, {{tokens: [..]}}, "
                f"got {_got(raw)}",
            )
        ((kind, value),) = raw.items()
        field = f"{where}.{kind}"
        if kind == "fresh":
            if not _is_count(value):
                raise self.error(index, field, f"must be an integer >= 0, got {_got(value)}")
            self.charge(index, field, value)
            return Segment("fresh", count=value)
        if kind == "tokens":
            if not isinstance(value, list):
                raise self.error(
                    index, field, f"must be a list of token ids (integers >= 0), got {_got(value)}"
                )
            # Counted before it is read: one long list behind many aliases
            # would otherwise be walked once per alias.
            self.charge(index, field, len(value))
            if not all(_is_count(t) and t < TOKEN_ID_BOUND for t in value):
                raise self.error(
                    index,
                    field,
                    f"must be a list of token ids (integers >= 0 and < 2**63), got {_got(value)}",
                )
            return Segment("tokens", token_ids=tuple(value))
        if kind in ("all_of", "prompt_of"):
            if not isinstance(value, str) or value not in self.requests:
                raise self.error(index, field, f"names no request that has arrived: {_got(value)}")
            self.charge(index, field, self.budget.copied(kind, value))
            return Segment(kind, req=value)
        raise self.error(
            index,
            where,
            f"unknown segment kind {_got(kind)} (expected one of {', '.join(_SEGMENT_KINDS)})",
        )

    def charge(self, index: int, field: str, tokens: int) -> None:
        try:
            self.budget.add_tokens(tokens, field)
        except LimitError as error:
            raise self.error(index, error.field, error.message) from None

    def expect(self, index: int, action: Action, raw: object) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise self.error(index, "expect", f"must be a mapping, got {_got(raw)}")
        self.unknown_keys(index, "expect.", raw, action.expect_keys, f"expect key of {action.name}")
        expect: dict[str, Any] = {}
        for key, value in raw.items():
            kind = EXPECT_TYPES[key]
            field = f"expect.{key}"
            if kind == "int" and not _is_count(value):
                raise self.error(index, field, f"must be an integer >= 0, got {_got(value)}")
            if kind == "bool" and not isinstance(value, bool):
                raise self.error(index, field, f"must be true or false, got {_got(value)}")
            if kind == "copies":
                value = self.copies(index, field, value)
            if kind == "events" and not (
                isinstance(value, list) and all(isinstance(e, str) for e in value)
            ):
                raise self.error(index, field, f"must be a list of event lines, got {_got(value)}")
            if kind == "counts" and not (
                isinstance(value, list) and all(_is_count(n) for n in value)
            ):
                raise self.error(
                    index, field, f"must be a list of integers >= 0, got {_got(value)}"
                )
            expect[key] = value
        return expect

    def copies(self, index: int, field: str, raw: object) -> tuple[tuple[int, int], ...]:
        pairs = raw if isinstance(raw, list) else None
        if pairs is None or not all(
            isinstance(p, list) and len(p) == 2 and all(_is_count(i) for i in p) for p in pairs
        ):
            raise self.error(
                index, field, f"must be a list of [src, dst] block-id pairs, got {_got(raw)}"
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
                raise self.error(index, key, f"must be true or false, got {_got(value)}")
            if key == "free_blocks" and not _is_count(value):
                raise self.error(index, key, f"must be an integer >= 0, got {_got(value)}")
            if key == "holds":
                value = self.holds(index, value)
            if key == "ref":
                value = self.ref_check(index, value)
            if key == "attention_cached":
                value = self.requests_mapping(index, key, value)
                for req, n in value.items():
                    if not _is_count(n):
                        raise self.error(
                            index, f"{key}.{req}", f"must be an integer >= 0, got {_got(n)}"
                        )
            check[key] = value
        return Step("check", index, check=check)

    def ref_check(self, index: int, raw: object) -> dict[str, dict[int, dict[int, int | None]]]:
        """`{R: {G: {P: N or null}}}`: ref counts of states keyed at R's prefix."""
        out: dict[str, dict[int, dict[int, int | None]]] = {}
        for req, groups in self.requests_mapping(index, "ref", raw).items():
            if not isinstance(groups, dict) or not groups:
                raise self.error(
                    index, f"ref.{req}", f"must map group ids to positions, got {_got(groups)}"
                )
            out[req] = {}
            for group, positions in groups.items():
                where = f"ref.{req}.{group}"
                assert self.config is not None
                if not _is_count(group) or group >= len(self.config.groups):
                    raise self.error(index, where, "names no group of the config")
                if not isinstance(positions, dict) or not positions:
                    raise self.error(
                        index,
                        where,
                        f"must map token positions to ref counts, got {_got(positions)}",
                    )
                for position, n in positions.items():
                    if not _is_count(position) or position == 0:
                        raise self.error(
                            index, f"{where}.{position}", "must be a token position > 0"
                        )
                    if n is not None and not _is_count(n):
                        raise self.error(
                            index,
                            f"{where}.{position}",
                            f"must be a ref count >= 0 or null, got {_got(n)}",
                        )
                out[req][group] = dict(positions)
        return out

    def requests_mapping(self, index: int, field: str, raw: object) -> dict[str, Any]:
        """A mapping keyed by the names of requests that have arrived."""
        if not isinstance(raw, dict):
            raise self.error(index, field, f"must be a mapping of request names, got {_got(raw)}")
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
                    index, where, f"must be a mapping {{group: position}}, got {_got(by_group)}"
                )
            for group, position in by_group.items():
                if group not in mamba or not _is_count(group):
                    raise self.error(
                        index,
                        f"{where}.{group}",
                        f"is not a mamba_align group id (those are {', '.join(map(str, mamba))})",
                    )
                if not _is_count(position):
                    raise self.error(
                        index,
                        f"{where}.{group}",
                        f"must be a token position >= 0, got {_got(position)}",
                    )
            holds[req] = dict(by_group)
        return holds

    def track_request(self, index: int, action: Action, values: Mapping[str, object]) -> None:
        """Enforce a request's life as the action table declares it."""
        req = values.get("req")
        if not isinstance(req, str) or not action.valid_in:
            return
        phase, since = self.requests.get(req, ("absent", ""))
        if phase not in action.valid_in:
            raise self.error(index, "req", out_of_phase(action.name, req, phase, since))
        how = values.get("how")
        after = next_phase(action.name, phase, how if isinstance(how, str) else None)
        if after in ("popped", "ended") or phase == "absent":
            verb = _ENDED_BY.get(str(how), "") if action.name == "free" else _VERBS[action.name]
            since = f"{verb} at step {index}"
        self.requests[req] = (after, since)


# How the validator says when a request arrived, was popped or ended.
_VERBS = {"arrive": "arrived", "pop": "popped", "release": "released"}
_ENDED_BY = {"finish": "finished", "abort": "aborted"}


def _is_count(value: object) -> TypeGuard[int]:
    # YAML `true` is a bool, which Python counts as an int; a count it is not.
    return type(value) is int and value >= 0


def _got(value: object) -> str:
    """A value as the error message shows it, in YAML's spelling where it differs."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
