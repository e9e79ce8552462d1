"""``order=`` of a trainable table's lookups: the dedup gather (distinct ids sorted by
jnp.unique, each row read once, copied back) must give the plain lookup's bits in
every order, for lookup and lookup_start/done, under jit, vmap, scan, a handle
carried between jitted calls, differentiation, a ShardPlan (eight CPU devices)
and fuzzed ids. CPU; the CUDA side-stream path marked gpu for a pinned table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engram_jax as ej
from engram_jax import testing

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
ROW_START = 7
ROWS, DIM = 23, 5  # odd sizes: no power of two, no multiple of 8
CPUS = jax.devices("cpu")


# Tests not marked gpu run on the CPU whatever jax sees (conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu")


def _weight(dtype, rows=ROWS, dim=DIM, seed=0):
    w = np.random.default_rng(seed).normal(size=(rows, dim)).astype(np.float32).astype(dtype)
    w[1, 0] = -0.0  # bits a copy must keep
    w[2, 1] = np.nan
    return w


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype == BF16 else np.uint32)


def _ids(rng, shape):
    """Ids with repeats, DEAD, other negatives and ids past either end of the table."""
    ids = rng.integers(ROW_START - 3, ROW_START + ROWS + 3, shape)
    ids[rng.random(shape) < 0.1] = ej.DEAD_ID
    ids.reshape(-1)[: ids.size // 3] = ids.reshape(-1)[-(ids.size // 3) :]  # repeats
    ids.reshape(-1)[:2] = [np.iinfo(np.int32).min, np.iinfo(np.int32).max]
    return ids.astype(np.int32)


@DTYPES
def test_every_order_gives_the_plain_bits_at_once_and_prefetched(dtype):
    weight = _weight(dtype)
    ids = _ids(np.random.default_rng(1), (3, 7, 4))
    expected = testing.trainable_lookup_reference(weight, ids, row_start=ROW_START)
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd(), row_start=ROW_START) as table:
        for order in ej.ORDERS:
            got = jax.jit(lambda i, o=order: ej.lookup(table, i, order=o))(ids)
            done = jax.jit(lambda i, o=order: ej.lookup_done(ej.lookup_start(table, i, order=o)))(
                ids
            )
            eager = ej.lookup_done(ej.lookup_start(table, ids, order=order))  # looked up at once
            for what, out in (("lookup", got), ("prefetch", done), ("eager", eager)):
                assert out.dtype == np.dtype(dtype) and out.shape == ids.shape + (DIM,)
                np.testing.assert_array_equal(
                    _bits(out), _bits(expected), err_msg=f"{order} {what}"
                )
        for order in ("plain", "dedup"):  # empty batches, every entry point
            empty = np.zeros((0, 4), np.int32)
            assert ej.lookup(table, empty, order=order).shape == (0, 4, DIM)
            assert jax.jit(lambda i, o=order: ej.lookup(table, i, order=o))(empty).shape == (
                0,
                4,
                DIM,
            )
            start = jax.jit(lambda i, o=order: ej.lookup_done(ej.lookup_start(table, i, order=o)))
            assert start(empty).shape == (0, 4, DIM)


def test_which_orders_dedup_and_what_the_gather_reads():
    """ "sorted" and "dedup" (and "auto" from 16,384 ids, and lookup_start's default)
    gather the distinct ids, sorted, DEAD-padded; "plain" and small "auto" do not."""
    weight = _weight(np.float32)
    ids = np.array([[9, 9, -1, 30], [8, 9, 30, -1]], np.int32)
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd(), row_start=ROW_START) as table:

        def started(ids, **options):
            return jax.jit(lambda i: ej.lookup_start(table, i, **options))(ids)

        for options in ({}, {"order": "sorted"}, {"order": "dedup"}):
            handle = started(ids, **options)
            assert handle.pending and handle.order == "dedup"
            np.testing.assert_array_equal(handle.unique, [-1, 8, 9, 30, -1, -1, -1, -1])
            np.testing.assert_array_equal(handle.ids, ids)  # the ids looked up, for updates
            np.testing.assert_array_equal(np.asarray(handle.unique)[handle.inverse], ids)
        for order in ("plain", "auto"):
            handle = started(ids, order=order)
            assert handle.order == "plain" and handle.unique is None and handle.inverse is None
        big = np.tile(np.arange(ROW_START, ROW_START + 16, dtype=np.int32), (1024, 1))
        assert started(big, order="auto").order == "dedup"
        # The synchronous lookup: a sort before the native gather only when deduplicating.
        for order, sorts in (("plain", False), ("auto", False), ("sorted", True), ("dedup", True)):
            jaxpr = str(jax.make_jaxpr(lambda i, o=order: ej.lookup(table, i, order=o))(ids))
            assert ("sort" in jaxpr) == sorts, order


@DTYPES
def test_vmap_and_scan(dtype):
    weight = _weight(dtype)
    ids = _ids(np.random.default_rng(2), (4, 6, 3))
    expected = _bits(testing.trainable_lookup_reference(weight, ids, row_start=ROW_START))
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd(), row_start=ROW_START) as table:
        for order in ("dedup",):  # "sorted" runs the same code (test_which_orders_dedup...)
            mapped = jax.jit(jax.vmap(lambda i, o=order: ej.lookup(table, i, order=o)))(ids)
            np.testing.assert_array_equal(_bits(mapped), expected)
            prefetched = jax.jit(
                jax.vmap(lambda i, o=order: ej.lookup_done(ej.lookup_start(table, i, order=o)))
            )(ids)
            np.testing.assert_array_equal(_bits(prefetched), expected)
            _, scanned = jax.lax.scan(
                lambda c, i, o=order: (c, ej.lookup(table, i, order=o)), 0, ids
            )
            np.testing.assert_array_equal(_bits(scanned), expected)

            def body(handle, next_ids, o=order):  # a chunk ahead, one tag
                rows = ej.lookup_done(handle)
                return ej.lookup_start(table, next_ids, order=o, tag=("ahead", o)), rows

            @jax.jit
            def ahead(ids, o=order, body=body):
                first = ej.lookup_start(table, ids[0], order=o, tag=("ahead", o))
                last, seen = jax.lax.scan(body, first, ids[1:])
                return jnp.concatenate([seen, ej.lookup_done(last)[None]])

            np.testing.assert_array_equal(_bits(ahead(ids)), expected)


def test_a_step_carrying_its_handle_compiles_once_and_reads_each_update():
    """The training step's exact prefetch: the next lookup started after this step's
    update, its handle (with the dedup's arrays) returned and taken by the next call."""
    weight = _weight(np.float32)
    weight[2, 1] = 0.0  # updated below: keep the arithmetic finite
    rng = np.random.default_rng(3)
    batches = [_ids(rng, (5, 4)) for _ in range(4)]
    traces = []
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd(), row_start=ROW_START) as table:

        @jax.jit
        def step(handle, ids, next_ids):
            traces.append(1)
            rows = ej.lookup_done(handle)
            grads = jax.grad(lambda r: jnp.sum(r**2))(rows)
            update = ej.apply_gradients(table, handle.ids, grads, 0.25, after=rows)
            return rows, ej.lookup_start(table, next_ids, tag="carried", after=update)

        handle = jax.jit(lambda i: ej.lookup_start(table, i, tag="carried"))(batches[0])
        w = weight
        for k in range(3):
            rows, handle = step(handle, batches[k], batches[k + 1])
            want = testing.trainable_lookup_reference(w, batches[k], row_start=ROW_START)
            np.testing.assert_array_equal(rows, want)
            w = testing.sgd_reference(w, batches[k] - ROW_START, 2 * want, 0.25)
        assert len(traces) == 1 and handle.unique is not None
        final = jax.jit(ej.lookup_done)(handle)
        np.testing.assert_array_equal(
            final, testing.trainable_lookup_reference(w, batches[3], row_start=ROW_START)
        )


def _loss(rows, x):
    return jnp.sum(jnp.tanh(x) * rows.astype(jnp.float32).sum(axis=(-2, -1))[:, None])


@pytest.mark.parametrize("how", ["lookup", "prefetch", "prefetch_ahead"])
def test_gradients_match_the_plain_lookups(how):
    """Differentiated code around a dedup lookup: the rows are constants of the ids
    (also when the ids and the handle's dedup arrays went through a barrier with a
    differentiated value), and the rows' cotangents are the plain lookup's."""
    weight = _weight(np.float32)
    weight[2, 1] = 1.0
    ids = _ids(np.random.default_rng(4), (2, 6))

    def grads(table, order):
        def loss(x, ids):
            if how == "lookup":
                ids, _ = jax.lax.optimization_barrier((ids, x[:1, :1]))
                rows = ej.lookup(table, ids, order=order)
            else:
                if how == "prefetch_ahead":
                    ids, x = jax.lax.optimization_barrier((ids, x))
                handle = ej.lookup_start(table, ids, order=order)
                x = jnp.tanh(x) * 2
                handle, _ = jax.lax.optimization_barrier((handle, x[:1, :1]))
                rows = ej.lookup_done(handle)
            return _loss(rows, x) + jnp.sum(rows * x[:, :1, None])

        x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)
        g_x = jax.jit(jax.grad(loss))(x, ids)

        @jax.jit
        def row_grads(ids):
            rows = ej.lookup(table, ids, order=order)
            return jax.grad(lambda r: _loss(r, x) + jnp.sum(r**3))(rows)

        return g_x, row_grads(ids)

    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd(), row_start=ROW_START) as table:
        want_x, want_rows = grads(table, "plain")
        assert float(jnp.abs(want_x).max()) > 0 and float(jnp.abs(want_rows).max()) > 0
        got_x, got_rows = grads(table, "dedup")
        np.testing.assert_array_equal(_bits(got_x), _bits(want_x))
        np.testing.assert_array_equal(_bits(got_rows), _bits(want_rows))


def test_sharded_dedup_equals_plain_at_once_and_prefetched():
    """With a ShardPlan each device dedups the ids it gathers (every replica's, for its
    head shard); rows and the update after them equal the plain path's."""
    sizes = (29, 31, 37, 41)
    mesh = ej.engram_mesh(tp=2, edp=2, devices=CPUS[:4])
    plan = ej.ShardPlan(sizes, tp=2, edp=2)
    rng = np.random.default_rng(5)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    ids = (rng.integers(0, sizes, (2 * 6, len(sizes))) + offsets).astype(np.int32)
    ids[rng.random(ids.shape) < 0.15] = ej.DEAD_ID
    ids[:6] = ids[6:]  # the same tokens on both replicas
    weight = rng.normal(size=(sum(sizes), 8)).astype(np.float32)
    expected = testing.trainable_lookup_reference(weight, ids)
    spec = P(("dp", "edp"))
    placed = jax.device_put(ids, NamedSharding(mesh, spec))
    with ej.shard_trainable_from_array(weight, mesh, plan, optimizer=ej.sgd()) as table:

        def body(ids, order):
            at_once = ej.lookup(table, ids, plan=plan, order=order)
            handle = ej.lookup_start(table, ids, plan=plan, order=order)
            assert (handle.unique is None) == (order == "plain")
            return at_once, ej.lookup_done(handle)

        results = {}
        for order in ("plain", "dedup"):
            mapped = jax.shard_map(
                lambda i, o=order: body(i, o), mesh=mesh, in_specs=spec, out_specs=(spec, spec)
            )
            results[order] = [np.asarray(r) for r in jax.jit(mapped)(placed)]
            for r in results[order]:
                np.testing.assert_array_equal(r, expected, err_msg=order)
        sharded = ej.make_sharded_lookup(table, mesh, plan, order="dedup")
        np.testing.assert_array_equal(sharded(ids), expected)


@settings(max_examples=12, deadline=None)
@given(
    data=st.lists(st.integers(-4, ROWS + 3), min_size=1, max_size=30),
    order=st.sampled_from(["sorted", "dedup"]),
)
def test_fuzzed_ids(data, order):
    # One shape for every example (one compile): the fuzzed ids padded with DEAD.
    ids = np.full(30, ej.DEAD_ID, np.int32)
    ids[: len(data)] = np.asarray(data, np.int32) + ROW_START
    ids = ids.reshape(6, 5)
    table = _fuzz_table()
    want = _bits(testing.trainable_lookup_reference(_weight(BF16), ids, row_start=ROW_START))
    got = _fuzz_steps(table, order)(ids)
    for out in got:
        np.testing.assert_array_equal(_bits(out), want)


_FUZZ: dict = {}


def _fuzz_table():
    if "table" not in _FUZZ or _FUZZ["table"].closed:
        _FUZZ["table"] = ej.TrainableTable.from_array(
            _weight(BF16), optimizer=ej.sgd(), row_start=ROW_START
        )
    return _FUZZ["table"]


def _fuzz_steps(table, order):
    key = (table.key, order)
    if key not in _FUZZ:
        _FUZZ[key] = jax.jit(
            lambda i: (
                ej.lookup(table, i, order=order),
                ej.lookup_done(ej.lookup_start(table, i, order=order)),
            )
        )
    return _FUZZ[key]


@pytest.fixture(scope="module", autouse=True)
def _close_fuzz_table():
    yield
    if "table" in _FUZZ:
        _FUZZ.pop("table").close()
    _FUZZ.clear()


# -- CUDA -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
@DTYPES
def test_gpu_dedup_lookup_and_prefetch_on_the_side_stream(placement, dtype, gpu_device):
    """The staged start of the distinct ids on the side stream, its done and the
    expansion, against the plain lookup, with ids that are a slice of a fused value;
    a carried handle across jitted calls; the grid default and a full one."""
    rows, dim = 5000, 64
    weight = _weight(dtype, rows=rows, dim=dim, seed=6)
    rng = np.random.default_rng(7)
    host = rng.integers(-2, rows + 2, (3, 512, 24)).astype(np.int32)
    host[:, 256:] = host[:, :256]  # about half repeated
    ids = jax.device_put(host, gpu_device)
    expected = _bits(testing.trainable_lookup_reference(weight, host))
    with ej.TrainableTable.from_array(
        weight, optimizer=ej.sgd(), placement=placement, device=gpu_device
    ) as table:
        for order in ("dedup", "sorted", "auto"):
            for max_ctas in (None, 132):

                @jax.jit
                def run(ids, o=order, m=max_ctas):
                    fused = jnp.where(ids < -1, ej.DEAD_ID, ids)  # a fusion, two consumers
                    handle = ej.lookup_start(table, fused[1:], order=o, max_ctas=m)
                    at_once = ej.lookup(table, fused[:1], order=o)
                    return at_once, ej.lookup_done(handle)

                at_once, done = run(ids)
                np.testing.assert_array_equal(_bits(at_once), expected[:1], err_msg=order)
                np.testing.assert_array_equal(_bits(done), expected[1:], err_msg=order)
        traces = []
        start = jax.jit(lambda i: ej.lookup_start(table, i, tag="gpu-dedup"))

        @jax.jit
        def finish(handle, ids):
            traces.append(1)
            return ej.lookup_done(handle), ej.lookup_start(table, ids, tag="gpu-dedup")

        handle = start(ids[0])
        for k in range(1, 3):
            rows_k, handle = finish(handle, ids[k])
            np.testing.assert_array_equal(_bits(rows_k), expected[k - 1])
        np.testing.assert_array_equal(_bits(jax.jit(ej.lookup_done)(handle)), expected[2])
        assert len(traces) == 1 and handle.unique is not None
