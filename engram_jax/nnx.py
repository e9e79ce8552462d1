"""engram_jax.nnx: the Engram layer as a Flax NNX module (``pip install "engram_jax[flax]"``).

:class:`Engram` holds one Engram layer's weights as ``nnx.Param``s and its
layout and table as static attributes; calling it hashes the token ids, looks
the rows up (or finishes a lookup :meth:`Engram.start` began earlier) and gates
them into the hidden state. The work is the framework-free functions'
(``hash_ngrams`` / ``hash_step``, ``lookup`` / ``lookup_start`` / ``lookup_done``,
``engram_layer``): same ids, rows and outputs, bit for bit. Not imported by
``import engram_jax``, so the core needs no Flax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError(
        'engram_jax.nnx needs Flax: pip install "engram_jax[flax]" (or pip install flax)'
    ) from exc

from engram_jax.hashing import hash_ngrams, hash_step
from engram_jax.hashing import init_state as init_hash_state
from engram_jax.hot_rows import HotRowCache
from engram_jax.layer import (
    EngramLayerConfig,
    EngramParams,
    engram_layer,
    engram_layer_step,
    init_conv_state,
    init_engram_params,
    token_mask_from_ids,
)
from engram_jax.layout import EngramLayout
from engram_jax.ops import LookupHandle, lookup, lookup_done, lookup_start
from engram_jax.sharded_table import ShardedTable
from engram_jax.table import EngramTable

__all__ = ["Engram", "EngramPrefetch", "EngramState"]

# Tables the module reads. Trainable tables (the training API's TrainableTable,
# rows in f32/bf16 plus optimizer state) will join this tuple: lookup and
# lookup_start take them as they are, and their rows' gradient is the cotangent
# of `rows` in `Engram.fuse`, which a train step hands to apply_gradients.
TABLE_TYPES: tuple[type, ...] = (EngramTable, ShardedTable)


class EngramState(NamedTuple):
    """What a sequence carries from one call to the next (a pytree).

    ``hash``: int32 ``[B, max_ngram_size - 1]``, the last token ids (as
    :func:`engram_jax.init_state`); ``conv``: ``[B, conv_history, hc_mult, H]``,
    the short convolution's history, ``None`` for a layer without one.
    """

    hash: jax.Array
    conv: jax.Array | None = None


class EngramPrefetch(NamedTuple):
    """A lookup in flight from :meth:`Engram.start` (a pytree): pass it to the call.

    ``handle`` is the :class:`~engram_jax.LookupHandle`, ``ids`` the layer's row
    ids ``[..., n_cols]`` (the token mask comes from them), ``state`` the state
    the start was given (``None`` for whole sequences) and ``hash`` the hash
    state after the tokens.
    """

    handle: LookupHandle
    ids: jax.Array
    state: EngramState | jax.Array | None
    hash: jax.Array | None


class Engram(nnx.Module):
    """One Engram layer: hash, look up, gate into the residual stream.

    Args:
        layout: the :class:`~engram_jax.EngramLayout` (static).
        table: this layer's table, an :class:`~engram_jax.EngramTable` or
            :class:`~engram_jax.ShardedTable` of ``layout.head_dim`` values per row
            (static: it is read inside jit, never copied into the module's state).
        hidden_size: the model width H.
        layer_id: which of ``layout.layer_ids`` this is (default: the only one).
        hc_mult, norm_eps, conv_kernel, conv_dilation: as
            :class:`~engram_jax.EngramLayerConfig`; ``engram_dim`` is
            ``layout.n_cols * layout.head_dim``.
        params: the weights, an :class:`~engram_jax.EngramParams` (e.g. from
            :func:`~engram_jax.params_from_deepseek`); else fresh ones from
            :func:`~engram_jax.init_engram_params` with ``rngs.params()``.
        param_dtype: dtype of fresh weights.
        order, cache, max_ctas, plan: lookup options, passed to ``lookup`` and
            ``lookup_start`` (``order=None`` keeps each one's default).

    Call it as ``layer(hidden, token_ids)`` on whole sequences (``token_ids``
    compressed ids ``[B, T]`` or ``[T]``, ``hidden`` ``[..., T, (hc_mult,) H]``) or
    ``layer(hidden, token_ids, state)`` to continue them (decode, chunked
    prefill), which also returns the new state. To hide the gather behind the
    layers before this one, ``p = layer.start(token_ids, state)`` early in the
    step and ``layer(hidden, prefetched=p)`` here (``README.md``, Prefetch, says
    where to put the two under jit).
    """

    def __init__(
        self,
        layout: EngramLayout,
        table: EngramTable | ShardedTable,
        hidden_size: int,
        *,
        layer_id: int | None = None,
        hc_mult: int = 1,
        norm_eps: float = 1e-6,
        conv_kernel: int = 0,
        conv_dilation: int = 1,
        params: EngramParams | None = None,
        rngs: nnx.Rngs | None = None,
        param_dtype: Any = jnp.bfloat16,
        order: str | None = None,
        cache: HotRowCache | None = None,
        max_ctas: int | None = None,
        plan: Any = None,
    ) -> None:
        if not isinstance(layout, EngramLayout):
            raise TypeError(f"layout must be an EngramLayout, got {type(layout).__name__}")
        if not isinstance(table, TABLE_TYPES):
            names = " or ".join(t.__name__ for t in TABLE_TYPES)
            raise TypeError(f"table must be an {names}, got {type(table).__name__}")
        if table.dim != layout.head_dim:
            raise ValueError(
                f"table rows hold {table.dim} values, layout.head_dim is {layout.head_dim}"
            )
        if layer_id is None:
            if layout.n_layers != 1:
                raise ValueError(f"the layout has layers {layout.layer_ids}: pass layer_id=")
            layer_id = layout.layer_ids[0]
        self.layout = layout
        self.table = table
        self.layer_id = int(layer_id)
        self.layer_index = layout.layer_index(layer_id)
        self.config = EngramLayerConfig(
            hidden_size,
            layout.n_cols * layout.head_dim,
            hc_mult=hc_mult,
            norm_eps=norm_eps,
            conv_kernel=conv_kernel,
            conv_dilation=conv_dilation,
        )
        options = {"order": order, "cache": cache, "max_ctas": max_ctas, "plan": plan}
        self.lookup_options = tuple((k, v) for k, v in options.items() if v is not None)
        if params is None:
            if rngs is None:
                raise ValueError("pass params= (e.g. params_from_deepseek(...)) or rngs=")
            params = init_engram_params(rngs.params(), self.config, param_dtype)
        _check_params(params, self.config)
        self.wkv = nnx.Param(jnp.asarray(params.wkv))
        self.q_weight = nnx.Param(jnp.asarray(params.q_weight))
        self.k_weight = nnx.Param(jnp.asarray(params.k_weight))
        if self.config.conv_kernel:
            self.conv_weight = nnx.Param(jnp.asarray(params.conv_weight))
            self.conv_norm = nnx.Param(jnp.asarray(params.conv_norm))

    # -- the parts ---------------------------------------------------------------

    def params(self) -> EngramParams:
        """The current weights as the functional layer's :class:`~engram_jax.EngramParams`."""
        if not self.config.conv_kernel:
            return EngramParams(self.wkv[...], self.q_weight[...], self.k_weight[...])
        return EngramParams(
            self.wkv[...],
            self.q_weight[...],
            self.k_weight[...],
            self.conv_weight[...],
            self.conv_norm[...],
        )

    def init_state(
        self, batch_size: int, *, history: Any = None, dtype: Any = jnp.float32
    ) -> EngramState:
        """A fresh state for ``batch_size`` sequences (``history``: their known last
        tokens, as :func:`engram_jax.init_state`); the conv history starts at zero."""
        hashed = init_hash_state(self.layout, batch_size, history=history)
        if not self.config.conv_kernel:
            return EngramState(hashed)
        return EngramState(hashed, init_conv_state(self.config, (batch_size,), dtype))

    def hash(
        self, token_ids: Any, state: EngramState | jax.Array | None = None, **hash_options: Any
    ) -> tuple[jax.Array, jax.Array | None]:
        """This layer's row ids ``[..., n_cols]`` and the hash state after the tokens
        (``None`` without a state). ``hash_options``: ``segment_ids``, ``positions``."""
        if state is None:
            ids = hash_ngrams(self.layout, token_ids, **hash_options)
            return ids[..., self.layer_index, :], None
        hashed = state.hash if isinstance(state, EngramState) else state
        ids, hashed = hash_step(self.layout, hashed, token_ids, **hash_options)
        return ids[..., self.layer_index, :], hashed

    def rows(self, ids: jax.Array) -> jax.Array:
        """The table's rows for ``ids``: bf16 ``[..., n_cols, head_dim]``."""
        return lookup(self.table, ids, **dict(self.lookup_options))

    def start(
        self,
        token_ids: Any,
        state: EngramState | jax.Array | None = None,
        *,
        after: LookupHandle | Sequence[LookupHandle] = (),
        **hash_options: Any,
    ) -> EngramPrefetch:
        """Hash ``token_ids`` and start their lookup in the background
        (:func:`engram_jax.lookup_start`); ``after``: handles to gather after."""
        ids, hashed = self.hash(token_ids, state, **hash_options)
        handle = lookup_start(self.table, ids, after=after, **dict(self.lookup_options))
        return EngramPrefetch(handle, ids, state, hashed)

    def fuse(
        self, hidden: jax.Array, rows: jax.Array, ids: jax.Array, conv: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array | None]:
        """The gate alone: ``hidden`` with ``rows`` fused in, and the conv history
        after them (``None`` when ``conv`` is). Tokens whose ``ids`` are all DEAD
        pass through. A train step that also trains the table differentiates
        ``rows`` here."""
        mask = token_mask_from_ids(ids)
        if conv is None:
            return engram_layer(self.params(), hidden, rows, mask, config=self.config), None
        return engram_layer_step(self.params(), hidden, rows, conv, mask, config=self.config)

    # -- the layer ---------------------------------------------------------------

    def __call__(
        self,
        hidden: jax.Array,
        token_ids: Any = None,
        state: EngramState | jax.Array | None = None,
        *,
        prefetched: EngramPrefetch | None = None,
        **hash_options: Any,
    ) -> jax.Array | tuple[jax.Array, EngramState | jax.Array]:
        """``hidden`` with the Engram rows of ``token_ids`` fused in.

        Without ``state``: whole sequences from their start; returns the new hidden.
        With ``state`` (:meth:`init_state`, or the int32 array of
        :func:`engram_jax.init_state` for a layer without convolution): the next
        tokens of those sequences; returns ``(hidden, new_state)``, the state of the
        same kind. With ``prefetched`` (from :meth:`start`, given the token ids and
        state instead): the same, with the rows that start gathered.
        """
        if prefetched is None:
            if token_ids is None:
                raise ValueError("pass token_ids, or prefetched= from Engram.start")
            ids, hashed = self.hash(token_ids, state, **hash_options)
            rows = self.rows(ids)
        else:
            if token_ids is not None or state is not None or hash_options:
                raise ValueError("with prefetched=, the token ids and state go to Engram.start")
            ids, state, hashed = prefetched.ids, prefetched.state, prefetched.hash
            rows = lookup_done(prefetched.handle)
        if state is None:
            return self.fuse(hidden, rows, ids)[0]
        if not isinstance(state, EngramState):
            if self.config.conv_kernel:
                raise ValueError(
                    "this layer has a convolution: pass layer.init_state(B), which carries "
                    "its history too"
                )
            return self.fuse(hidden, rows, ids)[0], hashed
        if self.config.conv_kernel and state.conv is None:
            raise ValueError("this layer has a convolution: the state needs its conv history")
        out, conv = self.fuse(hidden, rows, ids, state.conv if self.config.conv_kernel else None)
        return out, EngramState(hashed, conv)


def _check_params(params: EngramParams, config: EngramLayerConfig) -> None:
    if not isinstance(params, EngramParams):
        raise TypeError(f"params must be an EngramParams, got {type(params).__name__}")
    hc, width = config.hc_mult, config.hidden_size
    want = {
        "wkv": (config.engram_dim, (hc + 1) * width),
        "q_weight": (hc, width),
        "k_weight": (hc, width),
    }
    if config.conv_kernel:
        want |= {"conv_weight": (config.conv_kernel, hc, width), "conv_norm": (hc, width)}
    for name, shape in want.items():
        value = getattr(params, name)
        got = None if value is None else tuple(np.shape(value))
        if got != shape:
            raise ValueError(f"params.{name} must have shape {shape} for {config}, got {got}")
