"""Layering: a module of specserve imports its own floor or a lower one, never a higher one; and no module imports
itself back through others (no import cycle).

The modules are read with `ast`, never imported. Counted: `import specserve.x`, `from specserve.x import y` and
relative imports, wherever they stand (inside functions too); for the floors not counted: imports under
`if TYPE_CHECKING:`, which only annotations see; for cycles counted too (a cycle hidden from the interpreter is still
two modules that each need the other to be read). Dynamic imports (importlib.import_module with a string) are not
seen.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "specserve"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

# Path prefix inside specserve/ -> floor, top (0) to bottom. A prefix ending in "/" is a folder and everything under
# it; any other prefix is one file. The longest matching prefix wins. Same floor: may import each other.
FLOORS: dict[str, int] = {
    "server/": 0,
    "launch_server.py": 0,
    "cli.py": 0,
    "bench/": 1,
    "train/": 1,
    "engine/": 2,
    "server_args.py": 2,
    "defaults.py": 2,
    "tokenizer.py": 2,
    "__init__.py": 2,
    "speculative/": 3,
    "graphs/": 4,
    "models/": 5,
    "multimodal/": 5,
    "layers/": 6,
    "attention/": 7,
    "kernels/": 8,
    "kvcache/": 9,
    "weights/": 10,
    "distributed/": 11,
    "batch.py": 12,
}

FLOOR_NAMES: dict[int, str] = {
    0: "server",
    1: "bench/train",
    2: "engine",
    3: "speculative",
    4: "graphs",
    5: "models",
    6: "layers",
    7: "attention",
    8: "kernels",
    9: "kvcache",
    10: "weights",
    11: "distributed",
    12: "batch",
}

# Prefixes of the restructuring that may not exist yet.
PLANNED = {"speculative/", "graphs/", "distributed/", "batch.py"}


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # dotted, absolute: the deepest module the statement names


def floor_of(rel: str, floors: dict[str, int]) -> int | None:
    """The floor of a path relative to the package folder ("engine/engine.py"), or None when no prefix matches."""
    best = None
    for prefix, floor in floors.items():
        hit = rel.startswith(prefix) if prefix.endswith("/") else rel == prefix
        if hit and (best is None or len(prefix) > len(best[0])):
            best = (prefix, floor)
    return None if best is None else best[1]


def _module_path(module: str, pkg_dir: Path) -> str:
    """specserve.a.b -> "a/b/__init__.py" when a/b is a folder, else "a/b.py"; specserve -> "__init__.py"."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    if (pkg_dir.joinpath(*parts)).is_dir():
        return "/".join([*parts, "__init__.py"])
    return "/".join(parts) + ".py"


def _is_submodule(module: str, pkg_dir: Path) -> bool:
    parts = module.split(".")[1:]
    if not parts:
        return False
    return pkg_dir.joinpath(*parts).is_dir() or pkg_dir.joinpath(*parts[:-1], parts[-1] + ".py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, this_module: str, is_package: bool, pkg_dir: Path, package: str, type_checking: bool = False):
        self.type_checking = type_checking  # also count the imports under `if TYPE_CHECKING:`
        self.this_module = this_module
        self.is_package = is_package
        self.pkg_dir = pkg_dir
        self.package = package
        self.found: list[Import] = []

    def _ours(self, module: str) -> bool:
        return module == self.package or module.startswith(self.package + ".")

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test) and not self.type_checking:
            for stmt in node.orelse:  # the else branch runs
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._ours(alias.name):
                self.found.append(Import(node.lineno, alias.name))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            # The package this module lives in (itself for an __init__), then up level - 1 packages.
            base = self.this_module.split(".")
            if not self.is_package:
                base = base[:-1]
            up = node.level - 1
            if up > len(base) - 1:
                return  # beyond the top of the package: not ours (and not valid Python either)
            base = base[:len(base) - up]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if not self._ours(module):
            return
        # `from pkg import name`: a submodule when pkg/name exists, else an attribute of pkg.
        targets = set()
        for alias in node.names:
            sub = f"{module}.{alias.name}"
            targets.add(sub if alias.name != "*" and _is_submodule(sub, self.pkg_dir) else module)
        for target in sorted(targets):
            self.found.append(Import(node.lineno, target))


def imports_of(path: Path, pkg_dir: Path, package: str = PACKAGE, type_checking: bool = False) -> list[Import]:
    """The package's modules that the file at `path` imports; type_checking: also those under `if TYPE_CHECKING:`."""
    rel = path.relative_to(pkg_dir).with_suffix("")
    parts = [package, *rel.parts]
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    collector = _Collector(".".join(parts), is_package, pkg_dir, package, type_checking)
    collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return collector.found


def _floor_label(floor: int, names: dict[int, str]) -> str:
    return f"floor {floor} {names[floor]}" if floor in names else f"floor {floor}"


def check_layering(pkg_dir: Path, floors: dict[str, int], names: dict[int, str] | None = None,
                   package: str = PACKAGE) -> list[str]:
    """Every problem in the tree at pkg_dir, one line each: upward imports, and modules or import targets that the
    floor table does not place."""
    names = FLOOR_NAMES if names is None else names
    problems = []
    for path in sorted(pkg_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(pkg_dir).as_posix()
        shown = f"{package}/{rel}"
        here = floor_of(rel, floors)
        if here is None:
            problems.append(f"{shown}: on no floor (add it to the floor table)")
            continue
        for imp in imports_of(path, pkg_dir, package):
            target_rel = _module_path(imp.module, pkg_dir)
            there = floor_of(target_rel, floors)
            if there is None:
                problems.append(f"{shown}:{imp.line} imports {imp.module}, which is on no floor "
                                f"(add {target_rel} to the floor table, or fix the import)")
            elif there < here:
                problems.append(f"{shown}:{imp.line} imports {imp.module} "
                                f"({_floor_label(here, names)} -> {_floor_label(there, names)})")
    return problems


def test_no_upward_imports():
    problems = check_layering(PACKAGE_DIR, FLOORS)
    assert not problems, (f"{len(problems)} layering problem(s) in {PACKAGE}/ (floors: 0 = top, a module may import "
                          f"only its own floor or a higher number):\n" + "\n".join(problems))


def import_graph(pkg_dir: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module (path relative to the package folder) -> the modules it imports, TYPE_CHECKING imports included."""
    graph: dict[str, set[str]] = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(pkg_dir).as_posix()
        targets = {_module_path(imp.module, pkg_dir) for imp in imports_of(path, pkg_dir, package, type_checking=True)}
        graph[rel] = targets - {rel}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a graph, each as a path [a, b, ..., a]: for every module that lies on a cycle, the
    shortest cycle through it (cycles found twice, from different modules, reported once)."""
    cycles: set[tuple[str, ...]] = set()
    for start in sorted(graph):
        parent: dict[str, str] = {}
        queue, seen, found = [start], {start}, None
        while queue and found is None:  # breadth first: the shortest way back to start
            here = queue.pop(0)
            for there in sorted(graph.get(here, ())):
                if there == start:
                    found = here
                    break
                if there not in seen and there in graph:
                    seen.add(there)
                    parent[there] = here
                    queue.append(there)
        if found is None:
            continue
        path = [found]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycle = path[::-1]  # start ... found
        first = cycle.index(min(cycle))  # one rotation per cycle
        cycles.add(tuple(cycle[first:] + cycle[:first]))
    return [[*c, c[0]] for c in sorted(cycles)]


def test_no_import_cycles():
    cycles = import_cycles(import_graph(PACKAGE_DIR))
    assert not cycles, (f"{len(cycles)} import cycle(s) in {PACKAGE}/ (imports inside functions and under "
                        "TYPE_CHECKING counted): move the shared piece down into a module both import\n"
                        + "\n".join(" -> ".join(c) for c in cycles))


def test_cycle_finder_on_synthetic_tree(tmp_path):
    pkg = tmp_path / PACKAGE
    _write(pkg, "__init__.py", "")
    _write(pkg, "a.py", "from specserve import b\n")
    _write(pkg, "b.py", "def f():\n    from specserve.c import x\n")  # inside a function: counted
    _write(pkg, "c.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specserve.a import y\n")
    _write(pkg, "d.py", "import specserve.e\n")
    _write(pkg, "e.py", "from . import d\n")
    _write(pkg, "f.py", "from specserve import a\n")  # imports a cycle, on none
    graph = import_graph(pkg)
    assert graph["c.py"] == {"a.py"} and graph["f.py"] == {"a.py"}
    assert import_cycles(graph) == [["a.py", "b.py", "c.py", "a.py"], ["d.py", "e.py", "d.py"]]


def test_floor_table_prefixes_exist():
    assert set(FLOORS.values()) <= set(FLOOR_NAMES), "every floor in FLOORS needs a name in FLOOR_NAMES"
    assert not PLANNED - set(FLOORS), f"planned prefixes missing from FLOORS: {sorted(PLANNED - set(FLOORS))}"
    bad = []
    for prefix in FLOORS:
        if prefix.endswith("/"):
            exists = (PACKAGE_DIR / prefix).is_dir() and any(p for p in (PACKAGE_DIR / prefix).rglob("*.py"))
        elif prefix.endswith(".py"):
            exists = (PACKAGE_DIR / prefix).is_file()
        else:
            bad.append(f"{prefix!r}: neither a folder (ends in '/') nor a .py file")
            continue
        if not exists and prefix not in PLANNED:
            bad.append(f"{prefix!r}: no such {'folder with .py files' if prefix.endswith('/') else 'file'} "
                       f"under {PACKAGE}/ and not planned")
    assert not bad, "stale floor table entries:\n" + "\n".join(bad)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_checker_on_synthetic_tree(tmp_path):
    pkg = tmp_path / PACKAGE
    floors = {"__init__.py": 0, "engine/": 0, "models/": 1, "layers/": 2, "batch.py": 3}
    names = {0: "engine", 1: "models", 2: "layers", 3: "batch"}
    _write(pkg, "__init__.py", "")
    _write(pkg, "batch.py", "")
    _write(pkg, "engine/__init__.py", "")
    _write(pkg, "engine/core.py", "from specserve import batch\nfrom specserve.models import dense\n")
    _write(pkg, "models/__init__.py", "")
    # Allowed: down one floor; and a relative import of the own floor.
    _write(pkg, "models/dense.py", "import specserve.layers.norm\nfrom . import mtp\n")
    _write(pkg, "models/mtp.py", "")
    _write(pkg, "layers/__init__.py", "")
    # Annotation-only import: not counted; its else branch is.
    _write(pkg, "layers/norm.py",
           "from typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n"
           "    from specserve.engine.core import Engine\n"
           "else:\n"
           "    Engine = None\n")
    # Violations: a relative import two levels up, and one nested inside a function.
    _write(pkg, "layers/rotary.py",
           "from ..engine import core\n"
           "\n"
           "def f():\n"
           "    from specserve.models.dense import X\n"
           "    return X\n")
    _write(pkg, "stray.py", "")
    # A module the table does not place (mid-move, say): reported, never silently passed.
    _write(pkg, "models/old.py", "from specserve.spec.accept import accept\n")

    problems = check_layering(pkg, floors, names)
    assert problems == [
        "specserve/layers/rotary.py:1 imports specserve.engine.core (floor 2 layers -> floor 0 engine)",
        "specserve/layers/rotary.py:4 imports specserve.models.dense (floor 2 layers -> floor 1 models)",
        "specserve/models/old.py:1 imports specserve.spec.accept, which is on no floor "
        "(add spec/accept.py to the floor table, or fix the import)",
        "specserve/stray.py: on no floor (add it to the floor table)",
    ]

    imps = imports_of(pkg / "layers/rotary.py", pkg)
    assert [i.module for i in imps] == ["specserve.engine.core", "specserve.models.dense"]
    assert [i.module for i in imports_of(pkg / "engine/core.py", pkg)] == ["specserve.batch", "specserve.models.dense"]
    assert imports_of(pkg / "layers/norm.py", pkg) == []


@pytest.mark.parametrize("rel, floor", [("engine/engine.py", 2), ("__init__.py", 2), ("server/__init__.py", 0),
                                        ("batch.py", 12), ("bench/plot.py", 1), ("nowhere.py", None)])
def test_floor_of(rel, floor):
    assert floor_of(rel, FLOORS) == floor
