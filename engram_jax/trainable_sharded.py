"""ShardedTrainableTable: a different TrainableTable on each device, under one
registry key, as :class:`~engram_jax.ShardedTable` is for fp8 tables.

Several devices may share one table (a node-local host copy); each such table
is entered with exactly one writer device, so an update gathered to every
device that reads the table is written once.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from engram_jax import _native
from engram_jax.row_optimizers import RowOptimizer
from engram_jax.sharded_table import check_readable, handler_ordinal, release_shards
from engram_jax.sharding import ShardPlan, build_device_shards, device_shards
from engram_jax.table import next_table_key
from engram_jax.trainable import TrainableTable


class ShardedTrainableTable:
    """One :class:`TrainableTable` per device, read and updated through one key.

    All shards have the same dim, dtype and optimizer. The first device (in
    ``tables`` order) of each distinct table writes its updates; the others'
    updates of it are no-ops (they hold the same gathered gradients). Owns its
    tables: :meth:`close` unregisters the key and closes each table once.
    """

    def __init__(self, tables: Mapping[jax.Device, TrainableTable]) -> None:
        if not tables:
            raise ValueError("a ShardedTrainableTable needs at least one device's table")
        first = next(iter(tables.values()))
        entries, writers = [], set()
        for device, table in tables.items():
            if not isinstance(device, jax.Device):
                raise TypeError(f"keys must be jax devices, got {type(device).__name__}")
            if not isinstance(table, TrainableTable):
                raise TypeError(f"values must be TrainableTables, got {type(table).__name__}")
            if table.closed:
                raise ValueError(f"{table!r} (for {device}) is closed")
            if (table.dim, table.dtype, table.optimizer) != (
                first.dim,
                first.dtype,
                first.optimizer,
            ):
                raise ValueError("every shard must have the same dim, dtype and optimizer")
            ordinal = handler_ordinal(device)
            check_readable(device, table, ordinal)
            writer = id(table) not in writers
            writers.add(id(table))
            entries.append((device, ordinal, table, writer))
        ordinals = [ordinal for _, ordinal, _, _ in entries]
        if len(set(ordinals)) != len(ordinals):
            raise ValueError(f"two devices share a handler ordinal: {ordinals}")
        self._dim, self._dtype, self._optimizer = first.dim, first.dtype, first.optimizer
        self._tables = {device: table for device, _, table, _ in entries}
        unique = tuple({id(t): t for t in self._tables.values()}.values())
        self._key = next_table_key()
        try:
            for _, ordinal, table, writer in entries:
                table.register(self._key, ordinal, writer=writer)
        except BaseException:
            _native.native.unregister_table(self._key)
            raise
        self._finalizer = weakref.finalize(self, release_shards, self._key, unique)
        # Named for the error of a compiled lookup that outlives it.
        _native.native.name_table(self._key, repr(self))

    @property
    def key(self) -> int:
        return self._key

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def optimizer(self) -> RowOptimizer:
        return self._optimizer

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(self._tables)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive or any(t.closed for t in self._tables.values())

    def table(self, device: jax.Device) -> TrainableTable:
        try:
            return self._tables[device]
        except KeyError:
            raise ValueError(f"{self!r} holds no table for {device}") from None

    def row_range(self, device: jax.Device) -> tuple[int, int]:
        table = self.table(device)
        return table.row_start, table.row_stop

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._tables)} devices"
        return f"ShardedTrainableTable(dim={self._dim}, {state}, key={self._key})"

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> ShardedTrainableTable:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def shard_trainable_from_array(
    weight: np.ndarray,
    mesh: Mesh,
    plan: ShardPlan,
    *,
    optimizer: RowOptimizer,
    placement: str = "cpu",
) -> ShardedTrainableTable:
    """Each local device's head shard of a whole layer's ``weight`` ``[rows, dim]``
    (float32 or bfloat16) as a :class:`ShardedTrainableTable`. Devices needing the
    same rows share one table (one writer each) unless ``placement="device"``,
    which gives each GPU its own copy in HBM."""
    weight = np.asarray(weight)
    if weight.ndim != 2 or weight.shape[0] != plan.num_rows:
        raise ValueError(
            f"weight must be [{plan.num_rows}, dim] (the plan's layer), got {weight.shape}"
        )

    def make(row_start: int, row_stop: int, device: jax.Device | None) -> TrainableTable:
        return TrainableTable.from_array(
            weight[row_start:row_stop],
            optimizer=optimizer,
            placement=placement,
            row_start=row_start,
            device=device,
        )

    # One host copy per group of devices, not one per NUMA node: a copy per node
    # would take every update once per copy.
    return build_device_shards(mesh, plan, placement, make, ShardedTrainableTable, by_node=False)


def check_trainable_mesh(
    table: TrainableTable | ShardedTrainableTable, mesh: Mesh, plan: ShardPlan
) -> None:
    """Raise unless every device of this process in ``mesh`` holds its head shard's rows
    of ``table`` (a :class:`ShardedTrainableTable`, or one table every device reads)."""
    if table.closed:
        raise ValueError(f"{table!r} is closed")
    me = jax.process_index()
    for device, shard in device_shards(mesh, plan).items():
        if device.process_index != me:
            continue
        if isinstance(table, ShardedTrainableTable):
            start, stop = table.row_range(device)
        else:
            check_readable(device, table, handler_ordinal(device))
            if table.allocation.device_ordinal is not None:
                raise ValueError(
                    f"{table!r} is registered for one GPU only: wrap it in a ShardedTrainableTable"
                )
            start, stop = table.row_start, table.row_stop
        if shard.num_rows and (start > shard.row_start or stop < shard.row_stop):
            raise ValueError(
                f"{device} needs rows [{shard.row_start}, {shard.row_stop}) but its table "
                f"holds rows [{start}, {stop})"
            )
