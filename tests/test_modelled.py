"""The table of what kvgate does not model: the trace reader refuses by it
(a manager-level trace asking for what only scheduler-level traces model),
and the docs' lists are generated from it (tests/docs_reference.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate import cli
from kvgate.conformance.trace import TraceError, bundled_corpus, load_trace
from kvgate.model.scope import NOT_MODELLED, SCHEDULER_LEVEL_ONLY
from kvgate.vocabulary.schema import CONFIG_KEYS


def test_a_manager_level_trace_asking_for_async_scheduling_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its manager calls would be the same either way: it would check nothing of it.
    source = bundled_corpus() / "seed1-next-turn-after-burst.hold-off.yaml"
    path = tmp_path / "async.yaml"
    path.write_text(
        source.read_text().replace("config:\n", "config:\n  async_scheduling: true\n", 1)
    )
    with pytest.raises(TraceError, match=r"config\.async_scheduling: async scheduling is model"):
        load_trace(path)
    assert cli.main(["replay", str(path), "--target", "model"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvgate: error: {path}: config.async_scheduling: ")


def test_the_not_modelled_table_names_no_field_a_trace_can_set() -> None:
    # What no trace can set is not a config key; what only scheduler-level
    # traces model is one.
    assert set(SCHEDULER_LEVEL_ONLY) <= set(CONFIG_KEYS)
    settable = {key.replace("_", " ") for key in CONFIG_KEYS} | set(CONFIG_KEYS)
    for what, where in NOT_MODELLED:
        assert what not in settable and where.strip("`") not in CONFIG_KEYS, what
