"""Speculative drafts and known histories against whole-sequence hashing:
hash_draft (== the committed history followed by the draft), commit_state for
every accepted count, traced counts under one jit, init_state(history=) for
histories shorter than, as long as and longer than the state, DEAD positions,
hypothesis fuzzing, bad input; and the same on the CUDA backend (`gpu` marker).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engram_jax as ej
from engram_jax import DEAD_ID, EngramLayout
from engram_jax.testing import hash_sequence_reference

from .test_hashing import LAYOUTS, random_sequence


def state_of(layout: EngramLayout, sequence) -> np.ndarray:
    """The lookback state by definition: the last ``state_width`` ids, pad before the start."""
    width = layout.state_width
    return np.r_[np.full(width, layout.pad_id), np.asarray(sequence, np.int64)][-width:]


def continuation(layout: EngramLayout, history, tokens) -> np.ndarray:
    """Reference ids of ``tokens`` hashed as the continuation of ``history``."""
    whole = np.r_[np.asarray(history, np.int64), np.asarray(tokens, np.int64)]
    return hash_sequence_reference(layout, whole)[len(history) :]


def packed_state(layout: EngramLayout, histories: list[np.ndarray]) -> jax.Array:
    """Committed state of ragged histories, hashed here as one packed prefill chunk."""
    tokens = np.concatenate([np.zeros(0, np.int32), *histories])
    segments = np.concatenate(
        [np.zeros(0, np.int32)] + [np.full(len(h), b, np.int32) for b, h in enumerate(histories)]
    )
    state = ej.init_state(layout, len(histories))
    return ej.update_state(layout, state, tokens, segment_ids=segments)


def left_padded(histories: list[np.ndarray], length: int) -> np.ndarray:
    """``[B, length]``: each history's last ids, DEAD_ID where a row knows fewer."""
    out = np.full((len(histories), length), DEAD_ID, np.int32)
    for b, h in enumerate(histories):
        if length and len(h):
            kept = h[-length:]
            out[b, length - len(kept) :] = kept
    return out


@pytest.mark.parametrize("name", ["small", "bigram", "wide", "flash"])
@pytest.mark.parametrize("rows, k", [(1, 1), (3, 4), (5, 7)])
def test_hash_draft_equals_whole_sequence(name, rows, k):
    layout = LAYOUTS[name]
    rng = np.random.default_rng(rows * 100 + k)
    histories = [
        random_sequence(rng, layout, int(rng.integers(0, 9)), dead=0.2) for _ in range(rows)
    ]
    drafts = np.stack([random_sequence(rng, layout, k, dead=0.2) for _ in range(rows)])
    state = packed_state(layout, histories)
    before = np.asarray(state).copy()
    for fn in (ej.hash_draft, jax.jit(ej.hash_draft, static_argnums=0)):
        ids = np.asarray(fn(layout, state, drafts))
        assert ids.dtype == np.int32 and ids.shape == (rows, k, layout.n_layers, layout.n_cols)
        for b in range(rows):
            np.testing.assert_array_equal(ids[b], continuation(layout, histories[b], drafts[b]))
    np.testing.assert_array_equal(np.asarray(state), before)


@pytest.mark.parametrize("name", ["small", "bigram", "wide"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_commit_every_count_then_continue(name, k):
    """Each row sees every count 0..K; the committed state is the accepted
    prefix's, and the next decode step hashes the whole accepted sequence."""
    layout = LAYOUTS[name]
    rows = k + 1
    rng = np.random.default_rng(k)
    histories = [
        random_sequence(rng, layout, int(rng.integers(0, 7)), dead=0.2) for _ in range(rows)
    ]
    drafts = np.stack([random_sequence(rng, layout, k, dead=0.2) for _ in range(rows)])
    following = random_sequence(rng, layout, rows, dead=0.2)
    state = packed_state(layout, histories)
    for shift in range(k + 1):
        accepted = (np.arange(rows) + shift) % (k + 1)
        committed = ej.commit_state(layout, state, drafts, accepted)
        ids, _ = ej.hash_step(layout, committed, following)
        for b in range(rows):
            kept = np.r_[histories[b], drafts[b, : accepted[b]]]
            np.testing.assert_array_equal(np.asarray(committed)[b], state_of(layout, kept))
            np.testing.assert_array_equal(
                np.asarray(ids)[b], continuation(layout, kept, following[b : b + 1])[0]
            )


def test_commit_of_nothing_and_of_everything():
    layout = LAYOUTS["wide"]
    rng = np.random.default_rng(7)
    state = packed_state(layout, [random_sequence(rng, layout, 6) for _ in range(3)])
    drafts = np.stack([random_sequence(rng, layout, 5) for _ in range(3)])
    none = ej.commit_state(layout, state, drafts, np.zeros(3, np.int32))
    np.testing.assert_array_equal(np.asarray(none), np.asarray(state))
    everything = ej.commit_state(layout, state, drafts, np.full(3, 5, np.int32))
    _, stepped = ej.hash_step(layout, state, drafts)
    np.testing.assert_array_equal(np.asarray(everything), np.asarray(stepped))


@pytest.mark.parametrize("name", ["small", "flash"])
def test_speculative_rounds_under_one_jit(name):
    """Draft, verify (random acceptance), commit, round after round: one compiled
    program for every acceptance pattern, ids equal the accepted sequences'."""
    layout = LAYOUTS[name]
    rows, k, rounds = 4, 5, 8
    rng = np.random.default_rng(8)

    @functools.partial(jax.jit, static_argnums=0)
    def spec_round(layout, state, drafts, accepted):
        return ej.hash_draft(layout, state, drafts), ej.commit_state(
            layout, state, drafts, accepted
        )

    sequences = [random_sequence(rng, layout, int(rng.integers(0, 5))) for _ in range(rows)]
    state = ej.init_state(layout, rows, history=left_padded(sequences, 3))
    for _ in range(rounds):
        drafts = np.stack([random_sequence(rng, layout, k, dead=0.1) for _ in range(rows)])
        accepted = rng.integers(0, k + 1, rows).astype(np.int32)
        ids, state = spec_round(layout, state, jnp.asarray(drafts), jnp.asarray(accepted))
        for b in range(rows):
            np.testing.assert_array_equal(
                np.asarray(ids)[b], continuation(layout, sequences[b], drafts[b])
            )
            sequences[b] = np.r_[sequences[b], drafts[b, : accepted[b]]]
    assert spec_round._cache_size() == 1
    for b in range(rows):
        np.testing.assert_array_equal(np.asarray(state)[b], state_of(layout, sequences[b]))


def test_traced_counts_outside_range_are_clipped():
    layout = LAYOUTS["small"]
    state = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    drafts = np.array([[5, 6, 7], [8, 9, 10]], np.int32)
    commit = jax.jit(ej.commit_state, static_argnums=0)
    clipped = commit(layout, state, drafts, jnp.asarray([-3, 9], jnp.int32))
    np.testing.assert_array_equal(np.asarray(clipped), [[1, 2], [9, 10]])


@pytest.mark.parametrize("name", ["small", "bigram", "wide"])
@pytest.mark.parametrize("relation", ["empty", "shorter", "equal", "longer", "much longer"])
def test_init_state_from_history(name, relation):
    layout = LAYOUTS[name]
    width = layout.state_width
    length = {
        "empty": 0,
        "shorter": width - 1,
        "equal": width,
        "longer": width + 1,
        "much longer": 3 * width + 4,
    }[relation]
    rng = np.random.default_rng(length)
    rows = 3
    history = np.stack([random_sequence(rng, layout, length, dead=0.25) for _ in range(rows)])
    following = np.stack([random_sequence(rng, layout, 4, dead=0.2) for _ in range(rows)])
    state = ej.init_state(layout, rows, history=history)
    ids = np.asarray(ej.hash_ngrams(layout, following, state=state))
    for b in range(rows):
        np.testing.assert_array_equal(np.asarray(state)[b], state_of(layout, history[b]))
        np.testing.assert_array_equal(ids[b], continuation(layout, history[b], following[b]))
    traced = jax.jit(lambda h: ej.init_state(layout, rows, history=h))(jnp.asarray(history))
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(state))


@pytest.mark.parametrize("name", ["small", "wide"])
def test_history_dead_positions_are_unknown(name):
    """Rows that know fewer ids, left-padded with DEAD_ID, hash like the
    sequences those ids start; a DEAD id inside a history blocks n-grams as
    it would in the whole sequence."""
    layout = LAYOUTS[name]
    rng = np.random.default_rng(9)
    known = [np.zeros(0, np.int32), np.array([4], np.int32), np.array([5, 6, 7, 8, 9], np.int32)]
    known.append(np.array([1, DEAD_ID, 2], np.int32))
    following = np.stack([random_sequence(rng, layout, 5, dead=0.0) for _ in known])
    for length in (2, 5, 7):
        state = ej.init_state(layout, len(known), history=left_padded(known, length))
        ids = np.asarray(ej.hash_draft(layout, state, following))
        for b, h in enumerate(known):
            np.testing.assert_array_equal(ids[b], continuation(layout, h[-length:], following[b]))


def test_history_input_types():
    layout = LAYOUTS["small"]
    expected = np.array([[2, 3], [5, 6]], np.int32)
    for history in (
        [[1, 2, 3], [4, 5, 6]],
        np.array([[1, 2, 3], [4, 5, 6]], np.int64),
        np.array([[1, 2, 3], [4, 5, 6]], np.uint8),
        jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int16),
    ):
        state = ej.init_state(layout, 2, history=history)
        assert state.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(state), expected)
    assert ej.init_state(layout, 0, history=np.zeros((0, 4), np.int32)).shape == (0, 2)


def test_empty_drafts_and_batches():
    layout = LAYOUTS["small"]
    state = ej.init_state(layout, 2, history=[[1, 2], [3, 4]])
    empty = np.zeros((2, 0), np.int32)
    assert ej.hash_draft(layout, state, empty).shape == (2, 0, 2, 4)
    same = ej.commit_state(layout, state, empty, np.zeros(2, np.int32))
    np.testing.assert_array_equal(np.asarray(same), np.asarray(state))
    none = ej.init_state(layout, 0)
    assert ej.hash_draft(layout, none, np.zeros((0, 3), np.int32)).shape == (0, 3, 2, 4)
    assert ej.commit_state(layout, none, np.zeros((0, 3), np.int32), []).shape == (0, 2)


@pytest.mark.parametrize("name", list(LAYOUTS))
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_fuzz_history_draft_commit(name, data):
    layout = LAYOUTS[name]
    ids = st.one_of(st.just(DEAD_ID), st.integers(0, layout.compressed_vocab_size - 1))
    rows = data.draw(st.integers(1, 3), label="rows")
    length = data.draw(st.integers(0, 2 * layout.state_width + 2), label="history length")
    k = data.draw(st.integers(0, 5), label="draft length")

    def matrix(columns):
        cells = st.lists(ids, min_size=rows * columns, max_size=rows * columns)
        return np.array(data.draw(cells), np.int32).reshape(rows, columns)

    history, drafts, following = matrix(length), matrix(k), matrix(1)[:, 0]
    accepted = np.array(data.draw(st.lists(st.integers(0, k), min_size=rows, max_size=rows)))
    state = ej.init_state(layout, rows, history=history)
    drafted = np.asarray(ej.hash_draft(layout, state, drafts))
    committed = ej.commit_state(layout, state, drafts, accepted)
    stepped, _ = ej.hash_step(layout, committed, following)
    for b in range(rows):
        np.testing.assert_array_equal(drafted[b], continuation(layout, history[b], drafts[b]))
        kept = np.r_[history[b], drafts[b, : accepted[b]]]
        np.testing.assert_array_equal(np.asarray(committed)[b], state_of(layout, kept))
        np.testing.assert_array_equal(
            np.asarray(stepped)[b], continuation(layout, kept, following[b : b + 1])[0]
        )


# -- bad input ------------------------------------------------------------------

STATE = np.zeros((2, 2), np.int32)  # for LAYOUTS["small"]: state width 2, vocabulary 11
DRAFTS = np.array([[1, 2, 3], [4, 5, 6]], np.int32)


@pytest.mark.parametrize("fn", [ej.hash_draft, ej.commit_state])
@pytest.mark.parametrize(
    "state, drafts, error, match",
    [
        (STATE, DRAFTS[0], ValueError, r"draft_tokens must be \[B, K\]"),
        (STATE, DRAFTS[None], ValueError, r"draft_tokens must be \[B, K\]"),
        (np.zeros((3, 2), np.int32), DRAFTS, ValueError, "state has 3 rows, draft_tokens 2"),
        (np.zeros((2, 3), np.int32), DRAFTS, ValueError, r"state must be \[sequences, 2\]"),
        (None, DRAFTS, ValueError, "needs the committed state"),
        (STATE, DRAFTS.astype(np.float32), TypeError, "draft_tokens must hold integers"),
        (STATE, np.array([[1, 11, 2], [0, 0, 0]]), ValueError, r"draft_tokens\[0, 1\] = 11"),
        (STATE, np.array([[1, 2, 3], [0, -2, 0]]), ValueError, r"draft_tokens\[1, 1\] = -2"),
        (np.full((2, 2), 12, np.int32), DRAFTS, ValueError, r"state\[0, 0\] = 12"),
    ],
)
def test_bad_drafts(fn, state, drafts, error, match):
    args = (np.zeros(2, np.int32),) if fn is ej.commit_state else ()
    with pytest.raises(error, match=match):
        fn(LAYOUTS["small"], state, drafts, *args)


@pytest.mark.parametrize(
    "accepted, error, match",
    [
        ([0, 4], ValueError, r"num_accepted\[1\] = 4 is outside 0..3"),
        ([-1, 0], ValueError, r"num_accepted\[0\] = -1 is outside 0..3"),
        (jnp.array([0, 7]), ValueError, r"num_accepted\[1\] = 7"),
        ([0, 1, 2], ValueError, r"num_accepted must be \[2\]"),
        (1, ValueError, r"num_accepted must be \[2\]"),
        ([0.0, 1.0], TypeError, "num_accepted must hold integers"),
    ],
)
def test_bad_num_accepted(accepted, error, match):
    with pytest.raises(error, match=match):
        ej.commit_state(LAYOUTS["small"], STATE, DRAFTS, accepted)


@pytest.mark.parametrize(
    "rows, history, error, match",
    [
        (2, np.array([1, 2, 3]), ValueError, r"history must be \[num_sequences, L\] = \[2, L\]"),
        (2, np.zeros((3, 4), np.int32), ValueError, r"got shape \(3, 4\)"),
        (
            2,
            np.array([[1, 2], [11, 0]]),
            ValueError,
            r"history\[1, 0\] = 11 is not a compressed id",
        ),
        (1, np.array([[-5, 0, 0]]), ValueError, r"history\[0, 0\] = -5"),
        (1, np.array([[0.5]]), TypeError, "history must hold integers"),
        (-1, None, ValueError, "num_sequences"),
    ],
)
def test_bad_history(rows, history, error, match):
    with pytest.raises(error, match=match):
        ej.init_state(LAYOUTS["small"], rows, history=history)


def test_shape_errors_raise_while_tracing():
    """Inside jit the values are unknown, but shapes are checked at trace time."""
    layout = LAYOUTS["small"]
    with pytest.raises(ValueError, match="state has 3 rows"):
        jax.jit(lambda s, d: ej.hash_draft(layout, s, d))(np.zeros((3, 2), np.int32), DRAFTS)
    with pytest.raises(ValueError, match=r"num_accepted must be \[2\]"):
        jax.jit(lambda a: ej.commit_state(layout, STATE, DRAFTS, a))(np.zeros(3, np.int32))


# -- the CUDA backend -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["small", "flash"])
def test_gpu_speculative_rounds(gpu_device, name):
    """The draft-verify-commit loop with the hash on the GPU, against the reference."""
    layout = LAYOUTS[name]
    rows, k = 8, 4
    rng = np.random.default_rng(20)

    @functools.partial(jax.jit, static_argnums=0)
    def spec_round(layout, state, drafts, accepted):
        return ej.hash_draft(layout, state, drafts), ej.commit_state(
            layout, state, drafts, accepted
        )

    sequences = [random_sequence(rng, layout, int(rng.integers(0, 6))) for _ in range(rows)]
    with jax.default_device(gpu_device):
        state = ej.init_state(layout, rows, history=jnp.asarray(left_padded(sequences, 4)))
        for _ in range(6):
            drafts = np.stack([random_sequence(rng, layout, k, dead=0.1) for _ in range(rows)])
            accepted = rng.integers(0, k + 1, rows).astype(np.int32)
            ids, state = spec_round(layout, state, jnp.asarray(drafts), jnp.asarray(accepted))
            assert ids.devices() == {gpu_device} and state.devices() == {gpu_device}
            for b in range(rows):
                np.testing.assert_array_equal(
                    np.asarray(ids)[b], continuation(layout, sequences[b], drafts[b])
                )
                sequences[b] = np.r_[sequences[b], drafts[b, : accepted[b]]]
    for b in range(rows):
        np.testing.assert_array_equal(np.asarray(state)[b], state_of(layout, sequences[b]))


@pytest.mark.gpu
def test_gpu_history_matches_cpu(gpu_device, cpu_device):
    layout = LAYOUTS["wide"]
    rng = np.random.default_rng(21)
    history = np.stack([random_sequence(rng, layout, 9, dead=0.25) for _ in range(5)])
    drafts = np.stack([random_sequence(rng, layout, 6, dead=0.2) for _ in range(5)])
    results = {}
    for device in (gpu_device, cpu_device):
        with jax.default_device(device):
            state = ej.init_state(layout, 5, history=jnp.asarray(history))
            ids = ej.hash_draft(layout, state, jnp.asarray(drafts))
            assert ids.devices() == {device}
            results[device.platform] = np.asarray(ids)
    np.testing.assert_array_equal(results["gpu"], results["cpu"])
    for b in range(5):
        np.testing.assert_array_equal(
            results["gpu"][b], continuation(layout, history[b], drafts[b])
        )
