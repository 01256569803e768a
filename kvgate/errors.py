"""The one error every command turns into exit 2 with a single line, and the
text every error and report line is made of.

Trace names, request names, YAML keys and paths come from input; printed
raw, a newline in one forges a report line (`PASS ...`), an escape sequence
rewrites the terminal, and a control character makes JUnit XML unparsable.
Everything an error or a report shows goes through `printable` first.
"""

from __future__ import annotations


class InputError(Exception):
    """Bad input that is not a trace's fault (arguments, targets); exit 2."""


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
