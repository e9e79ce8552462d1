"""One table per node shared by a node-local group: /dev/shm on the CPU backend.

Ranks played by threads check the handshake quickly (every failure path);
real processes through jax.distributed (and through a coordination service
of their own, so the leader can be killed) check what only processes show:
separate address spaces, SIGKILL mid-way. After each, /dev/shm holds no file
of ours. Run as a script, this file is the worker those processes execute.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engram_jax import checkpoint, row_stride, testing
from engram_jax.storage import _cuda, shared
from engram_jax.storage.shared import (
    LocalKeyValueStore,
    NodeGroup,
    SharedTableError,
    SharedTableTimeout,
    allocate_shared,
    can_share_tables,
    handshake,
    processes,
)
from engram_jax.storage.shared import group as group_module

from ._helpers import child_env, free_port, wait_all, without_device_count

DIM = 64
ROWS = 517


def _our_files() -> list[str]:
    prefix = f"{shared.FILE_PREFIX}{os.getuid()}-"
    return sorted(n for n in os.listdir(shared.SHM_DIR) if n.startswith(prefix))


@pytest.fixture(autouse=True)
def no_leftover_files():
    before = set(_our_files())
    yield
    left = set(_our_files()) - before
    for name in left:  # keep later tests meaningful even when this one failed
        os.unlink(os.path.join(shared.SHM_DIR, name))
    assert not left, f"files left in /dev/shm: {sorted(left)}"


@pytest.fixture
def fault_hook():
    """Install a hook(point, rank) for the duration of a test."""

    def install(hook):
        handshake._fault_hook = hook

    yield install
    handshake._fault_hook = None


def _table_arrays(rows: int = ROWS, dim: int = DIM, seed: int = 0):
    rng = np.random.default_rng(seed)
    weight = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0  # no NaN encodings: compare bitwise
    scale = rng.integers(110, 140, (rows, dim // 32), dtype=np.uint8)
    return weight, scale


def _run_ranks(size: int, body, ranks=None, timeout_s: float = 10.0):
    """Run body(group) for each rank on its own thread; returns {rank: result or exception}."""
    store = LocalKeyValueStore()
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        group = NodeGroup(store, rank, size, scope="t", timeout_s=timeout_s)
        try:
            results[rank] = body(group)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in (ranks or range(size))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


# -- threads: the handshake ---------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("nbytes", [1, 4096, 3 * 4096 + 5])
def test_every_rank_sees_the_writers_bytes(size, nbytes):
    payload = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)

    def body(group):
        with allocate_shared(nbytes, group, backend="cpu") as alloc:
            with alloc.writing() as is_writer:
                if is_writer:
                    alloc.write(0, payload)
            return alloc.placement, alloc.method, alloc.read(0, nbytes), alloc.is_writer

    results = _run_ranks(size, body)
    for rank in range(size):
        placement, method, data, writer = results[rank]
        assert (placement, method, writer) == ("shared_shm", "shm", rank == 0)
        np.testing.assert_array_equal(data, payload)


def test_file_is_private_and_unlinked_once_mapped(fault_hook):
    seen = {}

    def hook(point, rank):
        if point == "mapped" and rank == 0:
            (path,) = [os.path.join(shared.SHM_DIR, n) for n in _our_files()]
            st = os.stat(path)
            seen["mode"] = stat.S_IMODE(st.st_mode)
            seen["owner"] = st.st_uid

    fault_hook(hook)

    def body(group):
        alloc = allocate_shared(8192, group, backend="cpu")
        files = _our_files()  # every rank has mapped: the name is gone already
        alloc.close()
        return files

    results = _run_ranks(3, body)
    assert seen == {"mode": 0o600, "owner": os.getuid()}
    assert all(results[r] == [] for r in range(3)), results


def test_readers_cannot_write():
    def body(group):
        with allocate_shared(4096, group, backend="cpu") as alloc:
            if alloc.is_writer:
                alloc.write(0, np.ones(16, np.uint8))
                return None
            with pytest.raises(PermissionError, match="rank 1"):
                alloc.write(0, np.ones(16, np.uint8))
            with pytest.raises(ValueError, match="read-only"):
                alloc.host_array[0] = 1
            return "refused"

    assert _run_ranks(2, body)[1] == "refused"


def test_table_shared_by_ranks_looks_up_the_same_rows():
    from engram_jax import EngramTable, lookup

    weight, scale = _table_arrays()
    ids = np.array([[0, 1, ROWS - 1, ROWS, -1, 17]], np.int32)
    expected = testing.lookup_reference(weight, scale, ids)
    nbytes = ROWS * row_stride(DIM)

    def body(group):
        alloc = allocate_shared(nbytes, group, backend="cpu")
        table = EngramTable(alloc, num_rows=ROWS, dim=DIM)
        try:
            with alloc.writing() as is_writer:
                if is_writer:
                    table.write_rows(0, weight, scale)
            return np.asarray(lookup(table, ids))
        finally:
            table.close()

    results = _run_ranks(3, body)
    for rank in range(3):
        assert results[rank].view(np.uint16).tolist() == expected.view(np.uint16).tolist()


@pytest.mark.parametrize("point", ["hello", "create", "map", "mapped"])
@pytest.mark.parametrize("failing", [0, 2])
def test_error_on_one_rank_is_raised_on_every_rank(fault_hook, point, failing):
    def hook(where, rank):
        if where == point and rank == failing:
            raise RuntimeError(f"injected failure at {point}")

    fault_hook(hook)
    results = _run_ranks(3, lambda g: allocate_shared(4096, g, backend="cpu"))
    for rank in range(3):
        error = results[rank]
        assert isinstance(error, SharedTableError), error
        assert not isinstance(error, SharedTableTimeout)
        assert f"rank {failing}" in str(error) and f"injected failure at {point}" in str(error)
        assert set(error.failures) == {failing}


def test_missing_rank_times_out_with_a_clear_error():
    start = time.monotonic()
    results = _run_ranks(
        3, lambda g: allocate_shared(4096, g, backend="cpu"), ranks=[0, 2], timeout_s=1.5
    )
    assert time.monotonic() - start < 10
    for rank in (0, 2):
        error = results[rank]
        assert isinstance(error, SharedTableTimeout) and isinstance(error, TimeoutError), error
        assert "rank 1" in str(error) and "no report within 1.5 s" in str(error)


def test_once_a_rank_failed_the_others_are_not_waited_for_long(fault_hook):
    def hook(where, rank):
        if where == "hello" and rank == 1:
            raise RuntimeError("bad node")

    fault_hook(hook)
    start = time.monotonic()
    results = _run_ranks(
        3, lambda g: allocate_shared(4096, g, backend="cpu"), ranks=[0, 1], timeout_s=60
    )
    assert time.monotonic() - start < 15  # the grace, not the 60 s bound
    for rank in (0, 1):
        error = results[rank]
        assert isinstance(error, SharedTableError) and not isinstance(error, SharedTableTimeout)
        assert "rank 1" in str(error) and "bad node" in str(error)
        assert "rank 2" in str(error) and "stopped waiting" in str(error)


def test_writer_failure_reaches_every_rank():
    def body(group):
        alloc = allocate_shared(4096, group, backend="cpu")
        try:
            with alloc.writing() as is_writer:
                if is_writer:
                    raise OSError("checkpoint unreadable")
            return "fenced"
        finally:
            alloc.close()

    results = _run_ranks(3, body)
    for rank in range(3):
        error = results[rank]
        assert isinstance(error, SharedTableError), error
        assert "rank 0" in str(error) and "OSError: checkpoint unreadable" in str(error)
        assert "fence0" in str(error)


def test_writer_interrupted_releases_the_readers_at_once():
    # A KeyboardInterrupt is no Exception: the fence must still tell the readers,
    # which would otherwise wait out the fence's whole bound (here 30 s).
    def body(group):
        alloc = allocate_shared(4096, group, backend="cpu")
        try:
            with alloc.writing(timeout_s=30) as is_writer:
                if is_writer:
                    raise KeyboardInterrupt
            return "fenced"
        finally:
            alloc.close()

    start = time.monotonic()
    results = _run_ranks(3, body)
    assert time.monotonic() - start < 15
    assert type(results[0]) is KeyboardInterrupt, results[0]  # the writer's own, not wrapped
    for rank in (1, 2):
        error = results[rank]
        assert isinstance(error, SharedTableError) and not isinstance(error, SharedTableTimeout)
        assert "rank 0" in str(error) and "KeyboardInterrupt" in str(error), error


def test_interrupt_during_setup_releases_the_other_ranks_at_once():
    # An interrupt in one rank's setup must not leave the others waiting out
    # the group's bound (here 20 s), nor leave a file behind.
    before = _our_files()

    def body(group):
        def check():
            if group.rank == 1:
                raise KeyboardInterrupt

        return allocate_shared(4096, group, backend="cpu", check=check)

    start = time.monotonic()
    results = _run_ranks(2, body, timeout_s=20.0)
    assert time.monotonic() - start < 10
    assert type(results[1]) is KeyboardInterrupt, results[1]
    error = results[0]
    assert isinstance(error, SharedTableError) and not isinstance(error, SharedTableTimeout), error
    assert "rank 1" in str(error) and "KeyboardInterrupt" in str(error), error
    assert _our_files() == before


def test_no_space_in_shm_fails_on_every_rank_before_allocating():
    free = os.statvfs(shared.SHM_DIR).f_bavail * os.statvfs(shared.SHM_DIR).f_frsize
    results = _run_ranks(2, lambda g: allocate_shared(free + (1 << 30), g, backend="cpu"))
    for rank in range(2):
        assert isinstance(results[rank], SharedTableError), results[rank]
        assert "rank 0" in str(results[rank]) and "GiB free" in str(results[rank])


def test_ranks_that_disagree_on_the_size_fail():
    results = _run_ranks(2, lambda g: allocate_shared(4096 * (1 + g.rank), g, backend="cpu"))
    for rank in range(2):
        assert isinstance(results[rank], SharedTableError)
        assert "different sizes" in str(results[rank])


def test_cpu_backend_refuses_cuda_methods():
    results = _run_ranks(2, lambda g: allocate_shared(4096, g, backend="cpu", method="fd"))
    assert all("/dev/shm only" in str(results[r]) for r in range(2))


def test_check_failing_on_one_rank_stops_all_ranks():
    def body(group):
        def check():
            if group.rank == 1:
                raise FileNotFoundError("no checkpoint on this node")

        return allocate_shared(4096, group, backend="cpu", check=check)

    results = _run_ranks(2, body)
    for rank in range(2):
        assert "rank 1" in str(results[rank]) and "no checkpoint" in str(results[rank])


def test_checkpoint_missing_on_one_rank_fails_every_rank(tmp_path):
    weight, scale = _table_arrays()
    path = checkpoint.save_checkpoint(tmp_path / "m.safetensors", {0: (weight, scale)})

    def body(group):
        source = path if group.rank != 1 else tmp_path / "elsewhere.safetensors"
        return checkpoint.load_table(source, 0, placement="cpu", group=group, progress=False)

    results = _run_ranks(3, body)
    for rank in range(3):
        error = results[rank]
        assert isinstance(error, SharedTableError), error
        assert "rank 1" in str(error) and "no such checkpoint file" in str(error)


def test_argument_errors():
    group = NodeGroup.single()
    with pytest.raises(ValueError, match="method"):
        allocate_shared(10, group, method="carrier-pigeon")
    with pytest.raises(ValueError, match="nbytes"):
        allocate_shared(0, group)
    with pytest.raises(TypeError, match="NodeGroup"):
        allocate_shared(10, object())
    with pytest.raises(ValueError, match="rank"):
        NodeGroup(LocalKeyValueStore(), 2, 2)
    with pytest.raises(ValueError, match="backend"):
        allocate_shared(10, group, backend="tpu")


def test_from_jax_refuses_another_timeout_for_the_formed_group(monkeypatch):
    group = NodeGroup(LocalKeyValueStore(), 0, 1, timeout_s=40)
    monkeypatch.setattr(group_module, "_jax_group", group)
    assert NodeGroup.from_jax() is group
    assert NodeGroup.from_jax(timeout_s=40) is group
    with pytest.raises(ValueError, match=r"timeout_s=10.*40"):
        NodeGroup.from_jax(timeout_s=10)


def test_can_share_tables_says_why():
    assert can_share_tables(1 << 20, group=2, backend="cpu")
    assert can_share_tables(1 << 20, group=2, backend="cpu").method == "shm"
    single = can_share_tables(1 << 20, group=1, backend="cpu")
    assert not single and "2+" in single.reason
    huge = can_share_tables(1 << 60, group=2, backend="cpu")
    assert not huge and "GiB free" in huge.reason
    missing = can_share_tables(1, group=2, backend="cpu", shm_dir="/nonexistent/shm")
    assert not missing and "does not exist" in missing.reason


@pytest.mark.skipif(_cuda.device_count() > 0, reason="checks the no-GPU answer")
def test_can_share_tables_without_gpu():
    check = can_share_tables(1 << 20, group=2, backend="gpu")
    assert not check and "GPU" in check.reason


def test_stale_files_of_dead_leaders_are_swept():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    ns = processes.pid_namespace() or 0
    stale = Path(shared.SHM_DIR) / f"{shared.FILE_PREFIX}{os.getuid()}-{ns}-{pid}-deadbeef"
    live = Path(shared.SHM_DIR) / f"{shared.FILE_PREFIX}{os.getuid()}-{ns}-{os.getpid()}-cafe"
    stale.touch(mode=0o600)
    live.touch(mode=0o600)
    try:
        removed = shared.sweep_stale_files()
        assert removed == [str(stale)] and not stale.exists() and live.exists()
    finally:
        live.unlink()
        stale.unlink(missing_ok=True)


# -- fd passing over a Unix socket (the cuMem POSIX-fd path's transport) ----------


def test_fds_reach_the_peer_and_only_the_peer():
    fds = [os.memfd_create(f"engram-test-{i}") for i in range(70)]  # more than one message
    for i, fd in enumerate(fds):
        os.write(fd, bytes([i]))
    name = f"\0engram_jax-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(name)
        sock.listen(2)
        got: list[int] = []
        receiver = threading.Thread(
            target=lambda: got.extend(shared.receive_fds(name, len(fds), time.monotonic() + 5))
        )
        receiver.start()
        shared.serve_fds(sock, fds, [(os.getpid(), 1)], time.monotonic() + 5)
        receiver.join()
        try:
            assert len(got) == len(fds)
            assert [os.pread(fd, 1, 0)[0] for fd in got] == list(range(len(fds)))
        finally:
            for fd in got:
                os.close(fd)
        # A connection from a process that is not in the group gets nothing.
        refused = threading.Thread(
            target=lambda: pytest.raises(
                ConnectionError, shared.receive_fds, name, 1, time.monotonic() + 3
            )
        )
        refused.start()
        with pytest.raises(TimeoutError, match="rank"):
            shared.serve_fds(sock, fds, [(1, 1)], time.monotonic() + 1)
        refused.join()
    for fd in fds:
        os.close(fd)


# -- the GPU handshake against a stand-in CUDA driver (runs anywhere) -----------------


@pytest.mark.parametrize("method", ["fd", "auto"])
def test_cumem_fd_handshake_with_a_stand_in_driver(monkeypatch, method):
    from tests.test_storage import _FakeDriver

    fake = _FakeDriver(monkeypatch)
    fds_before = set(os.listdir("/proc/self/fd"))

    def body(group):
        with allocate_shared(
            10 << 20, group, backend="gpu", method=method, chunk_bytes=4 << 20, reserve_bytes=0
        ) as alloc:
            with alloc.writing():
                pass
            return alloc.placement, alloc.method, alloc.info["chunks"]

    results = _run_ranks(3, body)
    for rank in range(3):
        assert results[rank] == ("shared_numa", "fd", 3), results[rank]
    assert fake.empty()  # every rank unmapped and released its handles
    assert set(os.listdir("/proc/self/fd")) == fds_before  # no exported fd left open


def test_gpu_shm_path_registers_on_every_rank_and_unregisters(monkeypatch):
    from tests.test_storage import _FakeDriver

    _FakeDriver(monkeypatch)  # a GPU as far as the handshake can tell
    registered: dict[int, int] = {}
    lock = threading.Lock()

    def register(address, nbytes):
        with lock:
            registered[address] = nbytes

    def unregister(address):
        with lock:
            del registered[address]

    monkeypatch.setattr(_cuda, "host_register", register)
    monkeypatch.setattr(_cuda, "host_unregister", unregister)
    payload = np.arange(5000, dtype=np.uint8)

    def body(group):
        alloc = allocate_shared(5000, group, backend="gpu", method="shm")
        try:
            with alloc.writing() as is_writer:
                if is_writer:
                    alloc.write(0, payload)
            with lock:
                seen = registered.get(alloc.address)
            return alloc.placement, int(alloc.kind), seen, alloc.read(0, 5000)
        finally:
            alloc.close()

    results = _run_ranks(3, body)
    for rank in range(3):
        placement, kind, seen, data = results[rank]
        assert (placement, kind, seen) == ("shared_shm", 1, 5000)  # HOST_MAPPED
        np.testing.assert_array_equal(data, payload)
    assert registered == {}


# -- processes ---------------------------------------------------------------------------


def _spawn(scenario: str, size: int, tmp_path: Path, *, how: str, port: int, gpu: bool = False):
    """Run the worker below in ``size`` processes; ``how``: jax (jax.distributed),
    service (a coordination service the test runs), own (process 0 runs it)."""
    env = without_device_count(dict(os.environ))
    if gpu:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # two processes on one GPU
    else:
        env["JAX_PLATFORMS"] = "cpu"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.test_shared_tables",  # a module, so its relative imports resolve
                scenario,
                str(rank),
                str(size),
                str(port),
                str(tmp_path),
                how,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[1],
        )
        for rank in range(size)
    ]
    return _collect_results(procs, timeout_s=90)


def _collect_results(procs, timeout_s: float) -> dict:
    """Each child's return code, last ``RESULT`` JSON line (None if none) and stderr tail;
    children still running at the deadline are killed, and none outlives this call."""
    results = {}
    for rank, (code, out, err, _) in enumerate(wait_all(procs, timeout_s)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        results[rank] = {
            "returncode": code,
            "result": json.loads(lines[-1][7:]) if lines else None,
            "stderr": err[-3000:],
        }
    return results


@pytest.fixture
def small_checkpoint(tmp_path):
    weight, scale = _table_arrays()
    checkpoint.save_checkpoint(tmp_path / "engram.safetensors", {1: (weight, scale)})
    return tmp_path


def test_processes_share_a_table_through_jax_distributed(small_checkpoint):
    results = _spawn("basic", 3, small_checkpoint, how="jax", port=free_port())
    for rank in range(3):
        info = results[rank]
        assert info["returncode"] == 0, info["stderr"]
        result = info["result"]
        assert result["group"] == [rank, 3]
        assert result["lookup_equal"] and result["dummy_equal"], result
        assert result["placement"] == "shared_shm"
        assert result["writeable"] == (rank == 0)
        assert "rank 2" in result["gathered_error"] and "boom on rank 2" in result["gathered_error"]
        assert "rank 0" in result["writer_error"] and "bad weights" in result["writer_error"]
        assert result["files_after"] == []


@pytest.mark.parametrize(
    "scenario, victim, via_jax",
    [
        ("kill_at_map", 1, True),  # a peer dies before mapping: the leader cleans up
        ("kill_after_create", 0, False),  # the leader dies holding a named file: peers unlink it
        ("kill_in_fence", 0, False),  # the writer dies while loading: readers are told
        ("kill_in_fence", 1, True),  # a reader dies after mapping: the writer is told
    ],
)
def test_sigkill_mid_way_leaves_nothing_and_names_the_rank(
    small_checkpoint, scenario, victim, via_jax
):
    port = free_port()
    service = None
    if not via_jax:
        # Outside the group, so killing the leader does not take the store with it.
        service = shared.coordination_service(f"127.0.0.1:{port}", 3)
    try:
        start = time.monotonic()
        results = _spawn(
            f"{scenario}:{victim}",
            3,
            small_checkpoint,
            how="jax" if via_jax else "service",
            port=port,
        )
        elapsed = time.monotonic() - start
    finally:
        if service is not None:
            service.shutdown()
    assert results[victim]["returncode"] == -signal.SIGKILL
    for rank in range(3):
        if rank == victim:
            continue
        info = results[rank]
        assert info["returncode"] == 0, info["stderr"]
        error = info["result"]["error"]
        assert info["result"]["type"] == "SharedTableError", error
        assert f"rank {victim}" in error and "died" in error, error
    assert elapsed < 60
    assert _our_files() == []


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fd", "shm", "auto"])
def test_two_processes_on_one_gpu_share_a_numa_table(small_checkpoint, method):
    results = _spawn(f"gpu:{method}", 2, small_checkpoint, how="own", port=free_port(), gpu=True)
    for rank in range(2):
        info = results[rank]
        assert info["returncode"] == 0, info["stderr"]
        result = info["result"]
        assert result["lookup_equal"], result
        assert result["method"] == method or (
            method == "auto" and result["method"] in ("fabric", "fd")
        )
        assert result["placement"] == ("shared_shm" if method == "shm" else "shared_numa")
    assert _our_files() == []


# -- the worker ------------------------------------------------------------------------------


def _worker(scenario: str, rank: int, size: int, port: int, directory: str, how: str):
    """Runs one scenario; returns (result, group)."""
    group = _join(rank, size, port, how)
    return _scenario(scenario, group, directory), group


def _join(rank: int, size: int, port: int, how: str) -> NodeGroup:
    import jax

    address = f"127.0.0.1:{port}"
    if how == "jax":
        jax.distributed.initialize(address, size, rank, initialization_timeout=60)
        return NodeGroup.from_jax(timeout_s=30)
    return NodeGroup.connect(
        address, size, rank, timeout_s=60, start_service=None if how == "own" else False
    )


def _scenario(scenario: str, group: NodeGroup, directory: str) -> dict:
    import jax

    from engram_jax import lookup

    name, _, victim = scenario.partition(":")
    ckpt = os.path.join(directory, "engram.safetensors")
    weight, scale = _table_arrays()
    ids = np.arange(-4, ROWS + 3, dtype=np.int32).reshape(-1, 4)

    if name == "gpu":
        with checkpoint.load_table(
            ckpt, 1, placement="numa", device=0, group=group, share_method=victim, progress=False
        ) as table:
            got = np.asarray(jax.jit(lambda i: lookup(table, i))(jax.device_put(ids)))
            expected = testing.lookup_reference(weight, scale, ids)
            return {
                "lookup_equal": bool((got.view(np.uint16) == expected.view(np.uint16)).all()),
                "method": table.allocation.method,
                "placement": table.placement,
                "platform": jax.devices()[0].platform,
            }

    if name != "basic":
        point = {"kill_at_map": "map", "kill_after_create": "created", "kill_in_fence": "fence0"}
        handshake._fault_hook = lambda where, r: (
            os.kill(os.getpid(), signal.SIGKILL)
            if where == point[name] and r == int(victim)
            else None
        )
        try:
            checkpoint.load_table(ckpt, 1, placement="cpu", group=group, progress=False)
            return {"type": None, "error": "no error"}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"type": type(exc).__name__, "error": str(exc)}

    result = {"group": [group.rank, group.size]}
    with checkpoint.load_table(
        ckpt, 1, row_start=5, num_rows=400, placement="cpu", group=group, progress=False
    ) as table:
        got = np.asarray(lookup(table, ids))
        expected = testing.lookup_reference(weight[5:405], scale[5:405], ids, row_start=5)
        result["lookup_equal"] = bool((got.view(np.uint16) == expected.view(np.uint16)).all())
        result["placement"] = table.placement
        result["writeable"] = bool(table.allocation.host_array.flags.writeable)
    with checkpoint.dummy_table(300, 128, placement="cpu", group=group) as table:
        got = np.asarray(lookup(table, ids % 300))
        result["dummy_equal"] = bool((got.astype(np.float32) == 1.0).all())

    def boom(where, r):
        if where == "map" and r == 2:
            raise RuntimeError("boom on rank 2")

    handshake._fault_hook = boom
    try:
        checkpoint.dummy_table(10, 32, placement="cpu", group=group)
    except SharedTableError as exc:
        result["gathered_error"] = str(exc)
    handshake._fault_hook = None
    try:
        alloc = allocate_shared(4096, group, backend="cpu")
        with alloc.writing() as is_writer:
            if is_writer:
                raise ValueError("bad weights")
    except SharedTableError as exc:
        result["writer_error"] = str(exc)
        alloc.close()
    result["files_after"] = _our_files()
    return result


if __name__ == "__main__":
    import faulthandler

    faulthandler.dump_traceback_later(40, exit=True)  # a hang shows where, and ends
    scenario_arg, rank_arg, size_arg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    outcome, node_group = _worker(
        scenario_arg, rank_arg, size_arg, int(sys.argv[4]), sys.argv[5], sys.argv[6]
    )
    print("RESULT " + json.dumps(outcome), flush=True)
    # Process 0 may host the coordination service: it leaves last, or the
    # others would be aborted by jax for losing it before they report.
    node_group.store.set(f"test/done/{rank_arg}", str(os.getpid()))
    if rank_arg == 0:
        killed = scenario_arg.partition(":")[2] if scenario_arg.startswith("kill") else None
        for other in range(1, size_arg):
            if str(other) != killed:
                pid = int(node_group.store.get(f"test/done/{other}", 30))
                deadline = time.monotonic() + 30
                while processes.ProcessWatch.start_time(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)  # until it has exited, not just reported
    # Skip interpreter teardown: jax.distributed's shutdown would wait for dead peers.
    os._exit(0)


# -- one process per GPU (jax.distributed), one table per node -------------------------

# NCCL's NVLink multicast stays off in every process these tests start.
os.environ["NCCL_NVLS_ENABLE"] = "0"

# Column sizes of the ROWS-row layer for the sharded lookups across the processes.
NODE_SIZES = (60, 70, 71, 73, 79, 80, 84)

NODE_CHILD = """
import faulthandler
import json
import os
import sys
import time

faulthandler.dump_traceback_later(float(sys.argv[8]), exit=True)  # a hang shows where, and ends
rank, size, port, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
method, platform, visibility = sys.argv[5], sys.argv[6], sys.argv[7]
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

extra = {"local_device_ids": [rank]} if visibility == "local_device_ids" else {}
jax.distributed.initialize(f"127.0.0.1:{port}", size, rank, initialization_timeout=60, **extra)
import engram_jax as ej
from engram_jax import checkpoint, row_stride, testing
from engram_jax.sharded_table import handler_ordinal
from engram_jax.storage import NodeGroup, SharedTableError, _cuda
from engram_jax.storage.shared import processes

(device,) = jax.local_devices()
group = NodeGroup.from_jax(timeout_s=60)
arrays = np.load(os.path.join(directory, "layer.npz"))
weight, scale, sizes = arrays["weight"], arrays["scale"], tuple(arrays["sizes"].tolist())
rows = weight.shape[0]
result = {"rank": rank, "group": [group.rank, group.size], "platform": device.platform}
result["ordinal"] = ordinal = handler_ordinal(device)
if platform == "gpu":
    bus_id = _cuda.check(_cuda.runtime().cudaDeviceGetPCIBusId(32, ordinal), "PCI bus id")
    result["pci"] = bytes(bus_id).split(bytes(1))[0].decode()  # which GPU, whatever is visible


def same_bits(got, expected):
    return bool(np.array_equal(np.asarray(got).view(np.uint16), expected.view(np.uint16)))


def finish():
    print("RESULT " + json.dumps(result), flush=True)
    # Process 0 holds the coordination service: it leaves once the others are gone.
    group.store.set(f"test/done/{rank}", str(os.getpid()))
    if rank == 0:
        for other in range(1, size):
            pid = int(group.store.get(f"test/done/{other}", 60))
            deadline = time.monotonic() + 30
            while processes.ProcessWatch.start_time(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
    os._exit(0)


try:
    table = checkpoint.load_table(
        os.path.join(directory, "engram.safetensors"),
        1,
        placement="numa" if platform == "gpu" else "cpu",
        device=device,
        group=group,
        share_method=method,
        progress=False,
    )
except SharedTableError as exc:
    result["refused"] = str(exc)
    finish()

allocation = table.allocation
result.update(
    method=allocation.method,
    placement=table.placement,
    writer=allocation.is_writer,
    writeable=bool(allocation.host_array.flags.writeable),
    numa_node=allocation.info.get("numa_node"),
)
# 1. This process's own GPU reads the node's one table.
ids = np.arange(-4, rows + 3, dtype=np.int32).reshape(-1, 4)  # past both ends too
got = jax.jit(lambda i: ej.lookup(table, i))(jax.device_put(ids, device))
result["lookup_equal"] = same_bits(got, testing.lookup_reference(weight, scale, ids))

# 2. The sharded lookup across the processes (NCCL between GPUs), every rank reading
#    the shared whole-layer table: EDP head sharding both ways, and shared mode.
mesh = ej.engram_mesh(tp=1)
result["mesh"] = dict(mesh.shape)
offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
rng = np.random.default_rng(1)  # the same ids in every process
result["sharded_equal"] = {}
for name, kwargs in (
    ("all_to_all", {}),
    ("all_gather_select", {"exchange": "all_gather_select"}),
    ("shared", {"mode": "shared"}),
):
    plan = ej.ShardPlan(sizes, edp=size, **kwargs)
    per = [(rng.integers(0, sizes, (n, 7)) + offsets).astype(np.int32) for n in (5, 0, 3, 6)[:size]]
    per += [(rng.integers(0, sizes, (2, 7)) + offsets).astype(np.int32)] * (size - len(per))
    global_ids, _ = ej.pad_replicas(per, slot=6)
    on_mesh = jax.make_array_from_callback(
        global_ids.shape, NamedSharding(mesh, P(("dp", "edp"))), lambda index: global_ids[index]
    )
    out = ej.make_sharded_lookup(table, mesh, plan)(on_mesh)
    expected = testing.lookup_reference(weight, scale, global_ids)
    result["sharded_equal"][name] = all(
        same_bits(shard.data, expected[shard.index]) for shard in out.addressable_shards
    )



def barrier(name):
    group.store.set(f"test/{name}/{rank}", "1")
    for other in range(size):
        group.store.get(f"test/{name}/{other}", 60)


# 3. One copy per node: the writer rewrites row 0, every process's GPU then reads the new row.
barrier("sharded")  # shared mode has no collective: a peer may still be reading
new_weight = np.full((1, weight.shape[1]), 0x38, np.uint8)  # fp8 1.0
new_scale = np.full((1, scale.shape[1]), 128, np.uint8)  # x 2
if rank == 0:
    table.write_rows(0, new_weight, new_scale)
    group.store.set("test/rewritten", "1")
else:
    group.store.get("test/rewritten", 60)
got = jax.jit(lambda i: ej.lookup(table, i))(jax.device_put(np.zeros((1, 1), np.int32), device))
result["sees_rewrite"] = same_bits(got, testing.lookup_reference(new_weight, new_scale, [[0]]))
barrier("read")  # nobody closes the table while another still reads it
table.close()
finish()
"""


def _run_node_processes(tmp_path, method, platform, visibility, size, timeout_s=120):
    """NODE_CHILD in ``size`` processes; their RESULT dicts (None where a process gave none)."""
    weight, scale = _table_arrays()
    checkpoint.save_checkpoint(tmp_path / "engram.safetensors", {1: (weight, scale)})
    np.savez(tmp_path / "layer.npz", weight=weight, scale=scale, sizes=np.array(NODE_SIZES))
    script = tmp_path / "node_child.py"
    script.write_text(NODE_CHILD)
    env = child_env(platform)
    port = free_port()
    procs = []
    for rank in range(size):
        rank_env = dict(env)
        if visibility == "cuda_visible_devices":
            rank_env["CUDA_VISIBLE_DEVICES"] = str(rank)
        args = [rank, size, port, tmp_path, method, platform, visibility, timeout_s - 20]
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *map(str, args)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=rank_env,
            )
        )
    return _collect_results(procs, timeout_s)


def _check_node_results(results, size, method, platform):
    for rank in range(size):
        info = results[rank]
        assert info["returncode"] == 0 and info["result"], info["stderr"]
    outcomes = [results[rank]["result"] for rank in range(size)]
    refused = [r for r in outcomes if "refused" in r]
    if refused:
        # A refusal is raised on every rank, naming the rank and the reason.
        assert len(refused) == size, outcomes
        reason = refused[0]["refused"]
        expected = ("NOT_PERMITTED", "not available on every rank", "/dev/shm only")
        if method == "fabric" and any(why in reason for why in expected):
            pytest.skip(f"FABRIC sharing refused here, as expected: {reason[:300]}")
        raise AssertionError(f"sharing by {method} failed: {reason}")
    for rank, result in enumerate(outcomes):
        assert result["group"] == [rank, size] and result["platform"] == platform, result
        assert result["writer"] == (rank == 0) and result["writeable"] == (rank == 0), result
        assert result["lookup_equal"], result
        assert result["mesh"] == {"dp": 1, "edp": size, "tp": 1}, result
        assert all(result["sharded_equal"].values()) and len(result["sharded_equal"]) == 3, result
        assert result["sees_rewrite"], result
        if platform == "gpu":
            want = {"shm": "shared_shm"}.get(method, "shared_numa")
            assert result["placement"] == want, result
            assert result["method"] == method or (
                method == "auto" and result["method"] in ("fabric", "fd")
            ), result
        else:
            assert (result["placement"], result["method"]) == ("shared_shm", "shm"), result
    if platform == "gpu":  # each process on its own GPU
        assert len({r["pci"] for r in outcomes}) == size, outcomes
    assert _our_files() == []


NODE_CASES = [
    ("fd", "local_device_ids"),
    ("shm", "local_device_ids"),
    ("auto", "local_device_ids"),
    ("fabric", "local_device_ids"),
    ("fd", "cuda_visible_devices"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("method", "visibility"), NODE_CASES, ids=["-".join(c) for c in NODE_CASES]
)
def test_one_process_per_gpu_shares_one_table_per_node(tmp_path, method, visibility):
    """One jax.distributed process per GPU (picked by local_device_ids, or by
    CUDA_VISIBLE_DEVICES), one table per node written by rank 0: every process's
    GPU reads it bit-exact, the sharded lookup runs across the processes on it,
    and a row the writer rewrites is seen by all (one copy, not one each).
    FABRIC is expected to be refused where no IMEX channel permits it: skipped."""
    gpus = _cuda.device_count()
    if gpus < 2:
        pytest.skip(f"needs 2+ GPUs on one host; {gpus} visible")
    results = _run_node_processes(tmp_path, method, "gpu", visibility, gpus)
    _check_node_results(results, gpus, method, "gpu")


def test_node_processes_share_one_table_on_cpu(tmp_path):
    """The same processes on the CPU backend (/dev/shm, gloo), so the script stays right."""
    results = _run_node_processes(tmp_path, "shm", "cpu", "all", 2)
    _check_node_results(results, 2, "shm", "cpu")
