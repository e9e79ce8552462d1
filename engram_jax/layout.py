"""EngramLayout and TokenCompressor: DeepSeek's Engram table layout and token compression.

The layout fixes, for each Engram layer, the prime table size of every hash
column (orders 2..max_ngram_size x heads), where each column starts in the
layer's concatenated table, and the odd 64-bit hash multipliers; the
compressor folds tokenizer ids that normalise to the same text into one id.
Both reproduce DeepSeek's reference construction exactly, so real DeepSeek
Engram checkpoints line up row for row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from engram_jax._format import BLOCK_SIZE, INT32_MAX, MAX_DIM, narrow_ids

INT64_MAX = 2**63 - 1
# DeepSeek seeds each layer's multiplier generator with seed + LAYER_SEED_STRIDE * layer_id.
LAYER_SEED_STRIDE = 10007
# Miller-Rabin with these bases is exact for every n < 3.3e24.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin primality test, exact for all n < 3.3e24."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_unused_prime(after: int, used: set[int]) -> int:
    candidate = after + 1
    while candidate in used or not is_prime(candidate):
        candidate += 1
    return candidate


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return int(value)


class EngramLayout:
    """DeepSeek's Engram hash layout for a set of layers.

    Args:
        engram_vocab_size: where the prime search starts for every order
            (DeepSeek-V4.1: 16,000,000); a sequence gives one start per order
            (orders 2..max_ngram_size), as DeepSeek's first demo does.
        layer_ids: the model layers that carry an Engram table, in order.
        max_ngram_size: the longest n-gram; orders are 2..max_ngram_size.
        n_heads: hash heads per order.
        head_dim: values per table row: a multiple of 32 up to 16,384 (the
            table format keeps one scale byte per 32 values).
        compressed_vocab_size: size of the compressed token vocabulary.
        pad_id: the *compressed* pad id (what the compressor maps the
            tokenizer's pad token to).
        seed: DeepSeek's multiplier seed (0 in every released model).

    Attributes (numpy, int64): ``primes`` ``[n_layers, n_orders, n_heads]``;
    ``column_sizes`` ``[n_layers, n_cols]`` (the primes, column ``c = (n-2)*n_heads + k``);
    ``offsets`` ``[n_layers, n_cols]``: each column's first row in its layer's table;
    ``multipliers`` ``[n_layers, max_ngram_size]``. ``num_embeddings`` is a tuple
    with each layer table's row count (the sum of its primes). ``n_cols``
    (``(max_ngram_size - 1) * n_heads``) is the number of hash columns, so a
    layer's flattened rows are ``n_cols * head_dim`` wide (the Engram layer's
    ``engram_dim``); ``n_orders``, ``n_layers`` and ``layer_index(layer_id)``
    (a layer's position in ``layer_ids``) go with it.

    Layouts are immutable, compare and hash by their arguments, and are static
    under ``jax.jit``.
    """

    def __init__(
        self,
        engram_vocab_size: int | Sequence[int],
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        head_dim: int,
        compressed_vocab_size: int,
        pad_id: int,
        seed: int = 0,
    ) -> None:
        max_ngram_size = _as_int("max_ngram_size", max_ngram_size)
        if max_ngram_size < 2:
            raise ValueError(f"max_ngram_size must be >= 2 (orders 2..N), got {max_ngram_size}")
        n_orders = max_ngram_size - 1
        if isinstance(engram_vocab_size, (int, np.integer)) and not isinstance(
            engram_vocab_size, bool
        ):
            starts = (int(engram_vocab_size),) * n_orders
        else:
            starts = tuple(_as_int("engram_vocab_size[i]", v) for v in engram_vocab_size)
            if len(starts) != n_orders:
                raise ValueError(
                    f"engram_vocab_size needs one value per order (2..{max_ngram_size}): "
                    f"{n_orders} values, got {len(starts)}"
                )
        if any(v < 2 for v in starts):
            raise ValueError(f"engram_vocab_size must be >= 2, got {engram_vocab_size!r}")
        if isinstance(layer_ids, (int, np.integer)):
            raise TypeError("layer_ids must be a sequence of ints, e.g. (1, 14)")
        layer_ids = tuple(_as_int("layer_ids[i]", v) for v in layer_ids)
        if not layer_ids:
            raise ValueError("layer_ids must name at least one layer")
        if len(set(layer_ids)) != len(layer_ids) or min(layer_ids) < 0:
            raise ValueError(f"layer_ids must be distinct non-negative ints, got {layer_ids}")
        n_heads = _as_int("n_heads", n_heads)
        if n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got {n_heads}")
        head_dim = _as_int("head_dim", head_dim)
        if head_dim < 1 or head_dim % BLOCK_SIZE or head_dim > MAX_DIM:
            # A table row holds one UE8M0 scale per 32 values, so no table could hold others.
            raise ValueError(
                f"head_dim (values per table row) must be a positive multiple of {BLOCK_SIZE} "
                f"up to {MAX_DIM}, got {head_dim}"
            )
        compressed_vocab_size = _as_int("compressed_vocab_size", compressed_vocab_size)
        if not 1 <= compressed_vocab_size <= INT32_MAX:
            raise ValueError(
                f"compressed_vocab_size must be in [1, 2**31 - 1], got {compressed_vocab_size}"
            )
        pad_id = _as_int("pad_id", pad_id)
        if not 0 <= pad_id < compressed_vocab_size:
            raise ValueError(
                f"pad_id is a compressed id and must be in [0, {compressed_vocab_size}), "
                f"got {pad_id}"
            )
        seed = _as_int("seed", seed)

        self._args = (
            starts,
            layer_ids,
            max_ngram_size,
            n_heads,
            head_dim,
            compressed_vocab_size,
            pad_id,
            seed,
        )
        self.engram_vocab_size = starts
        self.layer_ids = layer_ids
        self.max_ngram_size = max_ngram_size
        self.n_orders = n_orders
        self.n_heads = n_heads
        self.n_cols = n_orders * n_heads
        self.n_layers = len(layer_ids)
        self.head_dim = head_dim
        self.compressed_vocab_size = compressed_vocab_size
        self.pad_id = pad_id
        self.seed = seed

        # Primes: layers, then orders, then heads; each order searches upward from
        # its start, skipping every prime an earlier (layer, order, head) took.
        used: set[int] = set()
        primes = np.zeros((self.n_layers, n_orders, n_heads), dtype=np.int64)
        for li in range(self.n_layers):
            for o in range(n_orders):
                last = starts[o] - 1
                for k in range(n_heads):
                    last = _next_unused_prime(last, used)
                    used.add(last)
                    primes[li, o, k] = last
        self.primes = primes
        self.column_sizes = primes.reshape(self.n_layers, self.n_cols)
        self.offsets = np.cumsum(self.column_sizes, axis=1) - self.column_sizes
        self.num_embeddings = tuple(int(s) for s in self.column_sizes.sum(axis=1))
        if max(self.num_embeddings) > INT32_MAX:
            raise ValueError(
                f"layer tables of {self.num_embeddings} rows do not fit int32 row ids; "
                "engram_vocab_size * n_cols must stay below 2**31"
            )

        # Multipliers: odd, below 2 * bound + 1, so id * multiplier < 2**63 for
        # every compressed id and XOR of such products never overflows.
        bound = max(1, INT64_MAX // compressed_vocab_size // 2)
        mult = np.zeros((self.n_layers, max_ngram_size), dtype=np.int64)
        for li, layer in enumerate(layer_ids):
            rng = np.random.default_rng(seed + LAYER_SEED_STRIDE * layer)
            mult[li] = rng.integers(0, bound, max_ngram_size, dtype=np.int64) * 2 + 1
        self.multipliers = mult
        for a in (self.primes, self.column_sizes, self.offsets, self.multipliers):
            a.setflags(write=False)

    # -- config -------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | str | os.PathLike,
        *,
        compressor: TokenCompressor | None = None,
        pad_id: int | None = None,
        seed: int | None = None,
    ) -> EngramLayout:
        """A layout from a DeepSeek-style model config (a dict or a ``config.json`` path).

        A nested ``text_config`` (DeepSeek-V4.1's Hugging Face config) is read
        when present. Accepted spellings, first match wins:

        - layers: ``engram_layer_ids``, ``layer_ids``
        - start of the prime search: ``engram_vocab_size`` (int, or one per order)
        - longest n-gram: ``engram_max_ngram_size``, ``max_ngram_size``
        - heads per order: ``engram_n_heads``, ``n_head_per_ngram``, ``n_heads``
          (bare ``n_heads`` only when neither engram spelling is there: in a
          full model config it counts attention heads)
        - row width: ``engram_head_dim``, ``head_dim``, or DeepSeek's demo
          ``n_embed_per_ngram // n_head_per_ngram``
        - pad token (an *original* tokenizer id): ``engram_pad_token_id``
          (Hugging Face config), ``engram_pad_id`` (DeepSeek's inference
          config), ``pad_id`` (demo)
        - compressed vocabulary: ``engram_compressed_vocab_size``
        - multiplier seed: ``engram_seed``, ``seed`` (default 0)

        The compressed pad id comes from ``compressor`` (which maps the config's
        pad token and supplies the compressed vocabulary size, checked against
        the config's) or from ``pad_id`` (already compressed). When the config
        gives ``engram_num_embeddings``, the computed table sizes must match it.
        """
        cfg = _read_config(config)
        layer_ids = _pick(cfg, "engram_layer_ids", "layer_ids", required=True)
        vocab = _pick(cfg, "engram_vocab_size", required=True)
        max_ngram = _pick(cfg, "engram_max_ngram_size", "max_ngram_size", required=True)
        n_heads = _pick(cfg, "engram_n_heads", "n_head_per_ngram", "n_heads", required=True)
        head_dim = _pick(cfg, "engram_head_dim", "head_dim")
        if head_dim is None and "n_embed_per_ngram" in cfg:
            n_embed, heads = int(cfg["n_embed_per_ngram"]), int(n_heads)
            if heads < 1:
                raise ValueError(f"n_heads must be >= 1, got {heads}")
            if n_embed % heads:
                raise ValueError(
                    f"n_embed_per_ngram ({n_embed}) must be a multiple of n_heads ({heads}): "
                    "each head's rows are n_embed_per_ngram // n_heads wide"
                )
            head_dim = n_embed // heads
        if head_dim is None:
            raise ValueError("config gives no engram_head_dim (nor head_dim / n_embed_per_ngram)")
        cfg_compressed = _pick(cfg, "engram_compressed_vocab_size")
        pad_token = _pick(cfg, "engram_pad_token_id", "engram_pad_id", "pad_id")
        if seed is None:
            seed = _pick(cfg, "engram_seed", "seed")
            seed = 0 if seed is None else seed

        if compressor is not None:
            if not isinstance(compressor, TokenCompressor):
                raise TypeError(
                    f"compressor must be a TokenCompressor, got {type(compressor).__name__}"
                )
            if cfg_compressed is not None and int(cfg_compressed) != compressor.vocab_size:
                raise ValueError(
                    f"the compressor has {compressor.vocab_size} compressed ids, the config's "
                    f"engram_compressed_vocab_size is {cfg_compressed}: wrong tokenizer?"
                )
            compressed_vocab = compressor.vocab_size
            if pad_id is None:
                if pad_token is None:
                    raise ValueError(
                        "config gives no pad token (engram_pad_token_id); pass pad_id="
                    )
                pad_id = compressor.compress_id(int(pad_token))
        else:
            if cfg_compressed is None:
                raise ValueError(
                    "config gives no engram_compressed_vocab_size: "
                    "pass compressor=TokenCompressor(...)"
                )
            compressed_vocab = int(cfg_compressed)
            if pad_id is None:
                raise ValueError(
                    "the config names the pad token by its tokenizer id; pass compressor= to "
                    "map it, or pad_id= (the compressed pad id)"
                )
        layout = cls(vocab, layer_ids, max_ngram, n_heads, head_dim, compressed_vocab, pad_id, seed)
        expected = cfg.get("engram_num_embeddings")
        if expected is not None and tuple(int(n) for n in expected) != layout.num_embeddings:
            raise ValueError(
                f"config's engram_num_embeddings {tuple(expected)} do not match the table sizes "
                f"the layout computes, {layout.num_embeddings} (check engram_vocab_size, n_heads, "
                "max_ngram_size and layer_ids)"
            )
        return layout

    # -- identity -----------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngramLayout) and self._args == other._args

    def __hash__(self) -> int:
        return hash(self._args)

    def __repr__(self) -> str:
        return (
            f"EngramLayout(layers={self.layer_ids}, max_ngram_size={self.max_ngram_size}, "
            f"n_heads={self.n_heads}, head_dim={self.head_dim}, "
            f"num_embeddings={self.num_embeddings}, compressed_vocab_size="
            f"{self.compressed_vocab_size}, pad_id={self.pad_id})"
        )

    def layer_index(self, layer_id: int) -> int:
        """Position of model layer ``layer_id`` in ``layer_ids`` (the hash output's layer axis)."""
        try:
            return self.layer_ids.index(layer_id)
        except ValueError:
            raise ValueError(
                f"layer {layer_id} has no Engram table; layers are {self.layer_ids}"
            ) from None

    @property
    def state_width(self) -> int:
        """Lookback ids a sequence's state holds: ``max_ngram_size - 1``."""
        return self.max_ngram_size - 1


jax.tree_util.register_static(EngramLayout)


def _read_config(config: Mapping[str, Any] | str | os.PathLike) -> dict:
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict or a config.json path, got {type(config).__name__}")
    text = config.get("text_config")
    return dict(text) if isinstance(text, Mapping) else dict(config)


def _pick(cfg: Mapping[str, Any], *names: str, required: bool = False) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if required:
        raise ValueError(f"config gives none of {', '.join(names)}")
    return None


# -- token compression ------------------------------------------------------

# DeepSeek's key for a token: the text it decodes to, normalised so that case,
# accents, compatibility forms and whitespace runs fold together; a text that
# is exactly one space stays one space (the sentinel survives Strip).
_SENTINEL = "\ue000"


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def _as_tokenizer(tokenizer: Any):
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        return Tokenizer.from_file(str(path))
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a transformers fast tokenizer
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError(
        "tokenizer must be a tokenizers.Tokenizer, a tokenizer.json path or a transformers "
        f"fast tokenizer, got {type(tokenizer).__name__}"
    )


class TokenCompressor:
    """DeepSeek's token compression: tokenizer id -> compressed id (int32 ``map``).

    Every id is decoded alone; if the text holds U+FFFD (a partial UTF-8
    sequence) the key is the raw token string, else the text normalised by
    NFKC, NFD, accent stripping, lowercasing and whitespace folding (or the
    text itself if that leaves nothing). Keys get compressed ids in
    first-seen order, so ``map`` alone determines everything: save it with
    :meth:`save` and :meth:`load` it when serving.
    """

    def __init__(self, mapping: np.ndarray) -> None:
        mapping = np.asarray(mapping)
        if mapping.ndim != 1 or mapping.size == 0 or not np.issubdtype(mapping.dtype, np.integer):
            raise ValueError(
                f"map must be a non-empty 1-D integer array, got {mapping.dtype} {mapping.shape}"
            )
        if mapping.size > INT32_MAX or mapping.min() < 0 or mapping.max() >= mapping.size:
            raise ValueError("map values must lie in [0, len(map))")
        mapping = mapping.astype(np.int32)
        # First-seen numbering: each id is at most one past the largest id before it.
        running = np.maximum.accumulate(mapping)
        if mapping[0] != 0 or np.any(running[1:] - running[:-1] > 1):
            raise ValueError(
                "map is not a first-seen numbering (0, then each new id one past the last)"
            )
        mapping.setflags(write=False)
        self.map = mapping
        self.vocab_size = int(running[-1]) + 1

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenCompressor:
        """Build the map from a ``tokenizers.Tokenizer``, a ``tokenizer.json`` path, or a
        transformers fast tokenizer. Covers every id including added tokens."""
        tok = _as_tokenizer(tokenizer)
        size = tok.get_vocab_size(with_added_tokens=True)
        texts = tok.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        normalize = _normalizer().normalize_str
        keys: dict[str, int] = {}
        mapping = np.empty(size, dtype=np.int32)
        for i, text in enumerate(texts):
            if "\ufffd" in text:
                key = tok.id_to_token(i)
            else:
                key = normalize(text) or text
            mapping[i] = keys.setdefault(key, len(keys))
        return cls(mapping)

    @property
    def tokenizer_vocab_size(self) -> int:
        """Ids the tokenizer has (the map's length)."""
        return int(self.map.size)

    def compress_id(self, token_id: int) -> int:
        """Compressed id of one tokenizer id."""
        token_id = _as_int("token_id", token_id)
        if not 0 <= token_id < self.map.size:
            raise ValueError(f"token id {token_id} is outside the tokenizer's {self.map.size} ids")
        return int(self.map[token_id])

    def __call__(self, token_ids: ArrayLike) -> np.ndarray | jax.Array:
        """Compressed ids of tokenizer ids; ``-1`` (DEAD) stays ``-1``.

        numpy/list input: ids outside ``[-1, len(map))`` raise. A jax array
        (also inside ``jit``) is mapped with ``jnp.take``; there such ids
        become ``vocab_size``, which hashing treats as the pad id.
        """
        if isinstance(token_ids, jax.Array):
            ids = token_ids
            if jnp.issubdtype(ids.dtype, jnp.integer):
                # A plain cast would wrap an id past int32 onto a real id (or onto -1):
                # make it map.size, outside the map, so it becomes vocab_size below.
                ids = narrow_ids(ids, self.map.size)
            elif ids.dtype != jnp.int32:
                ids = ids.astype(jnp.int32)
            table = jnp.asarray(self.map)
            held = (ids >= 0) & (ids < self.map.size)
            out = jnp.where(held, table[jnp.clip(ids, 0, self.map.size - 1)], self.vocab_size)
            return jnp.where(ids == -1, -1, out)
        ids = np.asarray(token_ids)
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"token ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        bad = (ids < -1) | (ids >= self.map.size)
        if np.any(bad):
            raise ValueError(
                f"token id {int(ids[bad].flat[0])} is outside the tokenizer's {self.map.size} ids"
            )
        out = self.map[np.where(ids < 0, 0, ids)]
        return np.where(ids < 0, -1, out).astype(np.int32)

    compress = __call__

    def save(self, path: str | os.PathLike) -> None:
        """Write the map as a ``.npy`` file (int32, one entry per tokenizer id)."""
        np.save(path, self.map, allow_pickle=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenCompressor:
        """Read a map written by :meth:`save` (checked to be a first-seen numbering)."""
        return cls(np.load(path, allow_pickle=False))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenCompressor) and np.array_equal(self.map, other.map)

    def __hash__(self) -> int:
        return hash((self.map.size, self.vocab_size, self.map[:64].tobytes()))

    def __repr__(self) -> str:
        return f"TokenCompressor({self.map.size} ids -> {self.vocab_size})"
