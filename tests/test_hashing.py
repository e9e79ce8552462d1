"""hash_ngrams against the plain-Python reference: single sequences, packed
sequences (segment ids or positions), [B, T] batches, decode and chunked
prefill with lookback state (== the whole sequence), DEAD spans, jit/vmap,
bad input; and the same on the CUDA backend (`gpu` marker), also replayed from a
CUDA graph (run as ``python -m tests.test_hashing`` it is that test's child).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, PartitionSpec

import engram_jax as ej
from engram_jax import DEAD_ID, EngramLayout
from engram_jax.testing import hash_ngrams_reference, hash_sequence_reference

from ._helpers import FORCED_COMMAND_BUFFERS, captured_calls

LAYOUTS = {
    # A tiny compressed vocabulary, so n-grams repeat and pad collides with real ids.
    "small": EngramLayout(97, (0, 3), 3, 2, 32, 11, 2),
    "bigram": EngramLayout(31, (5,), 2, 1, 32, 7, 0),
    "wide": EngramLayout([50, 70, 90, 110], (2, 7, 9), 5, 3, 64, 1000, 999),
    "flash": EngramLayout(16_000_000, (1, 14), 4, 8, 256, 99_092, 2),
}


def random_sequence(
    rng: np.random.Generator, layout: EngramLayout, length: int, dead: float = 0.15
):
    """Compressed ids with DEAD tokens, some of them in runs."""
    tokens = rng.integers(0, layout.compressed_vocab_size, length).astype(np.int32)
    tokens[rng.random(length) < dead] = DEAD_ID
    if length > 4 and rng.random() < 0.5:
        start = int(rng.integers(0, length - 3))
        tokens[start : start + int(rng.integers(1, 4))] = DEAD_ID
    return tokens


def sequences_strategy(layout: EngramLayout, max_len: int = 24):
    ids = st.one_of(st.just(DEAD_ID), st.integers(0, layout.compressed_vocab_size - 1))
    return st.lists(st.lists(ids, min_size=1, max_size=max_len), min_size=1, max_size=4)


@pytest.mark.parametrize("name", list(LAYOUTS))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_single_sequence_matches_reference(name, data):
    layout = LAYOUTS[name]
    tokens = np.array(data.draw(sequences_strategy(layout, 40))[0], dtype=np.int32)
    out = ej.hash_ngrams(layout, tokens)
    assert out.dtype == jnp.int32 and out.shape == (len(tokens), layout.n_layers, layout.n_cols)
    np.testing.assert_array_equal(np.asarray(out), hash_sequence_reference(layout, tokens))


def test_flash_known_sequence_eager_and_jit():
    layout = LAYOUTS["flash"]
    tokens = random_sequence(np.random.default_rng(1), layout, 300)
    expected = hash_sequence_reference(layout, tokens)
    np.testing.assert_array_equal(np.asarray(ej.hash_ngrams(layout, tokens)), expected)
    jitted = jax.jit(ej.hash_ngrams, static_argnums=0)(layout, jnp.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(jitted), expected)
    live = tokens != DEAD_ID
    for li in range(layout.n_layers):
        lo = layout.offsets[li]
        hi = lo + layout.column_sizes[li]
        ids = np.asarray(jitted)[live, li]
        assert np.all((ids >= lo) & (ids < hi)), "a row id left its column's block"


def test_dead_tokens_block_older_ids():
    layout = LAYOUTS["small"]
    out = np.asarray(ej.hash_ngrams(layout, np.array([5, 6, -1, 7, 8, 9], np.int32)))
    assert np.all(out[2] == DEAD_ID)
    # After a DEAD token, n-grams see a fresh start: as if the sequence began at 7.
    np.testing.assert_array_equal(out[3:], np.asarray(ej.hash_ngrams(layout, np.array([7, 8, 9]))))
    assert not np.array_equal(out[1], np.asarray(ej.hash_ngrams(layout, np.array([6])))[0])


@pytest.mark.parametrize("name", ["small", "wide"])
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_packed_sequences_never_mix(name, data):
    layout = LAYOUTS[name]
    seqs = data.draw(sequences_strategy(layout))
    tokens = np.concatenate([np.array(s, np.int32) for s in seqs])
    expected = np.concatenate([hash_sequence_reference(layout, s) for s in seqs])
    # Segment ids: any labels, as long as neighbours differ.
    labels = data.draw(st.lists(st.integers(0, 3), min_size=len(seqs), max_size=len(seqs)))
    for i in range(1, len(labels)):
        if labels[i] == labels[i - 1]:
            labels[i] = labels[i - 1] + 1
    segments = np.concatenate(
        [np.full(len(s), lab, np.int32) for s, lab in zip(seqs, labels, strict=True)]
    )
    out = ej.hash_ngrams(layout, tokens, segment_ids=segments)
    np.testing.assert_array_equal(np.asarray(out), expected)
    # Positions alone (0 at each sequence start) separate the sequences too.
    positions = np.concatenate([np.arange(len(s), dtype=np.int32) for s in seqs])
    out = ej.hash_ngrams(layout, tokens, positions=positions)
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_batch_rows_are_sequences():
    layout = LAYOUTS["wide"]
    rng = np.random.default_rng(2)
    batch = np.stack([random_sequence(rng, layout, 17) for _ in range(5)])
    out = np.asarray(ej.hash_ngrams(layout, batch))
    assert out.shape == (5, 17, 3, 12)
    for b in range(5):
        np.testing.assert_array_equal(out[b], hash_sequence_reference(layout, batch[b]))
    vmapped = jax.vmap(lambda t: ej.hash_ngrams(layout, t))(jnp.asarray(batch))
    np.testing.assert_array_equal(np.asarray(vmapped), out)


@pytest.mark.parametrize("name", ["small", "flash", "bigram"])
@pytest.mark.parametrize("with_positions", [False, True])
def test_decode_equals_whole_sequence(name, with_positions):
    layout = LAYOUTS[name]
    rng = np.random.default_rng(3)
    batch, steps = 4, 12
    seqs = np.stack([random_sequence(rng, layout, steps, dead=0.25) for _ in range(batch)])
    expected = np.stack([hash_sequence_reference(layout, s) for s in seqs])
    state = ej.init_state(layout, batch)
    step = jax.jit(ej.hash_step, static_argnums=0)
    for t in range(steps):
        kwargs = {"positions": np.full(batch, t, np.int32)} if with_positions else {}
        ids, state = step(layout, state, seqs[:, t], **kwargs)
        np.testing.assert_array_equal(np.asarray(ids), expected[:, t])
    # The state is the last max_ngram_size - 1 ids, DEAD kept.
    np.testing.assert_array_equal(np.asarray(state), seqs[:, steps - layout.state_width :])


def test_decode_batch_rows_form():
    # [B, 1] token_ids: row b continues state row b.
    layout = LAYOUTS["small"]
    rng = np.random.default_rng(4)
    seqs = np.stack([random_sequence(rng, layout, 6) for _ in range(3)])
    state = ej.init_state(layout, 3)
    for t in range(6):
        ids, state = ej.hash_step(layout, state, seqs[:, t : t + 1])
        for b in range(3):
            np.testing.assert_array_equal(
                np.asarray(ids)[b, 0], hash_sequence_reference(layout, seqs[b, : t + 1])[t]
            )


STEP_TOKENS = 16


@pytest.mark.parametrize("name", ["small", "wide", "flash"])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), with_positions=st.booleans())
def test_chunked_prefill_equals_whole(name, seed, with_positions):
    """Random chunk schedules of several sequences packed per step (some absent
    in a step, padding at the end) give the whole sequences' ids."""
    layout = LAYOUTS[name]
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 4))
    seqs = [random_sequence(rng, layout, int(rng.integers(1, 20))) for _ in range(count)]
    expected = [hash_sequence_reference(layout, s) for s in seqs]
    got = [[] for _ in seqs]
    done = [0] * count
    state = ej.init_state(layout, count)
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        order = rng.permutation(count)
        tokens, segments, positions, owners = [], [], [], []
        for b in order:
            n = min(int(rng.integers(0, STEP_TOKENS // 3 + 1)), len(seqs[b]) - done[b])
            tokens.append(seqs[b][done[b] : done[b] + n])
            segments.append(np.full(n, b, np.int32))
            positions.append(np.arange(done[b], done[b] + n, dtype=np.int32))
            owners.append((b, n))
            done[b] += n
        # Padding slots (DEAD tokens of no sequence) fill every step to one size,
        # so the step compiles once.
        pad = STEP_TOKENS - sum(len(t) for t in tokens)
        tokens.append(np.full(pad, DEAD_ID, np.int32))
        segments.append(np.full(pad, -1, np.int32))
        positions.append(np.zeros(pad, np.int32))
        kwargs = {"positions": np.concatenate(positions)} if with_positions else {}
        ids, state = ej.hash_step(
            layout, state, np.concatenate(tokens), segment_ids=np.concatenate(segments), **kwargs
        )
        ids = np.asarray(ids)
        at = 0
        for b, n in owners:
            got[b].append(ids[at : at + n])
            at += n
        assert np.all(ids[at:] == DEAD_ID)
    for b in range(count):
        np.testing.assert_array_equal(np.concatenate(got[b]), expected[b])


def test_positions_restart_a_reused_state_row():
    """A new sequence in a row whose state still holds an old one: position 0
    ignores the stale state, in hashing and in update_state."""
    layout = LAYOUTS["small"]
    state = jnp.asarray([[4, 5]], jnp.int32)
    fresh = np.array([7, 8, 9], np.int32)
    ids, new_state = ej.hash_step(layout, state, fresh, positions=np.arange(3, dtype=np.int32))
    np.testing.assert_array_equal(np.asarray(ids), hash_sequence_reference(layout, fresh))
    np.testing.assert_array_equal(np.asarray(new_state), [[8, 9]])
    _, short = ej.hash_step(layout, state, fresh[:1], positions=np.array([0], np.int32))
    np.testing.assert_array_equal(np.asarray(short), [[layout.pad_id, 7]])
    # Without positions the state is history.
    ids = ej.hash_ngrams(layout, fresh, state=state)
    whole = hash_sequence_reference(layout, np.array([4, 5, 7, 8, 9]))
    np.testing.assert_array_equal(np.asarray(ids), whole[2:])


@functools.partial(jax.jit, static_argnums=0)
def _jit_hash(layout, tokens, segments, positions, state):
    return ej.hash_ngrams(layout, tokens, segment_ids=segments, positions=positions, state=state)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_raw_contract_fuzz_inside_jit(seed):
    """Arbitrary inputs (out-of-vocab ids, segment ids naming no state row,
    broken runs, DEAD in the state) inside jit, against the Python contract."""
    layout = LAYOUTS["small"]
    rng = np.random.default_rng(seed)
    n, rows = 32, int(rng.integers(1, 4))  # fixed sizes: one compile per row count
    tokens = rng.integers(-3, layout.compressed_vocab_size + 3, n).astype(np.int32)
    segments = rng.integers(-1, rows + 1, n).astype(np.int32)
    segments = np.sort(segments) if rng.random() < 0.5 else segments
    positions = np.abs(np.cumsum(rng.integers(-1, 3, n))).astype(np.int32)
    state = rng.integers(-2, layout.compressed_vocab_size + 2, (rows, layout.state_width)).astype(
        np.int32
    )
    out = _jit_hash(layout, tokens, segments, positions, state)
    np.testing.assert_array_equal(
        np.asarray(out), hash_ngrams_reference(layout, tokens, segments, positions, state)
    )
    np.testing.assert_array_equal(
        np.asarray(_jit_hash(layout, tokens, segments, positions, None)),
        hash_ngrams_reference(layout, tokens, segments, positions),
    )


def test_out_of_vocab_inside_jit_hashes_as_pad():
    layout = LAYOUTS["small"]
    tokens = np.array([3, 11, 4, -7, 5, 2**31 - 1], np.int32)
    out = jax.jit(lambda t: ej.hash_ngrams(layout, t))(tokens)
    as_pad = np.where((tokens < -1) | (tokens >= 11), layout.pad_id, tokens)
    np.testing.assert_array_equal(np.asarray(out), hash_sequence_reference(layout, as_pad))


def test_input_types_and_empty():
    layout = LAYOUTS["small"]
    ref = hash_sequence_reference(layout, [1, 2, 3])
    for tokens in (
        [1, 2, 3],
        np.array([1, 2, 3], np.int64),
        np.array([1, 2, 3], np.uint8),
        jnp.array([1, 2, 3], jnp.int16),
    ):
        np.testing.assert_array_equal(np.asarray(ej.hash_ngrams(layout, tokens)), ref)
    assert ej.hash_ngrams(layout, np.zeros(0, np.int32)).shape == (0, 2, 4)
    assert ej.hash_ngrams(layout, []).shape == (0, 2, 4)
    state = ej.init_state(layout, 2)
    assert state.shape == (2, 2) and np.all(np.asarray(state) == layout.pad_id)
    same = ej.update_state(layout, state, np.zeros(0, np.int32), segment_ids=np.zeros(0, np.int32))
    np.testing.assert_array_equal(np.asarray(same), np.asarray(state))


def test_sharded_over_cpu_devices():
    layout = LAYOUTS["small"]
    devices = jax.devices("cpu")
    mesh = Mesh(np.array(devices), ("b",))
    rng = np.random.default_rng(5)
    batch = np.stack([random_sequence(rng, layout, 9) for _ in range(len(devices))])
    fn = jax.jit(
        jax.shard_map(
            lambda t: ej.hash_ngrams(layout, t),
            mesh=mesh,
            in_specs=PartitionSpec("b"),
            out_specs=PartitionSpec("b"),
        )
    )
    np.testing.assert_array_equal(np.asarray(fn(batch)), np.asarray(ej.hash_ngrams(layout, batch)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"token_ids": [1, 11]}, ValueError, r"token_ids\[1\] = 11"),
        ({"token_ids": [1, -2]}, ValueError, "not a compressed id"),
        ({"token_ids": [1.0, 2.0]}, TypeError, "integers"),
        ({"token_ids": np.zeros((1, 1, 1), np.int32)}, ValueError, r"\[T\] or \[B, T\]"),
        ({"segment_ids": [0]}, ValueError, "segment_ids must be"),
        ({"positions": [0, -1, 2]}, ValueError, "positions must be >= 0"),
        ({"positions": [0, 1]}, ValueError, "positions must be"),
        ({"state": np.zeros((1, 3), np.int32)}, ValueError, r"state must be \[sequences, 2\]"),
        ({"state": np.full((1, 2), 11, np.int32)}, ValueError, "state"),
        ({"state": np.zeros((2, 2), np.int32)}, ValueError, "segment_ids="),
        (
            {"state": np.zeros((2, 2), np.int32), "segment_ids": [0, 2, 1]},
            ValueError,
            "names no row",
        ),
        ({"state": np.zeros((2, 2), np.int32), "segment_ids": [0, 1, 0]}, ValueError, "contiguous"),
        (
            {"token_ids": np.zeros((2, 3), np.int32), "segment_ids": np.zeros((2, 3))},
            ValueError,
            "row b is sequence b",
        ),
        (
            {"token_ids": np.zeros((2, 3), np.int32), "state": np.zeros((3, 2), np.int32)},
            ValueError,
            "3 rows",
        ),
    ],
)
def test_bad_input(kwargs, error, match):
    args = {"token_ids": np.array([1, 2, 3], np.int32)}
    args.update(kwargs)
    tokens = args.pop("token_ids")
    with pytest.raises(error, match=match):
        ej.hash_ngrams(LAYOUTS["small"], tokens, **args)


def test_bad_layout_and_state_calls():
    with pytest.raises(TypeError, match="EngramLayout"):
        ej.hash_ngrams("layout", [1, 2])
    with pytest.raises(ValueError, match="init_state"):
        ej.update_state(LAYOUTS["small"], None, [1, 2])
    with pytest.raises(ValueError, match="num_sequences"):
        ej.init_state(LAYOUTS["small"], -1)
    # A DEAD padding token may carry any segment id; a live one may not.
    state = ej.init_state(LAYOUTS["small"], 1)
    ej.hash_ngrams(LAYOUTS["small"], [1, -1], segment_ids=[0, 7], state=state)


# -- the CUDA backend -----------------------------------------------------------


def on_device(device, fn, *args):
    """fn(*args) with numpy inputs placed on ``device``, as numpy."""
    with jax.default_device(device):
        out = fn(*args)
        assert out.devices() == {device}
        return np.asarray(out)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpu_sequences_match_reference(gpu_device, name):
    layout = LAYOUTS[name]
    rng = np.random.default_rng(10)
    seqs = [random_sequence(rng, layout, int(rng.integers(1, 60))) for _ in range(6)]
    tokens = np.concatenate(seqs)
    segments = np.concatenate([np.full(len(s), i, np.int32) for i, s in enumerate(seqs)])
    expected = np.concatenate([hash_sequence_reference(layout, s) for s in seqs])
    out = on_device(gpu_device, _jit_hash, layout, tokens, segments, None, None)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.gpu
def test_gpu_raw_contract(gpu_device):
    layout = LAYOUTS["small"]
    rng = np.random.default_rng(11)
    for _ in range(10):
        n, rows = 200, 5
        tokens = rng.integers(-3, 14, n).astype(np.int32)
        segments = np.sort(rng.integers(-1, rows + 1, n)).astype(np.int32)
        positions = np.abs(np.cumsum(rng.integers(-1, 3, n))).astype(np.int32)
        state = rng.integers(-2, 13, (rows, layout.state_width)).astype(np.int32)
        out = on_device(gpu_device, _jit_hash, layout, tokens, segments, positions, state)
        np.testing.assert_array_equal(
            out, hash_ngrams_reference(layout, tokens, segments, positions, state)
        )


@pytest.mark.gpu
def test_gpu_decode_equals_whole(gpu_device):
    layout = LAYOUTS["flash"]
    rng = np.random.default_rng(12)
    seqs = np.stack([random_sequence(rng, layout, 10, dead=0.25) for _ in range(8)])
    expected = np.stack([hash_sequence_reference(layout, s) for s in seqs])
    with jax.default_device(gpu_device):
        state = ej.init_state(layout, 8)
        step = jax.jit(ej.hash_step, static_argnums=0)
        for t in range(10):
            ids, state = step(layout, state, jnp.asarray(seqs[:, t]))
            assert ids.devices() == {gpu_device}
            np.testing.assert_array_equal(np.asarray(ids), expected[:, t])


@pytest.mark.gpu
def test_gpu_large_batch_matches_cpu(gpu_device, cpu_device):
    """400k tokens x 48 columns: more elements than one grid pass covers."""
    layout = LAYOUTS["flash"]
    rng = np.random.default_rng(13)
    n = 400_000
    tokens = random_sequence(rng, layout, n, dead=0.05)
    segments = np.cumsum(rng.random(n) < 0.001).astype(np.int32)
    gpu = on_device(gpu_device, _jit_hash, layout, tokens, segments, None, None)
    cpu = on_device(cpu_device, _jit_hash, layout, tokens, segments, None, None)
    np.testing.assert_array_equal(gpu, cpu)
    head = slice(0, 500)
    np.testing.assert_array_equal(
        gpu[head],
        hash_ngrams_reference(layout, tokens[head], segments[head], _run_positions(segments[head])),
    )


def _run_positions(segments: np.ndarray) -> np.ndarray:
    starts = np.r_[True, segments[1:] != segments[:-1]]
    index = np.arange(len(segments))
    return index - np.maximum.accumulate(np.where(starts, index, 0))


def _command_buffer_worker() -> dict:
    """Decode steps of hash_step, each with new tokens, under XLA's flags of the
    moment: the ids against the reference, and whether the hash was in a graph."""
    layout = LAYOUTS["flash"]
    rng = np.random.default_rng(14)
    seqs = np.stack([random_sequence(rng, layout, 24, dead=0.25) for _ in range(8)])
    expected = np.stack([hash_sequence_reference(layout, s) for s in seqs])
    step = jax.jit(functools.partial(ej.hash_step, layout))
    state = ej.init_state(layout, len(seqs))
    mismatches = 0
    for t in range(seqs.shape[1]):
        ids, state = step(state, jnp.asarray(seqs[:, t]))
        mismatches += int(np.sum(np.asarray(ids) != expected[:, t]))
    return {
        "steps": int(seqs.shape[1]),
        "mismatches": mismatches,
        "hash_captured": captured_calls()["engram_ngram_hash"],
    }


@pytest.mark.gpu
def test_gpu_hash_in_a_cuda_graph_matches_reference():
    """The hash handler is command-buffer compatible: with custom calls forced into
    graphs (flags XLA reads once, so in a child process) it is captured, and every
    replay with new tokens still hashes them."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.test_hashing"],
        cwd=Path(__file__).resolve().parents[1],
        env=dict(os.environ, XLA_FLAGS=FORCED_COMMAND_BUFFERS),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["hash_captured"] > 0, result
    assert result["steps"] == 24 and result["mismatches"] == 0, result


if __name__ == "__main__":
    print(json.dumps(_command_buffer_worker()))
