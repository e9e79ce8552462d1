"""The collectives of a lookup with a plan, inside ``shard_map``: :func:`gather_ids`
before the gather (pad, all-gather the EDP group's ids) and :func:`exchange_rows`
after it (rows, or a packed exchange's records, back to their replica, TP
column gather), and the vma helpers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from engram_jax._args import as_ids
from engram_jax._format import DEAD_ID
from engram_jax.sharding.plan import ShardPlan


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


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` typed as varying over the mesh axes ``like`` varies over: for an FFI
    result computed from ``like`` alone (typed invariant, whatever its operands)."""
    return _mark_varying(x, tuple(sorted(_varying_axes(like))))


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
    and cuts the slot and column padding. With a plan that
    :attr:`~ShardPlan.moves_records`, ``rows`` are packed records (uint8, ``dim``
    their bytes): they move the same way and come back undecoded.
    """
    rows = _mark_varying(rows, batch.varying)
    g, slot, part, dim = rows.shape
    if plan.exchanges_rows:
        if plan.exchange in ("all_to_all", "all_to_all_packed"):
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
