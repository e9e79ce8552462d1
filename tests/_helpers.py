"""Helpers shared by the test files: random tables and NaN-aware bitwise checks."""

from __future__ import annotations

import numpy as np

import engram_jax as ej

SPECIAL_SCALES = np.array([0, 1, 126, 127, 128, 254, 255], dtype=np.uint8)


def random_table_arrays(rng: np.random.Generator, rows: int, dim: int, scale_low: int = 0):
    """Random fp8 bytes (every pattern, NaN too) and scale bytes with the edge values mixed in."""
    weight = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    scale = rng.integers(scale_low, 256, (rows, dim // 32), dtype=np.uint8)
    if rows and scale_low == 0:
        flat = scale.reshape(-1)
        picks = rng.integers(0, flat.size, min(flat.size, 64))
        flat[picks] = rng.choice(SPECIAL_SCALES, picks.size)
    return weight, scale


def make_table(rng, rows, dim, placement="cpu", row_start=0, device=None):
    """A table of :func:`random_table_arrays` rows, with its weight and scale arrays."""
    weight, scale = random_table_arrays(rng, rows, dim)
    table = ej.EngramTable.from_arrays(
        weight, scale, placement=placement, row_start=row_start, device=device
    )
    return table, weight, scale


def nan_free_table_arrays(rows: int, dim: int, seed: int = 0):
    """Random fp8 bytes without NaN encodings and moderate scales, for exact comparisons."""
    rng = np.random.default_rng(seed)
    weight = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0
    scale = rng.integers(100, 150, (rows, dim // 32), dtype=np.uint8)
    return weight, scale


def assert_bf16_equal(actual, expected) -> None:
    """Bitwise equality of bf16 arrays, except that any NaN matches any NaN.

    Which NaN a product yields differs between CPUs and GPUs; everything else
    (signed zeros, infinities, subnormals) must match bit for bit.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a_nan = np.isnan(actual.astype(np.float32))
    e_nan = np.isnan(expected.astype(np.float32))
    np.testing.assert_array_equal(a_nan, e_nan)
    a_bits = actual.view(np.uint16)[~a_nan]
    e_bits = expected.view(np.uint16)[~e_nan]
    mismatch = np.flatnonzero(a_bits != e_bits)
    assert mismatch.size == 0, (
        f"{mismatch.size} bf16 values differ; first: got {a_bits[mismatch[0]]:#06x}, "
        f"want {e_bits[mismatch[0]]:#06x}"
    )
