"""Helpers shared by the test files: random tables, NaN-aware bitwise checks,
child processes of the multi-process tests, the example and benchmark runs a file
starts beside its other tests, and XLA's command buffers (CUDA graphs)."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import engram_jax as ej
from engram_jax import _native

SPECIAL_SCALES = np.array([0, 1, 126, 127, 128, 254, 255], dtype=np.uint8)


def load_file(name: str, path: Path):
    """The Python file at ``path`` as a module named ``name``: the examples and the
    tools, which are scripts rather than packages."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scale_factor() -> float:
    """``ENGRAM_TEST_SCALE`` (default 1): tools/sanitize.py sets 0.1, as under
    compute-sanitizer a GPU test runs tens of times slower."""
    return float(os.environ.get("ENGRAM_TEST_SCALE", "1"))


def scaled(count: int) -> int:
    """``count`` (examples, steps) times :func:`scale_factor`, at least 1: the fuzzed and
    soak tests run a tenth of theirs under tools/sanitize.py."""
    return max(1, round(count * scale_factor()))


def under_sanitizer() -> bool:
    """Whether tools/sanitize.py runs this process under compute-sanitizer (it sets
    ``ENGRAM_SANITIZER`` to the tool): the jax profiler sees no GPU kernel there
    (``python tools/sanitize.py --probe``)."""
    return bool(os.environ.get("ENGRAM_SANITIZER"))


def scaled_timeout(seconds: float) -> float:
    """A subprocess's timeout, over :func:`scale_factor` when that is below 1: under the
    sanitizer a test's subprocess runs its full work (a model script, a worker) tens
    of times slower, and tools/sanitize.py's own timeout bounds the run."""
    return seconds / min(1.0, scale_factor())


def random_table_arrays(rng: np.random.Generator, rows: int, dim: int, scale_low: int = 0):
    """Random fp8 bytes (every pattern, NaN too) and scale bytes with the edge values mixed in."""
    weight = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    scale = rng.integers(scale_low, 256, (rows, dim // 32), dtype=np.uint8)
    if rows and scale_low == 0:
        flat = scale.reshape(-1)
        picks = rng.integers(0, flat.size, min(flat.size, 64))
        flat[picks] = rng.choice(SPECIAL_SCALES, picks.size)
    return weight, scale


def make_table(rng, rows, dim, placement="cpu", row_start=0, device=None):
    """A table of :func:`random_table_arrays` rows, with its weight and scale arrays."""
    weight, scale = random_table_arrays(rng, rows, dim)
    table = ej.EngramTable.from_arrays(
        weight, scale, placement=placement, row_start=row_start, device=device
    )
    return table, weight, scale


def nan_free_table_arrays(rows: int, dim: int, seed: int = 0):
    """Random fp8 bytes without NaN encodings and moderate scales, for exact comparisons."""
    rng = np.random.default_rng(seed)
    weight = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0
    scale = rng.integers(100, 150, (rows, dim // 32), dtype=np.uint8)
    return weight, scale


def assert_bf16_equal(actual, expected) -> None:
    """Bitwise equality of bf16 arrays, except that any NaN matches any NaN.

    Which NaN a product yields differs between CPUs and GPUs; everything else
    (signed zeros, infinities, subnormals) must match bit for bit.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a_nan = np.isnan(actual.astype(np.float32))
    e_nan = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(a_nan, e_nan)
    a_bits = actual.view(np.uint16)[~a_nan]
    e_bits = expected.view(np.uint16)[~e_nan]
    mismatch = np.flatnonzero(a_bits != e_bits)
    assert mismatch.size == 0, (
        f"{mismatch.size} bf16 values differ; first: got {a_bits[mismatch[0]]:#06x}, "
        f"want {e_bits[mismatch[0]]:#06x}"
    )


def free_port() -> int:
    """A TCP port free on the loopback interface now, for a coordinator to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs, timeout_s: float) -> list[tuple[int, str, str | None, bool]]:
    """Each child's (return code, stdout, stderr, killed): one deadline for all of
    them; a child still running at it is killed, and none outlives this call."""
    deadline = time.monotonic() + timeout_s
    finished = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                killed = False
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                killed = True
            finished.append((proc.returncode, out, err, killed))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return finished


class Background:
    """Jobs (example or benchmark runs as child processes) started up front and run
    two at a time while a test file's other tests go on; a test takes its job's
    result. Each child is mostly XLA compiling, on one core: two at once keep both of
    the two cores CI has busy (under the README's `-n 2`, beside the other worker's
    tests). ``wanted`` names the tests selected to run, so a ``-k`` run starts only the
    jobs its tests need."""

    def __init__(self, request, workers: int = 2) -> None:
        self.wanted = {item.originalname for item in request.session.items}
        self._pool = concurrent.futures.ThreadPoolExecutor(workers)
        self._jobs: dict = {}

    def start(self, name, tests: set[str], fn, *args) -> None:
        """``fn(*args)`` as the job ``name``, if one of ``tests`` will run."""
        if tests & self.wanted:
            self._jobs[name] = self._pool.submit(fn, *args)

    def result(self, name):
        return self._jobs[name].result()

    def wait(self) -> None:
        """Until every job has ended: for a test whose check a child running beside
        it could disturb (files left in /dev/shm, a signal's timing)."""
        concurrent.futures.wait(list(self._jobs.values()))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def without_device_count(env: dict) -> dict:
    """``env`` with XLA_FLAGS less the session's forced CPU device count (a child runs
    on the devices a user's shell has), keeping the rest (conftest.py's compile level,
    a caller's own flags)."""
    flags = [
        flag
        for flag in env.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    env = dict(env)
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    return env


def child_env(platform: str) -> dict:
    """A multi-process test child's environment: the parent's without the session's
    forced CPU device count, NCCL's NVLink multicast off, no GPU memory taken up
    front (several processes may share a GPU), the CPU backend when asked for."""
    env = without_device_count(
        dict(os.environ, NCCL_NVLS_ENABLE="0", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    )
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    return env


# XLA_FLAGS that put custom calls in CUDA graphs even for the shortest runs of
# commands. XLA reads its flags once per process: tests run under them in a child.
FORCED_COMMAND_BUFFERS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL "
    "--xla_gpu_graph_min_graph_size=1"
)


# XLA_FLAGS for each command-buffer mode; XLA reads them once per process.
COMMAND_BUFFER_MODES = {
    "disabled": "--xla_gpu_enable_command_buffer=",
    "default": "",
    "forced": FORCED_COMMAND_BUFFERS,
}


def run_gpu_worker(module: str, mode: str) -> dict:
    """Run ``python -m module mode`` with the command-buffer mode's flag after this
    process's XLA_FLAGS (in a fresh process: XLA reads its flags once) and return the
    JSON of its last line. The flags it inherits stay: tools/sanitize.py turns XLA's
    GEMM autotuning off, whose redzone checks fault under racecheck. The worker gets
    :func:`scaled_timeout` of 300 s: under compute-sanitizer a soak worker of 100
    steps was still starting or compiling after 250 s."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFER_MODES[mode]}".strip()
    env = dict(os.environ, XLA_FLAGS=flags)
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", module, mode],  # a crash shows its stack
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled_timeout(300),
    )
    # The exit status too: under racecheck a soak worker failed with no output at all.
    assert proc.returncode == 0, (
        f"worker exited {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-8000:]}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def captured_calls() -> dict[str, int]:
    """How many times each graph-compatible CUDA handler was recorded into one of
    XLA's CUDA graphs in this process (XLA's compiled text does not show its graphs)."""
    return dict(_native.native.captured_calls())
