"""engram_jax.lookup: gather Engram rows inside jitted code.

ids -> the ``engram_lookup`` FFI target (CPU or CUDA handler, chosen by where
the computation runs) -> bf16 rows. The table reaches the handler as an
integer key attribute; the handler resolves it per device through the native
registry, so one compiled SPMD program reads each device's own table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from engram_jax import _native
from engram_jax.table import EngramTable


def _check_table(table: EngramTable) -> None:
    if not isinstance(table, EngramTable):
        raise TypeError(f"table must be an EngramTable, got {type(table).__name__}")
    if table.closed:
        raise ValueError(f"{table!r} is closed")


def _as_ids(ids) -> jax.Array:
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


def lookup(table: EngramTable, ids: jax.Array, *, max_ctas: int | None = None) -> jax.Array:
    """Rows of ``table`` for global row ids ``ids`` ``[..., H]`` -> bf16 ``[..., H, dim]``.

    Row ``id - table.row_start`` dequantised as ``bf16(float32(fp8) * 2**(scale - 127))``.
    Any id the table does not hold (``-1`` = DEAD_ID, negative, or outside
    ``[row_start, row_end)``) gives a zero row and is never read.

    Works under ``jit``, ``vmap`` and ``lax.scan``; on the CPU backend for
    ``cpu`` and ``pinned`` tables, on CUDA for ``pinned`` and ``device`` tables.
    ``max_ctas`` caps the CUDA grid (default: every SM); the CPU ignores it.
    """
    _check_table(table)
    ids = _as_ids(ids)
    if max_ctas is not None and (not isinstance(max_ctas, (int, np.integer)) or max_ctas < 1):
        raise ValueError(f"max_ctas must be a positive int or None, got {max_ctas!r}")
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
