"""Meshes for Engram lookups: a ``(dp, edp, tp)`` mesh whose EDP axis never spans
two nodes, the check that a mesh fits a plan, and which head shard each of its
devices holds.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from engram_jax.sharding.plan import HeadShard, ShardPlan, check_sizes

MESH_AXES = ("dp", "edp", "tp")

NodeOf = Callable[[jax.Device], Hashable]


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
    check_sizes(tp, edp, "heads")
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


def device_shards(mesh: Mesh, plan: ShardPlan) -> dict[jax.Device, HeadShard]:
    """The head shard each device of ``mesh`` must hold."""
    return {
        device: plan.shard(coord.get(plan.tp_axis, 0), coord.get(plan.edp_axis, 0))
        for device, coord in _coords(mesh).items()
    }
