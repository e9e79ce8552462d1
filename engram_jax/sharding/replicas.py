"""One block of tokens per replica: :func:`map_over_replicas` runs a per-replica
body under ``shard_map``, and :func:`pad_replicas` / :func:`split_replicas`
stack replicas' token counts into that layout and back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from engram_jax._args import narrow_host_ids
from engram_jax._format import DEAD_ID
from engram_jax.sharding.plan import ShardPlan


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
    arrays = [narrow_host_ids(np.asarray(ids)).astype(np.int32) for ids in ids_per_replica]
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
