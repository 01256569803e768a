"""One command-line grammar: every command's parser is walked for a flag
that means the same thing under two names and for a default its help does
not show; old spellings still work, each with a one-line notice."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvgate import cli, options
from kvgate.conformance.trace import bundled_corpus
from kvgate.explore import command as explore_command


def _visible(action: argparse.Action) -> bool:
    return action.help != argparse.SUPPRESS and bool(action.option_strings)


def grammar_problems(name: str, parser: argparse.ArgumentParser) -> list[str]:
    """What breaks the one grammar in one command's parser."""
    problems = []
    concepts = {spelling.removeprefix("--"): dest for dest, spelling in options.SHARED.items()}
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if not _visible(action) or isinstance(action, argparse._HelpAction):
            continue
        by_dest.setdefault(action.dest, []).append(action)
        flags = "/".join(action.option_strings)
        # A shared idea under its one spelling, whatever the command.
        shared = options.SHARED.get(action.dest)
        quiet = action.dest == "verbosity" and "--quiet" in action.option_strings
        if shared is not None and shared not in action.option_strings and not quiet:
            problems.append(f"{name} {flags}: means {action.dest}, spelled {shared} elsewhere")
        for option in action.option_strings:
            words = option.removeprefix("--")
            for concept, dest in concepts.items():
                if words != concept and (
                    words.endswith(f"-{concept}") or words.startswith(f"{concept}-")
                ):
                    problems.append(f"{name} {option}: a second name for {options.SHARED[dest]}")
        # Its default in its help.
        formatter = parser._get_formatter()
        formatter.add_argument(action)
        text = formatter.format_help()
        if options._has_default(action) and "default" not in text:
            problems.append(f"{name} {flags}: default {action.default!r} not shown in --help")
    for dest, actions in by_dest.items():
        # -q and -v set one level, from either side; any other two flags
        # into one dest are one thing under two names.
        if len(actions) > 1 and dest != "verbosity":
            names = ", ".join("/".join(a.option_strings) for a in actions)
            problems.append(f"{name}: {names} all set {dest}")
    return problems


def test_every_command_speaks_one_grammar() -> None:
    commands = options.subcommands(cli.build_parser())
    assert {"gate", "replay", "explore", "workload", "mutate", "prove"} <= set(commands)
    problems = [p for name, parser in commands.items() for p in grammar_problems(name, parser)]
    assert problems == []


def test_the_grammar_check_finds_a_second_name_and_a_hidden_default() -> None:
    """The check itself, on a parser that breaks both rules."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--explore-seed", type=int, default=3, help="exploration's seed")
    parser.add_argument("--output", dest="out", type=Path, help="where")
    problems = grammar_problems("bad", parser)
    assert "bad --explore-seed: a second name for --seed" in problems
    assert "bad --explore-seed: default 3 not shown in --help" in problems
    assert "bad --output: means out, spelled --out elsewhere" in problems
    # `finish` shows the default; the second names stay problems.
    options.finish(parser)
    assert "bad --explore-seed: default 3 not shown in --help" not in grammar_problems(
        "bad", parser
    )


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    ("old", "new", "dest", "value"),
    [
        (["mutate", "--explore-seed", "7"], ["mutate", "--seed", "7"], "seed", 7),
        (["workload", "--hold", "on,off"], ["workload", "--hold", "both"], "hold", "both"),
        (
            ["prove", "--mutation", "abort_keeps_hold"],
            ["prove", "--mutation", "abort-keeps-hold"],
            "mutation",
            "abort_keeps_hold",
        ),
        (
            ["mutate", "--faults", "free_cached_to_head"],
            ["mutate", "--faults", "free-cached-to-head"],
            "faults",
            ["free-cached-to-head"],
        ),
    ],
)
def test_an_old_spelling_works_with_a_one_line_notice(
    old: list[str], new: list[str], dest: str, value: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert getattr(_parse(*new), dest) == value
    assert capsys.readouterr().err == ""
    assert getattr(_parse(*old), dest) == value
    err = capsys.readouterr().err
    assert err.startswith("kvgate: deprecated: ") and err.count("\n") == 1


def test_the_overlay_is_one_flag_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("gate", "replay", "workload", "bless"):
        extra = ["t.yaml"] if command in ("replay", "bless") else []
        args = _parse(command, *extra, "--overlay")
        assert options.plugin_of(args) == options.OVERLAY_PLUGIN
    args = _parse("explore", "--target", "vllm", "--overlay")
    explore_command._resolve_target(args)
    assert args.target == "vllm+overlay"
    old = _parse("explore", "--target", "vllm+overlay")
    assert capsys.readouterr().err == ""
    explore_command._resolve_target(old)
    assert old.target == "vllm+overlay"
    assert capsys.readouterr().err.startswith(
        "kvgate: deprecated: --target vllm+overlay is now spelled --target vllm --overlay"
    )


def test_explore_needs_no_out_directory() -> None:
    args = _parse("explore")
    assert args.out == explore_command.DEFAULT_OUT


def test_profile_help_lists_each_profiles_size_and_the_default() -> None:
    from kvgate.explore.profiles import PROFILES

    text = options.subcommands(cli.build_parser())["explore"].format_help()
    flat = " ".join(text.split())
    for name, settings in PROFILES.items():
        assert f"{name} {settings.max_examples}" in flat
    assert "(default: dev)" in flat


@pytest.mark.parametrize(
    "argv",
    [
        ["gate", "--target", "model", "--junit-xml", "{file}/gate.xml"],
        ["gate", "--target", "model", "--junit-xml", "{missing}/gate.xml"],
        ["replay", "{trace}", "--target", "model", "--junit-xml", "{dir}"],
        ["explore", "--target", "model", "--budget", "1", "--out", "{file}/traces"],
        ["workload", "--out", "{file}"],
        ["prove", "--out", "{file}/sub"],
        ["mutate", "--junit-xml", "{missing}/m.xml"],
        ["shrink", "{trace}", "--target", "model", "--out", "{missing}/t.yaml"],
    ],
)
def test_an_unwritable_output_path_is_one_line_before_anything_runs(
    argv: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    trace = bundled_corpus() / "seed1-next-turn-after-burst.hold-on.yaml"
    places = {"file": file, "missing": tmp_path / "missing", "dir": tmp_path, "trace": trace}
    # Nothing may run: a replay, or a command's handler, would be a test failure.
    monkeypatch.setattr(cli, "run_traces", _never)
    code = cli.main([a.format(**places) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1, err
    flag = "--out" if "--out" in argv else "--junit-xml"
    assert err.startswith(f"kvgate: error: {flag}: "), err
    assert not (tmp_path / "missing").exists()


def _never(*args: object, **kwargs: object) -> int:
    raise AssertionError("ran before its output path was checked")
