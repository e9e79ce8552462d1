"""Plain numpy references for engram_jax's kernels.

Slow and obvious on purpose: the tests compare the FFI results against these
bit for bit. Uses ml_dtypes for the fp8 / e8m0 / bf16 conversions so the
reference shares no code with the kernels it checks.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK_SIZE = 32
DEAD_ID = -1


def row_stride(dim: int) -> int:
    """Bytes of one row record: dim fp8 values, dim/32 scale bytes, padded to 16."""
    raw = dim + dim // BLOCK_SIZE
    return (raw + 15) // 16 * 16


def dequantize(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """fp8 e4m3 ``[..., dim]`` times UE8M0 ``[..., dim/32]`` -> bf16, one rounding."""
    values = np.asarray(weight).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = np.asarray(scale).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        product = values * np.repeat(scales, BLOCK_SIZE, axis=-1)
    return product.astype(ml_dtypes.bfloat16)


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


def lookup_reference(
    weight: np.ndarray, scale: np.ndarray, ids: np.ndarray, row_start: int = 0
) -> np.ndarray:
    """Rows ``ids - row_start`` dequantised; ids the table does not hold give zeros."""
    weight = np.asarray(weight).view(np.uint8)
    scale = np.asarray(scale).view(np.uint8)
    ids = np.asarray(ids, dtype=np.int64)
    rows, dim = weight.shape
    local = ids - row_start
    held = (local >= 0) & (local < rows)
    out = np.zeros(ids.shape + (dim,), dtype=ml_dtypes.bfloat16)
    picked = local[held]
    out[held] = dequantize(weight[picked], scale[picked])
    return out
