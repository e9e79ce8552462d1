"""The row optimizers of apply_gradients against their numpy references (bit for
bit) and, for SGD and Adagrad, against optax's dense update of the same table
held as a jnp array: SGD bit for bit in float32; Adagrad to 1e-6 absolute and
relative on unit-scale rows (XLA's rsqrt is not always the correctly rounded
1/sqrt the kernels use); bfloat16 tables within bfloat16 rounding (the kernels round once,
optax's bf16 math rounds the update, then the sum). Rows seen up to thousands
of times in a batch follow the chunked order of the gradient sum, the same bits
on every backend. On the CPU; the same checks marked gpu for pinned and device tables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engram_jax as ej
from engram_jax import testing

BF16 = np.dtype(ml_dtypes.bfloat16)
ROWS, ROW_START = 29, 100


# Tests not marked gpu run on the CPU whatever jax sees (conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_unless_gpu")


def _weight(rng, dim, dtype):
    return rng.normal(size=(ROWS, dim)).astype(np.float32).astype(dtype)


def _batch(rng, shape, dim, grad_dtype=np.float32):
    # Ids with repeats, DEAD, negative and out-of-range ones.
    ids = rng.integers(ROW_START - 3, ROW_START + ROWS + 3, shape).astype(np.int32)
    ids.reshape(-1)[:: max(1, ids.size // 5)] = ROW_START + 2  # a row seen many times
    ids.reshape(-1)[1] = -1
    grads = rng.normal(size=shape + (dim,)).astype(np.float32).astype(grad_dtype)
    return ids, grads


@jax.jit
def _update(table, ids, grads, lr, step):
    return ej.apply_gradients(table, ids, grads, lr, step=step)


def _apply(table, ids, grads, lr, step=None, device=None):
    if device is not None:
        ids, grads = jax.device_put(ids, device), jax.device_put(grads, device)
    jax.block_until_ready(_update(table, ids, grads, np.float32(lr), step))


def _weight_of(table):
    return table.read_rows(np.arange(ROW_START, ROW_START + ROWS))


def _bits_equal(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    width = {4: np.uint32, 2: np.uint16}[actual.dtype.itemsize]
    diff = np.flatnonzero(actual.view(width) != expected.view(width))
    assert diff.size == 0, f"{diff.size} values differ, first at {diff[:5]}"


def _reference_step(opt, weight, state, ids, grads, lr, step):
    """(weight, state) after one update by the numpy reference of ``opt``."""
    kw = {"row_start": ROW_START}
    if opt.name == "sgd":
        return testing.sgd_reference(weight, ids, grads, lr, **kw), {}
    if opt.name == "adagrad":
        w, acc = testing.adagrad_reference(
            weight, state["sum_of_squares"], ids, grads, lr, eps=opt.eps, **kw
        )
        return w, {"sum_of_squares": acc}
    if opt.name == "row_adagrad":
        w, acc = testing.row_adagrad_reference(
            weight, state["accumulator"], ids, grads, lr, eps=opt.eps, **kw
        )
        return w, {"accumulator": acc}
    size = np.asarray(opt.step_size(lr, step))  # the library's float32 step size
    w, m, v = testing.lazy_adam_reference(
        weight,
        state["exp_avg"],
        state["exp_avg_sq"],
        ids,
        grads,
        lr,
        step,
        b1=opt.b1,
        b2=opt.b2,
        eps=opt.eps,
        step_size=size,
        **kw,
    )
    return w, {"exp_avg": m, "exp_avg_sq": v}


OPTIMIZERS = [
    ej.sgd(),
    ej.adagrad(),
    ej.row_adagrad(initial_accumulator_value=0.01),
    ej.lazy_adam(),
    ej.lazy_adam(b1=0.8, b2=0.99, eps=1e-6, moment_dtype=jnp.bfloat16),
]


def _steps_against_reference(opt, dtype, dim, seed, batch, steps, lr, placement, device):
    """``steps`` updates of one table, each of ``batch(rng)``'s ids and gradients at
    ``lr * step``, every row and state array compared bitwise with the reference's
    after each (the state carries from step to step)."""
    rng = np.random.default_rng(seed)
    weight = _weight(rng, dim, dtype)
    with ej.TrainableTable.from_array(
        weight, optimizer=opt, placement=placement, row_start=ROW_START, device=device
    ) as table:
        state = table.state()
        for step in range(1, steps + 1):
            ids, grads = batch(rng)
            _apply(table, ids, grads, lr * step, step, device)
            weight, state = _reference_step(opt, weight, state, ids, grads, lr * step, step)
            _bits_equal(_weight_of(table), weight)
            got = table.state()
            assert sorted(got) == sorted(state)
            for name in state:
                _bits_equal(got[name], state[name])


def _check_against_reference(opt, dtype, dim, grad_dtype, placement="cpu", device=None):
    def batch(rng):
        return _batch(rng, (6, 5), dim, grad_dtype)

    _steps_against_reference(opt, dtype, dim, dim * 7 + opt.code, batch, 3, 0.05, placement, device)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o.name}-{o.moment_dtype}")
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [8, 40])
def test_matches_reference_bitwise(opt, dtype, dim):
    _check_against_reference(opt, dtype, dim, np.float32)


@pytest.mark.parametrize("opt", [ej.sgd(), ej.row_adagrad()], ids=lambda o: o.name)
def test_bf16_gradients_match_reference(opt):
    _check_against_reference(opt, np.float32, 33, BF16)


def _dense_optax(tx, weight, ids, grads, lr_steps):
    """optax's dense update of the whole table as a jnp array: the gradient of
    ``take(weight, ids)`` is a scatter-add into zeros (dead ids dropped)."""
    params = jnp.asarray(weight)
    state = tx.init(params)
    for lr, i, g in zip(lr_steps, ids - ROW_START, grads, strict=True):
        i = np.where((i >= 0) & (i < ROWS), i, ROWS)  # ROWS: out of bounds, dropped
        dense = jnp.zeros(params.shape, jnp.float32).at[i].add(g, mode="drop")
        state.hyperparams["learning_rate"] = jnp.float32(lr)
        updates, state = tx.update(dense.astype(params.dtype), state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(params)


def _optax_case(name, dtype):
    rng = np.random.default_rng(11)
    dim = 24
    weight = _weight(rng, dim, dtype)
    batches = [_batch(rng, (4, 6), dim) for _ in range(3)]
    ids = np.stack([b[0] for b in batches])
    grads = np.stack([b[1] for b in batches])
    lrs = [0.1, 0.05, 0.2]
    if name == "sgd":
        opt, tx = ej.sgd(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    else:
        opt = ej.adagrad(initial_accumulator_value=0.1, eps=1e-7)
        tx = optax.inject_hyperparams(optax.adagrad)(
            learning_rate=0.1, initial_accumulator_value=0.1, eps=1e-7
        )
    expected = _dense_optax(tx, weight, ids, grads, lrs)
    with ej.TrainableTable.from_array(
        weight, optimizer=opt, placement="cpu", row_start=ROW_START
    ) as table:
        for k in range(3):
            _apply(table, ids[k], grads[k], lrs[k])
        return _weight_of(table), expected


def test_sgd_equals_optax_bitwise():
    got, expected = _optax_case("sgd", np.float32)
    _bits_equal(got, expected)


def test_adagrad_equals_optax_within_float32_rounding():
    # Rows of unit scale, updates of 0.05-0.2: 1e-6 is about 8 float32 ulps of 1.0.
    got, expected = _optax_case("adagrad", np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert (got != expected).mean() < 0.2  # most values are the same bits


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_bf16_table_within_bf16_rounding_of_optax(name):
    # One bfloat16 ulp relative (2**-7), 2**-8 absolute for values that cancel to ~0.
    got, expected = _optax_case(name, BF16)
    np.testing.assert_allclose(
        got.astype(np.float32), expected.astype(np.float32), rtol=2**-7, atol=2**-8
    )


def test_lazy_adam_matches_its_own_float64_step_size():
    # The reference computes torch's bias-corrected step size in float64; the library
    # computes it in float32 with jnp: the rows agree to float32 rounding.
    rng = np.random.default_rng(5)
    opt = ej.lazy_adam()
    weight = _weight(rng, 16, np.float32)
    m = np.zeros_like(weight)
    v = np.zeros_like(weight)
    with ej.TrainableTable.from_array(weight, optimizer=opt, row_start=ROW_START) as table:
        for step in (1, 2, 10):
            ids, grads = _batch(rng, (5, 3), 16)
            _apply(table, ids, grads, 1e-2, step)
            weight, m, v = testing.lazy_adam_reference(
                weight, m, v, ids, grads, 1e-2, step, row_start=ROW_START
            )
        np.testing.assert_allclose(_weight_of(table), weight, rtol=1e-6, atol=1e-6)


def test_lazy_adam_step_size_is_the_same_bits_traced_and_constant():
    # XLA folds a power of constants with its own pow, which rounds otherwise than the
    # compiled one (step 3 differed at every learning rate before the barrier in
    # step_size); a Python step in an unrolled loop must update the bits a traced
    # step does.
    opt = ej.lazy_adam()
    traced = jax.jit(lambda lr, step: opt.step_size(lr, step))
    for lr in (1e-2, 1e-4):
        for step in range(1, 25):
            constant = jax.jit(lambda: opt.step_size(lr, step))()  # noqa: B023 (called at once)
            want = np.asarray(traced(np.float32(lr), np.int32(step))).view(np.int32)
            eager = opt.step_size(np.float32(lr), np.int32(step))
            assert np.asarray(constant).view(np.int32) == want, (lr, step)
            assert np.asarray(eager).view(np.int32) == want, (lr, step)


def test_lazy_adam_moves_only_rows_with_gradients():
    rng = np.random.default_rng(6)
    weight = _weight(rng, 8, np.float32)
    with ej.TrainableTable.from_array(weight, optimizer=ej.lazy_adam()) as table:
        ids = np.array([[3, 3, 7]], np.int32)
        _apply(table, ids, rng.normal(size=(1, 3, 8)).astype(np.float32), 0.1, 1)
        after = table.read_rows(np.arange(ROWS))
        moved = np.flatnonzero((after != weight).any(axis=1))
        assert moved.tolist() == [3, 7]
        state = table.state()
        assert np.flatnonzero(state["exp_avg"].any(axis=1)).tolist() == [3, 7]


# -- hot rows: the chunked order of a long run's sum ---------------------------------

# Entries per row in one batch: one, a chunk (64), a chunk and one, two chunks
# exactly, several chunks with a partial last one, and far past it (on CUDA a
# run longer than a chunk has its full chunks summed a warp each and folded).
RUNS = (1, 64, 65, 128, 200, 256, 257, 3000)


def _hot_batch(rng, dim, grad_dtype=np.float32):
    """Rows ROW_START + r seen RUNS[r] times, among rows seen a few times and ids the
    table does not hold, shuffled; gradients over six decades of magnitude, whose
    float32 sums depend on the order they are taken in."""
    hot = [np.full(n, ROW_START + r, np.int32) for r, n in enumerate(RUNS)]
    cold = rng.integers(ROW_START + len(RUNS), ROW_START + ROWS + 3, 300).astype(np.int32)
    dead = rng.integers(ROW_START - 3, ROW_START, 40).astype(np.int32)
    ids = rng.permutation(np.concatenate(hot + [cold, dead, np.full(10, -1, np.int32)]))
    scale = 10.0 ** rng.uniform(-3, 3, (ids.size, 1))
    grads = (rng.normal(size=(ids.size, dim)) * scale).astype(np.float32).astype(grad_dtype)
    return ids, grads


def _check_hot_rows(opt, dtype, dim, grad_dtype, placement="cpu", device=None):
    def batch(rng):
        return _hot_batch(rng, dim, grad_dtype)

    _steps_against_reference(
        opt, dtype, dim, dim * 11 + opt.code, batch, 2, 1e-3, placement, device
    )


def test_reference_chunk_is_the_kernels():
    from engram_jax import _native

    assert testing.GRAD_CHUNK == _native.native.gradient_chunk == 64


def test_chunk_size_decides_the_bits():
    # SGD with lr = -1 on a zero table writes each row's summed gradient exactly
    # (0 + 1 * g): the CPU handler's sums are the reference's with chunks of 64, and
    # of no other size, on the rows seen more than 65 times; rows seen at most 65
    # times get the plain position-order sum (one chunk, or one plus one entry).
    rng = np.random.default_rng(3)
    ids, grads = _hot_batch(rng, 40)
    with ej.TrainableTable.from_array(
        np.zeros((ROWS, 40), np.float32), optimizer=ej.sgd(), row_start=ROW_START
    ) as table:
        _apply(table, ids, grads, -1.0)
        got = _weight_of(table)

    def sums(chunk):
        rows, g = testing.summed_gradients(ids, grads, ROW_START, ROWS, chunk=chunk)
        out = np.zeros((ROWS, 40), np.float32)
        out[rows] = g
        return out

    _bits_equal(got, sums(testing.GRAD_CHUNK))
    short = [r for r, n in enumerate(RUNS) if n <= 65]
    _bits_equal(got[short], sums(ids.size)[short])
    for chunk in (32, 63, 65, 128, ids.size):
        other = sums(chunk)[len(short) : len(RUNS)]
        assert (other.view(np.uint32) != got[len(short) : len(RUNS)].view(np.uint32)).any(), chunk


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o.name}-{o.moment_dtype}")
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [40, 256])
def test_hot_rows_match_reference_bitwise(opt, dtype, dim):
    _check_hot_rows(opt, dtype, dim, np.float32)


@pytest.mark.parametrize("opt", [ej.sgd(), ej.row_adagrad()], ids=lambda o: o.name)
def test_hot_rows_bf16_gradients_match_reference(opt):
    _check_hot_rows(opt, np.float32, 40, BF16)


@settings(max_examples=20, deadline=None)
@given(
    ids=st.lists(st.integers(ROW_START - 4, ROW_START + ROWS + 4) | st.just(-1), max_size=40),
    opt_index=st.sampled_from([0, 2, 3]),
)
def test_any_id_pattern_matches_reference(ids, opt_index):
    opt = OPTIMIZERS[opt_index]
    rng = np.random.default_rng(len(ids))
    ids = np.asarray(ids, np.int32).reshape(-1)
    grads = rng.normal(size=(ids.size, 8)).astype(np.float32)
    weight = _weight(rng, 8, np.float32)
    with jax.default_device(jax.devices("cpu")[0]):
        with ej.TrainableTable.from_array(weight, optimizer=opt, row_start=ROW_START) as table:
            state = table.state()
            _apply(table, ids, grads, 0.3, 1)
            weight, state = _reference_step(opt, weight, state, ids, grads, 0.3, 1)
            _bits_equal(_weight_of(table), weight)
            for name in state:
                _bits_equal(table.state()[name], state[name])


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o.name}-{o.moment_dtype}")
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [40, 264])
def test_matches_reference_bitwise_gpu(placement, opt, dtype, dim, gpu_device):
    # The same bits as the CPU: the kernels round every operation as the references do.
    # Both dims take the 16-byte loads and stores; 264 two tiles of 256 values, the second partial.
    _check_against_reference(opt, dtype, dim, np.float32, placement, gpu_device)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: f"{o.name}-{o.moment_dtype}")
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("grad_dtype", [np.float32, BF16], ids=["f32-grads", "bf16-grads"])
@pytest.mark.parametrize("dim", [33, 40, 256, 264, 300])
def test_hot_rows_match_reference_bitwise_gpu(placement, opt, dtype, grad_dtype, dim, gpu_device):
    # Runs past a chunk have their full chunks summed a warp each and folded,
    # shorter ones are summed by their row's warp; 40, 256 and 264 take 16-byte
    # loads (rows and state too on the warp path), 33 and 300 single ones; 264
    # and 300 a second, partial tile of 256 values.
    _check_hot_rows(opt, dtype, dim, grad_dtype, placement, gpu_device)


def _check_summed_rows(table, update, ids, grads, rows, device):
    """``update`` (SGD at lr -1) of the ``rows``-row float32 table zeroed first: each
    row then holds its summed gradient, which must be the reference's bit for bit."""
    dim = grads.shape[-1]
    table.write_rows(0, np.zeros((rows, dim), np.float32))
    jax.block_until_ready(update(jax.device_put(ids, device), jax.device_put(grads, device)))
    touched, sums = testing.summed_gradients(ids, grads, ROW_START, rows)
    expected = np.zeros((rows, dim), np.float32)
    expected[touched] = sums
    _bits_equal(table.read_rows(np.arange(ROW_START, ROW_START + rows)), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
@pytest.mark.parametrize("dim", [33, 256, 264])
def test_gpu_chunk_sums_wherever_a_run_falls(placement, dim, gpu_device):
    # The CUDA update sums a full chunk in the window of 64 sorted entries its first
    # entry falls in, finds the start of a run that began in an earlier window, and
    # folds a run's chunk sums. Runs of 64 to 200 entries at sorted offsets around the
    # windows' edges, each followed by a run of 130, padded with dead ids to one shape:
    # SGD at lr -1 on a zero table writes each row's summed gradient, which must be the
    # reference's bit for bit (gradients over six decades, so any other order shows).
    rng = np.random.default_rng(dim)
    size = 512
    with ej.TrainableTable.from_array(
        np.zeros((ROWS, dim), np.float32), optimizer=ej.sgd(), placement=placement,
        row_start=ROW_START, device=gpu_device,
    ) as table:  # fmt: skip
        update = jax.jit(lambda ids, grads: ej.apply_gradients(table, ids, grads, np.float32(-1)))
        for offset in (0, 1, 31, 32, 63, 64, 65, 127):
            for length in (64, 65, 127, 128, 129, 192, 200):
                ids = np.concatenate([
                    ROW_START + rng.integers(0, 18, offset),  # rows that sort before the runs
                    np.full(length, ROW_START + 20),
                    np.full(130, ROW_START + 21),
                ])  # fmt: skip
                ids = np.concatenate([ids, np.full(size - ids.size, -1)]).astype(np.int32)
                ids = ids[rng.permutation(size)]
                scale = 10.0 ** rng.uniform(-3, 3, (size, 1))
                grads = (rng.normal(size=(size, dim)) * scale).astype(np.float32)
                _check_summed_rows(table, update, ids, grads, ROWS, gpu_device)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
def test_gpu_batches_of_every_size_sum_like_the_reference(placement, gpu_device):
    # The other GPU tests' batches are small; the sort (one chunk up to 2048 ids, CUB's
    # one tile up to 4864, chunks and their merge up to 2^15, CUB's passes beyond), the
    # run list and the chunk sums must hold up to tens of thousands of ids: hot rows
    # among thousands seen once or twice, and dead ids, whose key on a table of
    # 2^12 - 1 rows is the chunk sort's padding key. SGD at lr -1 on a zero table
    # writes each row's summed gradient, which must be the reference's bit for bit.
    rng = np.random.default_rng(14)
    rows, dim = 4095, 40
    with ej.TrainableTable.from_array(
        np.zeros((rows, dim), np.float32), optimizer=ej.sgd(), placement=placement,
        row_start=ROW_START, device=gpu_device,
    ) as table:  # fmt: skip
        update = jax.jit(lambda ids, grads: ej.apply_gradients(table, ids, grads, np.float32(-1)))
        for size in (1, 2047, 2048, 2049, 4865, 16385, 2**15, 2**15 + 1, 3 * 2**14 + 7):
            ids = rng.integers(ROW_START - 3, ROW_START + rows + 3, size)
            hot = rng.random(size) < 0.3
            ids[hot] = ROW_START + rng.integers(0, 4, hot.sum())  # four hot rows
            ids[::11] = -1
            ids = ids.astype(np.int32)
            scale = 10.0 ** rng.uniform(-3, 3, (size, 1))
            grads = (rng.normal(size=(size, dim)) * scale).astype(np.float32)
            _check_summed_rows(table, update, ids, grads, rows, gpu_device)
