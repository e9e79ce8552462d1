"""The toy decoder: seeded random weights (no downloads), pre-norm attention over a
per-slot KV cache, SwiGLU MLPs, and Engram layers at chosen blocks. It knows
nothing of tables: at each Engram block it asks the caller for that layer's rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

import engram_jax as ej

BOS_ID = 0  # <｜begin▁of▁sentence｜>
EOS_ID = 1  # <｜end▁of▁sentence｜>
PAD_TOKEN_ID = 2  # <｜▁pad▁｜>, the n-gram pad DeepSeek's Engram configs name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    d_ff: int
    engram_layers: tuple[int, ...]
    hc_mult: int
    max_ngram_size: int
    engram_heads: int
    row_dim: int
    vocab_size: int = 129_280

    @property
    def n_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.engram_heads


MODELS = {
    # The smallest that still has every part: for tests and quick checks.
    "micro": ModelConfig(
        d_model=64,
        n_layers=3,
        n_heads=2,
        head_dim=32,
        d_ff=128,
        engram_layers=(0, 1),
        hc_mult=2,
        max_ngram_size=3,
        engram_heads=2,
        row_dim=32,
    ),
    # CPU-sized: runs with no arguments on two cores in well under a minute.
    "tiny": ModelConfig(
        d_model=256,
        n_layers=4,
        n_heads=4,
        head_dim=64,
        d_ff=512,
        engram_layers=(1, 2),
        hc_mult=1,
        max_ngram_size=3,
        engram_heads=4,
        row_dim=64,
    ),
    # GPU-sized, Engram shaped as DeepSeek-V4.1 (orders 2-4 x 8 heads of 256-dim rows,
    # 4 hyper-connection copies); Engram at blocks 2 and 6, so lookups have blocks to hide behind.
    "medium": ModelConfig(
        d_model=4096,
        n_layers=8,
        n_heads=32,
        head_dim=128,
        d_ff=12288,
        engram_layers=(2, 6),
        hc_mult=4,
        max_ngram_size=4,
        engram_heads=8,
        row_dim=256,
    ),
}


def engram_config(cfg: ModelConfig) -> ej.EngramLayerConfig:
    return ej.EngramLayerConfig(
        hidden_size=cfg.d_model, engram_dim=cfg.n_cols * cfg.row_dim, hc_mult=cfg.hc_mult
    )


def init_params(cfg: ModelConfig, seed: int, dtype) -> dict:
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8 * cfg.n_layers + 8))

    def dense(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)

    d, inner = cfg.d_model, cfg.n_heads * cfg.head_dim
    blocks = [
        dict(
            ln1=jnp.ones((d,), dtype),
            wqkv=dense((d, 3 * inner)),
            wo=dense((inner, d)),
            ln2=jnp.ones((d,), dtype),
            wgate=dense((d, cfg.d_ff)),
            wup=dense((d, cfg.d_ff)),
            wdown=dense((cfg.d_ff, d)),
        )
        for _ in range(cfg.n_layers)
    ]
    econfig = engram_config(cfg)
    return dict(
        embed=jax.random.normal(next(keys), (cfg.vocab_size, d), jnp.float32).astype(dtype),
        # Untied: with a tied head, random weights just repeat the input token.
        head=dense((d, cfg.vocab_size)),
        blocks=blocks,
        engram=[ej.init_engram_params(next(keys), econfig, dtype) for _ in cfg.engram_layers],
        ln_f=jnp.ones((d,), dtype),
    )


def init_kv_state(cfg: ModelConfig, slots: int, max_len: int, dtype) -> dict:
    """Every slot's KV cache (``max_len`` positions per block) and its next position.

    A slot's cache entries past ``pos`` are never read: rolling a slot back is
    moving ``pos`` back, and the next step overwrites what lay beyond. Heads come
    before positions, the layout the attention dots take as it is: with positions
    first, XLA transposed every block's whole cache in each step wider than one
    token (3.4 of a 9.5 ms verify step on an H200, 128 slots).
    """
    shape = (slots, cfg.n_heads, max_len, cfg.head_dim)
    return dict(
        cache=[(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.n_layers)],
        pos=jnp.zeros((slots,), jnp.int32),
    )


def _rms(x, gain):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return normed.astype(x.dtype) * gain


def _rope(x, positions):
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [B, C, 1, half]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def _block(cfg: ModelConfig, p, x, cache, pos, positions):
    """Pre-norm attention (over each slot's KV cache) and SwiGLU MLP: the residual update.

    ``x`` ``[B, C, D]``; slot b's tokens sit at positions ``pos[b] + 0..C-1``.
    """
    b, c, _ = x.shape
    q, k, v = jnp.split((_rms(x, p["ln1"]) @ p["wqkv"]).reshape(b, c, 3 * cfg.n_heads, -1), 3, 2)
    q, k = _rope(q, positions), _rope(k, positions)
    # One scatter of the step's positions into each slot's cache, in place (the
    # cache is donated); positions are distinct, any past the cache dropped.
    at = (jnp.arange(b)[:, None], slice(None), positions)
    k_cache = cache[0].at[at].set(k, unique_indices=True, mode="drop")
    v_cache = cache[1].at[at].set(v, unique_indices=True, mode="drop")
    scores = jnp.einsum("bchd,bhsd->bhcs", q, k_cache, preferred_element_type=jnp.float32)
    visible = jnp.arange(k_cache.shape[2])[None, None, :] <= positions[:, :, None]
    scores = jnp.where(visible[:, None], scores * cfg.head_dim**-0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    attn = jnp.einsum("bhcs,bhsd->bchd", probs, v_cache).reshape(b, c, -1) @ p["wo"]
    h = _rms(x + attn, p["ln2"])
    mlp = (jax.nn.silu(h @ p["wgate"]) * (h @ p["wup"])) @ p["wdown"]
    return attn + mlp, (k_cache, v_cache)


def embed(cfg: ModelConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """``[B, C]`` token ids to the first block's input ``[B, C, (hc_mult,) d_model]``."""
    x = params["embed"][tokens]
    if cfg.hc_mult > 1:
        x = jnp.broadcast_to(x[:, :, None, :], (*tokens.shape, cfg.hc_mult, cfg.d_model))
    return x


EngramRows = Callable[[int, jax.Array], tuple[jax.Array, jax.Array]]


def run_blocks(
    cfg: ModelConfig,
    params: dict,
    kv: dict,
    x: jax.Array,
    pos: jax.Array,
    engram_rows: EngramRows | None,
) -> tuple[jax.Array, dict]:
    """Every block over ``x`` (slot b's tokens at positions ``pos[b] + 0..C-1``).

    ``engram_rows(e, x)``, at the block of Engram layer ``e``, returns that layer's
    rows ``[B, C, n_cols, row_dim]`` and a token mask; ``None`` skips the Engram
    layers. Returns the last hidden state and the KV state with these positions
    written (``pos`` itself is the caller's to advance).
    """
    positions = pos[:, None] + jnp.arange(x.shape[1])[None, :]
    econfig = engram_config(cfg)
    caches = []
    for i, (p, cache) in enumerate(zip(params["blocks"], kv["cache"], strict=True)):
        if engram_rows is not None and i in cfg.engram_layers:
            e = cfg.engram_layers.index(i)
            rows, mask = engram_rows(e, x)
            x = ej.engram_layer(params["engram"][e], x, rows, mask, config=econfig)
        # Hyper-connection stand-in: blocks read the mean of the copies and add to each.
        if cfg.hc_mult > 1:
            update, cache = _block(cfg, p, x.mean(axis=2), cache, pos, positions)
            x = x + update[:, :, None, :]
        else:
            update, cache = _block(cfg, p, x, cache, pos, positions)
            x = x + update
        caches.append(cache)
    return x, dict(cache=caches, pos=pos)


def logits(cfg: ModelConfig, params: dict, x: jax.Array) -> jax.Array:
    """float32 next-token logits ``[B, P, vocab]`` of hidden states ``[B, P, (hc_mult,) D]``."""
    x = x.mean(axis=2) if cfg.hc_mult > 1 else x
    return jnp.dot(_rms(x, params["ln_f"]), params["head"], preferred_element_type=jnp.float32)
