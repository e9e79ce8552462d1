"""A source tree without a compiled module imports with the installed one.

After ``pip install .`` a script run from the repository root finds the source
tree's ``engram_jax/`` first on ``sys.path``; ``_native`` then loads the compiled
module of the installed distribution. These tests build nothing: they lay out a
copy of the package's Python files (the "source tree") and a fake installed
distribution holding this build's compiled module, and import in a subprocess.
CI also does it for real (``.ci/run``: a non-editable install, then imports from
the repository root).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import engram_jax
from engram_jax import _native

from ._helpers import without_device_count

PACKAGE = Path(engram_jax.__file__).resolve().parent

# The subprocess leaves `engram_jax` to plain sys.path lookup, as after a
# non-editable install: an editable install's finder on sys.meta_path would send
# it to the checkout that finder was made for.
PRELUDE = """
import importlib.machinery, sys, warnings
sys.meta_path[:] = [
    f for f in sys.meta_path
    if f is importlib.machinery.PathFinder
    or not hasattr(f, "find_spec")
    or f.find_spec("engram_jax", None) is None
]
warnings.simplefilter("always")
"""

LOOKUP = """
import numpy as np
import engram_jax as ej
print("package", ej.__file__)
print("native", sys.modules["engram_jax._engram_native"].__file__)
table = ej.dummy_table(8, 32, placement="cpu", fill="distinct")
from engram_jax.testing import lookup_reference
ids = np.array([[3, -1]], np.int32)
rows = np.asarray(ej.lookup(table, ids), np.float32)
want = np.asarray(lookup_reference(*table.read_rows(np.arange(8)), ids), np.float32)
assert (rows == want).all() and abs(rows[0, 0]).max() > 0 and (rows[0, 1] == 0).all()
print("rows ok")
"""


def _sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _layout(tmp_path: Path, *, with_native: bool = True) -> tuple[Path, Path]:
    """``(root, site)``: root/engram_jax holds the package's Python files only; site
    holds an installed distribution of them (RECORD with their hashes) and,
    ``with_native``, this build's compiled module."""
    root, site = tmp_path / "root", tmp_path / "site"
    shutil.copytree(
        PACKAGE,
        root / "engram_jax",
        ignore=shutil.ignore_patterns("__pycache__", "_engram_native*"),
    )
    (site / "engram_jax").mkdir(parents=True)
    record = []
    for path in sorted((root / "engram_jax").rglob("*.py")):
        data = path.read_bytes()
        name = path.relative_to(root).as_posix()
        record.append(f"{name},sha256={_sha256(data)},{len(data)}")
    if with_native:
        compiled = Path(_native.native.__file__)
        (site / "engram_jax" / compiled.name).symlink_to(compiled)
        record.append(f"engram_jax/{compiled.name},sha256=,")
    info = site / f"engram_jax-{engram_jax.__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: engram_jax\nVersion: {engram_jax.__version__}\n"
    )
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return root, site


def _run(root: Path, site: Path, code: str) -> subprocess.CompletedProcess:
    env = without_device_count(dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(site)))
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_source_tree_uses_the_installed_compiled_module(tmp_path):
    root, site = _layout(tmp_path)
    result = _run(root, site, LOOKUP)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    # The source tree's Python came first, the compiled module from the installed copy.
    assert Path(lines["package"]).resolve().parent == (root / "engram_jax").resolve()
    assert Path(lines["native"]).parent == site / "engram_jax"
    assert lines["rows"] == "ok"
    assert "RuntimeWarning" not in result.stderr, result.stderr[-3000:]


def test_a_source_tree_that_differs_from_the_install_warns(tmp_path):
    root, site = _layout(tmp_path)
    with open(root / "engram_jax" / "ops.py", "a") as f:
        f.write("\n# edited after the install\n")
    result = _run(root, site, LOOKUP)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RuntimeWarning" in result.stderr and "engram_jax/ops.py" in result.stderr
    assert "pip install -e ." in result.stderr


def test_no_compiled_module_anywhere_says_how_to_install(tmp_path):
    root, site = _layout(tmp_path, with_native=False)
    result = _run(root, site, "import engram_jax")
    assert result.returncode != 0
    assert "native module is missing" in result.stderr and "pip install ." in result.stderr
