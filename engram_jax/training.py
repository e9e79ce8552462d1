"""Training trainable tables inside jit: the lookup of a :class:`TrainableTable`
(rows in its own dtype) and :func:`apply_gradients`, the sparse row update.

ids -> ``engram_train_lookup`` -> rows -> the model's loss -> ``jax.grad`` ->
the rows' cotangents -> ``engram_apply_gradients`` (a custom call with a side
effect: it writes the table in place) -> an update token. XLA orders calls
only by data: a later lookup of the same table in the same program that must
see the new rows takes the token as ``after=`` (passed to its custom call as
an operand the call does not read); across jitted calls the order is program
order. With a :class:`~engram_jax.ShardPlan` the gradient rows go
back to the devices owning the rows through the transpose of the lookup's
row exchange, and every shard updates only its rows.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import compute_on as compute_on_module
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from engram_jax import _native, sharding
from engram_jax._args import as_ids, check_max_ctas, positive_int, resolve_order
from engram_jax._format import DEAD_ID
from engram_jax._slots import TICKET_WORDS, slot_for
from engram_jax.row_optimizers import FORMAT_CODES
from engram_jax.sharding import NodeOf, ShardPlan
from engram_jax.trainable import TrainableTable
from engram_jax.trainable_sharded import ShardedTrainableTable, check_trainable_mesh

Trainable = TrainableTable | ShardedTrainableTable

# The ``records`` attribute of lookup_start / lookup_done for a trainable table's rows,
# by dtype (ffi/handlers/train_args.h: RowFormat + 1).
TRAINABLE_OUTPUTS = {name: code + 1 for name, code in FORMAT_CODES.items()}

# The grid of a background update (apply_gradients_start's default max_ctas): a
# quarter of an H200's SMs, so the model beside it keeps the rest. The training
# example's stale step (two 4 GiB bf16 tables, lazy Adam, 786,432 ids a step)
# against the HBM-table step: 32 CTAs 1.10x (the update 29.9 ms a step beside the
# step's GEMMs), 64 1.10x and 1.12x in two runs (22.1 ms, the GEMMs slowed more),
# 128 1.21x, 16 1.20x (42.7 ms: longer than the forward pass it hides behind).
UPDATE_CTAS = 32


def is_trainable(table: object) -> bool:
    return isinstance(table, (TrainableTable, ShardedTrainableTable))


def check_trainable(table: object, what: str = "apply_gradients") -> None:
    """Raise unless ``table`` is an open trainable table."""
    if not is_trainable(table):
        from_fp8 = type(table).__name__ in ("EngramTable", "ShardedTable")
        hint = (
            ": fp8 serving tables are read-only; train a TrainableTable and export it"
            if from_fp8
            else ""
        )
        raise TypeError(f"{what} takes a TrainableTable, got {type(table).__name__}{hint}")
    if table.closed:
        raise ValueError(f"{table!r} is closed")


def tokens_of(after: Any, what: str) -> list[jax.Array]:
    """``after`` (an update token, a lookup handle's arrays, or a sequence of them) as a
    flat list of arrays to order behind."""
    if after is None:
        return []
    items = after if isinstance(after, (list, tuple)) else [after]
    out = []
    for item in items:
        if isinstance(item, UpdateHandle):
            # Its ticket exists once the update is queued, long before it is written.
            raise TypeError(
                f"{what}: after= got an UpdateHandle; pass apply_gradients_done(handle) "
                "(the update token), which exists only once the rows are written"
            )
        leaves = jax.tree_util.tree_leaves(item)
        if not leaves and item is not None:
            raise TypeError(f"{what}: after= got {type(item).__name__}, which holds no arrays")
        for leaf in leaves:
            if not isinstance(leaf, (jax.Array, np.ndarray)):
                raise TypeError(
                    f"{what}: after= takes update tokens (from apply_gradients) or lookup "
                    f"handles, got {type(leaf).__name__}"
                )
            out.append(leaf)
    return out


def order_after(value: Any, after: Sequence[jax.Array]) -> Any:
    """``value`` (a pytree of arrays), made to wait for every array in ``after`` through
    an ``optimization_barrier`` (for the fp8 lookups: the CUDA backend keeps it; the
    trainable table's calls take ``after`` as operands instead, which no backend drops)."""
    if not after:
        return value
    return jax.lax.optimization_barrier((value, list(after)))[0]


# -- lookup -------------------------------------------------------------------------


def trainable_local_lookup(
    table: Trainable, ids: jax.Array, after: Sequence[jax.Array] = ()
) -> jax.Array:
    """This device's rows of ``table`` for ``ids`` (int32, checked), in the table's dtype.
    ``after``: arrays passed to the call as operands it does not read, so it runs after
    whatever made them (XLA's CPU backend drops optimization barriers, not operands)."""
    out_type = jax.ShapeDtypeStruct(ids.shape + (table.dim,), jnp.dtype(table.dtype))
    if ids.size == 0:
        return jnp.zeros(out_type.shape, out_type.dtype)
    _native.ensure_registered()
    target = jax.ffi.ffi_call("engram_train_lookup", out_type, vmap_method="broadcast_all")
    return target(
        ids,
        *after,
        table_key=np.int64(table.key),
        dim=np.int64(table.dim),
        format=np.int64(FORMAT_CODES[table.dtype.name]),
    )


def trainable_order(order: str, num_ids: int) -> str:
    """The gather a trainable table's lookup of ``num_ids`` ids runs: ``"plain"``, or
    ``"dedup"`` for ``"sorted"``, ``"dedup"`` and ``"auto"`` where it picks dedup.

    ``"sorted"`` runs the dedup gather: both sort the ids (jnp.unique's sort is the
    sort), and a sort without dedup would fetch every repeat over PCIe again for
    nothing; only the scan and compaction that dedup adds over a sort differ, and
    they are cheap beside a host gather."""
    return "plain" if resolve_order(order, num_ids) == "plain" else "dedup"


def distinct_ids(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``ids`` ``[...]`` -> (the distinct ids, sorted, padded with DEAD_ID to ``ids.size``;
    ``inverse`` ``[...]``, each id's place among them), so ``rows[inverse]`` of the
    distinct ids' rows are the rows of ``ids``. The padding gathers zero rows that no
    id reads; ids the table does not hold stay themselves (zero rows too)."""
    flat = ids.reshape(-1)
    unique, inverse = jnp.unique(flat, size=flat.size, fill_value=DEAD_ID, return_inverse=True)
    return unique, inverse.reshape(ids.shape)


def expand_rows(rows: jax.Array, inverse: jax.Array) -> jax.Array:
    """The rows of the distinct ids ``[n, dim]`` put back at every position: ``[..., dim]``."""
    return rows[inverse]


def trainable_rows(
    table: Trainable, ids: jax.Array, order: str, after: Sequence[jax.Array] = ()
) -> jax.Array:
    """:func:`trainable_local_lookup` in ``order`` (``"plain"`` or ``"dedup"``, from
    :func:`trainable_order`): the same rows bit for bit, each distinct row read once."""
    if order == "plain" or ids.size == 0:
        return trainable_local_lookup(table, ids, after)
    unique, inverse = distinct_ids(ids)
    return expand_rows(trainable_local_lookup(table, unique, after), inverse)


def check_trainable_plan(plan: ShardPlan | None) -> None:
    if plan is not None and plan.exchange == "all_to_all_packed":
        raise ValueError(
            "a packed exchange moves fp8 records; a trainable table's rows move as they are: "
            "use ShardPlan(exchange='all_to_all') (or 'all_gather_select')"
        )


def trainable_lookup(
    table: Trainable,
    ids: ArrayLike,
    *,
    plan: ShardPlan | None = None,
    after: Any = None,
    order: str = "plain",
) -> jax.Array:
    """:func:`~engram_jax.lookup` of a trainable table: ``[..., H]`` ids -> ``[..., H, dim]``
    rows in the table's dtype, zeros for ids it does not hold. ``after``: update tokens
    (or any arrays) the read must wait for. ``order``: as :func:`trainable_order` says,
    with a plan over the ids this device gathers."""
    check_trainable(table, "lookup")
    check_trainable_plan(plan)
    earlier = tokens_of(after, "lookup")
    if plan is not None:
        own, batch = sharding.gather_ids(as_ids(ids), plan)
        rows = trainable_rows(table, own, trainable_order(order, own.size), earlier)
        return sharding.exchange_rows(rows, plan, batch)
    ids = as_ids(ids)
    return trainable_rows(table, ids, trainable_order(order, ids.size), earlier)


# -- the update -----------------------------------------------------------------------


def _as_grads(grads: ArrayLike, ids: jax.Array, dim: int) -> jax.Array:
    if not isinstance(grads, (jax.Array, np.ndarray)):
        grads = np.asarray(grads)
    dtype = jnp.result_type(grads)
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"grads must be float32 or bfloat16, got {dtype}")
    expected = tuple(ids.shape) + (dim,)
    if tuple(grads.shape) != expected:
        raise ValueError(
            f"grads must have shape ids.shape + (dim,) = {expected}, got {tuple(grads.shape)}"
        )
    return jnp.asarray(grads)


def _as_scalar(value: ArrayLike, name: str, kind: str) -> jax.Array:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a {kind} scalar, got {value!r}")
    if not isinstance(value, (jax.Array, np.ndarray, np.generic, int, float)):
        raise TypeError(f"{name} must be a {kind} scalar, got {type(value).__name__}")
    shape = np.shape(value)
    if shape != ():
        raise ValueError(f"{name} must be a scalar, got shape {shape}")
    dtype = jnp.result_type(value)
    ok = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    if kind == "integer":
        ok = jnp.issubdtype(dtype, jnp.integer)
    if not ok:
        raise TypeError(f"{name} must be a {kind} scalar, got {dtype}")
    return value


def _flat(ids: jax.Array, grads: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``ids`` as ``[n]`` and ``grads`` as ``[n, dim]`` for the custom call, which takes
    the default layout: XLA lays a caller's ``grads[:, None]`` out with its unit axis
    major, and its CPU backend copied the whole gradient array to hand the call
    ``[n, 1, dim]`` row-major. The flat shapes are bitcasts of any row-major array."""
    return ids.reshape(-1), grads.reshape(-1, grads.shape[-1])


def _update_call(table: Trainable, ids: jax.Array, grads: jax.Array, scale: jax.Array, after):
    """The custom call on this device: the update token (an int32 zero scalar).
    ``after``: operands it does not read, so it runs after whatever made them."""
    _native.ensure_registered()
    # One result, the token and then the sort's buffers (on CUDA also the sums of hot
    # rows' chunks): XLA on CUDA ran a call of two results twice when its ids were a
    # slice of a larger array (ffi/kernels/train_rows.h, UpdateResultBytes).
    size = int(_native.native.update_result_bytes(int(ids.size), int(grads.shape[-1])))
    ids, grads = _flat(ids, grads)
    target = jax.ffi.ffi_call(
        "engram_apply_gradients",
        jax.ShapeDtypeStruct((size,), jnp.uint8),
        has_side_effect=True,
    )
    result = target(
        ids,
        grads,
        scale,
        *after,
        **_update_attrs(table),
    )
    return jax.lax.bitcast_convert_type(result[:4], jnp.int32)


def _update_attrs(table: Trainable) -> dict:
    """What every update call (synchronous or a start) carries: the table's key and
    layout, and its optimizer's code and scalars, which the handler checks."""
    optimizer = table.optimizer
    return dict(
        table_key=np.int64(table.key),
        dim=np.int64(table.dim),
        format=np.int64(FORMAT_CODES[table.dtype.name]),
        optimizer=np.int64(optimizer.code),
        moment_format=np.int64(optimizer.moment_code),
        **optimizer.scalars(),
    )


# jax's compute_on in its function form: ``compute_on`` itself from jax 0.11,
# ``compute_on2`` before (where ``compute_on`` is the context manager).
if "out_memory_spaces" in inspect.signature(compute_on_module.compute_on).parameters:
    _compute_on = compute_on_module.compute_on
else:
    _compute_on = compute_on_module.compute_on2


def _on_xla_stream(fn, stream: int):
    """``fn`` as a call XLA runs on its GPU stream ``stream``, asynchronously
    (``compute_on("gpu_stream:N")``). The CPU backend ignores the stream."""
    return _compute_on(
        fn, compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device
    )


def _batched(call):
    """``call(ids, grads, scale, *after)`` (one update's custom call) as a function that
    vmap turns into one update of every batch element's ids at once (their gradients
    summed as any duplicates); its result (a token or a ticket) is not batched."""

    @jax.custom_batching.custom_vmap
    def update(ids, grads, scale, *after):
        return call(ids, grads, scale, after)

    @update.def_vmap
    def _rule(axis_size, in_batched, ids, grads, scale, *after):
        ids_batched, grads_batched, scale_batched = in_batched[:3]
        if scale_batched:
            raise ValueError(
                "apply_gradients under vmap: learning_rate and step must be the same for "
                "the whole batch (not batched): one update applies every element's gradients"
            )
        if not ids_batched:
            ids = jnp.broadcast_to(ids, (axis_size, *ids.shape))
        if not grads_batched:
            grads = jnp.broadcast_to(grads, (axis_size, *grads.shape))
        return update(ids, grads, scale, *after), False

    return update


def apply_gradients(
    table: Trainable,
    ids: ArrayLike,
    grads: ArrayLike,
    learning_rate: ArrayLike,
    step: ArrayLike | None = None,
    *,
    plan: ShardPlan | None = None,
    after: Any = None,
    stream: int | None = None,
) -> jax.Array:
    """Apply ``grads`` (the cotangent of ``lookup(table, ids)``) to ``table`` in place,
    with the table's optimizer; returns the update token (an int32 scalar).

    ``ids`` ``[..., H]`` int32, ``grads`` ``[..., H, dim]`` float32 or bfloat16.
    Equal ids are summed in a fixed order (the ids sorted stably; each run of
    equal ids cut into chunks of 64 entries, each chunk summed in position order
    in float32 from +0.0, the chunk sums added in order), so the result is the
    same bits run to run and on every backend; ids the table does not hold (``-1``,
    outside its rows or its shard) are ignored; each distinct row is read,
    updated and written once. ``learning_rate``: a Python or traced scalar (an
    optax schedule's value); ``step``: the global step, from 1, for lazy Adam's
    bias correction.

    Ordering: the update runs once its operands exist. A later lookup of the
    same table in the same jitted program that must see the new rows passes the
    token as ``after=``; an update that must wait for something its gradients do
    not depend on (another update of the table, or the lookup of this step when
    the loss is linear in the rows) takes it as ``after=``. Across jitted calls
    the order is program order. Under ``vmap`` the batch's ids and gradients go
    into one update (``learning_rate`` and ``step`` unbatched); in a ``scan``
    each iteration updates in turn.

    ``stream``: on CUDA, run the update on XLA's GPU stream ``stream`` (>= 1; jax's
    ``compute_on("gpu_stream:N")``), so the program's later work that does not take
    the token runs beside it; whatever takes the token waits for it on XLA's stream.
    The update reads its rows over PCIe on every SM, so it pays off beside work that
    does not need all of them at once; the CPU ignores it. Same rows either way.
    jax then commits the program's outputs to their device (``compute_on`` annotates
    the token's memory): a jitted step that takes its outputs back in should get
    committed arguments on its first call too (``jax.device_put``), or the second
    call compiles again.

    ``plan``: inside ``shard_map``, as for :func:`~engram_jax.lookup` with that
    plan: ``ids``/``grads`` are this replica's tokens and their cotangents; the
    gradient rows travel back to the devices owning the rows through the
    transpose of the lookup's exchange, the replicas' gradients for the same
    shard are gathered in replica order, and each shard's rows are written once.
    """
    stream = positive_int(stream, "stream", " (an XLA GPU stream; 0 is XLA's own)")
    ids, grads, scale, earlier = _prepare_update(
        table, ids, grads, learning_rate, step, plan, after, "apply_gradients"
    )
    token = _update_now(table, ids, grads, scale, earlier, stream)
    if plan is not None:
        token = sync_token(token, plan)
    return token


def _update_now(table, ids, grads, scale, earlier, stream=None) -> jax.Array:
    """The update of checked inputs (:func:`_prepare_update`'s) on XLA's stream (or
    ``stream``): its token."""
    if ids.size == 0:
        return jnp.zeros((), jnp.int32)
    update = _batched(functools.partial(_update_call, table))
    if stream is not None:
        update = _on_xla_stream(update, stream)
    return update(ids, grads, scale, *earlier)


def _prepare_update(table, ids, grads, learning_rate, step, plan, after, what: str):
    """The checks every update makes, in one place: ``(ids, grads, scale, earlier)``,
    with ``scale`` the optimizer's step size and, with a plan, the ids and gradients
    already sent to the devices owning their rows."""
    check_trainable(table, what)
    check_trainable_plan(plan)
    ids = as_ids(ids)
    grads = _as_grads(grads, ids, table.dim)
    optimizer = table.optimizer
    _as_scalar(learning_rate, "learning_rate", "float")
    if optimizer.needs_step:
        if step is None:
            raise ValueError(f"{optimizer.name} needs step= (the global step, from 1)")
        _as_scalar(step, "step", "integer")
        if not isinstance(step, jax.core.Tracer) and int(np.asarray(step)) < 1:
            raise ValueError(f"step counts from 1, got {int(np.asarray(step))}")
    elif step is not None:
        _as_scalar(step, "step", "integer")
    for item in after if isinstance(after, (list, tuple)) else [after]:
        if type(item).__name__ == "LookupHandle" and item.pending:
            # Its gather may still run on a side stream: the update must wait for the
            # rows themselves, which only lookup_done gives.
            raise ValueError(
                f"{what}: after= got a pending LookupHandle; pass lookup_done(handle) "
                "(the rows) so the update waits for the gather to finish"
            )
    earlier = tokens_of(after, what)
    scale = optimizer.step_size(learning_rate, step)
    if plan is not None:
        ids, grads = to_owners(table, ids, grads, plan)
    return ids, grads, scale, earlier


# -- the update in the background ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UpdateHandle:
    """An update in flight, from :func:`apply_gradients_start`; pass it to
    :func:`apply_gradients_done`, which returns the update token.

    A pytree. Array leaves: ``ticket`` (which call site staged the update and which
    start it was) or, for an update made at once (outside a trace, or of no ids),
    ``token`` (its update token); the other one is ``None``. Static: the call
    site's ``slot`` and the ``plan`` whose devices' tokens done joins.
    """

    ticket: jax.Array | None
    token: jax.Array | None
    slot: int
    plan: ShardPlan | None

    @property
    def pending(self) -> bool:
        """Whether the update may still be running (``False``: made at once)."""
        return self.token is None


jax.tree_util.register_dataclass(
    UpdateHandle, data_fields=["ticket", "token"], meta_fields=["slot", "plan"]
)


def _start_call(table: Trainable, slot: int, max_ctas: int, ids, grads, scale, after):
    """The start's custom call on this device: its ticket."""
    _native.ensure_registered()
    start = jax.ffi.ffi_call(
        "engram_apply_gradients_start",
        jax.ShapeDtypeStruct((TICKET_WORDS,), jnp.uint32),
        has_side_effect=True,
    )
    ids, grads = _flat(ids, grads)
    return start(
        ids,
        grads,
        scale,
        *after,
        max_ctas=np.int64(max_ctas),
        slot=np.int64(slot),
        **_update_attrs(table),
    )


def apply_gradients_start(
    table: Trainable,
    ids: ArrayLike,
    grads: ArrayLike,
    learning_rate: ArrayLike,
    step: ArrayLike | None = None,
    *,
    plan: ShardPlan | None = None,
    after: Any = None,
    max_ctas: int | None = None,
    tag: Hashable | None = None,
) -> UpdateHandle:
    """Start :func:`apply_gradients` in the background; :func:`apply_gradients_done`
    returns its update token. The same rows, state and token as
    ``apply_gradients(table, ids, grads, learning_rate, step, plan=plan, after=after)``,
    bit for bit.

    On CUDA the ids, gradients and learning rate are copied into the call site's own
    staging on XLA's stream, and the update (sort, then each distinct row read,
    updated and written back) runs from there on the side stream every
    :func:`~engram_jax.lookup_start` of the device shares, on at most ``max_ctas``
    CTAs (default :data:`UPDATE_CTAS`), so the model's kernels keep the other SMs.
    XLA's stream waits for it only at ``apply_gradients_done``. On the CPU the update
    runs at once. Called outside a traced computation (``ids`` concrete) it updates at
    once on every backend.

    Rules, as for ``lookup_start``: pass the handle to ``apply_gradients_done`` before
    this call site starts again, and keep its compiled function alive until then. A
    lookup or update of the table that must see the new rows takes done's token as
    ``after=``; only :func:`~engram_jax.lookup_start` also takes the handle itself (its
    gather queues behind the update on the side stream, XLA's stream waits for
    neither). ``tag``: starts with the same tag share one completion event, so a
    handle one jitted call returns can be finished by the next (a training step that
    leaves its update to the next step); untagged, each trace makes a new event, part
    of the handle's pytree structure.

    Where the start and the done go in the program is XLA's choice within the data
    dependencies: tie the start to a value the model needs early and the done to a
    value it makes late (``jax.lax.optimization_barrier``), as the training example's
    one-step-stale step does.
    """
    check_max_ctas(max_ctas)
    ids, grads, scale, earlier = _prepare_update(
        table, ids, grads, learning_rate, step, plan, after, "apply_gradients_start"
    )
    if ids.size == 0 or not any(isinstance(x, jax.core.Tracer) for x in (ids, grads)):
        # Nothing to overlap with outside a trace; an update of no ids writes nothing.
        token = _update_now(table, ids, grads, scale, earlier)
        return UpdateHandle(ticket=None, token=token, slot=-1, plan=plan)
    slot = slot_for(tag)
    start = _batched(functools.partial(_start_call, table, slot, max_ctas or UPDATE_CTAS))
    return UpdateHandle(ticket=start(ids, grads, scale, *earlier), token=None, slot=slot, plan=plan)


def apply_gradients_done(handle: UpdateHandle) -> jax.Array:
    """Wait for an :func:`apply_gradients_start` and return its update token (an int32
    zero scalar), as :func:`apply_gradients` would. On CUDA only XLA's stream waits
    (for this call site's update alone); the host never does."""
    if not isinstance(handle, UpdateHandle):
        raise TypeError(
            "handle must be an UpdateHandle from apply_gradients_start, got "
            f"{type(handle).__name__}"
        )
    if not handle.pending:
        return handle.token
    if not isinstance(handle.ticket, jax.core.Tracer):
        raise ValueError(
            "apply_gradients_done got a started update outside a traced computation: call "
            "it inside jit (the same jit as apply_gradients_start, or a later one the "
            "handle is passed into)"
        )
    _native.ensure_registered()
    done = jax.ffi.ffi_call(
        "engram_apply_gradients_done",
        jax.ShapeDtypeStruct((), jnp.int32),
        has_side_effect=True,
    )
    token = done(handle.ticket, slot=np.int64(handle.slot))
    if handle.plan is not None:
        token = sync_token(token, handle.plan)
    return token


# -- sharded training ---------------------------------------------------------------


def _mesh_axes() -> tuple[str, ...]:
    return tuple(jax.sharding.get_abstract_mesh().axis_names)


def _copy_axes(plan: ShardPlan) -> tuple[str, ...]:
    """Mesh axes along which devices hold copies of the same head shard: every axis
    but TP (and, with head sharding, EDP), of size > 1."""
    own = {plan.tp_axis} | ({plan.edp_axis} if plan.mode == "heads" else set())
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in mesh.axis_names if a not in own and mesh.shape[a] > 1)


def to_owners(
    table: Trainable, ids: jax.Array, grads: jax.Array, plan: ShardPlan
) -> tuple[jax.Array, jax.Array]:
    """This device's ids and gradient rows for the update: the replica's cotangents
    sent back to the devices that looked the rows up (the transpose of
    :func:`~engram_jax.sharding.exchange_rows`), then gathered over the axes along
    which devices hold copies of one shard, so each copy sees every replica's rows."""
    if isinstance(table, TrainableTable) and jax.sharding.get_abstract_mesh().size > 1:
        raise ValueError(
            "a sharded update needs a ShardedTrainableTable (one writer for each memory "
            "block): every device would write one TrainableTable they all read"
        )
    own, batch = sharding.gather_ids(ids, plan)
    shape = own.shape + (table.dim,)
    primal = jnp.zeros(shape, grads.dtype)
    if batch.varying:
        primal = jax.lax.pcast(primal, batch.varying, to="varying")

    def exchange(rows):
        return sharding.exchange_rows(rows, plan, batch)

    _, transpose = jax.vjp(exchange, primal)
    (local,) = transpose(grads)
    copies = _copy_axes(plan)
    if copies:
        own = jax.lax.all_gather(own, copies, axis=0, tiled=True)
        local = jax.lax.all_gather(local, copies, axis=0, tiled=True)
    return own, local


def sync_token(token: jax.Array, plan: ShardPlan) -> jax.Array:
    """The update token, reduced over the devices that may share the written memory:
    no device passes it on before every copy's writer has written."""
    axes = tuple(a for a in _mesh_axes() if jax.sharding.get_abstract_mesh().shape[a] > 1)
    if not axes:
        return token
    return jax.lax.psum(token, axes)


def _place(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    sharding_ = NamedSharding(mesh, spec)
    if all(kind == AxisType.Explicit for kind in mesh.axis_types):
        return jax.reshard(x, sharding_)
    return jax.lax.with_sharding_constraint(x, sharding_)


def make_sharded_update(
    table: Trainable,
    mesh: Mesh,
    plan: ShardPlan,
    *,
    node_of: NodeOf | None = None,
    check_vma: bool = True,
):
    """A jitted ``(ids, grads, learning_rate, step=1) -> token`` that runs
    :func:`apply_gradients` with ``plan`` under ``shard_map``: the update that
    matches :func:`~engram_jax.make_sharded_lookup`'s lookup (``ids`` and ``grads``
    laid out as that lookup's ids and rows). Checks the mesh and the table first."""
    check_trainable(table)
    check_trainable_plan(plan)
    sharding.check_mesh(mesh, plan, node_of=node_of)
    check_trainable_mesh(table, mesh, plan)
    spec = P(tuple(name for name in mesh.axis_names if name != plan.tp_axis))

    def body(ids, grads, learning_rate, step):
        return apply_gradients(table, ids, grads, learning_rate, step, plan=plan)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(spec, spec, P(), P()), out_specs=P(), check_vma=check_vma
    )

    @jax.jit
    def run(ids, grads, learning_rate, step=1):
        ids, grads = as_ids(ids), jnp.asarray(grads)
        return mapped(
            _place(ids, mesh, spec),
            _place(grads, mesh, spec),
            jnp.asarray(learning_rate, jnp.float32),
            jnp.asarray(step, jnp.int32),
        )

    return run
