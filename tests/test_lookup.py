"""engram_jax.lookup against the numpy reference: bitwise, on the CPU backend
(CI) and, marked gpu, on CUDA for pinned and device tables; under jit, vmap
and scan; edge ids, empty batches, closed tables and bad input.
"""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engram_jax as ej
from engram_jax import testing

from ._helpers import assert_bf16_equal, make_table, random_table_arrays

DIMS = [64, 128, 256, 512]


def edge_ids(rows, row_start, shape, rng):
    """Ids mixing held rows, the first and last held row, DEAD, and every kind of outside id."""
    specials = np.array(
        [
            -1,
            -2,
            -(2**31),
            2**31 - 1,
            row_start - 1,
            row_start,
            row_start + rows - 1,
            row_start + rows,
        ],
        dtype=np.int64,
    )
    ids = rng.integers(row_start, row_start + rows, shape).astype(np.int64)
    flat = ids.reshape(-1)
    picks = rng.integers(0, flat.size, max(1, flat.size // 4))
    flat[picks] = rng.choice(specials, picks.size)
    return np.clip(ids, -(2**31), 2**31 - 1).astype(np.int32)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("heads", [1, 7, 24, 48])
def test_matches_reference_cpu(dim, heads):
    rng = np.random.default_rng(dim * 100 + heads)
    rows, row_start = 37, 1000
    table, weight, scale = make_table(rng, rows, dim, row_start=row_start)
    with table:
        ids = edge_ids(rows, row_start, (5, heads), rng)
        out = jax.jit(lambda i: ej.lookup(table, i))(ids)
        assert out.dtype == jnp.bfloat16 and out.shape == (5, heads, dim)
        assert_bf16_equal(out, testing.lookup_reference(weight, scale, ids, row_start))


def test_leading_dims_preserved():
    rng = np.random.default_rng(1)
    table, weight, scale = make_table(rng, 50, 64)
    with table:
        ids = rng.integers(-1, 50, (2, 3, 4, 5)).astype(np.int32)
        out = ej.lookup(table, ids)
        assert out.shape == (2, 3, 4, 5, 64)
        assert_bf16_equal(out, testing.lookup_reference(weight, scale, ids))


def test_large_batch_uses_threads_and_matches():
    # Enough rows that the CPU handler splits the work across threads.
    rng = np.random.default_rng(2)
    table, weight, scale = make_table(rng, 4096, 128)
    with table:
        ids = rng.integers(-3, 4100, (3000, 24)).astype(np.int32)
        assert_bf16_equal(ej.lookup(table, ids), testing.lookup_reference(weight, scale, ids))


def every_pair_table_arrays():
    """Row s holds all 256 fp8 bytes under scale byte s: every (value, scale) pair once."""
    weight = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 256 // 32, axis=1)
    return weight, scale


def test_every_fp8_and_scale_pair():
    weight, scale = every_pair_table_arrays()
    with ej.EngramTable.from_arrays(weight.view(ml_dtypes.float8_e4m3fn), scale) as table:
        ids = np.arange(256, dtype=np.int32)[:, None]
        assert_bf16_equal(ej.lookup(table, ids), testing.lookup_reference(weight, scale, ids))


def test_empty_batch():
    rng = np.random.default_rng(3)
    table, _, _ = make_table(rng, 8, 64)
    with table:
        out = jax.jit(lambda i: ej.lookup(table, i))(np.zeros((0, 24), np.int32))
        assert out.shape == (0, 24, 64) and out.dtype == jnp.bfloat16


def test_empty_table_gives_zeros():
    with ej.EngramTable.allocate(0, 64) as table:
        out = ej.lookup(table, np.array([[0, 1, -1]], np.int32))
        assert not np.asarray(out, np.float32).any()


def test_vmap_and_scan():
    rng = np.random.default_rng(4)
    table, weight, scale = make_table(rng, 100, 128, row_start=5)
    with table:
        ids = rng.integers(0, 110, (6, 4, 24)).astype(np.int32)
        expected = testing.lookup_reference(weight, scale, ids, 5)
        assert_bf16_equal(jax.vmap(lambda i: ej.lookup(table, i))(ids), expected)

        def body(carry, step_ids):
            rows = ej.lookup(table, step_ids)
            return carry + rows.astype(jnp.float32).sum(), rows

        _, stacked = jax.jit(lambda i: jax.lax.scan(body, 0.0, i))(ids)
        assert_bf16_equal(stacked, expected)


def test_table_as_jit_argument():
    rng = np.random.default_rng(5)
    t1, w1, s1 = make_table(rng, 20, 64)
    t2, w2, s2 = make_table(rng, 20, 64)
    with t1, t2:
        f = jax.jit(ej.lookup)
        ids = rng.integers(0, 20, (3, 2)).astype(np.int32)
        assert_bf16_equal(f(t1, ids), testing.lookup_reference(w1, s1, ids))
        assert_bf16_equal(f(t2, ids), testing.lookup_reference(w2, s2, ids))


def test_closed_table_raises_before_and_inside_compiled_code():
    rng = np.random.default_rng(6)
    table, _, _ = make_table(rng, 10, 64)
    f = jax.jit(lambda i: ej.lookup(table, i))
    ids = np.zeros((2, 3), np.int32)
    f(ids).block_until_ready()
    table.close()
    table.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        ej.lookup(table, ids)
    # The compiled program is cached; the handler must refuse, not read freed memory.
    with pytest.raises(Exception, match="closed"):
        f(ids).block_until_ready()


def test_garbage_collected_table_is_unregistered():
    import gc

    from engram_jax import _native

    rng = np.random.default_rng(7)
    table, _, _ = make_table(rng, 10, 64)
    key = table.key
    del table
    gc.collect()
    assert _native.native.unregister_table(key) == 0


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64),
    row_start=st.integers(0, 2**20),
)
def test_fuzz_ids(ids, row_start):
    rng = np.random.default_rng(len(ids))
    table, weight, scale = make_table(rng, 33, 64, row_start=row_start)
    with table:
        ids = np.asarray(ids, np.int32)[:, None]
        # Hit the table often too, not only random 32-bit ids.
        ids[::3, 0] = row_start + (np.abs(ids[::3, 0].astype(np.int64)) % 40) - 3
        assert_bf16_equal(
            ej.lookup(table, ids), testing.lookup_reference(weight, scale, ids, row_start)
        )


# -- bad input ----------------------------------------------------------------


def test_rejects_bad_ids():
    rng = np.random.default_rng(8)
    table, _, _ = make_table(rng, 10, 64)
    with table:
        with pytest.raises(TypeError, match="int32"):
            ej.lookup(table, np.zeros((2, 3), np.float32))
        with pytest.raises(ValueError, match="at least one axis"):
            ej.lookup(table, np.int32(3))
        with pytest.raises(TypeError, match="EngramTable"):
            ej.lookup("table", np.zeros((2, 3), np.int32))
        with pytest.raises(ValueError, match="max_ctas"):
            ej.lookup(table, np.zeros((2, 3), np.int32), max_ctas=0)


@pytest.mark.parametrize(
    "weight_shape, weight_dtype, scale_shape, scale_dtype, error, match",
    [
        ((4, 48), np.uint8, (4, 1), np.uint8, ValueError, "multiple of 32"),
        ((4, 64), np.float32, (4, 2), np.uint8, TypeError, "weight"),
        ((4, 64), np.uint8, (4, 3), np.uint8, ValueError, "scale"),
        ((4, 64), np.uint8, (4, 2), np.int32, TypeError, "scale"),
        ((64,), np.uint8, (2,), np.uint8, ValueError, "weight"),
    ],
)
def test_rejects_bad_arrays(weight_shape, weight_dtype, scale_shape, scale_dtype, error, match):
    with pytest.raises(error, match=match):
        ej.EngramTable.from_arrays(
            np.zeros(weight_shape, weight_dtype), np.zeros(scale_shape, scale_dtype)
        )


def test_allocate_names_rows_and_the_table_in_its_errors():
    with pytest.raises(ValueError, match=r"num_rows and row_start must be >= 0, got -5, 0"):
        ej.EngramTable.allocate(-5, 64)
    with pytest.raises(ValueError, match=r"int32.*got 0 \+ 10000000000000"):
        ej.EngramTable.allocate(10**13, 64)
    # Within the int32 rows, more bytes than the machine has (35 TiB): a MemoryError
    # naming the table, not numpy's private _ArrayMemoryError about a flat array.
    with pytest.raises(MemoryError, match=r"2,147,483,647 rows of dim 16384 .* 'cpu' memory") as e:
        ej.EngramTable.allocate(2**31 - 1, 16384, placement="cpu")
    assert type(e.value) is MemoryError


def test_wide_ids_past_int32_warn_outside_jit_and_the_error_names_narrow_ids():
    rng = np.random.default_rng(10)
    table, weight, scale = make_table(rng, 10, 64)
    with table:
        ids = np.array([[2**32 + 5, 5, -(2**40)]], np.int64)
        with pytest.warns(UserWarning, match=r"2 of 3 int64 ids .*narrow_ids") as record:
            rows = ej.lookup(table, ids)
        assert record[0].filename == __file__  # points at the caller
        # Past int32 reads as DEAD here (zero rows), never row 5.
        assert_bf16_equal(rows, testing.lookup_reference(weight, scale, np.array([[-1, 5, -1]])))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ej.lookup(table, np.array([[1, 2]], np.int64))  # in range: no warning
        with jax.enable_x64(True):
            with pytest.raises(TypeError, match="int64.*narrow_ids.*wraps onto a real row"):
                ej.lookup(table, jnp.array([[1]], jnp.int64))
    assert "narrow_ids" in ej.lookup.__doc__ and "wraps onto a real row" in ej.lookup.__doc__


def test_the_error_of_a_closed_table_in_compiled_code_names_it():
    rng = np.random.default_rng(11)
    table, _, _ = make_table(rng, 4, 64)
    f = jax.jit(lambda i: ej.lookup(table, i))
    f(np.zeros((1, 1), np.int32)).block_until_ready()
    shown = repr(table)
    table.close()
    with pytest.raises(Exception, match=f"table {table.key} is closed") as e:
        f(np.zeros((1, 1), np.int32)).block_until_ready()
    assert f"key={table.key})" in shown and f"(it was {shown})" in str(e.value), (
        shown,
        str(e.value),
    )


def test_rejects_unknown_placement():
    with pytest.raises(ValueError, match="placement"):
        ej.EngramTable.allocate(4, 64, placement="floppy")


def test_cpu_table_is_refused_by_other_device_kinds():
    # Handlers check where a table lives; a device ordinal with no entry is an error.
    from engram_jax import _native

    rng = np.random.default_rng(9)
    table, _, _ = make_table(rng, 4, 64)
    with table:
        _native.native.unregister_table(table.key)
        with pytest.raises(Exception, match="closed or was never placed"):
            ej.lookup(table, np.zeros((1, 1), np.int32)).block_until_ready()


# -- GPU ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("heads", [1, 24, 48])
def test_matches_reference_gpu(placement, dim, heads, gpu_device):
    rng = np.random.default_rng(dim + heads)
    rows, row_start = 1000, 77
    table, weight, scale = make_table(rng, rows, dim, placement, row_start, device=gpu_device)
    with table:
        ids = jax.device_put(edge_ids(rows, row_start, (300, heads), rng), gpu_device)
        out = jax.jit(lambda i: ej.lookup(table, i))(ids)
        assert out.devices() == {gpu_device}
        assert_bf16_equal(out, testing.lookup_reference(weight, scale, np.asarray(ids), row_start))


@pytest.mark.gpu
@pytest.mark.parametrize("max_ctas", [1, 3, 8, None])
def test_gpu_grid_sizes(max_ctas, gpu_device):
    rng = np.random.default_rng(11)
    table, weight, scale = make_table(rng, 5000, 256, "pinned")
    with table:
        ids = jax.device_put(rng.integers(-1, 5000, (4099, 24)).astype(np.int32), gpu_device)
        out = ej.lookup(table, ids, max_ctas=max_ctas)
        assert_bf16_equal(out, testing.lookup_reference(weight, scale, np.asarray(ids)))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
def test_every_fp8_and_scale_pair_gpu(placement, gpu_device):
    weight, scale = every_pair_table_arrays()
    with ej.EngramTable.from_arrays(weight, scale, placement=placement, device=gpu_device) as table:
        ids = jax.device_put(np.arange(256, dtype=np.int32)[:, None], gpu_device)
        assert_bf16_equal(
            ej.lookup(table, ids), testing.lookup_reference(weight, scale, np.asarray(ids))
        )


@pytest.mark.gpu
def test_gpu_vmap_scan_and_empty(gpu_device):
    rng = np.random.default_rng(12)
    table, weight, scale = make_table(rng, 300, 128, "device", device=gpu_device)
    with table:
        ids = jax.device_put(rng.integers(-1, 300, (5, 7, 24)).astype(np.int32), gpu_device)
        expected = testing.lookup_reference(weight, scale, np.asarray(ids))
        assert_bf16_equal(jax.jit(jax.vmap(lambda i: ej.lookup(table, i)))(ids), expected)
        _, stacked = jax.lax.scan(lambda c, i: (c, ej.lookup(table, i)), 0, ids)
        assert_bf16_equal(stacked, expected)
        empty = ej.lookup(table, jax.device_put(np.zeros((0, 24), np.int32), gpu_device))
        assert empty.shape == (0, 24, 128)


@pytest.mark.gpu
def test_gpu_refuses_cpu_table_and_cpu_refuses_device_table(gpu_device, cpu_device):
    rng = np.random.default_rng(13)
    cpu_table, _, _ = make_table(rng, 4, 64, "cpu")
    dev_table, _, _ = make_table(rng, 4, 64, "device", device=gpu_device)
    with cpu_table, dev_table:
        with pytest.raises(Exception, match="cannot read"):
            ej.lookup(
                cpu_table, jax.device_put(np.zeros((1, 1), np.int32), gpu_device)
            ).block_until_ready()
        with pytest.raises(Exception, match="cannot read|never placed"):
            ej.lookup(
                dev_table, jax.device_put(np.zeros((1, 1), np.int32), cpu_device)
            ).block_until_ready()


@pytest.mark.gpu
def test_pinned_table_serves_cpu_and_gpu_backends(gpu_device, cpu_device):
    rng = np.random.default_rng(14)
    table, weight, scale = make_table(rng, 64, 256, "pinned")
    with table:
        ids = rng.integers(-1, 64, (9, 24)).astype(np.int32)
        expected = testing.lookup_reference(weight, scale, ids)
        for device in (gpu_device, cpu_device):
            assert_bf16_equal(ej.lookup(table, jax.device_put(ids, device)), expected)


# -- host ids wider than int32 -------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_wide_host_ids_past_int32_read_zero_rows_not_wrapped(dtype):
    """jax canonicalises int64 to int32: 2**32 + 1 must not wrap onto row 1."""
    rng = np.random.default_rng(31)
    table, weight, scale = make_table(rng, 10, 64)
    ids = np.array([[1, 2**32 + 1, 2**63 - 1 if dtype == np.int64 else 2**64 - 1, 9]], dtype)
    expected = testing.lookup_reference(weight, scale, np.array([[1, -1, -1, 9]]))
    with table, pytest.warns(UserWarning, match="past the int32 range"):
        assert_bf16_equal(ej.lookup(table, ids), expected)
        assert_bf16_equal(ej.lookup(table, ids, order="dedup"), expected)
        if dtype == np.int64:
            assert_bf16_equal(ej.lookup(table, np.array([[1, -(2**32) + 3, -1, 9]])), expected)


def test_wide_ids_passed_into_jit_wrap_unless_narrowed_first():
    """What the README warns of: a jitted function's int64 numpy argument is
    canonicalised to int32 by jax before the lookup sees it, so 2**32 + 1 reads row 1;
    narrow_ids on the host first turns it into DEAD_ID (a zero row)."""
    rng = np.random.default_rng(34)
    table, weight, scale = make_table(rng, 10, 64)
    ids = np.array([[1, 2**32 + 1, 9]], np.int64)
    with table:
        jitted = jax.jit(lambda i: ej.lookup(table, i))
        wrapped = testing.lookup_reference(weight, scale, np.array([[1, 1, 9]]))
        assert_bf16_equal(jitted(ids), wrapped)
        narrowed = ej.narrow_ids(ids)
        assert narrowed.dtype == np.int32 and narrowed.tolist() == [[1, ej.DEAD_ID, 9]]
        assert_bf16_equal(
            jitted(narrowed), testing.lookup_reference(weight, scale, np.array([[1, -1, 9]]))
        )


def test_python_lists_of_ids_are_ids():
    rng = np.random.default_rng(32)
    table, weight, scale = make_table(rng, 10, 64)
    with table:
        with pytest.warns(UserWarning, match="1 of 4 int64 ids lie past the int32 range"):
            rows = ej.lookup(table, [[3, -1], [9, 2**40]])
        assert_bf16_equal(
            rows, testing.lookup_reference(weight, scale, np.array([[3, -1], [9, -1]]))
        )
        assert ej.lookup(table, []).shape == (0, 64)
        with pytest.raises(TypeError, match="max_ctas"):
            ej.lookup(table, [[1]], max_ctas=True)


def test_table_writes_and_reads_refuse_values_a_cast_would_change():
    rng = np.random.default_rng(33)
    table, weight, scale = make_table(rng, 4, 64)
    with table:
        stride = table.row_stride
        with pytest.raises(TypeError, match="uint8"):
            table.write_records(0, np.full((1, stride), 1.7))
        with pytest.raises(TypeError, match="uint8"):
            table.write_records(0, np.full((1, stride), 300))
        with pytest.raises(TypeError, match="integer"):
            table.read_rows([1.9])
        got_w, got_s = table.read_rows(np.array([3, 0], np.uint8))
        np.testing.assert_array_equal(got_w.view(np.uint8), weight[[3, 0]])
        np.testing.assert_array_equal(got_s.view(np.uint8), scale[[3, 0]])
    with pytest.raises(TypeError, match="num_rows"):
        ej.EngramTable.allocate(2.5, 64)
    with pytest.raises(TypeError, match="row_start"):
        ej.EngramTable.allocate(2, 64, row_start=1.0)


# -- read_rows: few copies, the same rows ------------------------------------------------


class _CopyCounting(ej.storage.Allocation):
    """Memory the CPU cannot address directly (like HBM): every read is a counted copy."""

    def __init__(self, nbytes):
        self.backing = np.zeros(nbytes, np.uint8)
        self.copies = []
        super().__init__(
            placement="counted",
            address=self.backing.ctypes.data,
            nbytes=nbytes,
            kind=ej.storage.MemoryKind.HOST,
            release=lambda: None,
        )

    def _copy_in(self, offset, data):
        self.backing[offset : offset + data.nbytes] = data

    def _copy_out(self, offset, nbytes):
        self.copies.append(nbytes)
        return self.backing[offset : offset + nbytes].copy()


def _counted_table(rng, rows, dim, row_start):
    weight, scale = random_table_arrays(rng, rows, dim)
    allocation = _CopyCounting(rows * ej.row_stride(dim))
    table = ej.EngramTable(allocation, num_rows=rows, dim=dim, row_start=row_start)
    table.write_rows(0, weight, scale)
    return table, allocation, weight, scale


def test_read_rows_copies_the_covering_range_once():
    rng = np.random.default_rng(34)
    table, allocation, weight, scale = _counted_table(rng, 300, 96, row_start=1000)
    with table:
        ids = rng.integers(1010, 1290, 200)  # unsorted, with repeats
        got_w, got_s = table.read_rows(ids.reshape(20, 10))
        np.testing.assert_array_equal(got_w.view(np.uint8), weight[ids - 1000])
        np.testing.assert_array_equal(got_s.view(np.uint8), scale[ids - 1000])
        lo, hi = ids.min(), ids.max()
        assert allocation.copies == [(hi - lo + 1) * table.row_stride]
        assert [a.shape for a in table.read_rows([])] == [(0, 96), (0, 3)]


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 63), max_size=40),
    span_rows=st.integers(1, 70),
    gap_rows=st.integers(0, 10),
)
def test_read_rows_in_runs_equals_row_by_row(ids, span_rows, gap_rows):
    rng = np.random.default_rng(35)
    table, allocation, weight, scale = _counted_table(rng, 64, 32, row_start=5)
    stride = table.row_stride
    with table, pytest.MonkeyPatch.context() as mp:
        mp.setattr(ej.table, "_READ_SPAN_BYTES", span_rows * stride)
        mp.setattr(ej.table, "_READ_GAP_BYTES", gap_rows * stride)
        got_w, got_s = table.read_rows(np.array(ids, np.int64) + 5)
        np.testing.assert_array_equal(got_w.view(np.uint8), weight[ids].reshape(-1, 32))
        np.testing.assert_array_equal(got_s.view(np.uint8), scale[ids].reshape(-1, 1))
    # Never wider than the span, never more copies than distinct rows, and never
    # more bytes than the wanted rows plus the allowed gaps between them.
    wanted = sorted(set(ids))
    assert all(0 < n <= span_rows * stride for n in allocation.copies)
    assert len(allocation.copies) <= len(wanted)
    assert sum(allocation.copies) <= len(wanted) * (gap_rows + 1) * stride
    gaps = np.diff(wanted) - 1
    if wanted and wanted[-1] - wanted[0] < span_rows and np.all(gaps <= gap_rows):
        assert len(allocation.copies) == 1
    if np.any(gaps > gap_rows):
        assert len(allocation.copies) > 1


@pytest.mark.gpu
def test_read_rows_of_a_device_table_copies_once(gpu_device, monkeypatch):
    from engram_jax.storage import placements

    copies = []
    real = placements.DeviceAllocation._copy_out

    def counting(self, offset, nbytes):
        copies.append(nbytes)
        return real(self, offset, nbytes)

    monkeypatch.setattr(placements.DeviceAllocation, "_copy_out", counting)
    rng = np.random.default_rng(36)
    table, weight, scale = make_table(rng, 5000, 256, placement="device", device=gpu_device)
    with table:
        ids = rng.integers(0, 5000, 1000)
        got_w, got_s = table.read_rows(ids)
        np.testing.assert_array_equal(got_w.view(np.uint8), weight[ids])
        np.testing.assert_array_equal(got_s.view(np.uint8), scale[ids])
    assert len(copies) == 1
