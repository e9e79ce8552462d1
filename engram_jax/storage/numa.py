"""Host memory on the GPU's NUMA node through CUDA's virtual memory API.

``cuMemCreate`` with location ``HOST_NUMA`` allocates page-locked host memory
on one NUMA node (2 MiB granularity); chunks are mapped side by side into one
reserved address range and made readable and writable by the GPUs and the
CPU. Taking memory in chunks lets the allocation stop, cleanly, before the
node runs out, and the chunks' handles can be exported to other processes
(POSIX file descriptors, or FABRIC handles where the driver permits them).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

from engram_jax.storage import _cuda
from engram_jax.storage.base import Allocation, MemoryKind, host_view, round_up

log = logging.getLogger(__name__)

GIB = 1 << 30
MIN_GRANULE = 2 << 20
DEFAULT_CHUNK_BYTES = 1 << 30
# More handles than this would make fd passing slow; chunks grow instead.
MAX_CHUNKS = 512
RESERVE_ENV = "ENGRAM_JAX_NUMA_RESERVE_GIB"

HANDLE_NONE = "none"
HANDLE_FD = "fd"
HANDLE_FABRIC = "fabric"


# -- NUMA facts -------------------------------------------------------------


def gpu_numa_node(ordinal: int) -> int:
    """The host NUMA node nearest GPU ``ordinal`` (0 where the machine has no NUMA)."""
    try:
        node = _cuda.device_attribute(ordinal, "HOST_NUMA_ID")
    except (AttributeError, RuntimeError):
        node = -1
    if node < 0:
        node = _sysfs_numa_node(ordinal)
    return max(0, node)


def _sysfs_numa_node(ordinal: int) -> int:
    rt = _cuda.runtime()
    try:
        bus_id = _cuda.check(rt.cudaDeviceGetPCIBusId(32, ordinal), "cudaDeviceGetPCIBusId")
    except RuntimeError:
        return -1
    bus_id = (bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)).strip("\0").lower()
    try:
        with open(f"/sys/bus/pci/devices/{bus_id}/numa_node") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def _meminfo(path: str, prefix: str = "") -> dict[str, int]:
    values = {}
    with open(path) as f:
        for line in f:
            line = line[len(prefix) :] if prefix and line.startswith(prefix) else line
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                scale = 1024 if len(fields) > 1 and fields[1] == "kB" else 1
                values[key.strip()] = int(fields[0]) * scale
    return values


def node_memory(node: int) -> tuple[int, int]:
    """(total, available) bytes of NUMA node ``node``.

    Available counts free pages plus page cache the kernel can drop (file
    pages that are not shmem) and reclaimable slab: what pinning can still take.
    Falls back to /proc/meminfo where the node has no sysfs entry.
    """
    path = f"/sys/devices/system/node/node{node}/meminfo"
    if os.path.exists(path):
        info = _meminfo(path, prefix=f"Node {node} ")
        available = (
            info.get("MemFree", 0)
            + max(0, info.get("FilePages", 0) - info.get("Shmem", 0))
            + info.get("SReclaimable", info.get("KReclaimable", 0))
        )
        return info.get("MemTotal", 0), available
    info = _meminfo("/proc/meminfo")
    return info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))


def default_reserve(total: int) -> int:
    """Bytes a node keeps free: ENGRAM_JAX_NUMA_RESERVE_GIB, else max(4 GiB, 5 % of the node)."""
    env = os.environ.get(RESERVE_ENV)
    if env:
        try:
            gib = float(env)
        except ValueError:
            gib = -1.0
        if not gib >= 0:  # also catches nan
            raise ValueError(f"{RESERVE_ENV} must be a number of GiB >= 0, got {env!r}")
        return int(gib * GIB)
    return max(4 * GIB, total // 20)


# -- cuMem host-NUMA memory ---------------------------------------------------


def _handle_type(driver, kind: str):
    types = driver.CUmemAllocationHandleType
    return {
        HANDLE_NONE: types.CU_MEM_HANDLE_TYPE_NONE,
        HANDLE_FD: types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        HANDLE_FABRIC: types.CU_MEM_HANDLE_TYPE_FABRIC,
    }[kind]


def _prop(driver, node: int, handle: str):
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    prop.location.id = node
    prop.requestedHandleTypes = _handle_type(driver, handle)
    return prop


def granularity(node: int, handle: str = HANDLE_NONE) -> int:
    """cuMem's recommended granularity for host-NUMA memory, at least 2 MiB."""
    driver = _cuda.driver()
    flags = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    value = _cuda.check(
        driver.cuMemGetAllocationGranularity(_prop(driver, node, handle), flags),
        "cuMemGetAllocationGranularity",
    )
    return max(MIN_GRANULE, int(value))


def chunk_plan(nbytes: int, granule: int, chunk_bytes: int | None = None) -> list[int]:
    """Chunk sizes (multiples of ``granule``) that together cover ``nbytes``."""
    total = round_up(max(nbytes, 1), granule)
    chunk = round_up(chunk_bytes or DEFAULT_CHUNK_BYTES, granule)
    chunk = max(chunk, round_up(-(-total // MAX_CHUNKS), granule))
    sizes = [chunk] * (total // chunk)
    if total % chunk:
        sizes.append(total % chunk)
    return sizes


def _access_descs(driver, devices: Sequence[int], node: int) -> list:
    flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    descs = []
    for ordinal in devices:
        desc = driver.CUmemAccessDesc()
        desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = flags
        descs.append(desc)
    host = driver.CUmemAccessDesc()
    host.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
    host.location.id = node
    host.flags = flags
    descs.append(host)
    return descs


class HostNumaMemory:
    """cuMem host-NUMA chunks mapped contiguously at ``address`` in this process.

    Built by :meth:`create` (the owner) or :meth:`import_fds` /
    :meth:`import_fabric` (a peer). :meth:`close` unmaps, releases the handles
    and frees the address range; it is what every error path calls too, and it
    tolerates a half-built object.
    """

    def __init__(self, node: int, ordinal: int, handle: str) -> None:
        self.node = node
        self.ordinal = ordinal
        self.handle_kind = handle
        self.address = 0
        self.total = 0
        self.sizes: list[int] = []
        self.handles: list = []
        self._mapped: list[tuple[int, int]] = []
        self.devices: tuple[int, ...] = ()
        self._closed = False

    # -- building ---------------------------------------------------------

    @classmethod
    def create(
        cls,
        nbytes: int,
        *,
        ordinal: int,
        node: int | None = None,
        handle: str = HANDLE_NONE,
        chunk_bytes: int | None = None,
        reserve_bytes: int | None = None,
    ) -> HostNumaMemory:
        """Allocate ``nbytes`` (rounded up to the granularity) on ``node``, chunk by chunk.

        Before each chunk the node's available memory is checked: if taking it
        would leave less than ``reserve_bytes``, everything taken so far is
        released and :class:`MemoryError` says how much was asked, free and reserved.
        """
        driver = _cuda.driver()
        node = gpu_numa_node(ordinal) if node is None else node
        total_mem, _ = node_memory(node)
        reserve = default_reserve(total_mem) if reserve_bytes is None else int(reserve_bytes)
        self = cls(node, ordinal, handle)
        try:
            granule = granularity(node, handle)
            sizes = chunk_plan(nbytes, granule, chunk_bytes)
            prop = _prop(driver, node, handle)
            taken = 0
            for size in sizes:
                _, available = node_memory(node)
                if available - size < reserve:
                    raise MemoryError(
                        f"numa placement: {nbytes / GIB:.2f} GiB on NUMA node {node} does not fit: "
                        f"{taken / GIB:.2f} GiB taken, {available / GIB:.2f} GiB still available, "
                        f"the next {size / GIB:.2f} GiB chunk would leave less than the "
                        f"{reserve / GIB:.2f} GiB reserve (set {RESERVE_ENV} to change it); "
                        "everything taken was released"
                    )
                try:
                    handle_value = _cuda.check(driver.cuMemCreate(size, prop, 0), "cuMemCreate")
                except _cuda.CudaCallError as exc:
                    if exc.name == "CUDA_ERROR_OUT_OF_MEMORY":
                        raise MemoryError(
                            f"numa placement: cuMemCreate of a {size / GIB:.2f} GiB chunk on NUMA "
                            f"node {node} ran out of memory after {taken / GIB:.2f} GiB; "
                            "everything taken was released"
                        ) from exc
                    raise
                self.handles.append(handle_value)
                self.sizes.append(size)
                taken += size
            self._map(granule)
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def import_fds(
        cls, fds: Sequence[int], sizes: Sequence[int], *, ordinal: int, node: int
    ) -> HostNumaMemory:
        """Map chunks exported as POSIX fds by another process; closes the fds."""
        driver = _cuda.driver()
        kind = _handle_type(driver, HANDLE_FD)
        self = cls(node, ordinal, HANDLE_FD)
        try:
            for i, fd in enumerate(fds):
                try:
                    handle_value = _cuda.check(
                        driver.cuMemImportFromShareableHandle(fd, kind),
                        "cuMemImportFromShareableHandle(POSIX fd)",
                    )
                finally:
                    # The imported handle holds its own reference to the memory.
                    os.close(fd)
                self.handles.append(handle_value)
                self.sizes.append(int(sizes[i]))
            self._map(granularity(node, HANDLE_FD))
        except BaseException:
            for fd in fds[len(self.handles) + 1 :]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.close()
            raise
        return self

    @classmethod
    def import_fabric(
        cls, blobs: Sequence[bytes], sizes: Sequence[int], *, ordinal: int, node: int
    ) -> HostNumaMemory:
        """Map chunks exported as FABRIC handles (64-byte blobs) by another process."""
        driver = _cuda.driver()
        kind = _handle_type(driver, HANDLE_FABRIC)
        self = cls(node, ordinal, HANDLE_FABRIC)
        try:
            for blob, size in zip(blobs, sizes, strict=True):
                fabric = driver.CUmemFabricHandle()
                fabric.data = bytes(blob)
                self.handles.append(
                    _cuda.check(
                        driver.cuMemImportFromShareableHandle(fabric, kind),
                        "cuMemImportFromShareableHandle(FABRIC)",
                    )
                )
                self.sizes.append(int(size))
            self._map(granularity(node, HANDLE_FABRIC))
        except BaseException:
            self.close()
            raise
        return self

    def _map(self, granule: int) -> None:
        driver = _cuda.driver()
        self.total = sum(self.sizes)
        self.address = int(
            _cuda.check(
                driver.cuMemAddressReserve(self.total, granule, 0, 0), "cuMemAddressReserve"
            )
        )
        offset = 0
        for handle_value, size in zip(self.handles, self.sizes, strict=True):
            _cuda.check(
                driver.cuMemMap(self.address + offset, size, 0, handle_value, 0), "cuMemMap"
            )
            self._mapped.append((self.address + offset, size))
            offset += size
        devices = list(range(_cuda.device_count()))
        try:
            descs = _access_descs(driver, devices, self.node)
            _cuda.check(
                driver.cuMemSetAccess(self.address, self.total, descs, len(descs)),
                "cuMemSetAccess(all GPUs + host)",
            )
        except _cuda.CudaCallError:
            # Some GPU of the process may not reach this node; the table's GPU must.
            devices = [self.ordinal]
            descs = _access_descs(driver, devices, self.node)
            _cuda.check(
                driver.cuMemSetAccess(self.address, self.total, descs, len(descs)),
                f"cuMemSetAccess(GPU {self.ordinal} + host)",
            )
        self.devices = tuple(devices)

    # -- sharing ----------------------------------------------------------

    def export_fds(self) -> list[int]:
        """One new POSIX fd per chunk; the caller closes them once sent."""
        driver = _cuda.driver()
        kind = _handle_type(driver, HANDLE_FD)
        fds: list[int] = []
        try:
            for handle_value in self.handles:
                fd = _cuda.check(
                    driver.cuMemExportToShareableHandle(handle_value, kind, 0),
                    "cuMemExportToShareableHandle(POSIX fd)",
                )
                fds.append(int(fd))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def export_fabric(self) -> list[bytes]:
        """One 64-byte FABRIC handle per chunk."""
        driver = _cuda.driver()
        kind = _handle_type(driver, HANDLE_FABRIC)
        return [
            bytes(
                _cuda.check(
                    driver.cuMemExportToShareableHandle(handle_value, kind, 0),
                    "cuMemExportToShareableHandle(FABRIC)",
                ).data
            )
            for handle_value in self.handles
        ]

    # -- lifetime ---------------------------------------------------------

    def close(self) -> None:
        """Unmap, release every handle and free the address range (idempotent)."""
        if self._closed:
            return
        self._closed = True
        driver = _cuda.driver()
        if self._mapped:
            _cuda.synchronize_active_devices()
        with contextlib.ExitStack() as stack:
            with contextlib.suppress(Exception):  # CUDA shutting down: no context to be had
                stack.enter_context(_cuda.in_context(self.ordinal))
            self._release(driver)

    def _release(self, driver) -> None:
        errors = []
        for address, size in reversed(self._mapped):
            errors.append(driver.cuMemUnmap(address, size))
        self._mapped.clear()
        for handle_value in self.handles:
            errors.append(driver.cuMemRelease(handle_value))
        self.handles.clear()
        if self.address:
            errors.append(driver.cuMemAddressFree(self.address, self.total))
            self.address = 0
        for result in errors:
            _cuda.check(result, "releasing host-NUMA memory")


def allocate_numa(
    nbytes: int,
    device_ordinal: int | None = None,
    *,
    chunk_bytes: int | None = None,
    reserve_bytes: int | None = None,
) -> Allocation:
    """Page-locked memory on the GPU's NUMA node, readable by the GPUs and the CPU."""
    ordinal = _cuda.require_device(device_ordinal, "numa")
    memory = None
    # Once create() returns the memory is mapped: any later failure (leaving the
    # context, the view, the Allocation) frees it before raising.
    try:
        with _cuda.in_context(ordinal):
            if not _cuda.device_attribute(ordinal, "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
                raise _cuda.CudaUnavailableError(
                    f"GPU {ordinal} does not support cuMem host-NUMA allocations "
                    "(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)"
                )
            memory = HostNumaMemory.create(
                nbytes, ordinal=ordinal, chunk_bytes=chunk_bytes, reserve_bytes=reserve_bytes
            )
        allocation = Allocation(
            placement="numa",
            address=memory.address,
            nbytes=nbytes,
            kind=MemoryKind.HOST_MAPPED,
            release=memory.close,
            host_array=host_view(memory.address, nbytes),
            # Readable from every GPU of the process, unless some GPU was refused access.
            device_ordinal=None if len(memory.devices) == _cuda.device_count() else ordinal,
            info={"numa_node": memory.node, "chunks": len(memory.sizes)},
        )
    except BaseException:
        if memory is not None:
            memory.close()
        raise
    log.info(
        "numa: %.2f GiB on NUMA node %d in %d chunk(s), GPUs %s",
        nbytes / GIB,
        memory.node,
        len(memory.sizes),
        list(memory.devices),
    )
    return allocation
