"""The package keeps the shape its layout promises: engram_jax's import graph has
no cycles, no module uses another module's underscore names, jax internals are
reached through one shim, and every ``__all__`` is complete and sorted.

Read from the source with ``ast``: imports at module level, inside functions
and under ``TYPE_CHECKING`` all count, since each is an edge a reader follows.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import engram_jax

ROOT = Path(engram_jax.__file__).resolve().parent
# The one module allowed to import jax's private modules (each use explained there).
JAX_SHIM = "engram_jax._jax_private"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}
# The compiled extension: a module to import from, with no Python source to read.
EXTENSION = "engram_jax._engram_native"
KNOWN = set(MODULES) | {EXTENSION}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _from_base(name: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in module ``name`` reads from."""
    if not node.level:
        return node.module or ""
    package = name if _is_package(name) else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module or ''}".rstrip(".")


def _imports(name: str, tree: ast.Module) -> list[tuple[str, str | None, int]]:
    """``(module, name or None, line)`` for every engram_jax import of module ``name``:
    ``from m import x`` is an edge to ``m.x`` when that is a module, else to ``m``
    with the name ``x``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(name, node)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                edge = (full, None) if full in KNOWN else (base, alias.name)
                found.append((*edge, node.lineno))
    return [(module, what, line) for module, what, line in found if module in KNOWN]


def _module_aliases(name: str, tree: ast.Module) -> dict[str, str]:
    """Local names bound to engram_jax modules: ``from engram_jax import storage``,
    ``import engram_jax.storage as storage``."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in KNOWN and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(name, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in KNOWN:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def _defines_all(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "__all__" for t in node.targets)
        for node in tree.body
    )


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    return {
        name: {module for module, _, _ in _imports(name, tree) if module != name}
        for name, tree in trees.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def private_uses(trees: dict[str, ast.Module]) -> list[str]:
    """Where a module imports, or reads as an attribute, another engram_jax module's
    underscore name. Private modules themselves (``_native``, ``_format``, ...) may
    be imported: their names without an underscore are what they share."""
    found = []
    for name, tree in trees.items():
        for module, what, line in _imports(name, tree):
            if what and what.startswith("_") and not what.startswith("__"):
                found.append(f"{name}:{line} imports {module}.{what}")
        aliases = _module_aliases(name, tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and f"{aliases[node.value.id]}.{node.attr}" not in KNOWN
            ):
                found.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def jax_internal_imports(trees: dict[str, ast.Module]) -> list[str]:
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                if module.startswith(("jax._src", "jaxlib")) and name != JAX_SHIM:
                    found.append(f"{name}:{node.lineno} imports {module}")
    return found


def test_the_layout_is_read_whole():
    """The checks below see every module, subpackages included."""
    for name in (
        "engram_jax",
        "engram_jax.ops",
        "engram_jax._format",
        "engram_jax.sharding.plan",
        "engram_jax.storage.shared.group",
        "engram_jax.testing.lookup",
    ):
        assert name in MODULES
    graph = import_graph(_trees())
    assert "engram_jax.sharding" in graph["engram_jax.ops"]
    assert "engram_jax._format" in graph["engram_jax.hashing"]


def test_import_graph_has_no_cycles():
    cycle = find_cycle(import_graph(_trees()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_uses_another_modules_private_names():
    assert private_uses(_trees()) == []


def test_jax_internals_only_through_the_shim():
    assert jax_internal_imports(_trees()) == []


# Modules of an optional extra, and the package they need.
OPTIONAL = {"engram_jax.nnx": "flax"}


@pytest.mark.parametrize("name", [name for name, tree in _trees().items() if _defines_all(tree)])
def test_all_is_sorted_and_every_name_exists(name):
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    module = importlib.import_module(name)
    names = module.__all__
    assert names == sorted(set(names)), f"{name}.__all__ is not sorted (or repeats a name)"
    assert [n for n in names if not hasattr(module, n)] == []


def test_importing_the_package_imports_no_optional_extra():
    code = "import sys, engram_jax; print(sorted({m.split('.')[0] for m in sys.modules}))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = set(ast.literal_eval(result.stdout.strip().splitlines()[-1]))
    assert "engram_jax" in loaded and not loaded & set(OPTIONAL.values())


def test_the_top_level_exports_what_users_reach_for():
    assert "lookup" in engram_jax.__all__ and callable(engram_jax.lookup)
    assert isinstance(engram_jax.__version__, str) and engram_jax.__version__


# -- the checks themselves catch what they are for ------------------------------------------


def _with_source(name: str, extra: str) -> dict[str, ast.Module]:
    trees = _trees()
    trees[name] = ast.parse(MODULES[name].read_text() + "\n" + extra)
    return trees


def test_a_cycle_through_a_function_level_import_is_found():
    trees = _with_source("engram_jax.layout", "def f():\n    from engram_jax import hashing\n")
    cycle = find_cycle(import_graph(trees))
    assert cycle is not None and {"engram_jax.layout", "engram_jax.hashing"} <= set(cycle)


def test_a_cycle_through_type_checking_is_found():
    extra = "if TYPE_CHECKING:\n    from engram_jax.ops import LookupHandle\n"
    cycle = find_cycle(import_graph(_with_source("engram_jax.table", extra)))
    assert cycle is not None and "engram_jax.table" in cycle


def test_a_private_import_and_a_private_attribute_are_found():
    trees = _with_source("engram_jax.checkpoint", "from engram_jax.table import _check_dim\n")
    assert [use.split(" ", 1)[1] for use in private_uses(trees)] == [
        "imports engram_jax.table._check_dim"
    ]
    # storage._cuda is a private module (allowed); _native._lock is a private name.
    trees = _with_source("engram_jax.hot_rows", "x = storage._cuda, _native._lock\n")
    assert [use.split(" ", 1)[1] for use in private_uses(trees)] == [
        "uses engram_jax._native._lock"
    ]


def test_a_jax_internal_import_outside_the_shim_is_found():
    trees = _with_source("engram_jax.table", "from jax._src import xla_bridge\n")
    assert [use.split(" ", 1)[1] for use in jax_internal_imports(trees)] == ["imports jax._src"]
