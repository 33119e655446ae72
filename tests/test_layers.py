"""The package's floor plan holds: each subpackage is a layer that imports only from itself and
the layers below it (lazy imports included), no module imports one that imports it back (at any
distance, lazy imports included), the root holds only the command line, and no module grows
past what a reader holds in mind. docs/architecture.md draws the same order."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_gspo"

# Bottom to top.
LAYERS = [
    "runtime",
    "config",
    "parallel",
    "loss",
    "model",
    "weights",
    "data",
    "rollout",
    "trainer",
    "toolbox",
    "rewards",
    "episodes",
    "run",
    "launch",
    "preflight",
]
ROOT_MODULES = {"__init__.py", "__main__.py", "cli.py"}
MAX_LINES = 450
# A layer that grows past this many modules holds more than one concept (episodes/ held
# rewards, tools and sandboxes before they got layers of their own).
MAX_MODULES = {"episodes": 12}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layer(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else None


def _imported_layers(path: Path) -> set[tuple[str, int]]:
    """(layer, line) of every megatron_gspo import in the module, at any depth."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatron_gspo" and len(parts) > 1:
                out.add((parts[1], node.lineno))
    return out


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def import_graph(paths: list[Path], root: Path = PACKAGE.parent) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, lazy imports included. ``from a.b import c``
    imports ``a.b`` and, where ``c`` is a module, ``a.b.c``. A module's own packages are left
    out: Python imports them before the module in any case, so they are not its choice."""
    names = {_module_name(p, root): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = {
            t for t in targets if t in names and t != name and not name.startswith(t + ".")
        }
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_a_module_that_imports_it_back():
    cycles = import_cycles(import_graph(_modules()))
    assert not cycles, "modules that import each other (lazy imports included):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path):
    """The check above would pass on a package with no imports at all: here it must see a
    cycle closed by an import inside a function, at a distance of three modules."""
    pkg = tmp_path / "megatron_gspo"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from megatron_gspo.a import y\n")
    (pkg / "a" / "y.py").write_text("import megatron_gspo.a.z\n")
    (pkg / "a" / "z.py").write_text("def f():\n    from megatron_gspo.a.x import g\n")
    cycles = import_cycles(import_graph(sorted(pkg.rglob("*.py")), root=tmp_path))
    assert cycles == [["megatron_gspo.a.x", "megatron_gspo.a.y", "megatron_gspo.a.z"]], cycles


def test_no_layer_holds_more_modules_than_its_concepts():
    over = {}
    for layer, most in MAX_MODULES.items():
        modules = [p for p in (PACKAGE / layer).glob("*.py") if p.name != "__init__.py"]
        if len(modules) > most:
            over[layer] = len(modules)
    assert not over, f"layers over their module count {MAX_MODULES}: {over}"


def test_every_subpackage_has_a_place_in_the_layers():
    found = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert found == set(LAYERS), f"unplaced: {found - set(LAYERS)}, gone: {set(LAYERS) - found}"


def test_no_layer_imports_from_a_layer_above_it():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in _modules():
        layer = _layer(path)
        if layer is None:
            continue
        for target, line in _imported_layers(path):
            if target in rank and rank[target] > rank[layer]:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}/ ({layer}/)")
    assert not upward, "imports against the layer order:\n" + "\n".join(sorted(upward))


def test_the_root_holds_only_the_command_line():
    root = {p.name for p in PACKAGE.glob("*.py")}
    assert root <= ROOT_MODULES, f"modules at the package root: {sorted(root - ROOT_MODULES)}"


def test_no_module_is_longer_than_a_reader_holds_in_mind():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
