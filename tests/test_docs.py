"""The docs site builds in strict mode, and what the docs show is what the
code does: generated parts match their generators, the knob reference lists
exactly the keys the trace parser accepts, the README's example report is
what the gate prints for that trace, and the tutorial's trace replays as the
tutorial says."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from types import ModuleType

import pytest
from docs_reference import stale_parts

from kvgate import cli
from kvgate.vocabulary.schema import CONFIG_KEYS, GROUP_KEYS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).parent / "mkdocs"


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    # Not --quiet: mkdocs then drops the warnings that strict mode counts.
    assert MKDOCS.exists(), f"mkdocs is not installed next to {sys.executable}"
    done = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        # Material's notice about its successor is not a problem of these docs.
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_generated_parts_match_the_code() -> None:
    stale = stale_parts()
    assert not stale, f"regenerate with `python tests/docs_reference.py`: {stale}"


def test_generated_parts_show_no_raw_placeholder() -> None:
    """What argparse fills in (`%(default)s`) or hides (`==SUPPRESS==`)
    never reaches a page as written."""
    from docs_reference import GENERATED, part_pattern

    for page, parts in GENERATED.items():
        text = (ROOT / page).read_text(encoding="utf-8")
        for name in parts:
            found = part_pattern(name).search(text)
            assert found is not None, f"{page}: no generated part {name}"
            for raw in ("%(", ")s", "==SUPPRESS=="):
                assert raw not in found.group(2), f"{page}: {name} shows {raw!r}"


def knob_table_keys(section: str) -> set[str]:
    text = (DOCS / "reference" / "knobs.md").read_text(encoding="utf-8")
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", body, re.M))


def test_the_knob_reference_lists_every_config_key() -> None:
    assert knob_table_keys("Trace config") == set(CONFIG_KEYS)
    assert knob_table_keys("Group keys") == set(GROUP_KEYS)


def normalised(report: str) -> str:
    """A report without its timings, which vary from run to run."""
    return re.sub(r"(\d+ steps), [0-9.]+s\)", r"\1, _s)", report).strip()


def example_reports(path: Path) -> list[tuple[list[str], str]]:
    """Each `<!-- example report: ARGS -->` in a page, with the text block after it."""
    text = path.read_text(encoding="utf-8")
    found = re.findall(r"<!-- example report: kvgate (.*?) -->\n```text\n(.*?)```", text, re.S)
    return [(args.split(), block) for args, block in found]


def run_kvgate(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(args)
    return code, out.getvalue()


@pytest.mark.parametrize("page", ["README.md"])
def test_the_example_report_is_what_the_gate_prints(
    page: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    examples = example_reports(ROOT / page)
    assert examples, f"{page} has no `<!-- example report: kvgate ... -->` block"
    for args, shown in examples:
        _, printed = run_kvgate(args, monkeypatch)
        assert normalised(printed) == normalised(shown), (
            f"{page}'s example report for `kvgate {' '.join(args)}` drifted; it now prints:\n"
            + printed
        )


def tutorial_trace(tmp_path: Path) -> Path:
    """The trace the first-trace tutorial builds: its config and steps blocks."""
    text = (DOCS / "tutorial" / "first-trace.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    path = tmp_path / "my-next-turn.hold-on.yaml"
    path.write_text(blocks[0] + blocks[1], encoding="utf-8")
    return path


def test_the_tutorial_trace_replays_as_the_tutorial_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tutorial_trace(tmp_path)
    code, printed = run_kvgate(["replay", str(path), "--target", "model"], monkeypatch)
    assert code == 0, printed
    # The output the tutorial shows, and the step count its prose reads off it.
    page = (DOCS / "tutorial" / "first-trace.md").read_text(encoding="utf-8")
    section = page.split("## 3. Run it on the model", 1)[1]
    [shown] = re.findall(r"```text\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    assert normalised(printed) == normalised(shown), printed
    steps = re.search(r"\((\d+) steps, ", printed)
    assert steps is not None and f"\n{steps.group(1)} steps: the macros expanded" in section
    hold_off = tmp_path / "my-next-turn.hold-off.yaml"
    hold_off.write_text(
        path.read_text()
        .replace("retain_checkpoint: true", "retain_checkpoint: false")
        .replace("hit: 120", "hit: 0"),
        encoding="utf-8",
    )
    code, printed = run_kvgate(["replay", str(hold_off), "--target", "model"], monkeypatch)
    assert code == 0, printed


def load_results_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("results", ROOT / "benchmarks" / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["results"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


STAMP = r"^Generated \d{4}-\d\d-\d\d \d\d:\d\d UTC in \d+ s on .+, by:$"


def test_the_results_page_is_generated() -> None:
    """Every section of docs/results.md is one benchmarks/results.py writes,
    stamped with when, where and by which commands it was made."""
    results = load_results_module()
    sections = results.page_sections((DOCS / "results.md").read_text(encoding="utf-8"))
    known = {s.name: s for s in results.SECTIONS}
    assert sections, "docs/results.md has no generated section"
    for name, body in sections.items():
        assert name in known, f"docs/results.md: section {name!r} is not one results.py writes"
        assert re.search(STAMP, body, re.M), f"docs/results.md: section {name!r} is unstamped"
        for command in known[name].commands:
            assert f"    {command.replace(results.PY, 'python')}\n" in body, (name, command)
