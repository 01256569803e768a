"""The command-line grammar every kvgate command shares, written once.

The same idea has the same flag on every command: `--target`, `--overlay`
(kvgate's hold overlay loaded into vLLM), `--plugin`, `--level`, `--scope`, `--hold`,
`--seed`, `--profile`/`--budget`, `--out` and `-q`/`-v`. Each command adds
them through these functions, with its own default and help, and `finish`
makes every `--help` show every default. Fault and mutation names are
kebab-case for users. A spelling a release used to accept keeps working
for one more release, with a one-line notice on stderr (`deprecated`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.errors import InputError
from kvgate.output import QUIET

# The module `--overlay` loads as a vLLM general plugin.
OVERLAY_PLUGIN = "kvgate.impl.hold_overlay"

# The dest of each shared option and its one spelling; tests/test_options.py
# checks every command against it.
SHARED: dict[str, str] = {
    "target": "--target",
    "overlay": "--overlay",
    "plugin": "--plugin",
    "level": "--level",
    "scope": "--scope",
    "hold": "--hold",
    "seed": "--seed",
    "profile": "--profile",
    "budget": "--budget",
    "out": "--out",
    "verbosity": "--verbose",
}

# Old spellings still accepted (each with a notice), for the docs and tests.
DEPRECATED: dict[str, str] = {
    "explore --target vllm+overlay": "explore --target vllm --overlay",
    "mutate --explore-seed N": "mutate --seed N",
    "workload --hold on,off": "workload --hold both",
    "prove --mutation snake_case_name": "prove --mutation kebab-case-name",
    "mutate --faults snake_case_name": "mutate --faults kebab-case-name",
}


def deprecated(old: str, new: str) -> None:
    """The one-line notice for an old spelling that still works."""
    print(
        f"kvgate: deprecated: {old} is now spelled {new}; "
        f"the old spelling goes in the next release",
        file=sys.stderr,
    )


class _DeprecatedFlag(argparse.Action):
    """A hidden old flag: stores into the new flag's dest, with a notice."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        deprecated(str(option_string), self.new)
        setattr(namespace, self.dest, values)


def add_deprecated_flag(
    parser: argparse.ArgumentParser, old: str, new: str, dest: str, **kwargs: Any
) -> None:
    parser.add_argument(old, action=_DeprecatedFlag, dest=dest, new=new, **kwargs)


# -- the shared options ------------------------------------------------------


def add_target(
    parser: argparse.ArgumentParser, choices: Sequence[str], default: str, help: str = ""
) -> None:
    parser.add_argument(
        "--target", default=default, choices=choices, help=help or "what to run against"
    )


def add_overlay(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--overlay",
        action="store_true",
        help=f"load kvgate's hold overlay into vLLM (the same as --plugin {OVERLAY_PLUGIN})",
    )


def add_plugin(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin",
        metavar="MODULE",
        help="a vLLM plugin module for the vLLM targets, or 'entry-points' to run vLLM's "
        "own vllm.general_plugins loader (default: none)",
    )


def plugin_of(args: argparse.Namespace) -> str | None:
    """The plugin `--overlay` and `--plugin` ask for (None: upstream vLLM)."""
    plugin: str | None = getattr(args, "plugin", None)
    if getattr(args, "overlay", False):
        if plugin not in (None, OVERLAY_PLUGIN):
            raise InputError(f"--overlay: loads {OVERLAY_PLUGIN}; leave out --plugin {plugin}")
        return OVERLAY_PLUGIN
    return plugin


def add_partial(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--partial",
        action="store_true",
        help="a recording cut short (a truncated file, an entry cut mid-write, an entry this "
        "kvgate does not know) replays the entries recorded before the cut, with a note, "
        "instead of being refused (docs/how-to/record-and-replay.md)",
    )


def add_level(parser: argparse.ArgumentParser, levels: Sequence[str], default: str) -> None:
    parser.add_argument(
        "--level",
        default=default,
        choices=levels,
        help="how closely the target must follow the model: api (what a caller sees) or "
        "strict (also the manager's state)",
    )


# What a run drives: kvgate's model of the Scheduler issuing manager calls
# (`manager`), or whole engine steps on the Scheduler itself (`scheduler`).
SCOPES = ("manager", "scheduler")


def add_scope(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    parser.add_argument("--scope", default=default, choices=SCOPES, help=help)


HOLD_ARMS = ("on", "off", "both")


def add_hold(
    parser: argparse.ArgumentParser, default: str | None, help: str, both: bool = True
) -> None:
    arms = HOLD_ARMS if both else HOLD_ARMS[:2]
    parser.add_argument(
        "--hold",
        default=default,
        type=lambda text: _hold_arm(text, arms),
        metavar="{" + ",".join(arms) + "}",
        help=help,
    )


def _hold_arm(text: str, arms: Sequence[str]) -> str:
    if "both" in arms and text in ("on,off", "off,on"):
        deprecated(f"--hold {text}", "--hold both")
        return "both"
    if text not in arms:
        raise InputError(f"--hold: {text[:40]!r} is not {', '.join(arms[:-1])} or {arms[-1]}")
    return text


def hold_values(arm: str) -> list[bool]:
    """The hold switch of each arm `--hold` names, off first."""
    return {"on": [True], "off": [False], "both": [False, True]}[arm]


def add_seed(parser: argparse.ArgumentParser, default: int | None, help: str) -> None:
    parser.add_argument("--seed", type=int, default=default, metavar="N", help=help)


def add_out(parser: argparse.ArgumentParser, default: Path, help: str) -> None:
    parser.add_argument("--out", type=Path, default=default, metavar="DIR", help=help)


def check_output_file(path: Path, flag: str) -> None:
    """`path` is a file this process can write (opened for appending, and
    removed again if it was not there), or `InputError` in one line: checked
    before a run, not after it."""
    if path.is_dir():
        raise InputError(f"{flag}: cannot write {path}: it is a directory")
    existed = path.exists()
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as error:
        raise InputError(f"{flag}: cannot write {path}: {error.strerror}") from None
    if not existed:
        path.unlink()


def check_output_dir(path: Path, flag: str) -> None:
    """`path` is a directory this process can write in, or one it can
    create (its nearest existing ancestor a writable directory; nothing is
    created here), or `InputError` in one line: checked before a run."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag}: {path} exists and is not a directory")
    if path.is_dir():
        try:
            probe = path / ".kvgate-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise InputError(f"{flag}: cannot write in {path}: {error.strerror}") from None
        return
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"{flag}: cannot create {path}: {ancestor} is not a directory")
    import tempfile  # here: only a command given an output path pays for it

    try:
        # A real attempt (permissions alone do not say, for root or /proc).
        os.rmdir(tempfile.mkdtemp(prefix=".kvgate-write-test", dir=ancestor))
    except OSError as error:
        raise InputError(f"{flag}: cannot write in {path}: {error.strerror}") from None


def check_output_paths(args: argparse.Namespace) -> None:
    """Every output path a command was given, checked before it runs:
    `--junit-xml` (a file) and `--out` (a directory; a file where the
    command's `--out` names one, as `kvgate shrink`'s does)."""
    junit: Path | None = getattr(args, "junit_xml", None)
    if junit is not None:
        check_output_file(junit, "--junit-xml")
    out: Path | None = getattr(args, "out", None)
    if out is not None:
        if getattr(args, "out_is_file", False):
            check_output_file(out, "--out")
        else:
            check_output_dir(out, "--out")


def add_verbosity(parser: argparse.ArgumentParser) -> None:
    """-q / -v / -vv (see kvgate/output.py)."""
    levels = parser.add_argument_group("output")
    levels.add_argument(
        "-v",
        "--verbose",
        dest="verbosity",
        action="count",
        default=0,
        help="-v: also show vLLM's warnings as they happen; -vv: also its info and debug "
        "lines (default: vLLM's lines are kept per trace, shown only with a failure and "
        "counted in the summary)",
    )
    levels.add_argument(
        "-q",
        "--quiet",
        dest="verbosity",
        action="store_const",
        const=QUIET,
        help="print only failures and the verdict or summary: no progress, no header, no line "
        "for what passed or is not a failure",
    )


def quiet(args: argparse.Namespace) -> bool:
    """`-q`, the same on every command: only failures (and what a failure
    needs to be understood) and the verdict or summary; no progress, no
    header, no line for what passed or is not a failure."""
    return bool(getattr(args, "verbosity", 0) <= QUIET)


# -- names -------------------------------------------------------------------


def kebab(name: str) -> str:
    return name.replace("_", "-")


def name_argument(known: Sequence[str], what: str) -> Any:
    """An argparse `type` for a fault or mutation name: kebab-case (as the
    help lists them); a snake_case name still works, with a notice. Returns
    the name as `known` spells it; an unknown name unchanged, for the
    command to refuse."""
    by_kebab = {kebab(name): name for name in known}

    def parse(text: str) -> str:
        if text in by_kebab:
            return by_kebab[text]
        if "_" in text and kebab(text) in by_kebab:
            deprecated(f"{what} {text}", f"{what} {kebab(text)}")
            return by_kebab[kebab(text)]
        return text

    return parse


# -- help --------------------------------------------------------------------


class _DefaultsShown(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless it says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or not _has_default(action):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _has_default(action: argparse.Action) -> bool:
    # `is`, not `in`: a default of 0 equals False but is a default to show.
    unset = action.default is None or action.default is False
    if unset or action.default == argparse.SUPPRESS or not action.option_strings:
        return False
    return not isinstance(action, argparse._HelpAction | argparse._VersionAction)


def finish(parser: argparse.ArgumentParser) -> None:
    """Shows every default in `parser`'s help (an option with a default and
    no help text gets one that says only the default)."""
    parser.formatter_class = _DefaultsShown
    for action in parser._actions:
        if action.help is None and _has_default(action):
            action.help = "default: %(default)s"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def add_serving_machine(cmd: Any) -> None:
    """What only the serving machine's built model says, assumed by name."""
    cmd.add_argument(
        "--assume-attention-backend",
        metavar="NAME",
        help="the attention backend the serving worker runs, when the serve command line has "
        "no --attention-backend (vLLM's name, e.g. FLASH_ATTN, TRITON_ATTN, CPU_ATTN); its "
        "kernel block sizes set how the worker raises a hybrid's attention block "
        "(default: FLASH_ATTN, as on a CUDA GPU)",
    )
    cmd.add_argument(
        "--assume-checkpoint-alignment",
        type=int,
        metavar="TOKENS",
        help="the prefill checkpoint alignment the serving model's Mamba layers declare "
        "(64: Gated DeltaNet prefill on FlashInfer); the worker keeps blocks on it "
        "(default: none, as Triton GDN and Mamba2 kernels declare)",
    )


def check_serving_machine(args: argparse.Namespace) -> None:
    alignment = args.assume_checkpoint_alignment
    if alignment is not None and alignment < 1:
        raise InputError(f"--assume-checkpoint-alignment: {alignment} is not a token count")
