"""Placements: plain CPU memory, pinned (page-locked, mapped) host memory read
by GPUs over PCIe, huge-page and NUMA-local host memory (their own modules),
device memory (HBM), and ``auto``, which picks the best that works here.

Each is a function ``(nbytes, device_ordinal) -> Allocation``, looked up by
name in :data:`PLACEMENTS`, so further placements slot in beside them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from engram_jax.storage import _cuda
from engram_jax.storage.base import Allocation, MemoryKind, host_view
from engram_jax.storage.hugepage import allocate_hugepage, thp_mode
from engram_jax.storage.numa import allocate_numa

log = logging.getLogger(__name__)

_ALIGN = 4096


def allocate_cpu(nbytes: int, device_ordinal: int | None = None) -> Allocation:
    """Plain host memory for the CPU backend, page aligned, not initialised."""
    backing = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-backing.ctypes.data) % _ALIGN
    view = backing[start : start + nbytes]

    def release() -> None:
        nonlocal backing
        backing = None  # numpy frees it once the last view is gone

    return Allocation(
        placement="cpu",
        address=view.ctypes.data,
        nbytes=nbytes,
        kind=MemoryKind.HOST,
        release=release,
        host_array=view,
    )


def allocate_pinned(nbytes: int, device_ordinal: int | None = None) -> Allocation:
    """cudaHostAlloc'ed memory, portable and mapped: every GPU reads it in place.

    Not initialised: the table writes every byte it will read.
    """
    # Portable memory needs no particular GPU, but an ordinal past them is a caller's bug.
    _cuda.require_device(device_ordinal, "pinned")
    rt = _cuda.runtime()
    flags = rt.cudaHostAllocPortable | rt.cudaHostAllocMapped
    address = int(_cuda.check(rt.cudaHostAlloc(max(nbytes, 1), flags), "cudaHostAlloc"))

    def release() -> None:
        _cuda.synchronize_active_devices()
        _cuda.check(rt.cudaFreeHost(address), "cudaFreeHost")

    try:
        view = host_view(address, nbytes)
    except BaseException:
        release()
        raise
    return Allocation(
        placement="pinned",
        address=address,
        nbytes=nbytes,
        kind=MemoryKind.HOST_MAPPED,
        release=release,
        host_array=view,
    )


class DeviceAllocation(Allocation):
    """cudaMalloc'ed memory on one GPU, written and read through cudaMemcpy."""

    def _copy_in(self, offset: int, data: np.ndarray) -> None:
        rt = _cuda.runtime()
        with _cuda.on_device(self.device_ordinal):
            _cuda.check(
                rt.cudaMemcpy(
                    self.address + offset,
                    data.ctypes.data,
                    data.nbytes,
                    rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
                ),
                "cudaMemcpy host to device",
            )

    def _copy_out(self, offset: int, nbytes: int) -> np.ndarray:
        rt = _cuda.runtime()
        out = np.empty(nbytes, dtype=np.uint8)
        with _cuda.on_device(self.device_ordinal):
            _cuda.check(
                rt.cudaMemcpy(
                    out.ctypes.data,
                    self.address + offset,
                    nbytes,
                    rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                ),
                "cudaMemcpy device to host",
            )
        return out


def allocate_device(nbytes: int, device_ordinal: int | None = None) -> Allocation:
    """cudaMalloc'ed memory on GPU ``device_ordinal`` (default 0), not initialised."""
    # Checked here, not by cudaSetDevice: a bad ordinal is a ValueError naming the argument.
    ordinal = _cuda.require_device(device_ordinal, "device")
    rt = _cuda.runtime()
    with _cuda.on_device(ordinal):
        address = int(_cuda.check(rt.cudaMalloc(max(nbytes, 1)), "cudaMalloc"))

    def release() -> None:
        _cuda.synchronize_active_devices()
        with _cuda.on_device(ordinal):
            _cuda.check(rt.cudaFree(address), "cudaFree")

    return DeviceAllocation(
        placement="device",
        address=address,
        nbytes=nbytes,
        kind=MemoryKind.DEVICE,
        release=release,
        device_ordinal=ordinal,
    )


def choose_auto(device_ordinal: int | None = None) -> tuple[str, str]:
    """The placement ``auto`` takes here, and why.

    With a GPU: ``numa`` where the driver supports cuMem host-NUMA memory (on
    the GPU's node, allocated in chunks that stop before the node runs out),
    else ``hugepage`` where transparent huge pages can be asked for, else
    ``pinned``. Without one: ``cpu``. The lookup rate measured the same for all
    three GPU placements on the reference machine, so this ranks by what else
    each gives (locality, a clean out-of-memory error, fewer page-table entries).
    """
    try:
        ordinal = _cuda.require_device(device_ordinal, "auto")
    except _cuda.CudaUnavailableError:
        return "cpu", "no CUDA GPU is visible, so plain host memory for the CPU backend"
    try:
        numa_ok = _cuda.device_attribute(ordinal, "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")
    except (RuntimeError, AttributeError) as exc:
        numa_ok, numa_why = 0, f"the query failed ({exc})"
    else:
        numa_why = "the driver reports no cuMem host-NUMA support"
    if numa_ok:
        return "numa", (
            f"GPU {ordinal} supports cuMem host-NUMA memory: page-locked on its own NUMA node, "
            "allocated in chunks with a reserve check"
        )
    mode = thp_mode()
    if mode in ("always", "madvise"):
        return "hugepage", f"no numa ({numa_why}); transparent huge pages are '{mode}'"
    return "pinned", f"no numa ({numa_why}) and transparent huge pages are '{mode}'"


def allocate_auto(nbytes: int, device_ordinal: int | None = None) -> Allocation:
    """The placement :func:`choose_auto` picks, with one log line saying which and why.

    ``numa`` refuses a table its GPU's node cannot hold (keeping a reserve);
    ``auto`` then takes ``hugepage`` or ``pinned``, whose pages may come from
    any node, with a warning, rather than failing while the machine has memory.
    """
    choice, why = choose_auto(device_ordinal)
    log.info("placement auto -> %s: %s", choice, why)
    try:
        allocation = PLACEMENTS[choice](nbytes, device_ordinal)
    except MemoryError as exc:
        if choice != "numa":
            raise
        fallback = "hugepage" if thp_mode() in ("always", "madvise") else "pinned"
        why = f"numa could not hold it on the GPU's node ({exc}); {fallback} instead"
        log.warning("placement auto -> %s: %s", fallback, why)
        allocation = PLACEMENTS[fallback](nbytes, device_ordinal)
    allocation.info.setdefault("auto_reason", why)
    return allocation


PLACEMENTS: dict[str, Callable[[int, int | None], Allocation]] = {
    "cpu": allocate_cpu,
    "pinned": allocate_pinned,
    "hugepage": allocate_hugepage,
    "numa": allocate_numa,
    "device": allocate_device,
    "auto": allocate_auto,
}


def allocate(placement: str, nbytes: int, device_ordinal: int | None = None) -> Allocation:
    """Allocate ``nbytes`` with the named placement."""
    try:
        factory = PLACEMENTS[placement]
    except KeyError:
        raise ValueError(
            f"unknown placement {placement!r}; choose one of {sorted(PLACEMENTS)}"
        ) from None
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    # Every placement, even those that ignore it, refuses a malformed ordinal.
    return factory(nbytes, _cuda.check_ordinal(device_ordinal))
