"""The package's floor plan holds: each subpackage is a layer that imports only from itself and
the layers below it (lazy imports included), the root holds only the command line, and no
module grows past what a reader holds in mind. docs/architecture.md draws the same order."""

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
    "episodes",
    "run",
    "launch",
    "preflight",
]
ROOT_MODULES = {"__init__.py", "__main__.py", "cli.py"}
MAX_LINES = 450


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
