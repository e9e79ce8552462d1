"""Visiting order, deduplication and the hot-row cache: every order, with and
without a cache, equals the plain lookup bit for bit for every id pattern
(all hits, all misses, duplicates, DEAD, out-of-range, empty), on the CPU
backend and, marked gpu, on CUDA; profiles; refresh while lookups run.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engram_jax as ej
from engram_jax import _args, _native, hot_rows, testing

from ._helpers import assert_bf16_equal, make_table, random_table_arrays, scaled

# The visiting orders, as the package lists them for order=; "auto" picks one of them.
ORDERS = [o for o in ej.ORDERS if o != "auto"]
PATTERNS = ["all_hits", "all_misses", "duplicates", "dead", "out_of_range", "mixed", "empty"]


def hot_profile(rows, row_start, hot_count, rng):
    """A profile whose first hot_count rows are a random subset of the table's rows."""
    picked = rng.permutation(rows)[:hot_count] + row_start
    counts = np.arange(len(picked), 0, -1, dtype=np.int64) + 10
    return ej.HotRowProfile(picked.astype(np.int32), counts)


def id_pattern(name, rng, rows, row_start, cached, shape):
    """Ids of one pattern; `cached` are the global rows the cache holds."""
    held = np.arange(row_start, row_start + rows)
    uncached = np.setdiff1d(held, cached)
    if name == "empty":
        return np.zeros((0,) + shape[1:], np.int32)
    if name == "all_hits":
        ids = rng.choice(cached, shape)
    elif name == "all_misses":
        ids = rng.choice(uncached, shape)
    elif name == "duplicates":
        ids = rng.choice(rng.choice(held, 3), shape)
    elif name == "dead":
        ids = np.full(shape, -1, np.int64)
        ids.reshape(-1)[::7] = rng.choice(held, ids.reshape(-1)[::7].size)
    elif name == "out_of_range":
        outside = np.array([-2, -(2**31), 2**31 - 1, row_start - 1, row_start + rows, 2**30])
        ids = rng.choice(outside, shape)
    else:  # mixed: every kind at once, in random order
        specials = np.array([-1, -2, -(2**31), 2**31 - 1, row_start - 1, row_start + rows])
        ids = rng.choice(np.concatenate([cached, uncached, specials, cached[:2].repeat(20)]), shape)
    return np.clip(ids, -(2**31), 2**31 - 1).astype(np.int32)


def plain_bits(table, ids, device):
    return np.asarray(jax.jit(lambda i: ej.lookup(table, i))(jax.device_put(ids, device))).view(
        np.uint16
    )


def test_orders_lists_auto_and_each_native_order():
    assert ej.ORDERS[0] == "auto" and sorted(ORDERS) == ["dedup", "plain", "sorted"]
    assert set(ORDERS) == set(_args.ORDER_CODES)  # read from the extension, not copied


def check_all_orders(table, weight, scale, ids, device, hot_cache=None):
    expected = testing.lookup_reference(weight, scale, ids, table.row_start)
    plain = plain_bits(table, ids, device) if ids.size else None
    on_device = jax.device_put(ids, device)
    for order in ORDERS + ["auto"]:
        out = jax.jit(lambda i, o=order: ej.lookup(table, i, cache=hot_cache, order=o))(on_device)
        assert out.shape == ids.shape + (table.dim,) and out.dtype == jnp.bfloat16
        assert_bf16_equal(out, expected)
        if plain is not None:  # same backend: NaN bits included
            np.testing.assert_array_equal(np.asarray(out).view(np.uint16), plain)


# -- CPU backend --------------------------------------------------------------


@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("with_cache", [False, True])
def test_orders_and_cache_match_plain_cpu(dim, pattern, with_cache, cpu_device):
    rng = np.random.default_rng(dim + len(pattern) * 7 + with_cache)
    rows, row_start = 203, 1000
    table, weight, scale = make_table(rng, rows, dim, row_start=row_start)
    profile = hot_profile(rows, row_start, 60, rng)
    with table, ej.HotRowCache(table, 1.0, profile, devices=[cpu_device]) as hot:
        cached = hot.cached_rows()
        assert sorted(cached) == sorted(profile.rows)
        ids = id_pattern(pattern, rng, rows, row_start, cached, (37, 24))
        check_all_orders(table, weight, scale, ids, cpu_device, hot if with_cache else None)


def test_hits_are_read_from_the_cache_copy(cpu_device):
    """Rewrite the table under a live cache: hits keep the cached rows, misses
    read the new ones; reload() copies the new rows in."""
    rng = np.random.default_rng(3)
    table, weight, scale = make_table(rng, 100, 64)
    profile = hot_profile(100, 0, 30, rng)
    with table, ej.HotRowCache(table, 1.0, profile, devices=[cpu_device]) as hot:
        new_weight, new_scale = random_table_arrays(rng, 100, 64)
        table.write_rows(0, new_weight, new_scale)
        ids = np.arange(100, dtype=np.int32)[:, None]
        hit = np.isin(ids[:, 0], hot.cached_rows())
        for order in ORDERS:
            out = np.asarray(
                ej.lookup(table, jax.device_put(ids, cpu_device), cache=hot, order=order)
            )
            assert_bf16_equal(out[hit], testing.lookup_reference(weight, scale, ids[hit]))
            assert_bf16_equal(out[~hit], testing.lookup_reference(new_weight, new_scale, ids[~hit]))
        hot.reload()
        out = ej.lookup(table, jax.device_put(ids, cpu_device), cache=hot, order="dedup")
        assert_bf16_equal(out, testing.lookup_reference(new_weight, new_scale, ids))


def test_large_batch_with_long_runs_cpu(cpu_device):
    """Runs of one row far longer than a thread's chunk, plus every other kind of id."""
    rng = np.random.default_rng(4)
    table, weight, scale = make_table(rng, 500, 128, row_start=7)
    with (
        table,
        ej.HotRowCache(table, 1.0, hot_profile(500, 7, 100, rng), devices=[cpu_device]) as hot,
    ):
        ids = np.concatenate(
            [np.full(40000, 99, np.int32), rng.integers(-3, 520, 30001).astype(np.int32)]
        )
        ids = rng.permutation(ids).reshape(-1, 1)
        check_all_orders(table, weight, scale, ids, cpu_device, hot)


@settings(max_examples=25, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**31), 2**31 - 1) | st.integers(-2, 70), min_size=0, max_size=300),
    hot_count=st.integers(0, 64),
    order=st.sampled_from(ORDERS),
)
def test_fuzz(ids, hot_count, order):
    cpu_device = jax.devices("cpu")[0]
    rng = np.random.default_rng(hot_count)
    rows, row_start = 64, 5
    table, weight, scale = make_table(rng, rows, 64, row_start=row_start)
    with (
        table,
        ej.HotRowCache(
            table, 1.0, hot_profile(rows, row_start, hot_count, rng), devices=[cpu_device]
        ) as hot,
    ):
        ids = np.asarray(ids, dtype=np.int32).reshape(-1, 1)
        out = ej.lookup(table, jax.device_put(ids, cpu_device), cache=hot, order=order)
        assert_bf16_equal(out, testing.lookup_reference(weight, scale, ids, row_start))


def test_vmap_scan_and_leading_dims(cpu_device):
    rng = np.random.default_rng(5)
    table, weight, scale = make_table(rng, 80, 64)
    with (
        table,
        ej.HotRowCache(table, 1.0, hot_profile(80, 0, 20, rng), devices=[cpu_device]) as hot,
    ):
        ids = jax.device_put(rng.integers(-1, 85, (3, 4, 5, 6)).astype(np.int32), cpu_device)
        expected = testing.lookup_reference(weight, scale, np.asarray(ids))

        def one(i):
            return ej.lookup(table, i, cache=hot, order="dedup")

        assert_bf16_equal(jax.jit(one)(ids), expected)
        assert_bf16_equal(jax.jit(jax.vmap(one))(ids), expected)

        def body(carry, i):
            return carry, one(i)

        _, scanned = jax.jit(lambda x: jax.lax.scan(body, 0, x))(ids)
        assert_bf16_equal(scanned, expected)


def test_prefetch_start_done_cpu(cpu_device):
    rng = np.random.default_rng(6)
    table, weight, scale = make_table(rng, 90, 128)
    with (
        table,
        ej.HotRowCache(table, 1.0, hot_profile(90, 0, 30, rng), devices=[cpu_device]) as hot,
    ):
        ids = jax.device_put(rng.integers(-1, 95, (33, 24)).astype(np.int32), cpu_device)

        @jax.jit
        def step(i):
            handle = ej.lookup_start(table, i, cache=hot, order="dedup")
            return ej.lookup_done(handle)

        assert_bf16_equal(step(ids), testing.lookup_reference(weight, scale, np.asarray(ids)))
        eager = ej.lookup_done(ej.lookup_start(table, ids, cache=hot))
        assert_bf16_equal(eager, testing.lookup_reference(weight, scale, np.asarray(ids)))


def test_sharded_table_each_device_caches_its_own_rows():
    """A ShardedTable over 4 CPU devices, each holding a quarter of the rows,
    with a cache per device holding hot rows of its own quarter only."""
    devices = jax.devices("cpu")[:4]
    rng = np.random.default_rng(7)
    rows, dim = 4 * 50, 64
    weight, scale = random_table_arrays(rng, rows, dim)
    shards = {
        d: ej.EngramTable.from_arrays(
            weight[50 * k : 50 * (k + 1)], scale[50 * k : 50 * (k + 1)], row_start=50 * k
        )
        for k, d in enumerate(devices)
    }
    profile = hot_profile(rows, 0, 120, rng)
    with ej.ShardedTable(shards) as sharded, ej.HotRowCache(sharded, 1.0, profile) as hot:
        for k, d in enumerate(devices):
            mine = hot.cached_rows(d)
            assert mine.size and np.all((mine >= 50 * k) & (mine < 50 * (k + 1)))
            assert set(mine) == {r for r in profile.rows if 50 * k <= r < 50 * (k + 1)}
        mesh = jax.sharding.Mesh(np.array(devices), ("x",))
        spec = jax.sharding.PartitionSpec("x")
        ids = rng.integers(-1, rows + 3, (4 * 16, 24)).astype(np.int32)

        def body(i):
            return ej.lookup(sharded, i, cache=hot, order="dedup")

        run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        out = np.asarray(run(jax.device_put(ids, jax.sharding.NamedSharding(mesh, spec))))
        for k in range(4):  # device k returns its own rows only; the rest are zeros
            block = ids[16 * k : 16 * (k + 1)]
            own = np.where((block >= 50 * k) & (block < 50 * (k + 1)), block, -1)
            assert_bf16_equal(
                out[16 * k : 16 * (k + 1)], testing.lookup_reference(weight, scale, own)
            )


# -- profiles, budget, auto order ----------------------------------------------


def test_profile_counts_save_load_merge(tmp_path):
    ids = np.array([[5, 5, 7], [-1, 5, 9], [7, -3, 2**31 - 1]], np.int32)
    profile = ej.HotRowProfile.from_ids(ids)
    np.testing.assert_array_equal(profile.rows, [5, 7, 9, 2**31 - 1])
    np.testing.assert_array_equal(profile.counts, [3, 2, 1, 1])
    batched = ej.HotRowProfile.from_ids([ids[:1], ids[1:]])
    np.testing.assert_array_equal(batched.rows, profile.rows)
    path = hot_rows.profile_path(tmp_path, 14)
    assert path.name == "engram_profile.layer14.npy"
    profile.save(path)
    loaded = ej.HotRowProfile.load(path)
    np.testing.assert_array_equal(loaded.rows, profile.rows)
    np.testing.assert_array_equal(loaded.counts, profile.counts)
    merged = profile.merged(ej.HotRowProfile.from_ids(np.array([9, 9, 9, 9, 1])), weight=1.0)
    np.testing.assert_array_equal(merged.rows[:3], [9, 5, 7])
    np.testing.assert_array_equal(profile.top(2, (6, 100)), [7, 9])
    with pytest.raises(ValueError, match="non-increasing"):
        ej.HotRowProfile(np.array([1, 2]), np.array([1, 5]))
    np.save(tmp_path / "bad.npy", np.zeros((3, 2), np.int64))
    with pytest.raises(ValueError, match="not a row profile"):
        ej.HotRowProfile.load(tmp_path / "bad.npy")


def test_budget_and_index_bytes(cpu_device):
    rng = np.random.default_rng(8)
    table, _, _ = make_table(rng, 5000, 256)  # 272-byte records
    budget_gib = 100_000 / 2**30
    with (
        table,
        ej.HotRowCache(
            table, budget_gib, hot_profile(5000, 0, 5000, rng), devices=[cpu_device]
        ) as hot,
    ):
        assert hot.nbytes <= 100_000
        # Records plus about 4.5 bytes of index per cached row.
        assert hot.capacity == len(hot.cached_rows()) and hot.capacity >= 100_000 // (272 + 5)
        assert hot.hit_rate(hot.cached_rows()) == 1.0
    with (
        make_table(rng, 10, 64)[0] as small,
        ej.HotRowCache(small, 0, None, devices=[cpu_device]) as empty,
    ):
        assert empty.capacity == 0 and empty.hit_rate(np.arange(10)) == 0.0
        ids = jax.device_put(np.arange(10, dtype=np.int32)[:, None], cpu_device)
        assert_bf16_equal(ej.lookup(small, ids, cache=empty), ej.lookup(small, ids))


def test_auto_order_and_workspace():
    assert _args.choose_order(_args.AUTO_DEDUP_MIN_IDS - 1) == "plain"
    assert _args.choose_order(_args.AUTO_DEDUP_MIN_IDS) == "dedup"
    assert _args.workspace_bytes(1000, "plain") == 0
    # Sort double buffers (16 bytes per id) plus CUB's storage.
    assert _args.workspace_bytes(1000, "dedup") >= 16 * 1000


def test_bad_input(cpu_device):
    rng = np.random.default_rng(9)
    table, _, _ = make_table(rng, 20, 64)
    other, _, _ = make_table(rng, 20, 64)
    ids = jax.device_put(np.zeros((2, 3), np.int32), cpu_device)
    with table, other:
        hot = ej.HotRowCache(table, 1.0, hot_profile(20, 0, 5, rng), devices=[cpu_device])
        with pytest.raises(ValueError, match="order"):
            ej.lookup(table, ids, order="random")
        with pytest.raises(ValueError, match="another table"):
            ej.lookup(other, ids, cache=hot)
        with pytest.raises(TypeError, match="HotRowCache"):
            ej.lookup(table, ids, cache="hot")
        with pytest.raises(ValueError, match="budget_gib"):
            ej.HotRowCache(table, -1)
        compiled = jax.jit(lambda i: ej.lookup(table, i, cache=hot, order="dedup"))
        compiled(ids).block_until_ready()
        hot.close()
        with pytest.raises(ValueError, match="closed"):
            ej.lookup(table, ids, cache=hot)
        with pytest.raises(Exception, match="was it closed"):  # compiled before the close
            compiled(ids).block_until_ready()


def test_native_checks_workspace_and_order(cpu_device):
    rng = np.random.default_rng(10)
    table, _, _ = make_table(rng, 20, 64)
    _native.ensure_registered()
    ids = jax.device_put(np.zeros((100,), np.int32), cpu_device)
    with table:
        for order, ws, match in [(2, 16, "workspace"), (7, 10**6, "order")]:
            call = jax.ffi.ffi_call(
                "engram_cached_lookup",
                (
                    jax.ShapeDtypeStruct((100, 64), jnp.bfloat16),
                    jax.ShapeDtypeStruct((ws,), jnp.uint8),
                ),
            )
            with pytest.raises(Exception, match=match):
                jax.block_until_ready(
                    call(
                        ids,
                        table_key=np.int64(table.key),
                        dim=np.int64(64),
                        max_ctas=np.int64(0),
                        order=np.int64(order),
                        cache_key=np.int64(0),
                    )
                )


# -- online refresh -----------------------------------------------------------


def test_refresh_switches_contents_and_observes(cpu_device):
    rng = np.random.default_rng(11)
    table, weight, scale = make_table(rng, 300, 64)
    with (
        table,
        ej.HotRowCache(
            table, 2000 * 280 / 2**30, hot_profile(300, 0, 40, rng), devices=[cpu_device]
        ) as hot,
    ):
        before = set(hot.cached_rows())
        hot.refresh(hot_profile(300, 0, 40, np.random.default_rng(99)))
        assert set(hot.cached_rows()) != before
        observed = np.array([[250, 251, 252]] * 1000, np.int32)
        hot.observe(observed)
        hot.observe(jax.device_put(observed, cpu_device))
        hot.refresh(background=True).result(timeout=30)
        assert {250, 251, 252} <= set(hot.cached_rows())
        ids = jax.device_put(rng.integers(-1, 300, (64, 24)).astype(np.int32), cpu_device)
        assert_bf16_equal(
            ej.lookup(table, ids, cache=hot),
            testing.lookup_reference(weight, scale, np.asarray(ids)),
        )


def test_refresh_waits_for_a_lookup_in_flight(cpu_device):
    """A buffer set a lookup still reads is rewritten only after it is released."""
    rng = np.random.default_rng(12)
    table, _, _ = make_table(rng, 100, 64)
    native = _native.native
    profiles = [hot_profile(100, 0, 20, np.random.default_rng(s)) for s in range(3)]
    with table, ej.HotRowCache(table, 1.0, profiles[0], devices=[cpu_device]) as hot:
        hot.refresh(profiles[1])  # set 1 active, set 0 idle
        token, held = native.cache_hold(hot.key, -1, table.key, table.dim)
        try:
            assert held == 1 == native.cache_active(hot.key, -1)
            hot.refresh(profiles[2], background=True).result(timeout=30)  # writes the idle set 0
            assert native.cache_active(hot.key, -1) == 0
            blocked = hot.refresh(profiles[0], background=True)  # set 1: held by the "lookup"
            time.sleep(0.3)
            assert not blocked.done() and native.cache_active(hot.key, -1) == 0
        finally:
            native.cache_unhold(token)
        blocked.result(timeout=30)
        assert native.cache_active(hot.key, -1) == 1
        assert set(hot.cached_rows()) == set(profiles[0].rows)


def test_refresh_under_load_never_returns_stale_or_torn_rows(cpu_device):
    rng = np.random.default_rng(13)
    table, weight, scale = make_table(rng, 2000, 64)
    profiles = [hot_profile(2000, 0, 700, np.random.default_rng(s)) for s in range(4)]
    batches = [rng.integers(-1, 2000, (2048, 24)).astype(np.int32) for _ in range(3)]
    expected = [testing.lookup_reference(weight, scale, b) for b in batches]
    with table, ej.HotRowCache(table, 700 * 300 / 2**30, profiles[0], devices=[cpu_device]) as hot:
        step = jax.jit(lambda i: ej.lookup(table, i, cache=hot, order="dedup"))
        on_device = [jax.device_put(b, cpu_device) for b in batches]
        stop = threading.Event()
        failures = []

        def refresher():
            k = 0
            while not stop.is_set():
                k += 1
                hot.refresh(profiles[k % len(profiles)])

        thread = threading.Thread(target=refresher)
        thread.start()
        try:
            for k in range(60):
                out = step(on_device[k % 3])
                bits = np.asarray(out).view(np.uint16)
                if not np.array_equal(
                    np.isnan(np.asarray(out, np.float32)),
                    np.isnan(expected[k % 3].astype(np.float32)),
                ):
                    failures.append(k)
                elif not np.array_equal(
                    bits[~np.isnan(np.asarray(out, np.float32))],
                    expected[k % 3].view(np.uint16)[~np.isnan(expected[k % 3].astype(np.float32))],
                ):
                    failures.append(k)
        finally:
            stop.set()
            thread.join()
        assert not failures


# -- CUDA -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dim, pattern", [(256, p) for p in PATTERNS] + [(64, "mixed"), (512, "mixed")]
)
def test_orders_and_cache_match_plain_gpu(dim, pattern, gpu_device):
    rng = np.random.default_rng(dim + len(pattern))
    rows, row_start = 3001, 123
    table, weight, scale = make_table(rng, rows, dim, "pinned", row_start)
    profile = hot_profile(rows, row_start, 700, rng)
    with table, ej.HotRowCache(table, 1.0, profile, devices=[gpu_device]) as hot:
        ids = id_pattern(pattern, rng, rows, row_start, hot.cached_rows(), (517, 24))
        check_all_orders(table, weight, scale, ids, gpu_device, None)
        check_all_orders(table, weight, scale, ids, gpu_device, hot)


@pytest.mark.gpu
@pytest.mark.parametrize("max_ctas", [None, 1, 8])
def test_gpu_long_runs_across_tiles(max_ctas, gpu_device):
    """Runs of one row spanning many tiles; tiny and big grids; not a whole number of
    tiles. A tenth of the ids under tools/sanitize.py (racecheck took the one-CTA grid
    past 370 s): the hot row's run still spans many tiles."""
    rng = np.random.default_rng(20)
    table, weight, scale = make_table(rng, 40000, 256, "pinned")
    with (
        table,
        ej.HotRowCache(table, 0.002, hot_profile(40000, 0, 5000, rng), devices=[gpu_device]) as hot,
    ):
        ids = np.concatenate(
            [
                np.full(scaled(50000), 77),
                np.full(scaled(3000), -1),
                rng.integers(-5, 40005, scaled(150001)),
            ]
        )
        ids = rng.permutation(ids).astype(np.int32).reshape(-1, 1)
        expected = testing.lookup_reference(weight, scale, ids)
        on_device = jax.device_put(ids, gpu_device)
        for order in ORDERS:
            for c in (None, hot):
                out = ej.lookup(table, on_device, cache=c, order=order, max_ctas=max_ctas)
                assert_bf16_equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2047, 2048, 2049, 4865, 2**15, 2**15 + 1])
def test_gpu_orders_at_the_sorts_edges(size, gpu_device):
    """Batches at the edges of the sort's ways (one chunk of 2048 ids sorted in shared
    memory, CUB's one tile up to 4864, up to 16 chunks merged, CUB's passes beyond),
    with a hot row across the chunks, on a table of 2^12 - 1 rows, whose dead ids' key
    is the chunk sort's padding key: every order gives the reference's rows and the
    plain lookup's bits."""
    rng = np.random.default_rng(size)
    rows, row_start = 4095, 9
    table, weight, scale = make_table(rng, rows, 64, "pinned", row_start)
    with table:
        ids = rng.integers(row_start - 5, row_start + rows + 5, size)
        ids[rng.random(size) < 0.3] = row_start + 7
        ids[::13] = -1
        check_all_orders(table, weight, scale, ids.astype(np.int32).reshape(-1, 1), gpu_device)


@pytest.mark.gpu
def test_gpu_prefetch_vmap_scan_empty(gpu_device):
    rng = np.random.default_rng(21)
    table, weight, scale = make_table(rng, 2000, 256, "pinned")
    with (
        table,
        ej.HotRowCache(table, 1.0, hot_profile(2000, 0, 500, rng), devices=[gpu_device]) as hot,
    ):
        ids = jax.device_put(rng.integers(-1, 2003, (4, 300, 24)).astype(np.int32), gpu_device)
        expected = testing.lookup_reference(weight, scale, np.asarray(ids))

        @jax.jit
        def step(i):
            handles = [ej.lookup_start(table, i[k], cache=hot, order="dedup") for k in range(4)]
            return jnp.stack([ej.lookup_done(h) for h in handles])

        assert_bf16_equal(step(ids), expected)
        one = lambda i: ej.lookup(table, i, cache=hot, order="sorted")  # noqa: E731
        assert_bf16_equal(jax.jit(jax.vmap(one))(ids), expected)
        _, scanned = jax.jit(lambda x: jax.lax.scan(lambda c, i: (c, one(i)), 0, x))(ids)
        assert_bf16_equal(scanned, expected)
        empty = ej.lookup(table, jax.device_put(np.zeros((0, 24), np.int32), gpu_device), cache=hot)
        assert empty.shape == (0, 24, 256)


@pytest.mark.gpu
def test_gpu_refresh_under_load(gpu_device):
    """Steps queued back to back (async dispatch) while a background refresh
    keeps swapping the cache: every step returns the reference rows. 200 steps, a
    refresh every 20; a tenth of the steps under tools/sanitize.py, a refresh every 2
    (initcheck took the whole test past 300 s)."""
    rng = np.random.default_rng(22)
    table, weight, scale = make_table(rng, 100_000, 256, "pinned")
    profiles = [hot_profile(100_000, 0, 30_000, np.random.default_rng(s)) for s in range(3)]
    batches = [rng.integers(-1, 100_000, (1024, 24)).astype(np.int32) for _ in range(4)]
    expected = [testing.lookup_reference(weight, scale, b).view(np.uint16) for b in batches]
    with (
        table,
        ej.HotRowCache(table, 30_000 * 280 / 2**30, profiles[0], devices=[gpu_device]) as hot,
    ):
        step = jax.jit(lambda i: ej.lookup(table, i, cache=hot, order="dedup"))
        on_device = [jax.device_put(b, gpu_device) for b in batches]
        outs = []
        futures = []
        steps = scaled(200)
        every = max(1, steps // 10)
        for k in range(steps):
            outs.append(step(on_device[k % 4]))
            if k % every == 0:
                futures.append(hot.refresh(profiles[k // every % 3], background=True))
        for f in futures:
            f.result(timeout=60)
        for k, out in enumerate(outs):
            got = np.asarray(out).view(np.uint16)
            nan = np.isnan(np.asarray(out, np.float32))
            assert np.array_equal(got[~nan], expected[k % 4][~nan]), k


@pytest.mark.gpu
def test_gpu_cache_refuses_host_only_and_device_tables(gpu_device):
    rng = np.random.default_rng(23)
    cpu_table, _, _ = make_table(rng, 10, 64, "cpu")
    dev_table, _, _ = make_table(rng, 10, 64, "device", device=gpu_device)
    with cpu_table, dev_table:
        with pytest.raises(ValueError, match="pinned"):
            ej.HotRowCache(cpu_table, 0.01, None, devices=[gpu_device])
        with pytest.raises(ValueError, match="nothing to cache"):
            ej.HotRowCache(dev_table, 0.01, None, devices=[gpu_device])


# -- the options through engram_jax.lookup / lookup_start / lookup_done ---------------


def custom_call_targets(fn, *args):
    text = jax.jit(fn).lower(*args).as_text()
    return [
        line.split("custom_call @", 1)[1].split("(", 1)[0]
        for line in text.splitlines()
        if "custom_call @" in line
    ]


def check_lookup_options(table, ids, hot, device):
    """lookup / lookup_start+done with every order and cache equal the plain lookup bitwise."""
    plain = plain_bits(table, ids, device)
    on_device = jax.device_put(ids, device)
    for order in ORDERS + ["auto"]:
        for c in (None, hot):

            def direct(i, o=order, c=c):
                return ej.lookup(table, i, order=o, cache=c)

            def prefetched(i, o=order, c=c):
                return ej.lookup_done(ej.lookup_start(table, i, order=o, cache=c))

            for fn in (direct, prefetched):
                out = np.asarray(jax.jit(fn)(on_device))
                np.testing.assert_array_equal(out.view(np.uint16), plain, err_msg=str((order, c)))
            # Eagerly, the start gathers at once.
            eager = ej.lookup_done(ej.lookup_start(table, on_device, order=order, cache=c))
            np.testing.assert_array_equal(np.asarray(eager).view(np.uint16), plain)


def test_lookup_takes_order_and_cache(cpu_device):
    rng = np.random.default_rng(30)
    table, _, _ = make_table(rng, 150, 64, row_start=40)
    with (
        table,
        ej.HotRowCache(table, 1.0, hot_profile(150, 40, 50, rng), devices=[cpu_device]) as hot,
    ):
        ids = id_pattern("mixed", rng, 150, 40, hot.cached_rows(), (29, 24))
        check_lookup_options(table, ids, hot, cpu_device)


def test_lookup_default_is_the_plain_call_and_options_forward(cpu_device):
    rng = np.random.default_rng(31)
    table, _, _ = make_table(rng, 64, 64)
    ids = jax.device_put(rng.integers(-1, 64, (8, 24)).astype(np.int32), cpu_device)
    with table, ej.HotRowCache(table, 1.0, hot_profile(64, 0, 20, rng)) as hot:
        assert custom_call_targets(lambda i: ej.lookup(table, i), ids) == ["engram_lookup"]
        assert custom_call_targets(lambda i: ej.lookup(table, i, order="plain"), ids) == [
            "engram_lookup"
        ]
        assert custom_call_targets(lambda i: ej.lookup_done(ej.lookup_start(table, i)), ids) == [
            "engram_lookup_start",
            "engram_lookup_done",
        ]
        for kwargs in ({"order": "sorted"}, {"order": "dedup"}, {"cache": hot}):
            assert custom_call_targets(lambda i, k=kwargs: ej.lookup(table, i, **k), ids) == [
                "engram_cached_lookup"
            ]
            # One asynchronous pair for every option.
            assert custom_call_targets(
                lambda i, k=kwargs: ej.lookup_done(ej.lookup_start(table, i, **k)), ids
            ) == ["engram_lookup_start", "engram_lookup_done"]

        @jax.jit
        def kinds(i):
            cached = ej.lookup_start(table, i, cache=hot)
            plain = ej.lookup_start(table, i)
            assert type(cached) is type(plain) is ej.LookupHandle
            return ej.lookup_done(plain), ej.lookup_done(cached)

        a, b = kinds(ids)
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_lookup_options_bad_input(cpu_device):
    rng = np.random.default_rng(32)
    table, _, _ = make_table(rng, 32, 64)
    other, _, _ = make_table(rng, 32, 64)
    ids = np.zeros((4, 2), np.int32)
    with table, other, ej.HotRowCache(other, 1.0, hot_profile(32, 0, 8, rng)) as other_cache:
        for call in (ej.lookup, ej.lookup_start):
            with pytest.raises(ValueError, match="another table"):
                call(table, ids, cache=other_cache)
            with pytest.raises(ValueError, match="order must be"):
                call(table, ids, order="fast")
            with pytest.raises(ValueError, match="order must be"):
                call(table, ids, order=None)
            with pytest.raises(TypeError, match="HotRowCache"):
                call(table, ids, cache=table)
            with pytest.raises(ValueError, match="max_ctas"):
                call(table, ids, order="dedup", max_ctas=0)
        with pytest.raises(TypeError, match="LookupHandle"):
            ej.lookup_done(ids)
        closed = ej.HotRowCache(table, 1.0, hot_profile(32, 0, 8, rng))
        closed.close()
        with pytest.raises(ValueError, match="closed"):
            ej.lookup(table, ids, cache=closed)


@pytest.mark.gpu
def test_gpu_lookup_takes_order_and_cache(gpu_device):
    rng = np.random.default_rng(33)
    table, _, _ = make_table(rng, 3000, 256, "pinned", 17)
    with (
        table,
        ej.HotRowCache(table, 1.0, hot_profile(3000, 17, 800, rng), devices=[gpu_device]) as hot,
    ):
        ids = id_pattern("mixed", rng, 3000, 17, hot.cached_rows(), (300, 24))
        check_lookup_options(table, ids, hot, gpu_device)


# -- input checks and lifetime edges -------------------------------------------------


def test_workspace_bytes_takes_auto_and_rejects_unknown_orders():
    n = _args.AUTO_DEDUP_MIN_IDS
    assert _args.workspace_bytes(n, "auto") == _args.workspace_bytes(n, "dedup")
    assert _args.workspace_bytes(10, "auto") == _args.workspace_bytes(10, "plain")
    with pytest.raises(ValueError, match="order"):
        _args.workspace_bytes(10, "shuffled")


def test_profile_rows_must_be_distinct_integers():
    """The cache index needs strictly increasing rows: a repeated row would break it."""
    with pytest.raises(ValueError, match="distinct"):
        ej.HotRowProfile(np.array([5, 5]), np.array([2, 1]))
    with pytest.raises(TypeError, match="integers"):
        ej.HotRowProfile(np.array([5.7]), np.array([2]))
    with pytest.raises(TypeError, match="integers"):
        ej.HotRowProfile(np.array([5]), np.array([2.5]))
    assert len(ej.HotRowProfile(np.zeros(0, np.int32), np.zeros(0, np.int64))) == 0


def test_ids_observed_during_a_refresh_are_kept_for_the_next(cpu_device, monkeypatch):
    rng = np.random.default_rng(41)
    table, _, _ = make_table(rng, 100, 64)
    with table, ej.HotRowCache(table, 1.0, None, devices=[cpu_device]) as hot:
        hot.observe(np.array([1, 1, 2]))
        original = ej.HotRowProfile.from_ids

        def from_ids_while_a_step_observes(ids):
            # Another thread's step lands between the refresh's snapshot and its reset.
            monkeypatch.setattr(ej.HotRowProfile, "from_ids", original)
            hot.observe(np.array([7, 7]))
            return original(ids)

        monkeypatch.setattr(ej.HotRowProfile, "from_ids", from_ids_while_a_step_observes)
        hot.refresh()
        assert set(hot.cached_rows()) == {1, 2}
        pending = hot.observed_profile()
        np.testing.assert_array_equal(pending.rows, [7])
        np.testing.assert_array_equal(pending.counts, [2])


def test_observe_refuses_traced_ids_clearly(cpu_device):
    rng = np.random.default_rng(44)
    table, _, _ = make_table(rng, 100, 64)
    with table, ej.HotRowCache(table, 1.0, None, devices=[cpu_device]) as hot:
        ids = jnp.array([[1, 2, 3]], jnp.int32)
        for transform in (jax.jit, jax.vmap):
            with pytest.raises(TypeError, match=r"observe\(\) needs concrete ids"):
                transform(hot.observe)(ids)
        assert len(hot.observed_profile()) == 0
        hot.observe(ids)  # the step's concrete output, outside the trace
        np.testing.assert_array_equal(hot.observed_profile().rows, [1, 2, 3])


def test_sharded_cache_needs_a_device(cpu_device):
    rng = np.random.default_rng(42)
    table, _, _ = make_table(rng, 10, 64)
    with ej.ShardedTable({cpu_device: table}) as sharded:
        with pytest.raises(ValueError, match="at least one device"):
            ej.HotRowCache(sharded, 1.0, None, devices=[])
        with pytest.raises(ValueError, match="distinct"):
            ej.HotRowCache(sharded, 1.0, None, devices=[cpu_device, cpu_device])


def test_cache_dropped_by_its_own_background_refresh_is_freed(cpu_device, monkeypatch):
    """The last reference can die on the refresh worker: the cache must still be freed."""
    rng = np.random.default_rng(43)
    table, _, _ = make_table(rng, 100, 64)
    hot = ej.HotRowCache(table, 1.0, ej.HotRowProfile.from_ids(np.arange(50)), devices=[cpu_device])
    state = hot._state
    original = hot_rows.HotRowCache._load

    def slow_load(self, shard, profile):
        time.sleep(0.3)  # long enough for the caller to drop its reference first
        original(self, shard, profile)

    monkeypatch.setattr(hot_rows.HotRowCache, "_load", slow_load)
    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    future = hot.refresh(background=True)
    del hot
    future.result(timeout=30)
    deadline = time.monotonic() + 10
    while state.shards[0].sets != [None, None] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.shards[0].sets == [None, None]
    assert not unraisable
    table.close()
