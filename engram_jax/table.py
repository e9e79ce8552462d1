"""EngramTable: one layer's Engram table, or one shard of it, in memory a
lookup can read.

A table is a run of row records (``row_stride(dim)`` bytes each: fp8 values,
UE8M0 scale bytes, zero padding) covering global rows
``[row_start, row_start + num_rows)`` of the layer table. Where it lives is a
placement from :mod:`engram_jax.storage`; once placed, the table is entered in
the native registry under an integer key that lookups carry as an attribute.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence

import jax
import ml_dtypes
import numpy as np

from engram_jax import _jax_private, _native, storage
from engram_jax._format import BLOCK_SIZE, MAX_DIM, pack_records, row_stride, unpack_records
from engram_jax.storage import Allocation, _cuda

_keys = itertools.count(1)
_keys_lock = threading.Lock()
# Rows packed per step when writing: bounds the temporary copy to ~64 MiB.
_WRITE_CHUNK_BYTES = 64 << 20
# read_rows copies runs of wanted rows, not single rows: a run skips at most
# _READ_GAP_BYTES between neighbours (about what one more cudaMemcpy call costs
# in time) and spans at most _READ_SPAN_BYTES, so sparse ids never read much more.
_READ_GAP_BYTES = 256 << 10
_READ_SPAN_BYTES = 64 << 20


def next_table_key() -> int:
    """A fresh registry key for a table (an EngramTable or a ShardedTable)."""
    with _keys_lock:
        return next(_keys)


def device_ordinal(device: jax.Device | int | None, placement: str) -> int | None:
    """The CUDA ordinal a placement gets for ``device`` (a jax device or a CUDA ordinal);
    None for a CPU device or None."""
    if not isinstance(device, jax.Device):
        try:
            return _cuda.check_ordinal(device, "device")
        except TypeError:
            raise TypeError(
                "device must be a jax.Device, an int CUDA ordinal or None, "
                f"got {type(device).__name__} {device!r}"
            ) from None
    if placement == "device" and device.platform != "gpu":
        raise ValueError(f"placement 'device' needs a GPU device, got {device}")
    return int(device.local_hardware_id) if device.platform == "gpu" else None


def _check_dim(dim: int) -> None:
    if not isinstance(dim, (int, np.integer)) or dim <= 0 or dim % BLOCK_SIZE or dim > MAX_DIM:
        raise ValueError(
            f"dim must be a positive multiple of {BLOCK_SIZE} up to {MAX_DIM}, got {dim}"
        )


def _check_rows(num_rows: int, row_start: int) -> None:
    for name, value in (("num_rows", num_rows), ("row_start", row_start)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_rows < 0 or row_start < 0:
        raise ValueError(f"num_rows and row_start must be >= 0, got {num_rows}, {row_start}")
    if row_start + num_rows > 2**31:
        raise ValueError(
            f"row ids are int32: row_start + num_rows must be <= 2**31, got {row_start} + "
            f"{num_rows}"
        )


def _as_weight_bytes(weight: np.ndarray) -> np.ndarray:
    weight = np.asarray(weight)
    if weight.dtype not in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.uint8)):
        raise TypeError(
            f"weight must be float8_e4m3fn (or uint8 holding its bytes), got {weight.dtype}"
        )
    if weight.ndim != 2:
        raise ValueError(f"weight must be [rows, dim], got shape {weight.shape}")
    return weight.view(np.uint8)


def _as_scale_bytes(scale: np.ndarray, rows: int, dim: int) -> np.ndarray:
    scale = np.asarray(scale)
    if scale.dtype not in (np.dtype(ml_dtypes.float8_e8m0fnu), np.dtype(np.uint8)):
        raise TypeError(f"scale must be uint8 or float8_e8m0fnu, got {scale.dtype}")
    if scale.shape != (rows, dim // BLOCK_SIZE):
        raise ValueError(
            f"scale must be [rows, dim // {BLOCK_SIZE}] = {(rows, dim // BLOCK_SIZE)}, "
            f"got {scale.shape}"
        )
    return scale.view(np.uint8)


def wait_for_dispatched() -> None:
    """Wait for every array jax has in flight: dispatched computations may still read a table.

    Without a backend nothing can have read it, and starting one here would
    block in a multi-process job whose peer just died (shared-table cleanup).
    """
    if _jax_private.backends_are_initialized():
        jax.block_until_ready(jax.live_arrays())


def _release(key: int, allocation: Allocation) -> None:
    # Unregister once nothing dispatched reads the table: from here on a lookup
    # fails cleanly, and the native side waits out any CPU gather still running.
    wait_for_dispatched()
    _native.native.unregister_table(key)
    allocation.close()


class EngramTable:
    """Rows ``[row_start, row_start + num_rows)`` of one layer's Engram table.

    Build one with :meth:`from_arrays` (small tables, tests) or :meth:`allocate`
    followed by :meth:`write_rows` (loading in chunks). Free it with
    :meth:`close` or a ``with`` block; garbage collection frees it too.
    A table is static under ``jax.jit``: pass it as an argument or close over it.
    """

    def __init__(
        self, allocation: Allocation, *, num_rows: int, dim: int, row_start: int = 0
    ) -> None:
        _check_dim(dim)
        _check_rows(num_rows, row_start)
        stride = row_stride(dim)
        if allocation.nbytes < num_rows * stride:
            raise ValueError(f"allocation of {allocation.nbytes} bytes cannot hold {num_rows} rows")
        self._allocation = allocation
        self._num_rows = int(num_rows)
        self._dim = int(dim)
        self._row_start = int(row_start)
        self._key = next_table_key()
        # Memory one GPU alone can read is entered for that GPU; the rest for every device.
        held_by = allocation.device_ordinal
        _native.native.register_table(
            self._key,
            _native.native.any_device if held_by is None else held_by,
            allocation.address,
            self._row_start,
            self._num_rows,
            self._dim,
            int(allocation.kind),
        )
        self._finalizer = weakref.finalize(self, _release, self._key, allocation)
        # Named for the error of a compiled lookup that outlives it.
        _native.native.name_table(self._key, repr(self))

    # -- construction -------------------------------------------------------

    @classmethod
    def allocate(
        cls,
        num_rows: int,
        dim: int,
        *,
        placement: str = "cpu",
        row_start: int = 0,
        device: jax.Device | int | None = None,
    ) -> EngramTable:
        """An uninitialised table of ``num_rows`` rows; fill it with :meth:`write_rows`.

        ``device`` (a jax device or a CUDA ordinal, default GPU 0) picks the GPU
        the memory is for: whose HBM holds a ``device`` table, on whose NUMA
        node a ``numa`` table sits, for which ``auto`` chooses. ``cpu`` and
        ``pinned`` ignore it, and a CPU device means no GPU in particular.
        """
        _check_dim(dim)
        _check_rows(num_rows, row_start)  # before the bytes are counted from them
        nbytes = int(num_rows) * row_stride(dim)
        try:
            allocation = storage.allocate(placement, nbytes, device_ordinal(device, placement))
        except MemoryError as exc:
            # numpy's own error names a flat uint8 array, not the table asked for.
            raise MemoryError(
                f"a table of {int(num_rows):,} rows of dim {dim} ({nbytes / 2**30:,.1f} GiB) "
                f"does not fit in {placement!r} memory: {exc}"
            ) from exc
        try:
            return cls(allocation, num_rows=num_rows, dim=dim, row_start=row_start)
        except BaseException:
            allocation.close()
            raise

    @classmethod
    def from_arrays(
        cls,
        weight: np.ndarray,
        scale: np.ndarray,
        *,
        placement: str = "cpu",
        row_start: int = 0,
        device: jax.Device | int | None = None,
    ) -> EngramTable:
        """A table of ``weight`` ``[rows, dim]`` fp8 e4m3 and ``scale`` ``[rows, dim/32]`` UE8M0."""
        weight_bytes = _as_weight_bytes(weight)
        rows, dim = weight_bytes.shape
        _check_dim(dim)
        scale_bytes = _as_scale_bytes(scale, rows, dim)
        table = cls.allocate(rows, dim, placement=placement, row_start=row_start, device=device)
        try:
            table.write_rows(0, weight_bytes, scale_bytes)
        except BaseException:
            table.close()
            raise
        return table

    # -- properties ---------------------------------------------------------

    @property
    def key(self) -> int:
        """The registry key lookups carry to the native handler."""
        return self._key

    @property
    def row_start(self) -> int:
        return self._row_start

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def row_stop(self) -> int:
        return self._row_start + self._num_rows

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE

    @property
    def row_stride(self) -> int:
        return row_stride(self._dim)

    @property
    def nbytes(self) -> int:
        return self._num_rows * self.row_stride

    @property
    def placement(self) -> str:
        """Where the memory came from: a name in ``PLACEMENTS`` (``auto`` reports its
        choice), or ``shared_numa`` / ``shared_shm`` for a node-shared table."""
        return self._allocation.placement

    @property
    def allocation(self) -> Allocation:
        self._check_open()
        return self._allocation

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.placement
        return (
            f"EngramTable(rows=[{self.row_start}, {self.row_stop}), dim={self.dim}, "
            f"placement={state}, key={self.key})"
        )

    # -- data ---------------------------------------------------------------

    def write_rows(self, local_start: int, weight: np.ndarray, scale: np.ndarray) -> None:
        """Write rows ``local_start ..`` (table-local numbering) from fp8 weight and e8m0 scale."""
        self._check_open()
        weight_bytes = _as_weight_bytes(weight)
        rows, dim = weight_bytes.shape
        if dim != self._dim:
            raise ValueError(f"weight has dim {dim}, the table {self._dim}")
        scale_bytes = _as_scale_bytes(scale, rows, dim)
        if local_start < 0 or local_start + rows > self._num_rows:
            raise ValueError(
                f"rows [{local_start}, {local_start + rows}) are outside the table's "
                f"{self._num_rows} rows"
            )
        stride = self.row_stride
        chunk = max(1, _WRITE_CHUNK_BYTES // stride)
        for lo in range(0, rows, chunk):
            hi = min(rows, lo + chunk)
            records = pack_records(weight_bytes[lo:hi], scale_bytes[lo:hi])
            self._allocation.write((local_start + lo) * stride, records)

    def write_records(self, local_start: int, records: np.ndarray) -> None:
        """Write already packed ``[rows, row_stride]`` uint8 records to rows
        ``local_start ..`` (table-local numbering, as :meth:`write_rows`)."""
        self._check_open()
        records = np.asarray(records)
        if records.dtype != np.uint8:
            # A cast would silently wrap or truncate the bytes.
            raise TypeError(f"records must be uint8 bytes, got {records.dtype}")
        if records.ndim != 2 or records.shape[1] != self.row_stride:
            raise ValueError(
                f"records must be [rows, {self.row_stride}] uint8, got {records.shape}"
            )
        if local_start < 0 or local_start + records.shape[0] > self._num_rows:
            raise ValueError("records fall outside the table")
        self._allocation.write(local_start * self.row_stride, records)

    def read_rows(self, ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Debug read-back of global rows ``ids`` (unlike the writes' table-local rows).

        Returns (fp8 weight ``[n, dim]``, e8m0 scale ``[n, dim/32]``).
        """
        self._check_open()
        ids = np.asarray(ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be integer row ids, got {ids.dtype}")
        local = ids.astype(np.int64).reshape(-1) - self._row_start
        if np.any((local < 0) | (local >= self._num_rows)):
            raise IndexError(f"ids outside the table's rows [{self.row_start}, {self.row_stop})")
        return unpack_records(self._read_records(local), self._dim)

    def _read_records(self, local: np.ndarray) -> np.ndarray:
        """Records of table-local rows ``local`` (any order, repeats allowed), ``[n, stride]``.

        One copy per run of nearby wanted rows, not one per row (for device
        memory each copy is a cudaMemcpy); the rows are then picked in numpy.
        """
        stride = self.row_stride
        records = np.empty((local.size, stride), np.uint8)
        if not local.size:
            return records
        order = np.argsort(local, kind="stable")
        rows = local[order]
        span_rows = max(1, _READ_SPAN_BYTES // stride)
        gap_rows = _READ_GAP_BYTES // stride
        # Positions in `rows` where a run must start because the gap before is too wide.
        breaks = np.flatnonzero(np.diff(rows) > gap_rows + 1) + 1
        i = 0
        while i < rows.size:
            first = int(rows[i])
            j = int(np.searchsorted(rows, first + span_rows, side="left"))
            k = int(np.searchsorted(breaks, i, side="right"))
            if k < breaks.size:
                j = min(j, int(breaks[k]))
            last = int(rows[j - 1])
            span = self._allocation.read(first * stride, (last - first + 1) * stride)
            records[order[i:j]] = span.reshape(-1, stride)[rows[i:j] - first]
            i = j
        return records

    # -- lifetime -----------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"EngramTable (key {self._key}) is closed")

    def close(self) -> None:
        """Free the memory now. Lookups of a closed table raise; a second close does nothing."""
        self._finalizer()

    def __enter__(self) -> EngramTable:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# Tables are static under jit: they hash by identity and carry no array leaves.
jax.tree_util.register_static(EngramTable)
