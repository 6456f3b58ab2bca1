"""The house rules that a reviewer would otherwise check by eye: four rooms and a folder per
framework, imports that point one way between them, no import cycle between the package's modules
(deferred imports inside functions included), and no module over 400 lines without a reason
written at its top.

The rooms (README "Layout"): ``spec`` (the workload: fields, layers, graph, shapes, FLOPs,
replicas' semantics), ``data`` (datasets and the run's arrays), ``run`` (plan, runner, executors,
worker, timing, checks) and ``analysis`` (compare, statistics, tables, report, figures), beside
``backends`` (the registry, the contract, a folder per framework). The top level holds the commands
(``cli``, ``epilogue``, ``inventory``), the CSV (``results``, shared by ``run`` and ``analysis``) and
three leaves every room may use (``errors``, ``paths``, ``columns``: the CSV's declaration)."""
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


def _imports(name: str, path: Path, known: set[str], typing: bool = False) -> set[str]:
    """The package modules ``name`` imports, at its top or inside a function (a deferred import
    still ties the two modules together); ``TYPE_CHECKING`` blocks never run, so they count only
    with ``typing`` (the direction rule, which a type's import breaks as much as a call's)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for s in statements:
            if isinstance(s, ast.If) and "TYPE_CHECKING" in ast.unparse(s.test) and not typing:
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


# --- the rooms and the direction of their imports ---------------------------------------------------

ROOMS = ("spec", "data", "run", "analysis", "backends")
#: Leaves that any module may import.
LEAVES = {"errors", "paths", "columns"}
#: What each room may import besides itself and the leaves. ``backends`` means the registry and its
#: entries' types (``backends/__init__.py``, ``backends/spec.py``), ``backends.*`` any adapter module.
ALLOWED = {
    "spec": set(),
    "data": {"spec"},
    "analysis": {"results", "backends"},
    "backends": {"spec", "backends.*"},
    "run": {"spec", "data", "analysis", "backends", "backends.*", "results"},
}
REGISTRY = {"benchbackend.backends.registry", "benchbackend.backends.spec"}
PACKAGES = {"benchbackend", *(f"benchbackend.{room}" for room in ROOMS)}
TOP = {"__init__.py", "__main__.py", "cli.py", "epilogue.py", "inventory.py", "results.py", "columns.py", "errors.py",
       "paths.py", *ROOMS}


def _room(module: str) -> str:
    """The room of ``benchbackend.X...``: X when it is a room, else the top-level module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _allowed(source: str, target: str) -> bool:
    src, dst = _room(source), _room(target)
    if src not in ALLOWED or dst in LEAVES or dst == src or target in PACKAGES:
        return True  # a room's own package (an empty __init__) holds nothing to depend on
    rules = ALLOWED[src]
    if dst == "backends":
        return "backends.*" in rules or ("backends" in rules and target in REGISTRY)
    return dst in rules


def wrong_way(root: Path) -> list[str]:
    """Each import between rooms that the direction rule forbids, as ``source -> target``."""
    modules = _modules(root)
    out = []
    for name, path in sorted(modules.items()):
        for target in sorted(_imports(name, path, set(modules), typing=True)):
            if not _allowed(name, target):
                out.append(f"{name} -> {target}")
    return out


def test_imports_point_one_way_between_the_rooms():
    assert wrong_way(PACKAGE) == []


def test_the_direction_rule_sees_a_planted_wrong_way_import(tmp_path):
    import shutil

    pkg = tmp_path / "benchbackend"
    shutil.copytree(PACKAGE, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert wrong_way(pkg) == []
    stats = pkg / "analysis" / "stats.py"
    stats.write_text(stats.read_text() + "\n\ndef _late():\n    from ..run import worker  # noqa\n")
    model = pkg / "spec" / "model.py"
    model.write_text(model.read_text().replace("from __future__ import annotations\n",
                                              "from __future__ import annotations\n\nfrom typing import TYPE_CHECKING\n"
                                              "if TYPE_CHECKING:\n    from ..data import arrays\n", 1))
    torch = pkg / "backends" / "torch" / "adapter.py"
    torch.write_text(torch.read_text() + "\nfrom ...analysis import compare  # noqa\n")
    assert wrong_way(pkg) == ["benchbackend.analysis.stats -> benchbackend.run.worker",
                              "benchbackend.backends.torch.adapter -> benchbackend.analysis.compare",
                              "benchbackend.spec.model -> benchbackend.data.arrays"]


def test_the_top_level_holds_the_commands_the_csv_and_four_rooms():
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == TOP, f"unexpected at the top: {sorted(entries - TOP)}; missing: {sorted(TOP - entries)}"
    for room in ROOMS:
        assert (PACKAGE / room / "__init__.py").read_text() == "", f"{room}/__init__.py is not empty"


FRAMEWORKS = ("numpy", "torch", "tensorflow", "jax", "keras", "chainer", "onnx", "onnxruntime", "openvino", "tvm",
              "plaidml")


def test_backends_has_a_folder_per_framework_and_every_adapter_lives_in_one():
    from benchbackend.backends import registry as backends

    folders = {p.name for p in (PACKAGE / "backends").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(FRAMEWORKS)
    for spec in backends.BACKENDS.values():
        for target in filter(None, (spec.target, spec.capabilities.replicas)):
            module = target.partition(":")[0].split(".")
            assert module[:2] == ["benchbackend", "backends"] and module[2] in FRAMEWORKS, target
