"""The Engram fusion layer against its plain-jnp reference: hyper-connection
copies, dtypes, token masks, the short convolution (whole and chunked),
hand-computed gate values, DeepSeek checkpoint conversion, and the layer fed
by a real lookup under jit.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engram_jax as ej
from engram_jax import layer, testing

from ._helpers import random_table_arrays


def make_case(
    seed, *, hc=1, width=48, n_cols=3, dim=32, lead=(2, 7), dtype=jnp.float32, conv=0, dilation=3
):
    config = layer.EngramLayerConfig(
        hidden_size=width,
        engram_dim=n_cols * dim,
        hc_mult=hc,
        conv_kernel=conv,
        conv_dilation=dilation,
    )
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    params = layer.init_engram_params(keys[0], config, dtype=dtype)
    # Gains away from 1 so a swapped or dropped gain shows.
    params = params._replace(
        q_weight=(1 + 0.5 * jax.random.normal(keys[1], params.q_weight.shape)).astype(dtype),
        k_weight=(1 + 0.5 * jax.random.normal(keys[2], params.k_weight.shape)).astype(dtype),
    )
    if conv:
        params = params._replace(
            conv_norm=(1 + 0.5 * jax.random.normal(keys[5], params.conv_norm.shape)).astype(dtype)
        )
    tail = (hc, width) if hc > 1 else (width,)
    hidden = jax.random.normal(keys[3], (*lead, *tail), jnp.float32).astype(dtype)
    rows = jax.random.normal(keys[4], (*lead, n_cols, dim), jnp.float32).astype(jnp.bfloat16)
    return config, params, hidden, rows


@pytest.fixture(autouse=True)
def exact_matmuls():
    """float32 matmuls at full precision on every backend (GPUs default to TF32), so the
    float32 tolerances below mean the same on a GPU machine as on the CPU."""
    with jax.default_matmul_precision("highest"):
        yield


# Jitted once per shape: eager dispatch of the reference's many small ops is what is slow here.
layer_fn = jax.jit(layer.engram_layer, static_argnames="config")
reference_fn = jax.jit(testing.engram_layer_reference, static_argnames="config")


def tolerance(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("hc", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("conv", [0, 4])
def test_matches_reference(hc, dtype, conv):
    """The layer (jitted) against the reference, with and without convolution, masked tokens."""
    config, params, hidden, rows = make_case(hc * 10 + conv, hc=hc, dtype=dtype, conv=conv)
    mask = jnp.asarray(np.random.default_rng(hc).random(hidden.shape[:2]) < 0.6)
    out = layer_fn(params, hidden, rows, mask, config=config)
    want = reference_fn(params, hidden, rows, mask, config=config)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want, np.float32), **tolerance(dtype)
    )
    # The update is not negligible: the test would see a layer that did nothing.
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - hidden.astype(jnp.float32)))) > 0.05


@pytest.mark.parametrize("hc", [1, 3])
def test_masked_tokens_pass_through_unchanged(hc):
    config, params, hidden, rows = make_case(7, hc=hc, dtype=jnp.bfloat16)
    mask = jnp.array([[True, False, True, False, False, True, True]] * 2)
    out = layer_fn(params, hidden, rows, mask, config=config)
    out, hidden = np.asarray(out), np.asarray(hidden)
    np.testing.assert_array_equal(out[~np.asarray(mask)], hidden[~np.asarray(mask)])
    assert not np.array_equal(out[np.asarray(mask)], hidden[np.asarray(mask)])


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gate_value_by_hand(sign):
    """Key equal to +-h: the scaled dot is +-sqrt(H), so the gate is sigmoid(+-H**0.25)."""
    width = 16
    config = layer.EngramLayerConfig(hidden_size=width, engram_dim=width, norm_eps=1e-12)
    eye = np.eye(width, dtype=np.float32)
    value_map = np.roll(eye, 1, axis=1) * 0.5
    params = layer.EngramParams(
        wkv=jnp.asarray(np.concatenate([sign * eye, value_map], axis=1)),
        q_weight=jnp.ones((1, width)),
        k_weight=jnp.ones((1, width)),
    )
    h = np.random.default_rng(0).normal(size=(3, width)).astype(np.float32)
    rows = jnp.asarray(h.reshape(3, 1, width)).astype(jnp.bfloat16)
    h_in = np.asarray(rows, np.float32).reshape(3, width)
    out = layer.engram_layer(params, jnp.asarray(h_in), rows, config=config)
    gate = 1 / (1 + np.exp(-sign * width**0.25))
    want = h_in + gate * (h_in @ value_map)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_zero_dot_gate_keeps_sign_of_zero():
    """A zero score gives sigmoid(+1e-3), as copysign does (DeepSeek V4.1), not sigmoid(0)."""
    width = 8
    config = layer.EngramLayerConfig(hidden_size=width, engram_dim=32)
    params = layer.EngramParams(
        wkv=jnp.concatenate([jnp.zeros((32, width)), jnp.eye(32, width)], axis=1),
        q_weight=jnp.ones((1, width)),
        k_weight=jnp.ones((1, width)),
    )
    rows = jnp.ones((1, 1, 32), jnp.bfloat16)
    hidden = jnp.ones((1, width))
    out = layer.engram_layer(params, hidden, rows, config=config)
    gate = 1 / (1 + np.exp(-np.sqrt(1e-6)))
    np.testing.assert_allclose(np.asarray(out), 1 + gate * np.ones((1, width)), rtol=1e-6)


@pytest.mark.parametrize(
    "hc, chunks", [(1, (9,)), (2, (4, 1, 4)), (1, (1,) * 9), (2, (2, 7)), (3, (5, 4))]
)
def test_step_in_chunks_equals_whole(hc, chunks):
    config, params, hidden, rows = make_case(3, hc=hc, lead=(2, 9), conv=3, dilation=2)
    mask = jnp.asarray(np.random.default_rng(1).random((2, 9)) < 0.8)
    whole = layer_fn(params, hidden, rows, mask, config=config)
    state = layer.init_conv_state(config, (2,))
    step = jax.jit(lambda p, h, r, s, m: layer.engram_layer_step(p, h, r, s, m, config=config))
    pieces, start = [], 0
    for size in chunks:
        part = slice(start, start + size)
        out, state = step(params, hidden[:, part], rows[:, part], state, mask[:, part])
        pieces.append(out)
        start += size
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(pieces, axis=1)), np.asarray(whole), rtol=1e-5, atol=1e-5
    )


def test_vmap_and_grad():
    config, params, hidden, rows = make_case(5, hc=2, conv=4)
    f = lambda p, h, r: layer.engram_layer(p, h, r, config=config)  # noqa: E731
    batched = jax.jit(jax.vmap(f, in_axes=(None, 0, 0)))(params, hidden, rows)
    single = layer_fn(params, hidden, rows, config=config)
    np.testing.assert_allclose(np.asarray(batched), np.asarray(single), rtol=1e-6)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(f(p, hidden, rows) ** 2)))(
        jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
    )
    for leaf in jax.tree_util.tree_leaves(grads):
        assert bool(jnp.all(jnp.isfinite(leaf))) and float(jnp.max(jnp.abs(leaf))) > 0


def test_bad_input():
    config, params, hidden, rows = make_case(1, hc=2)
    with pytest.raises(ValueError, match="hidden must end in"):
        layer.engram_layer(params, hidden[..., 0, :], rows, config=config)
    with pytest.raises(ValueError, match="n_cols \\* dim"):
        layer.engram_layer(params, hidden, rows[..., :16], config=config)
    with pytest.raises(ValueError, match="rows cover tokens"):
        layer.engram_layer(params, hidden, rows[:, :3], config=config)
    with pytest.raises(ValueError, match="token_mask"):
        layer.engram_layer(params, hidden, rows, jnp.ones((2,), bool), config=config)
    with pytest.raises(ValueError, match="params.wkv"):
        layer.engram_layer(params._replace(wkv=params.wkv[:, :10]), hidden, rows, config=config)
    with pytest.raises(ValueError, match="conv_weight"):
        conv_config = layer.EngramLayerConfig(48, 96, hc_mult=2, conv_kernel=4)
        layer.engram_layer(params, hidden, rows, config=conv_config)
    with pytest.raises(ValueError, match="no convolution"):
        layer.engram_layer_step(params, hidden, rows, jnp.zeros(()), config=config)
    with pytest.raises(ValueError, match="hc_mult must be a positive int"):
        layer.EngramLayerConfig(48, 96, hc_mult=0)
    with pytest.raises(TypeError, match="EngramLayerConfig"):
        layer.engram_layer(params, hidden, rows, config={"hidden_size": 48})


def test_params_from_deepseek():
    rng = np.random.default_rng(0)
    hc, width, edim, block = 2, 64, 96, 32
    wkv = rng.normal(size=((hc + 1) * width, edim)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.integers(120, 131, ((hc + 1) * width // block, edim // block), dtype=np.uint8)
    k = rng.normal(size=(hc, width)).astype(ml_dtypes.bfloat16)
    q = rng.normal(size=(hc, width)).astype(ml_dtypes.bfloat16)
    params = layer.params_from_deepseek(
        wkv, k, q, scale.view(ml_dtypes.float8_e8m0fnu), block=block, dtype=jnp.float32
    )
    block_scales = 2.0 ** (scale.astype(np.float32) - 127)
    dense = wkv.astype(np.float32) * np.kron(block_scales, np.ones((block, block)))
    np.testing.assert_array_equal(np.asarray(params.wkv), dense.T)
    np.testing.assert_array_equal(np.asarray(params.k_weight), k.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(params.q_weight), q.astype(np.float32))
    with pytest.raises(ValueError, match="wkv has"):
        layer.params_from_deepseek(wkv[:-1], k, q)
    with pytest.raises(ValueError, match="wkv_scale must be"):
        layer.params_from_deepseek(wkv, k, q, scale[:-1], block=block)


def fed_by_lookup(placement, device):
    """lookup -> engram_layer in one jitted function on ``device``, against the reference."""
    rng = np.random.default_rng(4)
    rows_in_table, n_cols, dim = 101, 4, 64
    weight, scale = random_table_arrays(rng, rows_in_table, dim, scale_low=110)
    weight = np.where((weight & 0x7F) == 0x7F, 0, weight).astype(np.uint8)  # no NaN rows
    scale = np.minimum(scale, 135).astype(np.uint8)
    config, params, hidden, _ = make_case(9, hc=2, n_cols=n_cols, dim=dim, lead=(6,))
    ids = rng.integers(0, rows_in_table, (6, n_cols)).astype(np.int32)
    ids[2] = ej.DEAD_ID
    on = device if placement == "device" else None
    with ej.EngramTable.from_arrays(weight, scale, placement=placement, device=on) as table:

        @jax.jit
        def model(p, h, i):
            rows = ej.lookup(table, i)
            return layer.engram_layer(p, h, rows, layer.token_mask_from_ids(i), config=config)

        inputs = jax.device_put((params, hidden, jnp.asarray(ids)), device)
        # Wait inside the block: the lookup runs asynchronously and must see the table open.
        out = np.asarray(model(*inputs))
    rows_ref = jnp.asarray(testing.lookup_reference(weight, scale, ids))
    mask = jnp.asarray(ids[:, 0] != ej.DEAD_ID)
    want = reference_fn(params, hidden, rows_ref, mask, config=config)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(out)[2], np.asarray(hidden)[2])


def test_fed_by_lookup_under_jit(cpu_device):
    """DEAD ids leave their token unchanged; the rest matches the reference."""
    fed_by_lookup("cpu", cpu_device)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
def test_fed_by_lookup_gpu(placement, gpu_device):
    fed_by_lookup(placement, gpu_device)


@settings(max_examples=5, deadline=None)
@given(
    hc=st.integers(1, 4),
    width=st.sampled_from([8, 24, 40]),
    n_cols=st.integers(1, 5),
    seq=st.integers(1, 5),
    conv=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_against_reference(hc, width, n_cols, seq, conv, seed):
    config, params, hidden, rows = make_case(
        seed, hc=hc, width=width, n_cols=n_cols, lead=(seq,), conv=conv, dilation=2
    )
    mask = None if seed % 3 == 0 else jnp.asarray(np.random.default_rng(seed).random(seq) < 0.7)
    out = layer_fn(params, hidden, rows, mask, config=config)
    want = reference_fn(params, hidden, rows, mask, config=config)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=5e-5, atol=5e-5)
