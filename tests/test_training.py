"""Trainable tables end to end: the table's own API (rows, state, close), the
lookup in the table's dtype (jit, vmap, scan, prefetch), apply_gradients inside
a jitted step (duplicates, dead ids, empty batches, vmap, scan, ordering
against lookups with after= in the same step and across steps,
bit-reproducibility) and the errors for bad input before anything compiles,
with nothing written. CPU; the CUDA paths marked gpu for pinned and device tables.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import engram_jax as ej
from engram_jax import testing

BF16 = np.dtype(ml_dtypes.bfloat16)


# Tests not marked gpu run on the CPU whatever jax sees (conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu")


def _weight(rows, dim, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, dim)).astype(np.float32).astype(dtype)


def _fp8_table(rows=16, dim=32):
    weight = np.zeros((rows, dim), ml_dtypes.float8_e4m3fn)
    return ej.EngramTable.from_arrays(weight, np.full((rows, dim // 32), 127, np.uint8))


# -- the table ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_allocate_write_read_and_state(dtype):
    opt = ej.adagrad(initial_accumulator_value=0.25)
    with ej.TrainableTable.allocate(10, 6, dtype=dtype, optimizer=opt, row_start=50) as table:
        assert (table.dtype, table.dim, table.num_rows, table.row_start) == (
            np.dtype(dtype),
            6,
            10,
            50,
        )
        assert table.optimizer == opt and table.placement == "cpu"
        assert not table.read_rows(np.arange(50, 60)).any()  # zero rows
        np.testing.assert_array_equal(table.state()["sum_of_squares"], np.full((10, 6), 0.25))
        rows = _weight(3, 6, dtype)
        table.write_rows(4, rows)
        got = table.read_rows([54, 55, 56, 1, 60, -1])
        assert got.dtype == np.dtype(dtype) and got.shape == (6, 6)
        np.testing.assert_array_equal(got[:3], rows)
        assert not got[3:].any()  # not held: zeros
        state = {"sum_of_squares": np.arange(12, dtype=np.float32).reshape(2, 6)}
        table.write_state(8, state)
        np.testing.assert_array_equal(table.state()["sum_of_squares"][8:], state["sum_of_squares"])
        np.testing.assert_array_equal(table.read_rows([54, 55, 56]), rows)  # rows kept
    assert table.closed and "closed" in repr(table)


def test_from_array_with_state_and_every_optimizers_state_names():
    weight = _weight(5, 4)
    names = {
        "sgd": [],
        "adagrad": ["sum_of_squares"],
        "row_adagrad": ["accumulator"],
        "lazy_adam": ["exp_avg", "exp_avg_sq"],
    }
    for opt in (ej.sgd(), ej.adagrad(), ej.row_adagrad(), ej.lazy_adam()):
        with ej.TrainableTable.from_array(weight, optimizer=opt) as table:
            state = table.state()
            assert sorted(state) == names[opt.name]
            np.testing.assert_array_equal(table.read_rows(np.arange(5)), weight)
            if state:
                state = {k: v + 1 for k, v in state.items()}
                with ej.TrainableTable.from_array(weight, optimizer=opt, state=state) as copy:
                    for name, value in copy.state().items():
                        np.testing.assert_array_equal(value, state[name])


def test_optimizer_specs_are_static_and_hashable():
    assert ej.lazy_adam() == ej.lazy_adam() and hash(ej.sgd()) == hash(ej.sgd())
    assert ej.lazy_adam(moment_dtype=jnp.bfloat16).moment_dtype == "bfloat16"
    assert isinstance(ej.row_adagrad(), ej.RowOptimizer)
    with pytest.raises(TypeError, match="moment_dtype"):
        ej.lazy_adam(moment_dtype=np.int8)
    with pytest.raises(ValueError, match="b1 and b2"):
        ej.lazy_adam(b1=1.0)


# -- the lookup --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_lookup_under_jit_vmap_scan_and_prefetch(dtype):
    weight = _weight(20, 5, dtype)
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd(), row_start=7) as table:
        ids = np.array([[7, 26, 27, -1], [6, 10, 10, 2**31 - 1]], np.int32)
        expected = testing.trainable_lookup_reference(weight, ids, row_start=7)
        out = jax.jit(lambda i: ej.lookup(table, i))(ids)
        assert out.dtype == np.dtype(dtype) and out.shape == (2, 4, 5)
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(jax.vmap(lambda i: ej.lookup(table, i))(ids), expected)
        _, scanned = jax.lax.scan(lambda c, i: (c, ej.lookup(table, i)), 0, ids)
        np.testing.assert_array_equal(scanned, expected)
        started = jax.jit(lambda i: ej.lookup_done(ej.lookup_start(table, i)))(ids)
        np.testing.assert_array_equal(started, expected)
        assert ej.lookup(table, np.zeros((0, 3), np.int32)).shape == (0, 3, 5)


# -- the update ----------------------------------------------------------------------------


def test_update_then_lookup_in_the_same_step_and_the_next():
    weight = _weight(12, 8)
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd()) as table:

        @jax.jit
        def step(ids, lr):
            rows = ej.lookup(table, ids)
            loss, grads = jax.value_and_grad(lambda r: jnp.sum(r**2))(rows)
            update = ej.apply_gradients(table, ids, grads, lr, after=rows)
            return rows, ej.lookup(table, ids, after=update), update

        ids = np.array([[1, 3], [3, 11]], np.int32)
        before, after, token = step(ids, 0.25)
        assert token.shape == () and token.dtype == jnp.int32
        np.testing.assert_array_equal(before, weight[ids])
        expected = testing.sgd_reference(weight, ids, 2 * weight[ids], 0.25)
        np.testing.assert_array_equal(after, expected[ids])  # same step, after the update
        before2, _, _ = step(ids, 0.25)
        np.testing.assert_array_equal(before2, expected[ids])  # next step: new rows
        h = jax.jit(lambda i, t: ej.lookup_done(ej.lookup_start(table, i, after=t)))(ids, token)
        np.testing.assert_array_equal(h, table.read_rows(ids))


def _prefetch_orders(table, ids, next_ids):
    """One step of each order of reading the next batch early: exact (the next
    batch's gather starts after this step's update) and one step stale (finished
    before the update)."""

    @jax.jit
    def exact(ids, next_ids):
        rows = ej.lookup(table, ids)
        update = ej.apply_gradients(table, ids, rows, 0.5, after=rows)
        return ej.lookup_done(ej.lookup_start(table, next_ids, after=update))

    @jax.jit
    def stale(ids, next_ids):
        handle = ej.lookup_start(table, next_ids)
        rows = ej.lookup(table, ids)
        next_rows = ej.lookup_done(handle)
        ej.apply_gradients(table, ids, rows, 0.5, after=(rows, next_rows))
        return next_rows

    return exact, stale


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_next_batch_read_exactly_or_one_step_stale(dtype):
    weight = _weight(10, 8, dtype)
    ids = np.array([[1, 2, 2]], np.int32)
    next_ids = np.array([[2, 3, -1]], np.int32)
    updated = testing.sgd_reference(weight, ids, weight[ids], 0.5)
    for order, expected in (("exact", updated), ("stale", weight)):
        with ej.TrainableTable.from_array(weight, optimizer=ej.sgd()) as table:
            exact, stale = _prefetch_orders(table, ids, next_ids)
            got = (exact if order == "exact" else stale)(ids, next_ids)
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(
                got, testing.trainable_lookup_reference(expected, next_ids)
            )
            np.testing.assert_array_equal(table.read_rows(np.arange(10)), updated)
        with ej.TrainableTable.from_array(weight, optimizer=ej.sgd()) as table:
            with pytest.raises(ValueError, match="pending LookupHandle"):
                jax.jit(
                    lambda i: ej.apply_gradients(
                        table, i, jnp.ones((1, 3, 8), dtype), 0.1, after=ej.lookup_start(table, i)
                    )
                )(ids)


def test_scan_gathers_the_next_chunk_a_step_ahead_after_each_update():
    weight = _weight(12, 4)
    chunks = np.array([[[1, 2]], [[2, 5]], [[5, 1]], [[7, 2]]], np.int32)
    with ej.TrainableTable.from_array(weight, optimizer=ej.row_adagrad()) as table:

        @jax.jit
        def train(chunks):
            def body(handle, next_ids):
                rows = ej.lookup_done(handle)
                update = ej.apply_gradients(table, handle.ids, rows, 0.1, after=rows)
                return ej.lookup_start(table, next_ids, tag="train", after=update), rows

            first = ej.lookup_start(table, chunks[0], tag="train")
            last, seen = jax.lax.scan(body, first, chunks[1:])
            return seen, ej.lookup_done(last)

        seen, last = train(chunks)
        w, acc = weight, np.zeros(12, np.float32)
        for k in range(3):
            np.testing.assert_array_equal(seen[k], w[chunks[k]])
            w, acc = testing.row_adagrad_reference(w, acc, chunks[k], w[chunks[k]], 0.1)
        np.testing.assert_array_equal(last, w[chunks[3]])


def test_duplicates_dead_ids_and_bit_reproducibility():
    rng = np.random.default_rng(3)
    weight = _weight(8, 16)
    ids = rng.integers(-2, 10, (64, 3)).astype(np.int32)  # many repeats, dead, past the end
    grads = rng.normal(size=(64, 3, 16)).astype(np.float32) * 1e3
    results = []
    for _ in range(2):  # fresh tables, same input: the same bits
        with ej.TrainableTable.from_array(weight, optimizer=ej.row_adagrad()) as table:
            jax.jit(lambda i, g: ej.apply_gradients(table, i, g, 0.1))(ids, grads)
            results.append(table.read_rows(np.arange(8)))
    np.testing.assert_array_equal(results[0].view(np.uint32), results[1].view(np.uint32))
    expected, _ = testing.row_adagrad_reference(weight, np.zeros(8, np.float32), ids, grads, 0.1)
    np.testing.assert_array_equal(results[0].view(np.uint32), expected.view(np.uint32))


def test_dead_and_empty_batches_write_nothing():
    weight = _weight(6, 4)
    with ej.TrainableTable.from_array(weight, optimizer=ej.lazy_adam()) as table:
        dead = np.array([[-1, 6, 100, -(2**31)]], np.int32)
        token = ej.apply_gradients(table, dead, np.ones((1, 4, 4), np.float32), 1.0, step=1)
        empty = ej.apply_gradients(table, np.zeros((0, 2), np.int32), np.zeros((0, 2, 4)), 1.0, 1)
        jax.block_until_ready((token, empty))
        np.testing.assert_array_equal(table.read_rows(np.arange(6)), weight)
        assert not table.state()["exp_avg"].any()


def test_vmap_makes_one_update_of_the_whole_batch():
    weight = _weight(10, 4)
    ids = np.array([[1, 2], [2, 2], [9, -1]], np.int32)
    grads = np.random.default_rng(4).normal(size=(3, 2, 4)).astype(np.float32)
    with ej.TrainableTable.from_array(weight, optimizer=ej.row_adagrad()) as table:
        tokens = jax.jit(jax.vmap(lambda i, g: ej.apply_gradients(table, i, g, 0.5)))(ids, grads)
        assert tokens.shape == (3,)
        expected, _ = testing.row_adagrad_reference(
            weight, np.zeros(10, np.float32), ids, grads, 0.5
        )
        np.testing.assert_array_equal(table.read_rows(np.arange(10)), expected)
        with pytest.raises(ValueError, match="not batched"):
            jax.vmap(lambda i, g, lr: ej.apply_gradients(table, i, g, lr))(
                ids, grads, np.ones(3, np.float32)
            )


def _gradient_sized_copies(device=None) -> list[str]:
    """The compiled update's instructions that make an array the size of its gradients
    (other than the custom call, the parameter and bitcasts, which move nothing), for
    gradients given with a unit axis (``grads[:, None]``, as a caller with one id column
    writes them)."""
    n, dim = 1024, 256
    weight = _weight(n, dim, BF16)
    kw = dict(placement="pinned", device=device) if device is not None else {}
    with ej.TrainableTable.from_array(weight, optimizer=ej.row_adagrad(), **kw) as table:

        def update(ids, grads):
            return ej.apply_gradients(table, ids[:, None], grads[:, None], 0.1)

        args = (jnp.zeros(n, jnp.int32), jnp.zeros((n, dim), jnp.bfloat16))
        if device is not None:
            args = jax.device_put(args, device)
        hlo = jax.jit(update).lower(*args).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :].splitlines()[1:]
    return [
        line.strip()
        for line in entry
        if (f"[{n},1,{dim}]" in line or f"[{n},{dim}]{{" in line)
        and not any(op in line for op in ("custom-call(", " parameter(", " bitcast("))
    ]


def test_update_takes_the_gradients_without_a_copy():
    # XLA lays grads[:, None] out with its unit axis major; the call took [n, 1, dim]
    # row-major and the CPU backend copied the whole array to give it that.
    assert _gradient_sized_copies() == []


@pytest.mark.gpu
def test_gpu_update_takes_the_gradients_without_a_copy(gpu_device):
    assert _gradient_sized_copies(gpu_device) == []


def test_scan_updates_in_turn_and_reads_each_update():
    weight = _weight(6, 4)
    ids = np.array([[1, 2], [2, 3], [1, 1]], np.int32)
    with ej.TrainableTable.from_array(weight, optimizer=ej.lazy_adam()) as table:

        @jax.jit
        def train(ids):
            def body(step, i):
                rows = ej.lookup(table, i)
                update = ej.apply_gradients(table, i, rows, 0.1, step=step, after=rows)
                return step + 1, ej.lookup(table, i, after=update)

            return jax.lax.scan(body, jnp.int32(1), ids)[1]

        seen = train(ids)
        w = weight
        m = v = np.zeros_like(weight)
        for k in range(3):  # gradient = the rows themselves
            g = w[ids[k]]
            size = np.asarray(table.optimizer.step_size(0.1, k + 1))
            w, m, v = testing.lazy_adam_reference(w, m, v, ids[k], g, 0.1, k + 1, step_size=size)
            np.testing.assert_array_equal(seen[k], w[ids[k]])
        np.testing.assert_array_equal(table.read_rows(np.arange(6)), w)


def test_schedule_as_traced_learning_rate():
    import optax

    schedule = optax.linear_schedule(1.0, 0.0, 4)
    weight = _weight(4, 4)
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd()) as table:
        step = jax.jit(lambda i, g, n: ej.apply_gradients(table, i, g, schedule(n)))
        ids, grads = np.array([0, 1], np.int32), np.ones((2, 4), np.float32)
        for n in range(2):
            step(ids, grads, n)
        expected = weight.copy()
        expected[:2] -= np.float32(1.0) + np.float32(0.75)
        np.testing.assert_allclose(table.read_rows(np.arange(4)), expected, rtol=1e-6)


# -- bad input ---------------------------------------------------------------------------


def test_bad_input_raises_before_compiling_and_writes_nothing():
    weight = _weight(6, 4)
    ids = np.array([[0, 1]], np.int32)
    ok = np.ones((1, 2, 4), np.float32)
    with ej.TrainableTable.from_array(weight, optimizer=ej.lazy_adam()) as table:
        cases = [
            (TypeError, "float32 or bfloat16", dict(grads=ok.astype(np.float16))),
            (ValueError, r"ids.shape \+ \(dim,\)", dict(grads=np.ones((1, 2, 5), np.float32))),
            (ValueError, "must be a scalar", dict(lr=np.ones(2, np.float32))),
            (TypeError, "learning_rate must be a float scalar", dict(lr="0.1")),
            (ValueError, "needs step", dict(step=None)),
            (ValueError, "counts from 1", dict(step=0)),
            (ValueError, "must be a scalar", dict(step=np.ones(2, np.int32))),
            (ValueError, "stream must be >= 1", dict(stream=0)),
            (TypeError, "stream must be an int", dict(stream=True)),
            (TypeError, "stream must be an int", dict(stream="1")),
        ]
        for error, message, change in cases:
            args = dict(grads=ok, lr=0.1, step=1, stream=None) | change
            with pytest.raises(error, match=message):
                jax.jit(
                    lambda i, table=table, a=args: ej.apply_gradients(
                        table, i, a["grads"], a["lr"], step=a["step"], stream=a["stream"]
                    )
                )(ids)
        np.testing.assert_array_equal(table.read_rows(np.arange(6)), weight)
        with pytest.raises(ValueError, match="does not match the table"):
            table.write_state(0, {"exp_avg": np.zeros((2, 4), np.float32)})
        with pytest.raises(ValueError, match="does not match the table"):
            table.write_state(0, {"exp_avg": np.zeros((2, 3)), "exp_avg_sq": np.zeros((2, 3))})
        with pytest.raises(TypeError, match="hot-row cache"):
            ej.lookup(table, ids, cache=object())
        for fp8_only in (
            lambda: ej.lookup_records(table, ids),
            lambda: ej.HotRowCache(table, 0.001),
        ):
            with pytest.raises(TypeError, match="fp8 serving tables"):
                fp8_only()
    with pytest.raises(ValueError, match="does not match the table"):
        ej.TrainableTable.from_array(weight, optimizer=ej.sgd(), state={"x": weight})
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        ej.TrainableTable.from_array(weight.astype(np.float16), optimizer=ej.sgd())
    with pytest.raises(TypeError, match="RowOptimizer"):
        ej.TrainableTable.allocate(4, 4, optimizer="adam")
    with _fp8_table() as fp8:
        with pytest.raises(TypeError, match="fp8 serving tables are read-only"):
            ej.apply_gradients(fp8, ids, ok, 0.1)


def _updates_on_streams(table, ids, grads, device=None):
    """One jitted program: an update on XLA's stream 1 whose token a lookup takes, then
    one on stream 2 whose token nothing takes, beside arithmetic that needs neither:
    the rows after the first update, and the arithmetic's result."""

    @jax.jit
    def step(ids, grads, x):
        first = ej.apply_gradients(table, ids, grads, 0.5, stream=1)
        rows = ej.lookup(table, ids, after=first)
        ej.apply_gradients(table, ids, grads, 0.25, stream=2, after=rows)
        for _ in range(4):
            x = jnp.tanh(x @ x)
        return rows, x

    x = jnp.full((64, 64), 0.01, jnp.float32)
    if device is not None:
        ids, grads, x = jax.device_put((ids, grads, x), device)
    return step(ids, grads, x)


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_updates_on_a_stream_write_what_updates_without_one_write(dtype):
    weight = _weight(50, 8, dtype)
    ids = np.array([[3, 3, 7], [49, -1, 60]], np.int32)
    grads = _weight(6, 8, dtype, seed=1).reshape(2, 3, 8)
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd()) as table:
        rows, _ = _updates_on_streams(table, ids, grads)
        got = table.read_rows(np.arange(50))
    once = testing.sgd_reference(weight, ids, grads, 0.5)
    twice = testing.sgd_reference(once, ids, grads, 0.25)
    np.testing.assert_array_equal(rows, testing.trainable_lookup_reference(once, ids))
    np.testing.assert_array_equal(got, twice)


def test_closed_table_raises_also_from_a_compiled_step():
    table = ej.TrainableTable.from_array(_weight(6, 4), optimizer=ej.sgd())
    ids, grads = np.array([0, 1], np.int32), np.ones((2, 4), np.float32)
    step = jax.jit(lambda i, g: ej.apply_gradients(table, i, g, 0.1))
    step(ids, grads)
    table.close()
    with pytest.raises(ValueError, match="closed"):
        ej.apply_gradients(table, ids, grads, 0.1)
    with pytest.raises(ValueError, match="closed"):
        ej.lookup(table, ids)
    with pytest.raises(Exception, match="closed or was never placed"):
        jax.block_until_ready(step(ids, grads))  # compiled before the close: the handler refuses


def test_native_checks_refuse_mismatched_calls_and_write_nothing():
    # What Python checks first, the handler checks again: a call traced for another
    # optimizer or dtype, and an fp8 table's key, are refused with nothing written.
    from engram_jax import _native

    weight = _weight(6, 4)
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd()) as table, _fp8_table() as fp8:
        _native.ensure_registered()

        def call(size):  # the token and the workspace, in one result
            out = jax.ShapeDtypeStruct((size,), jnp.uint8)
            return jax.ffi.ffi_call("engram_apply_gradients", out, has_side_effect=True)

        target = call(1 << 20)
        good = dict(
            table_key=np.int64(table.key),
            dim=np.int64(4),
            format=np.int64(1),
            optimizer=np.int64(0),
            moment_format=np.int64(1),
            eps=np.float32(0),
            one_minus_b1=np.float32(1),
            one_minus_b2=np.float32(1),
        )
        ids, grads = jnp.array([0, 1], jnp.int32), jnp.ones((2, 4), jnp.float32)
        for change, message in (
            (dict(optimizer=np.int64(2)), "does not match"),
            (dict(format=np.int64(2)), "traced for"),
            (dict(table_key=np.int64(fp8.key)), "fp8 serving table"),
        ):
            with pytest.raises(Exception, match=message):
                jax.block_until_ready(target(ids, grads, jnp.float32(1.0), **(good | change)))
        with pytest.raises(Exception, match="learning_rate must be a float32 scalar"):
            jax.block_until_ready(target(ids, grads, jnp.ones(2, jnp.float32), **good))
        with pytest.raises(Exception, match="needed .token and workspace"):
            jax.block_until_ready(call(8)(ids, grads, jnp.float32(1.0), **good))
        np.testing.assert_array_equal(table.read_rows(np.arange(6)), weight)
        with pytest.raises(Exception, match="trainable table"):
            # an fp8 lookup handed a trainable table's key
            lookup = jax.ffi.ffi_call("engram_lookup", jax.ShapeDtypeStruct((2, 32), jnp.bfloat16))
            jax.block_until_ready(
                lookup(ids, table_key=np.int64(table.key), dim=np.int64(32), max_ctas=np.int64(0))
            )


# -- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_gpu_step_lookup_update_lookup(placement, dtype, gpu_device):
    rng = np.random.default_rng(9)
    host_ids = rng.integers(-5, 310, (64, 12)).astype(np.int32)
    _check_step_lookup_update_lookup(_weight(300, 40, dtype), host_ids, placement, gpu_device)


@pytest.mark.gpu
def test_gpu_dedup_after_update_over_a_dirtied_pool(gpu_device):
    """The step test's bf16 program, four times on fresh ids and a fresh table, each
    after nonzero bytes were left in jax's pool. initcheck with command buffers on
    reports the zeros its dedup start scatters the inverse onto as never written
    (README, developer section); were they not, the inverse would land on leftover
    bytes and the rows would differ."""
    rng = np.random.default_rng(21)
    for k in range(4):
        junk = [jax.device_put(np.full(1 << 20, 0x01010101 * (k + 1), np.int32), gpu_device)
                for _ in range(64)]  # fmt: skip
        jax.block_until_ready(junk)
        del junk
        host_ids = rng.integers(-5, 310, (64, 12)).astype(np.int32)
        _check_step_lookup_update_lookup(_weight(300, 40, BF16, k), host_ids, "pinned", gpu_device)


def _check_step_lookup_update_lookup(weight, host_ids, placement, device):
    """A lookup, its rows' row_adagrad update, a dedup start and done after it and a
    lookup after it in one jitted step: the rows before and after as the references
    give them, and the table's rows after."""
    with ej.TrainableTable.from_array(
        weight, optimizer=ej.row_adagrad(), placement=placement, device=device
    ) as table:

        @jax.jit
        def step(ids, lr):
            rows = ej.lookup(table, ids)
            grads = jax.grad(lambda r: jnp.sum(r.astype(jnp.float32) ** 2))(rows)
            update = ej.apply_gradients(table, ids, grads, lr, after=rows)
            done = ej.lookup_done(ej.lookup_start(table, ids, after=update))
            return rows, ej.lookup(table, ids, after=update), done

        before, after, done = step(jax.device_put(host_ids, device), jnp.float32(0.1))
        assert after.devices() == {device}
        np.testing.assert_array_equal(before, testing.trainable_lookup_reference(weight, host_ids))
        num_rows = len(weight)
        grads = weight[np.clip(host_ids, 0, num_rows - 1)].astype(np.float32)
        grads = (2 * grads).astype(weight.dtype)
        grads[(host_ids < 0) | (host_ids >= num_rows)] = 0
        expected, _ = testing.row_adagrad_reference(
            weight, np.zeros(num_rows, np.float32), host_ids, grads, 0.1
        )
        np.testing.assert_array_equal(after, testing.trainable_lookup_reference(expected, host_ids))
        np.testing.assert_array_equal(done, after)
        np.testing.assert_array_equal(table.read_rows(np.arange(num_rows)), expected)


def _check_next_batch_orders(placement, device=None):
    """Both orders of :func:`_prefetch_orders` at a size where the next batch shares
    half its ids (and their duplicates, and dead ids) with this one. The update's
    gradients are the rows themselves (what ``_prefetch_orders`` passes), so a row
    met ``k`` times becomes ``(1 - k / 2) * row``: twice is zero, and every touched
    row differs from its stale value."""
    rng = np.random.default_rng(12)
    weight = _weight(4000, 64, BF16)
    ids = rng.integers(-1, 4000, (256, 8)).astype(np.int32)
    next_ids = np.concatenate([ids[:128], rng.integers(0, 4000, (128, 8))]).astype(np.int32)
    updated = testing.sgd_reference(
        weight, ids, testing.trainable_lookup_reference(weight, ids), 0.5
    )
    put = (lambda x: x) if device is None else (lambda x: jax.device_put(x, device))
    for order, expected in (("exact", updated), ("stale", weight)):
        with ej.TrainableTable.from_array(
            weight, optimizer=ej.sgd(), placement=placement, device=device
        ) as table:
            exact, stale = _prefetch_orders(table, ids, next_ids)
            got = (exact if order == "exact" else stale)(put(ids), put(next_ids))
            np.testing.assert_array_equal(
                got,
                testing.trainable_lookup_reference(expected, next_ids),
                err_msg=f"{order} order: the next batch's rows",
            )
            np.testing.assert_array_equal(
                table.read_rows(np.arange(4000)),
                updated,
                err_msg=f"{order} order: the table after the update",
            )
    return rng


def test_next_batch_orders_at_size():
    _check_next_batch_orders("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
def test_gpu_next_batch_exact_stale_and_scan_ahead(placement, gpu_device):
    # The background gather of a trainable table on the side stream: after an update
    # (exact), finished before one (stale), and a whole scan step ahead.
    rng = _check_next_batch_orders(placement, gpu_device)
    weight = _weight(4000, 64, BF16)
    put = lambda x: jax.device_put(x, gpu_device)  # noqa: E731
    chunks = rng.integers(0, 4000, (6, 64, 8)).astype(np.int32)
    with ej.TrainableTable.from_array(
        weight, optimizer=ej.row_adagrad(), placement=placement, device=gpu_device
    ) as table:

        @jax.jit
        def train(chunks):
            def body(handle, next_ids):
                rows = ej.lookup_done(handle)
                update = ej.apply_gradients(table, handle.ids, rows, 0.1, after=rows)
                return ej.lookup_start(table, next_ids, tag="gpu-train", after=update), rows

            first = ej.lookup_start(table, chunks[0], tag="gpu-train")
            last, seen = jax.lax.scan(body, first, chunks[1:])
            return seen, ej.lookup_done(last)

        seen, last = train(put(chunks))
        w, acc = weight, np.zeros(4000, np.float32)
        for k in range(5):
            np.testing.assert_array_equal(seen[k], w[chunks[k]])
            w, acc = testing.row_adagrad_reference(w, acc, chunks[k], w[chunks[k]], 0.1)
        np.testing.assert_array_equal(last, w[chunks[5]])


@pytest.mark.gpu
def test_gpu_vmap_scan_empty_and_reproducible(gpu_device):
    rng = np.random.default_rng(10)
    weight = _weight(50, 8)
    ids = jax.device_put(rng.integers(-1, 50, (4, 256)).astype(np.int32), gpu_device)
    grads = jax.device_put(rng.normal(size=(4, 256, 8)).astype(np.float32), gpu_device)
    results = []
    for _ in range(2):
        with ej.TrainableTable.from_array(
            weight, optimizer=ej.lazy_adam(), placement="pinned", device=gpu_device
        ) as table:
            upd = jax.vmap(lambda i, g: ej.apply_gradients(table, i, g, 0.1, step=1))
            jax.block_until_ready(jax.jit(upd)(ids, grads))
            empty = jax.device_put(np.zeros((0, 3), np.int32), gpu_device)
            ej.apply_gradients(table, empty, jnp.zeros((0, 3, 8)), 0.1, step=1)
            results.append(table.read_rows(np.arange(50)))
    np.testing.assert_array_equal(results[0].view(np.uint32), results[1].view(np.uint32))
    size = np.asarray(ej.lazy_adam().step_size(0.1, 1))
    z = np.zeros_like(weight)
    expected, _, _ = testing.lazy_adam_reference(
        weight, z, z, np.asarray(ids), np.asarray(grads), 0.1, 1, step_size=size
    )
    np.testing.assert_array_equal(results[0].view(np.uint32), expected.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
def test_gpu_updates_on_streams(placement, gpu_device):
    """Updates on XLA streams 1 and 2 (one token taken by a lookup, one by nothing) write
    what the plain update writes, and the lookup after the first sees it."""
    rng = np.random.default_rng(4)
    weight = _weight(5000, 64, BF16)
    ids = rng.integers(-3, 5003, (512, 12)).astype(np.int32)
    grads = _weight(512 * 12, 64, BF16, seed=2).reshape(512, 12, 64)
    with ej.TrainableTable.from_array(
        weight, optimizer=ej.sgd(), placement=placement, device=gpu_device
    ) as table:
        rows, _ = _updates_on_streams(table, ids, grads, gpu_device)
        got = table.read_rows(np.arange(5000))
    once = testing.sgd_reference(weight, ids, grads, 0.5)
    twice = testing.sgd_reference(once, ids, grads, 0.25)
    np.testing.assert_array_equal(rows, testing.trainable_lookup_reference(once, ids))
    np.testing.assert_array_equal(got, twice)


def _check_updates_of_slices(placement, device=None):
    """Updates whose ids and gradients are slices of stacked arrays (a scan's steps, and
    ids[k] unrolled in one program) write each batch once: the reference of the batches
    in turn. On CUDA, XLA's dynamic-slice fusion once left a copy of such a call in
    place beside the fused one, so every batch was applied twice."""
    rng = np.random.default_rng(21)
    weight = _weight(3000, 64, BF16)
    ids = rng.integers(-2, 3000, (4, 512, 2)).astype(np.int32)
    ids[:, :40, 0] = np.arange(40)  # rows every batch touches
    grads = _weight(4 * 512 * 2, 64, BF16, seed=3).reshape(4, 512, 2, 64)
    put = (lambda x: jax.device_put(x, device)) if device is not None else jnp.asarray
    w, acc = weight, np.zeros(3000, np.float32)
    for k in range(4):
        w, acc = testing.row_adagrad_reference(w, acc, ids[k], grads[k], 0.1)

    def scanned(table, i, g):
        def body(token, xs):
            return ej.apply_gradients(table, xs[0], xs[1], 0.1, after=token), None

        return jax.lax.scan(body, jnp.zeros((), jnp.int32), (i, g))[0]

    def unrolled(table, i, g):
        token = None
        for k in range(4):
            token = ej.apply_gradients(table, i[k], g[k], 0.1, after=token)
        return token

    for program in (scanned, unrolled):
        with ej.TrainableTable.from_array(
            weight, optimizer=ej.row_adagrad(), placement=placement, device=device
        ) as table:
            jax.block_until_ready(jax.jit(functools.partial(program, table))(put(ids), put(grads)))
            got = table.read_rows(np.arange(3000))
            np.testing.assert_array_equal(got.view(np.uint16), w.view(np.uint16), program.__name__)


def test_updates_of_slices_apply_each_batch_once():
    _check_updates_of_slices("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
def test_gpu_updates_of_slices_apply_each_batch_once(placement, gpu_device):
    _check_updates_of_slices(placement, gpu_device)
