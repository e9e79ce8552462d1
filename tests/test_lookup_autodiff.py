"""Lookups inside differentiated code: the rows are constants of the ids, also when
the ids or a handle went through an ``optimization_barrier`` with a differentiated
value (README, Prefetch: how a lookup is tied to its layer), which hands integer
values float0 zero tangents that jax would refuse to pass to an ``ffi_call``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import engram_jax as ej


@pytest.fixture(scope="module")
def table():
    with ej.dummy_table(50, 32, placement="cpu", fill="distinct") as t:
        yield t


IDS = np.array([[3, -1, 7], [49, 0, 12]], np.int32)


def _loss(rows, x):
    return jnp.sum(jnp.tanh(x) * rows.astype(jnp.float32).sum(axis=(-2, -1))[:, None])


@pytest.mark.parametrize("how", ["lookup", "prefetch", "prefetch_ahead"])
def test_grad_through_lookups_tied_to_a_differentiated_value(table, how):
    def loss(x, ids):
        if how == "lookup":
            ids, _ = jax.lax.optimization_barrier((ids, x[:1, :1]))
            rows = ej.lookup(table, ids)
        else:
            if how == "prefetch_ahead":  # the start tied to the value too
                ids, x = jax.lax.optimization_barrier((ids, x))
            handle = ej.lookup_start(table, ids)
            x = jnp.tanh(x) * 2
            handle, _ = jax.lax.optimization_barrier((handle, x[:1, :1]))
            rows = ej.lookup_done(handle)
        return _loss(rows, x)

    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32).reshape(2, 4)
    got = jax.jit(jax.grad(loss))(x, IDS)
    rows = ej.lookup(table, IDS)  # the rows as a constant
    if how == "lookup":
        want = jax.jit(jax.grad(lambda x: _loss(rows, x)))(x)
    else:
        want = jax.jit(jax.grad(lambda x: _loss(rows, jnp.tanh(x) * 2)))(x)
    np.testing.assert_array_equal(got, want)
    assert float(jnp.abs(got).max()) > 0


def test_value_and_grad_of_the_rows_themselves(table):
    """A train step differentiates the rows it looked up (the table's gradient)."""

    @jax.jit
    def step(x, ids):
        rows = ej.lookup(table, ids)
        return jax.grad(lambda r: _loss(r, x))(rows)

    g = step(jnp.ones((2, 4)), IDS)
    assert g.shape == IDS.shape + (32,) and g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), np.tanh(1.0) * 4, rtol=1e-2)
