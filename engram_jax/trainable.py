"""TrainableTable: one layer's Engram table (or one shard of it) as float32 or
bfloat16 rows with their optimizer state, in memory a lookup and an update can
reach.

One record per row: the row's values, then its optimizer state, each padded to
16 bytes (the layout of ``ffi/kernels/train_rows.h``, asked from the native
module), so an update reads and writes a row and its state in one place. The
memory comes from an :mod:`engram_jax.storage` placement; the table is entered
in the native registry under an integer key as the fp8 tables are, with its row
dtype and optimizer, so every handler checks what it is handed.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from engram_jax import _native, storage
from engram_jax._format import MAX_DIM
from engram_jax.row_optimizers import FORMAT_CODES, RowOptimizer, as_row_dtype
from engram_jax.storage import Allocation
from engram_jax.table import device_ordinal, next_table_key, wait_for_dispatched

# Records written per step: bounds the temporary copy to ~64 MiB.
_CHUNK_BYTES = 64 << 20


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return int(value)


def _check_optimizer(optimizer: object) -> RowOptimizer:
    if not isinstance(optimizer, RowOptimizer):
        raise TypeError(
            "optimizer must be a RowOptimizer (engram_jax.sgd(), adagrad(), row_adagrad(), "
            f"lazy_adam()), got {type(optimizer).__name__}"
        )
    return optimizer


def record_layout(dtype: np.dtype, dim: int, optimizer: RowOptimizer) -> tuple[int, int, int]:
    """``(stride, state_offset, state_bytes)`` of one row's record, from the native layout."""
    return tuple(
        _native.native.trainable_layout(
            FORMAT_CODES[dtype.name], dim, optimizer.code, optimizer.moment_code
        )
    )


def _release(key: int, allocation: Allocation) -> None:
    # Unregister once nothing dispatched reads or updates the table.
    wait_for_dispatched()
    _native.native.unregister_table(key)
    allocation.close()


class TrainableTable:
    """Rows ``[row_start, row_start + num_rows)`` of a layer table, ``dim`` float32 or
    bfloat16 values each, with ``optimizer``'s state.

    Build one with :meth:`allocate` (rows zero, state initial) or :meth:`from_array`.
    :func:`~engram_jax.lookup` reads it inside ``jit`` and
    :func:`~engram_jax.apply_gradients` updates it in place. Free it with
    :meth:`close` or a ``with`` block; garbage collection frees it too. Static
    under ``jax.jit``, like an :class:`~engram_jax.EngramTable`.
    """

    def __init__(
        self,
        allocation: Allocation,
        *,
        num_rows: int,
        dim: int,
        dtype: object,
        optimizer: RowOptimizer,
        row_start: int = 0,
    ) -> None:
        num_rows, dim = _check_int("num_rows", num_rows), _check_int("dim", dim)
        row_start = _check_int("row_start", row_start)
        if not 0 < dim <= MAX_DIM:
            raise ValueError(f"dim must be in [1, {MAX_DIM}], got {dim}")
        if num_rows < 0 or row_start < 0:
            raise ValueError(f"num_rows and row_start must be >= 0, got {num_rows}, {row_start}")
        if row_start + num_rows > 2**31:
            raise ValueError("row ids are int32: row_start + num_rows must be <= 2**31")
        self._dtype = as_row_dtype(dtype)
        self._optimizer = _check_optimizer(optimizer)
        self._stride, self._state_offset, _ = record_layout(self._dtype, dim, self._optimizer)
        if allocation.nbytes < num_rows * self._stride:
            raise ValueError(f"allocation of {allocation.nbytes} bytes cannot hold {num_rows} rows")
        self._allocation = allocation
        self._num_rows, self._dim, self._row_start = num_rows, dim, row_start
        self._key = next_table_key()
        held_by = allocation.device_ordinal
        self.register(self._key, _native.native.any_device if held_by is None else held_by)
        self._finalizer = weakref.finalize(self, _release, self._key, allocation)
        # Named for the error of a compiled lookup that outlives it.
        _native.native.name_table(self._key, repr(self))

    def register(self, key: int, ordinal: int, *, writer: bool = True) -> None:
        """Enter this table's memory in the native registry under ``key`` for handler
        ordinal ``ordinal`` (a :class:`ShardedTrainableTable` enters each shard so);
        ``writer``: whether updates through that entry write."""
        _native.native.register_trainable_table(
            key,
            ordinal,
            self._allocation.address,
            self._row_start,
            self._num_rows,
            self._dim,
            int(self._allocation.kind),
            FORMAT_CODES[self._dtype.name],
            self._optimizer.code,
            self._optimizer.moment_code,
            writer,
        )

    # -- construction -------------------------------------------------------

    @classmethod
    def allocate(
        cls,
        num_rows: int,
        dim: int,
        *,
        dtype: object = np.float32,
        optimizer: RowOptimizer,
        placement: str = "auto",
        row_start: int = 0,
        device: jax.Device | int | None = None,
    ) -> TrainableTable:
        """A table of ``num_rows`` zero rows with ``optimizer``'s initial state, in
        ``placement`` (``device`` as for :meth:`EngramTable.allocate
        <engram_jax.EngramTable.allocate>`). Fill it with :meth:`write_rows`."""
        dtype = as_row_dtype(dtype)
        optimizer = _check_optimizer(optimizer)
        num_rows, dim = _check_int("num_rows", num_rows), _check_int("dim", dim)
        if not 0 < dim <= MAX_DIM:
            raise ValueError(f"dim must be in [1, {MAX_DIM}], got {dim}")
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        stride = record_layout(dtype, dim, optimizer)[0]
        allocation = storage.allocate(
            placement, max(num_rows * stride, 1), device_ordinal(device, placement)
        )
        try:
            table = cls(
                allocation,
                num_rows=num_rows,
                dim=dim,
                dtype=dtype,
                optimizer=optimizer,
                row_start=row_start,
            )
            table._initialise()
        except BaseException:
            allocation.close()
            raise
        return table

    @classmethod
    def from_array(
        cls,
        weight: np.ndarray,
        *,
        optimizer: RowOptimizer,
        placement: str = "auto",
        row_start: int = 0,
        device: jax.Device | int | None = None,
        state: Mapping[str, np.ndarray] | None = None,
    ) -> TrainableTable:
        """A table of ``weight`` ``[rows, dim]`` (float32 or bfloat16: the table's dtype),
        with ``optimizer``'s initial state or ``state`` (as :meth:`state` returns it)."""
        weight = np.asarray(weight)
        dtype = as_row_dtype(weight.dtype, "weight")
        if weight.ndim != 2:
            raise ValueError(f"weight must be [rows, dim], got shape {weight.shape}")
        optimizer = _check_optimizer(optimizer)
        if state is not None:
            check_state(optimizer, state, weight.shape[0], weight.shape[1])
        table = cls.allocate(
            weight.shape[0],
            weight.shape[1],
            dtype=dtype,
            optimizer=optimizer,
            placement=placement,
            row_start=row_start,
            device=device,
        )
        try:
            table.write_rows(0, weight)
            if state is not None:
                table.write_state(0, state)
        except BaseException:
            table.close()
            raise
        return table

    # -- properties ---------------------------------------------------------

    @property
    def key(self) -> int:
        """The registry key lookups and updates carry to the native handlers."""
        return self._key

    @property
    def dtype(self) -> np.dtype:
        """float32 or bfloat16: the rows' dtype, which lookups return."""
        return self._dtype

    @property
    def optimizer(self) -> RowOptimizer:
        return self._optimizer

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def row_start(self) -> int:
        return self._row_start

    @property
    def row_stop(self) -> int:
        return self._row_start + self._num_rows

    @property
    def record_bytes(self) -> int:
        """Bytes of one row's record: values, state, padding."""
        return self._stride

    @property
    def nbytes(self) -> int:
        return self._num_rows * self._stride

    @property
    def placement(self) -> str:
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
            f"TrainableTable(rows=[{self.row_start}, {self.row_stop}), dim={self.dim}, "
            f"dtype={self._dtype.name}, optimizer={self._optimizer.name}, placement={state}, "
            f"key={self.key})"
        )

    # -- data ---------------------------------------------------------------

    def _field_bytes(self) -> dict[str, tuple[int, tuple[int, ...], np.dtype]]:
        """Each state array's byte offset in a record, shape per row and dtype."""
        fields, offset = {}, self._state_offset
        for name, shape, dtype in self._optimizer.state_fields(self._dim):
            fields[name] = (offset, shape, dtype)
            offset += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return fields

    def _records(self, local_start: int, count: int) -> np.ndarray:
        return self._allocation.read(local_start * self._stride, count * self._stride).reshape(
            count, self._stride
        )

    def _patch(self, local_start: int, pieces: Sequence[tuple[int, np.ndarray]]) -> None:
        """Write ``pieces`` (byte offset in the record, ``[n, bytes]`` uint8) into rows
        ``local_start ..``, keeping the rest of each record."""
        count = pieces[0][1].shape[0]
        chunk = max(1, _CHUNK_BYTES // self._stride)
        host = self._allocation.host_array
        for lo in range(0, count, chunk):
            hi = min(count, lo + chunk)
            first = local_start + lo
            if host is not None:
                records = host[first * self._stride : (first + hi - lo) * self._stride]
                records = records.reshape(hi - lo, self._stride)
            else:
                records = self._records(first, hi - lo)
            for offset, data in pieces:
                records[:, offset : offset + data.shape[1]] = data[lo:hi]
            if host is None:
                self._allocation.write(first * self._stride, records)

    def _initialise(self) -> None:
        """Zero rows and the optimizer's initial state, in chunks."""
        if not self._num_rows:
            return
        template = np.zeros((1, self._stride), np.uint8)
        initial = self._optimizer.initial_state(1, self._dim)
        for name, (offset, _, _) in self._field_bytes().items():
            value = initial[name]
            template[0, offset : offset + value.nbytes] = value.reshape(-1).view(np.uint8)
        chunk = max(1, _CHUNK_BYTES // self._stride)
        block = np.repeat(template, min(chunk, self._num_rows), axis=0)
        for lo in range(0, self._num_rows, chunk):
            hi = min(self._num_rows, lo + chunk)
            self._allocation.write(lo * self._stride, block[: hi - lo])

    def _check_range(self, local_start: int, count: int) -> None:
        local_start = _check_int("local_start", local_start)
        if local_start < 0 or local_start + count > self._num_rows:
            raise ValueError(
                f"rows [{local_start}, {local_start + count}) are outside the table's "
                f"{self._num_rows} rows"
            )

    def write_rows(self, local_start: int, rows: np.ndarray) -> None:
        """Write ``rows`` ``[n, dim]`` (the table's dtype; float32 or bfloat16 is cast to
        it) to rows ``local_start ..`` (table-local numbering), keeping their state.
        Waits for dispatched work first, so an update in flight is not overwritten."""
        self._check_open()
        rows = np.asarray(rows)
        as_row_dtype(rows.dtype, "rows")
        if rows.ndim != 2 or rows.shape[1] != self._dim:
            raise ValueError(f"rows must be [n, {self._dim}], got shape {rows.shape}")
        self._check_range(local_start, rows.shape[0])
        if not rows.shape[0]:
            return
        data = np.ascontiguousarray(rows.astype(self._dtype)).view(np.uint8)
        wait_for_dispatched()
        self._patch(local_start, [(0, data.reshape(rows.shape[0], -1))])

    def write_state(self, local_start: int, state: Mapping[str, np.ndarray]) -> None:
        """Write optimizer state (every array :meth:`state` names, ``[n, ...]``) to rows
        ``local_start ..``."""
        self._check_open()
        count = check_state(self._optimizer, state, None, self._dim)
        self._check_range(local_start, count)
        if not count or not state:
            return
        pieces = []
        for name, (offset, _, dtype) in self._field_bytes().items():
            value = np.ascontiguousarray(np.asarray(state[name]).astype(dtype))
            pieces.append((offset, value.view(np.uint8).reshape(count, -1)))
        wait_for_dispatched()
        self._patch(local_start, pieces)

    def _gather_records(self, local: np.ndarray) -> np.ndarray:
        """Records of table-local rows ``local`` (valid rows, any order) ``[n, stride]``."""
        host = self._allocation.host_array
        if host is not None:
            return host[: self._num_rows * self._stride].reshape(-1, self._stride)[local]
        records = np.empty((local.size, self._stride), np.uint8)
        order = np.argsort(local, kind="stable")
        rows = local[order]
        # Runs of nearby rows, one copy each (each copy of device memory is a cudaMemcpy).
        breaks = np.flatnonzero(np.diff(rows) > 1024) + 1
        for run in np.split(np.arange(rows.size), breaks):
            if not run.size:
                continue
            first, last = int(rows[run[0]]), int(rows[run[-1]])
            span = self._records(first, last - first + 1)
            records[order[run]] = span[rows[run] - first]
        return records

    def read_rows(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows of global ids ``ids`` ``[...]`` -> ``[..., dim]`` in the table's dtype;
        ids the table does not hold give zero rows (as a lookup does)."""
        self._check_open()
        ids = np.asarray(ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be integer row ids, got {ids.dtype}")
        local = ids.astype(np.int64).reshape(-1) - self._row_start
        held = (local >= 0) & (local < self._num_rows)
        out = np.zeros((local.size, self._dim), self._dtype)
        wait_for_dispatched()
        if held.any():
            records = self._gather_records(local[held])
            row_bytes = self._dim * self._dtype.itemsize
            out[held] = np.ascontiguousarray(records[:, :row_bytes]).view(self._dtype)
        return out.reshape(ids.shape + (self._dim,))

    def state(self) -> dict[str, np.ndarray]:
        """A copy of the optimizer state of every row, by name (see
        :meth:`RowOptimizer.state_fields <engram_jax.RowOptimizer.state_fields>`):
        ``sum_of_squares`` (adagrad), ``accumulator`` (row_adagrad), ``exp_avg`` and
        ``exp_avg_sq`` (lazy_adam); empty for sgd."""
        self._check_open()
        fields = self._field_bytes()
        out = {
            name: np.empty((self._num_rows, *shape), dtype)
            for name, (_, shape, dtype) in fields.items()
        }
        if not fields or not self._num_rows:
            return out
        wait_for_dispatched()
        chunk = max(1, _CHUNK_BYTES // self._stride)
        for lo in range(0, self._num_rows, chunk):
            hi = min(self._num_rows, lo + chunk)
            records = self._records(lo, hi - lo)
            for name, (offset, shape, dtype) in fields.items():
                width = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                piece = np.ascontiguousarray(records[:, offset : offset + width])
                out[name][lo:hi] = piece.view(dtype).reshape((hi - lo, *shape))
        return out

    # -- lifetime -----------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"TrainableTable (key {self._key}) is closed")

    def close(self) -> None:
        """Free the memory now. Lookups and updates of a closed table raise; a second
        close does nothing."""
        self._finalizer()

    def __enter__(self) -> TrainableTable:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def check_state(
    optimizer: RowOptimizer, state: Mapping[str, np.ndarray], num_rows: int | None, dim: int
) -> int:
    """Raise unless ``state`` holds exactly ``optimizer``'s arrays for ``num_rows`` rows
    (any count when None) of ``dim`` values; returns the row count."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict of numpy arrays, got {type(state).__name__}")
    fields = optimizer.state_fields(dim)
    names = sorted(name for name, _, _ in fields)
    if sorted(state) != names:
        raise ValueError(
            f"{optimizer.name} keeps state {names}, got {sorted(state)}: "
            "the optimizer state does not match the table"
        )
    count = num_rows
    for name, shape, dtype in fields:
        value = np.asarray(state[name])
        rows = value.shape[0] if value.ndim else -1
        if count is None:
            count = rows
        if value.shape != (count, *shape) or value.dtype != dtype:
            raise ValueError(
                f"state {name!r} must be {dtype.name} of shape {(count, *shape)}, got "
                f"{value.dtype} {value.shape}: the optimizer state does not match the table"
            )
    return 0 if count is None else count


# Static under jit: hashed by identity, no array leaves.
jax.tree_util.register_static(TrainableTable)
