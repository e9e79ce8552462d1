"""numpy reference for the export quantiser: per block of 32 values the smallest
UE8M0 scale that keeps the block within e4m3's 448, and round-to-nearest-even onto
the e4m3 grid, both found by search over every candidate (no casts, no frexp).

Slow and obvious on purpose: the tests compare ``quantize_rows`` with it bit for bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from engram_jax._format import BLOCK_SIZE


def e4m3_grid() -> tuple[np.ndarray, np.ndarray]:
    """(values, bytes) of every finite non-negative e4m3 number, ascending, from the
    bit layout: byte ``0EEEEMMM``; E = 0 is ``M * 2**-9``, else ``(1 + M/8) * 2**(E-7)``;
    0x7F is NaN."""
    codes = np.arange(0x7F, dtype=np.int64)
    exponent, mantissa = codes >> 3, codes & 7
    values = np.where(
        exponent == 0,
        mantissa * 2.0**-9,
        (1 + mantissa / 8) * 2.0 ** (exponent - 7),
    )
    return values, codes.astype(np.uint8)


def _round_e4m3(q: np.ndarray) -> np.ndarray:
    """float64 ``q`` with |q| <= 448 -> e4m3 bytes, nearest value, ties to the even byte."""
    values, codes = e4m3_grid()
    mag = np.abs(q)
    hi = np.clip(np.searchsorted(values, mag, side="left"), 0, values.size - 1)
    lo = np.maximum(hi - 1, 0)
    below, above = mag - values[lo], values[hi] - mag
    pick_hi = (above < below) | ((above == below) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, codes[hi], codes[lo])
    return (out | np.where(np.signbit(q), 0x80, 0)).astype(np.uint8)


def quantize_rows_reference(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[rows, dim]`` float32/bfloat16 -> (e4m3 ``[rows, dim]``, e8m0 ``[rows, dim/32]``)."""
    values = np.asarray(rows).astype(np.float64)
    n, dim = values.shape
    blocks = values.reshape(n, dim // BLOCK_SIZE, BLOCK_SIZE)
    amax = np.abs(blocks).max(axis=-1)
    exponents = np.arange(-127, 128)
    limits = 448.0 * np.exp2(exponents.astype(np.float64))
    e = exponents[np.searchsorted(limits, amax, side="left")]
    e = np.where(amax == 0, 0, e)
    weight = _round_e4m3(blocks / np.exp2(e.astype(np.float64))[..., None]).reshape(n, dim)
    scale = (e + 127).astype(np.uint8)
    return weight.view(ml_dtypes.float8_e4m3fn), scale.view(ml_dtypes.float8_e8m0fnu)


def quantization_bound(rows: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Half an e4m3 step at each element's magnitude under its block's scale: the most
    round-to-nearest may move it, ``2**(max(floor(log2|q|), -6) - 4) * 2**e`` for
    ``q = x / 2**e`` (float64 ``[rows, dim]``)."""
    values = np.asarray(rows).astype(np.float64)
    e = np.asarray(scale).view(np.uint8).astype(np.float64) - 127
    step = np.exp2(np.repeat(e, BLOCK_SIZE, axis=-1))
    q = np.abs(values) / step
    _, k = np.frexp(q)  # q = m * 2**k, m in [0.5, 1): floor(log2 q) = k - 1, exactly
    binade = np.where(q > 0, k - 1, -6)
    return np.exp2(np.maximum(binade, -6) - 4) * step
