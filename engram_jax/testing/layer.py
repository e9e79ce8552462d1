"""Plain-jnp reference of the Engram fusion layer, written the way DeepSeek's demo reads.

The tests compare :func:`engram_jax.engram_layer` (and its step form)
against it; it shares no code with the layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from engram_jax.layer import EngramLayerConfig, EngramParams

# The gate's floor under |score| before the square root (DeepSeek's clamp_min(1e-6)).
GATE_FLOOR = 1e-6


def engram_layer_reference(
    params: EngramParams,
    hidden: jax.Array,
    rows: jax.Array,
    token_mask: jax.Array | None = None,
    *,
    config: EngramLayerConfig,
) -> jax.Array:
    """Plain-jnp reference of :func:`engram_jax.engram_layer`.

    One key projection and two separately weighted RMSNorms per copy, a loop
    over copies, a loop over positions for the convolution, float32 matmuls
    at HIGHEST precision. Slow and obvious on purpose; the tests compare the
    layer against it.
    """
    hc, width = config.hc_mult, config.hidden_size
    hi = jax.lax.Precision.HIGHEST
    h = hidden.astype(jnp.float32)
    h = h if hc > 1 else h[..., None, :]
    lead = h.shape[:-2]
    embedding = rows.astype(jnp.float32).reshape(*lead, config.engram_dim)
    wkv = params.wkv.astype(jnp.float32)
    value = jnp.matmul(embedding, wkv[:, hc * width :], precision=hi)

    def rms_norm(x, gain, eps):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain

    gated = []
    for c in range(hc):
        key = jnp.matmul(embedding, wkv[:, c * width : (c + 1) * width], precision=hi)
        k_gain = params.k_weight[c].astype(jnp.float32)
        q_gain = params.q_weight[c].astype(jnp.float32)
        normed_key = rms_norm(key, k_gain, config.norm_eps)
        normed_query = rms_norm(h[..., c, :], q_gain, config.norm_eps)
        score = jnp.sum(normed_key * normed_query, axis=-1) / np.sqrt(width)
        magnitude = jnp.sqrt(jnp.maximum(jnp.abs(score), GATE_FLOOR))
        gate = 1.0 / (1.0 + jnp.exp(-jnp.where(jnp.signbit(score), -magnitude, magnitude)))
        if token_mask is not None:
            gate = jnp.where(token_mask, gate, 0.0)
        gated.append(gate[..., None] * value)
    update = jnp.stack(gated, axis=-2)
    if config.conv_kernel:
        seq = update.shape[-3]
        conv_gain = params.conv_norm.astype(jnp.float32)
        normed = jnp.stack(
            [rms_norm(update[..., c, :], conv_gain[c], config.conv_norm_eps) for c in range(hc)],
            axis=-2,
        )
        weight = params.conv_weight.astype(jnp.float32)
        outputs = []
        for t in range(seq):
            acc = jnp.zeros(update.shape[:-3] + update.shape[-2:], jnp.float32)
            for tap in range(config.conv_kernel):
                source = t - (config.conv_kernel - 1 - tap) * config.conv_dilation
                if source >= 0:
                    acc = acc + weight[tap] * normed[..., source, :, :]
            outputs.append(acc * (1.0 / (1.0 + jnp.exp(-acc))))
        update = update + jnp.stack(outputs, axis=-3)
    out = h + update
    out = out if hc > 1 else out[..., 0, :]
    return out.astype(hidden.dtype)
