"""No word only kvgate's authors understand: the docs and every message
kvgate prints are for users.

The docs (README.md, ARCHITECTURE.md, docs/), the bundled traces and fault
descriptions that kvgate prints, and every string literal in kvgate/ that
is not a docstring (messages, help texts, labels a report shows) are
searched for the project's internal shorthand: its issue and milestone
numbers, branch names, and names of sources a user never saw. A term with
a user-facing meaning is defined in docs/glossary.md instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvgate"

INTERNAL = re.compile(
    r"\bstop \d+"  # a milestone of the project's history
    r"|\bissue[- ]?\d+"  # an issue number
    r"|\bs\d{2}-[a-z]"  # a work branch's name
    r"|\bpatch \d{4}\b"  # a patch in a build users never saw
    r"|\bthe seed\b|\bseed(?:'s)? (?:patch|scenario)"  # the specification's working name
    r"|\b(?:the|production) fork\b",  # a build named without saying which
    re.IGNORECASE,
)
# The glossary may name a term in order to define it.
DEFINES = {ROOT / "docs" / "glossary.md": re.compile(r"the fork's retention", re.IGNORECASE)}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]


def shipped_text_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.yaml"))


def findings(path: Path, text: str, first_line: int = 1) -> list[str]:
    allowed = DEFINES.get(path)
    found = []
    for number, line in enumerate(text.splitlines(), first_line):
        if allowed is not None and allowed.search(line):
            continue
        found += [
            f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r}" for m in INTERNAL.finditer(line)
        ]
    if not found and allowed is None:
        # A phrase wrapped over two lines.
        joined = " ".join(text.split())
        found += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in INTERNAL.finditer(joined)]
    return found


def docstring_nodes(tree: ast.AST) -> set[int]:
    nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                nodes.add(id(first.value))
    return nodes


def message_findings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found += findings(path, node.value, node.lineno)
    return found


def test_the_docs_use_no_internal_words() -> None:
    found = [f for path in doc_files() for f in findings(path, path.read_text(encoding="utf-8"))]
    assert not found, "internal shorthand in the docs (say what it means):\n" + "\n".join(found)


def test_what_kvgate_prints_uses_no_internal_words() -> None:
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in message_findings(path)]
    found += [
        f for path in shipped_text_files() for f in findings(path, path.read_text(encoding="utf-8"))
    ]
    assert not found, "internal shorthand in what kvgate prints:\n" + "\n".join(found)


def test_the_word_list_catches_what_it_names() -> None:
    for word in ("stop 23", "issue-12", "issue 12", "the seed", "patch 0093", "s23-eaglegroups"):
        assert INTERNAL.search(f"as in {word}, see"), word
    for fine in ("--seed 3", "seed 0", "a fork of vLLM", "stops at the junction", "tissue-1"):
        assert not INTERNAL.search(fine), fine
