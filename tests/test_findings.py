"""The known vLLM defects: each standalone reproduction under findings/ run on
the installed (pinned) vLLM in a subprocess, which must still show what
findings/results.json and docs/findings.md say it shows there; the page must
be what benchmarks/findings.py renders from that record; a reproduction
must need nothing of kvgate; and `kvgate gate` reports the defects it probes
on the build as its --known-defects policy says.

Each reproduction builds a real vLLM Scheduler on CPU: about 10 s apiece on
an idle machine; the gate's test runs all four again.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
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
    finding = GENERATOR.Finding("x", "t", "w", "f", "i", "e", "x")
    script = tmp_path / "broken.py"
    script.write_text("raise SystemExit('no Scheduler here')\n", encoding="utf-8")

    class Broken(type(finding)):  # type: ignore[misc]
        @property
        def script(self) -> str:
            return str(script)

    result = GENERATOR.run_reproduction(sys.executable, Broken("x", "t", "w", "f", "i", "e", "x"))
    assert result == {"status": "failed (exit 1)", "said": ["no Scheduler here"]}


def test_said_keeps_the_expected_and_actual_lines_with_their_continuations() -> None:
    out = "vLLM 1\nstep 1\nexpected: a\nactual:   b\n          c\nstep 2\n"
    assert GENERATOR.said(out) == ["expected: a", "actual:   b", "          c"]


# -- kvgate gate's group of known defects --------------------------------------


def _fake_findings(folder: Path, exits: dict[str, str]) -> None:
    """A findings folder whose reproductions exit as `exits` says (Python
    source of the exit), each with a finding.yaml."""
    for slug, body in exits.items():
        (folder / slug).mkdir()
        (folder / slug / "finding.yaml").write_text(
            f"title: defect {slug}\neffect: costs {slug}\n", encoding="utf-8"
        )
        (folder / slug / "repro.py").write_text(body, encoding="utf-8")


def test_the_probe_reads_each_reproductions_exit_code(tmp_path: Path) -> None:
    from kvgate.known_defects import DefectProbe, fails, lines

    _fake_findings(
        tmp_path,
        {
            "a": "print('expected: x')\nprint('actual:   it broke')\nraise SystemExit(10)\n",
            "b": "raise SystemExit(0)\n",
            "c": "print('could not run here: no Triton')\nraise SystemExit(77)\n",
            "d": "raise RuntimeError('a bug')\n",
        },
    )
    probes = DefectProbe(tmp_path).finish()
    assert [(p.slug, p.status, p.detail) for p in probes] == [
        ("a", "present", "it broke"),
        ("b", "absent", ""),
        ("c", "not probed", "no Triton"),
        ("d", "not probed", "its reproduction exited 1"),
    ]
    shown = lines(probes, "report")
    assert shown[0].startswith("known vLLM defects: 1 of 4 present on this build; reported only")
    assert shown[1:] == [
        "  present: defect a (impact: costs a)",
        "  absent: defect b (this build behaves as a fixed vLLM, the model's "
        "`vllm_defects: fixed`; the traces pass either way)",
        "  not probed: defect c: no Triton",
        "  not probed: defect d: its reproduction exited 1",
    ]
    assert fails(probes, "fail") and not fails(probes, "report")
    assert not fails([p for p in probes if p.status != "present"], "fail")


def test_closing_the_probe_stops_a_reproduction_still_running(tmp_path: Path) -> None:
    from kvgate.known_defects import DefectProbe

    _fake_findings(tmp_path, {"slow": "import time\ntime.sleep(600)\n"})
    probe = DefectProbe(tmp_path)
    probe.close()
    [slow] = probe.finish()
    assert slow.status == "not probed" and slow.detail.startswith("its reproduction exited -")


def test_the_model_target_and_skip_probe_nothing() -> None:
    from kvgate.known_defects import start

    assert start("skip", "vllm") is None
    assert start("report", "model") is None


def test_the_source_tree_probes_the_reproductions_in_findings() -> None:
    """One copy: the package's folder of reproductions is findings/ itself."""
    from kvgate.known_defects import findings_dir

    folder = findings_dir()
    assert folder is not None and folder == (ROOT / "findings").resolve()


def installed_wheel(into: Path) -> Path:
    """kvgate built as a wheel from this checkout and unpacked (a wheel is
    its installed tree): the folder to put on the path."""
    wheels = into / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["--wheel-dir", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("kvgate-*.whl")
    site = into / "site"
    zipfile.ZipFile(wheel).extractall(site)
    return site


def test_the_gate_from_an_installed_wheel_lists_the_defects_and_fails_by_policy(
    tmp_path: Path,
) -> None:
    """`--known-defects fail` on vLLM 0.33.0, kvgate run from its wheel
    outside the checkout: every known defect present, with its impact, and
    exit 1 though the one trace selected passes."""
    site = installed_wheel(tmp_path)
    assert sorted(p.parent.name for p in (site / "kvgate" / "findings").glob("*/repro.py")) == (
        sorted(SLUGS)
    )
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(site)}
    env.pop("KVGATE_KNOWN_DEFECTS", None)
    probed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kvgate import known_defects; print(known_defects.findings_dir())",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert probed == str((site / "kvgate" / "findings").resolve()), probed
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "gate", "--target", "vllm", "-k", "admission-exact-fit"]
        + ["--known-defects", "fail"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 1, out[-3000:] + done.stderr[-2000:]
    assert "1 passed, 0 failed" in out
    assert f"known vLLM defects: {len(FINDINGS)} of {len(FINDINGS)} present on this build" in out
    for finding in FINDINGS:
        assert f"  present: {finding.title} (impact: {finding.effect})" in out
