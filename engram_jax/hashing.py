"""engram_jax.hashing: compressed token ids -> Engram row ids, inside jit.

token ids (+ which sequence, + position, + lookback state) -> the
``engram_ngram_hash`` FFI target (CPU or CUDA; exact 64-bit products and XOR
whatever ``jax_enable_x64`` says) -> int32 row ids ``[T, n_layers, n_cols]``
of each layer's concatenated table, ready for :func:`engram_jax.lookup`.
The lookback state (last ``max_ngram_size - 1`` ids of each sequence) lets
decode, chunked prefill, speculative drafts (hashed from the committed state,
committed once verified) and sequences restored from a known history hash
exactly as the whole sequence would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from engram_jax import _native
from engram_jax._format import DEAD_ID, narrow_ids
from engram_jax.layout import EngramLayout

__all__ = ["commit_state", "hash_draft", "hash_ngrams", "hash_step", "init_state", "update_state"]


@functools.lru_cache(maxsize=64)
def _layout_operands(layout: EngramLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Small operands rather than attributes: any layout size fits, XLA keeps them
    # on the device as constants of the compiled program, and the CUDA handler
    # needs no host-to-device copy (so it stays CUDA-graph safe). The 64-bit
    # multipliers travel as 32-bit halves because default jax has no int64.
    mult = layout.multipliers.astype(np.uint64)
    halves = np.stack([mult & 0xFFFFFFFF, mult >> 32], axis=-1).astype(np.uint32)
    return halves, layout.column_sizes.astype(np.int32), layout.offsets.astype(np.int32)


def _check_layout(layout: EngramLayout) -> None:
    if not isinstance(layout, EngramLayout):
        raise TypeError(f"layout must be an EngramLayout, got {type(layout).__name__}")


def _int_array(name: str, x):
    """x as an integer array (numpy when it came as a Python/numpy value); dtype checked."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        x = np.asarray(x)
        if x.size == 0:
            x = x.astype(np.int32)
    dtype = x.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must hold integers, got {dtype}")
    return x


def _concrete(x) -> np.ndarray | None:
    """The values of x when they are known now; None inside a trace."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _to_int32(x, out_of_range: int) -> jax.Array:
    """``x`` as a jax int32 array; values a wider type holds past int32 become ``out_of_range``."""
    return jnp.asarray(narrow_ids(x, out_of_range))


def _check_ids(name: str, values: np.ndarray | None, vocab: int) -> None:
    if values is None or values.size == 0:
        return
    bad = (values < -1) | (values >= vocab)
    if np.any(bad):
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{name}{list(where)} = {int(values[where])} is not a compressed id: ids must lie in "
            f"[0, {vocab}) or be -1 (DEAD); compress tokenizer ids with TokenCompressor first"
        )


def init_state(
    layout: EngramLayout, num_sequences: int, history: ArrayLike | None = None
) -> jax.Array:
    """Lookback state for ``num_sequences`` sequences: int32 ``[B, max_ngram_size - 1]``.

    Rows hold each sequence's last ids, oldest first. Without ``history`` every
    row is all pad, which hashes exactly like the start of a sequence.
    ``history`` ``[B, L]`` (compressed ids, any ``L``) gives the state that
    hashing those tokens from a fresh row would have left: the last ids of a
    prefix-cache hit, a disaggregated prefill or a restored session, known but
    never hashed here. ``DEAD_ID`` marks unknown positions (left-pad rows of
    fewer known tokens with it): like a DEAD token in the sequence, it blocks
    every n-gram reaching over it. ``history`` may be traced; its concrete ids
    are checked like ``token_ids``.
    """
    _check_layout(layout)
    if not isinstance(num_sequences, (int, np.integer)) or num_sequences < 0:
        raise ValueError(f"num_sequences must be a non-negative int, got {num_sequences!r}")
    fresh = jnp.full((int(num_sequences), layout.state_width), layout.pad_id, dtype=jnp.int32)
    if history is None:
        return fresh
    history = _int_array("history", history)
    if history.ndim != 2 or history.shape[0] != num_sequences:
        raise ValueError(
            f"history must be [num_sequences, L] = [{num_sequences}, L] (any L, DEAD_ID where "
            f"unknown), got shape {history.shape}"
        )
    _check_ids("history", _concrete(history), layout.compressed_vocab_size)
    history = _to_int32(history, layout.compressed_vocab_size)
    return jnp.concatenate([fresh, history], axis=1)[:, history.shape[1] :]


def _prepare(layout, token_ids, segment_ids, positions, state, who: str, name: str = "token_ids"):
    """Flattened int32 (tokens, segments, positions, state) plus the output's leading shape."""
    _check_layout(layout)
    vocab = layout.compressed_vocab_size
    width = layout.state_width
    tokens = _int_array(name, token_ids)
    if tokens.ndim not in (1, 2):
        raise ValueError(f"{name} must be [T] or [B, T], got shape {tokens.shape}")
    lead = tokens.shape
    _check_ids(name, _concrete(tokens), vocab)

    if state is not None:
        state = _int_array("state", state)
        if state.ndim != 2 or state.shape[1] != width:
            raise ValueError(f"state must be [sequences, {width}], got shape {state.shape}")
        _check_ids("state", _concrete(state), vocab)
        state = _to_int32(state, vocab)

    if tokens.ndim == 2:
        rows, length = tokens.shape
        if segment_ids is not None:
            raise ValueError(
                "segment_ids go with 1-D token_ids (packed sequences); with [B, T] token_ids "
                "row b is sequence b"
            )
        if state is not None and state.shape[0] != rows:
            raise ValueError(f"state has {state.shape[0]} rows, {name} {rows} sequences")
        segments = np.repeat(np.arange(rows, dtype=np.int32), length)
        if positions is not None:
            positions = _int_array("positions", positions)
            if positions.shape != lead:
                raise ValueError(
                    f"positions must have the shape of token_ids {lead}, got {positions.shape}"
                )
            positions = positions.reshape(-1)
        else:
            base = 0 if state is None else width
            positions = np.tile(np.arange(length, dtype=np.int32) + base, rows)
        tokens = tokens.reshape(-1)
    else:
        (length,) = tokens.shape
        if segment_ids is not None:
            segment_ids = _int_array("segment_ids", segment_ids)
            if segment_ids.shape != lead:
                raise ValueError(f"segment_ids must be [{length}], got shape {segment_ids.shape}")
        elif state is not None:
            if state.shape[0] == 1:
                segment_ids = np.zeros(length, dtype=np.int32)
            elif state.shape[0] == length:
                segment_ids = np.arange(length, dtype=np.int32)  # decode: one token per sequence
            else:
                raise ValueError(
                    f"{who}: with a state of {state.shape[0]} sequences and {length} tokens, "
                    "say which sequence each token belongs to (segment_ids=)"
                )
        else:
            segment_ids = np.zeros(length, dtype=np.int32)
        if positions is not None:
            positions = _int_array("positions", positions)
            if positions.shape != lead:
                raise ValueError(f"positions must be [{length}], got shape {positions.shape}")
        segments = segment_ids

    if positions is not None:
        known = _concrete(positions)
        if known is not None and known.size and known.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(known.min())}")
        positions = _to_int32(positions, 2**31 - 1)
    segments = _to_int32(segments, -1)

    if state is not None:
        seg_known, tok_known = _concrete(segments), _concrete(tokens)
        if seg_known is not None and tok_known is not None:
            live = tok_known != DEAD_ID
            bad = live & ((seg_known < 0) | (seg_known >= state.shape[0]))
            if np.any(bad):
                i = int(np.argmax(bad))
                raise ValueError(
                    f"segment_ids[{i}] = {int(seg_known[i])} names no row of the "
                    f"{state.shape[0]}-row state (only DEAD tokens may use other segment ids)"
                )
            in_range = (seg_known >= 0) & (seg_known < state.shape[0])
            starts = np.r_[True, seg_known[1:] != seg_known[:-1]] & in_range
            runs = seg_known[starts]
            if runs.size != np.unique(runs).size:
                raise ValueError(
                    "each sequence's tokens must be one contiguous run of the call "
                    f"(segment_ids {runs.tolist()} come back after a gap)"
                )
    tokens = _to_int32(tokens, vocab)
    return tokens, segments, positions, state, lead


def _run_positions(segments: jax.Array) -> jax.Array:
    """Position of each token inside its run of equal segment ids (0 at each run start)."""
    n = segments.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    start = jnp.concatenate([jnp.ones((1,), bool), segments[1:] != segments[:-1]])
    run_start = jax.lax.cummax(jnp.where(start, index, 0))
    return index - run_start


def hash_ngrams(
    layout: EngramLayout,
    token_ids: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    positions: ArrayLike | None = None,
    state: ArrayLike | None = None,
) -> jax.Array:
    """Engram row ids of compressed token ids: int32 ``[..., n_layers, n_cols]``.

    Column ``c = (n - 2) * n_heads + k`` holds head ``k`` of order ``n``; the
    ids are global rows of each layer's concatenated table (what
    :func:`engram_jax.lookup` reads). A DEAD token (``-1``) gets DEAD_ID
    (``-1``) in every column, and every n-gram reaching over a DEAD token
    uses the pad id for it and everything older.

    Forms:

    - ``token_ids`` ``[T]``, nothing else: one sequence from its start.
    - ``token_ids`` ``[T]`` + ``segment_ids`` ``[T]``: packed sequences; each
      change of segment id starts a sequence, so no n-gram crosses two.
    - ``token_ids`` ``[B, T]``: row ``b`` is sequence ``b``.
    - with ``state`` ``[B, max_ngram_size - 1]`` (see :func:`init_state`,
      :func:`update_state`): the call continues each sequence; ``segment_ids``
      then index the state's rows (defaults: all 0 when ``B == 1``,
      ``arange(B)`` when there is one token per sequence, i.e. decode), and
      each sequence's tokens must be one contiguous run of the call. Hashing
      with the state equals hashing the whole sequence at once.
    - ``positions`` (optional, shape of ``token_ids``): each token's position
      in its sequence; anything before position 0 hashes as pad, whatever the
      state holds, and a token only continues the token before it in the call
      if their positions are consecutive.

    Bad input: concrete ids outside ``[0, compressed_vocab_size)`` other than
    -1, negative positions, and segment ids that name no state row raise
    ``ValueError`` before anything compiles (checking a jax array's values
    waits for it). Inside ``jit`` the values are unknown: out-of-vocabulary
    ids hash as the pad id, and a segment id that names no state row reads
    its history as pad.

    ``vmap`` maps the call sequentially; pack a batch with ``segment_ids`` or
    pass it as ``[B, T]`` for one kernel launch instead.
    """
    return _hash(layout, *_prepare(layout, token_ids, segment_ids, positions, state, "hash_ngrams"))


def _hash(layout: EngramLayout, tokens, segments, pos, state, lead) -> jax.Array:
    out_shape = lead + (layout.n_layers, layout.n_cols)
    if tokens.shape[0] == 0:
        return jnp.zeros(out_shape, jnp.int32)
    _native.ensure_registered()
    return _hash_core(layout, tokens, segments, pos, state).reshape(out_shape)


# One compiled program per (layout, shapes): eager calls cost one dispatch, not
# one per jnp op; inside an outer jit this simply inlines.
@functools.partial(jax.jit, static_argnums=0)
def _hash_core(layout: EngramLayout, tokens, segments, pos, state) -> jax.Array:
    if pos is None:
        pos = (
            _run_positions(segments)
            if state is None
            else (jnp.arange(tokens.shape[0], dtype=jnp.int32) + layout.state_width)
        )
    if state is None:
        # Nothing before this call: no token reaches past its run start, so a
        # one-row pad state is never read for history that matters.
        state = jnp.full((1, layout.state_width), layout.pad_id, jnp.int32)
    mult, primes, offsets = (jnp.asarray(a) for a in _layout_operands(layout))
    call = jax.ffi.ffi_call(
        "engram_ngram_hash",
        jax.ShapeDtypeStruct((tokens.shape[0], layout.n_layers, layout.n_cols), jnp.int32),
        vmap_method="sequential",
    )
    return call(
        tokens,
        segments,
        pos,
        state,
        mult,
        primes,
        offsets,
        pad_id=np.int64(layout.pad_id),
        vocab_size=np.int64(layout.compressed_vocab_size),
    )


def update_state(
    layout: EngramLayout,
    state: ArrayLike,
    token_ids: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    positions: ArrayLike | None = None,
) -> jax.Array:
    """The lookback state after ``token_ids`` (same forms as :func:`hash_ngrams`).

    Row ``b`` becomes the last ``max_ngram_size - 1`` ids of sequence ``b``:
    its old row followed by this call's tokens of segment ``b`` (DEAD tokens
    kept as ``-1``, so they keep blocking n-grams). Rows with no token in the
    call are unchanged; tokens whose segment id names no row (padding) are
    ignored. With ``positions``, entries before the sequence start become pad.
    Pure ``jnp`` (integer selects only), usable inside ``jit``.
    """
    if state is None:
        raise ValueError("update_state needs a state; start from init_state(layout, num_sequences)")
    tokens, segments, pos, state, _ = _prepare(
        layout, token_ids, segment_ids, positions, state, "update_state"
    )
    if tokens.shape[0] == 0 or state.shape[0] == 0:
        return state
    return _update_core(layout, state, tokens, segments, pos)


@functools.partial(jax.jit, static_argnums=0)
def _update_core(layout: EngramLayout, state, tokens, segments, pos) -> jax.Array:
    rows, width = state.shape
    n = tokens.shape[0]
    index = jnp.arange(n, dtype=jnp.int32)
    valid = (segments >= 0) & (segments < rows)
    slot = jnp.where(valid, segments, rows)  # an extra row collects the ignored tokens
    count = jnp.zeros(rows + 1, jnp.int32).at[slot].add(1)[:rows]
    last = jnp.full(rows + 1, -1, jnp.int32).at[slot].max(index)[:rows]
    w = jnp.arange(width, dtype=jnp.int32)[None, :]
    # Entry w (oldest first) is the (width - w)-th newest id of old row ++ new tokens.
    from_old = w + count[:, None]
    take = jnp.clip(last[:, None] - (width - 1 - w), 0, n - 1)
    new = jnp.where(
        from_old < width,
        jnp.take_along_axis(state, jnp.clip(from_old, 0, width - 1), axis=1),
        tokens[take],
    )
    if pos is not None:
        last_pos = pos[jnp.clip(last, 0, n - 1)]
        before_start = (count[:, None] > 0) & (last_pos[:, None] - (width - 1 - w) < 0)
        new = jnp.where(before_start, layout.pad_id, new)
    return new


def hash_step(
    layout: EngramLayout,
    state: ArrayLike,
    token_ids: ArrayLike,
    *,
    segment_ids: ArrayLike | None = None,
    positions: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(hash_ngrams(..., state=state), update_state(...))`` in one call: a decode or
    chunked-prefill step."""
    ids = hash_ngrams(layout, token_ids, segment_ids=segment_ids, positions=positions, state=state)
    return ids, update_state(layout, state, token_ids, segment_ids=segment_ids, positions=positions)


# -- speculative decoding: hash a draft from the committed state, commit what is accepted


def _prepare_draft(layout, state, draft_tokens, who: str):
    """_prepare for ``[B, K]`` draft tokens continuing a ``[B, W]`` state."""
    if state is None:
        raise ValueError(
            f"{who} needs the committed state (from init_state, hash_step or commit_state)"
        )
    draft = _int_array("draft_tokens", draft_tokens)
    if draft.ndim != 2:
        raise ValueError(
            f"draft_tokens must be [B, K] (row b continues state row b), got shape {draft.shape}"
        )
    return _prepare(layout, draft, None, None, state, who, name="draft_tokens")


def hash_draft(layout: EngramLayout, state: ArrayLike, draft_tokens: ArrayLike) -> jax.Array:
    """Row ids ``[B, K, n_layers, n_cols]`` of ``K`` speculative tokens per sequence.

    Row ``b`` equals hashing sequence ``b``'s committed history (what ``state``
    holds) followed by ``draft_tokens[b]``, as the whole sequence would. The
    state is not advanced: once the draft is verified, :func:`commit_state`
    keeps the accepted tokens. ``draft_tokens`` are the tokens the verify pass
    feeds, e.g. the last sampled token followed by the drafter's guesses; DEAD
    tokens may pad rows of shorter drafts. Same checks as :func:`hash_ngrams`.
    """
    return _hash(layout, *_prepare_draft(layout, state, draft_tokens, "hash_draft"))


def commit_state(
    layout: EngramLayout, state: ArrayLike, draft_tokens: ArrayLike, num_accepted: ArrayLike
) -> jax.Array:
    """The state after the first ``num_accepted[b]`` tokens of ``draft_tokens[b]``.

    ``num_accepted`` int ``[B]`` in ``0..K`` (0 leaves row ``b`` as it was);
    it may be traced, so one compiled step serves every acceptance pattern.
    Equals :func:`update_state` with each row's accepted prefix. Concrete
    counts outside ``0..K`` raise ``ValueError``; inside ``jit`` they are
    clipped to ``0..K``.
    """
    tokens, _, _, state, (rows, k) = _prepare_draft(layout, state, draft_tokens, "commit_state")
    accepted = _int_array("num_accepted", num_accepted)
    if accepted.shape != (rows,):
        raise ValueError(
            f"num_accepted must be [{rows}] (one count per draft row), got shape {accepted.shape}"
        )
    known = _concrete(accepted)
    if known is not None and known.size:
        bad = (known < 0) | (known > k)
        if np.any(bad):
            i = int(np.argmax(bad))
            raise ValueError(
                f"num_accepted[{i}] = {int(known[i])} is outside 0..{k} (the draft has {k} "
                "tokens per row)"
            )
    if rows == 0 or k == 0:
        return state
    return _commit_core(state, tokens.reshape(rows, k), _to_int32(accepted, k))


@jax.jit
def _commit_core(state, draft, accepted) -> jax.Array:
    # Row b's new state is the W ids of [state[b], draft[b]] that end after
    # draft token accepted[b]: a gather at a per-row offset, static shapes.
    width, k = state.shape[1], draft.shape[1]
    start = jnp.clip(accepted, 0, k)[:, None] + jnp.arange(width, dtype=jnp.int32)
    return jnp.take_along_axis(jnp.concatenate([state, draft], axis=1), start, axis=1)
