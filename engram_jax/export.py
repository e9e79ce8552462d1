"""Trained rows back to the serving format: fp8 e4m3 values under a UE8M0 scale per
32 values, written as a safetensors checkpoint under DeepSeek's tensor names.

:func:`quantize_rows` is the per-block quantiser; :func:`export_table` streams a
table's rows through it a bounded chunk at a time and writes the same file
:func:`~engram_jax.checkpoint.save_checkpoint` writes, without holding the layer.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from engram_jax._format import BLOCK_SIZE
from engram_jax.checkpoint import SCALE_DTYPE, WEIGHT_DTYPE, tensor_names

# The largest finite float8_e4m3fn value: a block's scale keeps its max |x| within it.
E4M3_MAX = 448.0
# UE8M0 byte b means 2**(b - 127); 255 is NaN, so exponents run -127..127.
SCALE_BIAS = 127
MIN_EXPONENT = -SCALE_BIAS
# Inputs at or above 2**127 could dequantise past bfloat16's range (448 * 2**120 does).
MAX_ABS = 2.0**127
# Input bytes each export step reads from the table: bounds the buffers.
CHUNK_BYTES = 64 << 20


class RowSource(Protocol):
    """What :func:`export_table` reads: ``TrainableTable`` has it, so can a stand-in."""

    num_rows: int
    dim: int

    def read_rows(self, ids: np.ndarray) -> np.ndarray: ...


def _check_rows(rows: Any) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.dtype not in (np.float32, ml_dtypes.bfloat16):
        raise TypeError(f"rows must be float32 or bfloat16, got {rows.dtype}")
    if rows.ndim != 2 or rows.shape[1] == 0 or rows.shape[1] % BLOCK_SIZE:
        raise ValueError(
            f"rows must be [rows, dim] with dim a positive multiple of {BLOCK_SIZE}, "
            f"got shape {rows.shape}"
        )
    return rows


def block_exponents(blocks: np.ndarray) -> np.ndarray:
    """Per block of ``[..., 32]`` float32: the smallest ``e >= -127`` with max |x| <= 448 * 2**e
    (0 for an all-zero block), as int32 ``[...]``."""
    amax = np.max(np.abs(blocks), axis=-1).astype(np.float64)
    # frexp gives amax / 448 = m * 2**k with m in [0.5, 1): ceil(log2) is k, or k - 1 when
    # m is exactly 0.5. The division may round (float64 keeps float32's subnormals
    # apart), so the exact comparisons with 448 * 2**e below settle it.
    mantissa, k = np.frexp(amax / E4M3_MAX)
    e = np.where(mantissa == 0.5, k - 1, k).astype(np.int32)
    e = np.where(amax > np.ldexp(E4M3_MAX, e), e + 1, e)
    e = np.where(amax <= np.ldexp(E4M3_MAX, e - 1), e - 1, e)
    e = np.maximum(e, MIN_EXPONENT)
    return np.where(amax == 0, 0, e).astype(np.int32)


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[rows, dim]`` float32 or bfloat16 -> (float8_e4m3fn ``[rows, dim]``,
    float8_e8m0fnu ``[rows, dim/32]``), the serving format.

    Each block of 32 values gets the smallest power-of-two scale ``2**e`` that
    keeps its max |x| within 448 (e4m3's largest value; ``e`` no lower than
    -127, the smallest UE8M0 holds; an all-zero block gets byte 127, 2**0), and
    each value becomes ``x / 2**e`` rounded to the nearest e4m3, ties to even.

    The error bound this gives, per element, for ``q = x / 2**e``: at most half
    an e4m3 step, ``2**(max(floor(log2 |q|), -6) - 4) * 2**e``. So ``|x| / 17``
    where q is normal (|q| >= 2**-6), ``2**(e - 10)`` below, and never more than
    ``2**-4`` of the block's max |x|. Dequantising (``bf16(fp8 * 2**e)``) adds
    nothing while the result is a normal bfloat16. Non-finite values and
    ``|x| >= 2**127`` (which could dequantise past bfloat16's range) raise
    ``ValueError``.
    """
    rows = _check_rows(rows)
    n, dim = rows.shape
    values = rows.astype(np.float32).reshape(n, dim // BLOCK_SIZE, BLOCK_SIZE)
    if not np.all(np.isfinite(values)):
        raise ValueError("rows hold NaN or infinite values: nothing to quantise them to")
    if np.any(np.abs(values) >= MAX_ABS):
        raise ValueError(f"rows hold values of magnitude >= 2**127 (at most {MAX_ABS:.3g})")
    e = block_exponents(values)
    # A power-of-two scaling: exact, or (far below e4m3's resolution) harmlessly rounded.
    scaled = np.ldexp(values, -e[..., None])
    weight = scaled.astype(ml_dtypes.float8_e4m3fn).reshape(n, dim)
    scale = (e + SCALE_BIAS).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return weight, scale


def _header(layer: int, rows: int, dim: int, metadata: Mapping[str, str] | None) -> bytes:
    """The safetensors header save_checkpoint's writer gives these two tensors: compact
    JSON, tensors by name (scale before weight), padded with spaces to 8 bytes."""
    weight_name, scale_name = tensor_names(layer)
    scale_bytes = rows * (dim // BLOCK_SIZE)
    entries: dict[str, Any] = {}
    if metadata:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    entries[scale_name] = {
        "dtype": SCALE_DTYPE,
        "shape": [rows, dim // BLOCK_SIZE],
        "data_offsets": [0, scale_bytes],
    }
    entries[weight_name] = {
        "dtype": WEIGHT_DTYPE,
        "shape": [rows, dim],
        "data_offsets": [scale_bytes, scale_bytes + rows * dim],
    }
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
    while view.nbytes:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def export_table(
    table: RowSource,
    path: str | os.PathLike,
    layer: int,
    *,
    metadata: Mapping[str, str] | None = None,
    chunk_rows: int | None = None,
) -> Path:
    """Write ``table``'s rows, quantised by :func:`quantize_rows`, as layer ``layer`` of a
    safetensors checkpoint at ``path`` (``layers.{layer}.engram.embed.weight`` and
    ``.scale``); returns the path. :func:`~engram_jax.load_table` reads it back.

    ``table`` is anything with ``num_rows``, ``dim`` and ``read_rows(ids)`` (a
    ``TrainableTable``); it must hold a whole layer (``row_start`` 0). Rows are read
    ``chunk_rows`` at a time (default: 64 MiB of them), written to a file beside
    ``path`` and renamed over it at the end, so a failed export leaves no partial file.
    """
    num_rows, dim = int(table.num_rows), int(table.dim)
    row_start = int(getattr(table, "row_start", 0))
    if row_start != 0:
        raise ValueError(
            f"table holds rows from {row_start}: export a whole layer (row_start 0), "
            "not a head shard"
        )
    if num_rows < 1 or dim < 1 or dim % BLOCK_SIZE:
        raise ValueError(
            f"table must have rows and a dim that is a multiple of {BLOCK_SIZE}, "
            f"got {num_rows} x {dim}"
        )
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    if chunk_rows is None:
        chunk_rows = max(1, CHUNK_BYTES // (4 * dim))
    elif chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    path = Path(path)
    header = _header(int(layer), num_rows, dim, metadata)
    scales_at = len(header)
    weights_at = scales_at + num_rows * (dim // BLOCK_SIZE)
    partial = path.with_name(f".{path.name}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _pwrite_all(fd, np.frombuffer(header, np.uint8), 0)
        for lo in range(0, num_rows, chunk_rows):
            hi = min(num_rows, lo + chunk_rows)
            rows = np.asarray(table.read_rows(np.arange(lo, hi, dtype=np.int32)))
            if rows.shape != (hi - lo, dim):
                raise ValueError(
                    f"read_rows gave shape {rows.shape} for {hi - lo} rows of dim {dim}"
                )
            weight, scale = quantize_rows(rows)
            _pwrite_all(fd, scale, scales_at + lo * (dim // BLOCK_SIZE))
            _pwrite_all(fd, weight, weights_at + lo * dim)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        partial.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(partial, path)
    return path
