"""Every Python code block of README.md runs as written, each in a fresh
process on the CPU backend (so a block may set jax's device count), and prints
what it says it shows: a README example that no longer runs fails here. A
block that imports an optional extra's package (Flax) is skipped where that
package is not installed; ``pip install -e ".[test]"`` installs them all.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import Background, without_device_count

README = Path(__file__).resolve().parents[1] / "README.md"


def code_blocks() -> list[tuple[str, str]]:
    """(the section heading above it, the code) of each ```python block."""
    text = README.read_text() if README.exists() else ""
    blocks = []
    heading = "top"
    for part in re.split(r"(^#+ [^\n]*$|```python\n.*?```)", text, flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.lstrip("# ").strip()
        elif part.startswith("```python"):
            blocks.append((heading, part[len("```python\n") : -3]))
    return blocks


BLOCKS = code_blocks()
# Top-level packages of the optional extras (pyproject's [project.optional-dependencies]).
OPTIONAL = {"flax", "optax"}


def optional_imports(code: str) -> set[str]:
    """The optional extras' packages a block imports (``engram_jax.nnx`` needs Flax)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    wanted = {name.split(".")[0] for name in names} & OPTIONAL
    return wanted | ({"flax"} if "engram_jax.nnx" in names else set())


def test_the_readme_has_code_blocks():
    assert len(BLOCKS) >= 5, BLOCKS


def missing_extras(code: str) -> list[str]:
    return [p for p in sorted(optional_imports(code)) if importlib.util.find_spec(p) is None]


def run_block(code: str, cwd: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_PYTHON_CLIENT_PREALLOCATE="false", TMPDIR=str(tmp)
    )
    env = without_device_count(env)  # the suite's forced CPU device count is not the README's
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def block_runs(request, tmp_path_factory):
    """Every block's process, started together, two at a time (see _helpers.Background:
    each is mostly imports, on one core), in a folder of its own: {index: (cwd, tmp)}."""
    background = Background(request)
    background.dirs = {}
    # The blocks with an optional extra (Flax above all) take the longest: first.
    for i in sorted(range(len(BLOCKS)), key=lambda i: not optional_imports(BLOCKS[i][1])):
        code = BLOCKS[i][1]
        if missing_extras(code):
            continue
        root = tmp_path_factory.mktemp(f"block{i}")
        cwd, tmp = root / "cwd", root / "tmp"
        cwd.mkdir()
        tmp.mkdir()
        background.dirs[i] = root, cwd, tmp
        background.start(i, {"test_readme_block_runs"}, run_block, code, cwd, tmp)
    yield background
    background.close()


@pytest.mark.parametrize(
    "index", range(len(BLOCKS)), ids=[f"{i}-{h}" for i, (h, _) in enumerate(BLOCKS)]
)
def test_readme_block_runs(index, block_runs):
    for package in missing_extras(BLOCKS[index][1]):
        pytest.skip(f"needs {package} (an optional extra)")
    tmp_path, cwd, tmp = block_runs.dirs[index]
    result = block_runs.result(index)
    assert result.returncode == 0, result.stderr[-3000:]
    # A block cleans up after itself: nothing left where it ran nor in the temporary
    # folder (a README example that leaves files behind leaves them on every reader's disk).
    left = sorted(str(p.relative_to(tmp_path)) for p in [*cwd.iterdir(), *tmp.iterdir()])
    assert not left, left


def test_optional_imports_are_found():
    assert optional_imports("from flax import nnx\nimport numpy") == {"flax"}
    assert optional_imports("from engram_jax.nnx import Engram") == {"flax"}
    assert optional_imports("from engram_jax import nnx") == {"flax"}
    assert optional_imports("import engram_jax as ej\nimport optax") == {"optax"}
    assert optional_imports("import engram_jax as ej") == set()
