"""ShardedTable: a different EngramTable on each device, under one registry key.

The lookup handler resolves (key, device ordinal) on every call, so entering
each device's own table under one shared key lets one compiled SPMD program
(``shard_map`` over a mesh) read a different shard on every device.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import jax

from engram_jax import _native
from engram_jax.storage import MemoryKind
from engram_jax.table import EngramTable, next_table_key, wait_for_dispatched


def handler_ordinal(device: jax.Device) -> int:
    """The ordinal the FFI handlers see for ``device`` (XLA's ``DeviceOrdinal``), under
    which the native registries hold its tables and caches.

    CUDA handlers get the local CUDA ordinal (``local_hardware_id``, what
    ``device_ordinal`` means everywhere else); the CPU backend passes the
    device's global id (0..n-1 in one process, offset per process under
    ``jax.distributed``, e.g. 2048 for process 1's first device).
    """
    if device.process_index != jax.process_index():
        raise ValueError(f"{device} belongs to process {device.process_index}, not this one")
    if device.platform == "cpu":
        return int(device.id)
    if device.local_hardware_id is None:
        raise ValueError(f"{device} has no local hardware id")
    return int(device.local_hardware_id)


def release_shards(key: int, tables: tuple) -> None:
    """Unregister ``key`` and close each of ``tables`` once, after what was dispatched."""
    # Unregister once nothing dispatched reads the shards, so no lookup can
    # reach memory that is about to be freed.
    wait_for_dispatched()
    _native.native.unregister_table(key)
    for table in tables:
        table.close()


def check_readable(device: jax.Device, table, ordinal: int) -> None:
    """Raise unless ``device`` (:func:`handler_ordinal` ``ordinal``) can read ``table``'s
    memory (an EngramTable's or a TrainableTable's ``allocation``).

    An allocation's ``device_ordinal`` is a CUDA ordinal, so it is compared
    with GPU devices' handler ordinals only: a CPU device's is its jax id.
    """
    allocation = table.allocation
    kind, held_by = allocation.kind, allocation.device_ordinal
    if device.platform == "cpu":
        if kind == MemoryKind.DEVICE:
            raise ValueError(f"{device} cannot read {table!r}: it lives in GPU memory")
        return
    if kind == MemoryKind.HOST:
        raise ValueError(
            f"{device} cannot read {table!r}: plain host memory; place it as 'pinned' for GPUs"
        )
    if held_by is not None and held_by != ordinal:
        where = "lives on" if kind == MemoryKind.DEVICE else "is mapped for"
        raise ValueError(f"{table!r} {where} GPU {held_by} only, not {device} (ordinal {ordinal})")


class ShardedTable:
    """One :class:`EngramTable` per device, read through a single registry key.

    ``tables`` maps each device (of this process) to the table holding its
    rows; several devices may share one table (a node-local host copy). The
    ShardedTable owns its tables: :meth:`close` (or garbage collection)
    unregisters the key and then closes every table once. Do not close the
    tables on their own while the ShardedTable is open.

    ``engram_jax.lookup(sharded, ids)`` inside ``shard_map`` reads, on each
    device, that device's table; devices without an entry fail the lookup.
    """

    def __init__(self, tables: Mapping[jax.Device, EngramTable]) -> None:
        if not tables:
            raise ValueError("a ShardedTable needs at least one device's table")
        dims = {table.dim for table in tables.values()}
        if len(dims) != 1:
            raise ValueError(f"every shard must have the same dim, got {sorted(dims)}")
        entries = []
        for device, table in tables.items():
            if not isinstance(device, jax.Device):
                raise TypeError(f"keys must be jax devices, got {type(device).__name__}")
            if not isinstance(table, EngramTable):
                raise TypeError(f"values must be EngramTables, got {type(table).__name__}")
            if table.closed:
                raise ValueError(f"{table!r} (for {device}) is closed")
            ordinal = handler_ordinal(device)
            check_readable(device, table, ordinal)
            entries.append((device, ordinal, table))
        ordinals = [ordinal for _, ordinal, _ in entries]
        if len(set(ordinals)) != len(ordinals):
            raise ValueError(f"two devices share a handler ordinal: {ordinals}")
        self._dim = dims.pop()
        self._tables = {device: table for device, _, table in entries}
        unique = tuple({id(table): table for table in self._tables.values()}.values())
        self._key = next_table_key()
        try:
            for _, ordinal, table in entries:
                allocation = table.allocation
                _native.native.register_table(
                    self._key,
                    ordinal,
                    allocation.address,
                    table.row_start,
                    table.num_rows,
                    table.dim,
                    int(allocation.kind),
                )
        except BaseException:
            # Not built: leave the caller's tables open.
            _native.native.unregister_table(self._key)
            raise
        self._finalizer = weakref.finalize(self, release_shards, self._key, unique)
        # Named for the error of a compiled lookup that outlives it.
        _native.native.name_table(self._key, repr(self))

    @property
    def key(self) -> int:
        """The registry key lookups carry; it resolves to a different table per device."""
        return self._key

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(self._tables)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive or any(t.closed for t in self._tables.values())

    def table(self, device: jax.Device) -> EngramTable:
        """The table ``device`` reads."""
        try:
            return self._tables[device]
        except KeyError:
            raise ValueError(f"{self!r} holds no table for {device}") from None

    def row_range(self, device: jax.Device) -> tuple[int, int]:
        """Global rows ``[start, stop)`` that ``device`` holds."""
        table = self.table(device)
        return table.row_start, table.row_stop

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._tables)} devices"
        return f"ShardedTable(dim={self._dim}, {state}, key={self._key})"

    def close(self) -> None:
        """Unregister the key and close every shard; a second close does nothing."""
        self._finalizer()

    def __enter__(self) -> ShardedTable:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# Static under jit, like EngramTable: hashed by identity, no array leaves.
jax.tree_util.register_static(ShardedTable)
