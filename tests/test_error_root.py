"""One exception root: every error kvgate reports derives from `KvgateError`,
and the command line turns each into one line and the exit code its class
carries."""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any

import pytest

import kvgate
from kvgate import cli
from kvgate.errors import EXIT_INPUT, EXIT_KVGATE_BUG, KvgateError

# Exceptions that never reach a command's caller: each is caught where it is
# raised, as a signal between two parts of kvgate (a replay unwinding at its
# first divergence, a target refusing a step, a fault that does not fit the
# installed code, an exploration draw to discard, a Hypothesis failure at
# either level (and their common base, which names and saves the history
# as a trace), a test item's failure, a run Z3 found that does not
# concretize, the scheduler model finding no way forward, a recorded step
# no trace can say, which stops the recording).
SIGNALS = {
    "Diverged",
    "StepRefused",
    "NotApplicable",
    "Unrealistic",
    "TraceFailure",
    "ExploreFailure",
    "SchedulerExploreFailure",
    "TraceFailed",
    "NotConcretized",
    "SchedulerStuck",
    "NotExpressible",
}


def kvgate_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module_info in pkgutil.walk_packages(kvgate.__path__, "kvgate."):
        if module_info.name == "kvgate.__main__":  # runs the command line
            continue
        try:
            module = importlib.import_module(module_info.name)
        except ImportError:  # an optional extra (ray) not installed
            continue
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_public_error_has_the_one_root() -> None:
    found = kvgate_exceptions()
    assert len(found) > len(SIGNALS)
    outside = [
        name
        for name, cls in found.items()
        if not issubclass(cls, KvgateError) and not {c.__name__ for c in cls.__mro__} & SIGNALS
    ]
    assert outside == [], "errors outside KvgateError (or list them as signals, with why)"
    assert {cls.__name__ for cls in found.values()} >= SIGNALS, "a listed signal is gone"


@pytest.mark.parametrize(
    "error",
    [cls for cls in kvgate_exceptions().values() if issubclass(cls, KvgateError)],
    ids=lambda cls: cls.__name__,
)
def test_the_command_line_exits_with_the_class_code(
    error: type[KvgateError], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    message = "what went wrong\nsecond line"

    class Raised(error):  # type: ignore[valid-type,misc]
        """The error as raised, built without its own constructor's fields."""

        def __init__(self) -> None:
            Exception.__init__(self, message)

        def __str__(self) -> str:
            return message

    def handler(args: argparse.Namespace) -> int:
        raise Raised()

    class Parser:
        def __init__(self, only: str | None = None) -> None:
            """The command line's parser, for the command `only` or all."""

        def parse_args(self, argv: Any) -> argparse.Namespace:
            return argparse.Namespace(command="x", verbosity=0, handler=handler)

    monkeypatch.setattr(cli, "_parser", Parser)
    assert cli.main([]) == error.exit_code
    assert error.exit_code in (EXIT_INPUT, EXIT_KVGATE_BUG)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "what went wrong\\nsecond line" in err
    kind = "internal error" if error.exit_code == EXIT_KVGATE_BUG else "error"
    assert err.startswith(f"kvgate: {kind}: ")


def test_a_request_the_pool_can_never_run_is_bad_input_not_a_kvgate_bug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Alone in the pool, a request whose sequence outgrows it preempts
    itself for ever (vLLM's Scheduler loops the same way): the trace's
    config cannot run it, said in one line naming the step and the field."""
    corpus = Path(kvgate.__file__).parent / "conformance" / "corpus" / "scheduler"
    source = (corpus / "sched-preempt-under-pressure-and-resume.yaml").read_text()
    header = source[: source.index("engine:")]
    assert "num_blocks: 30" in header
    trace = tmp_path / "too-long.yaml"
    trace.write_text(
        header
        + "engine:\n"
        + "  - {op: arrive, req: A, prompt: [{fresh: 100}], max_tokens: 400}\n"
        + "  - {op: step, steps: 200}\n"
    )
    assert cli.main(["replay", str(trace), "--target", "model", "-q"]) == EXIT_INPUT
    out = capsys.readouterr().out
    assert f"{trace}: step 1: config.num_blocks: A cannot run on a pool of 30 blocks" in out
