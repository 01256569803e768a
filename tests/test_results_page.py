"""docs/results.md against what the code prints today.

The page is written by benchmarks/results.py, never by hand; these tests fail
when it no longer says what the code would print:

- in the default run, every count the page publishes that the project's own
  files determine (traces in each corpus, the faults of the campaign, the
  Scheduler methods counted as KV paths) is read back and compared, in
  milliseconds;
- `KVGATE_RESULTS_CHECK=SECTION,...` (or `all`) reruns those sections with
  `results.py --check`, which masks timings and compares every other number
  and verdict (the gate takes about a minute, the campaign about ten);
- `--check` itself is shown finding a drift and ignoring a timing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from test_docs import load_results_module

from kvgate.conformance.trace import bundled_corpus, bundled_scheduler_corpus, read_corpus
from kvgate.explore.coverage import SCHEDULER_FILE, core_dir, kv_paths
from kvgate.mutate.faults import DRAFT_AREAS, FAULTS

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "regenerate it with: python benchmarks/results.py {}"


@pytest.fixture(scope="module")
def results() -> ModuleType:
    return load_results_module()


@pytest.fixture(scope="module")
def page(results: ModuleType) -> dict[str, str]:
    return dict(results.page_sections(results.PAGE.read_text(encoding="utf-8")))


def printed(results: ModuleType, page: dict[str, str], name: str) -> str:
    if name not in page:
        pytest.fail(f"docs/results.md has no section {name!r}; {REGENERATE.format(name)}")
    return "".join(results.FENCE.findall(page[name]))


def corpus_sizes() -> tuple[int, int]:
    manager, _ = read_corpus(bundled_corpus())
    scheduler, _ = read_corpus(bundled_scheduler_corpus())
    return len(manager), len(scheduler)


def test_the_gate_section_counts_every_trace_of_both_corpora(
    results: ModuleType, page: dict[str, str]
) -> None:
    manager, scheduler = corpus_sizes()
    counts = re.findall(r"^(\d+ passed.*)$", printed(results, page, "gate"), re.M)
    assert len(counts) == 2, counts  # without and with the overlay
    for line in counts:
        total = sum(int(n) for n in re.findall(r"(\d+) ", line))
        assert total == manager + scheduler, (
            f"docs/results.md, gate: {line!r} counts {total} traces; the corpora hold "
            f"{manager} + {scheduler}; {REGENERATE.format('gate')}"
        )


@pytest.mark.parametrize("name", ["mutate", "kill-rates"])
def test_the_campaign_sections_run_today_s_faults_on_today_s_corpora(
    results: ModuleType, page: dict[str, str], name: str
) -> None:
    if name == "kill-rates" and name not in page:
        pytest.skip("the page does not publish the kill rates by stage (an hour's run)")
    text = printed(results, page, name)
    manager, scheduler = corpus_sizes()
    hint = REGENERATE.format(name)
    if name == "mutate":
        assert f"kvgate mutate: {len(FAULTS)} faults," in text, f"{name}: faults; {hint}"
        # The table: a header row, then one row per fault up to a blank line.
        table = text.split("\nfault ", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
        listed = {row.split()[0] for row in table}
        assert listed == {f.name for f in FAULTS}, f"{name}: fault rows; {hint}"
    assert re.search(rf"\b\d+ of {manager} traces pass\b", text), f"{name}: corpus; {hint}"
    assert re.search(rf"real Scheduler: \d+ of {scheduler} pass\b", text), (
        f"{name}: Scheduler-level corpus; {hint}"
    )


def test_the_draft_faults_section_runs_today_s_faults_of_those_areas(
    results: ModuleType, page: dict[str, str]
) -> None:
    """The faults of async scheduling with drafts, each with a row in both
    columns (the gate and vLLM's own tests), as the fault table has them."""
    text = printed(results, page, "draft-faults")
    hint = REGENERATE.format("draft-faults")
    names = {f.name for f in FAULTS if f.area in DRAFT_AREAS}
    assert f"kvgate mutate: {len(names)} faults," in text, hint
    side_by_side = text.split("kvgate gate    vLLM's own tests", 1)[1].splitlines()[1:]
    rows = {line.split()[0] for line in side_by_side[: len(names)]}
    assert rows == names, hint


def test_the_coverage_section_counts_today_s_kv_paths(
    results: ModuleType, page: dict[str, str]
) -> None:
    text = printed(results, page, "coverage")
    methods = [name for name, _, _ in kv_paths(core_dir() / SCHEDULER_FILE)]
    hint = REGENERATE.format("coverage")
    assert f"Scheduler KV paths ({len(methods)} methods)" in text, hint
    assert f"Scheduler KV paths: {', '.join(methods)}" in text, hint


def test_the_benchmark_section_replays_today_s_corpora(
    results: ModuleType, page: dict[str, str]
) -> None:
    text = printed(results, page, "benchmarks")
    manager, scheduler = corpus_sizes()
    replayed, _ = read_corpus(bundled_corpus())
    runs = sum(1 for t in replayed if t.expect_refused is None)
    hint = REGENERATE.format("benchmarks")
    assert f"corpus: {runs} traces," in text, hint
    assert re.search(rf"^scheduler-level\s+{scheduler}\s", text, re.M), hint
    assert re.search(rf"^manager-level\s+{manager}\s", text, re.M), hint


def test_the_served_overhead_section_prints_the_measured_record(
    results: ModuleType, page: dict[str, str]
) -> None:
    """The section is the record benchmarks/served_overhead.py measured,
    rendered: every run of both arms, each arm's spread, none typed."""
    import importlib.util
    import json

    script = ROOT / "benchmarks" / "served_overhead.py"
    spec = importlib.util.spec_from_file_location("served_overhead", script)
    assert spec is not None and spec.loader is not None
    served = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(served)
    record = json.loads(served.RECORD.read_text())
    text = printed(results, page, "served-overhead")
    hint = REGENERATE.format("served-overhead")
    assert text == served.render(record) + "\nexit 0\n", hint
    runs = {arm: [r for r in record["runs"] if r["arm"] == arm] for arm in ("on", "off")}
    assert all(len(arm_runs) >= 3 for arm_runs in runs.values()), runs
    # Interleaved: the arms alternate run by run.
    assert [r["arm"] for r in record["runs"]] == ["on", "off"] * len(runs["on"])


def test_the_hunting_section_is_its_record_rendered(
    results: ModuleType, page: dict[str, str]
) -> None:
    """The hunt's counts come from findings/hunting.json (one real run's,
    written by benchmarks/hunting.py), never typed: the page prints them as
    the record renders them."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hunting.py"), "--render"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert printed(results, page, "hunting") == done.stdout + "exit 0\n", REGENERATE.format(
        "hunting"
    )


def test_the_hunt_reads_a_divergence_and_the_defects_it_explored_past() -> None:
    """What benchmarks/hunting.py records of an exploration's summary: a
    divergence on stock vLLM is counted and named, never lost."""
    spec = importlib.util.spec_from_file_location("hunting", ROOT / "benchmarks" / "hunting.py")
    assert spec is not None and spec.loader is not None
    hunting = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hunting)
    summary = (
        "explore: scope scheduler, target vllm\n"
        "7 examples, 120 engine steps, 1 round(s), 9.0s (besides: 0 dropped part-way)\n"
        "  reset 3  (preempting running requests, not sent while a waiting request holds "
        "blocks 2)\n"
        "examples per deployment family:\n"
        "  no drafter; prefill checkpoints (Mamba2): 7\n"
        "examples dropped (config or request refused, by field): known vLLM defect "
        "(connector admission at an exact fit) 4, num_blocks 1\n"
        "first divergence after 3.2s\n"
        "FAIL divergence (5 engine entries): engine step 2: scheduled\n"
        "saved: out/hunting/scheduler/x.yaml\n"
    )
    run = hunting.read_run("scheduler", summary, 1)
    assert (run["examples"], run["steps"], run["divergences"]) == (7, 120, 1)
    assert run["divergence"] == "divergence (5 engine entries): engine step 2: scheduled"
    assert (run["exact_fit_defect"], run["resets_held_back"]) == (4, 2)
    assert run["families"] == {"no drafter; prefill checkpoints (Mamba2)": 7}
    record = {
        "generated": "g",
        "machine": "m",
        "vllm": "v",
        "runs": {"scheduler": {"command": "kvgate explore", **run}},
    }
    assert hunting.render(record)[-1] == "divergences on stock vLLM: 1"


def test_check_finds_a_changed_count_and_ignores_a_changed_timing(
    results: ModuleType,
) -> None:
    def section(printing: str) -> object:
        return results.Section(
            "mutate",
            "a campaign",
            "seconds",
            (f"printf '{printing}'",),
            results.render_whole,
            "",
            stable=results.mask_campaign,
        )

    published = results.render_whole(["kill rate 86/88 (97.7 %)\ntime: 644.1s in all\nexit 0"])
    faster = section("kill rate 86/88 (97.7 %%)\\ntime: 12.5s in all\\n")
    assert results.check_section(faster, published) == []
    fewer = section("kill rate 85/88 (96.6 %%)\\ntime: 644.1s in all\\n")
    drift = results.check_section(fewer, published)
    assert drift[0].startswith("results: section 'mutate' drifted"), drift
    assert "-kill rate 86/88 (# %)" in drift and "+kill rate 85/88 (# %)" in drift, drift
    assert results.check_section(faster, None) == [
        "results: docs/results.md has no section 'mutate'"
    ]


CHECKED = os.environ.get("KVGATE_RESULTS_CHECK", "")


@pytest.mark.skipif(not CHECKED, reason="set KVGATE_RESULTS_CHECK=SECTION,... or all")
def test_the_page_reprints_as_published() -> None:
    sections = [] if CHECKED == "all" else CHECKED.split(",")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "results.py"), "--check", *sections],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


# -- every other page: a number the code prints is generated or checked --------

# A count of something the code decides (traces, faults, verdicts, proofs, ...).
COUNTED = re.compile(
    r"\b\d[\d,]* (?:passed|failed|lacking|traces?|faults?|invariants?|lemmas?|proved|"
    r"methods|errors|not applicable|examples)\b|\b\d+ of \d+\b"
)
# Where such a number may stand: a generated part (test_docs checks each
# against its generator), an example report test_docs replays, this page's
# sections (checked above), and the tutorial's run (test_docs replays it).
CHECKED_PARTS = (
    re.compile(r"<!-- generated: ([\w-]+) -->\n.*?<!-- end generated: \1 -->", re.S),
    re.compile(r"<!-- example report: .*? -->\n```text\n.*?```", re.S),
    re.compile(r"<!-- results: ([\w-]+) -->\n.*?<!-- end: \1 -->", re.S),
    re.compile(r"## 3\. Run it on the model\n.*?\n## ", re.S),
)


def drifting_numbers(page: str, text: str) -> list[str]:
    """Each count on `page` outside the parts a test checks."""
    for part in CHECKED_PARTS:
        text = part.sub("", text)
    return [
        f"{page}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)!r}"
        for m in COUNTED.finditer(text)
    ]


def test_no_page_types_a_number_the_code_prints() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    typed = [
        line
        for path in pages
        for line in drifting_numbers(str(path.relative_to(ROOT)), path.read_text("utf-8"))
    ]
    assert not typed, (
        "numbers typed into the docs, unchecked (generate them: tests/docs_reference.py, "
        "benchmarks/results.py): " + "; ".join(typed)
    )


def test_a_typed_count_is_found() -> None:
    page = (
        "intro\n    182 passed, 0 failed\n"
        "<!-- generated: x -->\n3 traces\n<!-- end generated: x -->\n"
    )
    assert drifting_numbers("docs/p.md", page) == [
        "docs/p.md:2: '182 passed'",
        "docs/p.md:2: '0 failed'",
    ]
