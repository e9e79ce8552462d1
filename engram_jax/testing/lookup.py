"""numpy references for the lookup: fp8 x UE8M0 -> bf16 decoding, row gathering and
the packed records a packed exchange moves.

Slow and obvious on purpose: the tests compare the FFI results against these
bit for bit. Uses ml_dtypes for the fp8 / e8m0 / bf16 conversions so the
reference shares no code with the kernels it checks.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from engram_jax._format import BLOCK_SIZE


def dequantize(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """fp8 e4m3 ``[..., dim]`` times UE8M0 ``[..., dim/32]`` -> bf16, one rounding."""
    values = np.asarray(weight).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    scales = np.asarray(scale).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        product = values * np.repeat(scales, BLOCK_SIZE, axis=-1)
    return product.astype(ml_dtypes.bfloat16)


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


def lookup_records_reference(
    weight: np.ndarray, scale: np.ndarray, ids: np.ndarray, row_start: int = 0
) -> np.ndarray:
    """Packed records uint8 ``ids.shape + (dim + dim/32,)``: row ``id - row_start``'s
    fp8 bytes then its scale bytes; all zeros for ids the table does not hold."""
    weight = np.asarray(weight).view(np.uint8)
    scale = np.asarray(scale).view(np.uint8)
    records = np.concatenate([weight, scale], axis=1)
    ids = np.asarray(ids, dtype=np.int64)
    local = ids - row_start
    held = (local >= 0) & (local < records.shape[0])
    out = np.zeros(ids.shape + (records.shape[1],), dtype=np.uint8)
    out[held] = records[local[held]]
    return out


def decode_records_reference(records: np.ndarray) -> np.ndarray:
    """Packed records uint8 ``[..., dim + dim/32]`` -> bf16 ``[..., dim]`` by :func:`dequantize`."""
    records = np.asarray(records, dtype=np.uint8)
    dim = records.shape[-1] // (BLOCK_SIZE + 1) * BLOCK_SIZE
    return dequantize(records[..., :dim], records[..., dim:])
