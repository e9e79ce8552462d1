"""The decoder trained here: the serving example's blocks, run over whole sequences
(each block's KV cache is the sequence itself, so attention is causal over it), a
word-level vocabulary, Engram layers at chosen blocks fed the rows the step looked
up, and the next-token loss. The same function without rows is the baseline.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from serving import model as serving_model

import engram_jax as ej

ModelConfig = serving_model.ModelConfig

MODELS = {
    # The smallest with every part, for tests.
    "micro": ModelConfig(
        d_model=64,
        n_layers=2,
        n_heads=2,
        head_dim=32,
        d_ff=128,
        engram_layers=(0, 1),
        hc_mult=1,
        max_ngram_size=3,
        engram_heads=2,
        row_dim=32,
    ),
    # CPU-sized: both models train for the default steps in about two minutes on 2 cores.
    "tiny": ModelConfig(
        d_model=128,
        n_layers=3,
        n_heads=4,
        head_dim=32,
        d_ff=384,
        engram_layers=(1, 2),
        hc_mult=1,
        max_ngram_size=3,
        engram_heads=4,
        row_dim=32,
    ),
    # GPU-sized, Engram shaped as DeepSeek-V4.1's (orders 2-4 x 8 heads of 256-dim rows).
    "small": ModelConfig(
        d_model=1024,
        n_layers=8,
        n_heads=8,
        head_dim=128,
        d_ff=4096,
        engram_layers=(1, 4),
        hc_mult=1,
        max_ngram_size=4,
        engram_heads=8,
        row_dim=256,
    ),
}


def config(name: str, vocab_size: int) -> ModelConfig:
    return dataclasses.replace(MODELS[name], vocab_size=vocab_size)


def layout(cfg: ModelConfig, corpus, table_bytes: float, row_bytes: int) -> ej.EngramLayout:
    """The hash layout whose tables (rows and optimizer state) take about ``table_bytes``."""
    per_column = int(table_bytes / row_bytes / len(cfg.engram_layers) / cfg.n_cols)
    return ej.EngramLayout(
        engram_vocab_size=max(per_column, 2),
        layer_ids=cfg.engram_layers,
        max_ngram_size=cfg.max_ngram_size,
        n_heads=cfg.engram_heads,
        head_dim=cfg.row_dim,
        compressed_vocab_size=corpus.compressed_vocab_size,
        pad_id=corpus.pad_id,
    )


def init_params(cfg: ModelConfig, seed: int, dtype) -> dict:
    """Both models' weights, from one seed: the baseline leaves the Engram ones unused."""
    return serving_model.init_params(cfg, seed, dtype)


def loss(cfg: ModelConfig, params: dict, rows, ids, inputs, targets) -> jax.Array:
    """Mean next-token cross-entropy of ``inputs`` ``[B, S]`` against ``targets``.

    ``rows``: per Engram layer ``[B, S, n_cols, row_dim]`` (what ``ej.lookup`` gave for
    ``ids``, per layer ``[B, S, n_cols]``), or ``None`` for the model without Engram.
    """
    b, s = inputs.shape
    x = serving_model.embed(cfg, params, inputs)
    kv = serving_model.init_kv_state(cfg, b, s, x.dtype)
    engram_rows = None
    if rows is not None:
        masks = [ej.token_mask_from_ids(i) for i in ids]
        engram_rows = lambda e, x: (rows[e].astype(x.dtype), masks[e])  # noqa: E731
    x, _ = serving_model.run_blocks(cfg, params, kv, x, jnp.zeros((b,), jnp.int32), engram_rows)
    logits = serving_model.logits(cfg, params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
