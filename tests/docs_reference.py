"""The parts of the docs generated from the code, and the command that
regenerates them.

    python tests/docs_reference.py      (from the checkout, kvgate importable)

Each generated part sits in a page between `<!-- generated: NAME -->` and
`<!-- end generated: NAME -->`; `tests/test_docs.py` fails when a part no
longer matches what its generator produces, so a change to the code that
the docs describe shows up as a failing test naming the command above.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402

from kvgate import cli  # noqa: E402
from kvgate.conformance.limits import DEFAULT_LIMITS, Limits  # noqa: E402
from kvgate.errors import EXIT_CODES, EXIT_PRECEDENCE  # noqa: E402
from kvgate.explore import command as explore_command  # noqa: E402
from kvgate.explore.knobs import knobs_by_field  # noqa: E402
from kvgate.invariants.catalogue import CATALOGUE, LEMMAS  # noqa: E402
from kvgate.invariants.z3 import command as prove_command  # noqa: E402
from kvgate.model.scope import not_modelled_text  # noqa: E402
from kvgate.mutate import command as mutate_command  # noqa: E402
from kvgate.vocabulary.schema import config_fields_table, group_fields_table  # noqa: E402
from kvgate.workload import command as workload_command  # noqa: E402

CHECKED_BY = {
    "snapshot": "every step's snapshot",
    "model": "inside the model",
    "lifecycle": "over a request's life",
    "z3": "proved",
}


def invariants_table() -> str:
    rows = ["| invariant | meaning | checked |", "| --- | --- | --- |"]
    for invariant in CATALOGUE:
        where = ", ".join(CHECKED_BY[c] for c in invariant.checked_by)
        rows.append(f"| `{invariant.name}` | {invariant.meaning} | {where} |")
    return "\n".join(rows)


def lemmas_table() -> str:
    rows = ["| lemma | meaning |", "| --- | --- |"]
    rows += [f"| `{lemma.name}` | {lemma.meaning} |" for lemma in LEMMAS]
    return "\n".join(rows)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`" + (" ..." if action.nargs in ("+", "*") else "")
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs == 0:
        return names
    if action.choices is not None:
        return names + " " + "\\|".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or action.dest.upper()
    value = " ".join(metavar) if isinstance(metavar, tuple) else metavar
    # A pipe would end the table cell: such a metavar is written plain.
    return names + (" " + _cell(value) if "|" in value else f" `{value}`")


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    # `is`, not `in`: a default of 0 equals False but is a default to show.
    unset = action.default is None or action.default is False
    if action.nargs == 0 or unset or action.default == argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def _help(action: argparse.Action) -> str:
    """`action`'s help as `--help` shows it: its `%(default)s` and the
    like filled in."""
    text = action.help or ""
    params = {**vars(action), "prog": "kvgate"}
    params = {k: getattr(v, "__name__", v) for k, v in params.items() if v is not argparse.SUPPRESS}
    return text % params if "%" in text else text


def gate_on_upstream() -> str:
    """The gate's summary on upstream vLLM, as docs/results.md publishes it
    (its first run: the installed vLLM as it is), indented as a page shows
    terminal output."""
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    section = results.split("<!-- results: gate -->", 1)[1].split("<!-- end: gate -->", 1)[0]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block is not None, "docs/results.md: the gate section has no output"
    lines = [line for line in block.group(1).splitlines() if not line.startswith("exit ")]
    # Blank lines around it: an indented block after a comment is code.
    return "\n" + "\n".join(f"    {line}" if line else "" for line in lines) + "\n"


def commands_reference() -> str:
    """A section per command: what it does, then a row per argument, all read
    from the parsers `kvgate` itself builds."""
    parser = cli._parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in subparsers._choices_actions}
    parts = []
    for name, command in subparsers.choices.items():
        rows = ["| argument | default | meaning |", "| --- | --- | --- |"]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue  # a hidden option (an old spelling kept for a release)
            rows.append(f"| {_flag(action)} | {_default(action)} | {_cell(_help(action))} |")
        parts.append(f"## `kvgate {name}`\n\n{_cell(helps.get(name, ''))}.\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def exit_codes_table() -> str:
    rows = ["| exit code | meaning |", "| --- | --- |"]
    rows += [f"| `{code}` | {_cell(meaning)} |" for code, meaning in EXIT_CODES]
    order = ", ".join(str(code) for code in EXIT_PRECEDENCE)
    return "\n".join(rows) + f"\n\nWhen several apply, the first of {order} is the exit code."


def trace_limits_table() -> str:
    rows = ["| limit | default |", "| --- | --- |"]
    rows += [f"| `{name}` | {getattr(DEFAULT_LIMITS, name):,} |" for name in Limits.names()]
    return "\n".join(rows)


def _seconds(seconds: float) -> str:
    return "a day" if seconds == 86_400 else f"{seconds:g} s"


def flag_ranges_table() -> str:
    """The range of every bounded flag, read from the constants each command checks."""
    rows = ["| command | flag | range |", "| --- | --- | --- |"]
    for flag, (low, high) in workload_command.FLAG_RANGES.items():
        rows.append(f"| `kvgate workload` | `--{flag}` | {low} to {high:,} |")
    rows.append(f"| `kvgate workload` | `--units` | each at most {workload_command.MAX_UNIT:,} |")
    for flag, high in prove_command.MAX_FLAGS.items():
        rows.append(f"| `kvgate prove` | `--{flag}` | at most {high} |")
    rows.append(
        f"| `kvgate prove` | `--search-timeout` | at most {_seconds(prove_command.MAX_SECONDS)} |"
    )
    rows.append(
        f"| `kvgate explore` | `--budget` | at most {explore_command.MAX_EXAMPLES:,} examples, "
        f"or {_seconds(explore_command.MAX_SECONDS)} |"
    )
    rows.append(f"| `kvgate mutate` | `--jobs` | 1 to {mutate_command.MAX_JOBS} |")
    rows.append(
        f"| `kvgate mutate` | `--timeout` | at most {_seconds(mutate_command.MAX_TIMEOUT)} |"
    )
    return "\n".join(rows)


# page (relative to the checkout) -> part name -> its generator
GENERATED: dict[str, dict[str, Callable[[], str]]] = {
    "README.md": {"exit-codes": exit_codes_table},
    "docs/reference/commands.md": {"commands": commands_reference},
    "docs/gate.md": {"gate-on-upstream": gate_on_upstream},
    "docs/explanation/blind-spots.md": {"not-modelled": not_modelled_text},
    "docs/reference/knobs.md": {
        "config-fields": lambda: config_fields_table(knobs_by_field()),
        "group-fields": group_fields_table,
        "not-modelled": not_modelled_text,
    },
    "docs/reference/limits.md": {
        "trace-limits": trace_limits_table,
        "flag-ranges": flag_ranges_table,
    },
    "docs/explanation/invariants-and-proofs.md": {
        "invariants": invariants_table,
        "lemmas": lemmas_table,
    },
}


def part_pattern(name: str) -> re.Pattern[str]:
    marker = re.escape(name)
    return re.compile(
        rf"(<!-- generated: {marker} -->\n)(.*?)(<!-- end generated: {marker} -->)", re.S
    )


def stale_parts() -> list[str]:
    """`page: part` for every generated part that differs from its generator."""
    stale = []
    for page, parts in GENERATED.items():
        text = (ROOT / page).read_text(encoding="utf-8")
        for name, generate in parts.items():
            found = part_pattern(name).search(text)
            if found is None or found.group(2) != generate() + "\n":
                stale.append(f"{page}: {name}")
    return stale


def _fill(body: str, found: re.Match[str]) -> str:
    return found.group(1) + body + found.group(3)


def regenerate() -> None:
    for page, parts in GENERATED.items():
        path = ROOT / page
        text = path.read_text(encoding="utf-8")
        for name, generate in parts.items():
            filled = functools.partial(_fill, generate() + "\n")
            text, count = part_pattern(name).subn(filled, text)
            if count != 1:
                raise SystemExit(f"{page}: no '<!-- generated: {name} -->' part to fill")
        path.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    regenerate()
