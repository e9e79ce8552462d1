"""engram_jax.lookup: gather Engram rows inside jitted code.

ids -> the ``engram_lookup`` FFI target (CPU or CUDA handler, chosen by where
the computation runs) -> bf16 rows. The table reaches the handler as an
integer key attribute; the handler resolves it per device through the native
registry, so one compiled SPMD program reads each device's own table.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from engram_jax import _native
from engram_jax.reference import DEAD_ID
from engram_jax.sharded_table import ShardedTable
from engram_jax.table import EngramTable

if TYPE_CHECKING:  # cache.py imports this module, so only for annotations
    from engram_jax.cache import CachedLookupHandle, HotRowCache


def _check_table(table: EngramTable | ShardedTable) -> None:
    # A ShardedTable is one registry key with a different table per device.
    if not isinstance(table, (EngramTable, ShardedTable)):
        raise TypeError(f"table must be an EngramTable or ShardedTable, got {type(table).__name__}")
    if table.closed:
        raise ValueError(f"{table!r} is closed")


def _narrow_ids(ids: np.ndarray) -> np.ndarray:
    """64-bit integer host ids as int32, ids past the int32 range as DEAD_ID.

    A plain cast (and jax's int64 -> int32 canonicalisation) would wrap such an
    id onto a real row; no table holds it, so it must read as a zero row.
    """
    if ids.dtype.kind not in "iu" or ids.dtype.itemsize <= 4:
        return ids
    held = (ids >= -(2**31)) & (ids <= 2**31 - 1)
    narrow = np.full(ids.shape, DEAD_ID, np.int32)
    narrow[held] = ids[held]
    return narrow


def _as_ids(ids: ArrayLike) -> jax.Array:
    if not isinstance(ids, (jax.Array, np.ndarray)):
        ids = np.asarray(ids)
        if ids.size == 0:  # an empty list has no integer dtype of its own
            ids = ids.astype(np.int32)
    if isinstance(ids, np.ndarray):
        ids = _narrow_ids(ids)
    dtype = jnp.result_type(ids)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"ids must be int32 row numbers, got {dtype}")
    if dtype != jnp.int32:
        if jnp.iinfo(dtype).bits > 32 or dtype == jnp.uint32:
            raise TypeError(f"ids must be int32 (or a narrower integer type), got {dtype}")
    ids = jnp.asarray(ids, dtype=jnp.int32)
    if ids.ndim < 1:
        raise ValueError(f"ids must have shape [..., H] with at least one axis, got {ids.shape}")
    return ids


def _check_max_ctas(max_ctas: int | None) -> None:
    if max_ctas is not None and (
        isinstance(max_ctas, bool) or not isinstance(max_ctas, (int, np.integer)) or max_ctas < 1
    ):
        raise ValueError(f"max_ctas must be a positive int or None, got {max_ctas!r}")


def _cache_module():
    # Imported on use: engram_jax.cache imports this module.
    from engram_jax import cache

    return cache


def lookup(
    table: EngramTable | ShardedTable,
    ids: jax.Array,
    *,
    max_ctas: int | None = None,
    order: str = "plain",
    cache: HotRowCache | None = None,
) -> jax.Array:
    """Rows of ``table`` for global row ids ``ids`` ``[..., H]`` -> bf16 ``[..., H, dim]``.

    Row ``id - table.row_start`` dequantised as ``bf16(float32(fp8) * 2**(scale - 127))``.
    Any id the table does not hold (``-1`` = DEAD_ID, negative, or outside
    ``[row_start, row_end)``) gives a zero row and is never read.

    Works under ``jit``, ``vmap`` and ``lax.scan``; on the CPU backend for
    every host placement (all but ``device``), on CUDA for ``device`` tables
    and page-locked host ones (``pinned``, ``hugepage``, ``numa``, shared for the GPU).
    ``max_ctas`` caps the CUDA grid (default: every SM); the CPU ignores it.

    ``order`` (``"plain"``, ``"sorted"``, ``"dedup"`` or ``"auto"``) and
    ``cache`` (a :class:`~engram_jax.HotRowCache` built for ``table``) are
    :func:`~engram_jax.cached_lookup`'s levers, which these arguments forward
    to; the rows are the same bit for bit. The defaults are the plain gather.
    """
    if order != "plain" or cache is not None:
        return _cache_module().cached_lookup(
            table, ids, cache=cache, order=order, max_ctas=max_ctas
        )
    _check_table(table)
    ids = _as_ids(ids)
    _check_max_ctas(max_ctas)
    out_type = jax.ShapeDtypeStruct(ids.shape + (table.dim,), jnp.bfloat16)
    if ids.size == 0:
        return jnp.zeros(out_type.shape, out_type.dtype)
    _native.ensure_registered()
    call = jax.ffi.ffi_call("engram_lookup", out_type, vmap_method="broadcast_all")
    return call(
        ids,
        table_key=np.int64(table.key),
        dim=np.int64(table.dim),
        max_ctas=np.int64(max_ctas or 0),
    )


# -- asynchronous prefetch: lookup_start / lookup_done ------------------------

# CUDA grid of a background gather, by the number of ids: as few SMs as finish it in
# time, taken from the model's. Measured on an H200 with a 64 GiB host table beside
# a 20-block model (benchmarks/overlap.py): at 12,288 ids, 2-8 CTAs cost the same
# and 16 cost 3 % more step time (the model's GEMMs lose SMs for nothing); at
# 98,304 ids, 16 CTAs were 2 % faster than 8 and 9 % faster than 4 (the gather
# itself is on the critical path). One CTA of 256 threads moves about 3.5 M rows/s
# from a large table; 16 reach the link's row rate.
PREFETCH_MIN_CTAS = 4
PREFETCH_MAX_CTAS = 16
PREFETCH_IDS_PER_CTA = 6144


def prefetch_ctas(num_ids: int) -> int:
    """The default ``max_ctas`` of :func:`lookup_start` for ``num_ids`` ids:
    ``ceil(num_ids / 6144)`` clamped to ``[4, 16]``."""
    wanted = -(-int(num_ids) // PREFETCH_IDS_PER_CTA)
    return max(PREFETCH_MIN_CTAS, min(PREFETCH_MAX_CTAS, wanted))


_slot_counter = itertools.count()
_slot_lock = threading.Lock()


def _next_slot() -> int:
    with _slot_lock:
        return next(_slot_counter)


@dataclasses.dataclass(frozen=True)
class LookupHandle:
    """A lookup in flight, from :func:`lookup_start`; pass it to :func:`lookup_done`.

    A pytree: ``rows`` (the output buffer, still being written on CUDA; do not
    read it) and ``ids`` (kept alive until done) are its array leaves; ``slot``
    (the call site's completion event) and ``pending`` are static.
    ``pending`` is ``False`` when the rows were gathered at once (eager calls).
    """

    rows: jax.Array
    ids: jax.Array
    slot: int
    pending: bool


jax.tree_util.register_dataclass(
    LookupHandle, data_fields=["rows", "ids"], meta_fields=["slot", "pending"]
)


def lookup_start(
    table: EngramTable | ShardedTable,
    ids: jax.Array,
    *,
    max_ctas: int | None = None,
    order: str = "plain",
    cache: HotRowCache | None = None,
) -> LookupHandle | CachedLookupHandle:
    """Start gathering the rows of ``ids`` in the background; :func:`lookup_done` returns them.

    ``lookup_done(lookup_start(table, ids))`` equals ``lookup(table, ids)`` bit for bit.
    On CUDA the gather runs on a side stream shared by every prefetch of the
    device (so several lookups take turns), on ``max_ctas`` CTAs (default
    :func:`prefetch_ctas` of the number of ids: 4 to 16), after the ids are
    ready; XLA's stream waits for it only at ``lookup_done``. On the CPU it
    gathers at once. Called outside a traced computation (``ids`` concrete) it
    gathers at once on every backend.

    Rules: pass the handle to ``lookup_done`` exactly once, inside the same
    jitted computation (the same ``scan`` iteration), and read the rows only
    from ``lookup_done``. XLA sees the handle's ``rows`` as ready at start, so a
    handle carried out of jit or across loop iterations could be read early.

    Scheduling recipe: XLA runs an op as late as its inputs allow, so route the
    first block's input through a barrier with the handles, and tie each handle
    to its Engram layer's input::

        ids = hash_step(...)                     # every layer's ids, after the embedding
        h2 = lookup_start(table2, ids[2])        # start every Engram layer's lookup
        h15 = lookup_start(table15, ids[15])
        x, h2, h15 = jax.lax.optimization_barrier((x, h2, h15))  # starts before block 0
        for i, block in enumerate(blocks):
            if i == 2:
                h2, _ = jax.lax.optimization_barrier((h2, x))    # done after blocks 0-1
                x = engram2(x, lookup_done(h2))
            ...
            x = block(x)

    At the layer, pass ``x`` into the barrier but keep using the original ``x``:
    a bf16 hidden state that comes out of a barrier is rounded there, while
    XLA may keep it in excess precision inside fusions of the plain-lookup
    program (``--xla_allow_excess_precision``, on by default), and the two
    programs then compute different numbers (greedy decoding picks other
    tokens). Before block 0, ``x`` is usually an embedding gather, exact in its
    dtype, so routing it through the barrier changes nothing.

    ``order`` and ``cache`` are :func:`lookup`'s: with either set this is
    :func:`~engram_jax.cached_lookup_start` (the handle is a
    :class:`~engram_jax.CachedLookupHandle`, which ``lookup_done`` also takes).
    """
    if order != "plain" or cache is not None:
        return _cache_module().cached_lookup_start(
            table, ids, cache=cache, order=order, max_ctas=max_ctas
        )
    _check_table(table)
    ids = _as_ids(ids)
    _check_max_ctas(max_ctas)
    if ids.size == 0 or not isinstance(ids, jax.core.Tracer):
        # Nothing to overlap with outside a trace: an eagerly started gather
        # would outlive the call that owns its output buffer.
        return LookupHandle(lookup(table, ids, max_ctas=max_ctas), ids, -1, False)
    _native.ensure_registered()
    slot = _next_slot()
    out_type = jax.ShapeDtypeStruct(ids.shape + (table.dim,), jnp.bfloat16)
    call = jax.ffi.ffi_call("engram_lookup_start", out_type, vmap_method="broadcast_all")
    rows = call(
        ids,
        table_key=np.int64(table.key),
        dim=np.int64(table.dim),
        max_ctas=np.int64(max_ctas or prefetch_ctas(ids.size)),
        slot=np.int64(slot),
    )
    return LookupHandle(rows, ids, slot, True)


def lookup_done(handle: LookupHandle | CachedLookupHandle) -> jax.Array:
    """Wait for a :func:`lookup_start` and return its rows ``ids.shape + (dim,)`` bf16.

    On CUDA only XLA's stream waits (for this call site's gather alone, not
    for later lookups on the side stream); the host never does. The result is
    the buffer start wrote (the output aliases it), so nothing is copied.
    A :class:`~engram_jax.CachedLookupHandle` goes to ``cached_lookup_done``.
    """
    if not isinstance(handle, LookupHandle):
        cache = _cache_module()
        if isinstance(handle, cache.CachedLookupHandle):
            return cache.cached_lookup_done(handle)
        raise TypeError(
            "handle must be a LookupHandle or CachedLookupHandle from lookup_start, "
            f"got {type(handle).__name__}"
        )
    if not handle.pending:
        return handle.rows
    if not isinstance(handle.rows, jax.core.Tracer):
        raise ValueError(
            "lookup_done got a started lookup from outside the current traced computation: "
            "call lookup_start and lookup_done inside the same jit (and the same scan iteration)"
        )
    return _done_call("engram_lookup_done", handle.rows, handle.ids, slot=handle.slot)


def _done_call(target: str, rows: jax.Array, *keep: jax.Array, slot: int) -> jax.Array:
    """The ``target`` done call of a prefetch: waits for slot ``slot``, returns ``rows``
    in place (the output aliases them); ``keep`` are the start's other buffers, passed
    so they stay alive until the gather is done."""
    call = jax.ffi.ffi_call(
        target,
        jax.ShapeDtypeStruct(rows.shape, jnp.bfloat16),
        vmap_method="broadcast_all",
        input_output_aliases={0: 0},
    )
    return call(rows, *keep, slot=np.int64(slot))
