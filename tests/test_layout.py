"""The house rules that a reviewer would otherwise check by eye: no import cycle between the
package's modules (deferred imports inside functions included), and no module over 400 lines
without a reason written at its top."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "benchbackend"
LIMIT = 400
#: What a long module's docstring says to explain its length.
REASON = "Over 400 lines:"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports, at its top or inside a function (a deferred import
    still ties the two modules together); ``TYPE_CHECKING`` blocks never run."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for s in statements:
            if isinstance(s, ast.If) and "TYPE_CHECKING" in ast.unparse(s.test):
                continue
            if isinstance(s, ast.Import):
                found.update(a.name for a in s.names)
            elif isinstance(s, ast.ImportFrom):
                if s.level:
                    base = package.split(".")[: len(package.split(".")) - (s.level - 1)]
                    module = ".".join(base + ([s.module] if s.module else []))
                else:
                    module = s.module or ""
                found.add(module)
                found.update(f"{module}.{a.name}" for a in s.names)
            else:
                visit([c for c in ast.iter_child_nodes(s) if isinstance(c, ast.stmt)])

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in known and m != name}


def cycles(root: Path) -> list[list[str]]:
    modules = _modules(root)
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [])
    return found


def test_no_import_cycles():
    assert cycles(PACKAGE) == []


def test_the_cycle_finder_sees_a_planted_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
                              "from .a import thing\n")
    (pkg / "c.py").write_text("import pkg.b\n")
    assert cycles(pkg) == [["pkg.a", "pkg.b", "pkg.a"]]
    (pkg / "d.py").write_text("def late():\n    from . import e\n")
    (pkg / "e.py").write_text("from . import d\n")
    assert ["pkg.d", "pkg.e", "pkg.d"] in cycles(pkg)


def test_long_modules_say_why():
    long = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        text = path.read_text()
        if text.count("\n") > LIMIT:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if REASON not in doc:
                long.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert long == [], f"modules over {LIMIT} lines whose docstring has no '{REASON} ...': {long}"
