"""engram_jax.sharding: Engram lookups spread over a device mesh.

Head-shard arithmetic (which hash columns, and so which contiguous rows, each
device holds), the collectives of a lookup with a plan inside ``shard_map``
(:func:`gather_ids` before it, :func:`exchange_rows` after it: TP column
gather; node-local EDP head sharding with an all-to-all row exchange; shared
host tables), and a mesh helper whose EDP axis never spans two nodes.

    mesh = engram_mesh(tp=2)                          # (dp, edp, tp); edp = replicas per node
    plan = ShardPlan.from_layout(layout, 0, tp=2, edp=mesh.shape["edp"])
    table = shard_table_from_arrays(weight, scale, mesh, plan)   # each device's head shard
    rows = make_sharded_lookup(table, mesh, plan)(ids)           # [replicas * slot, n_cols, dim]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import socket
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engram_jax._args import as_ids, narrow_ids
from engram_jax.cache import HotRowCache, check_cache
from engram_jax.reference import DEAD_ID
from engram_jax.sharded_table import ShardedTable, _check_readable, device_ordinal
from engram_jax.storage import choose_auto
from engram_jax.storage.numa import gpu_numa_node
from engram_jax.table import EngramTable

MODES = ("heads", "shared")
EXCHANGES = ("all_to_all", "all_gather_select")
MESH_AXES = ("dp", "edp", "tp")

Table = EngramTable | ShardedTable
NodeOf = Callable[[jax.Device], Hashable]


# -- head-shard arithmetic ---------------------------------------------------


def column_sizes(layout: Any, layer: int = 0) -> np.ndarray:
    """Rows per hash column of one layer, int64 ``[n_cols]``.

    ``layout`` is an :class:`~engram_jax.EngramLayout` (or anything with
    ``offsets`` ``[n_layers, n_cols]`` and per-layer ``num_embeddings``; ``layer``
    is the row of ``offsets``, i.e. the index in ``layer_ids`` order), or the
    per-column sizes themselves (1-D, the layout's primes for that layer).
    """
    if hasattr(layout, "offsets") and hasattr(layout, "num_embeddings"):
        offsets = np.asarray(layout.offsets, dtype=np.int64)
        totals = np.asarray(layout.num_embeddings, dtype=np.int64).reshape(-1)
        if offsets.ndim == 2:
            offsets = offsets[layer]
        total = totals[layer] if totals.size > 1 else totals[0]
        if offsets.size == 0 or offsets[0] != 0:
            raise ValueError(f"layer {layer}'s offsets must start at 0, got {offsets[:1]}")
        sizes = np.diff(np.append(offsets, total))
    else:
        sizes = np.asarray(layout)
        if sizes.ndim != 1 or not np.issubdtype(sizes.dtype, np.integer):
            raise TypeError(
                "expected an EngramLayout or 1-D integer per-column sizes, "
                f"got {type(layout).__name__} {getattr(sizes, 'shape', '')}"
            )
        sizes = sizes.astype(np.int64)
    if sizes.size == 0 or np.any(sizes <= 0):
        raise ValueError(f"every hash column needs at least one row, got sizes {sizes.tolist()}")
    if sizes.sum() > 2**31:
        raise ValueError("a layer's rows are int32 ids: at most 2**31 rows")
    return sizes


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """What one (tp_rank, edp_rank) owns: columns ``[col_start, col_stop)`` and
    their rows ``[row_start, row_stop)`` of the layer table.

    ``rank`` is the head-shard rank (``tp_rank * edp + edp_rank`` for head
    sharding, ``tp_rank`` for shared tables); it covers columns
    ``[rank * part, (rank + 1) * part)``, of which those past ``n_cols`` are
    padding (zero rows, cut from the result), so a shard may hold no rows.
    """

    tp_rank: int
    edp_rank: int
    rank: int
    part: int
    col_start: int
    col_stop: int
    row_start: int
    row_stop: int

    @property
    def num_rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def num_cols(self) -> int:
        return self.col_stop - self.col_start


def _shard_count(tp: int, edp: int, mode: str) -> int:
    return tp * edp if mode == "heads" else tp


def head_shard(
    layout: Any,
    tp: int,
    edp: int,
    tp_rank: int,
    edp_rank: int,
    *,
    layer: int = 0,
    mode: str = "heads",
) -> HeadShard:
    """The columns and rows ``(tp_rank, edp_rank)`` owns; see :class:`HeadShard`.

    ``mode="heads"``: tp * edp head shards, TP-major. ``mode="shared"``: the EDP
    replicas of a node share one table, so only TP splits the columns.
    """
    sizes = column_sizes(layout, layer)
    _check_sizes(tp, edp, mode)
    if not (0 <= tp_rank < tp and 0 <= edp_rank < edp):
        raise ValueError(f"rank ({tp_rank}, {edp_rank}) is outside tp={tp}, edp={edp}")
    n_cols = sizes.size
    shards = _shard_count(tp, edp, mode)
    part = -(-n_cols // shards)
    rank = tp_rank * edp + edp_rank if mode == "heads" else tp_rank
    col_start = min(rank * part, n_cols)
    col_stop = min(col_start + part, n_cols)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return HeadShard(
        tp_rank=tp_rank,
        edp_rank=edp_rank,
        rank=rank,
        part=part,
        col_start=col_start,
        col_stop=col_stop,
        row_start=int(bounds[col_start]),
        row_stop=int(bounds[col_stop]),
    )


def head_shards(
    layout: Any, tp: int, edp: int = 1, *, layer: int = 0, mode: str = "heads"
) -> list[HeadShard]:
    """Every (tp_rank, edp_rank)'s :class:`HeadShard`, in TP-major order."""
    return [
        head_shard(layout, tp, edp, t, e, layer=layer, mode=mode)
        for t in range(tp)
        for e in range(edp)
    ]


def _check_sizes(tp: int, edp: int, mode: str) -> None:
    for name, value in (("tp", tp), ("edp", edp)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How one layer's lookup is spread over a mesh (static, hashable).

    ``sizes``: rows per hash column (the layer's primes; see :meth:`from_layout`).
    ``mode``: ``"heads"`` (EDP head sharding; with ``edp=1`` this is TP only) or
    ``"shared"`` (the node-local EDP group reads one shared table per TP rank).
    ``exchange``: how head-sharded rows go back to their replica: ``"all_to_all"``
    (each rank sends 1/edp of its rows to each peer) or ``"all_gather_select"``
    (every rank receives every row and keeps its own: edp times the bytes).
    ``slot``: tokens per replica after padding with DEAD_ID (default: the local
    token count); a replica with more tokens than the slot is an error.
    ``tp_axis``/``edp_axis``: mesh axis names; an axis of size 1 may be absent.
    """

    sizes: tuple[int, ...]
    tp: int = 1
    edp: int = 1
    mode: str = "heads"
    exchange: str = "all_to_all"
    slot: int | None = None
    tp_axis: str = "tp"
    edp_axis: str = "edp"

    def __post_init__(self) -> None:
        sizes = column_sizes(np.asarray(self.sizes, dtype=np.int64))
        object.__setattr__(self, "sizes", tuple(int(s) for s in sizes))
        _check_sizes(self.tp, self.edp, self.mode)
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if self.slot is not None and (
            not isinstance(self.slot, (int, np.integer)) or self.slot < 1
        ):
            raise ValueError(f"slot must be a positive int or None, got {self.slot!r}")
        if self.tp_axis == self.edp_axis:
            raise ValueError(f"tp_axis and edp_axis must differ, both are {self.tp_axis!r}")

    @classmethod
    def from_layout(cls, layout: Any, layer: int = 0, **kwargs: Any) -> ShardPlan:
        """The plan for the layer at index ``layer`` of ``layout.layer_ids`` (the row of
        its ``offsets``, not the model layer id), or for per-column sizes."""
        return cls(tuple(int(s) for s in column_sizes(layout, layer)), **kwargs)

    @property
    def n_cols(self) -> int:
        return len(self.sizes)

    @property
    def num_rows(self) -> int:
        return sum(self.sizes)

    @property
    def shards(self) -> int:
        """Head shards the columns are split into."""
        return _shard_count(self.tp, self.edp, self.mode)

    @property
    def part(self) -> int:
        """Columns per head shard, padding included."""
        return -(-self.n_cols // self.shards)

    @property
    def exchanges_rows(self) -> bool:
        """Whether rows cross the EDP axis (head sharding over more than one replica)."""
        return self.mode == "heads" and self.edp > 1

    def shard(self, tp_rank: int, edp_rank: int) -> HeadShard:
        return head_shard(self.sizes, self.tp, self.edp, tp_rank, edp_rank, mode=self.mode)


# -- the collectives of a lookup inside shard_map ---------------------------------------------


def _varying_axes(x: jax.Array) -> frozenset:
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(vma)


def _mark_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    # The FFI result is typed as invariant under shard_map's check_vma, but it
    # differs per device (each reads its own shard): say so, so that out_specs
    # that claim replication are rejected instead of silently wrong.
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _gather_invariant(x: jax.Array, axis_name: str, axis: int) -> jax.Array:
    try:
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True, to="invarying")
    except TypeError:  # jax without the `to` argument
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)


def _check_axes(plan: ShardPlan) -> None:
    for label, name, size in (("tp", plan.tp_axis, plan.tp), ("edp", plan.edp_axis, plan.edp)):
        if size == 1:
            continue
        try:
            actual = jax.lax.axis_size(name)
        except NameError:
            raise ValueError(
                f"the plan has {label}={size} but no mesh axis {name!r} is bound: "
                "call this inside shard_map over a mesh with that axis"
            ) from None
        if actual != size:
            raise ValueError(
                f"the plan has {label}={size} but mesh axis {name!r} has size {actual}"
            )


def _rank(name: str, size: int) -> jax.Array | int:
    return jax.lax.axis_index(name) if size > 1 else 0


@dataclasses.dataclass(frozen=True)
class ShardedBatch:
    """What :func:`exchange_rows` needs to send a rank's rows back to the tokens
    :func:`gather_ids` took them for: the replica's batch shape and token count,
    and the mesh axes over which the rows differ from device to device."""

    batch_shape: tuple[int, ...]
    n_tokens: int
    varying: tuple[str, ...]


def gather_ids(ids: jax.Array, plan: ShardPlan) -> tuple[jax.Array, ShardedBatch]:
    """This rank's ids to look up, ``[g, slot, part]`` (inside ``shard_map``).

    ``ids`` ``[..., n_cols]`` are this replica's tokens (the same on every TP
    rank). They are padded to ``plan.slot`` tokens and ``shards * part``
    columns with DEAD_ID; with head sharding over EDP the TP rank's columns are
    all-gathered over the EDP axis (``g = edp``: every replica's tokens), else
    ``g = 1``. Returns the ids and what :func:`exchange_rows` needs.
    """
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be a ShardPlan, got {type(plan).__name__}")
    ids = as_ids(ids)
    if ids.shape[-1] != plan.n_cols:
        raise ValueError(f"ids must be [..., {plan.n_cols}] (one per hash column), got {ids.shape}")
    _check_axes(plan)
    batch_shape = tuple(ids.shape[:-1])
    n_tokens = math.prod(batch_shape)
    slot = n_tokens if plan.slot is None else plan.slot
    if n_tokens > slot:
        raise ValueError(f"{n_tokens} tokens on this replica exceed the token slot of {slot}")
    part = plan.part
    flat = ids.reshape(n_tokens, plan.n_cols)
    flat = jnp.pad(
        flat,
        ((0, slot - n_tokens), (0, plan.shards * part - plan.n_cols)),
        constant_values=DEAD_ID,
    )
    tp_rank = _rank(plan.tp_axis, plan.tp)
    if plan.exchanges_rows:
        group = plan.edp * part
        mine = jax.lax.dynamic_slice_in_dim(flat, tp_rank * group, group, axis=1)
        gathered = jax.lax.all_gather(mine, plan.edp_axis, axis=0)  # [edp, slot, edp * part]
        edp_rank = jax.lax.axis_index(plan.edp_axis)
        own = jax.lax.dynamic_slice_in_dim(gathered, edp_rank * part, part, axis=2)
    else:
        own = jax.lax.dynamic_slice_in_dim(flat, tp_rank * part, part, axis=1)[None]
    varying = set(_varying_axes(own))
    varying.update(
        name for name, size in ((plan.tp_axis, plan.tp), (plan.edp_axis, plan.edp)) if size > 1
    )
    return own, ShardedBatch(batch_shape, n_tokens, tuple(sorted(varying)))


def exchange_rows(rows: jax.Array, plan: ShardPlan, batch: ShardedBatch) -> jax.Array:
    """This rank's looked-up rows ``[g, slot, part, dim]`` -> the replica's
    ``batch.batch_shape + (n_cols, dim)`` (inside ``shard_map``).

    Head sharding: the rows go back to the replica that owns each token (all-to-all
    or all-gather + select over EDP); then every mode all-gathers columns over TP
    and cuts the slot and column padding.
    """
    rows = _mark_varying(rows, batch.varying)
    g, slot, part, dim = rows.shape
    if plan.exchanges_rows:
        if plan.exchange == "all_to_all":
            # [source replica, ...] -> [head shard, ...]: only this replica's tokens.
            rows = jax.lax.all_to_all(rows, plan.edp_axis, 0, 0, tiled=True)
        else:
            every = jax.lax.all_gather(rows, plan.edp_axis, axis=0)  # [shard, replica, ...]
            rows = jax.lax.dynamic_index_in_dim(
                every, jax.lax.axis_index(plan.edp_axis), axis=1, keepdims=False
            )
        rows = rows.transpose(1, 0, 2, 3).reshape(slot, g * part, dim)
    else:
        rows = rows[0]
    if plan.tp > 1:
        rows = _gather_invariant(rows, plan.tp_axis, axis=1)
    rows = rows[: batch.n_tokens, : plan.n_cols]
    return rows.reshape(batch.batch_shape + (plan.n_cols, dim))


# -- meshes ------------------------------------------------------------------


@functools.cache
def _process_hosts(process_count: int) -> tuple[str, ...]:
    """Each process's host name, gathered from every process (a collective)."""
    name = socket.gethostname().encode()[:255]
    if process_count == 1:
        return (name.decode(),)
    from jax.experimental import multihost_utils

    record = np.zeros(258, np.int32)
    record[0], record[1] = jax.process_index(), len(name)
    record[2 : 2 + len(name)] = np.frombuffer(name, np.uint8)
    records = np.asarray(multihost_utils.process_allgather(record)).reshape(process_count, -1)
    hosts = [""] * process_count
    for row in records:
        hosts[int(row[0])] = bytes(row[2 : 2 + int(row[1])].astype(np.uint8)).decode()
    return tuple(hosts)


def default_node_of() -> NodeOf:
    """Device -> node: the host name of the device's process (one node per host).

    Under ``jax.distributed`` the first call gathers every process's host name,
    a collective: every process must make it (``engram_mesh`` and
    ``make_sharded_lookup`` do, when no ``node_of`` is given).
    """
    hosts = _process_hosts(jax.process_count())
    return lambda device: hosts[device.process_index]


def engram_mesh(
    tp: int = 1,
    edp: int | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    node_of: NodeOf | None = None,
    axis_names: tuple[str, str, str] = MESH_AXES,
    axis_types: tuple[AxisType, ...] | None = None,
) -> Mesh:
    """A ``(dp, edp, tp)`` mesh: dp across nodes (and groups), edp node-local, tp innermost.

    Devices (default ``jax.devices()``, every process's) are grouped by node
    (``node_of``; default: by host, gathered from every process under
    ``jax.distributed``), ordered by process and id within a node, and split
    into blocks of ``tp * edp``. ``edp`` defaults to every replica of a node
    (``devices per node // tp``). Raises if nodes differ in size or an EDP
    group would span two nodes. Axis types default to Explicit (as
    ``jax.make_mesh``).
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must name at least one device")
    node_of = node_of or default_node_of()
    nodes: dict[Hashable, list[jax.Device]] = {}
    for device in sorted(devices, key=lambda d: (d.process_index, d.id)):
        nodes.setdefault(node_of(device), []).append(device)
    counts = {len(group) for group in nodes.values()}
    if len(counts) != 1:
        sizes = {str(node): len(group) for node, group in nodes.items()}
        raise ValueError(f"every node must have the same number of devices, got {sizes}")
    per_node = counts.pop()
    if not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if edp is None:
        edp = max(1, per_node // tp)
    _check_sizes(tp, edp, "heads")
    ordered = [device for group in nodes.values() for device in group]
    if len(ordered) % (tp * edp):
        raise ValueError(f"{len(ordered)} devices do not split into tp * edp = {tp * edp} blocks")
    grid = np.array(ordered, dtype=object).reshape(-1, edp, tp)
    types = axis_types if axis_types is not None else (AxisType.Explicit,) * 3
    mesh = Mesh(grid, axis_names, axis_types=types)
    check_mesh(mesh, edp_axis=axis_names[1], node_of=node_of)
    return mesh


def _coords(mesh: Mesh) -> dict[jax.Device, dict[str, int]]:
    names = mesh.axis_names
    return {
        mesh.devices[index]: dict(zip(names, index, strict=True))
        for index in np.ndindex(mesh.devices.shape)
    }


def check_mesh(
    mesh: Mesh,
    plan: ShardPlan | None = None,
    *,
    edp_axis: str | None = None,
    node_of: NodeOf | None = None,
) -> None:
    """Raise unless the mesh has the plan's axis sizes and every EDP group is on one node."""
    if plan is not None:
        edp_axis = plan.edp_axis
        for label, name, size in (("tp", plan.tp_axis, plan.tp), ("edp", plan.edp_axis, plan.edp)):
            actual = mesh.shape.get(name, 1)
            if actual != size:
                raise ValueError(
                    f"the plan has {label}={size} but the mesh's axis {name!r} has size {actual} "
                    f"(mesh axes {dict(mesh.shape)})"
                )
    if edp_axis is None or mesh.shape.get(edp_axis, 1) == 1:
        return
    node_of = node_of or default_node_of()
    axis = mesh.axis_names.index(edp_axis)
    groups = np.moveaxis(mesh.devices, axis, -1).reshape(-1, mesh.shape[edp_axis])
    for group in groups:
        where = {node_of(device) for device in group}
        if len(where) > 1:
            raise ValueError(
                f"EDP axis {edp_axis!r} spans nodes: devices {[d.id for d in group]} are on "
                f"{sorted(map(str, where))}; an EDP group must share one node"
            )


# -- tables for a mesh ---------------------------------------------------------


def device_shards(mesh: Mesh, plan: ShardPlan) -> dict[jax.Device, HeadShard]:
    """The head shard each device of ``mesh`` must hold."""
    return {
        device: plan.shard(coord.get(plan.tp_axis, 0), coord.get(plan.edp_axis, 0))
        for device, coord in _coords(mesh).items()
    }


def _held_rows(table: Table, device: jax.Device) -> tuple[int, int]:
    if isinstance(table, ShardedTable):
        return table.row_range(device)
    if isinstance(table, EngramTable):
        ordinal = device_ordinal(device)
        _check_readable(device, table, ordinal)
        held_by = table.allocation.device_ordinal
        if held_by is not None and held_by != ordinal:
            # Host memory mapped for one GPU only is registered under that GPU's
            # ordinal; a CPU device's lookup (ordinal = its jax id) would not find it.
            raise ValueError(
                f"{table!r} is registered for GPU {held_by} only; {device} (ordinal {ordinal}) "
                "would not find it: wrap it in a ShardedTable"
            )
        return table.row_start, table.row_end
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
    ordinal = device_ordinal(device)
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
    me = jax.process_index()
    made: dict[tuple, EngramTable] = {}
    tables: dict[jax.Device, EngramTable] = {}
    try:
        for device, shard in device_shards(mesh, plan).items():
            if device.process_index != me:
                continue
            rows = (shard.row_start, shard.row_stop)
            if placement == "device":
                where: tuple = ("gpu", device_ordinal(device))
            else:
                node = _host_node(device, placement)
                where = () if node is None else ("node", node)
            key = rows + where
            if key not in made:
                # The first device of a group picks the memory (its GPU, its NUMA node).
                made[key] = EngramTable.from_arrays(
                    weight[rows[0] : rows[1]],
                    scale[rows[0] : rows[1]],
                    placement=placement,
                    row_start=rows[0],
                    device=device if where else None,
                )
            tables[device] = made[key]
        return ShardedTable(tables)
    except BaseException:
        for table in made.values():
            table.close()
        raise


# -- the whole thing, shard_map included ----------------------------------------


def _data_axes(mesh: Mesh, plan: ShardPlan) -> tuple[str, ...]:
    return tuple(name for name in mesh.axis_names if name != plan.tp_axis)


def _place(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    # jax.shard_map wants its inputs already laid out as in_specs says.
    explicit = {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == AxisType.Explicit
    }
    used = {
        name
        for entry in spec
        if entry
        for name in (entry if isinstance(entry, tuple) else (entry,))
    }
    sharding = NamedSharding(mesh, spec)
    if used and used <= explicit:
        return jax.reshard(x, sharding)
    if used & explicit:
        raise ValueError(f"the token axes {sorted(used)} mix Explicit and Auto mesh axes")
    return jax.lax.with_sharding_constraint(x, sharding)


def map_over_replicas(
    body: Callable[[jax.Array], jax.Array], mesh: Mesh, plan: ShardPlan, *, check_vma: bool = True
) -> Callable[[jax.Array], jax.Array]:
    """A jitted ``ids -> rows`` that runs ``body`` on each replica's block under ``shard_map``.

    ``ids`` ``[replicas * slot, ..., n_cols]``: axis 0 is split over every mesh
    axis but TP (dp, edp, ...), one block of tokens per replica; the result is
    laid out the same way. :func:`engram_jax.make_sharded_lookup` is this with
    the sharded lookup as ``body``.
    """
    spec = P(_data_axes(mesh, plan))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma)
    replicas = math.prod(mesh.shape[name] for name in _data_axes(mesh, plan))

    @jax.jit
    def run(ids: jax.Array) -> jax.Array:
        if ids.ndim < 2 or ids.shape[0] % replicas:
            raise ValueError(
                f"ids must be [replicas * slot, ..., n_cols] with {replicas} replicas "
                f"(every mesh axis but {plan.tp_axis!r}), got shape {ids.shape}"
            )
        return mapped(_place(ids, mesh, spec))

    return run


def pad_replicas(
    ids_per_replica: Sequence[np.ndarray], slot: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Stack each replica's ids ``[n_r, n_cols]`` into ``[replicas * slot, n_cols]``,
    padding with DEAD_ID. Returns the ids and the token counts ``n_r``.

    ``slot`` defaults to the largest count (at least 1); a larger count raises.
    """
    arrays = [narrow_ids(np.asarray(ids)).astype(np.int32) for ids in ids_per_replica]
    if not arrays:
        raise ValueError("no replicas")
    if slot is not None and (not isinstance(slot, (int, np.integer)) or slot < 1):
        raise ValueError(f"slot must be a positive int or None, got {slot!r}")
    widths = {a.shape[-1] if a.ndim == 2 else None for a in arrays}
    if len(widths) != 1 or None in widths:
        raise ValueError(
            f"each replica's ids must be [tokens, n_cols], got {[a.shape for a in arrays]}"
        )
    counts = np.array([a.shape[0] for a in arrays])
    slot = max(1, int(counts.max())) if slot is None else int(slot)
    for replica, count in enumerate(counts):
        if count > slot:
            raise ValueError(
                f"replica {replica} has {count} tokens, more than the token slot {slot}"
            )
    out = np.full((len(arrays), slot, widths.pop()), DEAD_ID, dtype=np.int32)
    for replica, ids in enumerate(arrays):
        out[replica, : ids.shape[0]] = ids
    return out.reshape(len(arrays) * slot, -1), counts


def split_replicas(rows: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """Undo :func:`pad_replicas` on the looked-up rows: each replica's real tokens."""
    rows = np.asarray(rows)
    if len(counts) == 0 or rows.ndim == 0 or rows.shape[0] % len(counts):
        raise ValueError(
            f"rows must be [replicas * slot, ...] for the {len(counts)} replica counts "
            f"pad_replicas returned, got shape {rows.shape}"
        )
    slot = rows.shape[0] // len(counts)
    return [rows[r * slot : r * slot + int(n)] for r, n in enumerate(counts)]
