"""Which traces a run selects: `-k EXPR`, `--arm`, `--family`, as pytest users expect.

A trace's family and arm come from its config, never its file name:

- the arm is the hold switches: `fork` (the production fork's retention,
  `retain_retired`, with or without the hold), `hold-on` (`retain_checkpoint`
  alone) or `hold-off`;
- the family is the deployment the Mamba groups' prefill checkpoint stands
  for: `mamba2` (a checkpoint block at alignment 1: Mamba2 layers),
  `gdn-flashinfer` (one on a grid of 64-token multiples: GDN on FlashInfer),
  `gdn-triton` (a hybrid with none: GDN on Triton), or `gdn-cpu` for a
  recording of such a hybrid served by vLLM's CPU build (`recording.device`
  is `cpu`: GDN on vLLM's CPU kernels); a config that is none of these (no
  Mamba group, a pure Mamba model without a checkpoint, another grid) has no
  family.

`-k` is pytest's keyword expression: words joined by `and`, `or`, `not` and
parentheses; a word matches a trace when it is a substring (case
insensitive) of its name, one of its tags, its family or its arm.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvgate.conformance.trace import Trace
from kvgate.errors import KvgateError
from kvgate.vocabulary.config import Config

ARMS: tuple[str, ...] = ("hold-off", "hold-on", "fork")
FAMILIES: tuple[str, ...] = ("gdn-triton", "gdn-flashinfer", "mamba2", "gdn-cpu")
# What a FlashInfer GDN checkpoint's alignment is a multiple of.
FLASHINFER_GRID = 64


def arm(config: Config) -> str:
    if config.retain_retired:
        return "fork"
    return "hold-on" if config.hold else "hold-off"


def family(config: Config) -> str | None:
    mamba = [config.groups[i] for i in config.mamba_group_ids]
    if not mamba:
        return None
    if any(
        g.prefill_checkpoint_blocks == 0 or g.prefill_checkpoint_alignment is None for g in mamba
    ):
        return "gdn-triton" if config.has_attention else None
    # As vLLM's scheduler does: the first Mamba group's alignment counts.
    alignment = mamba[0].prefill_checkpoint_alignment
    if alignment == 1:
        return "mamba2"
    if alignment is not None and alignment % FLASHINFER_GRID == 0:
        return "gdn-flashinfer"
    return None


def trace_family(trace: Trace) -> str | None:
    """A trace's family: its config's, except that a hybrid without a
    prefill checkpoint recorded on vLLM's CPU build runs its GDN layers on
    the CPU kernels, not on Triton."""
    found = family(trace.config)
    if found == "gdn-triton" and trace.device == "cpu":
        return "gdn-cpu"
    return found


def keywords(trace: Trace) -> tuple[str, ...]:
    """What `-k` matches a trace by: its name, tags, family and arm."""
    found = trace_family(trace)
    return (trace.name, *trace.tags, *((found,) if found else ()), arm(trace.config))


class SelectionError(KvgateError, ValueError):
    """A selection that cannot be read (`-k`'s syntax); one line."""


# A `-k` word, as pytest's lexer reads one.
_WORD = re.compile(r"(?:\w|[:+\-.\[\]\\/])+")
_KEYWORDS = ("and", "or", "not")

Matcher = Callable[[Sequence[str]], bool]


def keyword_matcher(expression: str) -> Matcher:
    """`expression` (pytest's `-k` syntax) as a test of a trace's keywords."""
    tokens = _tokens(expression)
    if not tokens:
        return lambda _keywords: True
    parser = _Parser(tokens, expression)
    matcher = parser.expression()
    if parser.position < len(tokens):
        raise SelectionError(f"{expression!r}: unexpected {tokens[parser.position]!r}")
    return matcher


def _tokens(expression: str) -> list[str]:
    tokens: list[str] = []
    position = 0
    while position < len(expression):
        char = expression[position]
        if char.isspace():
            position += 1
        elif char in "()":
            tokens.append(char)
            position += 1
        else:
            word = _WORD.match(expression, position)
            if word is None:
                raise SelectionError(f"{expression!r}: unexpected character {char!r}")
            tokens.append(word.group())
            position = word.end()
    return tokens


class _Parser:
    """expression := and ('or' and)*; and := not ('and' not)*;
    not := 'not' not | '(' expression ')' | word."""

    def __init__(self, tokens: list[str], text: str) -> None:
        self.tokens = tokens
        self.text = text
        self.position = 0

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise SelectionError(f"{self.text!r}: ends where a word was expected")
        self.position += 1
        return token

    def expression(self) -> Matcher:
        return self.joined("or", self.conjunction, any)

    def conjunction(self) -> Matcher:
        return self.joined("and", self.negation, all)

    def joined(
        self, word: str, operand: Callable[[], Matcher], combine: Callable[[Iterable[bool]], bool]
    ) -> Matcher:
        """Operands joined by `word` (or, and): one matcher, `combine` of theirs."""
        parts = [operand()]
        while self.peek() == word:
            self.take()
            parts.append(operand())
        return parts[0] if len(parts) == 1 else lambda k: combine(p(k) for p in parts)

    def negation(self) -> Matcher:
        token = self.take()
        if token == "not":
            inner = self.negation()
            return lambda k: not inner(k)
        if token == "(":
            inner = self.expression()
            if self.take() != ")":
                raise SelectionError(f"{self.text!r}: a '(' is not closed")
            return inner
        if token in (")", "and", "or"):
            raise SelectionError(f"{self.text!r}: unexpected {token!r}")
        word = token.lower()
        return lambda k: any(word in keyword.lower() for keyword in k)


@dataclass(frozen=True)
class Selection:
    """What a run selects; everything by default."""

    expression: str = ""
    arms: tuple[str, ...] = ()
    families: tuple[str, ...] = ()

    def matcher(self) -> Callable[[Trace], bool]:
        """The test of one trace; SelectionError when `expression` is unreadable."""
        matches = keyword_matcher(self.expression)

        def selected(trace: Trace) -> bool:
            if self.arms and arm(trace.config) not in self.arms:
                return False
            if self.families and trace_family(trace) not in self.families:
                return False
            return matches(keywords(trace))

        return selected

    def select(self, traces: Sequence[Trace]) -> list[Trace]:
        selected = self.matcher()
        return [t for t in traces if selected(t)]


# The JUnit classname of a trace that could not be read (no config to place it by).
INVALID_CLASSNAME = "kvgate.invalid"


def classname(trace: Trace) -> str:
    """`kvgate.<family>.<arm>`, so CI groups results by both; `other` when
    the config is of no family."""
    return f"kvgate.{trace_family(trace) or 'other'}.{arm(trace.config)}"


def describe(trace: Trace) -> str:
    """One line naming a selected trace, its family, arm and tags (`--list`)."""
    tags = f", tags {' '.join(trace.tags)}" if trace.tags else ""
    return f"{trace.name} ({classname(trace)}{tags}): {trace.path}"
