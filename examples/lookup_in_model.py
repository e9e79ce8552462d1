"""engram_jax.lookup inside your own jitted model.

A toy model, all in one ``jax.jit``: embed the tokens, hash their n-grams to
table rows, gather the rows from a host-memory table, gate them into the
hidden state with the Engram layer, project to logits. The table is an
ordinary (static) Python object the jitted function closes over. Runs on the
CPU or a GPU and checks the gathered rows against the numpy reference.

    python examples/lookup_in_model.py
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import engram_jax as ej
from engram_jax import testing

VOCAB, WIDTH, ROW_DIM = 500, 128, 64

# Where each token's n-grams land: orders 2 and 3, two hash heads each (4 rows per token).
layout = ej.EngramLayout(
    engram_vocab_size=1000,
    layer_ids=[0],
    max_ngram_size=3,
    n_heads=2,
    head_dim=ROW_DIM,
    compressed_vocab_size=VOCAB,
    pad_id=0,
)

# One layer's table: fp8 e4m3 rows with one UE8M0 scale byte per 32 values (127 = 1.0),
# in page-locked host memory when a GPU reads it, plain memory on the CPU.
rng = np.random.default_rng(0)
num_rows = layout.num_embeddings[0]
weight = rng.normal(size=(num_rows, ROW_DIM)).astype(ml_dtypes.float8_e4m3fn)
scale = np.full((num_rows, ROW_DIM // 32), 127, np.uint8)
placement = "pinned" if jax.default_backend() == "gpu" else "cpu"
table = ej.EngramTable.from_arrays(weight, scale, placement=placement)

config = ej.EngramLayerConfig(hidden_size=WIDTH, engram_dim=layout.n_cols * ROW_DIM)
k_embed, k_engram, k_head = jax.random.split(jax.random.PRNGKey(0), 3)
params = {
    "embed": jax.random.normal(k_embed, (VOCAB, WIDTH)),
    "engram": ej.init_engram_params(k_engram, config, dtype=jnp.float32),
    "head": jax.random.normal(k_head, (WIDTH, VOCAB)) * WIDTH**-0.5,
}


@jax.jit
def model(params, tokens):
    """``tokens``: compressed ids ``[T]`` of one sequence -> logits ``[T, VOCAB]``."""
    x = params["embed"][tokens]
    ids = ej.hash_ngrams(layout, tokens)[:, 0]  # [T, n_cols] rows of layer 0's table
    rows = ej.lookup(table, ids)  # [T, n_cols, ROW_DIM] bf16, gathered from host memory
    x = ej.engram_layer(params["engram"], x, rows, ej.token_mask_from_ids(ids), config=config)
    return x @ params["head"], rows


tokens = jnp.asarray(rng.integers(0, VOCAB, 12), jnp.int32)
logits, rows = model(params, tokens)
ids = np.asarray(ej.hash_ngrams(layout, tokens))[:, 0]
expected = testing.lookup_reference(weight, scale, ids)
assert np.array_equal(np.asarray(rows).view(np.uint16), expected.view(np.uint16))
print(
    f"{placement} table of {num_rows} rows; {tokens.shape[0]} tokens x {layout.n_cols} rows "
    f"gathered inside jit match the reference; logits {logits.shape}, "
    f"next tokens {np.asarray(jnp.argmax(logits, -1)).tolist()}"
)
table.close()
