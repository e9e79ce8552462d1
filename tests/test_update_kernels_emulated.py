"""The CUDA update kernels' logic on a machine without a GPU: ffi/kernels/train.cuh's
UpdateKernel (the hot runs' chunk sums and folds, and the rows) compiled for the host with
tests/emulated_cuda/cuda_host.h (a warp is 32 fibers meeting at every ballot and
shuffle) and run against the CPU update, tables compared byte for byte, over every
optimizer, row dtype, narrow and wide dims and runs of 1 to 2500 entries; and the
small-batch sort's merge (ffi/kernels/merge_chunks.cuh) against a stable sort of the
whole batch. What it cannot see (the sorts' CUB parts, the run list, memory ordering
between CTAs, the GPU's own arithmetic) the tests marked gpu check.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent / "emulated_cuda"
KERNELS = ROOT / "ffi" / "kernels" / "train.cuh"
# A launch function: `static inline cudaError_t Name(...) {` to its closing brace at column 0.
LAUNCH = re.compile(r"^static inline cudaError_t \w+\(.*?^\}\n", re.S | re.M)


def _compiler(tmp_path: Path) -> str:
    """A C++20 compiler with POSIX's <ucontext.h> (cuda_host.h's lanes are fibers)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None or not KERNELS.exists():
        pytest.skip("needs a C++ compiler and the repository's ffi/ sources")
    probe = tmp_path / "probe.cc"
    probe.write_text("#include <ucontext.h>\nint main() { ucontext_t c; return getcontext(&c); }\n")
    built = subprocess.run(
        [compiler, "-std=c++20", str(probe), "-o", str(tmp_path / "probe")],
        capture_output=True, timeout=120,
    )  # fmt: skip
    if built.returncode != 0:
        pytest.skip(f"{compiler} has no C++20 or no <ucontext.h>")
    return compiler


def _build_and_run(tmp_path: Path, program: str, *flags: str) -> str:
    """Build tests/emulated_cuda/<program>.cc for the host and run it; its summary line."""
    compiler = _compiler(tmp_path)
    exe = tmp_path / program
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", *flags, f"-I{HERE / 'stub'}", f"-I{HERE}",
         f"-I{ROOT / 'ffi'}", str(HERE / f"{program}.cc"), "-o", str(exe)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""


def test_update_kernels_match_the_cpu_update(tmp_path):
    source = KERNELS.read_text()
    kernels, launches = LAUNCH.subn("", source)
    assert launches >= 2 and "<<<" not in kernels, "train.cuh's launch functions were not all cut"
    (tmp_path / "train_kernels.h").write_text(kernels)
    summary = _build_and_run(tmp_path, "update_kernels", "-ffp-contract=off", f"-I{tmp_path}")
    counts = dict(zip(summary.split()[::2], map(int, summary.split()[1::2]), strict=True))
    assert counts["failures"] == 0 and counts["cases"] == 240, summary
    # The hot-row path ran: full chunks summed a warp each, and runs updated by the warp
    # of their last chunk.
    assert counts["chunks"] > 0 and counts["runs_done"] > 0, summary


def test_merge_of_sorted_chunks_is_the_stable_sort(tmp_path):
    assert _build_and_run(tmp_path, "merge_kernel") == "cases 35 failures 0"
