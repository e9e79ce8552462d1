"""Storage placements: which exist, what they refuse without a GPU, the huge-page
and NUMA helpers on any Linux machine, and (``gpu``) that every placement
returns the reference rows through ``engram_jax.lookup``.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engram_jax import CudaUnavailableError, EngramTable, checkpoint, lookup, row_stride, testing
from engram_jax.storage import (
    PLACEMENTS,
    Allocation,
    MemoryKind,
    _cuda,
    allocate,
    choose_auto,
    hugepage,
    numa,
    shared,
)

from ._helpers import nan_free_table_arrays

HAS_GPU = _cuda.device_count() > 0


def test_placements_are_registered():
    assert {"cpu", "pinned", "hugepage", "numa", "device", "auto"} <= set(PLACEMENTS)
    with pytest.raises(ValueError, match="unknown placement 'nowhere'"):
        allocate("nowhere", 16)


@pytest.mark.skipif(HAS_GPU, reason="checks the answer without a GPU")
@pytest.mark.parametrize("placement", ["hugepage", "numa", "pinned", "device"])
def test_cuda_placements_refuse_clearly_without_gpu(placement):
    with pytest.raises(CudaUnavailableError):
        allocate(placement, 1 << 20)


@pytest.mark.skipif(HAS_GPU, reason="checks the answer without a GPU")
def test_auto_without_gpu_is_cpu_with_one_log_line(caplog):
    assert choose_auto()[0] == "cpu"
    with caplog.at_level(logging.INFO, logger="engram_jax.storage"):
        with allocate("auto", 4096) as allocation:
            assert allocation.placement == "cpu"
            assert "no CUDA GPU" in allocation.info["auto_reason"]
    lines = [r.getMessage() for r in caplog.records if "placement auto" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("placement auto -> cpu: no CUDA GPU")


def test_allocation_context_manager_frees():
    with allocate("cpu", 4096) as allocation:
        allocation.write(0, np.arange(16, dtype=np.uint8))
    assert allocation.closed
    with pytest.raises(ValueError, match="closed"):
        allocation.read(0, 1)


class _SlowCopy(Allocation):
    """Memory that is not host-addressable, whose copies wait for the test's go."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(
            placement="slow",
            address=0,
            nbytes=64,
            kind=MemoryKind.HOST,
            release=lambda: log.append("released"),
        )
        self.log = log
        self.copying = threading.Event()
        self.go = threading.Event()

    def _copy_in(self, offset, data):
        self.copying.set()
        self.go.wait(10)
        self.log.append("copied")

    def _copy_out(self, offset, nbytes):
        self._copy_in(offset, None)
        return np.zeros(nbytes, np.uint8)


@pytest.mark.parametrize("op", ["write", "read"])
def test_close_waits_for_a_copy_in_progress(op):
    log: list[str] = []
    allocation = _SlowCopy(log)
    if op == "write":
        copy = threading.Thread(target=allocation.write, args=(0, np.ones(8, np.uint8)))
    else:
        copy = threading.Thread(target=allocation.read, args=(0, 8))
    copy.start()
    assert allocation.copying.wait(10)
    closer = threading.Thread(target=allocation.close)
    closer.start()
    closer.join(0.3)
    try:
        # The memory must not be freed under the copy.
        assert closer.is_alive() and log == []
    finally:
        allocation.go.set()
        copy.join(10)
        closer.join(10)
    assert log == ["copied", "released"] and allocation.closed
    with pytest.raises(ValueError, match="closed"):
        getattr(allocation, op)(0, np.ones(1, np.uint8) if op == "write" else 1)


def test_close_on_the_copying_thread_frees_after_the_copy():
    # close() reached on the thread that is copying (a finaliser run by the garbage
    # collector mid-copy) must neither hang nor free the memory under the copy.
    log: list[str] = []
    allocation = _SlowCopy(log)
    allocation.go.set()
    copy_in = allocation._copy_in

    def close_mid_copy(offset, data):
        allocation.close()
        copy_in(offset, data)

    allocation._copy_in = close_mid_copy
    writer = threading.Thread(target=allocation.write, args=(0, np.ones(8, np.uint8)), daemon=True)
    writer.start()
    writer.join(10)
    assert not writer.is_alive(), "close() on the copying thread deadlocked"
    assert log == ["copied", "released"] and allocation.closed


# -- huge pages ------------------------------------------------------------------------


def test_anonymous_mapping_is_aligned_and_faulted_in(monkeypatch):
    monkeypatch.setattr(hugepage, "_PARALLEL_FAULT_BYTES", 0)  # take the threaded path
    nbytes = 8 * hugepage.HUGE_PAGE + 12345
    mapping = hugepage.AnonymousMapping(nbytes, huge=True)
    try:
        assert mapping.address % hugepage.HUGE_PAGE == 0
        assert mapping.length % hugepage.HUGE_PAGE == 0 and mapping.length >= nbytes
        mapping.fault_in(threads=3)
        view = hugepage.host_view(mapping.address, mapping.length)
        assert not view.any()
        view[-1] = 7  # the whole length is mapped and writable
        assert view[-1] == 7
    finally:
        mapping.close()


@pytest.mark.skipif(hugepage.thp_mode() != "madvise", reason="needs THP in madvise mode")
def test_huge_page_share_tells_advised_from_plain_memory():
    size = 16 * hugepage.HUGE_PAGE
    advised = hugepage.AnonymousMapping(size, huge=True)
    plain = hugepage.AnonymousMapping(size, huge=False)
    try:
        advised.fault_in()
        plain.fault_in()
        if hugepage.huge_page_share(advised.address, size) < 1.0:
            advised.collapse()
        assert hugepage.huge_page_share(advised.address, size) > 0.5
        assert hugepage.huge_page_share(plain.address, size) == 0.0
    finally:
        advised.close()
        plain.close()


def test_collapse_is_best_effort():
    mapping = hugepage.AnonymousMapping(2 * hugepage.HUGE_PAGE, huge=True)
    try:
        mapping.fault_in()
        note = mapping.collapse()
        assert note is None or note.startswith("MADV_COLLAPSE")
    finally:
        mapping.close()
    assert hugepage.MADV_COLLAPSE == getattr(mmap, "MADV_COLLAPSE", 25)


def test_hugepage_placement_registers_after_faulting_and_unregisters(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(hugepage._cuda, "require_device", lambda ordinal, what: 0)
    monkeypatch.setattr(hugepage._cuda, "in_context", lambda ordinal: contextlib.nullcontext())

    def register(address, nbytes):
        # Every page is already there when CUDA pins it.
        assert not hugepage.host_view(address, nbytes)[:: hugepage.SMALL_PAGE].any()
        calls.append(("register", address, nbytes))

    monkeypatch.setattr(hugepage._cuda, "host_register", register)
    monkeypatch.setattr(
        hugepage._cuda, "host_unregister", lambda address: calls.append(("unregister", address))
    )
    nbytes = 3 * hugepage.HUGE_PAGE + 100
    with caplog.at_level(logging.INFO, logger="engram_jax.storage"):
        allocation = hugepage.allocate_hugepage(nbytes, 0)
    assert allocation.placement == "hugepage" and allocation.nbytes == nbytes
    assert allocation.address % hugepage.HUGE_PAGE == 0
    assert 0.0 <= allocation.info["huge_page_share"] <= 1.0
    assert calls == [("register", allocation.address, 4 * hugepage.HUGE_PAGE)]
    assert any("in huge pages" in r.getMessage() for r in caplog.records)
    allocation.write(nbytes - 4, np.arange(4, dtype=np.uint8))
    assert allocation.read(nbytes - 4, 4).tolist() == [0, 1, 2, 3]
    allocation.close()
    assert calls[-1] == ("unregister", allocation.address)


def test_thp_mode_reads_the_bracketed_choice():
    assert hugepage.thp_mode() in ("always", "madvise", "never", "absent")


# -- NUMA helpers ------------------------------------------------------------------------


@given(
    nbytes=st.integers(1, 1 << 44),
    granule_shift=st.integers(21, 30),
    chunk=st.one_of(st.none(), st.integers(1, 1 << 33)),
)
def test_chunk_plan_covers_the_request(nbytes, granule_shift, chunk):
    granule = 1 << granule_shift
    sizes = numa.chunk_plan(nbytes, granule, chunk)
    assert all(s > 0 and s % granule == 0 for s in sizes)
    assert nbytes <= sum(sizes) < nbytes + granule
    assert len(sizes) <= numa.MAX_CHUNKS + 1


def test_node_memory_and_reserve(monkeypatch):
    total, available = numa.node_memory(0)
    assert total > 0 and 0 < available <= total
    monkeypatch.delenv(numa.RESERVE_ENV, raising=False)
    assert numa.default_reserve(1000 << 30) == 50 << 30
    assert numa.default_reserve(8 << 30) == 4 << 30
    monkeypatch.setenv(numa.RESERVE_ENV, "1.5")
    assert numa.default_reserve(1000 << 30) == 3 << 29


# -- GPU ---------------------------------------------------------------------------------------

GPU_PLACEMENTS = ["pinned", "hugepage", "numa", "auto", "device"]


def _gpu_lookup(table, ids, device):
    ids = jax.device_put(ids, device)
    return np.asarray(jax.jit(lambda i: lookup(table, i))(ids))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", GPU_PLACEMENTS)
@pytest.mark.parametrize("rows, dim", [(1, 32), (1000, 256), (4097, 96)])
def test_gpu_placement_returns_reference_rows(gpu_device, placement, rows, dim):
    weight, scale = nan_free_table_arrays(rows, dim, seed=rows)
    ids = np.random.default_rng(1).integers(-2, rows + 2, (64, 24)).astype(np.int32)
    expected = testing.lookup_reference(weight, scale, ids)
    with EngramTable.from_arrays(weight, scale, placement=placement, device=gpu_device) as table:
        if placement == "auto":
            assert table.placement in ("numa", "hugepage", "pinned")
        got = _gpu_lookup(table, ids, gpu_device)
        if placement == "hugepage":
            assert 0.0 <= table.allocation.info["huge_page_share"] <= 1.0
    assert got.view(np.uint16).tolist() == expected.view(np.uint16).tolist()


@pytest.mark.gpu
def test_numa_rows_across_chunk_boundaries(gpu_device):
    rows, dim = 40_000, 256  # 10.9 MB in 2 MiB chunks: six boundaries
    weight, scale = nan_free_table_arrays(rows, dim, seed=7)
    stride = row_stride(dim)
    allocation = numa.allocate_numa(rows * stride, 0, chunk_bytes=2 << 20)
    assert allocation.info["chunks"] >= 6
    with EngramTable(allocation, num_rows=rows, dim=dim) as table:
        table.write_rows(0, weight, scale)
        edges = np.array([(k * (2 << 20)) // stride for k in range(1, 6)])
        ids = np.concatenate([edges - 1, edges, edges + 1, [0, rows - 1]]).astype(np.int32)
        ids = ids.reshape(1, -1)
        got = _gpu_lookup(table, ids, gpu_device)
    expected = testing.lookup_reference(weight, scale, ids)
    assert got.view(np.uint16).tolist() == expected.view(np.uint16).tolist()


@pytest.mark.gpu
def test_numa_stops_before_the_reserve_and_releases(gpu_device, monkeypatch):
    node = numa.gpu_numa_node(0)
    total, _ = numa.node_memory(node)
    calls = []

    def shrinking(n):  # room for three 2 MiB chunks, then the node is "full"
        calls.append(n)
        return total, (1 << 40) if len(calls) <= 4 else 0

    released = []
    original = numa.HostNumaMemory._release

    def spy(self, driver):
        released.append((len(self.handles), len(self._mapped)))
        original(self, driver)

    monkeypatch.setattr(numa, "node_memory", shrinking)
    monkeypatch.setattr(numa.HostNumaMemory, "_release", spy)
    with pytest.raises(MemoryError, match=f"NUMA node {node}.*0.01 GiB taken.*reserve.*released"):
        numa.allocate_numa(64 << 20, 0, chunk_bytes=2 << 20, reserve_bytes=1 << 30)
    assert released == [(3, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "hugepage", "numa"])
def test_gpu_load_from_checkpoint(tmp_path, gpu_device, placement):
    weight, scale = nan_free_table_arrays(3000, 256, seed=3)
    path = checkpoint.save_checkpoint(tmp_path / "m.safetensors", {0: (weight, scale)})
    ids = np.arange(0, 3000, 7, dtype=np.int32).reshape(1, -1)
    with checkpoint.load_table(
        path,
        0,
        row_start=1000,
        num_rows=1500,
        placement=placement,
        device=gpu_device,
        progress=False,
    ) as table:
        got = _gpu_lookup(table, ids, gpu_device)
    expected = testing.lookup_reference(weight[1000:2500], scale[1000:2500], ids, 1000)
    assert got.view(np.uint16).tolist() == expected.view(np.uint16).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["fd", "shm", "auto"])
def test_gpu_shared_group_of_one(gpu_device, method):
    weight, scale = nan_free_table_arrays(2000, 256, seed=5)
    nbytes = 2000 * row_stride(256)
    allocation = shared.allocate_shared(
        nbytes, shared.NodeGroup.single(), backend="gpu", method=method, device_ordinal=0
    )
    assert allocation.placement == ("shared_shm" if method == "shm" else "shared_numa")
    with EngramTable(allocation, num_rows=2000, dim=256) as table:
        with allocation.writing() as is_writer:
            assert is_writer
            table.write_rows(0, weight, scale)
        ids = np.arange(-5, 2005, dtype=np.int32).reshape(-1, 10)
        got = _gpu_lookup(table, ids, gpu_device)
    expected = testing.lookup_reference(weight, scale, ids)
    assert got.view(np.uint16).tolist() == expected.view(np.uint16).tolist()
    assert not [n for n in os.listdir(shared.SHM_DIR) if n.startswith(shared.FILE_PREFIX)]


# -- host-NUMA bookkeeping against a stand-in driver (no GPU needed) ------------------


class _FakeDriver:
    """cuda.bindings' cuMem calls with a ledger instead of a GPU; fails where told."""

    def __init__(self, monkeypatch, fail=None):
        from cuda.bindings import driver

        self.d = driver
        self.ok = driver.CUresult.CUDA_SUCCESS
        self.fail = fail or {}
        self.handles: set[int] = set()
        self.mapped: dict[int, int] = {}
        self.reserved: dict[int, int] = {}
        self.access = []
        self.buffers = []
        self.next_handle = 100
        for name in (
            "cuMemGetAllocationGranularity",
            "cuMemCreate",
            "cuMemAddressReserve",
            "cuMemMap",
            "cuMemSetAccess",
            "cuMemUnmap",
            "cuMemRelease",
            "cuMemAddressFree",
            "cuMemExportToShareableHandle",
            "cuMemImportFromShareableHandle",
            "cuGetErrorName",
            "cuGetErrorString",
        ):
            monkeypatch.setattr(driver, name, getattr(self, name))
        monkeypatch.setattr(numa._cuda, "driver", lambda: driver)
        monkeypatch.setattr(numa._cuda, "device_count", lambda: 1)
        monkeypatch.setattr(numa._cuda, "synchronize_active_devices", lambda: None)
        monkeypatch.setattr(numa._cuda, "in_context", lambda ordinal: contextlib.nullcontext())
        monkeypatch.setattr(numa._cuda, "require_device", lambda ordinal, what: 0)
        monkeypatch.setattr(numa._cuda, "device_attribute", lambda ordinal, name: 1)
        monkeypatch.setattr(numa, "gpu_numa_node", lambda ordinal: 0)

    def _result(self, name, *values):
        if name in self.fail:
            self.fail[name] -= 1
            if self.fail[name] < 0:
                return (self.d.CUresult.CUDA_ERROR_INVALID_VALUE, *([None] * len(values)))
        return (self.ok, *values)

    def cuGetErrorName(self, err):
        return self.ok, err.name.encode()

    def cuGetErrorString(self, err):
        return self.ok, b"stand-in failure"

    def cuMemGetAllocationGranularity(self, prop, option):
        assert prop.location.type == self.d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
        return self.ok, 2 << 20

    def cuMemCreate(self, size, prop, flags):
        fabric = self.d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
        if prop is not None and prop.requestedHandleTypes == fabric:
            return self.d.CUresult.CUDA_ERROR_NOT_PERMITTED, None  # as on the reference machine
        result = self._result("cuMemCreate", self.next_handle)
        if result[0] == self.ok:
            self.handles.add(self.next_handle)
            self.next_handle += 1
        return result

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        buffer = np.zeros(size + alignment, np.uint8)  # real memory, so host views work
        self.buffers.append(buffer)
        address = buffer.ctypes.data + (-buffer.ctypes.data) % alignment
        self.reserved[address] = size
        return self.ok, address

    def cuMemMap(self, ptr, size, offset, handle, flags):
        result = self._result("cuMemMap")
        if result[0] == self.ok:
            assert handle in self.handles and ptr not in self.mapped
            self.mapped[ptr] = size
        return result

    def cuMemSetAccess(self, ptr, size, descs, count):
        self.access.append([(int(d.location.type), d.location.id) for d in descs])
        return (self.ok,)

    def cuMemUnmap(self, ptr, size):
        assert self.mapped.pop(ptr) == size
        return (self.ok,)

    def cuMemRelease(self, handle):
        self.handles.remove(handle)
        return (self.ok,)

    def cuMemAddressFree(self, ptr, size):
        assert self.reserved.pop(ptr) == size
        return (self.ok,)

    def cuMemExportToShareableHandle(self, handle, kind, flags):
        return self.ok, os.open(os.devnull, os.O_RDONLY)

    def cuMemImportFromShareableHandle(self, fd, kind):
        os.fstat(fd)  # a live fd
        return self.cuMemCreate(0, None, 0)

    def empty(self) -> bool:
        return not (self.handles or self.mapped or self.reserved)


def test_numa_chunks_are_mapped_back_to_back_and_released(monkeypatch):
    fake = _FakeDriver(monkeypatch)
    allocation = numa.allocate_numa(9 << 20, 0, chunk_bytes=4 << 20, reserve_bytes=0)
    assert allocation.placement == "numa" and allocation.info["chunks"] == 3
    assert sorted(s for s in fake.mapped.values()) == [2 << 20, 4 << 20, 4 << 20]
    starts = sorted(fake.mapped)
    assert starts[0] == allocation.address and starts[1] - starts[0] == 4 << 20
    assert len(fake.access) == 1 and len(fake.access[0]) == 2  # the GPU and the host node
    allocation.write((9 << 20) - 3, np.ones(3, np.uint8))
    allocation.close()
    assert fake.empty()


@pytest.mark.parametrize("failing", [{"cuMemCreate": 2}, {"cuMemMap": 1}])
def test_numa_failure_mid_way_releases_everything(monkeypatch, failing):
    fake = _FakeDriver(monkeypatch, fail=dict(failing))
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_VALUE"):
        numa.allocate_numa(16 << 20, 0, chunk_bytes=4 << 20, reserve_bytes=0)
    assert fake.empty()


def test_numa_reserve_stops_allocation_and_releases(monkeypatch):
    fake = _FakeDriver(monkeypatch)
    budget = iter([1 << 40, 1 << 40, 1 << 40, 0, 0])  # total, then room for two chunks
    monkeypatch.setattr(numa, "node_memory", lambda node: (1 << 40, next(budget)))
    with pytest.raises(MemoryError, match=r"NUMA node 0 does not fit: 0.01 GiB taken.*released"):
        numa.allocate_numa(32 << 20, 0, chunk_bytes=4 << 20, reserve_bytes=1 << 20)
    assert fake.empty()


def test_numa_fd_export_and_import_bookkeeping(monkeypatch):
    fake = _FakeDriver(monkeypatch)
    owner = numa.HostNumaMemory.create(
        10 << 20, ordinal=0, handle=numa.HANDLE_FD, chunk_bytes=4 << 20, reserve_bytes=0
    )
    fds = owner.export_fds()
    peer = numa.HostNumaMemory.import_fds(fds, owner.sizes, ordinal=0, node=0)
    for fd in fds:  # the import closed every fd it was given
        with pytest.raises(OSError):
            os.fstat(fd)
    assert peer.sizes == owner.sizes and peer.address != owner.address
    peer.close()
    owner.close()
    assert fake.empty()


def test_numa_import_failure_closes_the_remaining_fds(monkeypatch):
    fake = _FakeDriver(monkeypatch)
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(4)]
    fake.fail["cuMemCreate"] = 1  # the second import fails
    with pytest.raises(RuntimeError, match="cuMemImportFromShareableHandle"):
        numa.HostNumaMemory.import_fds(fds, [2 << 20] * 4, ordinal=0, node=0)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert fake.empty()


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_bad_reserve_setting_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(numa.RESERVE_ENV, value)
    with pytest.raises(ValueError, match=numa.RESERVE_ENV):
        numa.default_reserve(1000 << 30)


# -- device ordinals are checked before CUDA is touched --------------------------------


def _no_cuda(monkeypatch):
    def refuse():
        raise AssertionError("a CUDA call was made before the ordinal was checked")

    monkeypatch.setattr(_cuda, "_runtime", refuse)
    monkeypatch.setattr(_cuda, "_driver", refuse)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize(
    "ordinal, error",
    [(-1, ValueError), (1.0, TypeError), ("0", TypeError), (True, TypeError), ([0], TypeError)],
)
def test_malformed_device_ordinal_is_refused_before_any_cuda_call(
    monkeypatch, placement, ordinal, error
):
    _no_cuda(monkeypatch)
    with pytest.raises(error, match="device_ordinal"):
        allocate(placement, 4096, ordinal)


@pytest.mark.parametrize("ordinal, error", [(-2, ValueError), (0.5, TypeError), ("1", TypeError)])
def test_device_placement_checks_its_ordinal_itself(monkeypatch, ordinal, error):
    # Called directly, not through allocate(): the placement must not hand it to cudaSetDevice.
    _no_cuda(monkeypatch)
    with pytest.raises(error, match="device_ordinal"):
        PLACEMENTS["device"](4096, ordinal)


def test_numpy_ordinals_are_plain_ints():
    assert _cuda.check_ordinal(None) is None
    for value in (np.int64(3), np.uint8(3), 3):
        checked = _cuda.check_ordinal(value)
        assert checked == 3 and type(checked) is int


def test_table_device_argument_is_checked():
    weight, scale = nan_free_table_arrays(2, 32)
    # A numpy int is an ordinal (the cpu placement ignores it), not a jax device.
    with EngramTable.from_arrays(weight, scale, device=np.int64(0)) as table:
        assert table.placement == "cpu"
    with pytest.raises(TypeError, match="jax.Device, an int CUDA ordinal or None"):
        EngramTable.allocate(2, 32, device="gpu:0")
    with pytest.raises(ValueError, match="device must be >= 0"):
        EngramTable.allocate(2, 32, device=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "pinned", "hugepage", "numa", "auto"])
def test_device_ordinal_past_the_visible_gpus_is_a_value_error(placement):
    count = _cuda.device_count()
    with pytest.raises(ValueError, match="out of range"):
        allocate(placement, 4096, count)
    with pytest.raises(ValueError, match="out of range"):
        EngramTable.allocate(1, 32, placement=placement, device=count)


# -- a failure after the memory is mapped leaks nothing --------------------------------


@pytest.mark.parametrize("failing", ["register", "view", "allocation"])
def test_hugepage_failure_after_mmap_unregisters_and_unmaps(monkeypatch, failing):
    calls, mappings = [], []
    nbytes = 2 * hugepage.HUGE_PAGE + 10

    class Mapping(hugepage.AnonymousMapping):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            mappings.append(self)

    def register(address, size):
        if failing == "register":
            raise RuntimeError("cudaHostRegister failed")
        calls.append("register")

    real_view = hugepage.host_view

    def view(address, size):
        if failing == "view" and size == nbytes:  # the table's view, not fault_in's
            raise MemoryError("no view")
        return real_view(address, size)

    def allocation(**kwargs):
        raise RuntimeError("Allocation failed")

    monkeypatch.setattr(hugepage, "AnonymousMapping", Mapping)
    monkeypatch.setattr(hugepage._cuda, "require_device", lambda ordinal, what: 0)
    monkeypatch.setattr(hugepage._cuda, "in_context", lambda ordinal: contextlib.nullcontext())
    monkeypatch.setattr(hugepage._cuda, "host_register", register)
    monkeypatch.setattr(hugepage._cuda, "host_unregister", lambda address: calls.append("unreg"))
    monkeypatch.setattr(hugepage, "host_view", view)
    if failing == "allocation":
        monkeypatch.setattr(hugepage, "Allocation", allocation)
    with pytest.raises((RuntimeError, MemoryError)):
        hugepage.allocate_hugepage(nbytes, 0)
    assert len(mappings) == 1 and mappings[0]._mmap.closed
    # Unregistered exactly when it had been registered.
    assert calls == ([] if failing == "register" else ["register", "unreg"])


@pytest.mark.parametrize("failing", ["view", "allocation"])
def test_numa_failure_after_mapping_releases_everything(monkeypatch, failing):
    fake = _FakeDriver(monkeypatch)

    def fail(*args, **kwargs):
        raise MemoryError(f"{failing} failed")

    monkeypatch.setattr(numa, "host_view" if failing == "view" else "Allocation", fail)
    with pytest.raises(MemoryError, match=f"{failing} failed"):
        numa.allocate_numa(6 << 20, 0, chunk_bytes=4 << 20, reserve_bytes=0)
    assert fake.empty()


def test_auto_falls_back_when_numa_cannot_hold_the_table(monkeypatch, caplog):
    from engram_jax.storage import placements

    def node_full(nbytes, ordinal=None):
        raise MemoryError("node 0 has 1.0 GiB available")

    monkeypatch.setattr(placements, "choose_auto", lambda ordinal=None: ("numa", "test"))
    monkeypatch.setattr(placements, "thp_mode", lambda: "never")
    monkeypatch.setitem(placements.PLACEMENTS, "numa", node_full)
    monkeypatch.setitem(placements.PLACEMENTS, "pinned", placements.allocate_cpu)
    with caplog.at_level(logging.WARNING, logger=placements.log.name):
        allocation = placements.allocate_auto(4096)
    try:
        assert allocation.nbytes == 4096
        assert "numa could not hold it" in allocation.info["auto_reason"]
        assert "pinned instead" in caplog.text
    finally:
        allocation.close()
    # Any other placement's out-of-memory error is the caller's to see.
    monkeypatch.setattr(placements, "choose_auto", lambda ordinal=None: ("pinned", "test"))
    monkeypatch.setitem(placements.PLACEMENTS, "pinned", node_full)
    with pytest.raises(MemoryError, match="node 0"):
        placements.allocate_auto(4096)
