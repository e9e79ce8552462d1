"""The Engram fusion layer: looked-up rows gated into the residual stream.

Plain functions over an explicit params pytree (:class:`EngramParams`) and a
static, hashable :class:`EngramLayerConfig`: the layer drops into any JAX
model (plain jit, Flax, Equinox, Haiku) and the package needs no framework.

Formulation: DeepSeek-V4.1's, as its checkpoint tensors (``engram.wkv``,
``k_weight``, ``q_weight``) and the public reimplementations of its inference
code have it (ROCm ATOM's ``engram_post_wkv_reference``, mirrored op for op
by other engines). Per token and per hyper-connection copy ``c`` of ``h``::

    e      = rows.reshape(n_cols * dim)                  # the looked-up rows, flattened
    kv     = e @ wkv                                     # [(hc_mult + 1) * H]: keys, then value
    key_c  = kv[c*H:(c+1)*H]; value = kv[hc_mult*H:]
    dot    = <rms(h_c) * q_weight_c, rms(key_c) * k_weight_c> / sqrt(H)
    gate   = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))   # 0 where token_mask is False
    out_c  = h_c + gate * value

with ``rms(x) = x * rsqrt(mean(x**2) + eps)`` and norms, dot and gate in
float32. This is the gate of DeepSeek's Engram demo (``engram_demo_v1.py``:
one key projection and two RMSNorms per copy, a shared value projection) with
V4.1's fused ``wkv`` and token mask. The optional short causal convolution is
the demo's ``ShortConv``: gated values RMS-normalised per copy, convolved
depthwise along the sequence (``kernel`` taps, ``dilation`` apart, causal),
SiLU, added to the gated values before the residual add. V4.1 leaves it out.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from engram_jax._format import DEAD_ID

# The gate's floor under |dot| before the square root (DeepSeek's clamp_min(1e-6)).
_GATE_FLOOR = 1e-6


@dataclasses.dataclass(frozen=True)
class EngramLayerConfig:
    """Static shape and numerics of one Engram layer (hashable: pass it as a static argument).

    ``hidden_size`` is the model width H; ``engram_dim`` the width of one token's
    rows flattened (``n_cols * dim``; DeepSeek-V4.1: 24 * 256 = 6144);
    ``hc_mult`` the hyper-connection copies of the hidden state (1 = a plain
    residual stream). ``norm_eps`` is the model's RMSNorm epsilon (its
    ``rms_norm_eps``). ``conv_kernel`` > 0 turns on the demo's short causal
    convolution with that many taps, ``conv_dilation`` apart (the demo uses
    ``max_ngram_size``).
    """

    hidden_size: int
    engram_dim: int
    hc_mult: int = 1
    norm_eps: float = 1e-6
    conv_kernel: int = 0
    conv_dilation: int = 1
    conv_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden_size", "engram_dim", "hc_mult", "conv_dilation"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.conv_kernel, (int, np.integer)) or self.conv_kernel < 0:
            raise ValueError(f"conv_kernel must be an int >= 0, got {self.conv_kernel!r}")
        if not (self.norm_eps > 0 and self.conv_norm_eps > 0):
            raise ValueError("norm_eps and conv_norm_eps must be > 0")

    @property
    def conv_history(self) -> int:
        """Earlier positions the convolution reads: ``(conv_kernel - 1) * conv_dilation``."""
        return max(self.conv_kernel - 1, 0) * self.conv_dilation


class EngramParams(NamedTuple):
    """The weights of one Engram layer (a pytree).

    ``wkv`` ``[engram_dim, (hc_mult + 1) * H]``: the key projections, copy by
    copy, then the one value projection (the transpose of DeepSeek's
    ``engram.wkv.weight``). ``q_weight``/``k_weight`` ``[hc_mult, H]``: the RMSNorm
    gains on the hidden state and on the key. ``conv_weight`` ``[kernel, hc_mult, H]``
    (tap ``k`` reads position ``t - (kernel - 1 - k) * dilation``, torch's
    ``Conv1d`` order) and ``conv_norm`` ``[hc_mult, H]``: only with the convolution.
    """

    wkv: jax.Array
    q_weight: jax.Array
    k_weight: jax.Array
    conv_weight: jax.Array | None = None
    conv_norm: jax.Array | None = None


def init_engram_params(
    key: jax.Array, config: EngramLayerConfig, dtype: jnp.dtype = jnp.bfloat16
) -> EngramParams:
    """Fresh weights: ``wkv`` ~ N(0, 1/engram_dim), unit norm gains, a small random conv."""
    hc, width = config.hc_mult, config.hidden_size
    k_wkv, k_conv = jax.random.split(key)
    wkv = jax.random.normal(k_wkv, (config.engram_dim, (hc + 1) * width), jnp.float32)
    wkv = (wkv * config.engram_dim**-0.5).astype(dtype)
    ones = jnp.ones((hc, width), dtype)
    if not config.conv_kernel:
        return EngramParams(wkv, ones, ones)
    conv = jax.random.normal(k_conv, (config.conv_kernel, hc, width), jnp.float32)
    conv = (conv * config.conv_kernel**-0.5).astype(dtype)
    return EngramParams(wkv, ones, ones, conv, ones)


def params_from_deepseek(
    wkv: np.ndarray,
    k_weight: np.ndarray,
    q_weight: np.ndarray,
    wkv_scale: np.ndarray | None = None,
    *,
    block: int = 32,
    dtype: jnp.dtype = jnp.bfloat16,
) -> EngramParams:
    """:class:`EngramParams` from a DeepSeek checkpoint's tensors of one Engram layer.

    ``wkv`` is ``layers.{L}.engram.wkv.weight`` ``[(hc_mult + 1) * H, engram_dim]``
    (fp8 e4m3 or already float); ``wkv_scale`` its block scales
    ``[rows / block, cols / block]`` (e8m0 or float), applied blockwise before
    the transpose; ``k_weight``/``q_weight`` the ``[hc_mult, H]`` gains.
    ``block`` is the scale block edge: 32 in DeepSeek-V4.1, whose ``wkv.scale``
    is ``[800, 192]`` for a ``[25600, 6144]`` ``wkv``.
    """
    weight = np.asarray(wkv).astype(np.float32)
    if weight.ndim != 2:
        raise ValueError(f"wkv must be 2-D [(hc_mult + 1) * H, engram_dim], got {weight.shape}")
    q = np.asarray(q_weight).astype(np.float32)
    k = np.asarray(k_weight).astype(np.float32)
    if q.shape != k.shape or q.ndim != 2:
        raise ValueError(
            f"q_weight and k_weight must both be [hc_mult, H], got {q.shape}, {k.shape}"
        )
    hc, width = q.shape
    if weight.shape[0] != (hc + 1) * width:
        raise ValueError(
            f"wkv has {weight.shape[0]} rows; hc_mult={hc}, H={width} needs {(hc + 1) * width}"
        )
    if wkv_scale is not None:
        rows, cols = weight.shape
        scale = np.asarray(wkv_scale).astype(np.float32)
        want = (-(-rows // block), -(-cols // block))
        if scale.shape != want:
            raise ValueError(
                f"wkv_scale must be {want} for {block}x{block} blocks, got {scale.shape}"
            )
        full = np.repeat(np.repeat(scale, block, axis=0), block, axis=1)[:rows, :cols]
        weight = weight * full
    return EngramParams(jnp.asarray(weight.T, dtype), jnp.asarray(q, dtype), jnp.asarray(k, dtype))


def token_mask_from_ids(ids: jax.Array) -> jax.Array:
    """True for tokens that have n-gram rows: any of their ``[..., n_cols]`` ids is not DEAD."""
    return jnp.any(jnp.asarray(ids) != DEAD_ID, axis=-1)


def init_conv_state(
    config: EngramLayerConfig, batch_shape: tuple[int, ...], dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """Zero conv history ``[*batch_shape, conv_history, hc_mult, H]`` for a fresh sequence."""
    if not config.conv_kernel:
        raise ValueError("this layer has no convolution (conv_kernel=0)")
    shape = (*batch_shape, config.conv_history, config.hc_mult, config.hidden_size)
    return jnp.zeros(shape, dtype)


# -- the layer -------------------------------------------------------------------


def _rms(x: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def _check_inputs(params: EngramParams, hidden, rows, token_mask, config) -> tuple[int, ...]:
    if not isinstance(config, EngramLayerConfig):
        raise TypeError(f"config must be an EngramLayerConfig, got {type(config).__name__}")
    hc, width = config.hc_mult, config.hidden_size
    want = {
        "wkv": (config.engram_dim, (hc + 1) * width),
        "q_weight": (hc, width),
        "k_weight": (hc, width),
    }
    if config.conv_kernel:
        want["conv_weight"] = (config.conv_kernel, hc, width)
        want["conv_norm"] = (hc, width)
    for name, shape in want.items():
        value = getattr(params, name)
        if value is None or tuple(value.shape) != shape:
            got = None if value is None else tuple(value.shape)
            raise ValueError(f"params.{name} must have shape {shape} for {config}, got {got}")
    tail = (hc, width) if hc > 1 else (width,)
    if tuple(hidden.shape[-len(tail) :]) != tail or hidden.ndim < len(tail):
        raise ValueError(
            f"hidden must end in {tail} (hc_mult={hc}, hidden_size={width}), got {hidden.shape}"
        )
    lead = tuple(hidden.shape[: hidden.ndim - len(tail)])
    if rows.ndim < 2 or rows.shape[-2] * rows.shape[-1] != config.engram_dim:
        raise ValueError(
            f"rows must be [..., n_cols, dim] with n_cols * dim = {config.engram_dim}, "
            f"got {rows.shape}"
        )
    if tuple(rows.shape[:-2]) != lead:
        raise ValueError(f"rows cover tokens {rows.shape[:-2]}, hidden covers {lead}")
    if token_mask is not None and tuple(token_mask.shape) != lead:
        raise ValueError(f"token_mask must have shape {lead}, got {token_mask.shape}")
    return lead


def _gated_value(params: EngramParams, h: jax.Array, rows: jax.Array, token_mask, config):
    """gate * value ``[..., hc, H]`` in float32; ``h`` is float32 ``[..., hc, H]``."""
    hc, width = config.hc_mult, config.hidden_size
    lead = h.shape[:-2]
    embedding = rows.reshape(*lead, config.engram_dim).astype(params.wkv.dtype)
    # kv stays float32; bf16 serving engines round it to bf16 first (a last-bit difference).
    kv = jnp.einsum("...e,ef->...f", embedding, params.wkv, preferred_element_type=jnp.float32)
    key = kv[..., : hc * width].reshape(*lead, hc, width)
    value = kv[..., hc * width :]
    # q and k gains fold into one weight on the dot product, as V4.1 inference does.
    gain = params.q_weight.astype(jnp.float32) * params.k_weight.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1) + config.norm_eps) * jax.lax.rsqrt(
        jnp.mean(jnp.square(key), axis=-1) + config.norm_eps
    )
    dot = jnp.sum(h * gain * key, axis=-1) * rstd * width**-0.5
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), _GATE_FLOOR)), dot))
    if token_mask is not None:
        gate = jnp.where(token_mask[..., None], gate, 0.0)
    return gate[..., None] * value[..., None, :]


def _conv_input(params: EngramParams, gated: jax.Array, config) -> jax.Array:
    return _rms(gated, config.conv_norm_eps) * params.conv_norm.astype(jnp.float32)


def _causal_conv(params: EngramParams, padded: jax.Array, steps: int, config) -> jax.Array:
    """SiLU(depthwise dilated conv) of the last ``steps`` positions of ``padded``.

    ``padded`` ``[..., S, hc, H]`` holds ``conv_history`` earlier positions before them.
    """
    kernel, dilation = config.conv_kernel, config.conv_dilation
    history = config.conv_history
    weight = params.conv_weight.astype(jnp.float32)
    total = jnp.zeros(padded.shape[:-3] + (steps,) + padded.shape[-2:], jnp.float32)
    for tap in range(kernel):
        start = history - (kernel - 1 - tap) * dilation
        total = total + weight[tap] * jax.lax.slice_in_dim(padded, start, start + steps, axis=-3)
    return jax.nn.silu(total)


def _as_copies(hidden: jax.Array, config) -> jax.Array:
    h = hidden.astype(jnp.float32)
    return h if config.hc_mult > 1 else h[..., None, :]


def _from_copies(out: jax.Array, like: jax.Array, config) -> jax.Array:
    out = out if config.hc_mult > 1 else out[..., 0, :]
    return out.astype(like.dtype)


def engram_layer(
    params: EngramParams,
    hidden: jax.Array,
    rows: jax.Array,
    token_mask: jax.Array | None = None,
    *,
    config: EngramLayerConfig,
) -> jax.Array:
    """``hidden`` with the Engram rows fused in (the module docstring has the formula).

    ``hidden``: ``[..., hc_mult, H]``, or ``[..., H]`` when ``hc_mult == 1``.
    ``rows``: ``[..., n_cols, dim]``, what :func:`engram_jax.lookup` returns.
    ``token_mask``: bool ``[...]``; False (tokens outside n-grams: padding,
    DEAD tokens, see :func:`token_mask_from_ids`) zeroes the gate, so those
    tokens pass through unchanged. Returns ``hidden``'s shape and dtype.

    With the convolution on, the axis just before the hidden axes is the
    sequence, and every sequence starts fresh (no earlier history); use
    :func:`engram_layer_step` to carry the history across decode steps.
    """
    _check_inputs(params, hidden, rows, token_mask, config)
    h = _as_copies(hidden, config)
    update = _gated_value(params, h, rows, token_mask, config)
    if config.conv_kernel:
        if h.ndim < 3:
            raise ValueError("the convolution needs a sequence axis before the hidden axes")
        conv_in = _conv_input(params, update, config)
        pad = [(0, 0)] * conv_in.ndim
        pad[-3] = (config.conv_history, 0)
        update = update + _causal_conv(params, jnp.pad(conv_in, pad), h.shape[-3], config)
    return _from_copies(h + update, hidden, config)


def engram_layer_step(
    params: EngramParams,
    hidden: jax.Array,
    rows: jax.Array,
    conv_state: jax.Array,
    token_mask: jax.Array | None = None,
    *,
    config: EngramLayerConfig,
) -> tuple[jax.Array, jax.Array]:
    """:func:`engram_layer` for the next ``T`` positions of sequences that carry conv history.

    ``hidden`` ``[*batch, T, (hc_mult,) H]``, ``rows`` ``[*batch, T, n_cols, dim]``,
    ``conv_state`` ``[*batch, conv_history, hc_mult, H]`` (from
    :func:`init_conv_state` or the previous step). Returns the new hidden and
    the new state; feeding a sequence in chunks gives the same result as
    :func:`engram_layer` on all of it. Only for layers with a convolution.
    """
    if not config.conv_kernel:
        raise ValueError("engram_layer_step carries conv history; this layer has no convolution")
    lead = _check_inputs(params, hidden, rows, token_mask, config)
    want = (*lead[:-1], config.conv_history, config.hc_mult, config.hidden_size)
    if not lead or tuple(conv_state.shape) != want:
        raise ValueError(f"conv_state must have shape {want}, got {conv_state.shape}")
    h = _as_copies(hidden, config)
    update = _gated_value(params, h, rows, token_mask, config)
    conv_in = _conv_input(params, update, config)
    padded = jnp.concatenate([conv_state.astype(jnp.float32), conv_in], axis=-3)
    update = update + _causal_conv(params, padded, h.shape[-3], config)
    new_state = jax.lax.slice_in_dim(padded, padded.shape[-3] - config.conv_history, None, axis=-3)
    return _from_copies(h + update, hidden, config), new_state.astype(conv_state.dtype)
