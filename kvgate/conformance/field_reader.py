"""What the readers of a trace's parts share: where the reader is (file,
limits, each request's life so far, the config once read, the token
budget), its one-line errors, the key checks, and the fields both kinds of
step carry (a prompt's segments, a request's text fields)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from kvgate.conformance.limits import TOKEN_ID_BOUND, LimitError, Limits, TraceBudget
from kvgate.conformance.trace_error import TraceError
from kvgate.vocabulary.config import Config
from kvgate.vocabulary.ops import Phase, Segment
from kvgate.vocabulary.tokens import MmItem

_SEGMENT_KINDS = ("fresh", "all_of", "prompt_of", "tokens")


class FieldReader:
    """The state of one trace's reading and the checks every part of it uses."""

    def __init__(self, path: Path, limits: Limits, partial: bool = False) -> None:
        self.path = path
        self.limits = limits
        # A recording's entries before a cut: no `end` line to check.
        self.partial = partial
        self.requests: dict[str, tuple[Phase, str]] = {}  # name -> (phase, since when)
        # Scheduler-level traces: the streaming-input sessions (resumable requests).
        self.sessions: set[str] = set()
        self.drafts = 0  # the scheduler settings' draft tokens a step (`spec`)
        self.config: Config | None = None
        self._budget: TraceBudget | None = None

    @property
    def budget(self) -> TraceBudget:
        assert self._budget is not None, "the config is read first"
        return self._budget

    def error(self, index: int | None, field: str, message: str) -> TraceError:
        return TraceError(self.path, index, field, message)

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

    def op_of(
        self, index: int, raw: object, known: tuple[str, ...], what: str
    ) -> tuple[dict[Any, Any], str]:
        """A step's mapping and its `op`, one of `known`."""
        if not isinstance(raw, dict):
            raise self.error(index, "step", f"must be a mapping with an `op`, got {got(raw)}")
        op = raw.get("op")
        if op is None:
            raise self.error(index, "op", "missing")
        if not isinstance(op, str) or op not in known:
            raise self.error(
                index, "op", f"unknown {what} {got(op)} (expected one of {', '.join(known)})"
            )
        return raw, op

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
                f"got {got(value)}",
            )
        return value

    def prompt(self, index: int, raw: object) -> tuple[Segment, ...]:
        if not isinstance(raw, list) or not raw:
            raise self.error(
                index, "prompt", f"must be a non-empty list of segments, got {got(raw)}"
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
                f"got {got(raw)}",
            )
        ((kind, value),) = raw.items()
        field = f"{where}.{kind}"
        if kind == "fresh":
            if not is_count(value):
                raise self.error(index, field, f"must be an integer >= 0, got {got(value)}")
            self.charge(index, field, value)
            return Segment("fresh", count=value)
        if kind == "tokens":
            if not isinstance(value, list):
                raise self.error(
                    index, field, f"must be a list of token ids (integers >= 0), got {got(value)}"
                )
            # Counted before it is read: one long list behind many aliases
            # would otherwise be walked once per alias.
            self.charge(index, field, len(value))
            if not all(is_count(t) and t < TOKEN_ID_BOUND for t in value):
                raise self.error(
                    index,
                    field,
                    f"must be a list of token ids (integers >= 0 and < 2**63), got {got(value)}",
                )
            return Segment("tokens", token_ids=tuple(value))
        if kind in ("all_of", "prompt_of"):
            if not isinstance(value, str) or value not in self.requests:
                raise self.error(index, field, f"names no request that has arrived: {got(value)}")
            self.charge(index, field, self.budget.copied(kind, value))
            return Segment(kind, req=value)
        raise self.error(
            index,
            where,
            f"unknown segment kind {got(kind)} (expected one of {', '.join(_SEGMENT_KINDS)})",
        )

    def charge(self, index: int, field: str, tokens: int) -> None:
        try:
            self.budget.add_tokens(tokens, field)
        except LimitError as error:
            raise self.error(index, error.field, error.message) from None

    def mm(self, index: int, raw: object) -> tuple[MmItem, ...]:
        """Multimodal placeholders: sorted by offset, disjoint, each at least
        one token (vLLM's hasher assumes the order)."""
        if not isinstance(raw, list) or not raw:
            raise self.error(
                index, "mm", f"must be a non-empty list of {{offset, length, id}}, got {got(raw)}"
            )
        items: list[MmItem] = []
        for i, entry in enumerate(raw):
            where = f"mm[{i}]"
            if not isinstance(entry, dict):
                raise self.error(
                    index, where, f"must be a mapping {{offset, length, id}}, got {got(entry)}"
                )
            self.unknown_keys(index, where + ".", entry, ("offset", "length", "id"), "key")
            self.missing_keys(index, where + ".", entry, ("offset", "length", "id"))
            offset, length = entry["offset"], entry["length"]
            if not is_count(offset):
                raise self.error(
                    index, f"{where}.offset", f"must be an integer >= 0, got {got(offset)}"
                )
            if not is_count(length) or length == 0:
                raise self.error(
                    index, f"{where}.length", f"must be an integer >= 1, got {got(length)}"
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


def is_count(value: object) -> TypeGuard[int]:
    # YAML `true` is a bool, which Python counts as an int; a count it is not.
    return type(value) is int and value >= 0


def got(value: object) -> str:
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
