"""The coverage table's counting (kvgate.explore.coverage) on a module
whose answer is known by reading it, recorded by coverage.py here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import coverage

from kvgate.explore.coverage import (
    OUT_OF_SCOPE,
    OUT_OF_SCOPE_CONDITIONS,
    OUT_OF_SCOPE_WHEN_OFF,
    SCHEDULER_FILE,
    Figures,
    core_dir,
    figures,
    kv_paths,
    missing_report,
    out_of_scope_branches,
)

# A condition split over lines (Python 3.11 reports it on a continuation
# line) inside a class, then a function outside the class that never runs.
SOURCE = """\
class Gate:
    def admit(self, free, needed):
        if (
            free
            >= needed
        ):
            return True
        return False


def never_called(x):
    if x:
        return 1
    return 2
"""


def _record(tmp_path: Path) -> tuple[Path, Path]:
    module = tmp_path / "gate_module.py"
    module.write_text(SOURCE, encoding="utf-8")
    data = tmp_path / ".coverage"
    cov = coverage.Coverage(data_file=str(data), branch=True, include=[str(module)])
    cov.start()
    try:
        spec = importlib.util.spec_from_file_location("gate_module", module)
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        assert loaded.Gate().admit(4, 2) is True  # only the taken exit
    finally:
        cov.stop()
        cov.save()
        sys.modules.pop("gate_module", None)
    return data, module


def test_a_multi_line_condition_counts_as_reached_with_one_exit_taken(tmp_path: Path) -> None:
    data, module = _record(tmp_path)
    within_class = figures(data, module, (1, 8))
    # def admit, the if, return True, return False (+ the class line itself)
    assert within_class.missing_lines == (8,)
    assert (within_class.branches, within_class.branches_hit) == (2, 1)
    assert within_class.missing_branches == ((3, 8),)


def test_a_whole_file_counts_what_coverage_report_counts(tmp_path: Path) -> None:
    data, module = _record(tmp_path)
    whole = figures(data, module)
    assert whole.missing_lines == (8, 12, 13, 14)
    assert (whole.branches, whole.branches_hit) == (4, 1)
    cov = coverage.Coverage(data_file=str(data), branch=True)
    cov.load()
    numbers = cov._analyze(str(module)).numbers
    assert whole.lines == numbers.n_statements
    assert whole.lines - whole.lines_hit == numbers.n_missing
    assert whole.branches - whole.branches_hit == numbers.n_missing_branches


SCHEDULER_SOURCE = """\
class Scheduler:
    def admit(self, request):
        hit = self.kv_cache_manager.lookup(request)
        request.num_computed_tokens = hit
        return hit

    def describe(self):
        return "a scheduler"

    def cached(self, request):
        return request.num_cached_tokens


def kv_cache_manager_helper(x):
    return x.kv_cache_manager
"""


def test_the_schedulers_kv_paths_are_its_methods_that_touch_the_kv_state(
    tmp_path: Path,
) -> None:
    """A method of the Scheduler class is a KV path when it names the
    manager or a request's computed or cached tokens; a function outside
    the class is not, whatever it names."""
    source = tmp_path / "scheduler.py"
    source.write_text(SCHEDULER_SOURCE, encoding="utf-8")
    assert kv_paths(source) == [("admit", 2, 5), ("cached", 10, 11)]
    # A method left out of scope is no KV path, whatever it names.
    assert kv_paths(source, out_of_scope=("admit",)) == [("cached", 10, 11)]


def test_what_is_left_out_of_scope_is_a_kv_path_of_the_installed_scheduler() -> None:
    """Each method left out names a KV path of the installed vLLM's
    Scheduler: a rename there would otherwise put it back unnoticed."""
    source = core_dir() / SCHEDULER_FILE
    every = {name for name, _, _ in kv_paths(source, out_of_scope=())}
    kept = {name for name, _, _ in kv_paths(source)}
    assert set(OUT_OF_SCOPE) <= every
    assert every - kept == set(OUT_OF_SCOPE)


def test_the_missing_report_names_each_gap_and_skips_what_was_reached() -> None:
    reached = Figures(lines=2, lines_hit=2, branches=2, branches_hit=2)
    gaps = Figures(4, 2, 2, 1, missing_lines=(7, 8, 9), missing_branches=((6, 9), (6, -3)))
    rows = [("Scheduler.done (lines 1-3)", [reached]), ("Scheduler.gaps (lines 5-9)", [gaps])]
    assert missing_report("kvgate", rows, 0) == (
        "# kvgate\n"
        "Scheduler.gaps (lines 5-9): lines 7-9\n"
        "Scheduler.gaps (lines 5-9): branches 6->9, 6->exit\n"
    )


def test_figures_count_inside_several_spans(tmp_path: Path) -> None:
    data, module = _record(tmp_path)
    # The class's method and the uncalled function, nothing between them.
    both = figures(data, module, ((2, 8), (11, 14)))
    assert both.missing_lines == (8, 12, 13, 14)
    assert (both.branches, both.branches_hit) == (4, 1)


SCOPED_SOURCE = """\
class Scheduler:
    def admit(self, request):
        hit = self.kv_cache_manager.lookup(request)
        if self.prefix_replay_tokens and hit:
            hit -= 1
        if hit > 8 or self.is_encoder_decoder:
            hit += 1
        if not self.needs_kv_cache_zeroing:
            return None
        request.num_computed_tokens = hit
        return hit
"""


def test_a_branch_only_an_out_of_scope_feature_takes_is_left_out(tmp_path: Path) -> None:
    """The body of an `if` that holds only with a feature a hybrid align-mode
    deployment lacks (named alone or in an `and`; off, for a feature every
    hybrid has on) is left out; one an `or` lets in-scope runs take stays."""
    source = tmp_path / "scheduler.py"
    source.write_text(SCOPED_SOURCE, encoding="utf-8")
    assert out_of_scope_branches(source, kv_paths(source)) == ((5, 5), (9, 9))


def test_figures_leave_out_the_statements_and_exits_of_excluded_spans(tmp_path: Path) -> None:
    data, module = _record(tmp_path)
    # `return True` left out: the if keeps one exit, to `return False`.
    scoped = figures(data, module, (1, 8), excluded=((7, 7),))
    assert scoped.missing_lines == (8,)
    assert (scoped.lines, scoped.lines_hit) == (figures(data, module, (1, 8)).lines - 1, 3)
    assert (scoped.branches, scoped.branches_hit) == (1, 0)
    assert scoped.missing_branches == ((3, 8),)


def test_each_out_of_scope_condition_names_a_branch_of_the_installed_scheduler() -> None:
    """Each feature whose branches are left out still guards one in the
    installed vLLM's Scheduler KV paths: a rename would otherwise count
    them again unnoticed."""
    source = core_dir() / SCHEDULER_FILE
    text = source.read_text(encoding="utf-8")
    assert out_of_scope_branches(source, kv_paths(source))
    for name in (*OUT_OF_SCOPE_CONDITIONS, *OUT_OF_SCOPE_WHEN_OFF):
        assert name in text, name
