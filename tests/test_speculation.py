"""Speculative decoding in the serving example's engine (examples/serving): prompt
lookup (numpy and on the device) against a plain loop; the oracle drafter; the
scheduler's multi-token bookkeeping against a toy model that reads its own
per-position cache (so a wrong rollback shows); and the real decoder with CPU
tables, read at the layer, prefetched and without Engram, whose speculative tokens
equal greedy decoding's, with drafts from prompt lookup and from an oracle that is
right only part of the time (so both accepting and rolling back are exercised),
and differ once the KV rollback is taken out.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engram_jax as ej

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from serving import engine, model, tables  # noqa: E402

# -- prompt lookup -----------------------------------------------------------------------


def lookup_alone(text: list[int], k: int, sizes=(3, 2)) -> list[int]:
    """The tokens after the last earlier occurrence of the text's final n-gram, plainly."""
    for size in sizes:
        if len(text) <= size:
            continue
        key = text[-size:]
        for start in range(len(text) - size - 1, -1, -1):
            if text[start : start + size] == key:
                return text[start + size : start + size + k]
    return []


def check_prompt_lookup(texts, k, slack, past, xp):
    width = max(map(len, texts)) + slack
    rows = np.full((len(texts), width), past, np.int32)  # past each length
    for i, t in enumerate(texts):
        rows[i, : len(t)] = t
    lengths = np.array([len(t) for t in texts], np.int32)
    drafts, found = engine.prompt_lookup(xp.asarray(rows), xp.asarray(lengths), k, xp=xp)
    drafts, found = np.asarray(drafts), np.asarray(found)
    for i, t in enumerate(texts):
        want = lookup_alone(t, k)
        assert found[i] == len(want), (t, k)
        assert drafts[i, : found[i]].tolist() == want and not drafts[i, found[i] :].any()


texts_strategy = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=6
)


@settings(max_examples=200, deadline=None)
@given(texts=texts_strategy, k=st.integers(1, 5), slack=st.integers(0, 4), past=st.integers(0, 7))
def test_prompt_lookup_matches_a_plain_loop(texts, k, slack, past):
    """What lies past a row's length (a slot's stale text) never matches."""
    check_prompt_lookup(texts, k, slack, past, np)


@settings(max_examples=6, deadline=None)  # each example runs op by op in jax: slow
@given(texts=texts_strategy, k=st.integers(1, 4), slack=st.integers(0, 3), past=st.integers(0, 7))
def test_prompt_lookup_on_the_device_matches_a_plain_loop(texts, k, slack, past):
    check_prompt_lookup(texts, k, slack, past, jnp)


def test_oracle_drafter():
    """Right drafts at acceptance 1, wrong ones at 0, none off the reference's track
    or past its end, and none for an idle slot."""
    refs = [[5, 6, 7, 8, 9, 10], [1, 2, 3]]
    text = jnp.array(
        [[5, 6, 7, 0, 0, 0], [1, 2, 3, 0, 0, 0], [5, 4, 7, 0, 0, 0], [5, 0, 0, 0, 0, 0]]
    )
    length = jnp.array([3, 3, 3, 1])
    request = jnp.array([0, 1, 0, -1])
    drafts, found = engine.oracle_drafter(refs, 1.0)(text, length, request, 2)
    assert found.tolist() == [2, 0, 0, 0] and drafts[0].tolist() == [8, 9]
    drafts, found = engine.oracle_drafter(refs, 0.0)(text, length, request, 2)
    assert found.tolist() == [2, 0, 0, 0] and (drafts[0] != jnp.array([8, 9])).all()
    # Each token kept with the chance given, per request and position: about half at
    # 0.5, the same in every run.
    text = jnp.tile(jnp.array([[5, 6]]), (400, 1))
    args = text, jnp.full(400, 1), jnp.arange(400), 3
    a, _ = engine.oracle_drafter(refs[:1] * 400, 0.5, seed=3)(*args)
    b, _ = engine.oracle_drafter(refs[:1] * 400, 0.5, seed=3)(*args)
    assert (a == b).all() and 0.4 < float(jnp.mean(a == jnp.array([6, 7, 8]))) < 0.6
    with pytest.raises(ValueError, match="acceptance must be in"):
        engine.oracle_drafter(refs, 1.5)


# -- the scheduler, against a toy model ------------------------------------------------

VOCAB = 6  # small: a sequence soon repeats itself, and prompt lookup drafts often
MAX_LEN = 64


def toy_next(a: int, b: int) -> int:
    """The toy model's greedy token after ``a, b`` (EOS, token 1, about one time in six)."""
    return (3 * a + 5 * b + 2) % VOCAB


def toy_step(params, state, inputs, verify=True):
    """A model in numpy with the engine step's signature. Its "KV cache" keeps each
    position's token, and a prediction reads the two tokens before it from there, so
    a position advanced past a rejected draft reads that draft later. Drafts come
    from prompt lookup over the slot's text, as the engine's default drafter's."""
    cache, pos, text, left = (np.array(a) for a in state)
    k = params["speculate"]
    tokens = np.array(inputs.tokens)
    slots, width = tokens.shape
    decoding = np.asarray(inputs.decoding)
    pos = np.where(inputs.reset, 0, pos)
    left = np.where(inputs.reset, inputs.budget, left)
    n_drafts = np.zeros(slots, np.int32)
    tokens[decoding, 0] = text[np.arange(slots), pos][decoding]
    if k and width > 1 and verify:
        drafts, found = engine.prompt_lookup(text, pos + 1, k)
        n_drafts = np.where(decoding, np.clip(found, 0, np.minimum(width - 1, left - 1)), 0)
        columns = np.arange(1, width)
        use = decoding[:, None] & (columns[None, :] <= n_drafts[:, None])
        tokens[:, 1:] = np.where(
            use, np.pad(drafts, ((0, 0), (0, width)))[:, : width - 1], tokens[:, 1:]
        )
    n_valid = np.where(decoding, 1 + n_drafts, inputs.n_valid)
    predictions = np.zeros((slots, k + 1), np.int32)
    accepted = np.zeros(slots, np.int32)
    for b in range(slots):
        cache[b, pos[b] : pos[b] + width] = tokens[b]
        base = max(n_valid[b] - 1 - n_drafts[b], 0)
        for j in range(k + 1):
            at = pos[b] + min(base + j, width - 1)
            predictions[b, j] = toy_next(cache[b, at - 1] if at else 0, cache[b, at])
        while (
            accepted[b] < n_drafts[b]
            and predictions[b, accepted[b]] == tokens[b, base + 1 + accepted[b]]
        ):
            accepted[b] += 1
    committed = n_valid - n_drafts + accepted
    next_tokens = predictions[np.arange(slots), accepted]
    for b in range(slots):
        text[b, pos[b] : pos[b] + width] = tokens[b]
        text[b, pos[b] + committed[b]] = next_tokens[b]
    pos = pos + committed
    left = left - np.where(decoding, accepted + 1, np.asarray(inputs.emits, np.int32))
    found = engine.prompt_lookup(text, pos + 1, k)[1] if k else np.zeros(slots, np.int32)
    out = engine.StepOutput(
        jnp.asarray(next_tokens),
        predictions,
        accepted,
        n_drafts,
        np.minimum(found, np.maximum(left - 1, 0)),
        jnp.int32(0),
        np.zeros((1, 2), np.uint32),
        np.ones(predictions.shape, np.float32),
    )
    return (cache, pos, text, left), out


def toy_state(slots: int):
    return (
        np.zeros((slots, MAX_LEN), np.int32),
        np.zeros(slots, np.int32),
        np.zeros((slots, MAX_LEN), np.int32),
        np.zeros(slots, np.int32),
    )


class AlwaysWide(engine.WidthChoice):
    """Every decode step verifies drafts: the tests of what speculation decodes must
    not depend on how fast a loaded machine runs the steps."""

    def wide(self, found, decoding, stats, prefill=False) -> bool:
        return bool(self.speculate and decoding.any())


class CoinChoice(engine.WidthChoice):
    """Verifies or not at random, in decode steps and in steps with prompts in them
    alike: whatever a step's choice, every request must decode as it would alone."""

    def __init__(self, speculate: int, seed: int):
        super().__init__(speculate)
        self.rng = np.random.default_rng(seed)

    def wide(self, found, decoding, stats, prefill=False) -> bool:
        return bool(self.speculate and decoding.any() and self.rng.random() < 0.5)


class DecodeStepsOnly(AlwaysWide):
    """Verifies in every decode step, never in a step with prompts in it."""

    def wide(self, found, decoding, stats, prefill=False) -> bool:
        return not prefill and super().wide(found, decoding, stats)


def test_width_choice_widens_when_the_drafts_pay_for_it():
    choice = engine.WidthChoice(3)
    decoding = np.array([True, True, True, True])
    stats = engine.RunStats()
    # Before any step time is seen, a wide step is taken to cost 1.5 narrow ones.
    assert not choice.wide(np.zeros(4, np.int32), decoding, stats)
    assert choice.wide(np.full(4, 3), decoding, stats)  # 0.5 x 12 drafts > 4 x 0.5
    assert not choice.wide(np.array([3, 0, 0, 0]), decoding, stats)  # 1.5 < 2
    for _ in range(4):
        choice.observe(False, 0.010)
        choice.observe(True, 0.030)  # now a wide step costs 3 narrow ones
    assert not choice.wide(np.full(4, 3), decoding, stats)  # 6 < 4 x 2
    stats.drafted, stats.accepted = 1000, 1000  # every draft accepted so far
    assert choice.wide(np.full(4, 3), decoding, stats)  # ~12 > 8
    assert not engine.WidthChoice(0).wide(np.full(4, 3), decoding, stats)
    assert not choice.wide(np.full(4, 3), np.zeros(4, bool), stats)


def test_width_choice_judges_steps_with_prompts_by_their_own_times():
    """A step with prompts in it is as wide either way: verifying costs only its
    vocabulary head for more positions, so fewer drafts pay for it, and its times
    are kept apart from the decode steps'."""
    choice = engine.WidthChoice(3)
    decoding = np.ones(4, bool)
    stats = engine.RunStats()
    one_slot = np.array([3, 0, 0, 0])
    assert choice.wide(one_slot, decoding, stats, prefill=True)  # 1.5 > 4 x 0.2
    assert not choice.wide(one_slot, decoding, stats)  # 1.5 < 4 x 0.5
    for _ in range(4):
        choice.observe(False, 0.010, prefill=True)
        choice.observe(True, 0.020, prefill=True)  # verifying doubles this step
        choice.observe(False, 0.010)
        choice.observe(True, 0.011)  # a wide decode step costs little more
    assert not choice.wide(one_slot, decoding, stats, prefill=True)  # 1.5 < 4 x 1
    assert choice.wide(one_slot, decoding, stats)  # 1.5 > 4 x 0.1


class Recording(AlwaysWide):
    """AlwaysWide, noting whether each step faced a choice and what it was told."""

    def __init__(self, speculate: int):
        super().__init__(speculate)
        self.faced, self.observed = [], 0

    def wide(self, found, decoding, stats, prefill=False) -> bool:
        self.faced.append(bool(decoding.any()))
        return super().wide(found, decoding, stats, prefill)

    def observe(self, wide, seconds, prefill=False) -> None:
        self.observed += 1
        super().observe(wide, seconds, prefill)


def test_the_choice_learns_only_from_steps_that_faced_it():
    """Step times reach the choice only from steps with sequences decoding in them
    (a round's first steps, all prompts, faced none), never the first read's."""
    choice = Recording(3)
    prompts = [[0, 2, 3, 4, 5, 6], [0, 4, 5, 3, 7, 1, 2], [0, 3]]
    _, stats, _ = engine.serve(
        toy_step, {"speculate": 3}, toy_state(2), prompts,
        slots=2, prefill_chunk=2, max_new_tokens=6, speculate=3, choice=choice,
    )  # fmt: skip
    assert choice.faced[:2] == [False, False] and any(choice.faced)
    assert choice.observed == sum(choice.faced[1:])
    assert sum(map(len, stats.kind_steps.values())) == stats.steps - 1


def toy_alone(prompt: list[int], max_new_tokens: int) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_new_tokens and (not out or out[-1] != model.EOS_ID):
        out.append(toy_next(seq[-2] if len(seq) > 1 else 0, seq[-1]))
        seq.append(out[-1])
    return out


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=10),
    slots=st.integers(1, 4),
    chunk=st.integers(1, 6),
    speculate=st.integers(0, 4),
    max_new_tokens=st.integers(1, 16),
    seed=st.integers(0, 2**16),
    coin=st.booleans(),
)
def test_speculative_scheduler_decodes_each_request_as_alone(
    lengths, slots, chunk, speculate, max_new_tokens, seed, coin
):
    """Several tokens a step per slot, cut at the budget and at EOS, the rest rolled
    back: every request gets exactly what decoding it alone gives (``coin``: each
    step verifies or not at random)."""
    rng = np.random.default_rng(seed)
    prompts = [[0, *rng.integers(2, VOCAB, n - 1).tolist()] for n in lengths]
    state = toy_state(slots)
    outputs, stats, _ = engine.serve(
        toy_step,
        {"speculate": speculate},
        state,
        prompts,
        slots=slots,
        prefill_chunk=chunk,
        max_new_tokens=max_new_tokens,
        speculate=speculate,
        choice=CoinChoice(speculate, seed) if coin else None,
    )
    expected = [toy_alone(p, max_new_tokens) for p in prompts]
    assert outputs == expected
    assert stats.generated == sum(map(len, expected))
    assert 0 <= stats.accepted <= stats.drafted
    assert stats.drafted == 0 or speculate


def test_speculative_scheduler_accepts_drafts_of_a_repetitive_model():
    """The toy model loops soon, so prompt lookup drafts right: most drafts are accepted,
    and fewer steps are run than tokens generated."""
    prompts = [[0, 2, 3], [0, 4, 5, 3], [0, 3]]
    state = toy_state(2)
    outputs, stats, _ = engine.serve(
        toy_step,
        {"speculate": 3},
        state,
        prompts,
        slots=2,
        prefill_chunk=4,
        max_new_tokens=30,
        speculate=3,
        choice=AlwaysWide(3),
    )
    assert outputs == [toy_alone(p, 30) for p in prompts]
    assert stats.acceptance_rate > 0.5
    assert len(stats.decode_steps) < stats.generated / 2


# -- the real decoder, CPU tables ------------------------------------------------------

CFG = model.MODELS["micro"]
SLOTS, CHUNK, MAX_NEW = 3, 4, 12


@functools.cache
def setup():
    """Model, layout, CPU tables of distinct rows (kept open for the session) and prompts."""
    compressor = ej.TokenCompressor(np.arange(CFG.vocab_size) % 5000)
    layout = tables.make_layout(CFG, compressor, 0.004)
    params = model.init_params(CFG, 0, jnp.float32)
    stack = contextlib.ExitStack()
    built = tables.build_tables(layout, "cpu", jax.devices("cpu")[0], stack, progress=False)
    rng = np.random.default_rng(1)
    prompts = [[model.BOS_ID, *rng.integers(3, 50_000, n).tolist()] for n in (2, 9, 5, 3, 7, 4, 6)]
    return compressor, layout, params, built, stack, prompts


def decode(mode: str, speculate: int, drafter=None, wrap=None, choice=None):
    compressor, layout, params, built, _, prompts = setup()
    step = engine.make_step(
        CFG,
        layout,
        compressor,
        built if mode != "none" else (),
        mode,
        speculate=speculate,
        drafter=drafter,
    )
    step = wrap(step) if wrap else step
    max_len = engine.cache_length(max(map(len, prompts)), MAX_NEW, CHUNK, speculate)
    state = engine.init_slot_state(CFG, layout, SLOTS, max_len, jnp.float32)
    outputs, stats, _ = engine.serve(
        step,
        params,
        state,
        prompts,
        slots=SLOTS,
        prefill_chunk=CHUNK,
        max_new_tokens=MAX_NEW,
        speculate=speculate,
        choice=choice,
    )
    return outputs, stats


@functools.cache
def greedy_run(mode: str):
    return decode(mode, 0)


def greedy(mode: str):
    return greedy_run(mode)[0]


@functools.cache
def oracle_run(mode: str, speculate: int):
    """Oracle drafts, every decode step verifying: shared by the tests that check it."""
    return decode(mode, speculate, drafter=oracle(mode), choice=AlwaysWide(speculate))


def oracle(mode: str, seed: int = 0):
    """Drafts of greedy decoding's own continuation, each draft token wrong one time in
    three: accepted up to the first wrong one."""
    _, _, _, _, _, prompts = setup()
    references = [p + out for p, out in zip(prompts, greedy(mode), strict=True)]
    return engine.oracle_drafter(references, 2 / 3, seed=seed)


@pytest.mark.parametrize(
    # Width 2 (K = 1) once; the prefetched lookup at K = 3 (a suite-time budget).
    "mode, speculate",
    [("sync", 1), ("sync", 3), ("prefetch", 3), ("none", 3)],
)
def test_speculative_tokens_equal_greedy_decoding(mode, speculate):
    outputs, stats = oracle_run(mode, speculate)
    assert outputs == greedy(mode)
    # Both ways through the verify step were taken: drafts accepted, drafts rolled back.
    assert 0.2 < stats.acceptance_rate < 0.9, stats
    assert stats.wide_steps and len(stats.decode_steps) < len(greedy_run(mode)[1].decode_steps)
    # Prompt lookup's own drafts (random weights: few, if any, are right), here read at
    # the layer at K = 1 and without Engram; the drafter does not depend on the lookup,
    # and the example's runs check it with prefetched host tables at K = 3
    # (test_examples.py: serve.py --speculate 3; test_speculate_bench.py's smoke).
    if speculate == 1 or mode == "none":
        assert decode(mode, speculate)[0] == greedy(mode)


def test_steps_with_prompts_in_them_verify_only_when_chosen():
    """Without verifying, a step with prompts in it drafts nothing (its head runs
    for one position per slot): the same tokens, fewer drafts."""
    both, both_stats = oracle_run("sync", 3)
    only, only_stats = decode("sync", 3, drafter=oracle("sync"), choice=DecodeStepsOnly(3))
    assert both == only == greedy("sync")
    assert both_stats.verifying_prefill_steps > 0 and only_stats.verifying_prefill_steps == 0
    assert 0 < only_stats.drafted < both_stats.drafted
    assert only_stats.wide_steps > 0


def test_engram_rows_change_the_tokens():
    """What the checks above compare depends on the Engram rows."""
    assert greedy("sync") == greedy("prefetch") != greedy("none")


def keep_rejected_drafts(step):
    """The step with its KV rollback taken out: a slot's position moves past every
    token it verified, rejected drafts included (its text still ends in the token
    predicted last)."""

    def broken(params, state, inputs, verify=True):
        pos = jnp.where(jnp.asarray(inputs.reset), 0, state["kv"]["pos"])
        state, out = step(params, state, inputs, verify=verify)
        moved = pos + jnp.where(jnp.asarray(inputs.decoding), 1 + out.drafted, inputs.n_valid)
        text = state["text"].at[jnp.arange(moved.size), moved].set(out.next_tokens, mode="drop")
        return dict(state, kv=dict(state["kv"], pos=moved), text=text), out

    return broken


def test_without_the_rollback_the_tokens_differ():
    """The check has teeth: keep the rejected drafts in the KV cache and greedy
    decoding's tokens are lost."""
    outputs, _ = decode(
        "sync", 3, drafter=oracle("sync"), wrap=keep_rejected_drafts, choice=AlwaysWide(3)
    )
    assert outputs != greedy("sync")


def test_a_drafter_of_the_wrong_shape_fails_before_compiling():
    compressor, layout, _, built, _, _ = setup()

    def short(text, length, request, k):
        return jnp.zeros((text.shape[0], k - 1), jnp.int32), length

    def floats(text, length, request, k):
        return jnp.zeros((text.shape[0], k), jnp.float32), length

    for drafter in (short, floats):
        with pytest.raises(TypeError, match="a drafter must return int32 drafts"):
            engine.make_step(CFG, layout, compressor, built, "sync", speculate=2, drafter=drafter)
    with pytest.raises(ValueError, match="speculate must be an int >= 0"):
        engine.make_step(CFG, layout, compressor, built, "sync", speculate=-1)
