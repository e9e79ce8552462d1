"""The checks every lookup entry point makes before it emits an ``ffi_call``.

Tables, ids (64-bit host ids narrowed by :func:`engram_jax._format.narrow_ids`),
grid caps and visiting orders: one place, so the plain, asynchronous and
sharded lookups and the hot-row cache refuse bad input with the same messages.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from engram_jax import _native
from engram_jax._format import INT32_MAX, INT32_MIN, narrow_ids
from engram_jax.sharded_table import ShardedTable
from engram_jax.table import EngramTable

# VisitOrder of the native code (ffi/kernels/dedup_params.h), by name.
ORDER_CODES: dict[str, int] = dict(_native.native.visit_orders)
ORDERS = tuple(ORDER_CODES)

# order="auto" sorts and deduplicates from this many ids per call. A sort costs
# a few kernel launches plus a pass over the ids; on DESIGN.md's H200 figures
# (64 GiB table) table order speeds up the gather of a 12,288-row decode step
# by 3 % and of 2 M rows by 2.4x. benchmarks/cache.py measures plain against
# dedup for each batch on real-text ids and reports which was faster.
AUTO_DEDUP_MIN_IDS = 16384


def check_table(table: EngramTable | ShardedTable) -> None:
    # A ShardedTable is one registry key with a different table per device.
    if not isinstance(table, (EngramTable, ShardedTable)):
        if type(table).__name__ in ("TrainableTable", "ShardedTrainableTable"):
            raise TypeError(
                f"this path reads fp8 serving tables (EngramTable, ShardedTable), got a "
                f"{type(table).__name__}: use lookup / lookup_start, or export it to fp8 first"
            )
        raise TypeError(f"table must be an EngramTable or ShardedTable, got {type(table).__name__}")
    if table.closed:
        raise ValueError(f"{table!r} is closed")


# Said wherever ids wider than int32 are refused or narrowed: the one case the
# library never sees is a jitted function's int64 argument, which jax itself
# narrows (x64 off) by wrapping, onto a real row.
WIDE_IDS_HINT = (
    "build ids as int32, or pass them through engram_jax.narrow_ids(ids) on the host "
    "first (ids past int32 become DEAD_ID): a jitted function's int64 argument is "
    "narrowed by jax itself, and an id past int32 then wraps onto a real row"
)


def narrow_host_ids(ids: np.ndarray, stacklevel: int = 2) -> np.ndarray:
    """64-bit integer host ids as int32 (:func:`~engram_jax._format.narrow_ids`: ids past
    the int32 range read as DEAD, with a warning pointing ``stacklevel`` frames up);
    any other dtype as given, for the caller to check."""
    if ids.dtype.kind in "iu" and ids.dtype.itemsize > 4:
        past = ids > INT32_MAX
        if np.iinfo(ids.dtype).min < INT32_MIN:
            past |= ids < INT32_MIN
        if count := int(np.count_nonzero(past)):
            warnings.warn(
                f"{count} of {ids.size} {ids.dtype} ids lie past the int32 range and "
                f"read as DEAD_ID (zero rows) here; {WIDE_IDS_HINT}",
                UserWarning,
                stacklevel=stacklevel + 1,
            )
        return narrow_ids(ids)
    return ids


@jax.custom_jvp
def without_tangent(x: jax.Array) -> jax.Array:
    """Integer ``x`` (ids, a ticket) whose tangent is always a symbolic zero.

    An ``optimization_barrier`` shared with a differentiated value (how a lookup is
    tied to its layer) gives its integer outputs float0 zero tangents, and jax
    refuses to differentiate an ``ffi_call`` handed any; ids have no derivative.
    """
    return x


@without_tangent.defjvp
def _without_tangent_jvp(primals, tangents):
    (x,) = primals
    return x, np.zeros(np.shape(x), jax.dtypes.float0)


def as_ids(ids: ArrayLike) -> jax.Array:
    """``ids`` as an int32 array of at least one axis, or a TypeError/ValueError."""
    if not isinstance(ids, (jax.Array, np.ndarray)):
        ids = np.asarray(ids)
        if ids.size == 0:  # an empty list has no integer dtype of its own
            ids = ids.astype(np.int32)
    if isinstance(ids, np.ndarray):
        ids = narrow_host_ids(ids, stacklevel=4)  # the caller of lookup / lookup_start
    dtype = jnp.result_type(ids)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"ids must be int32 row numbers, got {dtype}")
    if dtype != jnp.int32:
        if jnp.iinfo(dtype).bits > 32 or dtype == jnp.uint32:
            raise TypeError(
                f"ids must be int32 (or a narrower integer type), got {dtype}: {WIDE_IDS_HINT}"
            )
    ids = jnp.asarray(ids, dtype=jnp.int32)
    if ids.ndim < 1:
        raise ValueError(f"ids must have shape [..., H] with at least one axis, got {ids.shape}")
    return without_tangent(ids)


def positive_int(value: object, name: str, meaning: str = "") -> int | None:
    """``value`` as an int >= 1, or ``None``; ``meaning`` goes into the errors."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int >= 1{meaning} or None, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1{meaning}, got {value}")
    return int(value)


def check_max_ctas(max_ctas: int | None) -> None:
    positive_int(max_ctas, "max_ctas", " (CTAs of the CUDA grid)")


def check_order(order: str) -> None:
    if not isinstance(order, str) or (order != "auto" and order not in ORDERS):
        raise ValueError(f"order must be 'auto' or one of {ORDERS}, got {order!r}")


def choose_order(num_ids: int) -> str:
    """The order ``order="auto"`` uses for a batch of ``num_ids`` ids.

    ``"dedup"`` (sort, fetch each distinct row once) from
    :data:`AUTO_DEDUP_MIN_IDS` ids on, else ``"plain"``. Dedup never fetches
    more rows than sorting alone, so ``"sorted"`` is never the automatic pick.
    The batch size is the only input: the repeat rate is not known before the
    ids are. The threshold is set from DESIGN.md's figures; benchmarks/cache.py
    checks it against plain vs dedup on real-text batches (64 GiB table).
    """
    return "dedup" if num_ids >= AUTO_DEDUP_MIN_IDS else "plain"


def resolve_order(order: str, num_ids: int) -> str:
    """``order`` checked, with ``"auto"`` replaced by :func:`choose_order`'s pick."""
    check_order(order)
    return choose_order(num_ids) if order == "auto" else order


def workspace_bytes(num_ids: int, order: str) -> int:
    """Bytes of scratch a lookup of ``num_ids`` ids in ``order`` takes (the sort's buffers)."""
    order = resolve_order(order, num_ids)
    return int(_native.native.lookup_workspace_bytes(int(num_ids), ORDER_CODES[order]))
