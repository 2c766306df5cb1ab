"""The house's layout, checked from the source (DESIGN.md §1): imports point down
`kernels ← models ← speculation ← drafter, verifier ← serving ← cluster`, only cluster/ imports
Ray, no two files import each other (directly or round a loop), no class outgrows ~400 lines,
no package holds more than a third of the product, and the package names are ours."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {"kernels": 0, "models": 1, "speculation": 2, "drafter": 3, "verifier": 3, "serving": 4, "cluster": 5}
MAX_CLASS_LINES = 400


def _files(package: str) -> list[Path]:
    return sorted(p for p in (REPO / package).rglob("*.py") if "_pb2" not in p.name)


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module imported, line) of every import in the file, at any depth (lazy ones too)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if isinstance(node, ast.ImportFrom) and _is_type_checking(tree, node):
                continue
            out += [(node.module, node.lineno)]
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def _is_type_checking(tree: ast.Module, target: ast.AST) -> bool:
    """Whether an import sits under `if TYPE_CHECKING:` (annotations only, never run)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            if any(target is child for child in ast.walk(node)):
                return True
    return False


@pytest.mark.parametrize("package", list(LAYERS))
def test_imports_point_down_and_only_cluster_imports_ray(package):
    wrong = []
    for path in _files(package):
        for name, line in _imports(path):
            top = name.split(".")[0]
            if top in LAYERS and top != package and LAYERS[top] >= LAYERS[package]:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {name}")
            if top == "ray" and package != "cluster":
                wrong.append(f"{path.relative_to(REPO)}:{line} imports Ray")
            if top in ("bench", "tests", "recipes"):
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {top}/")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_between_files():
    modules = {_module(p): p for package in LAYERS for p in _files(package)}
    edges: dict[str, set[str]] = {}
    for mod, path in modules.items():
        targets = set()
        for name, _ in _imports(path):
            while name and name not in modules:        # `from a.b import c`: c may be a name in a.b
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):   # a package's own __init__
                targets.add(name)
        edges[mod] = targets
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(mod: str, stack: list[str]) -> bool:
        state[mod] = 1
        for nxt in sorted(edges[mod]):
            if state.get(nxt) == 1:
                cycle.extend(stack[stack.index(nxt):] + [mod, nxt] if nxt in stack else [mod, nxt])
                return True
            if nxt not in state and visit(nxt, stack + [mod]):
                return True
        state[mod] = 2
        return False

    for mod in sorted(edges):
        if mod not in state and visit(mod, []):
            break
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_class_over_400_lines():
    big = []
    for package in LAYERS:
        for path in _files(package):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                    big.append(f"{path.relative_to(REPO)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not big, big


def test_no_package_holds_more_than_a_third_of_the_product():
    lines = {package: sum(len(p.read_text().splitlines()) for p in _files(package)) for package in LAYERS}
    total = sum(lines.values())
    assert all(n <= total / 3 for n in lines.values()), lines


def test_package_names_resolve_to_this_repo():
    import importlib

    from transformers.utils.import_utils import is_kernels_available

    for package in LAYERS:
        module = importlib.import_module(package)
        assert Path(module.__file__).resolve().parent == REPO / package, package
    assert is_kernels_available() is False, "transformers takes our `kernels` for its optional dependency"
