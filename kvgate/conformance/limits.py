"""How big a trace may be: the documented limits, checked before anything runs.

A trace is input from anywhere (a colleague, a fuzzer, a generator gone
wrong), so the reader bounds what it costs before a target sees it: the
file's size, how deep its YAML nests, how many primitive steps its macros
expand to, how many tokens its prompts hold, and the few numbers a target
turns into memory (`num_blocks`, `lookahead`, `spec`). Each limit has a name
a user can raise with `--limit NAME=N` (`kvgate replay`, `kvgate gate`);
`TOKEN_ID_BOUND` is the one that cannot move, since every target stores
token ids as signed 64-bit integers.

The defaults sit above anything kvgate itself writes (the workload's
largest trace at full size: 3.2 MB, 56,583 steps, 5.7 million prompt
tokens, 11,326 blocks) and below what exhausts a CI box's memory: PyYAML
builds about 110 bytes of nodes per byte of the densest YAML (a long list
of one-digit ints), so 8 MiB of trace costs at most about 1 GiB to read.
The format document lists them (docs/trace-format.md, "Limits").
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, fields, replace
from pathlib import Path

from kvgate.errors import KvgateError
from kvgate.vocabulary.ops import Segment

# Token ids are int64 in vLLM and in the prefix keys' digest input.
TOKEN_ID_BOUND = 2**63
# The most digits an integer scalar may have: YAML integers wider than this
# are refused before Python converts them (a 5,000-digit int costs time and
# raises outside YAML's errors); every bound below fits in it.
INT_DIGITS = 20


@dataclass(frozen=True)
class Limits:
    """The limits a trace must stay within; field names are the `--limit` names."""

    file_bytes: int = 8 * 2**20  # the trace file, in bytes
    nesting: int = 32  # YAML collections inside each other (a valid trace needs 6)
    num_blocks: int = 2**18  # config.num_blocks
    steps: int = 2_000_000  # primitive steps once `decode` macros are expanded
    tokens: int = 2**24  # prompt tokens summed over every `arrive`, `all_of` counted in full
    lookahead: int = 256  # an allocate's or a prefill's `lookahead`
    spec: int = 256  # a decode's draft tokens per step

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def raised(self, assignment: str) -> Limits:
        """These limits with one `NAME=N` from the command line applied."""
        name, sep, value = assignment.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in self.names():
            raise ValueError(
                f"{assignment[:40]!r} is not NAME=N with NAME one of {', '.join(self.names())}"
            )
        if not value.strip().isdigit() or len(value.strip()) > INT_DIGITS:
            raise ValueError(f"{name}: {value[:40]!r} is not a whole number of at most 20 digits")
        number = int(value)
        if number < 1:
            raise ValueError(f"{name}: must be at least 1")
        return replace(self, **{name: number})


DEFAULT_LIMITS = Limits()


class LimitError(KvgateError, ValueError):
    """A trace beyond a limit: `field` names where, the message says which limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def over(name: str, value: int, limits: Limits, unit: str = "") -> str:
    """The message for `value` beyond the limit `name`, with how to raise it."""
    value_text = f"{value:,} {unit}" if unit else f"{value:,}"
    return (
        f"{value_text} exceeds the limit {name} = {getattr(limits, name):,} "
        f"(raise it with --limit {name}=N)"
    )


def check_file(path: Path, limits: Limits) -> None:
    """A regular file no larger than `limits.file_bytes`, by `stat` alone."""
    try:
        info = os.stat(path)
    except OSError as error:
        raise LimitError("file", f"cannot read: {error.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise LimitError("file", f"is {kind}; a trace is read from a regular file only")
    if info.st_size > limits.file_bytes:
        raise LimitError("file", over("file_bytes", info.st_size, limits, "bytes"))


def read_bounded(path: Path, limits: Limits) -> bytes:
    """The bytes of a regular file no larger than `limits.file_bytes`.

    Checked with `stat` before the file is opened, so a FIFO (whose open
    blocks until a writer comes) or a device such as /dev/zero is refused
    without reading; the read itself stops one byte past the limit, for
    files whose size `stat` does not tell (/proc).
    """
    check_file(path, limits)
    try:
        with open(path, "rb") as stream:
            data = stream.read(limits.file_bytes + 1)
    except OSError as error:
        raise LimitError("file", f"cannot read: {error.strerror}") from None
    if len(data) > limits.file_bytes:
        raise LimitError("file", over("file_bytes", len(data), limits, "bytes"))
    return data


class TraceBudget:
    """One trace's running totals, against its limits and its config, kept by
    the reader as it goes, so a trace is refused before the step that would
    make it too big is even built.

    A prompt's length is known before replay up to the outputs of the
    requests it copies (`all_of`): each `decode1` appends at most two tokens
    (the token the last chunk sampled, and the step's own) and the drafts
    it accepts. So every prompt
    has a least and a most length; the most counts against `tokens`, the
    least against the config's `max_model_len`.
    """

    def __init__(self, limits: Limits, max_model_len: int) -> None:
        self.limits = limits
        self.max_model_len = max_model_len
        self.steps = 0
        self.tokens = 0
        self.prompt_least: dict[str, int] = {}
        self.prompt_most: dict[str, int] = {}
        self.output_most: dict[str, int] = {}

    def add_steps(self, n: int, field: str) -> None:
        self.steps += n
        if self.steps > self.limits.steps:
            raise LimitError(field, "primitive steps: " + over("steps", self.steps, self.limits))

    def add_tokens(self, n: int, field: str) -> None:
        self.tokens += n
        if self.tokens > self.limits.tokens:
            raise LimitError(
                field, "prompt tokens in the trace: " + over("tokens", self.tokens, self.limits)
            )

    def copied(self, kind: str, req: str) -> int:
        """The most tokens an `all_of`/`prompt_of` segment of `req` holds."""
        most = self.prompt_most[req]
        return most + self.output_most[req] if kind == "all_of" else most

    def arrive(self, req: str, segments: tuple[Segment, ...]) -> None:
        written = sum(s.count + len(s.token_ids) for s in segments if s.req is None)
        copied = [(s.kind, s.req) for s in segments if s.req is not None]
        least = written + sum(self.prompt_least[r] for _, r in copied)
        if least > self.max_model_len:
            raise LimitError(
                "prompt",
                f"at least {least:,} tokens, more than config.max_model_len {self.max_model_len:,}",
            )
        self.prompt_least[req] = least
        self.prompt_most[req] = written + sum(self.copied(kind, r) for kind, r in copied)
        self.output_most[req] = 0

    def decoded(self, req: str, decode_steps: int, accepted: int = 0) -> None:
        self.output_most[req] += (2 + accepted) * decode_steps
