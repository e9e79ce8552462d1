"""The basic placements: plain CPU memory, pinned (page-locked, mapped) host
memory read by GPUs over PCIe, and device memory (HBM).

Each is a function ``(nbytes, device_ordinal) -> Allocation``, looked up by
name in :data:`PLACEMENTS`, so further placements slot in beside them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engram_jax.storage import _cuda
from engram_jax.storage.base import Allocation, MemoryKind, host_view

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
    ordinal = 0 if device_ordinal is None else int(device_ordinal)
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


PLACEMENTS: dict[str, Callable[[int, int | None], Allocation]] = {
    "cpu": allocate_cpu,
    "pinned": allocate_pinned,
    "device": allocate_device,
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
    return factory(nbytes, device_ordinal)
