"""Test setup shared by every test file: eight virtual CPU devices (set before
jax is imported, so multi-device tests run on any machine), the `gpu`
marker, which skips unless the CUDA build of engram_jax sees a GPU, the units of
work under pytest-xdist, and the fixtures several files use.
"""

import os
from pathlib import Path

# Device-placed tables are cudaMalloc'ed beside XLA's pool, so XLA must not grab most of the GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# Without NVIDIA devices, XLA compiles at LLVM's lowest level (the processes the tests
# start inherit it): the suite compiles hundreds of small programs and runs each a few
# times, and on 2 cores compiling took about a fifth of test_speculation.py and
# test_layer.py (98 -> 77 s). The semantics are the same (no fast math either way); a
# GPU machine keeps XLA's default, as its GPU tests were checked with it.
if (
    not os.path.exists("/dev/nvidiactl")
    and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]
):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402
import pytest  # noqa: E402

from engram_jax import _native  # noqa: E402

# Under pytest-xdist (the README's test command: `-n 2`) a test file runs whole in one
# worker, so its module fixtures (the background jobs of _helpers.Background among
# them) start once; the files that make shared tables in /dev/shm or check that none
# of ours is left there are one unit, run by one worker in turn.
SHM_FILES = {"test_checkpoint.py", "test_examples.py", "test_shared_tables.py", "test_storage.py"}


def scheduling_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under pytest-xdist: its file, or "shm"."""
    file = nodeid.split("::", 1)[0]
    return "shm" if Path(file).name in SHM_FILES else file


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    # xdist's own per-file scheduling (--dist loadfile) with the units above. Its
    # --dist loadgroup renames node ids to group them, which pytest 9.2 does not see:
    # the files of one group ran in both workers.
    from xdist.scheduler import LoadScopeScheduling

    class ByFileAndShm(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return ByFileAndShm(config, log)


def pytest_collection_modifyitems(config, items):
    if _native.gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and engram_jax built with CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cpu_unless_gpu(request):
    """jax's default device is the CPU for the test, unless it is marked `gpu` (then
    the GPU is, where there is one). A file takes it for every test with
    ``pytestmark = pytest.mark.usefixtures("cpu_unless_gpu")``."""
    if "gpu" in request.keywords:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="session")
def cpu_device():
    return jax.devices("cpu")[0]


@pytest.fixture(scope="session")
def gpu_device():
    return jax.devices("gpu")[0]
