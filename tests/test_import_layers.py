"""dcpx's layers, and imports that only go down (docs/design.md, "The
package"): every module of dcpx belongs to one layer, a module imports only
modules of its own layer or of layers below it, and no import circle exists
anywhere, counting imports inside functions and those made for type names
only (``if TYPE_CHECKING:``) too.

Run as a script, it prints the measures of issue 32: the longest chain of
dcpx modules importing one another (the import depth), the upward imports
and the circles::

    python tests/test_import_layers.py          # this tree
    python tests/test_import_layers.py --edges  # and every module's imports
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dcpx"

#: The layers, top first: (name, the modules in it).  A module is named by
#: its dotted path; a name ending in ``.*`` stands for a package's modules.
LAYERS = [
    ("face", ["dcpx", "dcpx.__main__", "dcpx._exports"]),
    ("manager", ["dcpx.manager", "dcpx.manager.*"]),
    ("cli", ["dcpx.cli", "dcpx.cli.*"]),
    ("api", ["dcpx.api.*", "dcpx.staging", "dcpx.filesystem", "dcpx.fsspec"]),
    ("coordination", ["dcpx.coordination.*"]),
    ("storage", ["dcpx.storage.*"]),
    ("formats", ["dcpx.formats.*"]),
    ("base", ["dcpx.errors", "dcpx._torchcompat", "dcpx._C", "dcpx.version"]),
]

#: Where each module of the flat tree (before issue 32) would belong: only
#: for measuring that tree (``--flat``); the test itself uses LAYERS.
FLAT = {
    "face": "dcpx dcpx.__main__ dcpx._exports",
    "manager": "dcpx.manager dcpx.tiers",
    "cli": "dcpx.cli dcpx.cli.*",
    "api": "dcpx._api dcpx._async dcpx._process dcpx._compat dcpx._bc dcpx._guard "
           "dcpx.staging dcpx.filesystem dcpx.fsspec",
    "coordination": "dcpx._plan dcpx._planner_state dcpx._dist dcpx._readplan dcpx._unasked "
                    "dcpx._flatten dcpx._stateful dcpx._gc",
    "storage": "dcpx._writer dcpx._reader dcpx._commit dcpx._pending dcpx._locks dcpx._pieces "
               "dcpx._steps",
    "formats": "dcpx._metadata dcpx._values dcpx._dtypes dcpx._chunks dcpx._byteorder "
               "dcpx._legacy dcpx._fmt_safetensors dcpx._fmt_transforms dcpx._formats "
               "dcpx._files",
    "base": "dcpx.errors dcpx._torchcompat dcpx._C dcpx.version",
}


def modules(root: Path = ROOT) -> dict:
    """{dotted name: path} of every module of the package, ``_C`` included
    (the extension: a node with no imports)."""
    out = {"dcpx._C": None}
    for p in root.rglob("*.py"):
        rel = p.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The absolute module an ``ImportFrom`` in module ``name`` names."""
    if not node.level:
        return node.module or ""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    parts = pkg.split(".")
    base = ".".join(parts[:len(parts) - node.level + 1])
    return base + ("." + node.module if node.module else "")


def edges(root: Path = ROOT) -> dict:
    """{module: {the dcpx modules it imports}}: every import statement,
    at the top, inside functions and under ``if TYPE_CHECKING:``;
    ``from pkg import sub`` counts as an import of ``pkg.sub``."""
    mods = modules(root)
    out = {}
    for name, path in mods.items():
        found = set()
        if path is not None:
            for n in ast.walk(ast.parse(path.read_text())):
                if isinstance(n, ast.ImportFrom):
                    target = _resolve(n, name, path)
                    for a in n.names:
                        sub = f"{target}.{a.name}"
                        found.add(sub if sub in mods else target)
                elif isinstance(n, ast.Import):
                    found.update(a.name for a in n.names)
        # a package's own __init__ that only holds a docstring is no node
        out[name] = {m for m in found if m in mods and m != name}
    return out


def layer_index(layers: list) -> callable:
    def index(module: str) -> int:
        best, best_len = None, -1
        for i, (_, members) in enumerate(layers):
            for m in members:
                if m.endswith(".*"):
                    ok = module.startswith(m[:-1])
                    n = len(m) - 1
                else:
                    ok, n = module == m, len(m)
                if ok and n > best_len:
                    best, best_len = i, n
        return best
    return index


def unplaced(graph: dict, layers: list) -> list:
    index = layer_index(layers)
    return sorted(m for m in graph if index(m) is None and not _empty_package(m))


def _empty_package(module: str, root: Path = ROOT) -> bool:
    p = root.parent / Path(*module.split(".")) / "__init__.py"
    if not p.exists():
        return False
    body = ast.parse(p.read_text()).body
    return all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)


def upward(graph: dict, layers: list) -> list:
    """(importer, imported) pairs where the imported module is in a higher
    layer than the importer."""
    index = layer_index(layers)
    bad = []
    for m, targets in graph.items():
        for t in targets:
            im, it = index(m), index(t)
            if im is not None and it is not None and it < im:
                bad.append((m, t))
    return sorted(bad)


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (each an
    import circle), by Tarjan's algorithm, iteratively."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def longest_chain(graph: dict) -> list:
    """The longest chain of modules importing one another (the modules in
    order), over the graph with its circles' back edges left out."""
    memo: dict = {}
    visiting: set = set()

    def best(m):
        if m in memo:
            return memo[m]
        visiting.add(m)
        chain = [m]
        for t in sorted(graph.get(m, ())):
            if t in visiting:
                continue
            c = best(t)
            if len(c) + 1 > len(chain):
                chain = [m] + c
        visiting.discard(m)
        memo[m] = chain
        return chain

    sys.setrecursionlimit(10000)
    return max((best(m) for m in sorted(graph)), key=len)


def flat_layers() -> list:
    return [(k, v.split()) for k, v in FLAT.items()]


def current_layers() -> list:
    """LAYERS, with each layer's modules also under their names in the
    flat tree, while the modules move into the layers' folders."""
    return [(k, members + FLAT[k].split()) for k, members in LAYERS]


def test_every_module_has_a_layer():
    assert unplaced(edges(), current_layers()) == []


def test_imports_only_go_down():
    assert upward(edges(), current_layers()) == []


def test_no_import_circle():
    assert cycles(edges()) == []


def test_the_checks_see_what_they_look_for():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert longest_chain({"a": {"b"}, "b": {"c"}, "c": set()}) == ["a", "b", "c"]
    layers = [("top", ["x.*"]), ("bottom", ["y", "y.*"])]
    assert upward({"y.m": {"x.n"}, "x.n": {"y"}}, layers) == [("y.m", "x.n")]


def report(layers: list) -> None:
    g = edges()
    chain = longest_chain(g)
    up = upward(g, layers)
    circ = cycles(g)
    print(f"modules: {len(g)}")
    print(f"import depth: {len(chain)} ({' -> '.join(chain)})")
    print(f"upward imports: {len(up)}")
    for a, b in up:
        print(f"  {a} -> {b}")
    print(f"circles: {len(circ)}")
    for c in circ:
        print("  " + ", ".join(c))
    missing = unplaced(g, layers)
    if missing:
        print(f"modules in no layer: {', '.join(missing)}")
    if "--edges" in sys.argv:
        for m in sorted(g):
            print(f"{m} -> {' '.join(sorted(g[m]))}")


if __name__ == "__main__":
    report(flat_layers() if "--flat" in sys.argv else current_layers())
