"""Loading tables from safetensors checkpoints with DeepSeek's names.

Small real checkpoints are written with ``save_checkpoint`` (and, for the
malformed ones, with safetensors directly); loaded rows are compared bit for
bit with the arrays that went in, through ``read_rows`` and through ``lookup``.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from engram_jax import EngramTable, checkpoint, lookup, pack_records, row_stride, testing
from engram_jax.checkpoint import Checkpoint, CheckpointError
from engram_jax.storage import Allocation, MemoryKind, shared

from ._helpers import nan_free_table_arrays


def _assert_rows(table: EngramTable, weight: np.ndarray, scale: np.ndarray) -> None:
    ids = np.arange(table.row_start, table.row_stop)
    got_w, got_s = table.read_rows(ids)
    np.testing.assert_array_equal(got_w.view(np.uint8), weight[ids])
    np.testing.assert_array_equal(got_s.view(np.uint8), scale[ids])


@pytest.mark.parametrize("dim", [32, 96, 256])
@pytest.mark.parametrize("rows", [1, 7, 1000])
def test_round_trip_whole_layer(tmp_path, dim, rows):
    weight, scale = nan_free_table_arrays(rows, dim, seed=rows + dim)
    path = checkpoint.save_checkpoint(tmp_path / "m.safetensors", {0: (weight, scale)})
    with checkpoint.load_table(path, 0, placement="cpu", progress=False) as table:
        assert (table.row_start, table.num_rows, table.dim) == (0, rows, dim)
        _assert_rows(table, weight, scale)
        ids = np.array([[0, rows - 1, rows, -1]], np.int32)
        expected = testing.lookup_reference(weight, scale, ids)
        assert np.asarray(lookup(table, ids)).view(np.uint16).tolist() == (
            expected.view(np.uint16).tolist()
        )


@pytest.mark.parametrize("row_start, num_rows", [(0, 10), (13, 101), (499, 1), (250, 250)])
@pytest.mark.parametrize("chunk_rows, threads", [(1, 1), (7, 3), (4096, 2)])
def test_head_shard_is_read_in_chunks(tmp_path, row_start, num_rows, chunk_rows, threads):
    weight, scale = nan_free_table_arrays(500, 64)
    path = checkpoint.save_checkpoint(tmp_path / "m.safetensors", {5: (weight, scale)})
    table = EngramTable.allocate(num_rows, 64, row_start=row_start)
    try:
        stats = checkpoint.load_layer(
            table,
            path,
            5,
            chunk_bytes=chunk_rows * table.row_stride,
            threads=threads,
            progress=False,
        )
        assert stats.rows == num_rows and stats.nbytes == num_rows * table.row_stride
        _assert_rows(table, weight, scale)
        # Padding bytes of every record are zero, as pack_records writes them.
        records = table.allocation.read(0, table.nbytes).reshape(num_rows, table.row_stride)
        assert not records[:, 64 + 2 :].any()
    finally:
        table.close()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.integers(1, 300),
    dim=st.sampled_from([32, 64, 160]),
    data=st.data(),
)
def test_fuzz_ranges_and_chunks(tmp_path, rows, dim, data):
    row_start = data.draw(st.integers(0, rows - 1))
    num_rows = data.draw(st.integers(0, rows - row_start))
    chunk = data.draw(st.integers(1, 64))
    weight, scale = nan_free_table_arrays(rows, dim, seed=rows * dim)
    path = checkpoint.save_checkpoint(tmp_path / f"f{rows}_{dim}.safetensors", {2: (weight, scale)})
    table = EngramTable.allocate(num_rows, dim, row_start=row_start)
    try:
        checkpoint.load_layer(
            table, path, 2, chunk_bytes=chunk * table.row_stride, threads=2, progress=False
        )
        _assert_rows(table, weight, scale)
    finally:
        table.close()


def test_layers_spread_over_files_in_a_directory(tmp_path):
    w0, s0 = nan_free_table_arrays(40, 64, seed=1)
    w1, s1 = nan_free_table_arrays(30, 64, seed=2)
    checkpoint.save_checkpoint(tmp_path / "a.safetensors", {0: (w0, s0)})
    weight_name, scale_name = checkpoint.tensor_names(1)
    save_file({weight_name: w1.view(ml_dtypes.float8_e4m3fn)}, str(tmp_path / "b.safetensors"))
    save_file({scale_name: s1.view(ml_dtypes.float8_e8m0fnu)}, str(tmp_path / "c.safetensors"))
    ckpt = Checkpoint(tmp_path)
    assert len(ckpt.files) == 3
    for layer, (w, s) in {0: (w0, s0), 1: (w1, s1)}.items():
        with checkpoint.load_table(ckpt, layer, placement="cpu", progress=False) as table:
            _assert_rows(table, w, s)


def test_progress_bar_and_throughput_in_the_log(tmp_path, caplog, capsys):
    weight, scale = nan_free_table_arrays(64, 32)
    path = checkpoint.save_checkpoint(tmp_path / "m.safetensors", {3: (weight, scale)})
    with caplog.at_level(logging.INFO, logger="engram_jax.checkpoint"):
        checkpoint.load_table(path, 3, placement="cpu", progress=True).close()
    assert "engram layer 3" in capsys.readouterr().err
    (message,) = [r.getMessage() for r in caplog.records if "loaded layer 3" in r.getMessage()]
    assert "rows [0, 64)" in message and "GiB/s" in message


def test_raw_reads_when_safetensors_cannot_give_fp8_to_numpy(tmp_path):
    weight, scale = nan_free_table_arrays(16, 32)
    path = checkpoint.save_checkpoint(tmp_path / "m.safetensors", {0: (weight, scale)})
    table = EngramTable.allocate(16, 32)
    try:
        stats = checkpoint.load_layer(table, path, 0, progress=False)
    finally:
        table.close()
    has_fp8 = hasattr(np, "float8_e4m3fn")  # what safetensors' numpy reader looks up
    assert stats.raw_reads == (not has_fp8)


# -- errors ------------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    weight, scale = nan_free_table_arrays(20, 64)
    return checkpoint.save_checkpoint(tmp_path / "good.safetensors", {4: (weight, scale)})


def test_missing_tensor_names_it_and_the_files(good):
    with pytest.raises(
        CheckpointError, match=r"layers\.9\.engram\.embed\.weight.*good\.safetensors"
    ):
        checkpoint.load_table(good, 9, placement="cpu", progress=False)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        Checkpoint(tmp_path / "absent.safetensors")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize(
    "weight, scale, match",
    [
        (
            np.zeros((4, 64), np.uint8),
            np.zeros((4, 2), np.uint8),
            r"weight' in .*bad.* is U8, expected F8_E4M3",
        ),
        (
            np.zeros((4, 64), ml_dtypes.float8_e4m3fn),
            np.zeros((4, 2), np.uint8),
            r"scale' in .*bad.* is U8, expected F8_E8M0",
        ),
        (
            np.zeros((4, 64), ml_dtypes.float8_e4m3fn),
            np.zeros((4, 3), ml_dtypes.float8_e8m0fnu),
            r"scale' in .*bad.* has shape \[4, 3\], expected \[4, 2\]",
        ),
        (
            np.zeros((4, 40), ml_dtypes.float8_e4m3fn),
            np.zeros((4, 1), ml_dtypes.float8_e8m0fnu),
            r"weight' in .*bad.* has dim 40",
        ),
        (
            np.zeros(64, ml_dtypes.float8_e4m3fn),
            np.zeros((1, 2), ml_dtypes.float8_e8m0fnu),
            r"weight' in .*bad.* has shape \[64\], expected 2-D",
        ),
    ],
)
def test_mismatched_dtypes_and_shapes_name_tensor_and_file(tmp_path, weight, scale, match):
    weight_name, scale_name = checkpoint.tensor_names(0)
    path = tmp_path / "bad.safetensors"
    save_file({weight_name: weight, scale_name: scale}, str(path))
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load_table(path, 0, placement="cpu", progress=False)


def test_table_that_does_not_fit_the_checkpoint(good):
    with EngramTable.allocate(5, 32) as narrow:
        with pytest.raises(CheckpointError, match="dim 64, the table 32"):
            checkpoint.load_layer(narrow, good, 4, progress=False)
    with EngramTable.allocate(5, 64, row_start=18) as beyond:
        with pytest.raises(CheckpointError, match=r"20 rows; the table needs rows \[18, 23\)"):
            checkpoint.load_layer(beyond, good, 4, progress=False)
    with pytest.raises(CheckpointError, match=r"asked for rows \[15, 25\)"):
        checkpoint.load_table(good, 4, row_start=15, num_rows=10, placement="cpu")


@pytest.mark.parametrize("cut", [1, 100, 2000])
def test_truncated_file_is_an_error(good, cut):
    data = good.read_bytes()
    good.write_bytes(data[: len(data) - cut])
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.load_table(good, 4, placement="cpu", progress=False)


def test_truncated_after_opening_is_an_error_not_garbage(good):
    ckpt = Checkpoint(good)  # validated while whole
    os.truncate(good, os.path.getsize(good) - 64)
    with EngramTable.allocate(20, 64) as table, pytest.raises(CheckpointError, match="truncated"):
        checkpoint.load_layer(table, ckpt, 4, progress=False)


def test_duplicate_tensor_across_files(tmp_path):
    weight, scale = nan_free_table_arrays(4, 32)
    checkpoint.save_checkpoint(tmp_path / "a.safetensors", {0: (weight, scale)})
    checkpoint.save_checkpoint(tmp_path / "b.safetensors", {0: (weight, scale)})
    with pytest.raises(CheckpointError, match="in both"):
        Checkpoint(tmp_path)


def test_save_checkpoint_validates(tmp_path):
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        checkpoint.save_checkpoint(tmp_path / "x", {0: (np.zeros((2, 32), np.float32), None)})
    with pytest.raises(TypeError, match="scale"):
        checkpoint.save_checkpoint(
            tmp_path / "x", {0: (np.zeros((2, 32), np.uint8), np.zeros((2, 2), np.uint8))}
        )


# -- dummy init --------------------------------------------------------------------------


@pytest.mark.parametrize("rows, dim", [(1, 32), (3, 64), (20_000, 256), (70_001, 96)])
def test_dummy_table_is_all_ones(rows, dim):
    with checkpoint.dummy_table(rows, dim, placement="cpu") as table:
        weight, scale = checkpoint.dummy_reference(rows, dim)
        _assert_rows(table, weight.view(np.uint8), scale.view(np.uint8))
        out = np.asarray(lookup(table, np.array([[0, rows - 1]], np.int32)))
        assert (out.astype(np.float32) == 1.0).all()


class _CopiedMemory(Allocation):
    """Stands in for device memory: no host view, written through _copy_in."""

    def __init__(self, nbytes: int) -> None:
        self.backing = np.full(nbytes, 0xAA, np.uint8)
        super().__init__(
            placement="copied",
            address=self.backing.ctypes.data,
            nbytes=nbytes,
            kind=MemoryKind.HOST,
            release=lambda: None,
        )

    def _copy_in(self, offset, data):
        self.backing[offset : offset + data.nbytes] = data


@pytest.mark.parametrize("rows, dim", [(5, 32), (20_000, 256)])
def test_fill_dummy_writes_whole_records_with_and_without_a_host_view(rows, dim):
    # The benchmarks fill pinned and device tables with it: fp8 1.0 (0x38) under
    # scale 2^0 (127) and zero padding, through the host view or through write().
    stride = row_stride(dim)
    record = np.zeros(stride, np.uint8)
    record[:dim] = 0x38
    record[dim : dim + dim // 32] = 127
    expected = np.tile(record, rows)
    with EngramTable.allocate(rows, dim, placement="cpu") as table:
        table.allocation.host_array[:] = 0xAA
        checkpoint.fill_dummy(table)
        np.testing.assert_array_equal(table.allocation.host_array[: rows * stride], expected)
    memory = _CopiedMemory(rows * stride)
    with EngramTable(memory, num_rows=rows, dim=dim) as table:
        checkpoint.fill_dummy(table)
    np.testing.assert_array_equal(memory.backing, expected)


# -- distinct rows -----------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = x * 0x85EBCA6B & _M32
    x ^= x >> 13
    x = x * 0xC2B2AE35 & _M32
    return x ^ x >> 16


def _distinct_row(row: int, dim: int, seed: int) -> tuple[list[int], list[int]]:
    """distinct_bytes's definition for one row, in plain Python ints, a value at a time."""
    key = (seed * 0x9E3779B9 + 0x7F4A7C15) & _M32
    ident = _fmix32(row & _M32 ^ key)
    weight = []
    for j in range(8):
        nibble = ident >> 4 * j & 15
        weight.append((nibble & 8) << 4 | 0x38 | nibble & 7)
    base = row % 4096
    for j in range(8, dim):
        b = _fmix32((1 << 31 | base * dim + j) ^ key) & 0xFF
        weight.append(b & 0x87 | (5 + (b >> 3 & 3)) << 3)
    scale = [
        124 + (_fmix32((3 << 30 | base * (dim // 32) + k) ^ key) & 3) for k in range(dim // 32)
    ]
    return weight, scale


@pytest.mark.parametrize("dim", [32, 96, 256])
@pytest.mark.parametrize("seed", [0, 7])
def test_distinct_bytes_follow_their_definition_in_numpy_and_jax(dim, seed):
    ids = np.array([0, 1, 4095, 4096, 4097, 123_456, 2**31 - 1, 9_999_999, 8191], np.int64)
    weight, scale = checkpoint.distinct_bytes(ids, dim, seed=seed)
    assert weight.dtype == scale.dtype == np.uint8
    for i, row in enumerate(ids):
        want_weight, want_scale = _distinct_row(int(row), dim, seed)
        assert weight[i].tolist() == want_weight, row
        assert scale[i].tolist() == want_scale, row
    # The same bytes from jax arrays, traced (how a benchmark computes expected rows).
    traced = jax.jit(lambda i: checkpoint.distinct_bytes(i, dim, seed=seed))(
        jnp.asarray(ids.reshape(3, 3), jnp.int32)
    )
    np.testing.assert_array_equal(np.asarray(traced[0]), weight.reshape(3, 3, dim))
    np.testing.assert_array_equal(np.asarray(traced[1]), scale.reshape(3, 3, dim // 32))


def test_distinct_rows_differ_and_decode_finite_and_exact():
    rng = np.random.default_rng(0)
    ids = np.concatenate(
        [np.arange(300_000), 300_000 + rng.choice(2**31 - 300_000, 200_000, replace=False)]
    )
    weight, scale = checkpoint.distinct_bytes(ids, 64)
    # Every row's first 8 values alone tell it from every other row.
    assert np.unique(weight[:, :8].copy().view(np.uint64)).size == ids.size
    assert not ((weight & 0x7F) == 0x7F).any()  # no fp8 NaN encoding
    assert ((scale >= 124) & (scale <= 127)).all()
    rows = testing.dequantize(weight[:20_000], scale[:20_000]).astype(np.float32)
    exact = weight[:20_000].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.repeat(
        scale[:20_000].view(ml_dtypes.float8_e8m0fnu).astype(np.float32), 32, -1
    )
    np.testing.assert_array_equal(rows, exact)  # bf16 holds every value exactly
    assert (np.abs(rows) >= 2**-5).all() and (np.abs(rows) <= 3.75).all()


@pytest.mark.parametrize("rows, dim, row_start", [(1, 32, 0), (4099, 96, 13), (70_001, 256, 4090)])
@pytest.mark.parametrize("threads", [1, 3])
def test_fill_distinct_writes_the_definition_with_and_without_a_host_view(
    rows, dim, row_start, threads, monkeypatch
):
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 5000 * row_stride(dim))
    ids = np.arange(row_start, row_start + rows)
    expected = pack_records(*checkpoint.distinct_bytes(ids, dim, seed=3))
    with EngramTable.allocate(rows, dim, placement="cpu", row_start=row_start) as table:
        table.allocation.host_array[:] = 0xAA
        checkpoint.fill_distinct(table, seed=3, threads=threads)
        np.testing.assert_array_equal(
            table.allocation.host_array[: table.nbytes].reshape(rows, -1), expected
        )
        got_weight, got_scale = table.read_rows(ids)
        np.testing.assert_array_equal(got_weight.view(np.uint8), expected[:, :dim])
        np.testing.assert_array_equal(got_scale.view(np.uint8), expected[:, dim : dim + dim // 32])
    memory = _CopiedMemory(rows * row_stride(dim))
    with EngramTable(memory, num_rows=rows, dim=dim, row_start=row_start) as table:
        checkpoint.fill_distinct(table, seed=3, threads=threads)
    np.testing.assert_array_equal(memory.backing.reshape(rows, -1), expected)


def test_distinct_table_lookup_and_seeds():
    with checkpoint.dummy_table(5000, 64, placement="cpu", fill="distinct", seed=1) as table:
        ids = np.array([[0, 4999, 4096, -1, 5000], [17, 17, 3, 2, 1]], np.int32)
        weight, scale = checkpoint.distinct_bytes(np.arange(5000), 64, seed=1)
        expected = testing.lookup_reference(weight, scale, ids)
        assert np.asarray(lookup(table, ids)).view(np.uint16).tolist() == (
            expected.view(np.uint16).tolist()
        )
        first = table.allocation.host_array[: table.nbytes].copy()
        checkpoint.fill_distinct(table, seed=1)
        np.testing.assert_array_equal(table.allocation.host_array[: table.nbytes], first)
        checkpoint.fill_distinct(table, seed=2)
        other = table.allocation.host_array[: table.nbytes].reshape(5000, -1)
        # Another seed: every row's id values differ (the chance of a match is 2**-32 a row).
        assert (other[:, :8] != first.reshape(5000, -1)[:, :8]).any(axis=1).all()
    with pytest.raises(ValueError, match="fill must be one of"):
        checkpoint.dummy_table(4, 64, placement="cpu", fill="random")
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        checkpoint.dummy_table(4, 64, placement="cpu", fill="distinct", seed=-1)
    with pytest.raises(ValueError, match="multiple of 32"):
        checkpoint.distinct_bytes(np.arange(3), 40)


def test_fill_distinct_reports_progress_and_stops_when_it_raises(monkeypatch):
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 100 * row_stride(32))
    with EngramTable.allocate(1000, 32, placement="cpu") as table:
        done = []
        checkpoint.fill_distinct(table, threads=1, progress=done.append)
        assert done == [100 * table.row_stride] * 10

        table.allocation.host_array[:] = 0

        def stop(nbytes):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            checkpoint.fill_distinct(table, threads=1, progress=stop)
        records = table.allocation.host_array[: table.nbytes].reshape(1000, -1)
        assert not records[-100:].any()  # the chunks after the first were never written


def test_rows_cut_off_while_reading_are_an_error(good):
    ckpt = Checkpoint(good)
    weight, scale = ckpt.layer(4)
    reader = checkpoint._RowReader(ckpt, [weight, scale])
    try:
        os.truncate(good, weight.offset + 3 * weight.row_bytes)
        out = np.empty(20 * weight.row_bytes, np.uint8)
        assert reader.read(weight, 0, 3, out).shape == (3, 64)
        if reader.raw:
            with pytest.raises(CheckpointError, match=r"weight' in .*file ends after.*truncated"):
                reader.read(weight, 0, 4, out)
    finally:
        reader.close()


@pytest.mark.parametrize("placement", ["device", "floppy"])
def test_shared_table_refuses_placements_that_are_not_host_memory(good, placement):
    """Without the check these became a GPU-backend share and failed as 'no CUDA GPU'."""
    group = shared.NodeGroup.single()
    with pytest.raises(ValueError, match=f"placement '{placement}' cannot be shared"):
        checkpoint.dummy_table(4, 64, placement=placement, group=group)
    with pytest.raises(ValueError, match=f"placement '{placement}' cannot be shared"):
        checkpoint.load_table(good, 4, placement=placement, group=group, progress=False)
    with checkpoint.dummy_table(4, 64, placement="cpu", group=group) as table:
        assert table.placement == "shared_shm"


def test_save_into_a_missing_folder_names_the_folder(tmp_path):
    weight = np.zeros((4, 32), ml_dtypes.float8_e4m3fn)
    scale = np.full((4, 1), 127, np.uint8)
    missing = tmp_path / "no_such_folder"
    with pytest.raises(FileNotFoundError, match="folder .*no_such_folder.* does not exist"):
        checkpoint.save_checkpoint(missing / "m.safetensors", {0: (weight, scale)})
    assert not missing.exists()
