"""The known vLLM defects: each standalone reproduction under findings/ run on
the installed (pinned) vLLM in a subprocess, which must still show what
findings/results.json and docs/findings.md say it shows there; the page must
be what benchmarks/findings.py renders from that record; and a reproduction
must need nothing of kvgate.

Each reproduction builds a real vLLM Scheduler on CPU: about 10 s apiece.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "regenerate with: python benchmarks/findings.py"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "findings_page", ROOT / "benchmarks" / "findings.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["findings_page"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


GENERATOR = load_generator()
FINDINGS = GENERATOR.load_findings()
SLUGS = [f.slug for f in FINDINGS]


@pytest.fixture(scope="module")
def record() -> dict[str, Any]:
    loaded: dict[str, Any] = GENERATOR.read_record()
    return loaded


def test_four_findings_each_with_a_reproduction_and_a_trace() -> None:
    assert len(FINDINGS) == 4
    for finding in FINDINGS:
        assert (finding.folder / "repro.py").is_file(), finding.slug
        assert (finding.folder / "trace.yaml").is_file(), finding.slug


def test_the_record_covers_every_release_checked(record: dict[str, Any]) -> None:
    assert set(GENERATOR.RELEASES) <= set(record["releases"])
    assert record["pinned"] == GENERATOR.pinned_release()
    for release in record["releases"]:
        assert set(record["results"][release]) == set(SLUGS), (release, REGENERATE)


def test_the_page_is_what_the_record_renders(record: dict[str, Any]) -> None:
    page = GENERATOR.PAGE.read_text(encoding="utf-8")
    assert page == GENERATOR.render(FINDINGS, record), REGENERATE


@pytest.mark.parametrize("slug", SLUGS)
def test_a_reproduction_imports_nothing_of_kvgate(slug: str) -> None:
    """Only the standard library, vLLM and torch (which vLLM brings)."""
    tree = ast.parse((ROOT / "findings" / slug / "repro.py").read_text(encoding="utf-8"))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    outside = roots - set(sys.stdlib_module_names) - {"vllm", "torch", "__future__"}
    assert not outside, f"{slug}/repro.py imports {sorted(outside)}"


@pytest.mark.parametrize("slug", SLUGS)
def test_each_reproduction_shows_on_the_pinned_release_what_the_page_says(
    slug: str, record: dict[str, Any]
) -> None:
    """Run in a subprocess with the test's own Python (the pinned venv),
    without kvgate on its path: a defect recorded present must still be
    present (exit 10) and print the same, or the page must say it is fixed."""
    pinned = record["pinned"]
    assert importlib.metadata.version("vllm") == pinned, "the tests run on the pinned vLLM"
    (finding,) = [f for f in FINDINGS if f.slug == slug]
    live = GENERATOR.run_reproduction(sys.executable, finding)
    recorded = record["results"][pinned][slug]
    assert recorded["status"] in ("present", "absent"), f"{slug} must run on vLLM {pinned}"
    assert live == recorded, REGENERATE


def test_a_reproduction_that_fails_is_told_apart(tmp_path: Path) -> None:
    """An exit code that is none of the three is a failure, shown with the
    last line of its error output, never read as a status."""
    finding = GENERATOR.Finding("x", "t", "w", "f", "i", "e")
    script = tmp_path / "broken.py"
    script.write_text("raise SystemExit('no Scheduler here')\n", encoding="utf-8")

    class Broken(type(finding)):  # type: ignore[misc]
        @property
        def script(self) -> str:
            return str(script)

    result = GENERATOR.run_reproduction(sys.executable, Broken("x", "t", "w", "f", "i", "e"))
    assert result == {"status": "failed (exit 1)", "said": ["no Scheduler here"]}


def test_said_keeps_the_expected_and_actual_lines_with_their_continuations() -> None:
    out = "vLLM 1\nstep 1\nexpected: a\nactual:   b\n          c\nstep 2\n"
    assert GENERATOR.said(out) == ["expected: a", "actual:   b", "          c"]

