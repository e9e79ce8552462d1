"""EngramLayout: DeepSeek's primes, offsets and multipliers against a step-by-step
reference (trial division), the DeepSeek-V4.1-Flash table sizes, config reading
and bad arguments.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_jax import EngramLayout, TokenCompressor
from engram_jax import layout as layout_mod
from engram_jax.testing import layout_reference

# DeepSeek-V4.1-Flash's text_config (the Engram keys and a few neighbours).
FLASH_TEXT_CONFIG = {
    "num_attention_heads": 64,
    "n_heads": 64,
    "head_dim": 512,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
}


def flash_layout() -> EngramLayout:
    return EngramLayout(16_000_000, (1, 14), 4, 8, 256, 99_092, 2)


def test_flash_table_sizes_and_build_time():
    start = time.perf_counter()
    layout = flash_layout()
    elapsed = time.perf_counter() - start
    assert layout.num_embeddings == (384_006_168, 384_016_682)
    assert layout.primes.shape == (2, 3, 8)
    assert layout.offsets.shape == (2, 24)
    assert layout.multipliers.shape == (2, 4)
    assert layout.primes[0, 0, :3].tolist() == [16_000_057, 16_000_079, 16_000_081]
    assert elapsed < 0.5, f"layout took {elapsed:.3f} s"


def test_flash_matches_reference():
    layout = flash_layout()
    primes, mult = layout_reference(16_000_000, (1, 14), 4, 8, 99_092)
    np.testing.assert_array_equal(layout.primes, np.array(primes))
    np.testing.assert_array_equal(layout.multipliers, np.array(mult))


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.one_of(st.integers(2, 5000), st.lists(st.integers(2, 3000), min_size=1, max_size=4)),
    layers=st.lists(st.integers(0, 60), min_size=1, max_size=3, unique=True),
    max_ngram=st.integers(2, 5),
    heads=st.integers(1, 5),
    compressed=st.integers(1, 200_000),
    seed=st.integers(0, 1000),
)
def test_layout_matches_reference(vocab, layers, max_ngram, heads, compressed, seed):
    if isinstance(vocab, list):
        vocab = (vocab * max_ngram)[: max_ngram - 1]
    layout = EngramLayout(vocab, layers, max_ngram, heads, 32, compressed, compressed - 1, seed)
    primes, mult = layout_reference(vocab, layers, max_ngram, heads, compressed, seed)
    np.testing.assert_array_equal(layout.primes, np.array(primes))
    np.testing.assert_array_equal(layout.multipliers, np.array(mult))
    sizes = layout.primes.reshape(len(layers), -1)
    np.testing.assert_array_equal(layout.column_sizes, sizes)
    np.testing.assert_array_equal(layout.offsets[:, 0], 0)
    np.testing.assert_array_equal(layout.offsets[:, 1:], np.cumsum(sizes, axis=1)[:, :-1])
    assert layout.num_embeddings == tuple(int(s) for s in sizes.sum(axis=1))
    flat = layout.primes.reshape(-1).tolist()
    assert len(set(flat)) == len(flat), "a prime was used twice"
    # Products and XORs stay below 2**63: the hash needs no overflow.
    assert all(m % 2 == 1 for m in layout.multipliers.reshape(-1).tolist())
    assert (compressed - 1) * int(layout.multipliers.max()) < 2**63


def test_is_prime_matches_trial_division_and_known_values():
    small = [n for n in range(2000) if all(n % d for d in range(2, int(n**0.5) + 1)) and n > 1]
    assert [n for n in range(2000) if layout_mod.is_prime(n)] == small
    # Carmichael numbers and strong pseudoprimes to small bases are composite.
    for n in (561, 1105, 1729, 2047, 3215031751, 3825123056546413051):
        assert not layout_mod.is_prime(n)
    for p in (2_147_483_647, 16_000_057, 2**61 - 1):
        assert layout_mod.is_prime(p)


def test_per_order_vocab_sizes():
    layout = EngramLayout([100, 200], (0,), 3, 2, 32, 50, 0)
    assert layout.primes[0].tolist() == [[101, 103], [211, 223]]
    # One start for every order: the second order skips the first order's primes.
    layout = EngramLayout(100, (0,), 3, 2, 32, 50, 0)
    assert layout.primes[0].tolist() == [[101, 103], [107, 109]]


def test_equality_hash_and_static_under_jit():
    a, b = flash_layout(), flash_layout()
    assert a == b and hash(a) == hash(b)
    assert a != EngramLayout(16_000_000, (1, 14), 4, 8, 256, 99_092, 3)

    @jax.jit
    def first_offset(layout, x):
        return x + int(layout.offsets[0, 1])

    assert int(first_offset(a, jnp.int32(0))) == int(a.primes[0, 0, 0])
    assert a.layer_index(14) == 1
    with pytest.raises(ValueError, match="no Engram table"):
        a.layer_index(2)


def test_from_config_flash_text_config(tmp_path):
    config = {"model_type": "deepseek_v41", "text_config": FLASH_TEXT_CONFIG}
    layout = EngramLayout.from_config(config, pad_id=2)
    assert layout == flash_layout()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert EngramLayout.from_config(path, pad_id=2) == layout
    assert EngramLayout.from_config(str(tmp_path), pad_id=2) == layout


def test_from_config_maps_pad_through_compressor():
    # A toy map: tokenizer id 2 (the pad token) folds into compressed id 1.
    compressor = TokenCompressor(np.array([0, 1, 1, 2, 3], dtype=np.int32))
    cfg = dict(FLASH_TEXT_CONFIG, engram_compressed_vocab_size=4)
    cfg.pop("engram_num_embeddings")
    layout = EngramLayout.from_config(cfg, compressor=compressor)
    assert layout.pad_id == 1 and layout.compressed_vocab_size == 4
    with pytest.raises(ValueError, match="wrong tokenizer"):
        EngramLayout.from_config(dict(cfg, engram_compressed_vocab_size=5), compressor=compressor)


def test_from_config_deepseek_demo_spellings():
    demo = {
        "engram_vocab_size": [129280 * 5, 129280 * 5],
        "max_ngram_size": 3,
        "n_embed_per_ngram": 512,
        "n_head_per_ngram": 8,
        "layer_ids": [1, 15],
        "pad_id": 2,
        "seed": 0,
        "engram_compressed_vocab_size": 1000,
    }
    layout = EngramLayout.from_config(demo, pad_id=5)
    assert layout.head_dim == 64 and layout.n_heads == 8 and layout.layer_ids == (1, 15)
    assert layout.engram_vocab_size == (646400, 646400)


def test_from_config_n_embed_per_ngram_must_divide_by_the_heads():
    demo = {
        "engram_vocab_size": 500,
        "max_ngram_size": 3,
        "n_embed_per_ngram": 100,
        "n_head_per_ngram": 8,
        "layer_ids": [1],
        "engram_compressed_vocab_size": 10,
    }
    with pytest.raises(ValueError, match=r"n_embed_per_ngram \(100\).*n_heads \(8\)"):
        EngramLayout.from_config(demo, pad_id=0)
    with pytest.raises(ValueError, match="n_heads must be >= 1"):
        EngramLayout.from_config(dict(demo, n_head_per_ngram=0), pad_id=0)
    # 100 // 4 = 25 values per row: no table holds that (one scale byte per 32 values).
    with pytest.raises(ValueError, match="head_dim .* multiple of 32.* got 25"):
        EngramLayout.from_config(dict(demo, n_head_per_ngram=4), pad_id=0)
    wider = dict(demo, n_embed_per_ngram=128, n_head_per_ngram=4)
    assert EngramLayout.from_config(wider, pad_id=0).head_dim == 32


def test_from_config_inference_spelling_and_bare_n_heads():
    cfg = {
        "engram_layer_ids": [3],
        "engram_vocab_size": 500,
        "engram_max_ngram_size": 3,
        "n_heads": 2,
        "engram_head_dim": 32,
        "engram_pad_id": 2,
        "engram_compressed_vocab_size": 10,
    }
    assert EngramLayout.from_config(cfg, pad_id=0).n_heads == 2
    # engram_n_heads wins over an attention-head count.
    assert EngramLayout.from_config(dict(cfg, engram_n_heads=4), pad_id=0).n_heads == 4


@pytest.mark.parametrize(
    "change, match",
    [
        ({"engram_num_embeddings": [384006168, 384016683]}, "do not match"),
        ({"engram_num_embeddings": [384006168]}, "do not match"),
        ({"engram_layer_ids": None}, "engram_layer_ids"),
        ({"engram_head_dim": None, "head_dim": None}, "head_dim"),
        ({"engram_compressed_vocab_size": None}, "compressor"),
    ],
)
def test_from_config_errors(change, match):
    cfg = dict(FLASH_TEXT_CONFIG, **change)
    with pytest.raises(ValueError, match=match):
        EngramLayout.from_config(cfg, pad_id=2)


def test_from_config_needs_a_pad():
    with pytest.raises(ValueError, match="pad"):
        EngramLayout.from_config(FLASH_TEXT_CONFIG)
    with pytest.raises(TypeError):
        EngramLayout.from_config(["not", "a", "dict"])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_ngram_size": 1}, ValueError, "max_ngram_size"),
        ({"n_heads": 0}, ValueError, "n_heads"),
        ({"engram_vocab_size": 1}, ValueError, "engram_vocab_size"),
        ({"engram_vocab_size": [100, 100, 100, 100]}, ValueError, "one value per order"),
        ({"compressed_vocab_size": 0}, ValueError, "compressed_vocab_size"),
        ({"pad_id": 99_092}, ValueError, "pad_id"),
        ({"pad_id": -1}, ValueError, "pad_id"),
        ({"layer_ids": ()}, ValueError, "at least one"),
        ({"layer_ids": (1, 1)}, ValueError, "distinct"),
        ({"layer_ids": 1}, TypeError, "sequence"),
        ({"head_dim": 0}, ValueError, "head_dim"),
        ({"head_dim": 48}, ValueError, "head_dim .* multiple of 32"),
        ({"head_dim": 16384 + 32}, ValueError, "head_dim .* up to 16384"),
        ({"engram_vocab_size": 100_000_000}, ValueError, "int32"),
        ({"n_heads": 2.0}, TypeError, "n_heads"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = dict(
        engram_vocab_size=16_000_000,
        layer_ids=(1, 14),
        max_ngram_size=4,
        n_heads=8,
        head_dim=256,
        compressed_vocab_size=99_092,
        pad_id=2,
    )
    args.update(kwargs)
    with pytest.raises(error, match=match):
        EngramLayout(**args)
