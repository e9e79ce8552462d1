"""engram_jax.ops: gather Engram rows inside jitted code, at once or in the background.

One operation with options: :func:`lookup` returns the rows;
:func:`lookup_start` and :func:`lookup_done` split it around the compute the
gather should hide behind. Options: the visiting ``order``, a hot-row
``cache``, a sharding ``plan`` (inside ``shard_map``) and the CUDA grid cap.
ids -> (``gather_ids`` with a plan) -> the ``engram_lookup`` /
``engram_cached_lookup`` / ``engram_lookup_start`` + ``engram_lookup_done``
FFI targets -> bf16 rows -> (``exchange_rows`` with a plan). A packed exchange
gathers packed records instead (``engram_lookup_records``, or start/done with
``records=1``), exchanges those and decodes them at the end
(``engram_decode_records``); :func:`lookup_records` and :func:`decode_records`
are those two ends. The table reaches the handler as an integer key; the
handler resolves it per device through the native registry, so one compiled
SPMD program reads each device's own table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from engram_jax import _native, sharding
from engram_jax._args import (
    ORDER_CODES,
    as_ids,
    check_max_ctas,
    check_table,
    resolve_order,
    without_tangent,
    workspace_bytes,
)
from engram_jax._format import BLOCK_SIZE, MAX_DIM, packed_record_bytes
from engram_jax._slots import TICKET_WORDS, slot_for
from engram_jax.hot_rows import HotRowCache, check_cache
from engram_jax.sharded_table import ShardedTable
from engram_jax.sharding import NodeOf, ShardedBatch, ShardPlan
from engram_jax.table import EngramTable
from engram_jax.trainable_sharded import check_trainable_mesh
from engram_jax.training import (
    TRAINABLE_OUTPUTS,
    Trainable,
    UpdateHandle,
    check_trainable_plan,
    distinct_ids,
    expand_rows,
    is_trainable,
    order_after,
    tokens_of,
    trainable_lookup,
    trainable_order,
    trainable_rows,
)

# The values of every lookup's ``order=``: "auto" picks one of the others by batch.
ORDERS: tuple[str, ...] = ("auto", *ORDER_CODES)

# A background gather's defaults: as few CTAs as keep up with where its rows come
# from, since every gather CTA on an SM holds back a CTA of the model's GEMMs (4 for
# plain order, which the link's address translation bounds; more as sorted, dedup and
# cached gathers move rows faster), and rows in table order, so neighbouring rows
# share their address translations. Measured beside a model on an H200:
# benchmarks/README.md, "Levers, measured".
PREFETCH_ORDER = "sorted"
PREFETCH_MIN_CTAS = 4
PREFETCH_MAX_CTAS = 16
PREFETCH_IDS_PER_CTA = 6144


def prefetch_ctas(
    num_ids: int, *, order: str = PREFETCH_ORDER, cache: HotRowCache | None = None
) -> int:
    """The default ``max_ctas`` of :func:`lookup_start` for ``num_ids`` ids in
    ``order`` (after ``"auto"`` is resolved) with or without a hot-row ``cache``:
    4 for plain order without a cache, else ``ceil(num_ids / 6144)`` clamped to
    ``[4, 16]`` (see the constants for the measurements)."""
    if int(num_ids) < 0:
        raise ValueError(f"num_ids must be >= 0, got {num_ids}")
    if resolve_order(order, num_ids) == "plain" and cache is None:
        return PREFETCH_MIN_CTAS
    wanted = -(-int(num_ids) // PREFETCH_IDS_PER_CTA)
    return max(PREFETCH_MIN_CTAS, min(PREFETCH_MAX_CTAS, wanted))


@dataclasses.dataclass(frozen=True)
class _Call:
    """A checked lookup: what every FFI call of it carries, and the ids it reads
    (with a plan, this rank's ids after :func:`~engram_jax.sharding.gather_ids`).
    ``records``: it returns packed records, decoded after the plan's exchange."""

    ids: jax.Array
    table_key: int
    dim: int
    order: str
    cache_key: int
    max_ctas: int | None
    plan: ShardPlan | None
    batch: ShardedBatch | None
    records: bool

    def attrs(self) -> dict[str, np.int64]:
        return _attrs(self.table_key, self.dim, self.order, self.cache_key)

    def out_type(self) -> jax.ShapeDtypeStruct:
        return _out_type(self.ids.shape, self.dim, self.records)


def _attrs(table_key: int, dim: int, order: str, cache_key: int) -> dict[str, np.int64]:
    """The attributes every FFI call of a lookup carries (start's and done's too)."""
    return {
        "table_key": np.int64(table_key),
        "dim": np.int64(dim),
        "order": np.int64(ORDER_CODES[order]),
        "cache_key": np.int64(cache_key),
    }


def _out_type(ids_shape: tuple[int, ...], dim: int, records: bool) -> jax.ShapeDtypeStruct:
    if records:
        return jax.ShapeDtypeStruct(ids_shape + (packed_record_bytes(dim),), jnp.uint8)
    return jax.ShapeDtypeStruct(ids_shape + (dim,), jnp.bfloat16)


def _check(table, ids, order, cache, plan, max_ctas, records=False) -> _Call:
    check_table(table)
    check_max_ctas(max_ctas)
    check_cache(table, cache)
    if plan is not None:
        ids, batch = sharding.gather_ids(ids, plan)
        records = plan.moves_records
    else:
        ids, batch = as_ids(ids), None
    return _Call(
        ids=ids,
        table_key=table.key,
        dim=table.dim,
        order=resolve_order(order, ids.size),
        cache_key=0 if cache is None else cache.key,
        max_ctas=max_ctas,
        plan=plan,
        batch=batch,
        records=records,
    )


def _rows_now(call: _Call) -> jax.Array:
    """The synchronous lookup of ``call``'s ids (rows, or packed records), on XLA's stream."""
    out_type = call.out_type()
    if call.ids.size == 0:
        return jnp.zeros(out_type.shape, out_type.dtype)  # zero records decode to zero rows
    _native.ensure_registered()
    if not call.records and call.order == "plain" and call.cache_key == 0:
        target = jax.ffi.ffi_call("engram_lookup", out_type, vmap_method="broadcast_all")
        return target(
            call.ids,
            table_key=np.int64(call.table_key),
            dim=np.int64(call.dim),
            max_ctas=np.int64(call.max_ctas or 0),
        )
    # With an order, a cache or packed records: the sort's workspace is a second result.
    name = "engram_lookup_records" if call.records else "engram_cached_lookup"
    workspace = jax.ShapeDtypeStruct((workspace_bytes(call.ids.size, call.order),), jnp.uint8)
    target = jax.ffi.ffi_call(name, (out_type, workspace), vmap_method="broadcast_all")
    out, _ = target(call.ids, max_ctas=np.int64(call.max_ctas or 0), **call.attrs())
    return out


def _finish(plan: ShardPlan | None, batch: ShardedBatch | None, rows: jax.Array) -> jax.Array:
    """The looked-up rows (or packed records) after the plan's exchange, decoded."""
    if plan is None:
        return rows
    rows = sharding.exchange_rows(rows, plan, batch)
    return decode_records(rows) if plan.moves_records else rows


def lookup(
    table: EngramTable | ShardedTable | Trainable,
    ids: jax.Array,
    *,
    order: str = "plain",
    cache: HotRowCache | None = None,
    plan: ShardPlan | None = None,
    max_ctas: int | None = None,
    after: Any = None,
) -> jax.Array:
    """Rows of ``table`` for global row ids ``ids`` ``[..., H]`` -> bf16 ``[..., H, dim]``.

    Row ``id - table.row_start`` dequantised as ``bf16(float32(fp8) * 2**(scale - 127))``.
    Any id the table does not hold (``-1`` = DEAD_ID, negative, or outside
    ``[row_start, row_stop)``) gives a zero row and is never read.

    Ids are int32 (what :func:`hash_ngrams` returns). Numpy int64/uint64 ids given
    outside ``jit`` are narrowed, those past int32 reading as DEAD with a warning;
    a 64-bit jax array raises ``TypeError``. But a *jitted* function's int64
    argument is narrowed by jax itself before the library sees it (x64 off), and an
    id past int32 then wraps onto a real row without a word: pass ids built in
    numpy through :func:`narrow_ids` on the host first.

    Works under ``jit``, ``vmap`` and ``lax.scan``; on the CPU backend for
    every host placement (all but ``device``), on CUDA for ``device`` tables
    and page-locked host ones (``pinned``, ``hugepage``, ``numa``, shared for the GPU).

    Options, each giving the same rows bit for bit:

    - ``order``: ``"plain"`` (ids as given), ``"sorted"`` (rows visited in table
      order, so neighbouring rows share address translations), ``"dedup"``
      (sorted, each distinct row fetched once and copied to its other places)
      or ``"auto"`` (``"dedup"`` from 16,384 ids, else ``"plain"``).
    - ``cache``: a :class:`~engram_jax.HotRowCache` of ``table``; hits are read
      from its copy (HBM on a GPU), misses from the table. Its active contents
      are read when the call runs, so a refresh needs no recompilation.
    - ``plan``: a :class:`~engram_jax.ShardPlan`, inside ``jax.shard_map`` over a
      mesh with the plan's TP/EDP axes: ``ids`` ``[..., n_cols]`` are this
      replica's tokens, ``table`` holds each device's head shard, and the rows
      come back as an unsharded lookup of the whole layer would return them
      (:func:`make_sharded_lookup` does the shard_map and the checks).
    - ``max_ctas`` caps the CUDA grid (default: every SM); the CPU ignores it.
    - ``after``: update tokens from :func:`~engram_jax.apply_gradients` (or any
      arrays) this read must wait for, inside one jitted program.

    A :class:`~engram_jax.TrainableTable` gives its rows in its own dtype
    (float32 or bfloat16), read as stored, and has no hot-row cache;
    ``max_ctas`` changes nothing there. Its ``order`` is ``"plain"`` or a dedup
    in JAX (the distinct ids sorted by ``jnp.unique``, each row gathered once, in
    table order, and copied back to its positions: the same bits); ``"sorted"``
    runs that dedup too, since a sort alone would fetch every repeat again.
    """
    if is_trainable(table):
        _check_trainable_options(order, cache, max_ctas)
        return trainable_lookup(table, ids, plan=plan, after=after, order=order)
    call = _check(table, ids, order, cache, plan, max_ctas)
    earlier = tokens_of(after, "lookup")
    if earlier:
        call = dataclasses.replace(call, ids=order_after(call.ids, earlier))
    return _finish(call.plan, call.batch, _rows_now(call))


def _check_trainable_options(order: str, cache: HotRowCache | None, max_ctas: int | None) -> None:
    resolve_order(order, 0)
    check_max_ctas(max_ctas)
    if cache is not None:
        raise TypeError("a hot-row cache holds fp8 serving rows: a TrainableTable has none")


def lookup_records(
    table: EngramTable | ShardedTable,
    ids: jax.Array,
    *,
    order: str = "plain",
    cache: HotRowCache | None = None,
    max_ctas: int | None = None,
) -> jax.Array:
    """The packed records of :func:`lookup`'s rows: ids ``[..., H]`` -> uint8
    ``[..., H, packed_record_bytes(dim)]`` (each row's fp8 bytes, then its scale
    bytes), all zeros for an id the table does not hold.

    One end of a packed exchange: move the records between devices (0.52x the
    bytes of bf16 rows for dim 256), then :func:`decode_records` gives the rows
    :func:`lookup` would have, bit for bit. ``order``, ``cache`` and ``max_ctas``
    as for :func:`lookup`; ``lookup(..., plan=ShardPlan(exchange="all_to_all_packed"))``
    does all of it.
    """
    return _rows_now(_check(table, ids, order, cache, None, max_ctas, records=True))


def decode_records(records: jax.Array) -> jax.Array:
    """Packed records uint8 ``[..., dim + dim/32]`` (from :func:`lookup_records`)
    -> bf16 rows ``[..., dim]``, decoded as :func:`lookup` decodes, bit for bit
    (the native decode: XLA's CPU flushes subnormals, so no jnp arithmetic could).

    Inside ``shard_map`` the rows vary over the mesh axes the records vary over.
    """
    if not isinstance(records, (jax.Array, np.ndarray)):
        records = np.asarray(records)
    dtype = jnp.result_type(records)
    if dtype != jnp.uint8:
        raise TypeError(f"records must be uint8 packed records, got {dtype}")
    width = records.shape[-1] if records.ndim else 0
    if width == 0 or width % (BLOCK_SIZE + 1) or width // (BLOCK_SIZE + 1) * BLOCK_SIZE > MAX_DIM:
        raise ValueError(
            "records must be [..., dim + dim / 32] with dim a positive multiple of "
            f"{BLOCK_SIZE} up to {MAX_DIM}, got shape {records.shape}"
        )
    dim = width // (BLOCK_SIZE + 1) * BLOCK_SIZE
    out_type = jax.ShapeDtypeStruct(records.shape[:-1] + (dim,), jnp.bfloat16)
    if records.size == 0:
        return jnp.zeros(out_type.shape, out_type.dtype)
    _native.ensure_registered()
    decode = jax.ffi.ffi_call("engram_decode_records", out_type, vmap_method="broadcast_all")
    return sharding.exchange.vary_like(decode(records, dim=np.int64(dim)), records)


@dataclasses.dataclass(frozen=True)
class LookupHandle:
    """A lookup in flight, from :func:`lookup_start`; pass it to :func:`lookup_done`.

    A pytree. Array leaves: ``ticket`` (which call site staged the rows and which
    start it was; ``None`` when the rows were looked up at once), ``ids`` (done's
    operand: the CPU looks the rows up from them, CUDA reads their shape) and
    ``rows`` (the rows of a lookup made at once, else ``None``). The rest is
    static: the call's attributes, the call site's ``slot`` and, with a plan,
    what ``lookup_done`` needs to exchange the rows. ``records``: the gather
    returns packed records (a packed exchange; ``rows`` holds those), which
    ``lookup_done`` exchanges and decodes. ``row_dtype``: set for a
    :class:`~engram_jax.TrainableTable`, whose rows come in that dtype. A
    trainable table's dedup adds two array leaves: ``unique`` (the distinct ids
    the gather reads, done's operand in place of ``ids``, which stay the ids
    looked up) and ``inverse`` (where each id's row is among them); ``None``
    otherwise.
    """

    ticket: jax.Array | None
    ids: jax.Array
    rows: jax.Array | None
    table_key: int
    dim: int
    order: str
    cache_key: int
    slot: int
    plan: ShardPlan | None
    batch: ShardedBatch | None
    records: bool
    row_dtype: str | None = None
    unique: jax.Array | None = None
    inverse: jax.Array | None = None

    @property
    def pending(self) -> bool:
        """Whether the rows are still being gathered (``False``: looked up at once)."""
        return self.rows is None


jax.tree_util.register_dataclass(
    LookupHandle,
    data_fields=["ticket", "ids", "rows", "unique", "inverse"],
    meta_fields=[
        "table_key",
        "dim",
        "order",
        "cache_key",
        "slot",
        "plan",
        "batch",
        "records",
        "row_dtype",
    ],
)


def lookup_start(
    table: EngramTable | ShardedTable | Trainable,
    ids: jax.Array,
    *,
    order: str = PREFETCH_ORDER,
    cache: HotRowCache | None = None,
    plan: ShardPlan | None = None,
    max_ctas: int | None = None,
    tag: Hashable | None = None,
    after: LookupHandle | jax.Array | Sequence[LookupHandle | jax.Array] = (),
) -> LookupHandle:
    """Start :func:`lookup` in the background; :func:`lookup_done` returns its rows.

    ``lookup_done(lookup_start(table, ids, **options))`` equals
    ``lookup(table, ids, **options)`` bit for bit, for every option; ``order``
    defaults to ``"sorted"`` here (``PREFETCH_ORDER``: rows in table order slow the
    model running beside the gather less). On CUDA the ids are copied into the
    call site's own staging on XLA's stream, and the gather runs from there into
    the staging on a side stream shared by every prefetch of the device (so
    several lookups take turns), on ``max_ctas`` CTAs (default
    :func:`prefetch_ctas`: 4 for plain order without a cache, otherwise 4 up to 16
    growing with the batch). XLA's stream waits for it only at ``lookup_done``,
    which copies the rows into its own result. Nothing XLA owns is touched after
    start returns, so the ids may be any value: a slice, a fusion's output,
    shared with other consumers. On the CPU, ``lookup_done`` looks the rows up
    itself. Called outside a traced computation (``ids`` concrete) it looks
    them up at once on every backend.

    Rules: pass the handle to ``lookup_done`` before its call site (this
    ``lookup_start`` in the compiled program) starts again: in the same jitted
    computation or loop iteration, or in a later one that finishes it before
    starting anew, and keep the compiled function that started it alive until
    then. A handle kept past a later start of its call site, or past its
    executable (its staging is released with it), gets NaN rows on CUDA, never
    another start's rows.

    ``tag``: starts with the same tag (any hashable) share one completion event,
    so their handles have one pytree structure and a loop can carry either; a
    done then also waits for any other start of the tag in flight. This is how
    to gather the next chunk's rows a whole step ahead::

        def body(handle, next_ids):
            rows = lookup_done(handle)
            next_ids, rows = jax.lax.optimization_barrier((next_ids, rows))
            return lookup_start(table, next_ids, tag="chunks"), rows

        first = lookup_start(table, chunks[0], tag="chunks")
        last, rows = jax.lax.scan(body, first, chunks[1:])

    The same holds for a handle one jitted call returns and the next takes in (a
    training step that starts the next step's lookup): give those starts a tag.
    Untagged, each trace makes a new completion event, part of the handle's pytree
    structure, so the next call finds a structure it was not compiled for and
    compiles again, every step.

    ``after`` may also hold update tokens from :func:`~engram_jax.apply_gradients`:
    the start then reads the table only once those updates are written. A trainable
    table's start also takes an :class:`~engram_jax.UpdateHandle` of
    :func:`~engram_jax.apply_gradients_start` itself: its gather then queues behind
    that update on the side stream they share, and XLA's stream waits for neither
    until their dones (the handle must still reach ``apply_gradients_done``). That
    keeps a training step's compute running while the update it needs is written:
    ``after=apply_gradients_done(handle)`` makes XLA's stream wait there for it.

    A :class:`~engram_jax.TrainableTable` is gathered in the background as
    well (rows copied as stored, in its dtype; no ``cache``), after the updates
    named in ``after``. Its default ``"sorted"`` (and ``"dedup"``, and
    ``"auto"`` from 16,384 ids) dedups as :func:`lookup` does: the distinct ids
    and where each id's row lies among them are computed on XLA's stream before
    the start, the start gathers each distinct row once, and ``lookup_done``
    copies the rows back to every position (the same bits as ``"plain"``).
    ``handle.ids`` stays the ids looked up (what ``apply_gradients`` takes).

    ``after``: a handle (or several) whose gathers this one queues behind. The
    side stream runs gathers in the order they start, and XLA may issue starts
    that do not depend on each other in any order; with two Engram layers, a
    schedule that starts the later layer first makes the first layer wait for
    both gathers (measured: 4.8 ms of a 22 ms step at 4,096 tokens). Start the
    first layer's lookup first and pass its handle as the next one's ``after``.

    Scheduling recipe: XLA runs an op as late as its inputs allow, so route the
    step's input (the token ids the embedding reads) through a barrier with the
    handles, and tie each handle to one value of its Engram layer's input::

        ids = hash_step(tokens, ...)             # every layer's ids
        h2 = lookup_start(table2, ids[2])        # start every Engram layer's lookup,
        h15 = lookup_start(table15, ids[15], after=h2)  # in the order they are needed
        tokens, h2, h15 = jax.lax.optimization_barrier((tokens, h2, h15))  # before block 0
        x = embed(tokens)
        for i, block in enumerate(blocks):
            if i == 2:
                h2, _ = jax.lax.optimization_barrier((h2, x[:1, :1]))  # after blocks 0-1
                x = engram2(x, lookup_done(h2))
            ...
            x = block(x)

    Not the embedded ``x`` before block 0: a barrier hands on what passes
    through it built whole, so XLA can no longer fuse or simplify what made it
    (the serving example's embedding, broadcast to 4 hyper-connection copies,
    then had its blocks' norms tiled otherwise than in the plain-lookup
    program: other tokens on the GPU). At the layer, not ``x`` out of the
    barrier: a bf16 hidden state that comes out of a barrier is rounded there,
    while XLA may keep it in excess precision inside fusions of the
    plain-lookup program (``--xla_allow_excess_precision``, on by default);
    greedy decoding would pick other tokens either way.
    """
    trainable = is_trainable(table)
    earlier = _check_after(after, trainable)
    tokens = [t for t in earlier if not isinstance(t, (LookupHandle, UpdateHandle))]
    handles = [h for h in earlier if isinstance(h, LookupHandle)]
    updates = [h for h in earlier if isinstance(h, UpdateHandle)]
    if trainable:
        return _start_trainable(
            table, ids, plan, max_ctas, tag, order, cache, tokens, handles, updates
        )
    call = _check(table, ids, order, cache, plan, max_ctas)
    if tokens:
        call = dataclasses.replace(call, ids=order_after(call.ids, tokens))
    earlier = handles

    def handle(call, ticket, rows, slot):  # the call whose ids the start read
        return LookupHandle(
            ticket=ticket,
            ids=call.ids,
            rows=rows,
            table_key=call.table_key,
            dim=call.dim,
            order=call.order,
            cache_key=call.cache_key,
            slot=slot,
            plan=call.plan,
            batch=call.batch,
            records=call.records,
        )

    if call.ids.size == 0 or not isinstance(call.ids, jax.core.Tracer):
        # Nothing to overlap with outside a trace: an eagerly started gather
        # would outlive the call that owns its staging.
        return handle(call, None, _rows_now(call), -1)
    _native.ensure_registered()
    slot = slot_for(tag)
    tickets = [h.ticket for h in earlier if h.pending]
    if tickets:  # the ids wait for the earlier starts, so this start is issued after them
        call = dataclasses.replace(call, ids=jax.lax.optimization_barrier((call.ids, tickets))[0])
    start = jax.ffi.ffi_call(
        "engram_lookup_start",
        jax.ShapeDtypeStruct((TICKET_WORDS,), jnp.uint32),
        vmap_method="broadcast_all",
    )
    grid = call.max_ctas or prefetch_ctas(call.ids.size, order=call.order, cache=cache)
    ticket = start(
        call.ids,
        max_ctas=np.int64(grid),
        slot=np.int64(slot),
        records=np.int64(call.records),
        **call.attrs(),
    )
    return handle(call, ticket, None, slot)


def _start_trainable(
    table, ids, plan, max_ctas, tag, order, cache, tokens, handles, updates
) -> LookupHandle:
    """:func:`lookup_start` of a trainable table: the same start and done targets, with
    ``records`` saying the rows come as stored (2: float32, 3: bfloat16), and the update
    tokens and tickets passed to the start as operands it does not read (no backend
    drops those). A dedup gathers the distinct ids
    (:func:`~engram_jax.training.distinct_ids`) with the native gather in plain order;
    ``lookup_done`` expands them."""
    _check_trainable_options(order, cache, max_ctas)
    check_trainable_plan(plan)
    if plan is not None:
        own, batch = sharding.gather_ids(as_ids(ids), plan)
    else:
        own, batch = as_ids(ids), None
    order = trainable_order(order, own.size)
    kind = TRAINABLE_OUTPUTS[table.dtype.name]
    queued = [u.ticket for u in updates if u.pending]
    tokens = list(tokens) + [u.token for u in updates if not u.pending]
    waits = tokens + [h.ticket for h in handles if h.pending] + queued
    if queued and own.size and not isinstance(own, jax.core.Tracer):
        # Constant ids would be read on XLA's stream, which does not wait for an
        # update on the side stream: gather them on the side stream, behind it.
        own = order_after(own, queued)

    def handle(ticket, rows, slot, unique=None, inverse=None):
        return LookupHandle(
            ticket=ticket,
            ids=own,
            rows=rows,
            table_key=table.key,
            dim=table.dim,
            order=order,
            cache_key=0,
            slot=slot,
            plan=plan,
            batch=batch,
            records=False,
            row_dtype=table.dtype.name,
            unique=unique,
            inverse=inverse,
        )

    if own.size == 0 or not isinstance(own, jax.core.Tracer):
        return handle(None, trainable_rows(table, own, order, waits), -1)
    unique, inverse = distinct_ids(own) if order == "dedup" else (None, None)
    gathered = own if unique is None else unique
    _native.ensure_registered()
    slot = slot_for(tag)
    start = jax.ffi.ffi_call(
        "engram_lookup_start",
        jax.ShapeDtypeStruct((TICKET_WORDS,), jnp.uint32),
        vmap_method="broadcast_all",
    )
    ticket = start(
        gathered,
        *waits,
        max_ctas=np.int64(max_ctas or prefetch_ctas(gathered.size, order=order)),
        slot=np.int64(slot),
        records=np.int64(kind),
        **_attrs(table.key, table.dim, "plain", 0),
    )
    return handle(ticket, None, slot, unique, inverse)


def _check_after(after, trainable: bool) -> list[LookupHandle | UpdateHandle | jax.Array]:
    """``lookup_start``'s ``after``, as a list of handles and update tokens; update
    handles only for a ``trainable`` table's start."""
    if after is None:
        return []
    earlier = list(after) if isinstance(after, (list, tuple)) else [after]
    for h in earlier:
        if isinstance(h, UpdateHandle) and not trainable:
            raise TypeError(
                "after got an UpdateHandle: only a trainable table's lookup_start queues behind "
                "one; pass apply_gradients_done(handle) (the update token)"
            )
        token = isinstance(h, (jax.Array, np.ndarray)) and h.shape == () and h.dtype == jnp.int32
        if not (isinstance(h, (LookupHandle, UpdateHandle)) or token):
            what = type(h).__name__
            if isinstance(h, (jax.Array, np.ndarray)):
                what = f"an array {h.dtype}{list(h.shape)}"
            raise TypeError(
                "after must be a LookupHandle from lookup_start, an update token from "
                "apply_gradients (an int32 scalar), an UpdateHandle from "
                f"apply_gradients_start, or a sequence of them, got {what}"
            )
    return earlier


def lookup_done(handle: LookupHandle) -> jax.Array:
    """Wait for a :func:`lookup_start` and return its rows, as :func:`lookup` would.

    On CUDA only XLA's stream waits (for this call site's gather alone, not
    for later lookups on the side stream); the host never does.
    """
    if not isinstance(handle, LookupHandle):
        raise TypeError(
            f"handle must be a LookupHandle from lookup_start, got {type(handle).__name__}"
        )
    if not handle.pending:
        return _finish(handle.plan, handle.batch, handle.rows)
    if not isinstance(handle.ticket, jax.core.Tracer):
        raise ValueError(
            "lookup_done got a started lookup outside a traced computation: call lookup_done "
            "inside jit (the same jit as lookup_start, or a later one the handle is passed into)"
        )
    _native.ensure_registered()
    # What the start gathered: a trainable dedup's distinct ids, else the ids.
    gathered = handle.ids if handle.unique is None else handle.unique
    order = handle.order
    if handle.row_dtype is not None:
        out_type = jax.ShapeDtypeStruct(gathered.shape + (handle.dim,), jnp.dtype(handle.row_dtype))
        kind = TRAINABLE_OUTPUTS[handle.row_dtype]
        order = "plain"  # a trainable dedup ran in JAX; the native gather is plain
    else:
        out_type = _out_type(gathered.shape, handle.dim, handle.records)
        kind = int(handle.records)
    done = jax.ffi.ffi_call("engram_lookup_done", out_type, vmap_method="broadcast_all")
    rows = done(
        without_tangent(handle.ticket),
        without_tangent(gathered),
        slot=np.int64(handle.slot),
        records=np.int64(kind),
        **_attrs(handle.table_key, handle.dim, order, handle.cache_key),
    )
    if handle.inverse is not None:
        rows = expand_rows(rows, handle.inverse)  # gathers take no tangent of their indices
    return _finish(handle.plan, handle.batch, rows)


def make_sharded_lookup(
    table: EngramTable | ShardedTable,
    mesh: Mesh,
    plan: ShardPlan,
    *,
    node_of: NodeOf | None = None,
    check_vma: bool = True,
    **options: Any,
) -> Callable[[jax.Array], jax.Array]:
    """A jitted ``ids -> rows`` that runs ``lookup(table, ids, plan=plan, **options)``
    under ``shard_map``.

    ``ids`` ``[replicas * slot, ..., n_cols]``: axis 0 is split over every mesh
    axis but TP (dp, edp, ...), one block of tokens per replica (build it with
    :func:`~engram_jax.pad_replicas` when replicas have different token counts).
    Returns ``[replicas * slot, ..., n_cols, dim]`` bf16 laid out the same way.
    Checks first that the mesh fits the plan, that EDP groups are node-local,
    that every local device holds its shard's rows, and that a ``cache`` (built
    for ``table``) has a copy on every local device of the mesh.
    """
    sharding.check_mesh(mesh, plan, node_of=node_of)
    if is_trainable(table):
        check_trainable_mesh(table, mesh, plan)
    else:
        sharding.check_table(table, mesh, plan)
    sharding.check_mesh_cache(options.get("cache"), table, mesh)
    resolve_order(options.get("order", "plain"), 0)

    def body(ids: jax.Array) -> jax.Array:
        return lookup(table, ids, plan=plan, **options)

    return sharding.map_over_replicas(body, mesh, plan, check_vma=check_vma)
