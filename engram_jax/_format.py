"""The row record format every table, loader and kernel agrees on, and int32 row ids.

A record is ``dim`` fp8 e4m3 bytes, ``dim / 32`` UE8M0 scale bytes and zeros
up to a multiple of 16; a packed record is the same without the zeros (what a
packed exchange moves between devices). Ids are int32; :func:`narrow_ids` is
the one place wider integer ids become int32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

BLOCK_SIZE = 32
MAX_DIM = 16384
DEAD_ID = -1
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def row_stride(dim: int) -> int:
    """Bytes of one row record: dim fp8 values, dim/32 scale bytes, padded to 16."""
    raw = dim + dim // BLOCK_SIZE
    return (raw + 15) // 16 * 16


def packed_record_bytes(dim: int) -> int:
    """Bytes of a packed record: dim fp8 values then dim/32 scale bytes, no padding
    (264 for dim 256, against 512 bytes of bf16 row and a 272-byte record)."""
    return dim + dim // BLOCK_SIZE


def pack_records(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The in-memory layout: ``[rows, row_stride(dim)]`` uint8, data then scales then zeros."""
    weight = np.asarray(weight).view(np.uint8)
    scale = np.asarray(scale).view(np.uint8)
    rows, dim = weight.shape
    records = np.zeros((rows, row_stride(dim)), dtype=np.uint8)
    records[:, :dim] = weight
    records[:, dim : dim + dim // BLOCK_SIZE] = scale
    return records


def unpack_records(records: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`pack_records`: fp8 weight and e8m0 scale arrays."""
    weight = records[:, :dim].view(ml_dtypes.float8_e4m3fn)
    scale = records[:, dim : dim + dim // BLOCK_SIZE].view(ml_dtypes.float8_e8m0fnu)
    return weight, scale


def narrow_ids(ids: np.ndarray | jax.Array, out_of_range: int = DEAD_ID) -> np.ndarray | jax.Array:
    """Integer ``ids`` as int32 (numpy stays numpy, jax stays jax); the values of a
    wider type outside the int32 range become ``out_of_range``.

    A plain cast (and jax's int64 -> int32 canonicalisation) would wrap such an
    id onto a real one; no table holds it, so by default it reads as DEAD.
    """
    if ids.dtype == np.int32:
        return ids
    xp = np if isinstance(ids, np.ndarray) else jnp
    info = np.iinfo(ids.dtype)
    if info.max > INT32_MAX:
        outside = ids > INT32_MAX
        if info.min < INT32_MIN:
            outside = outside | (ids < INT32_MIN)
        ids = xp.where(outside, out_of_range, ids)
    return ids.astype(np.int32)
