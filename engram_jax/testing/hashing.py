"""numpy references for the Engram layout and n-gram hashing, in plain Python ints.

DeepSeek's construction step by step (trial-division primality, one layer
at a time) and hashing straight from the definition, one token at a time:
the tests compare :class:`~engram_jax.EngramLayout` and the hash kernels
against these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from engram_jax._format import DEAD_ID

if TYPE_CHECKING:  # the references take a layout but build nothing from its module
    from engram_jax.layout import EngramLayout


def _is_prime_trial(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def layout_reference(
    engram_vocab_size: int | Sequence[int],
    layer_ids: Sequence[int],
    max_ngram_size: int,
    n_heads: int,
    compressed_vocab_size: int,
    seed: int = 0,
) -> tuple[list, list]:
    """DeepSeek's construction, step by step: (primes ``[layer][order][head]``,
    multipliers ``[layer][s]``), with trial-division primality."""
    orders = max_ngram_size - 1
    starts = (
        [engram_vocab_size] * orders
        if isinstance(engram_vocab_size, int)
        else list(engram_vocab_size)
    )
    seen: set[int] = set()
    primes = []
    for _ in layer_ids:
        per_order = []
        for o in range(orders):
            heads, start = [], starts[o] - 1
            for _ in range(n_heads):
                candidate = start + 1
                while not (_is_prime_trial(candidate) and candidate not in seen):
                    candidate += 1
                seen.add(candidate)
                heads.append(candidate)
                start = candidate
            per_order.append(heads)
        primes.append(per_order)
    bound = max(1, (2**63 - 1) // compressed_vocab_size // 2)
    multipliers = []
    for layer in layer_ids:
        rng = np.random.default_rng(seed + 10007 * layer)
        r = rng.integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
        multipliers.append([int(v) * 2 + 1 for v in r])
    return primes, multipliers


def _hash_window(layout, window: list[int]) -> list[list[int]]:
    """Row ids ``[layer][col]`` of one token from its ids ``window[s]`` (s = 0..N-1)."""
    out = []
    for li in range(len(layout.layer_ids)):
        row, h, offset = [], 0, 0
        for s in range(layout.max_ngram_size):
            h ^= window[s] * int(layout.multipliers[li][s])
            if s >= 1:
                for k in range(layout.n_heads):
                    prime = int(layout.primes[li][s - 1][k])
                    row.append(h % prime + offset)
                    offset += prime
        out.append(row)
    return out


def _window_from_history(layout, token: int, older: list[int], reach: int) -> list[int] | None:
    """ids hashed for a token whose sequence's earlier ids are ``older`` (newest
    first, as far as known) and of which ``reach`` precede it in the sequence."""
    if token == DEAD_ID:
        return None
    vocab, pad = layout.compressed_vocab_size, layout.pad_id

    def as_input(v: int) -> int:
        return v if 0 <= v < vocab else pad

    window, blocked = [as_input(token)], False
    for s in range(1, layout.max_ngram_size):
        if s > reach or s > len(older) or older[s - 1] == DEAD_ID:
            blocked = True
        window.append(pad if blocked else as_input(older[s - 1]))
    return window


def hash_sequence_reference(layout: EngramLayout, tokens: ArrayLike) -> np.ndarray:
    """Row ids ``[T, n_layers, n_cols]`` of ONE whole sequence of compressed ids,
    straight from the definition (DEAD = -1; ids outside the vocabulary hash as pad)."""
    tokens = [int(v) for v in np.asarray(tokens).reshape(-1)]
    out = np.full((len(tokens), len(layout.layer_ids), layout.n_cols), DEAD_ID, dtype=np.int64)
    for t, token in enumerate(tokens):
        older = tokens[:t][::-1]
        window = _window_from_history(layout, token, older, reach=t)
        if window is not None:
            out[t] = _hash_window(layout, window)
    return out


def hash_ngrams_reference(
    layout: EngramLayout,
    tokens: ArrayLike,
    segment_ids: ArrayLike,
    positions: ArrayLike,
    state: ArrayLike | None = None,
) -> np.ndarray:
    """The packed / stateful contract of ``hash_ngrams`` for 1-D inputs: each token's
    history is its run of the call (same segment, consecutive positions) continued
    by its state row, cut at position 0. ``state=None``: nothing before the call."""
    tokens = [int(v) for v in np.asarray(tokens).reshape(-1)]
    segs = [int(v) for v in np.asarray(segment_ids).reshape(-1)]
    pos = [int(v) for v in np.asarray(positions).reshape(-1)]
    rows = [] if state is None else [[int(v) for v in r] for r in np.asarray(state)]
    out = np.full((len(tokens), len(layout.layer_ids), layout.n_cols), DEAD_ID, dtype=np.int64)
    for t, token in enumerate(tokens):
        older = []
        j = t - 1
        while j >= 0 and segs[j] == segs[t] and pos[j] == pos[t] - (t - j):
            older.append(tokens[j])
            j -= 1
        if 0 <= segs[t] < len(rows):
            older.extend(rows[segs[t]][::-1])
        window = _window_from_history(layout, token, older, reach=pos[t])
        if window is not None:
            out[t] = _hash_window(layout, window)
    return out
