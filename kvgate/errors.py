"""The root of kvgate's errors (`KvgateError`: each kind carries the exit
code the command line turns it into, after a single line), the exit code
table, and the text every error and report line is made of.

Trace names, request names, YAML keys and paths come from input; printed
raw, a newline in one forges a report line (`PASS ...`), an escape sequence
rewrites the terminal, and a control character makes JUnit XML unparsable.
Everything an error or a report shows goes through `printable` first.
"""

from __future__ import annotations

from typing import ClassVar

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """`text` with every character that is not printable escaped (`\\n`,
    `\\x1b`, `\\u2028`), so it stays on one line and means only itself.

    Backslashes are kept as they are: the result is for people and parsers
    that must not be fooled, not a reversible encoding.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(char: str) -> str:
    if char in _ESCAPES:
        return _ESCAPES[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


# Exit codes: the one table the command line's help and docs/gate.md show.
EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_INPUT = 2
EXIT_KVGATE_BUG = 3
EXIT_LACKS_REQUIRED = 4
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (
        EXIT_OK,
        "deployable: every trace that ran conforms (a capability not required may be missing)",
    ),
    (
        EXIT_DIVERGED,
        "a trace diverges: the build differs from the model, or misses an expectation "
        "for a reason other than a missing capability; do not deploy",
    ),
    (
        EXIT_INPUT,
        "bad input: an invalid trace, a bad argument, an unknown or unavailable target "
        "(each told in one line), or no trace applicable to the target",
    ),
    (EXIT_KVGATE_BUG, "a bug in kvgate itself (its model raised): please report it"),
    (
        EXIT_LACKS_REQUIRED,
        "conforms, but the build lacks a required capability (--require): the summary "
        "names it, what it costs and the remedy",
    ),
)
# When several apply, the first of these is the exit code.
EXIT_PRECEDENCE: tuple[int, ...] = (
    EXIT_KVGATE_BUG,
    EXIT_INPUT,
    EXIT_DIVERGED,
    EXIT_LACKS_REQUIRED,
    EXIT_OK,
)


def exit_code_table() -> str:
    """The exit codes as `--help` shows them."""
    lines = [f"  {code}  {meaning}" for code, meaning in EXIT_CODES]
    order = ", ".join(str(code) for code in EXIT_PRECEDENCE)
    return "exit codes:\n" + "\n".join(lines) + f"\nwhen several apply, the first of {order}"


class KvgateError(Exception):
    """The root of every error a command reports in one line instead of a
    traceback; `exit_code` is the exit code the command line turns it into."""

    exit_code: ClassVar[int] = EXIT_INPUT


class InputError(KvgateError):
    """Bad input that is not a trace's fault (arguments, targets); exit 2."""
