"""dcpx's modules import one another one way (API -> planning and rank
coordination -> storage and formats -> _C): no cycle, counting imports
inside functions too (only ``if TYPE_CHECKING:`` blocks are left out), and
the storage and format modules import no rank coordination (issue 23: the
writer's import of ``_dist`` closed a 7-module circle)."""
from __future__ import annotations

import ast
from pathlib import Path

import dcpx

ROOT = Path(dcpx.__file__).parent
STORAGE = ["_writer", "_reader", "_readplan", "_commit", "_pending", "_files", "_formats",
           "_fmt_safetensors", "_fmt_transforms", "_metadata", "_values", "_byteorder",
           "_chunks", "_locks"]
COORDINATION = {"_dist", "_api", "_async", "_plan", "_planner_state", "_process", "manager"}


def _edges() -> dict:
    """{module: the dcpx modules it imports} for the package's top level
    (relative imports; a subpackage counts as one node)."""
    mods = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir()
                                                  if (p / "__init__.py").exists()}
    edges = {}
    for path in ROOT.glob("*.py"):
        tree = ast.parse(path.read_text())
        typing_only = {id(x) for n in ast.walk(tree)
                       if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n.test)
                       for x in ast.walk(n)}
        out = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.level == 1 and id(n) not in typing_only:
                if n.module:
                    out.add(n.module.split(".")[0])
                else:
                    out.update(a.name for a in n.names)
        edges[path.stem] = (out & mods) - {path.stem, "__init__"}
    return edges


def _cycle(edges: dict) -> list:
    """One import cycle (its modules in order), or []."""
    state: dict = {}
    stack: list = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for w in sorted(edges.get(m, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


def test_no_import_cycle():
    assert _cycle(_edges()) == []


def test_the_finder_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_storage_and_formats_import_no_rank_coordination():
    edges = _edges()
    found = {m: sorted(edges[m] & COORDINATION) for m in STORAGE if edges[m] & COORDINATION}
    assert found == {}
