"""Every Python code block of README.md runs as written, each in a fresh
process on the CPU backend (so a block may set jax's device count), and prints
what it says it shows: a README example that no longer runs fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_the_readme_has_code_blocks():
    assert len(BLOCKS) >= 5, BLOCKS


@pytest.mark.parametrize(
    "code", [code for _, code in BLOCKS], ids=[f"{i}-{h}" for i, (h, _) in enumerate(BLOCKS)]
)
def test_readme_block_runs(code, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("XLA_FLAGS", None)  # the suite's forced CPU device count is not the README's
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
