"""The two native ends of a packed exchange, against the numpy references: the
gather of packed records (every order, the hot-row cache, start/done with
records) and their decode, bit for bit the lookup's rows; bad input refused in
Python and by the handlers. The exchange itself: tests/test_sharding.py.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engram_jax as ej
from engram_jax import _native, testing

from ._helpers import assert_bf16_equal, make_table, random_table_arrays

ORDER_CODES = dict(_native.native.visit_orders)
# Packed records of 33, 66, 99, 132, 264 and 528 bytes: every alignment (1, 2, 1,
# 4, 8, 16 bytes) the CUDA kernels read and write them with.
DIMS = (32, 64, 96, 128, 256, 512)
SHAPES = [(1,), (7,), (3, 5), (2, 3, 4)]
ROWS, ROW_START = 37, 5
SLOT = 9001  # the completion event of the start/done calls made here


def random_ids(rng, shape):
    """Held ids, DEAD, negatives and ids past either end of the table."""
    ids = rng.integers(ROW_START - 3, ROW_START + ROWS + 3, shape)
    ids[rng.random(shape) < 0.1] = ej.DEAD_ID
    ids[rng.random(shape) < 0.05] = 2**31 - 1
    return ids.astype(np.int32)


def assert_bits_equal(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


def hot_cache(table, device, rows=ROWS):
    """A cache of every other row of `table` on `device`."""
    hot = np.arange(ROW_START, ROW_START + rows, 2, dtype=np.int32)
    profile = ej.HotRowProfile(hot, np.ones(hot.size, np.int64))
    return ej.HotRowCache(table, 1.0, profile, devices=[device])


@pytest.fixture(autouse=True)
def on_the_cpu_unless_gpu(request, cpu_device):
    """CPU tests run on a CPU device also where a GPU is the default backend."""
    if "gpu" in request.keywords:
        yield
        return
    with jax.default_device(cpu_device):
        yield


# -- the gather of packed records ------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("order", ["plain", "sorted", "dedup"])
@pytest.mark.parametrize("dim", DIMS)
def test_lookup_records_match_the_reference(dim, order, shape):
    rng = np.random.default_rng(dim + len(shape))
    table, weight, scale = make_table(rng, ROWS, dim, row_start=ROW_START)
    ids = random_ids(rng, shape)
    with table:
        out = jax.jit(lambda i: ej.lookup_records(table, i, order=order))(ids)
        want = testing.lookup_records_reference(weight, scale, ids, ROW_START)
        assert want.shape == shape + (ej.packed_record_bytes(dim),)
        assert_bits_equal(out, want)


@pytest.mark.parametrize("order", ["plain", "sorted", "dedup"])
def test_lookup_records_read_the_cache(order, cpu_device):
    """With a cache the records are the same bytes, read from the cache's copy: the
    program says so, and a cache whose copy differs from the table shows it."""
    rng = np.random.default_rng(3)
    table, weight, scale = make_table(rng, ROWS, 64, row_start=ROW_START)
    ids = random_ids(rng, (6, 7))
    want = testing.lookup_records_reference(weight, scale, ids, ROW_START)
    with table, hot_cache(table, cpu_device) as hot:
        fn = jax.jit(lambda i: ej.lookup_records(table, i, order=order, cache=hot))
        calls = [ln for ln in fn.lower(ids).as_text().splitlines() if "engram_lookup_records" in ln]
        assert len(calls) == 1 and f"cache_key = {hot.key} " in calls[0]
        assert_bits_equal(fn(ids), want)
        # The cache holds its own copy: rewrite the table's rows, the hits keep the old bytes.
        table.write_records(0, np.zeros((ROWS, table.row_stride), np.uint8))
        out = np.asarray(fn(ids))
        held = (ids >= ROW_START) & (ids < ROW_START + ROWS)
        hits = held & ((ids - ROW_START) % 2 == 0)
        assert hits.any() and (held & ~hits).any()
        assert_bits_equal(out[hits], want[hits])
        assert not out[held & ~hits].any()


def test_lookup_records_of_no_ids_and_under_vmap():
    rng = np.random.default_rng(4)
    table, weight, scale = make_table(rng, ROWS, 32, row_start=ROW_START)
    with table:
        empty = ej.lookup_records(table, np.zeros((0, 3), np.int32))
        assert empty.shape == (0, 3, 33) and empty.dtype == jnp.uint8
        ids = random_ids(rng, (4, 5))
        out = jax.jit(jax.vmap(lambda i: ej.lookup_records(table, i)))(ids)
        assert_bits_equal(out, testing.lookup_records_reference(weight, scale, ids, ROW_START))


# -- the decode -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dim", DIMS)
def test_decode_records_matches_the_reference(dim, shape):
    """Any bytes (every fp8 pattern, NaNs, every scale, the subnormal products of
    small scales) decode as numpy's one rounding of fp8 x 2**(scale - 127)."""
    rng = np.random.default_rng(dim * 7 + len(shape))
    weight, scale = random_table_arrays(rng, int(np.prod(shape)), dim)
    records = np.concatenate([weight, scale], axis=1).reshape(shape + (-1,))
    rows = jax.jit(ej.decode_records)(records)
    assert rows.shape == shape + (dim,) and rows.dtype == jnp.bfloat16
    assert_bf16_equal(rows, testing.decode_records_reference(records))


@pytest.mark.parametrize("order", ["plain", "dedup"])
@pytest.mark.parametrize("dim", [32, 96, 256])
def test_decoded_records_are_the_lookups_rows(dim, order):
    """decode_records(lookup_records(...)) is lookup(...) bit for bit, NaN bits too."""
    rng = np.random.default_rng(dim + 1)
    table, _, _ = make_table(rng, ROWS, dim, row_start=ROW_START)
    ids = random_ids(rng, (5, 9))
    with table:
        rows = jax.jit(lambda i: ej.decode_records(ej.lookup_records(table, i, order=order)))(ids)
        assert_bits_equal(rows, jax.jit(lambda i: ej.lookup(table, i, order=order))(ids))
        batched = jax.jit(jax.vmap(ej.decode_records))(ej.lookup_records(table, ids))
        assert_bits_equal(batched, rows)


def test_decode_keeps_subnormals():
    """fp8 0x01 (2**-9) times 2**(5 - 127) is 2**-131, a bf16 subnormal: a float
    decode on XLA's CPU, which flushes subnormals, would return zero."""
    records = np.zeros((2, 33), np.uint8)
    records[:, :32] = 0x01
    records[1, :32] = 0x81  # negative
    records[:, 32] = 5
    rows = np.asarray(ej.decode_records(records)).view(np.uint16)
    assert np.all(rows[0] == 0x0004) and np.all(rows[1] == 0x8004)  # 4 units of 2**-133


def test_decode_of_no_rows_and_of_zero_records():
    assert ej.decode_records(np.zeros((0, 66), np.uint8)).shape == (0, 64)
    rows = ej.decode_records(np.zeros((3, 66), np.uint8))
    assert rows.shape == (3, 64) and not np.asarray(rows).view(np.uint16).any()  # +0, as DEAD ids


def test_records_start_and_done_equal_lookup_records(cpu_device):
    """The asynchronous gather with records=1 (what lookup_start does for a packed
    plan): done returns the packed records lookup_records returns."""
    rng = np.random.default_rng(6)
    table, weight, scale = make_table(rng, ROWS, 64, row_start=ROW_START)
    ids = random_ids(rng, (3, 7))  # 21 records of 66 bytes: no whole number of 16-byte words
    with table, hot_cache(table, cpu_device) as hot:
        for order, cache_key in (("plain", 0), ("dedup", hot.key)):
            out = jax.jit(lambda i, o=order, c=cache_key: records_start_done(table, i, o, c))(ids)
            assert_bits_equal(out, testing.lookup_records_reference(weight, scale, ids, ROW_START))


# -- bad input --------------------------------------------------------------------------


def test_decode_records_refuses_what_is_not_packed_records():
    with pytest.raises(TypeError, match="uint8"):
        ej.decode_records(np.zeros((2, 33), np.float32))
    with pytest.raises(TypeError, match="uint8"):
        ej.decode_records(jnp.zeros((2, 33), jnp.int8))
    for shape in [(), (2, 32), (2, 65), (2, 0), (1, 16896 + 33)]:
        with pytest.raises(ValueError, match=r"dim \+ dim / 32"):
            ej.decode_records(np.zeros(shape, np.uint8))


def test_lookup_records_refuses_what_lookup_refuses():
    table, _, _ = make_table(np.random.default_rng(7), ROWS, 32)
    with table:
        with pytest.raises(TypeError, match="int32"):
            ej.lookup_records(table, np.zeros(3, np.float32))
        with pytest.raises(ValueError, match="order must be"):
            ej.lookup_records(table, np.zeros(3, np.int32), order="fastest")
        with pytest.raises(ValueError, match="max_ctas"):
            ej.lookup_records(table, np.zeros(3, np.int32), max_ctas=0)
    with pytest.raises(ValueError, match="closed"):
        ej.lookup_records(table, np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="all_to_all_packed"):
        ej.ShardPlan((5, 7), exchange="packed")


def ffi_attrs(table, order="plain", cache_key=0) -> dict:
    return {
        "table_key": np.int64(table.key),
        "dim": np.int64(table.dim),
        "order": np.int64(ORDER_CODES[order]),
        "cache_key": np.int64(cache_key),
        "slot": np.int64(SLOT),
    }


def records_start_done(table, ids, order="plain", cache_key=0, records=1, out_type=None):
    """engram_lookup_start + engram_lookup_done with records, no Python checks in front."""
    _native.ensure_registered()
    attrs = ffi_attrs(table, order, cache_key)
    ticket_type = jax.ShapeDtypeStruct((4,), jnp.uint32)
    start = jax.ffi.ffi_call("engram_lookup_start", ticket_type, vmap_method="broadcast_all")
    ticket = start(ids, max_ctas=np.int64(4), records=np.int64(records), **attrs)
    if out_type is None:
        out_type = jax.ShapeDtypeStruct(ids.shape + (ej.packed_record_bytes(table.dim),), jnp.uint8)
    done = jax.ffi.ffi_call("engram_lookup_done", out_type, vmap_method="broadcast_all")
    return done(ticket, ids, records=np.int64(records), **attrs)


def test_handlers_refuse_calls_that_do_not_fit():
    """Below the Python checks: the handlers' own InvalidArgument errors."""
    table, _, _ = make_table(np.random.default_rng(8), ROWS, 64)
    ids = jnp.zeros((2, 3), jnp.int32)
    _native.ensure_registered()
    bf16_rows = jax.ShapeDtypeStruct((2, 3, 64), jnp.bfloat16)
    with table:
        decode = jax.ffi.ffi_call("engram_decode_records", bf16_rows, vmap_method="broadcast_all")
        with pytest.raises(Exception, match="decode_records: records must be"):
            jax.block_until_ready(decode(jnp.zeros((2, 3, 66), jnp.uint8), dim=np.int64(32)))
        with pytest.raises(Exception, match="decode_records: dim must be"):
            jax.block_until_ready(decode(jnp.zeros((2, 3, 66), jnp.uint8), dim=np.int64(48)))
        width = jax.ShapeDtypeStruct((2, 3, 72), jnp.uint8)  # padded records, not packed
        workspace = jax.ShapeDtypeStruct((0,), jnp.uint8)
        lookup = jax.ffi.ffi_call(
            "engram_lookup_records", (width, workspace), vmap_method="broadcast_all"
        )
        attrs = ffi_attrs(table)
        del attrs["slot"]
        with pytest.raises(Exception, match="packed records must be uint8"):
            jax.block_until_ready(lookup(ids, max_ctas=np.int64(0), **attrs))
        with pytest.raises(Exception, match=r"records must be 0 \(rows\) or 1"):
            # 2 and 3 are a trainable table's float32 / bfloat16 rows (test_training.py)
            jax.block_until_ready(jax.jit(lambda i: records_start_done(table, i, records=4))(ids))
        with pytest.raises(Exception, match="packed records must be uint8"):
            jax.block_until_ready(
                jax.jit(lambda i: records_start_done(table, i, out_type=bf16_rows))(ids)
            )


# -- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
@pytest.mark.parametrize("dim", DIMS)
def test_gpu_lookup_records_and_decode(dim, placement, gpu_device):
    """The CUDA gather of packed records (every order; with the HBM cache for a
    host table) and their decode (the gathers' tiles and DecodeEight): the
    references, and the lookup's rows bit for bit."""
    rng = np.random.default_rng(20 + dim)
    rows = 3000
    table, weight, scale = make_table(
        rng, rows, dim, placement=placement, row_start=ROW_START, device=gpu_device
    )
    ids = rng.integers(ROW_START - 3, ROW_START + rows + 3, (257, 5)).astype(np.int32)
    ids[rng.random(ids.shape) < 0.1] = ej.DEAD_ID
    want = testing.lookup_records_reference(weight, scale, ids, ROW_START)
    ids = jax.device_put(ids, gpu_device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(table)
        caches = [None]
        if placement == "pinned":  # an HBM table has nothing to cache
            caches.append(stack.enter_context(hot_cache(table, gpu_device, rows)))
        for order in ("plain", "sorted", "dedup"):
            for cache in caches:
                fn = jax.jit(
                    lambda i, o=order, c=cache: ej.lookup_records(table, i, order=o, cache=c)
                )
                assert_bits_equal(fn(ids), want)
        records = jax.jit(lambda i: ej.lookup_records(table, i))(ids)
        rows_out = jax.jit(ej.decode_records)(records)
        assert_bf16_equal(
            rows_out, testing.lookup_reference(weight, scale, np.asarray(ids), ROW_START)
        )
        assert_bits_equal(rows_out, jax.jit(lambda i: ej.lookup(table, i))(ids))
    # Records the gather did not make: every byte pattern, decoded on the GPU.
    w, s = random_table_arrays(rng, 999, dim)
    packed = np.concatenate([w, s], axis=1).reshape(27, 37, -1)
    decoded = jax.jit(ej.decode_records)(jax.device_put(packed, gpu_device))
    assert_bf16_equal(decoded, testing.decode_records_reference(packed))


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [32, 64, 256])
def test_gpu_records_start_and_done(dim, gpu_device):
    """The staged result of a start with records=1 is bytes: done copies all of them
    out, a tail of less than 16 bytes too (odd id counts), and a handle kept past its
    site's next start gets records that decode to NaN, never the newer start's."""
    rng = np.random.default_rng(30 + dim)
    rows = 4096
    table, weight, scale = make_table(
        rng, rows, dim, placement="pinned", row_start=ROW_START, device=gpu_device
    )

    def reference(ids):
        return testing.lookup_records_reference(weight, scale, np.asarray(ids), ROW_START)

    with table, hot_cache(table, gpu_device, rows) as hot:
        for shape in [(1,), (7,), (3, 5), (129, 3)]:
            ids = rng.integers(ROW_START - 2, ROW_START + rows + 2, shape).astype(np.int32)
            ids = jax.device_put(ids, gpu_device)
            for order, cache_key in (("plain", 0), ("dedup", hot.key)):
                fn = jax.jit(lambda i, o=order, c=cache_key: records_start_done(table, i, o, c))
                assert_bits_equal(fn(ids), reference(ids))

        attrs = ffi_attrs(table)
        _native.ensure_registered()
        ticket_type = jax.ShapeDtypeStruct((4,), jnp.uint32)
        start = jax.ffi.ffi_call("engram_lookup_start", ticket_type, vmap_method="broadcast_all")
        out_type = jax.ShapeDtypeStruct((33, ej.packed_record_bytes(dim)), jnp.uint8)
        done = jax.ffi.ffi_call("engram_lookup_done", out_type, vmap_method="broadcast_all")
        started = jax.jit(
            lambda i: (start(i, max_ctas=np.int64(4), records=np.int64(1), **attrs), i)
        )
        finish = jax.jit(lambda t, i: done(t, i, records=np.int64(1), **attrs))
        ids_a, ids_b = (
            jax.device_put(
                rng.integers(ROW_START, ROW_START + rows, 33).astype(np.int32), gpu_device
            )
            for _ in range(2)
        )
        handle_a = started(ids_a)
        handle_b = started(ids_b)  # the same call site: restaged, a new generation
        assert_bits_equal(finish(*handle_b), reference(ids_b))
        stale = np.asarray(finish(*handle_a))
        assert np.all(stale == 0xFF)
        assert np.all(np.isnan(np.asarray(ej.decode_records(stale)).astype(np.float32)))
