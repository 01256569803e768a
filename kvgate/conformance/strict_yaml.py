"""The strict YAML loader every trace is read with: PyYAML's safe loader
that refuses a repeated key, an integer too long to convert, and nesting
deeper than the limit, each as one `TraceError`."""

from __future__ import annotations

import json
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any, cast

import yaml
from yaml.nodes import MappingNode

from kvgate.conformance.limits import INT_DIGITS, Limits
from kvgate.conformance.trace_error import TraceError

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


def load_document(text: str, path: Path, limits: Limits) -> object:
    """The one YAML document in `text`, loaded strictly (`path` names errors)."""
    fast = load_flow_body(text, limits)
    if fast is not None:
        return fast
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


def load_flow_entry(text: str) -> object:
    """One flow mapping line (`{...}`) as `load_flow_body` reads a body's
    line, or by the strict YAML loader; `ValueError` naming what does not
    parse."""
    line = text.rstrip("\n")
    if _PLAIN_LINE.fullmatch(line):
        try:
            return _json_line(line)
        except (_NotFlow, ValueError, RecursionError):
            pass
    try:
        return load_flow_line(line)
    except yaml.MarkedYAMLError as error:
        raise ValueError(str(error.problem or error)) from None
    except yaml.YAMLError as error:
        raise ValueError(str(error)) from None


def load_flow_line(text: str) -> object:
    """One line of YAML (a recording's entry line) read by the strict loader;
    raises `yaml.YAMLError` when it does not parse."""
    return yaml.load(text, Loader=_StrictCLoader if yaml.__with_libyaml__ else _StrictLoader)


# -- one flow mapping a line --------------------------------------------------
#
# A trace's `steps` (a recording's `engine`) is written one flow mapping a
# line, `  - {op: arrive, req: A, prompt: [{fresh: 48}]}`: most of a long
# trace's text. When every such line uses only bare words, decimal integers
# and flow punctuation, it is read as JSON after quoting the words (C speed,
# several times faster than even libyaml's constructor); anything else (a
# quoted or multi-word string, a word YAML reads as a bool or null, a float,
# a comment, a long integer, a repeated key, deep nesting) leaves the whole
# document to the YAML loader, so the values read and the errors told are
# the YAML loader's.

_BODY_KEYS = ("steps", "engine")
_PLAIN_LINE = re.compile(r"\{[\[\]{}:, A-Za-z0-9_-]*\}")
# A line of the body: `  - {...}` of bare words, integers and punctuation.
_FLOW_LINE = re.compile(r"  - \{[\[\]{}:, A-Za-z0-9_-]*\}")
# A bare word, captured: splitting on it alternates between the text around
# words and the words.
_WORD = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)")
# What YAML reads otherwise than JSON does once the words are quoted: its
# other spellings of bools and null, a colon not followed by a space, an
# integer too long (the loader words that refusal).
_YAML_WORDS = frozenset(
    [
        "yes",
        "Yes",
        "YES",
        "no",
        "No",
        "NO",
        "True",
        "TRUE",
        "False",
        "FALSE",
        "on",
        "On",
        "ON",
        "off",
        "Off",
        "OFF",
        "Null",
        "NULL",
    ]
)
_NOT_JSON = re.compile(r":(?! )|[0-9]{" + str(INT_DIGITS + 1) + ",}")


class _NotFlow(Exception):
    """The body is not one plain flow mapping a line."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        raise _NotFlow
    return mapping


def load_flow_body(text: str, limits: Limits) -> dict[str, Any] | None:
    """`text` read with its body (`steps:` or `engine:`, one flow mapping a
    line) as JSON and its other lines as YAML; None when the text is not in
    that form or anything in it could read otherwise as YAML (then the YAML
    loader reads it all)."""
    for key in _BODY_KEYS:
        marker = f"\n{key}:\n"
        start = text.find(marker)
        if start >= 0:
            break
    else:
        return None
    body_start = start + len(marker)
    # The body: the lines from there up to the first that is not a flow
    # line (the text after the last newline is no line). A long body
    # repeats a few hundred distinct lines (every decode of a request,
    # every step and drain): each is matched and read once, and the equal
    # lines share what it read (nothing read from a document is changed
    # after). In first-seen order, the first distinct line that is not a
    # flow line is where the body ends.
    pieces = text[body_start:].split("\n")
    del pieces[-1]
    end = len(pieces)
    read: dict[str, object] = {}
    for line in dict.fromkeys(pieces):
        if not _FLOW_LINE.fullmatch(line):
            end = pieces.index(line)
            break
        read[line] = None
    if end == 0:
        return None
    body = pieces[:end]
    body_end = body_start + sum(map(len, body)) + len(body)
    try:
        for line in read:
            # Nesting as the YAML loader counts it: the document, the list, the line's.
            if line.count("{") + line.count("[") + 2 > limits.nesting:
                return None
            read[line] = _json_line(line[4:])
        head = _yaml_mapping(text[: start + 1])
        tail = _yaml_mapping(text[body_end:]) if text[body_end:].strip() else {}
    except (_NotFlow, ValueError, yaml.YAMLError, RecursionError):
        return None
    if head is None or tail is None or head.keys() & tail.keys():
        return None
    if any(k in head or k in tail for k in _BODY_KEYS):
        return None
    return {**head, key: list(map(read.__getitem__, body)), **tail}


def _json_line(line: str) -> object:
    """One flow mapping of bare words, integers and flow punctuation, read
    as JSON once its words are quoted; `_NotFlow` when YAML could read any
    of it otherwise (`ValueError` when it is no JSON either)."""
    if _NOT_JSON.search(line):
        raise _NotFlow
    # Around words and words in turn: quoted by joining on a quote.
    parts = _WORD.split(line)
    if not _YAML_WORDS.isdisjoint(parts[1::2]):
        raise _NotFlow
    quoted = '"'.join(parts)
    for word in _JSON_WORDS:
        quoted = quoted.replace(f'"{word}"', word)
    return json.loads(quoted, object_pairs_hook=_unique_keys)


_JSON_WORDS = ("true", "false", "null")


def _yaml_mapping(text: str) -> dict[Any, Any] | None:
    """`text` by the strict libyaml loader, if PyYAML has it and it is a mapping."""
    if not yaml.__with_libyaml__:
        return None
    loaded = yaml.load(text, Loader=_StrictCLoader)
    return loaded if isinstance(loaded, dict) else None
