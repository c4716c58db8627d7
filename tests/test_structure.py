"""The shape of src/tetrad, read from its source with `ast` so it stays true (issue 17, docs/design.md Layout).

- no import cycle between modules (every import counts: inside functions and under TYPE_CHECKING too);
- floors: a module imports only its own floor or lower ones (FLOORS);
- no source file over MAX_FILE_LINES lines, no function over MAX_FUNCTION_LINES (except the
  schedule replay loop, which reads best as one loop);
- the Python the README and docs/ show imports names src/tetrad has.

Today's violations are listed in KNOWN_VIOLATIONS with the owner who removes them. The list can
only shrink: the test fails on a violation not listed *and* on a listed one that is gone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_ALLOWED = {"tetrad.parallel.pipeline.schedules:replay"}  # the schedule replay loop

# Floors, lowest first: a module may import modules of its own floor or below, never above.
# Prefixes match a module and everything under it; a module not listed is on the top floor.
FLOORS = [
    ("tetrad.config", "tetrad.presets", "tetrad.device"),  # settings and the device seam
    ("tetrad.dist",),  # layout, named groups, accounted collectives
    ("tetrad.model",),
    ("tetrad.parallel",),
    ("tetrad.plan", "tetrad.data"),  # the cost model (reads the schedules); token files
    ("tetrad.train",),
]
TOP = len(FLOORS)  # cli, launch, bench, viz, ...

# violation -> the owner who removes it (empty: every rule holds; keep it so).
KNOWN_VIOLATIONS: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "tetrad").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _imports(name: str) -> set[str]:
    """The tetrad modules `name` imports (`from pkg import mod` names the module, not the package)."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in MODULES else base)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _floor(module: str) -> int:
    for level, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return TOP


def _cycles() -> list[str]:
    """Every strongly connected component of more than one module (Tarjan), as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(" <-> ".join(sorted(component)))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def _long_functions(name: str) -> list[str]:
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > MAX_FUNCTION_LINES:
                    out.append(f"{name}:{qual}")
                walk(child, qual + ".")
            else:
                walk(child, prefix)

    walk(TREES[name], "")
    return out


def violations() -> set[str]:
    found = {f"cycle: {c}" for c in _cycles()}
    found |= {f"import: {m} -> {dep}" for m, deps in GRAPH.items() for dep in deps if _floor(dep) > _floor(m)}
    for name, path in MODULES.items():
        if len(path.read_text().splitlines()) > MAX_FILE_LINES:
            found.add(f"size: {path.relative_to(SRC).as_posix()}")
        found |= {f"function: {q}" for q in _long_functions(name) if q not in LONG_FUNCTIONS_ALLOWED}
    return found


def test_no_new_violations():
    new = sorted(violations() - KNOWN_VIOLATIONS.keys())
    assert not new, ("structure rules broken (see this file's docstring); fix, do not list:\n  "
                     + "\n  ".join(new))


def test_known_violations_are_still_real():
    gone = sorted(KNOWN_VIOLATIONS.keys() - violations())
    assert not gone, "fixed, so remove from KNOWN_VIOLATIONS:\n  " + "\n  ".join(gone)


def test_the_checks_see_what_they_claim():
    """The readers themselves: a known import, a known package-relative import, the floors."""
    assert "tetrad.presets" in GRAPH["tetrad.config.loading"]
    assert "tetrad.train.inputs" in GRAPH["tetrad.cli"]  # imported inside a function
    assert _floor("tetrad.config") < _floor("tetrad.model") < _floor("tetrad.parallel.pipeline.executor")
    assert _floor("tetrad.cli") == TOP


def _top_level_names(module: str) -> set[str]:
    """What `from module import NAME` finds: its submodules and the names its top level binds."""
    names = {m.rpartition(".")[2] for m in MODULES if m.rpartition(".")[0] == module}
    for node in TREES[module].body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
    return names


def test_the_docs_import_names_that_exist():
    """Nothing runs the README's and docs/' Python, so a moved name breaks it unseen (the startup
    branch moved model_keys from train/init_from.py to train/inputs.py; README's load_config
    example kept importing it from init_from)."""
    docs = [SRC.parent / "README.md", *sorted((SRC.parent / "docs").glob("*.md"))]
    missing, seen = [], 0
    for doc in docs:
        for line in doc.read_text().splitlines():
            found = re.fullmatch(r"\s*from (tetrad[\w.]*) import ([\w, ]+)", line)
            if not found:
                continue
            seen += 1
            module, names = found[1], [n.strip().split(" as ")[0] for n in found[2].split(",")]
            have = _top_level_names(module) if module in MODULES else set()
            missing += [f"{doc.name}: from {module} import {n}" for n in names if n not in have]
    assert seen and not missing, missing
