"""Huge-page host memory for GPU lookups: an anonymous mapping advised for
transparent huge pages, every page faulted in, then page-locked and mapped for
the GPUs with ``cudaHostRegister``.

Fewer, larger pages mean fewer address translations per random row. The share
that really got huge pages is read back from ``/proc/self/smaps`` and reported.
"""

from __future__ import annotations

import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

from engram_jax.storage import _cuda
from engram_jax.storage.base import Allocation, MemoryKind, buffer_address, host_view, round_up

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
SMALL_PAGE = mmap.PAGESIZE
# Linux's value; Python exposes mmap.MADV_COLLAPSE only where its headers had it.
MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)
# Below this, faulting in on one thread is quicker than starting more.
_PARALLEL_FAULT_BYTES = 256 << 20


def fault_threads() -> int:
    """Threads used to touch pages: the kernel zeroes pages as fast as cores allow."""
    return max(1, min(16, len(os.sched_getaffinity(0))))


def thp_mode() -> str:
    """The transparent huge page mode: ``always``, ``madvise``, ``never`` or ``absent``."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "absent"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "absent"


class AnonymousMapping:
    """A private anonymous mapping whose usable range starts on a 2 MiB boundary.

    The ``mmap`` object owns the memory; ``address`` is the aligned start, so
    huge pages can back the whole range. Numpy views come from
    :func:`host_view`, which exports no buffer from the ``mmap``, so closing it
    never fails on a view someone still holds.
    """

    def __init__(self, nbytes: int, *, huge: bool) -> None:
        self.nbytes = int(nbytes)
        self.length = round_up(max(self.nbytes, 1), HUGE_PAGE)
        # One spare huge page of slack to align the start.
        self._mmap = mmap.mmap(
            -1,
            self.length + HUGE_PAGE,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        try:
            base = buffer_address(self._mmap)
            self.offset = (-base) % HUGE_PAGE
            self.address = base + self.offset
            if huge:
                self._mmap.madvise(mmap.MADV_HUGEPAGE, self.offset, self.length)
        except BaseException:
            self._mmap.close()
            raise

    def fault_in(self, threads: int | None = None) -> None:
        """Write one byte per small page, on several threads, so no lookup ever faults."""
        fault_in(self.address, self.length, threads)

    def collapse(self) -> str | None:
        """Best-effort ``MADV_COLLAPSE``; None on success, else why it did not happen."""
        try:
            self._mmap.madvise(MADV_COLLAPSE, self.offset, self.length)
        except OSError as exc:
            return f"MADV_COLLAPSE: {exc.strerror or exc}"
        except ValueError as exc:  # pragma: no cover - madvise option rejected by Python
            return f"MADV_COLLAPSE: {exc}"
        return None

    def close(self) -> None:
        self._mmap.close()


def fault_in(address: int, nbytes: int, threads: int | None = None) -> None:
    """Touch every small page of ``[address, address + nbytes)`` by writing a zero.

    Only for memory whose contents do not matter yet (fresh anonymous pages).
    numpy's strided assignment drops the GIL, so the threads run in parallel.
    """
    if nbytes <= 0:
        return
    view = host_view(address, nbytes)
    threads = threads or fault_threads()
    if nbytes < _PARALLEL_FAULT_BYTES or threads == 1:
        view[::SMALL_PAGE] = 0
        return
    step = round_up(-(-nbytes // threads), HUGE_PAGE)
    spans = [(lo, min(nbytes, lo + step)) for lo in range(0, nbytes, step)]

    def touch(span: tuple[int, int]) -> None:
        lo, hi = span
        view[lo:hi:SMALL_PAGE] = 0

    with ThreadPoolExecutor(threads, thread_name_prefix="engram-fault") as pool:
        list(pool.map(touch, spans))


def huge_page_share(address: int, nbytes: int) -> float:
    """Share of ``[address, address + nbytes)`` backed by huge pages, from /proc/self/smaps."""
    if nbytes <= 0:
        return 0.0
    end = address + nbytes
    huge = 0
    overlap = 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    overlap = max(0, min(hi, end) - max(lo, address))
                elif overlap and head in ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:"):
                    huge += min(overlap, int(line.split()[1]) * 1024)
    except OSError:
        return 0.0
    return min(1.0, huge / nbytes)


def allocate_hugepage(nbytes: int, device_ordinal: int | None = None) -> Allocation:
    """Anonymous THP memory, faulted in, collapsed where it is not yet huge, then registered.

    ``MADV_COLLAPSE`` runs before ``cudaHostRegister``: the kernel refuses to
    collapse pages that are pinned for DMA, and the page size does not change
    when rows are written later. Not initialised beyond zero pages.
    """
    ordinal = _cuda.require_device(device_ordinal, "hugepage")
    mode = thp_mode()
    mapping = AnonymousMapping(nbytes, huge=True)
    registered = False

    def release() -> None:
        try:
            if registered:
                _cuda.host_unregister(mapping.address)
        finally:
            mapping.close()

    # Every step after the mmap is inside this block, so a failure at any of
    # them (the view and the Allocation included) unregisters and unmaps.
    try:
        mapping.fault_in()
        share = huge_page_share(mapping.address, mapping.length)
        collapse_note = None
        if share < 1.0:
            collapse_note = mapping.collapse()
            share = huge_page_share(mapping.address, mapping.length)
        with _cuda.in_context(ordinal):
            _cuda.host_register(mapping.address, mapping.length)
        registered = True
        info = {"huge_page_share": share, "thp_mode": mode}
        if collapse_note:
            info["collapse"] = collapse_note
        allocation = Allocation(
            placement="hugepage",
            address=mapping.address,
            nbytes=nbytes,
            kind=MemoryKind.HOST_MAPPED,
            release=release,
            host_array=host_view(mapping.address, nbytes),
            info=info,
        )
    except BaseException:
        release()
        raise
    log.info(
        "hugepage: %.2f GiB, %.1f%% in huge pages (THP mode %s%s)",
        nbytes / 2**30,
        100 * share,
        mode,
        f"; {collapse_note}" if collapse_note else "",
    )
    return allocation
