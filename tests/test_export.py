"""Exporting trained rows to the serving format: ``quantize_rows`` against the numpy
reference bit for bit, its error bound (half an e4m3 step, at most 2**-4 of the block
max) met and reached, and ``export_table`` files that ``load_table`` and ``lookup``
read back as exactly the dequantised quantised rows.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import engram_jax as ej
from engram_jax import testing

from ._helpers import assert_bf16_equal

DTYPES = [np.float32, ml_dtypes.bfloat16]


def _rows(rng: np.random.Generator, n: int, dim: int, dtype) -> np.ndarray:
    """Rows whose blocks span many magnitudes, with zero blocks, zeros and signed zeros."""
    blocks = dim // 32
    exponent = rng.integers(-40, 40, (n, blocks, 1))
    x = rng.standard_normal((n, blocks, 32)) * np.exp2(exponent)
    x[rng.random((n, blocks, 32)) < 0.05] = 0.0
    x[rng.random((n, blocks, 32)) < 0.02] = -0.0
    x[rng.random((n, blocks)) < 0.1] = 0.0
    return x.reshape(n, dim).astype(dtype)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _assert_matches_reference(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    weight, scale = ej.quantize_rows(rows)
    ref_w, ref_s = testing.quantize_rows_reference(rows)
    assert weight.dtype == ml_dtypes.float8_e4m3fn and weight.shape == rows.shape
    assert scale.dtype == ml_dtypes.float8_e8m0fnu
    assert scale.shape == (rows.shape[0], rows.shape[1] // 32)
    np.testing.assert_array_equal(_bits(scale), _bits(ref_s))
    np.testing.assert_array_equal(_bits(weight), _bits(ref_w))
    return weight, scale


def test_reference_grid_is_e4m3():
    values, codes = testing.e4m3_grid()
    np.testing.assert_array_equal(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64), values)
    assert values[-1] == 448.0 and np.all(np.diff(values) > 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, dim", [(1, 32), (7, 96), (33, 256)])
def test_quantize_matches_reference(dtype, n, dim):
    rows = _rows(np.random.default_rng(n * dim), n, dim, dtype)
    _assert_matches_reference(rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exactly_representable_rows_round_trip(dtype):
    # Every e4m3 value times one power of two per block: quantising loses nothing.
    values, _ = testing.e4m3_grid()
    rng = np.random.default_rng(1)
    q = rng.choice(values, (5, 4, 32)) * rng.choice([-1, 1], (5, 4, 32))
    q[:, :, 0] = 448.0  # pins the scale: the block's max is exactly 448 * 2**e
    rows = (q * np.exp2(rng.integers(-30, 30, (5, 4, 1)))).reshape(5, 128).astype(dtype)
    weight, scale = _assert_matches_reference(rows)
    back = testing.dequantize(weight, scale).astype(np.float32)
    np.testing.assert_array_equal(back, rows.astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_error_is_at_most_half_a_step_and_reaches_it(dtype):
    rows = _rows(np.random.default_rng(2), 64, 256, dtype)
    weight, scale = _assert_matches_reference(rows)
    x = rows.astype(np.float64)
    err = np.abs(testing.dequantize(weight, scale).astype(np.float64) - x)
    bound = testing.quantization_bound(rows, scale)
    assert np.all(err <= bound)
    amax = np.repeat(np.abs(x).reshape(64, 8, 32).max(-1), 32, axis=-1)
    assert np.all(err <= 2.0**-4 * amax)
    normal = np.abs(x) >= 2.0**-6 * np.exp2(
        np.repeat(_bits(scale).astype(np.float64) - 127, 32, axis=-1)
    )
    assert np.all(err[normal] <= np.abs(x[normal]) / 17)
    # The bound is reached: a value halfway between two e4m3 steps (1 + 1/16) rounds
    # to even (1.0), an error of exactly half a step, 1/17 of |x|.
    tie = np.full((1, 32), 1 + 1 / 16, np.float32)
    tie[0, 0] = 448.0
    w, s = ej.quantize_rows(tie.astype(dtype))
    tie_err = np.abs(testing.dequantize(w, s).astype(np.float64) - tie.astype(np.float64))
    np.testing.assert_array_equal(tie_err[0, 1:], testing.quantization_bound(tie, s)[0, 1:])
    assert tie_err[0, 0] == 0 and tie_err[0, 1] == 1 / 16


def test_scale_is_the_smallest_that_fits():
    rows = _rows(np.random.default_rng(3), 50, 128, np.float32)
    weight, scale = _assert_matches_reference(rows)
    e = _bits(scale).astype(np.int64) - 127
    amax = np.abs(rows.astype(np.float64)).reshape(50, 4, 32).max(-1)
    nonzero = amax > 0
    assert np.all(amax[nonzero] <= 448.0 * np.exp2(e[nonzero]))
    assert np.all(amax[nonzero] > 448.0 * np.exp2(e[nonzero] - 1))
    assert np.all(_bits(scale)[~nonzero] == 127)


def test_zero_blocks_tiny_blocks_and_boundaries():
    rows = np.zeros((4, 64), np.float32)
    rows[0, 32:] = -0.0
    rows[1, :32] = 2.0**-149  # below 448 * 2**-127: the smallest scale, byte 0
    rows[2, :32] = 448.0  # exactly 448 * 2**0
    rows[2, 32:] = np.nextafter(np.float32(448.0), np.float32(np.inf))  # just past: 2**1
    rows[3, :] = np.float32(2.0**127) * np.float32(0.99)  # largest magnitude accepted
    weight, scale = _assert_matches_reference(rows)
    assert _bits(scale).tolist() == [[127, 127], [0, 127], [127, 128], [127 + 119, 127 + 119]]
    assert np.all(_bits(weight)[0, :32] == 0) and np.all(_bits(weight)[0, 32:] == 0x80)
    assert np.all(np.isfinite(testing.dequantize(weight, scale).astype(np.float32)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 4), st.sampled_from([32, 64])),
        elements=st.floats(-(2.0**126), 2.0**126, width=32, allow_subnormal=True),
    )
)
def test_quantize_fuzz(rows):
    weight, scale = _assert_matches_reference(rows)
    err = np.abs(testing.dequantize(weight, scale).astype(np.float64) - rows.astype(np.float64))
    # bfloat16's own subnormal rounding (below 2**-126) is the one addition to the bound.
    assert np.all(err <= testing.quantization_bound(rows, scale) + 2.0**-134)


@pytest.mark.parametrize(
    "rows, error, match",
    [
        (np.full((2, 32), np.nan, np.float32), ValueError, "NaN or infinite"),
        (np.full((2, 32), np.inf, np.float32), ValueError, "NaN or infinite"),
        (np.full((2, 32), 2.0**127, np.float32), ValueError, "2\\*\\*127"),
        (np.zeros((2, 32), np.float16), TypeError, "float32 or bfloat16"),
        (np.zeros((2, 33), np.float32), ValueError, "multiple of 32"),
        (np.zeros((64,), np.float32), ValueError, "multiple of 32"),
    ],
)
def test_quantize_rejects(rows, error, match):
    with pytest.raises(error, match=match):
        ej.quantize_rows(rows)


# -- export_table -----------------------------------------------------------------


class RowsStandIn:
    """The least a table needs for export: rows, dim and read_rows, counting its calls."""

    def __init__(self, rows: np.ndarray, fail_after: int | None = None) -> None:
        self.rows = rows
        self.num_rows, self.dim = rows.shape
        self.dtype = rows.dtype
        self.calls = 0
        self.fail_after = fail_after

    def read_rows(self, ids):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("read failed")
        return self.rows[np.asarray(ids)]


def _check_export(tmp_path, table, rows: np.ndarray, layer: int, **kwargs) -> None:
    path = ej.export_table(table, tmp_path / "out.safetensors", layer, **kwargs)
    weight, scale = ej.quantize_rows(rows)
    metadata = kwargs.get("metadata")
    same = ej.save_checkpoint(
        tmp_path / "same.safetensors", {layer: (weight, scale)}, metadata=metadata
    )
    assert path.read_bytes() == same.read_bytes()
    expected = testing.dequantize(weight, scale)
    with ej.load_table(path, layer, placement="cpu", progress=False) as loaded:
        assert (loaded.num_rows, loaded.dim) == rows.shape
        ids = np.arange(-1, rows.shape[0] + 1, dtype=np.int32).reshape(1, -1)
        got = np.asarray(ej.lookup(loaded, ids))
    assert_bf16_equal(got[0, 1:-1], expected)
    assert not np.any(got[0, [0, -1]].astype(np.float32))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, dim, chunk_rows", [(1, 32, None), (37, 96, 5), (100, 64, 1)])
def test_export_stand_in_round_trips(tmp_path, dtype, n, dim, chunk_rows):
    rows = _rows(np.random.default_rng(n), n, dim, dtype)
    table = RowsStandIn(rows)
    _check_export(tmp_path, table, rows, layer=3, chunk_rows=chunk_rows)
    assert table.calls == (1 if chunk_rows is None else -(-n // chunk_rows))


def test_export_keeps_metadata(tmp_path):
    rows = _rows(np.random.default_rng(0), 9, 64, np.float32)
    _check_export(tmp_path, RowsStandIn(rows), rows, layer=14, metadata={"step": "100"})


@pytest.mark.skipif(not hasattr(ej, "TrainableTable"), reason="TrainableTable not merged yet")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_trainable_table_round_trips(tmp_path, dtype):
    rows = _rows(np.random.default_rng(5), 300, 64, getattr(ml_dtypes, dtype, np.float32))
    with ej.TrainableTable.from_array(rows, optimizer=ej.sgd(), placement="cpu") as table:
        _check_export(tmp_path, table, rows, layer=1, chunk_rows=64)


def test_failed_export_leaves_nothing(tmp_path):
    rows = _rows(np.random.default_rng(0), 20, 32, np.float32)
    target = tmp_path / "out.safetensors"
    with pytest.raises(RuntimeError, match="read failed"):
        ej.export_table(RowsStandIn(rows, fail_after=2), target, 0, chunk_rows=4)
    assert list(tmp_path.iterdir()) == []
    bad = rows.copy()
    bad[7, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        ej.export_table(RowsStandIn(bad), target, 0)
    assert list(tmp_path.iterdir()) == []


def test_export_rejects(tmp_path):
    rows = np.zeros((4, 32), np.float32)
    shard = RowsStandIn(rows)
    shard.row_start = 8
    with pytest.raises(ValueError, match="whole layer"):
        ej.export_table(shard, tmp_path / "x", 0)
    with pytest.raises(ValueError, match="layer"):
        ej.export_table(RowsStandIn(rows), tmp_path / "x", -1)
    with pytest.raises(ValueError, match="chunk_rows"):
        ej.export_table(RowsStandIn(rows), tmp_path / "x", 0, chunk_rows=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        ej.export_table(RowsStandIn(np.zeros((4, 48), np.float32)), tmp_path / "x", 0)
