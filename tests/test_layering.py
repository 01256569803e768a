"""The import table in ARCHITECTURE.md is the layering: check the code keeps it.

Each row names a unit of `kvgate/` (a folder or a top-level module), or one
file of a folder that follows its own rule, and, in its last column, the
kvgate units (or single files of a folder) and third-party packages it may
import. Every import statement in `kvgate/` must be allowed by its row.
Two rules hold whatever the table says: nothing below the model imports the
trace format or replay, and no module imports itself through others.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvgate"
# Third-party packages whose use is part of the layering (the rest, such as
# PyYAML or the standard library, is not tracked).
TRACKED = frozenset({"vllm", "torch", "z3", "hypothesis", "ray"})


def declared_layers() -> dict[str, set[str]]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    table = text[text.index("| folder |") :].split("\n\n", 1)[0]
    layers: dict[str, set[str]] = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        unit = cells[0].strip("`")
        layers[unit] = set(re.findall(r"`([^`]+)`", cells[-1]))
    return layers


def unit_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    if len(parts) == 1:
        return parts[0]
    if parts[:2] == ("invariants", "z3") and len(parts) > 2:
        return "invariants/z3/"
    return parts[0] + "/"


def unit_of_module(module: str) -> str | None:
    """The unit a `kvgate.x.y` module belongs to; None for a third-party one."""
    parts = module.split(".")
    if parts[0] != "kvgate":
        return None
    if len(parts) == 1:
        return "__init__.py"
    if parts[1:3] == ["invariants", "z3"]:
        return "invariants/z3/"
    if (PACKAGE / parts[1]).is_dir():
        return parts[1] + "/"
    return parts[1] + ".py"


def file_of_module(module: str) -> str | None:
    """The file a `kvgate.x.y` module is, relative to `kvgate/` (`x/y.py`)."""
    parts = module.split(".")
    if parts[0] != "kvgate" or len(parts) < 3:
        return None
    return "/".join(parts[1:]) + ".py"


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "kvgate":
                found.update(f"kvgate.{alias.name}" for alias in node.names)
    return found


def rule_of(path: Path, layers: dict[str, set[str]]) -> tuple[str, set[str]]:
    """The row a file follows (its own if the table has one) and what it allows."""
    own = str(path.relative_to(PACKAGE))
    unit = own if own in layers else unit_of(path)
    assert unit in layers, f"{unit} has no row in ARCHITECTURE.md's import table"
    return unit, layers[unit] | {unit_of(path)}


def test_every_import_is_in_the_architecture_table() -> None:
    layers = declared_layers()
    wrong: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if unit_of(path) == "__init__.py":
            continue
        unit, allowed = rule_of(path, layers)
        for module in imports(path):
            target = unit_of_module(module)
            name = target if target is not None else module.split(".")[0]
            if target is None and name not in TRACKED:
                continue
            if target == "__init__.py" or name in allowed or file_of_module(module) in allowed:
                continue
            wrong.append(f"{path.relative_to(ROOT)} imports {module} ({unit} may not use it)")
    assert not wrong, "\n".join(wrong)


BELOW_THE_MODEL = ("vocabulary", "driver", "model")


def test_nothing_below_the_model_imports_the_trace_format_or_replay() -> None:
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for folder in BELOW_THE_MODEL
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for module in imports(path)
        if module == "kvgate.conformance" or module.startswith("kvgate.conformance.")
    ]
    assert not wrong, "\n".join(wrong)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each kvgate module and the kvgate modules it imports, lazily or under
    TYPE_CHECKING alike (a module's own package excepted: importing it is
    how a package's module is reached at all)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for module in imports(path):
            candidates = [module, module.rsplit(".", 1)[0]]
            for candidate in candidates:
                if (
                    candidate in modules
                    and candidate != name
                    and not name.startswith(candidate + ".")
                ):
                    found.add(candidate)
                    break
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_only_main_imports_the_command_line() -> None:
    users = [
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__main__.py" and "kvgate.cli" in imports(path)
    ]
    assert users == []


def test_the_table_names_no_unit_that_does_not_exist() -> None:
    for unit in declared_layers():
        assert (PACKAGE / unit.rstrip("/")).exists(), unit


def architecture_files() -> set[str]:
    """The files ARCHITECTURE.md gives a line: `- `path` — what it is`."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    return set(re.findall(r"^- `((?:kvgate|tests)/[^`]+)` — ", text, re.M))


def files_needing_a_line() -> set[str]:
    code = {
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".yaml")
        and p.name != "__init__.py"
        and "corpus" not in p.parts
        and "__pycache__" not in p.parts
    }
    tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")}
    return code | tests


def test_every_file_and_test_module_has_a_line_in_the_architecture() -> None:
    listed, present = architecture_files(), files_needing_a_line()
    missing, stale = sorted(present - listed), sorted(listed - present)
    assert not missing, f"add a line to ARCHITECTURE.md's Files or Tests for: {missing}"
    assert not stale, f"ARCHITECTURE.md lists files that do not exist: {stale}"
