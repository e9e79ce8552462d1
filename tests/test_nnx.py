"""engram_jax.nnx.Engram: the framework-free path's outputs, bit for bit, under
nnx.jit, nnx.grad and nnx.scan, whole, chunked and prefetched. Skipped without Flax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import engram_jax as ej  # noqa: E402
from engram_jax.nnx import Engram, EngramState  # noqa: E402

from ._helpers import load_file  # noqa: E402

H = 48


@pytest.fixture(scope="module")
def layout():
    return ej.EngramLayout(200, (1, 4), 3, 2, 32, 60, 0)


@pytest.fixture(scope="module")
def table(layout):
    with ej.dummy_table(layout.num_embeddings[1], 32, placement="cpu", fill="distinct") as t:
        yield t


def _tokens(shape, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 60, shape).astype(np.int32)
    tokens[..., 3] = ej.DEAD_ID  # a DEAD token: its gate is zero
    return tokens


def _hidden(shape, seed=1, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _reference(params, config, layout, table, hidden, tokens):
    """The framework-free path, written out."""
    ids = ej.hash_ngrams(layout, tokens)[..., layout.layer_index(4), :]
    rows = ej.lookup(table, ids)
    return ej.engram_layer(params, hidden, rows, ej.token_mask_from_ids(ids), config=config)


def _equal(a, b):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_the_call_is_the_functional_path(layout, table):
    layer = Engram(layout, table, H, layer_id=4, rngs=nnx.Rngs(0))
    assert layer.config.engram_dim == layout.n_cols * layout.head_dim
    tokens, hidden = _tokens((2, 9)), _hidden((2, 9, H))
    reference = functools.partial(_reference, config=layer.config, layout=layout, table=table)
    want = reference(layer.params(), hidden=hidden, tokens=tokens)
    _equal(layer(hidden, tokens), want)
    # Jitted, against the jitted functional path (XLA fuses both alike).
    jitted = jax.jit(lambda p, h, t: reference(p, hidden=h, tokens=t))
    _equal(
        nnx.jit(lambda m, h, t: m(h, t))(layer, hidden, tokens),
        jitted(layer.params(), hidden, tokens),
    )
    # The DEAD token passes through; the others moved.
    _equal(want[:, 3], hidden[:, 3])
    assert not np.allclose(np.asarray(want[:, 5]), np.asarray(hidden[:, 5]))


def test_chunks_with_a_state_equal_the_whole_sequence(layout, table):
    layer = Engram(layout, table, H, layer_id=4, rngs=nnx.Rngs(1))
    tokens, hidden = _tokens((2, 12)), _hidden((2, 12, H))
    call = nnx.jit(lambda m, *args: m(*args))
    whole = call(layer, hidden, tokens)
    state = ej.init_state(layout, 2)  # the plain hash state, for a layer without conv
    first, state = call(layer, hidden[:, :5], tokens[:, :5], state)
    rest, state = call(layer, hidden[:, 5:], tokens[:, 5:], state)
    _equal(jnp.concatenate([first, rest], axis=1), whole)
    _equal(state, tokens[:, -2:])


def test_scan_over_decode_steps(layout, table):
    layer = Engram(layout, table, H, layer_id=4, rngs=nnx.Rngs(2))
    tokens, hidden = _tokens((2, 10)), _hidden((2, 10, H))

    @nnx.scan(in_axes=(None, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
    def decode(layer, state, h, t):  # one token per sequence per step
        out, state = layer(h[:, None], t[:, None], state)
        return state, out[:, 0]

    state, outs = decode(layer, layer.init_state(2), hidden.swapaxes(0, 1), tokens.T)
    assert isinstance(state, EngramState) and state.conv is None
    # A compiled loop of one-token steps rounds the f32 matmul otherwise than one call.
    np.testing.assert_allclose(outs.swapaxes(0, 1), layer(hidden, tokens), rtol=1e-5, atol=1e-6)
    _equal(state.hash, tokens[:, -2:])


def test_prefetched_equals_plain(layout, table):
    layer = Engram(layout, table, H, layer_id=4, rngs=nnx.Rngs(3))
    tokens, hidden = _tokens((2, 7)), _hidden((2, 7, H), dtype=jnp.bfloat16)

    @nnx.jit
    def step(layer, hidden, tokens, state):
        started = layer.start(tokens, state)
        # Started before the work below; done tied to one value of the layer's input
        # (README, Prefetch: a bf16 value out of a barrier is rounded there).
        tokens, started = jax.lax.optimization_barrier((tokens, started))
        hidden = jnp.tanh(hidden)
        started, _ = jax.lax.optimization_barrier((started, hidden[:1, :1]))
        return layer(hidden, prefetched=started)

    @nnx.jit
    def plain(layer, hidden, tokens, state):
        return layer(jnp.tanh(hidden), tokens, state)

    state = layer.init_state(2)
    got, got_state = step(layer, hidden, tokens, state)
    want, want_state = plain(layer, hidden, tokens, state)
    _equal(got, want)
    _equal(got_state.hash, want_state.hash)
    with pytest.raises(ValueError, match="Engram.start"):
        layer(hidden, tokens, prefetched=layer.start(tokens))


def test_grad_of_the_layers_own_params(layout, table):
    layer = Engram(layout, table, H, layer_id=4, rngs=nnx.Rngs(4), param_dtype=jnp.float32)
    tokens, hidden = _tokens((2, 6)), _hidden((2, 6, H))
    target = _hidden((2, 6, H), seed=9)

    def loss(layer):
        return jnp.mean((layer(hidden, tokens) - target) ** 2)

    grads = nnx.jit(nnx.grad(loss))(layer)

    ids = ej.hash_ngrams(layout, tokens)[..., 1, :]
    rows, mask = ej.lookup(table, ids), ej.token_mask_from_ids(ids)

    def functional(params):
        out = ej.engram_layer(params, hidden, rows, mask, config=layer.config)
        return jnp.mean((out - target) ** 2)

    want = jax.jit(jax.grad(functional))(layer.params())
    for name in ("wkv", "q_weight", "k_weight"):
        got = getattr(grads, name)[...]
        np.testing.assert_allclose(got, getattr(want, name), rtol=1e-5, atol=1e-7)
        assert float(jnp.abs(got).max()) > 0, name


def test_conv_layer_chunked_with_its_history(layout, table):
    layer = Engram(layout, table, H, layer_id=4, conv_kernel=3, conv_dilation=2, rngs=nnx.Rngs(5))
    tokens, hidden = _tokens((2, 11)), _hidden((2, 11, H))
    call = nnx.jit(lambda m, *args: m(*args))
    whole = call(layer, hidden, tokens)
    state = layer.init_state(2)
    parts = []
    for lo, hi in ((0, 4), (4, 5), (5, 11)):
        out, state = call(layer, hidden[:, lo:hi], tokens[:, lo:hi], state)
        parts.append(out)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), whole, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="init_state"):
        layer(hidden, tokens, ej.init_state(layout, 2))


def test_deepseek_params_and_bad_arguments(layout, table):
    rng = np.random.default_rng(6)
    engram_dim = layout.n_cols * layout.head_dim
    wkv = rng.normal(size=(2 * H, engram_dim)).astype(np.float32)
    gains = np.ones((1, H), np.float32)
    params = ej.params_from_deepseek(wkv, gains, gains)
    layer = Engram(layout, table, H, layer_id=4, params=params)
    _equal(layer.wkv[...], params.wkv)
    assert set(nnx.state(layer, nnx.Param)) == {"wkv", "q_weight", "k_weight"}
    with pytest.raises(ValueError, match="layer_id"):
        Engram(layout, table, H, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="params.wkv must have shape"):
        Engram(layout, table, H + 1, layer_id=4, params=params)
    with pytest.raises(ValueError, match="params= .* or rngs="):
        Engram(layout, table, H, layer_id=4)
    with pytest.raises(TypeError, match="EngramTable"):
        Engram(layout, "table", H, layer_id=4, rngs=nnx.Rngs(0))
    with ej.dummy_table(10, 64, placement="cpu") as wide:
        with pytest.raises(ValueError, match="head_dim is 32"):
            Engram(layout, wide, H, layer_id=4, rngs=nnx.Rngs(0))


def test_the_flax_example_trains_and_prefetches_the_same_logits():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "flax_model.py"
    example = load_file("flax_model_example", path)
    result = example.main(["--steps", "40", "--batch", "8"])
    assert result["gap"] == 0.0
    assert result["last_loss"] < result["first_loss"] - 0.2, result


@pytest.mark.gpu
def test_on_the_gpu_prefetched_plain_and_grad(layout):
    """A pinned host table read on CUDA: the prefetched layer gives the plain layer's
    bits under nnx.jit, and nnx.grad of its weights runs through the prefetch."""
    rows = layout.num_embeddings[1]
    with ej.dummy_table(rows, 32, placement="pinned", fill="distinct") as table:
        layer = Engram(layout, table, H, layer_id=4, rngs=nnx.Rngs(7), param_dtype=jnp.float32)
        tokens, hidden = _tokens((4, 64)), _hidden((4, 64, H))

        def forward(layer, hidden, tokens, prefetch):
            if not prefetch:
                return layer(jnp.tanh(hidden), tokens)
            started = layer.start(tokens)
            tokens, started = jax.lax.optimization_barrier((tokens, started))
            hidden = jnp.tanh(hidden)
            started, _ = jax.lax.optimization_barrier((started, hidden[:1, :1]))
            return layer(hidden, prefetched=started)

        run = nnx.jit(forward, static_argnums=3)
        _equal(run(layer, hidden, tokens, True), run(layer, hidden, tokens, False))
        grad = nnx.jit(nnx.grad(lambda m, h, t, p: forward(m, h, t, p).sum()), static_argnums=3)
        got, want = grad(layer, hidden, tokens, True), grad(layer, hidden, tokens, False)
        np.testing.assert_allclose(got.wkv[...], want.wkv[...], rtol=1e-5, atol=1e-6)
        assert float(jnp.abs(got.wkv[...]).max()) > 0
