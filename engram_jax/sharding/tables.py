"""Tables for a mesh: the checks that every local device holds its head shard's
rows (and a hot-row cache copy), and :func:`shard_table_from_arrays`, which
builds each device's shard with node-local host copies (:func:`build_device_shards`,
which trainable tables use too).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from engram_jax.hot_rows import HotRowCache, check_cache
from engram_jax.sharded_table import ShardedTable, check_readable, handler_ordinal
from engram_jax.sharding.mesh import device_shards
from engram_jax.sharding.plan import ShardPlan
from engram_jax.storage import choose_auto
from engram_jax.storage.numa import gpu_numa_node
from engram_jax.table import EngramTable

Table = EngramTable | ShardedTable


def _held_rows(table: Table, device: jax.Device) -> tuple[int, int]:
    if isinstance(table, ShardedTable):
        return table.row_range(device)
    if isinstance(table, EngramTable):
        ordinal = handler_ordinal(device)
        check_readable(device, table, ordinal)
        held_by = table.allocation.device_ordinal
        if held_by is not None and held_by != ordinal:
            # Host memory mapped for one GPU only is registered under that GPU's
            # ordinal; a CPU device's lookup (ordinal = its jax id) would not find it.
            raise ValueError(
                f"{table!r} is registered for GPU {held_by} only; {device} (ordinal {ordinal}) "
                "would not find it: wrap it in a ShardedTable"
            )
        return table.row_start, table.row_stop
    raise TypeError(f"table must be an EngramTable or ShardedTable, got {type(table).__name__}")


def check_table(table: Table, mesh: Mesh, plan: ShardPlan) -> None:
    """Raise unless every device of this process holds the rows of its head shard."""
    if table.closed:
        raise ValueError(f"{table!r} is closed")
    me = jax.process_index()
    for device, shard in device_shards(mesh, plan).items():
        if device.process_index != me:
            continue
        start, stop = _held_rows(table, device)
        if shard.num_rows and (start > shard.row_start or stop < shard.row_stop):
            raise ValueError(
                f"{device} (tp_rank {shard.tp_rank}, edp_rank {shard.edp_rank}) needs rows "
                f"[{shard.row_start}, {shard.row_stop}) for columns [{shard.col_start}, "
                f"{shard.col_stop}), but its table holds rows [{start}, {stop})"
            )


def check_mesh_cache(cache: HotRowCache | None, table: Table, mesh: Mesh) -> None:
    """Raise unless ``cache`` (if any) caches ``table`` on every device of this process in
    ``mesh``; a device without a copy would fail its lookup when the program runs."""
    check_cache(table, cache)
    if cache is None:
        return
    me = jax.process_index()
    missing = [d for d in mesh.devices.flat if d.process_index == me and not cache.serves(d)]
    if missing:
        raise ValueError(
            f"{cache!r} has no copy on {[str(d) for d in missing]}: build it for the "
            "ShardedTable of this mesh (or pass every device of the mesh as devices=)"
        )


def _host_node(device: jax.Device, placement: str) -> int | None:
    """The NUMA node a ``placement`` table for ``device`` goes on, or None where the
    placement does not place by node (cpu, pinned, hugepage, auto not choosing numa)."""
    if device.platform != "gpu" or placement not in ("numa", "auto"):
        return None
    ordinal = handler_ordinal(device)
    if placement == "auto" and choose_auto(ordinal)[0] != "numa":
        return None
    return gpu_numa_node(ordinal)


def shard_table_from_arrays(
    weight: np.ndarray,
    scale: np.ndarray,
    mesh: Mesh,
    plan: ShardPlan,
    *,
    placement: str = "cpu",
) -> ShardedTable:
    """Each local device's head shard of a whole layer (``weight`` fp8 ``[rows, dim]``,
    ``scale`` UE8M0 ``[rows, dim/32]``) as a :class:`ShardedTable`.

    Devices needing the same rows share one host table (shared mode: one copy
    per TP rank), one per NUMA node where the placement puts memory on a GPU's
    node (``numa``, or ``auto`` choosing it): each device reads a copy on its
    own node. ``placement="device"`` gives each GPU its own copy in HBM.
    """
    if weight.shape[0] != plan.num_rows:
        raise ValueError(f"weight has {weight.shape[0]} rows, the plan's layer {plan.num_rows}")

    def make(row_start: int, row_stop: int, device: jax.Device | None) -> EngramTable:
        return EngramTable.from_arrays(
            weight[row_start:row_stop],
            scale[row_start:row_stop],
            placement=placement,
            row_start=row_start,
            device=device,
        )

    return build_device_shards(mesh, plan, placement, make, ShardedTable)


def build_device_shards(
    mesh: Mesh, plan: ShardPlan, placement: str, make, combine, *, by_node=True
):
    """``combine({device: table})`` over each local device's table of its head shard.

    ``make(row_start, row_stop, device)`` builds a table once per group of devices
    needing the same rows in the same memory: one GPU's HBM for ``placement="device"``,
    else one host copy, per NUMA node where the placement puts memory on a GPU's node
    (``by_node``). ``device`` is the group's first device where the memory is chosen
    for it, else None. If anything fails, every table made is closed.
    """
    me = jax.process_index()
    made: dict[tuple, object] = {}
    tables: dict[jax.Device, object] = {}
    try:
        for device, shard in device_shards(mesh, plan).items():
            if device.process_index != me:
                continue
            rows = (shard.row_start, shard.row_stop)
            if placement == "device":
                where: tuple = ("gpu", handler_ordinal(device))
            else:
                node = _host_node(device, placement) if by_node else None
                where = () if node is None else ("node", node)
            key = rows + where
            if key not in made:
                # The first device of a group picks the memory (its GPU, its NUMA node).
                made[key] = make(*rows, device if where else None)
            tables[device] = made[key]
        return combine(tables)
    except BaseException:
        for table in made.values():
            table.close()
        raise
