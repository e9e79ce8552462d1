"""Raw memory that holds a table's bytes, independent of what the bytes mean.

An :class:`Allocation` is an address, a size, which processors can read it,
and a way to free it. Placements (``cpu``, ``pinned``, ``device``, ...) are
functions that return one; :mod:`engram_jax.table` lays rows into it.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import threading
from collections.abc import Callable, Iterator

import numpy as np

from engram_jax import _native

# Who can read the memory: the native registry's enum (ffi/table_registry.h), by name.
# HOST: plain host memory, the CPU backend only; HOST_MAPPED: page-locked host
# memory mapped for every GPU, CPU and CUDA; DEVICE: one GPU's memory, the CUDA
# backend of that device only.
MemoryKind = enum.IntEnum(
    "MemoryKind",
    {name.upper(): code for name, code in _native.native.memory_kinds.items()},
    module=__name__,
)


class Allocation:
    """One block of memory and its release.

    ``host_array`` is a writable uint8 numpy view when the CPU can address the
    memory directly, else ``None`` (device memory is written through
    :meth:`write`). ``device_ordinal`` is the CUDA ordinal of the one GPU that
    can read the memory (device memory, or host memory a GPU alone could be
    given access to), else ``None`` (readable from every device of the process).
    """

    def __init__(
        self,
        *,
        placement: str,
        address: int,
        nbytes: int,
        kind: MemoryKind,
        release: Callable[[], None],
        host_array: np.ndarray | None = None,
        device_ordinal: int | None = None,
        info: dict | None = None,
    ) -> None:
        self.placement = placement
        self.address = int(address)
        self.nbytes = int(nbytes)
        self.kind = kind
        self.device_ordinal = device_ordinal
        self.info = dict(info or {})
        self._host_array = host_array
        self._release = release
        # Held by copies and close, so memory is never freed under a copy; re-entrant,
        # so a close reached on the copying thread itself (a finaliser) cannot deadlock.
        self._lock = threading.RLock()
        self._copies = 0  # copies in progress (on the lock's holder, hence one thread)
        self._release_pending = False
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def host_array(self) -> np.ndarray | None:
        if self._closed:
            raise ValueError(f"{self.placement} allocation is closed")
        return self._host_array

    def write(self, offset: int, data: np.ndarray) -> None:
        """Copy ``data``'s bytes to ``offset``; bounds are checked.

        A :meth:`close` from another thread waits until the copy is done.
        """
        data = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        with self._copying():
            self._check_range(offset, data.nbytes)
            host = self._host_array
            if host is not None:
                host[offset : offset + data.nbytes] = data
            else:
                self._copy_in(offset, data)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """A copy of ``nbytes`` bytes from ``offset`` (a concurrent :meth:`close` waits)."""
        with self._copying():
            self._check_range(offset, nbytes)
            host = self._host_array
            if host is not None:
                return host[offset : offset + nbytes].copy()
            return self._copy_out(offset, nbytes)

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """Hold the memory for one copy; a close on this thread meanwhile frees it after."""
        with self._lock:
            self._copies += 1
            try:
                yield
            finally:
                self._copies -= 1
                if not self._copies and self._release_pending:
                    self._release_pending = False
                    self._release()

    def _check_range(self, offset: int, nbytes: int) -> None:
        if self._closed:
            raise ValueError(f"{self.placement} allocation is closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) is outside the {self.nbytes}-byte allocation"
            )

    def _copy_in(self, offset: int, data: np.ndarray) -> None:  # pragma: no cover - device only
        raise NotImplementedError(f"{self.placement} memory is not host-addressable")

    def _copy_out(self, offset: int, nbytes: int) -> np.ndarray:  # pragma: no cover - device only
        raise NotImplementedError(f"{self.placement} memory is not host-addressable")

    def close(self) -> None:
        """Free the memory; a second call does nothing. Waits for copies in progress."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._host_array = None
            if self._copies:  # called from within a copy on this thread: free after it
                self._release_pending = True
            else:
                self._release()

    def __enter__(self) -> Allocation:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def host_view(address: int, nbytes: int) -> np.ndarray:
    """A uint8 numpy view of host memory that something else owns and frees."""
    return _native.native.host_view(address, nbytes)


def buffer_address(buffer: mmap.mmap) -> int:
    """The start address of a writable buffer (an ``mmap``), leaving it unexported.

    The temporary numpy view is dropped before returning, so the ``mmap`` can
    still be closed (an exported buffer would make ``close`` fail).
    """
    view = np.frombuffer(buffer, dtype=np.uint8)
    try:
        return int(view.ctypes.data)
    finally:
        del view


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return (value + multiple - 1) // multiple * multiple
