"""Trace format version 1: read a YAML trace, validate all of it, expand macros.

The format (trace-format.md) is a contract; this module is its only reader.
Everything is checked before anything is replayed, and every problem is a
`TraceError` that names the file, the step and the field in one line.

This module reads the document (its top-level keys, a recording's head and
end line) and the files of a corpus; the parts are read by their own
modules: the YAML itself (`strict_yaml.py`), `config` (`config_reader.py`),
a manager-level trace's `steps` (`step_reader.py`) and a scheduler-level
trace's `engine` entries (`engine_reader.py`), with what they share in
`field_reader.py`.

Macros expand in `macros.py`: `Trace.primitives` has each `decode`
expanded and each `prefill` kept whole, since its loop's length depends on
the target's chunk split.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kvgate.conformance.collector import no_cycle_collection
from kvgate.conformance.config_reader import LISTED_CONFIG_KEYS, ConfigReader
from kvgate.conformance.engine_reader import EngineReader
from kvgate.conformance.field_reader import got, is_count
from kvgate.conformance.limits import (
    DEFAULT_LIMITS,
    LimitError,
    Limits,
    TraceBudget,
    over,
    read_bounded,
)
from kvgate.conformance.macros import expand_all
from kvgate.conformance.step_reader import StepReader
from kvgate.conformance.strict_yaml import load_document, load_flow_line
from kvgate.conformance.trace_error import TraceError as TraceError  # importers name it here
from kvgate.model.scope import SCHEDULER_LEVEL_ONLY, scheduler_level_only
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import Step
from kvgate.vocabulary.scheduling import EngineSettings, EngineStep
from kvgate.vocabulary.schema import FORMAT

_REQUIRED_KEYS = ("format", "name", "config", "steps")
_OPTIONAL_KEYS = ("about", "expect_refused", "tags")
# A scheduler-level trace: engine steps instead of manager steps.
_ENGINE_REQUIRED_KEYS = ("format", "name", "config", "engine")
_ENGINE_OPTIONAL_KEYS = ("about", "tags", "scheduler", "recording", "end")
# A recording (kvgate's recorder wrote it): where it came from, and its last
# line, `end`, which counts its `engine` entries so a cut file is detected.
# `follows`: the file of the part before this one (a later part of a
# recording replays after its earlier parts); `warm`: an older recorder's
# part started on a warm prefix cache, without expectations; `device`: the
# device vLLM's platform ran the engine on (`cpu`, `cuda`, ...).
_RECORDING_KEYS = ("vllm", "part", "follows", "warm", "device")
# A device as a recording names it.
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}")
# How many parts one recording may chain.
MAX_PARTS = 1024
_END_KEYS = ("entries",)
# A recording's entry lines, as the recorder writes them: one flow mapping each.
_ENTRY_PREFIX = "  - {"
PARTIAL_HINT = "--partial replays the {n} entries recorded before it"


# How long a trace name may be: it heads report lines and names JUnit cases.
NAME_WIDTH = 200
# A tag: a word `-k` can select by (letters, digits, `_ . + -`), and how
# many a trace may carry.
TAG_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
MAX_TAGS = 32
# The words a report's verdict lines start with (report.trace_line).
VERDICT_WORDS = ("PASS", "FAIL", "LACKS", "SKIP", "ERROR")


@dataclass(frozen=True)
class ReadAgain:
    """How a trace whose body was set aside after validation is read again."""

    limits: Limits
    partial: bool


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
    # A recording: the device its engine ran on (`recording.device`); empty
    # when the recording does not say, or for a trace written by hand.
    device: str = ""
    # A recording: the vLLM release whose Scheduler it recorded
    # (`recording.vllm`); empty for a trace written by hand.
    recorded_by: str = ""
    # A trace read entry by entry (`conformance.stream.StepStream`): its
    # steps are read from its file as they run; `steps` and `primitives`
    # are then empty.
    stream: Any = field(default=None, compare=False)
    # A trace of a corpus validated when the corpus was read, its body then
    # left in its file until it runs (`corpora.read_corpora`): `steps`,
    # `primitives` and `engine` are empty; `corpora.whole` reads them again.
    read_again: ReadAgain | None = field(default=None, compare=False)

    @property
    def scheduler_level(self) -> bool:
        """Replayed on a whole scheduler, not on a manager."""
        return self.scheduler is not None

    @property
    def has_sessions(self) -> bool:
        """A scheduler-level trace with a streaming-input session."""
        return any(event.resumable for event in self.engine)


def load_trace(path: str | Path, limits: Limits = DEFAULT_LIMITS, partial: bool = False) -> Trace:
    """Read and validate the trace in file `path` (a regular file within the
    limits: a FIFO or a device is refused without being read); `partial`: a
    recording cut short is read up to the cut (`parse_trace`)."""
    path = Path(path)
    text = _read_text(path, limits)
    if is_recording(text):
        text, parts = _with_earlier_parts(path, text, limits)
        if parts > 1:
            # The parts' entries are read as one document.
            limits = replace(limits, file_bytes=limits.file_bytes * parts)
    return parse_trace(text, path, limits, partial)


def _read_text(path: Path, limits: Limits) -> str:
    try:
        return read_bounded(path, limits).decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(path, None, "file", "is not UTF-8 text") from None
    except LimitError as error:
        raise TraceError(path, None, error.field, error.message) from None


def _follows(path: Path, text: str, limits: Limits) -> str | None:
    """The file a recording's part names as the part before it (`follows`)."""
    head = text.split("\nengine:\n", 1)[0]
    try:
        doc = load_document(head, path, limits)
    except TraceError:
        return None  # the whole read reports it
    recording = doc.get("recording") if isinstance(doc, dict) else None
    follows = recording.get("follows") if isinstance(recording, dict) else None
    if follows is None:
        return None
    if not isinstance(follows, str) or not follows or Path(follows).name != follows:
        raise TraceError(
            path, None, "recording.follows", f"must be a file name, got {got(follows)}"
        )
    return follows


_END_LINE = re.compile(r"^end: \{entries: (\d+)\}\n\Z", re.MULTILINE)


def _with_earlier_parts(path: Path, text: str, limits: Limits) -> tuple[str, int]:
    """A recording's part with its earlier parts' entries before its own (as
    one document: this part's head, every entry from the recording's first,
    an end line counting them all), and how many parts that is. Each earlier
    part (named by `follows`, in this file's directory) must be whole."""
    earlier: list[tuple[str, int]] = []  # each earlier part's entry lines and count
    seen = {path.name}
    current, current_text = path, text
    while (follows := _follows(current, current_text, limits)) is not None:
        if follows in seen or len(seen) >= MAX_PARTS:
            raise TraceError(
                path,
                None,
                "recording.follows",
                f"{follows}: the parts do not end in a first part within {MAX_PARTS} files",
            )
        seen.add(follows)
        previous = path.parent / follows
        if not previous.is_file():
            raise TraceError(
                path,
                None,
                "recording.follows",
                f"{follows}, which {current.name} follows, is not in {path.parent}: a "
                "recording's parts replay in order from its first",
            )
        previous_name = current.name
        current, current_text = previous, _read_text(previous, limits)
        _, lines, cut = _recording_lines(current_text)
        end = _END_LINE.search(current_text)
        if cut is not None or end is None or int(end.group(1)) != len(lines):
            raise TraceError(
                path,
                None,
                "recording.follows",
                f"{follows}, which {previous_name} follows, is cut short (replay it alone "
                "with --partial): the parts after it do not replay",
            )
        earlier.append(("".join(lines), len(lines)))
    if not earlier:
        return text, 1
    head, _, body = text.partition("engine:\n")
    before = sum(count for _, count in earlier)
    end = _END_LINE.search(body)
    if end is not None:
        body = body[: end.start(1)] + str(int(end.group(1)) + before) + body[end.end(1) :]
    entries = "".join(lines for lines, _ in reversed(earlier))
    return head + "engine:\n" + entries + body, len(earlier) + 1


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
        with no_cycle_collection():
            return _Reader(path, limits).trace(load_document(text, path, limits))
    except TraceError as error:
        if not is_recording(text):
            raise
        head, lines, cut = _recording_lines(text)
        if error.field == "engine" and not lines and error.step_index is None:
            # A head alone: the engine stopped before its first call was written.
            raise TraceError(
                path,
                None,
                "engine",
                "the recording holds no entries (the engine stopped before the recorder wrote "
                "its first call): nothing to replay",
            ) from None
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
            load_document(head + "".join(lines[:at]), path, limits)
        )
        return replace(trace, cut=f"entry {at}: {error.field}: {error.message}")


def is_recording(text: str) -> bool:
    """A recording's head has a top-level `recording:` mapping: a line that
    starts so (a substring search, several times faster than a multiline
    regex over a long trace's text)."""
    return text.startswith("recording:") or "\nrecording:" in text


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
            load_flow_line(line[4:])
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
    return read_traces(_last_parts(paths), limits, partial)


# A recording's part file: its recording's stem and its part number.
_PART_NAME = re.compile(r"(.+)\.(\d{3,})\.yaml")


def _last_parts(paths: Sequence[Path]) -> list[Path]:
    """`paths` without each recording's part that a later part in the same
    directory follows: that later part replays it, before its own entries."""
    kept: list[Path] = []
    names = {path.name for path in paths}
    for path in paths:
        match = _PART_NAME.fullmatch(path.name)
        if match is not None:
            number = int(match.group(2))
            successor = f"{match.group(1)}.{number + 1:0{len(match.group(2))}d}.yaml"
            if successor in names and _names_as_follows(path.parent / successor, path.name):
                continue
        kept.append(path)
    return kept


def _names_as_follows(path: Path, name: str) -> bool:
    """The head of the file at `path` says it follows file `name`."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(64 * 1024).decode("utf-8", "replace")
    except OSError:
        return False
    return (
        re.search(rf"^recording: \{{.*\bfollows: '?{re.escape(name)}'?[,}}]", head, re.M)
        is not None
    )


def read_traces(
    paths: Sequence[str | Path], limits: Limits = DEFAULT_LIMITS, partial: bool = False
) -> tuple[list[Trace], list[TraceError]]:
    """The traces in `paths` that are valid, and each other one's error
    (`partial`: recordings cut short are read up to the cut)."""
    return read_each(paths, lambda path: load_trace(path, limits, partial))


def read_each(
    paths: Sequence[str | Path], load: Callable[[str | Path], Trace]
) -> tuple[list[Trace], list[TraceError]]:
    """Each of `paths` read by `load`: the valid traces, and each other
    one's error (a name already taken by an earlier path is one)."""
    traces: list[Trace] = []
    invalid: list[TraceError] = []
    first_path: dict[str, Path] = {}
    for path in paths:
        try:
            trace = load(path)
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


class _Reader(ConfigReader, StepReader, EngineReader):
    """Validates one trace document, step by step, tracking each request's life."""

    # -- document ---------------------------------------------------------

    def trace(self, doc: object) -> Trace:
        if not isinstance(doc, dict):
            raise self.error(None, "document", f"must be a mapping, got {got(doc)}")
        if "format" not in doc:
            raise self.error(None, "format", f"missing (write `format: {FORMAT}`)")
        if doc["format"] != FORMAT:
            raise self.error(
                None,
                "format",
                f"{got(doc['format'])} is not supported (this reader reads {FORMAT})",
            )
        if "engine" in doc:
            return self.engine_trace(doc)
        self.unknown_keys(None, "", doc, _REQUIRED_KEYS + _OPTIONAL_KEYS, "top-level key")
        refused = self.expect_refused(doc)
        self.missing_keys(
            None, "", doc, tuple(k for k in _REQUIRED_KEYS if refused is None or k != "steps")
        )
        name = self.name(doc["name"])
        about = self.about(doc.get("about", ""))
        tags = self.tags(doc.get("tags", []))
        self.config = self.read_config(doc["config"], refused)
        for key in scheduler_level_only(self.config):
            raise self.error(None, f"config.{key}", SCHEDULER_LEVEL_ONLY[key])
        if refused is not None:
            return Trace(name, about, self.config, (), (), self.path, refused, tags)
        raw_steps = self.entries(doc, "steps")
        steps = self.steps(raw_steps)
        return Trace(
            name=name,
            about=about,
            config=self.config,
            steps=steps,
            primitives=expand_all(steps),
            path=self.path,
            tags=tags,
        )

    def entries(self, doc: Mapping[Any, Any], key: str) -> list[Any]:
        """The document's `steps` or `engine` list, checked non-empty and
        within the step limit; the trace's token budget starts here."""
        assert self.config is not None, "the config is read first"
        self._budget = TraceBudget(self.limits, self.config.max_model_len)
        raw = doc[key]
        if not isinstance(raw, list) or not raw:
            raise self.error(None, key, f"must be a non-empty list, got {got(raw)}")
        if len(raw) > self.limits.steps:
            raise self.error(None, key, over("steps", len(raw), self.limits))
        return raw

    def about(self, about: object) -> str:
        if not isinstance(about, str):
            raise self.error(None, "about", f"must be a string, got {got(about)}")
        return about

    def name(self, name: object) -> str:
        if not isinstance(name, str) or not name.strip():
            raise self.error(None, "name", f"must be a non-empty string, got {got(name)}")
        if not name.isprintable() or len(name) > NAME_WIDTH:
            # It heads a report line: a newline in it would print a line of its own.
            raise self.error(
                None,
                "name",
                f"must be one line of at most {NAME_WIDTH} printable characters, got {got(name)}",
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
        about = self.about(doc.get("about", ""))
        tags = self.tags(doc.get("tags", []))
        self.config = self.read_config(doc["config"])
        settings = self.engine_settings(doc.get("scheduler", {}))
        raw_steps = self.entries(doc, "engine")
        engine = tuple(e for i, raw in enumerate(raw_steps) for e in self.engine_step(i, raw))
        device, recorded_by = self.recording(doc, len(raw_steps))
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
            device=device,
            recorded_by=recorded_by,
        )

    def recording(self, doc: Mapping[Any, Any], entries: int) -> tuple[str, str]:
        """A recording's `recording` header and its `end` line; the device
        and the vLLM release it names."""
        if "recording" not in doc:
            if "end" in doc:
                raise self.error(
                    None, "end", "only a recording (with `recording:`) has an end line"
                )
            return "", ""
        raw = doc["recording"]
        if not isinstance(raw, dict):
            raise self.error(None, "recording", f"must be a mapping, got {got(raw)}")
        self.unknown_keys(None, "recording.", raw, _RECORDING_KEYS, "recording key")
        if not isinstance(raw.get("vllm", ""), str):
            raise self.error(None, "recording.vllm", f"must be a string, got {got(raw['vllm'])}")
        part = raw.get("part", 1)
        if not is_count(part) or part == 0:
            raise self.error(None, "recording.part", f"must be an integer >= 1, got {got(part)}")
        if not isinstance(raw.get("follows", ""), str):
            raise self.error(
                None, "recording.follows", f"must be a file name, got {got(raw['follows'])}"
            )
        if not isinstance(raw.get("warm", False), bool):
            raise self.error(
                None, "recording.warm", f"must be true or false, got {got(raw['warm'])}"
            )
        device = raw.get("device", "")
        if device != "" and not (isinstance(device, str) and _DEVICE.fullmatch(device)):
            raise self.error(
                None, "recording.device", f"must be a device name like cpu, got {got(device)}"
            )
        release = str(raw.get("vllm", ""))
        if self.partial:
            return str(device), release
        end = doc.get("end")
        if end is None:
            raise self.error(
                entries,
                "end",
                f"missing: the recording was cut after {entries} entries "
                "(the file ends without its end line)",
            )
        if not isinstance(end, dict):
            raise self.error(None, "end", f"must be a mapping, got {got(end)}")
        self.unknown_keys(None, "end.", end, _END_KEYS, "end key")
        if end.get("entries") != entries:
            raise self.error(
                min(entries, end["entries"]) if is_count(end.get("entries")) else None,
                "end.entries",
                f"says {got(end.get('entries'))} entries, the file holds {entries}",
            )
        return str(device), release

    def tags(self, raw: object) -> tuple[str, ...]:
        if not isinstance(raw, list):
            raise self.error(None, "tags", f"must be a list of words, got {got(raw)}")
        if len(raw) > MAX_TAGS:
            raise self.error(None, "tags", f"{len(raw)} tags, more than {MAX_TAGS}")
        for i, tag in enumerate(raw):
            if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
                raise self.error(
                    None,
                    f"tags[{i}]",
                    "must be a word of letters, digits and _ . + - (at most 64, "
                    f"starting with a letter or digit), got {got(tag)}",
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
        keys = LISTED_CONFIG_KEYS
        if not isinstance(field, str) or field not in keys:
            raise self.error(
                None, "expect_refused", f"{got(field)} is not a config key ({', '.join(keys)})"
            )
        if "steps" in doc:
            raise self.error(
                None, "steps", "a refusal trace (expect_refused) has no steps: nothing is replayed"
            )
        return field
