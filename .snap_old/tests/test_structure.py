"""The package's floors: every import runs from a higher floor to a lower one, no import
circle anywhere, and docs/structure.md names what exists (and all of it) on one page.

Imports are read from the source with ``ast`` (also those inside functions and under
``TYPE_CHECKING``), so a lazy import cannot hide an upward edge.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "freetoken"
DOC = ROOT / "docs" / "structure.md"

# Unit (a subpackage, or a module of the top package) -> its floor. A unit may import only
# units on lower floors; units on one floor are siblings and import neither way.
FLOORS = {
    "cli": 10,
    "server": 9,
    "bench": 9,
    "engine": 8,
    "models": 7,
    "layers": 6,
    "moe": 5,
    "cpu": 4,
    "kernels": 4,
    "checkpoint": 3,
    "kvcache": 3,
    "quant": 2,
    "config": 1,
    "env": 1,
    "errors": 0,
}
FACE = "freetoken"  # the top package's __init__: the version, imported from anywhere


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules that ``name`` imports, anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + is_pkg]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # ``import freetoken.moe.plan as p`` and the like
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACE


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_unit_has_a_floor(graph):
    units = {_unit(m) for m in graph} - {FACE}
    assert units == set(FLOORS), (
        f"units without a floor: {sorted(units - set(FLOORS))}; floors without a unit: "
        f"{sorted(set(FLOORS) - units)} (add the package to FLOORS and docs/structure.md)")


def test_imports_run_only_downward(graph):
    upward = []
    for src, targets in graph.items():
        a = _unit(src)
        for dst in targets:
            b = _unit(dst)
            if a == b or b == FACE:
                continue
            if a == FACE or FLOORS[b] >= FLOORS[a]:
                upward.append(f"{src} (floor {FLOORS.get(a)}) imports {dst} (floor {FLOORS[b]})")
    assert not upward, "imports that do not run downward:\n" + "\n".join(sorted(upward))


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles(graph):
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_check_sees_lazy_relative_imports_and_circles(tmp_path):
    """A planted lazy, relative, upward import is read; a planted circle is found."""
    src = tmp_path / "freetoken" / "quant" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from ..engine import runner\n")
    known = {"freetoken.quant.x", "freetoken.engine", "freetoken.engine.runner"}
    assert _imports("freetoken.quant.x", src, known) == {"freetoken.engine.runner"}
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_structure_doc_is_one_true_page():
    text = DOC.read_text()
    lines = text.splitlines()
    assert len(lines) <= 120 and len(text) <= 9000, (
        f"docs/structure.md is {len(lines)} lines and {len(text)} characters; keep it to one "
        "page (120 lines, 9,000 characters)")
    named = set(re.findall(r"`((?:freetoken|csrc|tests|benchmarks|scripts)/[\w/.]*)`", text))
    named |= {f"freetoken/{p}" for p in re.findall(r"`(\w+/(?:[\w.]+)?)`", text)
              if not p.startswith(("freetoken", "csrc", "tests", "benchmarks", "scripts"))}
    for pkg, row in re.findall(r"^\| \d+ \| `(\w+)/` \|(.*)$", text, re.M):
        named |= {f"freetoken/{pkg}/{f}" for f in re.findall(r"`([\w]+\.py)`", row)}
    missing = sorted(p for p in named if not (ROOT / p.split(":")[0]).exists())
    assert not missing, f"docs/structure.md names what does not exist: {missing}"
    rows = re.findall(r"^\| (\d+) \| `(?:freetoken/)?(\w+)(?:/|\.py)`", text, re.M)
    floors = {unit: int(n) for n, unit in rows}
    assert floors == FLOORS, "docs/structure.md's floor table differs from the checked floors"
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages <= set(floors), f"packages the doc does not list: {packages - set(floors)}"


def test_tests_mirror_the_packages():
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    missing = sorted(p for p in packages if not (ROOT / "tests" / p).is_dir())
    assert not missing, f"packages without a tests/ folder: {missing}"
