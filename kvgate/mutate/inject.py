"""Apply one fault to the running process, from the installed source text.

A fault names a function (`module`, `qualname`), an exact `anchor` inside it
and its `replacement`. `apply` reads the function's source with `inspect`,
checks the anchor occurs exactly once and that replacing it changes exactly
one line, compiles the edited function against the module's own globals and
rebinds it where it lives (class attribute or module global). Nothing on
disk changes; the edit lasts as long as the process, or until `Applied.revert`.

A fault whose module, function or anchor is missing from the installed build
is `NotApplicable`: it says nothing about that build, so it is never counted
as caught or missed.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import FunctionType
from typing import Any

from kvgate.mutate.faults import Fault

# The factory the edited function is compiled inside: its parameter is the
# `__class__` cell that zero-argument `super()` reads in a method.
_FACTORY = "__kvgate_fault_factory__"


class NotApplicable(Exception):
    """The fault's target or anchor is not in the installed code."""


@dataclass(frozen=True)
class Edit:
    """The one line a fault changes, as found in the installed source."""

    filename: str
    lineno: int  # in the file
    before: str
    after: str


@dataclass
class Applied:
    """A fault in effect in this process; `revert` puts the original back."""

    fault: Fault
    edit: Edit
    owner: Any  # the class or module the function is an attribute of
    attribute: str
    original: Any  # the raw attribute (function, classmethod, staticmethod)
    replaced: Any

    def revert(self) -> None:
        setattr(self.owner, self.attribute, self.original)


def at_site(fault: Fault) -> Fault:
    """`fault` at the first of its sites (its own anchor, then its ports)
    found exactly once in the installed code; `NotApplicable` naming why
    each site failed when none is."""
    reasons: list[str] = []
    for site in fault.sites():
        candidate = replace(
            fault,
            module=site.module,
            qualname=site.qualname,
            anchor=site.anchor,
            replacement=site.replacement,
        )
        try:
            _edit(candidate, locate(candidate)[3])
        except NotApplicable as error:
            reasons.append(str(error))
            continue
        return candidate
    raise NotApplicable("; port: ".join(reasons))


def locate(fault: Fault) -> tuple[Any, str, Any, FunctionType]:
    """(owner, attribute name, raw attribute, its function) for `fault`."""
    try:
        module = importlib.import_module(fault.module)
    except ImportError as error:
        raise NotApplicable(f"module {fault.module} not importable: {error}") from None
    owner: Any = module
    *path, attribute = fault.qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            raise NotApplicable(f"{fault.module} has no {fault.qualname}")
    # The raw attribute, not the bound or unwrapped one: what setattr restores.
    raw = vars(owner).get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
    if raw is None:
        raise NotApplicable(f"{fault.module} has no {fault.qualname}")
    function = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    if not isinstance(function, FunctionType):
        raise NotApplicable(f"{fault.qualname} is not a Python function")
    return owner, attribute, raw, function


def find_edit(fault: Fault) -> Edit:
    """The line `fault` changes, or `NotApplicable`. Changes nothing."""
    fault = at_site(fault)
    _, _, _, function = locate(fault)
    return _edit(fault, function)[2]


def _edit(fault: Fault, function: FunctionType) -> tuple[str, str, Edit]:
    """(dedented source, edited source, the edit) of `function`."""
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError) as error:
        raise NotApplicable(f"{fault.qualname}: no source ({error})") from None
    source = textwrap.dedent("".join(lines))
    found = source.count(fault.anchor)
    if found != 1:
        where = "not found" if found == 0 else f"found {found} times"
        raise NotApplicable(f"{fault.qualname}: anchor {fault.anchor!r} {where}")
    edited = source.replace(fault.anchor, fault.replacement)
    before, after = source.splitlines(), edited.splitlines()
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b]
    if len(before) != len(after) or len(changed) != 1:
        raise NotApplicable(f"{fault.name}: the edit must change exactly one line")
    [index] = changed
    edit = Edit(
        filename=inspect.getsourcefile(function) or "<unknown>",
        lineno=first + index,
        before=before[index].strip(),
        after=after[index].strip(),
    )
    return source, edited, edit


def compile_edited(function: FunctionType, edited: str, first_line: int, filename: str) -> Any:
    """The edited definition compiled in the function's own module globals.

    Wrapped in a factory whose parameter is `__class__`, so a method that
    calls zero-argument `super()` still finds its class; line numbers are
    shifted to the file's, so tracebacks point at the installed source.
    """
    factory = (
        f"def {_FACTORY}(__class__):\n"
        + textwrap.indent(edited, "    ")
        + f"    return {function.__name__}\n"
    )
    tree = ast.parse(factory, filename=filename)
    ast.increment_lineno(tree, first_line - 2)
    namespace: dict[str, Any] = {}
    exec(compile(tree, filename, "exec"), function.__globals__, namespace)
    owner_class = _defining_class(function)
    made = namespace[_FACTORY](owner_class)
    made_function = made.__func__ if isinstance(made, (classmethod, staticmethod)) else made
    made_function.__qualname__ = function.__qualname__
    made_function.__module__ = function.__module__
    made_function.__kwdefaults__ = function.__kwdefaults__
    made_function.__defaults__ = function.__defaults__
    return made


def _defining_class(function: FunctionType) -> type | None:
    """The class whose `super()` cell the original function closes over."""
    if "__class__" in function.__code__.co_freevars and function.__closure__:
        index = function.__code__.co_freevars.index("__class__")
        cell = function.__closure__[index].cell_contents
        return cell if isinstance(cell, type) else None
    return None


def apply(fault: Fault) -> Applied:
    """Put `fault` into effect in this process (at its first site the
    installed code holds); `NotApplicable` if it cannot."""
    fault = at_site(fault)
    owner, attribute, raw, function = locate(fault)
    extra = set(function.__code__.co_freevars) - {"__class__"}
    if extra:
        raise NotApplicable(f"{fault.qualname} closes over {sorted(extra)}")
    _, edited, edit = _edit(fault, function)
    _, first = inspect.getsourcelines(function)
    replaced = compile_edited(function, edited, first, edit.filename)
    setattr(owner, attribute, replaced)
    return Applied(fault, edit, owner, attribute, raw, replaced)


@contextmanager
def injected(fault: Fault) -> Iterator[Applied]:
    """`fault` in effect inside the block, reverted after it."""
    applied = apply(fault)
    try:
        yield applied
    finally:
        applied.revert()
