"""The update in the background: apply_gradients_start / apply_gradients_done write
what apply_gradients writes, bit for bit, for every optimizer, under jit, vmap and
scan, with the handle handed from one jitted step to the next, eagerly and for no
ids; a lookup ordered after done's token, and a gather queued behind the started
update (lookup_start's after=handle), see the new rows; the refusals. CPU (the
start updates at once there); on CUDA (marked gpu) the update runs on the side
stream, from ids and gradients that are slices and fusions XLA may reuse at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import engram_jax as ej

BF16 = np.dtype(ml_dtypes.bfloat16)
OPTIMIZERS = {
    "sgd": ej.sgd,
    "adagrad": ej.adagrad,
    "row_adagrad": ej.row_adagrad,
    "lazy_adam_f32": lambda: ej.lazy_adam(moment_dtype=np.float32),
    "lazy_adam_bf16": lambda: ej.lazy_adam(moment_dtype=BF16),
}


# Tests not marked gpu run on the CPU whatever jax sees (conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu")


def _weight(rows, dim, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, dim)).astype(np.float32).astype(dtype)


def _twins(weight, optimizer, **placement):
    """Two tables with the same rows and state: one for the background update, one
    for apply_gradients."""
    return (
        ej.TrainableTable.from_array(weight, optimizer=OPTIMIZERS[optimizer](), **placement),
        ej.TrainableTable.from_array(weight, optimizer=OPTIMIZERS[optimizer](), **placement),
    )


def _assert_same_table(a, b, num_rows):
    rows = np.arange(num_rows)
    np.testing.assert_array_equal(
        a.read_rows(rows).view(np.uint8), b.read_rows(rows).view(np.uint8)
    )
    for name, state in a.state().items():
        np.testing.assert_array_equal(state.view(np.uint8), b.state()[name].view(np.uint8))


def _steps(background, plain, max_ctas=None):
    """Two jitted steps of two updates each (the second ordered after the first), that
    return the rows a lookup after the last update reads: one with start/done, one with
    apply_gradients. The ids and gradients are slices and fusions of the inputs."""

    @jax.jit
    def with_start(ids, grads, lr, step):
        ids, grads = ids[1:] % 1000, grads[1:] * 2
        first = ej.apply_gradients_start(background, ids, grads, lr, step, max_ctas=max_ctas)
        x = jnp.tanh(grads.astype(jnp.float32) * 3)  # work beside it, in new buffers
        token = ej.apply_gradients_done(first)
        second = ej.apply_gradients_start(
            background, ids[::-1], x.astype(grads.dtype), lr, step + 1, after=token,
            max_ctas=max_ctas,
        )  # fmt: skip
        return ej.lookup(background, ids, after=ej.apply_gradients_done(second))

    @jax.jit
    def without(ids, grads, lr, step):
        ids, grads = ids[1:] % 1000, grads[1:] * 2
        token = ej.apply_gradients(plain, ids, grads, lr, step)
        x = jnp.tanh(grads.astype(jnp.float32) * 3)
        token = ej.apply_gradients(
            plain, ids[::-1], x.astype(grads.dtype), lr, step + 1, after=token
        )
        return ej.lookup(plain, ids, after=token)

    return with_start, without


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_start_done_write_what_apply_gradients_writes(optimizer, dtype):
    rng = np.random.default_rng(1)
    weight = _weight(40, 24, dtype)
    ids = rng.integers(-3, 44, (17, 5)).astype(np.int32)  # repeats, dead, past the end
    grads = _weight(17 * 5, 24, dtype, seed=2).reshape(17, 5, 24)
    background, plain = _twins(weight, optimizer)
    with background, plain:
        with_start, without = _steps(background, plain)
        got = with_start(ids, grads, jnp.float32(0.05), 1)
        want = without(ids, grads, jnp.float32(0.05), 1)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
        )
        _assert_same_table(background, plain, 40)
        assert not np.array_equal(background.read_rows(np.arange(40)), weight)


def test_a_step_hands_its_update_to_the_next():
    """A step starts its update and returns the handle; the next step finishes it and
    reads the rows after it. One compiled step for every call (the tag)."""
    weight = _weight(30, 8)
    background, plain = _twins(weight, "row_adagrad")
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, 30, (6, 3)).astype(np.int32) for _ in range(4)]
    with background, plain:

        @jax.jit
        def step(handle, ids):
            rows = ej.lookup(background, ids, after=ej.apply_gradients_done(handle))
            grads = rows * rows
            return ej.apply_gradients_start(background, ids, grads, 0.1, tag="next"), rows

        handle = ej.apply_gradients_start(
            background, batches[0][:0], np.zeros((0, 3, 8), np.float32), 0.1
        )
        assert not handle.pending  # no ids: nothing to wait for
        first = jax.jit(
            lambda i: ej.apply_gradients_start(
                background, i, jnp.zeros((6, 3, 8), jnp.float32), 0.1, tag="next"
            )
        )(batches[0])
        got = []
        handle = first
        for ids in batches:
            handle, rows = step(handle, ids)
            got.append(np.asarray(rows))
        jax.block_until_ready(jax.jit(ej.apply_gradients_done)(handle))
        assert step._cache_size() == 1
        for ids, rows in zip(batches, got, strict=True):
            want = ej.lookup(plain, ids)
            np.testing.assert_array_equal(rows, want)
            ej.apply_gradients(plain, ids, want * want, 0.1)
        _assert_same_table(background, plain, 30)


def test_vmap_scan_and_eager_updates():
    weight = _weight(20, 4)
    ids = np.array([[1, 2], [2, 2], [19, -1]], np.int32)
    grads = _weight(6, 4, seed=3).reshape(3, 2, 4)
    background, plain = _twins(weight, "adagrad")
    with background, plain:

        def one(i, g):
            return ej.apply_gradients_done(ej.apply_gradients_start(background, i, g, 0.5))

        tokens = jax.jit(jax.vmap(one))(ids, grads)
        assert tokens.shape == (3,)  # vmap broadcasts the one token
        ej.apply_gradients(plain, ids, grads, 0.5)
        _assert_same_table(background, plain, 20)

        def body(carry, xs):
            i, g = xs
            token = ej.apply_gradients_done(
                ej.apply_gradients_start(background, i, g, 0.25, after=carry)
            )
            return token, ej.lookup(background, i, after=token)

        _, rows = jax.jit(lambda i, g: jax.lax.scan(body, jnp.zeros((), jnp.int32), (i, g)))(
            ids, grads
        )
        want = []
        for i, g in zip(ids, grads, strict=True):
            ej.apply_gradients(plain, i, g, 0.25)
            want.append(ej.lookup(plain, i))
        np.testing.assert_array_equal(rows, np.stack(want))
        eager = ej.apply_gradients_start(background, ids, grads, 1.0)  # updates at once
        assert not eager.pending
        assert int(ej.apply_gradients_done(eager)) == 0
        ej.apply_gradients(plain, ids, grads, 1.0)
        _assert_same_table(background, plain, 20)


def test_refusals_before_anything_compiles():
    weight = _weight(10, 4)
    ids, grads = np.array([1, 2], np.int32), np.ones((2, 4), np.float32)
    with ej.TrainableTable.from_array(weight, optimizer=ej.sgd()) as table:

        @jax.jit
        def pending(i, g):
            return ej.apply_gradients_start(table, i, g, 0.1)

        handle = pending(ids, grads)
        assert handle.pending
        with pytest.raises(ValueError, match="outside a traced computation"):
            ej.apply_gradients_done(handle)
        with pytest.raises(TypeError, match="apply_gradients_done"):
            jax.jit(lambda h: ej.lookup(table, ids, after=h))(handle)
        with pytest.raises(TypeError, match="apply_gradients_done"):
            jax.jit(lambda h: ej.apply_gradients(table, ids, grads, 0.1, after=h))(handle)
        with pytest.raises(TypeError, match="UpdateHandle"):
            ej.apply_gradients_done(jnp.zeros((), jnp.int32))
        with pytest.raises(ValueError, match="max_ctas"):
            ej.apply_gradients_start(table, ids, grads, 0.1, max_ctas=0)
        with pytest.raises(ValueError, match="shape"):
            ej.apply_gradients_start(table, ids, np.ones((2, 5), np.float32), 0.1)
        with pytest.raises(ValueError, match="scalar"):
            ej.apply_gradients_start(table, ids, grads, np.ones(2, np.float32))
        before = table.read_rows(np.arange(10))
    with pytest.raises(ValueError, match="closed"):
        ej.apply_gradients_start(table, ids, grads, 0.1)
    fp8 = ej.EngramTable.from_arrays(
        np.zeros((4, 32), ml_dtypes.float8_e4m3fn), np.full((4, 1), 127, np.uint8)
    )
    with fp8, pytest.raises(TypeError, match="TrainableTable"):
        ej.apply_gradients_start(fp8, ids, np.ones((2, 32), np.float32), 0.1)
    with fp8, pytest.raises(TypeError, match="only a trainable table's lookup_start"):
        jax.jit(lambda h: ej.lookup_start(fp8, ids, after=h))(handle)
    # One update (the pending start above ran at once on the CPU), nothing from the refusals.
    np.testing.assert_array_equal(before[3:], weight[3:])


def _check_gather_queued_behind_an_update(device, placement, num_rows, batch, max_ctas):
    """``lookup_start(after=handle)``: the gather queued behind a started update, its
    done before the update's, reads the updated rows; from traced ids and from ids the
    step holds as a constant (gathered on the side stream too, behind the update)."""
    rng = np.random.default_rng(11)
    weight = _weight(num_rows, 64, BF16)
    ids = jax.device_put(rng.integers(0, num_rows, (batch, 4)).astype(np.int32), device)
    constant = rng.integers(0, num_rows, (batch, 4)).astype(np.int32)
    constant[0, 0] = int(np.asarray(ids)[0, 0])  # a row the update writes
    grads = jax.device_put(_weight(batch * 4, 64, BF16, seed=12).reshape(batch, 4, 64), device)
    background, plain = _twins(weight, "lazy_adam_bf16", placement=placement, device=device)
    with background, plain:

        @jax.jit
        def queued(ids, grads):
            update = ej.apply_gradients_start(background, ids, grads, 0.5, 1, max_ctas=max_ctas)
            traced = ej.lookup_start(background, ids[::-1], after=update)
            fixed = ej.lookup_start(background, constant, after=(traced, update))
            rows = (ej.lookup_done(traced), ej.lookup_done(fixed))
            return rows, ej.apply_gradients_done(update)

        (got, got_constant), _ = queued(ids, grads)
        token = ej.apply_gradients(plain, ids, grads, 0.5, 1)
        want = ej.lookup(plain, ids[::-1], after=token)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
        )
        want = ej.lookup(plain, constant, after=token)
        np.testing.assert_array_equal(
            np.asarray(got_constant).view(np.uint8), np.asarray(want).view(np.uint8)
        )
        assert not np.array_equal(np.asarray(got_constant)[0, 0], weight[constant[0, 0]])
        _assert_same_table(background, plain, num_rows)


def test_a_gather_queued_behind_an_update_reads_its_rows():
    _check_gather_queued_behind_an_update(jax.devices("cpu")[0], "cpu", 50, 9, None)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
def test_gpu_a_gather_queued_behind_an_update_reads_its_rows(placement, gpu_device):
    """On one CTA the update of some 30,000 rows runs for milliseconds: a gather not
    queued behind it, or a done that did not wait for it, would read rows it has not
    written yet."""
    _check_gather_queued_behind_an_update(gpu_device, placement, 200_000, 8192, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
@pytest.mark.parametrize(
    "optimizer,dtype,max_ctas",
    [("row_adagrad", BF16, None), ("lazy_adam_bf16", BF16, 1), ("adagrad", np.float32, 3)],
)
def test_gpu_start_done_write_what_apply_gradients_writes(
    placement, optimizer, dtype, max_ctas, gpu_device
):
    """On the side stream, on a grid of 1 or 3 CTAs or the default, with hot rows (more
    than one warp's run) among scattered ones: the same bits as apply_gradients."""
    rng = np.random.default_rng(7)
    weight = _weight(5000, 64, dtype)
    ids = rng.integers(-3, 1003, (513, 24)).astype(np.int32)
    ids[::2, :4] = 17  # a run of about a thousand ids of one row
    grads = _weight(513 * 24, 64, dtype, seed=8).reshape(513, 24, 64)
    background, plain = _twins(weight, optimizer, placement=placement, device=gpu_device)
    with background, plain:
        with_start, without = _steps(background, plain, max_ctas)
        args = jax.device_put((ids, grads, jnp.float32(0.01), jnp.int32(3)), gpu_device)
        for _ in range(2):  # the second run restages a site whose staging exists
            got = with_start(*args)
            want = without(*args)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
        )
        _assert_same_table(background, plain, 5000)


@pytest.mark.gpu
def test_gpu_handles_across_steps_and_a_dropped_start(gpu_device):
    """The handle of one jitted step finished by the next (tagged); a start whose handle
    is dropped is still written before its site's next start restages. The dropped
    starts share the steps' tag, so the next step's done waits for their updates too:
    with a slot of their own nothing would order that step's lookup after them, and
    under compute-sanitizer's slower device it read rows without the second one."""
    weight = _weight(3000, 32, BF16)
    background, plain = _twins(weight, "sgd", placement="pinned", device=gpu_device)
    rng = np.random.default_rng(9)
    batches = [
        jax.device_put(rng.integers(0, 3000, (256, 8)).astype(np.int32), gpu_device)
        for _ in range(5)
    ]
    with background, plain:

        @jax.jit
        def step(handle, ids):
            rows = ej.lookup(background, ids, after=ej.apply_gradients_done(handle))
            grads = (rows.astype(jnp.float32) * 0.5).astype(rows.dtype)
            return ej.apply_gradients_start(background, ids, grads, 0.1, tag="gpu next"), rows

        @jax.jit
        def dropped(ids):
            ones = jnp.ones(ids.shape + (32,), BF16)
            ej.apply_gradients_start(background, ids, ones, 0.1, tag="gpu next")
            return ids.sum()

        handle = jax.jit(
            lambda i: ej.apply_gradients_start(
                background, i, jnp.zeros(i.shape + (32,), BF16), 0.1, tag="gpu next"
            )
        )(batches[0])
        got = []
        for k, ids in enumerate(batches):
            handle, rows = step(handle, ids)
            got.append(np.asarray(rows))
            if k == 1:
                dropped(ids)
                dropped(ids)  # its site restages after the first one's update
        jax.block_until_ready(jax.jit(ej.apply_gradients_done)(handle))
        for k, (ids, rows) in enumerate(zip(batches, got, strict=True)):
            want = ej.lookup(plain, ids)
            np.testing.assert_array_equal(rows, want)
            ej.apply_gradients(plain, ids, (want.astype(np.float32) * 0.5).astype(BF16), 0.1)
            if k == 1:
                for _ in range(2):
                    ej.apply_gradients(plain, ids, np.ones(ids.shape + (32,), BF16), 0.1)
        _assert_same_table(background, plain, 3000)
