"""The strict YAML loader every trace is read with: PyYAML's safe loader
that refuses a repeated key, an integer too long to convert, and nesting
deeper than the limit, each as one `TraceError`."""

from __future__ import annotations

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


def load_flow_line(text: str) -> object:
    """One line of YAML (a recording's entry line) read by the strict loader;
    raises `yaml.YAMLError` when it does not parse."""
    return yaml.load(text, Loader=_StrictCLoader if yaml.__with_libyaml__ else _StrictLoader)
