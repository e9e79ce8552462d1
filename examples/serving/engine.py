"""The serving engine: one jitted step over every slot (chunked prefill, decode, or a
speculative verify pass), each step's Engram rows hashed from the slot's lookback
state and fetched from the tables, and the continuous-batching loop that feeds it,
refills finished slots and, with speculation, drafts by prompt lookup.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import engram_jax as ej

from . import model

# How a step reads Engram rows: not at all (the decoder without its Engram layers),
# a lookup at the layer, a lookup started after the embedding and awaited at the layer,
# or zeros in place of the rows (hashing kept: what the wait for rows costs).
MODES = ("none", "sync", "prefetch", "zeros")


class StepInputs(NamedTuple):
    """What the host gives a step, per slot (numpy or device arrays).

    ``tokens`` ``[slots, C]``: a prefilling slot's prompt chunk, its first
    ``n_valid`` real (a decoding slot's columns are ignored: its tokens come from
    its own text on the device). ``reset``: the slot starts a new sequence here,
    allowed ``budget`` generated tokens. ``decoding``: the slot decodes (its last
    token, plus drafts in a speculative step). ``emits``: the slot's step yields a
    token (decoding, or the chunk that completes its prompt). ``request``: the
    request the slot serves (-1: none), for drafters that know requests.
    """

    tokens: np.ndarray
    n_valid: np.ndarray
    reset: np.ndarray
    decoding: np.ndarray
    emits: np.ndarray
    budget: np.ndarray
    request: np.ndarray


class StepOutput(NamedTuple):
    """What a step returns beside the new state, all on the device.

    ``predictions`` ``[slots, speculate + 1]``: greedy tokens after the slot's last
    committed token and after each of its drafts (a prefill slot: after its last
    prompt token, in column 0). ``accepted``: drafts the predictions agree with, a
    prefix, of the ``drafted`` the slot verified. ``next_tokens``: the token after
    everything committed, ``predictions[b, accepted[b]]``. ``found``: drafts the
    drafter has for the slot's next step (the host widens steps by it).
    ``fetched``: Engram rows read. ``checks``: uint32 ``[Engram layers, 2]``
    checksums of each layer's ids and rows, and with ``expected`` a third, of the
    rows the table should have returned (zeros without a ``checksum``).
    ``margins`` float32 like ``predictions``: how far each prediction's logit lies
    above the runner-up's (a near tie flips with the rounding of another shape).
    """

    next_tokens: jax.Array
    predictions: jax.Array
    accepted: jax.Array
    drafted: jax.Array
    found: jax.Array
    fetched: jax.Array
    checks: jax.Array
    margins: jax.Array


# A drafter proposes up to ``k`` tokens per slot on the device from each slot's text
# (``text`` ``[slots, L]``, the first ``length`` tokens real) and the request it
# serves: ``drafter(text, length, request, k) -> (drafts [slots, k], found [slots])``.
Drafter = Callable[[jax.Array, jax.Array, jax.Array, int], tuple[jax.Array, jax.Array]]


def cache_length(max_prompt_tokens: int, max_new_tokens: int, prefill_chunk: int, speculate: int):
    """KV positions per slot: a step writes its whole width past the slot's position."""
    return max_prompt_tokens + max_new_tokens + max(step_widths(prefill_chunk, speculate))


def step_widths(prefill_chunk: int, speculate: int) -> list[int]:
    """Tokens per slot of the step shapes, each compiled once: a decode step (1), a
    verify step (``speculate + 1``) and a step with prompts in it."""
    return sorted({1, speculate + 1, max(prefill_chunk, speculate + 1)})


def step_shapes(prefill_chunk: int, speculate: int) -> list[tuple[int, bool]]:
    """The ``(width, verify)`` of every step :func:`serve` runs, each compiled once:
    a decode step, a verify step, and a step with prompts in it, which with
    ``speculate`` comes both ways (its decoding slots verifying drafts or not)."""
    *_, mixed = step_widths(prefill_chunk, speculate)
    verify = bool(speculate)
    shapes = [(1, False), (speculate + 1, verify), (mixed, False), (mixed, verify)]
    return list(dict.fromkeys(shapes))


def init_slot_state(cfg: model.ModelConfig, layout, slots: int, max_len: int, dtype) -> dict:
    """Each slot's KV cache and position, its n-gram lookback state, its text (the
    tokens at positions ``0..pos``: the KV cache's and the one predicted after them)
    and the tokens it may still generate."""
    return dict(
        kv=model.init_kv_state(cfg, slots, max_len, dtype),
        lookback=ej.init_state(layout, slots),
        text=jnp.zeros((slots, max_len), jnp.int32),
        left=jnp.zeros((slots,), jnp.int32),
    )


def accepted_drafts(predictions, tokens, base, n_drafts) -> jax.Array:
    """Per slot, the longest prefix of its drafts (``tokens[b, base[b] + 1 :]``, the
    first ``n_drafts[b]``) that greedy decoding agrees with, on the device."""
    k = predictions.shape[1] - 1
    if not k:
        return jnp.zeros(tokens.shape[:1], jnp.int32)
    j = jnp.arange(k)
    at = jnp.minimum(base[:, None] + 1 + j, tokens.shape[1] - 1)
    agree = (predictions[:, :k] == jnp.take_along_axis(tokens, at, axis=1)) & (
        j < n_drafts[:, None]
    )
    return jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def top2_margin(scores: jax.Array, predictions: jax.Array) -> jax.Array:
    """The best logit minus the runner-up's, per prediction (``scores`` ``[..., vocab]``)."""
    best = jnp.take_along_axis(scores, predictions[..., None], axis=-1)[..., 0]
    is_best = jnp.arange(scores.shape[-1]) == predictions[..., None]
    return best - jnp.max(jnp.where(is_best, -jnp.inf, scores), axis=-1)


def make_step(
    cfg: model.ModelConfig,
    layout,
    compressor,
    tables,
    mode: str,
    *,
    caches=None,
    speculate: int = 0,
    drafter: Drafter | None = None,
    prefetch_ctas: int | None = None,
    order: str = ej.PREFETCH_ORDER,
    checksum: Callable[[jax.Array], jax.Array] | None = None,
    expected: Callable[[int, jax.Array], jax.Array] | None = None,
):
    """The jitted engine step ``step(params, state, inputs: StepInputs, verify=True) ->
    (state, StepOutput)`` of ``mode`` (see MODES) over ``tables`` (one per Engram layer;
    ``caches``: a hot-row cache per table, or None), its state donated. With
    ``speculate`` K, each decoding slot verifies up to K drafts from ``drafter``
    (default: :func:`prompt_lookup_drafter`), as many as the step's width leaves
    room for: a width-1 step is plain decoding. Prefetched lookups visit their rows
    in ``order`` (see :func:`engram_jax.lookup`). ``checksum(array) -> uint32`` adds
    each layer's ids and rows checksums to the output (for comparing runs);
    ``expected(layer, ids) -> rows``, the rows layer ``layer``'s table holds for
    ``ids``, adds their checksum (for checking a run's rows against its tables)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(speculate, bool) or not isinstance(speculate, int) or speculate < 0:
        raise ValueError(f"speculate must be an int >= 0, got {speculate!r}")
    caches = tuple(caches) if caches else (None,) * len(tables)
    if speculate and drafter is None:
        drafter = prompt_lookup_drafter()

    def draft(text, length, request, limit):
        """The drafter's proposals, checked, cut to ``limit`` per slot."""
        drafts, found = drafter(text, length, request, speculate)
        slots = text.shape[0]
        if drafts.shape != (slots, speculate) or drafts.dtype != jnp.int32:
            raise TypeError(
                f"a drafter must return int32 drafts [{slots}, {speculate}] and found "
                f"[{slots}], got drafts {drafts.dtype} {list(drafts.shape)}"
            )
        if found.shape != (slots,) or not jnp.issubdtype(found.dtype, jnp.integer):
            raise TypeError(
                f"a drafter must return found as integers [{slots}], got {found.dtype} "
                f"{list(found.shape)}"
            )
        return drafts, jnp.clip(found.astype(jnp.int32), 0, jnp.maximum(limit, 0))

    if speculate:  # a drafter of the wrong shape fails here, before any step compiles
        one = jax.ShapeDtypeStruct((2,), jnp.int32)
        jax.eval_shape(draft, jax.ShapeDtypeStruct((2, speculate + 8), jnp.int32), one, one, one)

    def step(params, state, inputs: StepInputs, verify: bool = True):
        """One engine step over every slot (see StepInputs). A slot commits its tokens
        up to the last accepted draft: its position, text and lookback state move past
        them, and whatever the step wrote beyond is overwritten by the next step.
        ``verify`` (static): decoding slots verify drafts where the width leaves room;
        without it the step decodes one token per slot and its vocabulary head runs
        for one position per slot, as the plain step's does (in a step with prompts in
        it, a head for ``speculate + 1`` positions per slot made the step 1.19x as
        long, medium model at 512 slots on an H200)."""
        tokens = jnp.asarray(inputs.tokens, jnp.int32)
        slots, width = tokens.shape
        rows_of = jnp.arange(slots)
        reset, decoding = jnp.asarray(inputs.reset), jnp.asarray(inputs.decoding)
        pos = jnp.where(reset, 0, state["kv"]["pos"])
        left = jnp.where(reset, inputs.budget, state["left"])
        lookback = jnp.where(reset[:, None], layout.pad_id, state["lookback"])
        text = state["text"]
        # A decoding slot's tokens: its last one, then what the drafter proposes.
        n_drafts = jnp.zeros(slots, jnp.int32)
        own = text[rows_of, pos][:, None]
        if speculate and width > 1 and verify:
            limit = jnp.where(decoding, jnp.minimum(width - 1, left - 1), 0)
            drafts, n_drafts = draft(text, pos + 1, inputs.request, limit)
            pad = max(width - 1 - speculate, 0)
            own = jnp.concatenate([own, jnp.pad(drafts, ((0, 0), (0, pad)))[:, : width - 1]], 1)
        else:
            own = jnp.pad(own, ((0, 0), (0, width - 1)))
        tokens = jnp.where(decoding[:, None], own, tokens)
        n_valid = jnp.where(decoding, 1 + n_drafts, inputs.n_valid)
        valid = jnp.arange(width)[None, :] < n_valid[:, None]
        embedded_tokens = jnp.where(valid, tokens, 0)
        fetched = jnp.zeros((), jnp.int32)
        checks = [jnp.zeros(2 if expected is None else 3, jnp.uint32)] * len(cfg.engram_layers)
        engram_rows = None
        if mode != "none":
            # Padding is DEAD: it hashes to DEAD ids, which read nothing.
            compressed = jnp.where(valid, compressor(tokens), ej.DEAD_ID)
            ids = ej.hash_draft(layout, lookback, compressed)  # [slots, C, layers, cols]
            if mode != "zeros":
                fetched = jnp.sum(ids != ej.DEAD_ID, dtype=jnp.int32)
            if mode == "prefetch":
                # Not chained with after=: a decode step's gathers are short beside the
                # blocks before the first Engram layer, whichever XLA issues first.
                handles = [
                    ej.lookup_start(t, ids[:, :, i], order=order, cache=c, max_ctas=prefetch_ctas)
                    for i, (t, c) in enumerate(zip(tables, caches, strict=True))
                ]
                # Tied to the embedding's token ids, so XLA issues the starts before
                # block 0. Not to x: out of a barrier x's hc_mult copies are no longer
                # one broadcast to XLA, which then fuses and tiles the blocks' norms
                # otherwise than in the plain lookup's program (other rounding, other
                # tokens on the GPU).
                embedded_tokens, handles = jax.lax.optimization_barrier((embedded_tokens, handles))

            def engram_rows(e, x):
                layer_ids = ids[:, :, e]
                if mode == "prefetch":
                    # Tied to one value of x, x not routed through: a bf16 x out of a
                    # barrier would be rounded where the plain lookup's program may not,
                    # and a barrier on all of x would make XLA build it whole (its copies
                    # too) where the plain program need not: other tokens either way.
                    one_value = jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim)
                    handle, _ = jax.lax.optimization_barrier((handles[e], one_value))
                    rows = ej.lookup_done(handle)
                elif mode == "sync":
                    rows = ej.lookup(tables[e], layer_ids, cache=caches[e])
                else:
                    rows = jnp.zeros(layer_ids.shape + (layout.head_dim,), jnp.bfloat16)
                if checksum is not None:
                    sums = [checksum(layer_ids), checksum(rows)]
                    if expected is not None:
                        # After the layer's rows, so it hides no gather it would not otherwise.
                        later_ids, _ = jax.lax.optimization_barrier((layer_ids, rows))
                        sums.append(checksum(expected(e, later_ids)))
                    checks[e] = jnp.stack(sums)
                return rows, ej.token_mask_from_ids(layer_ids) & valid

        x = model.embed(cfg, params, embedded_tokens)
        x, kv = model.run_blocks(cfg, params, state["kv"], x, pos, engram_rows)
        # Positions that predict: a prefill slot's last token; a decode slot's first
        # token (its last committed one) and each draft after it.
        # A step of width C predicts at most C tokens per slot: the head's logits (a
        # vocabulary-wide GEMM) only for those, the rest of the columns padding.
        base = jnp.maximum(n_valid - 1 - n_drafts, 0)
        heads = min(speculate + 1, width) if verify else 1
        at = jnp.minimum(base[:, None] + jnp.arange(heads), width - 1)
        hidden = x[rows_of[:, None], at]
        scores = model.logits(cfg, params, hidden)
        predictions = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        margins = top2_margin(scores, predictions)
        padding = ((0, 0), (0, speculate + 1 - at.shape[1]))
        predictions, margins = jnp.pad(predictions, padding), jnp.pad(margins, padding)
        accepted = accepted_drafts(predictions, tokens, base, n_drafts)
        committed = n_valid - n_drafts + accepted
        if mode != "none":
            lookback = ej.commit_state(layout, lookback, compressed, committed)
        next_tokens = jnp.take_along_axis(predictions, accepted[:, None], axis=1)[:, 0]
        # The step's tokens at their positions, then the token after the committed ones
        # (what lies past it is never read before it is written again).
        written = pos[:, None] + jnp.arange(width)
        text = text.at[rows_of[:, None], written].set(tokens, mode="drop")
        text = text.at[rows_of, pos + committed].set(next_tokens, mode="drop")
        pos = pos + committed
        emitted = jnp.where(decoding, accepted + 1, jnp.asarray(inputs.emits, jnp.int32))
        left = left - emitted
        if speculate:
            goes_on = decoding | jnp.asarray(inputs.emits)
            limit = jnp.where(goes_on, jnp.minimum(speculate, left - 1), 0)
            found = draft(text, pos + 1, inputs.request, limit)[1]
        else:
            found = jnp.zeros(slots, jnp.int32)
        new_state = dict(kv=dict(kv, pos=pos), lookback=lookback, text=text, left=left)
        out = StepOutput(
            next_tokens, predictions, accepted, n_drafts, found, fetched, jnp.stack(checks), margins
        )
        return new_state, out

    return jax.jit(step, donate_argnums=1, static_argnames="verify")


def idle_inputs(slots: int, width: int) -> StepInputs:
    """A step's inputs where every slot is idle: it changes nothing."""
    zeros = np.zeros(slots, np.int32)
    off = zeros > 0
    return StepInputs(np.zeros((slots, width), np.int32), zeros, off, off, off, zeros, zeros - 1)


def warm_up(step, params, state, slots: int, shapes: list[tuple[int, bool]]):
    """Compile ``step`` for every ``(width, verify)`` of :func:`step_shapes` before any
    clock starts; returns the state."""
    for width, verify in shapes:
        state, out = step(params, state, idle_inputs(slots, width), verify=verify)
    jax.block_until_ready(out)
    return state


# -- drafting -------------------------------------------------------------------------


def prompt_lookup(texts, lengths, k: int, sizes: tuple[int, ...] = (3, 2), xp=np):
    """Drafts without a draft model: for each row of ``texts`` (its first ``lengths``
    tokens), the up to ``k`` tokens that followed the last earlier occurrence of its
    final n-gram, the longest of ``sizes`` that occurs. Returns ``[n, k]`` drafts
    and how many of each are real (0: no match). ``xp``: numpy, or jax.numpy to
    run it inside a step."""
    n, width = texts.shape
    drafts = xp.zeros((n, k), xp.int32)
    found = xp.zeros(n, xp.int32)
    j = xp.arange(k)
    for size in sizes:
        if width <= size:
            continue
        key = xp.take_along_axis(texts, xp.maximum(lengths[:, None] - size + xp.arange(size), 0), 1)
        count_windows = width - size + 1
        windows = xp.stack([texts[:, i : i + count_windows] for i in range(size)], -1)
        starts = xp.arange(count_windows)
        # An earlier occurrence with a token after it: the final n-gram itself is not one.
        match = (windows == key[:, None, :]).all(-1) & (starts + size < lengths[:, None])
        new = match.any(1) & (found == 0)
        follow = count_windows - 1 - xp.argmax(match[:, ::-1], axis=1) + size
        take = xp.take_along_axis(texts, xp.minimum(follow[:, None] + j, width - 1), 1)
        count = xp.minimum(k, lengths - follow)
        drafts = xp.where(new[:, None], xp.where(j < count[:, None], take, 0), drafts)
        found = xp.where(new, count, found).astype(xp.int32)
    return drafts.astype(xp.int32), found


def prompt_lookup_drafter(sizes: tuple[int, ...] = (3, 2)) -> Drafter:
    """:func:`prompt_lookup` on the device, over each slot's own text."""

    def drafter(text, length, request, k):
        return prompt_lookup(text, length, k, sizes, xp=jnp)

    return drafter


def oracle_drafter(references: list[list[int]], acceptance: float, seed: int = 0) -> Drafter:
    """Drafts that are right with a set chance: request r's ``references[r]`` (its
    prompt and the greedy continuation of a plain run) past the slot's text, each
    token kept with probability ``acceptance`` and else replaced by a wrong one
    (random per request and position, the same in every run). A slot whose text has
    left its reference gets no drafts. For measuring speculation at a known
    acceptance, and for tests that must both accept and reject drafts."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if not references:
        raise ValueError("references must hold one token list per request")
    longest = max(map(len, references))
    table = np.zeros((len(references), longest), np.int32)
    for r, ref in enumerate(references):
        table[r, : len(ref)] = ref
    lengths = np.array([len(ref) for ref in references], np.int32)
    base_key = jax.random.PRNGKey(seed)

    def drafter(text, length, request, k):
        slots, width = text.shape
        r = jnp.clip(request, 0, len(references) - 1)
        ref, ref_length = jnp.asarray(table)[r], jnp.asarray(lengths)[r]
        shared = min(width, longest)
        inside = jnp.arange(shared)[None, :] < length[:, None]
        on_track = jnp.all(~inside | (text[:, :shared] == ref[:, :shared]), axis=1)
        on_track &= (request >= 0) & (length <= ref_length)
        right = jnp.take_along_axis(
            ref, jnp.minimum(length[:, None] + jnp.arange(k), longest - 1), 1
        )
        keys = jax.vmap(lambda a, b: jax.random.fold_in(jax.random.fold_in(base_key, a), b))(
            r, length
        )
        kept = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(keys) < acceptance
        drafts = jnp.where(kept, right, jnp.where(right > 0, right - 1, right + 1))
        found = jnp.where(on_track, jnp.clip(ref_length - length, 0, k), 0)
        return drafts.astype(jnp.int32), found.astype(jnp.int32)

    return drafter


# -- continuous batching ----------------------------------------------------------------


@dataclasses.dataclass
class RunStats:
    wall_s: float = 0.0
    generated: int = 0
    processed: int = 0  # tokens through the model, drafts included
    rows: int = 0
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    steps: int = 0
    wide_steps: int = 0  # decode steps run wider than one token (verifying drafts)
    verifying_prefill_steps: int = 0  # steps with prompts in them whose decoding slots verified
    # Seconds of each step read but the first (which spans the run's start), by (prompts in
    # the step, its decoding slots verified drafts).
    kind_steps: dict[tuple[bool, bool], list[float]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list)
    )
    checks: list[np.ndarray] = dataclasses.field(default_factory=list)  # per step, in order
    # Per request, each generated token's logit margin over the runner-up.
    margins: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def decode_steps(self) -> list[float]:
        """Seconds of each decode step read, narrow ones first."""
        return self.kind_steps[False, False] + self.kind_steps[False, True]

    @property
    def prefill_steps(self) -> list[float]:
        """Seconds of each step with prompts in it read, those that verified last."""
        return self.kind_steps[True, False] + self.kind_steps[True, True]

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


@dataclasses.dataclass
class InFlight:
    """A dispatched step the host has not read yet."""

    out: StepOutput
    request: np.ndarray  # each slot's request when the step was dispatched
    emits: np.ndarray  # slots that emit tokens in this step
    decoding: np.ndarray
    verify: bool
    prefill: bool


class WidthChoice:
    """Whether a step's decoding slots verify drafts: a decode step of width
    ``speculate + 1`` rather than 1, or a step with prompts in it whose vocabulary
    head runs for ``speculate + 1`` positions per slot rather than one. Chosen when
    the drafts found are expected to pay for the dearer step, judged by the
    acceptance so far and the times seen so far of each kind of step, with and
    without verifying (before any are seen: ``PRIOR_COST`` and, with prompts in the
    step, ``PRIOR_PREFILL_COST`` times the step that does not verify)."""

    PRIOR_COST = 1.5
    PRIOR_PREFILL_COST = 1.2
    PRIOR_ACCEPTANCE = 0.5

    def __init__(self, speculate: int):
        self.speculate = speculate
        self.times: dict[tuple[bool, bool], collections.deque] = {
            (prefill, verify): collections.deque(maxlen=16)
            for prefill in (False, True)
            for verify in (False, True)
        }

    def observe(self, wide: bool, seconds: float, prefill: bool = False) -> None:
        """A step's time: ``wide``, it verified drafts; ``prefill``, prompts were in it."""
        self.times[prefill, wide].append(seconds)

    def wide(
        self, found: np.ndarray, decoding: np.ndarray, stats: RunStats, prefill: bool = False
    ) -> bool:
        if not self.speculate or not decoding.any():
            return False
        acceptance = (stats.accepted + self.PRIOR_ACCEPTANCE * 8) / (stats.drafted + 8)
        gain = acceptance * np.minimum(found[decoding], self.speculate).sum()
        narrow, wide = (self.times[prefill, verify] for verify in (False, True))
        cost = statistics.median(wide) / statistics.median(narrow) if narrow and wide else None
        if cost is None:
            cost = self.PRIOR_PREFILL_COST if prefill else self.PRIOR_COST
        # Tokens per second: (decoding + gain) / the dearer step's time > decoding / the other's.
        return gain > decoding.sum() * (cost - 1)


def serve(
    step,
    params,
    state,
    prompts: list[list[int]],
    *,
    slots: int,
    prefill_chunk: int,
    max_new_tokens: int,
    speculate: int = 0,
    choice: WidthChoice | None = None,
    between_steps: Callable[[], None] | None = None,
    progress: bool = False,
):
    """Greedy-decode every prompt, ``slots`` at a time; a finished sequence's slot is refilled.

    The host runs one step ahead: it dispatches step k (decoding slots take their
    tokens from their own text on the device), then reads step k-1 and does its
    bookkeeping while step k runs, so the device never waits for Python between
    steps. The outputs the host reads are queued for copying at dispatch, so a read
    waits for no transfer of its own. The price: a sequence's end (EOS or its token
    budget) is seen a step late, so its slot runs one step whose output is dropped.
    With ``speculate`` K, a decode step may be a verify step: each decoding slot
    runs its last token and up to K drafts (the step's drafter, on the device) and
    emits every token greedy decoding agrees with, plus one; in a step with prompts
    in it (as wide as a prompt chunk) the decoding slots may verify drafts too. Whether a step
    verifies is chosen per step by ``choice`` (default: a :class:`WidthChoice`)
    from the drafts the last step read had found. ``step`` is compiled for each of
    :func:`step_shapes` (see :func:`warm_up`).
    The bookkeeping is numpy over all slots at once. ``between_steps`` is called
    before each dispatch (it may raise to stop). Returns each request's tokens, the
    run's RunStats and the state.
    """
    count = len(prompts)
    prompt_len = np.array([len(p) for p in prompts], np.int32)
    widths = step_widths(prefill_chunk, speculate)
    # Each request's prompt, then its tokens as they come (slack for a step's read past the end).
    texts = np.zeros((count, prompt_len.max() + max_new_tokens + widths[-1]), np.int32)
    margins = np.zeros(texts.shape, np.float32)
    for i, p in enumerate(prompts):
        texts[i, : len(p)] = p
    n_generated = np.zeros(count, np.int32)
    finished = np.zeros(count, bool)
    request = np.full(slots, -1)  # which request each slot serves
    done = np.zeros(slots, np.int32)  # prompt tokens already fed
    found = np.zeros(slots, np.int32)  # drafts each slot had, as of the last step read
    columns = np.arange(widths[-1])
    choice = WidthChoice(speculate) if choice is None else choice
    next_request = 0
    stats = RunStats()
    in_flight: collections.deque[InFlight] = collections.deque()
    bar = tqdm(
        total=count, desc="requests", unit="req", disable=not progress, file=sys.stderr, leave=False
    )
    start = last_read = time.perf_counter()
    try:
        while True:
            if between_steps is not None:
                between_steps()
            free = np.flatnonzero(request < 0)[: count - next_request]
            reset = np.zeros(slots, bool)
            reset[free] = True
            request[free] = np.arange(next_request, next_request + free.size)
            done[free] = 0
            found[free] = 0
            next_request += free.size
            active = request >= 0
            if active.any():
                req = np.maximum(request, 0)
                prefilling = active & (done < prompt_len[req])
                decoding = active & ~prefilling
                prefill = bool(prefilling.any())
                verify = bool(choice.wide(found, decoding, stats, prefill=prefill))
                width = widths[-1] if prefill else (speculate + 1 if verify else 1)
                n_valid = np.where(prefilling, np.minimum(prompt_len[req] - done, prefill_chunk), 0)
                n_valid = n_valid.astype(np.int32)
                tokens = texts[req[:, None], done[:, None] + columns[None, :width]]
                emits = decoding | (prefilling & (done + n_valid >= prompt_len[req]))
                budget = np.where(reset, max_new_tokens, 0).astype(np.int32)
                inputs = StepInputs(
                    tokens, n_valid, reset, decoding, emits, budget, np.where(active, request, -1)
                )
                state, out = step(params, state, inputs, verify=verify)
                for read_later in out[1:]:  # next_tokens stays on the device
                    if isinstance(read_later, jax.Array):
                        read_later.copy_to_host_async()
                done += n_valid
                in_flight.append(InFlight(out, request.copy(), emits, decoding, verify, prefill))
                stats.steps += 1
                stats.wide_steps += int(not prefill and width > 1)
                stats.verifying_prefill_steps += int(prefill and verify)
            if not in_flight:
                break
            if active.any() and len(in_flight) < 2:
                continue  # keep a step queued behind the one being read
            # Read the oldest step while the newest runs.
            pending = in_flight.popleft()
            predictions = np.asarray(pending.out.predictions)
            accepted = np.asarray(pending.out.accepted)
            drafted = np.asarray(pending.out.drafted)
            step_margins = np.asarray(pending.out.margins)
            found = np.where(request == pending.request, np.asarray(pending.out.found), 0)
            now = time.perf_counter()
            # In steady state: one step's time on the device. Not the first read's,
            # which spans the run's start and two dispatches; and the choice learns
            # only from steps that faced it (sequences decoding in them): a round's
            # first steps, all prompts, would price a prompt step that does not
            # verify above one that does.
            if last_read != start:
                stats.kind_steps[pending.prefill, pending.verify].append(now - last_read)
                if pending.decoding.any():
                    choice.observe(pending.verify, now - last_read, prefill=pending.prefill)
            last_read = now
            stats.rows += int(pending.out.fetched)
            stats.checks.append(np.asarray(pending.out.checks))
            stats.processed += int(np.where(pending.decoding, 1 + drafted, 0).sum())
            slots_out = np.flatnonzero(pending.emits)
            r = pending.request[slots_out]
            live = ~finished[r]  # a request that ended a step ago emits nothing more
            slots_out, r = slots_out[live], r[live]
            new = predictions[slots_out]
            # The accepted drafts and the token after them, up to the budget and EOS.
            n_new = np.minimum(accepted[slots_out] + 1, max_new_tokens - n_generated[r])
            j = np.arange(new.shape[1])
            eos = (new == model.EOS_ID) & (j < n_new[:, None])
            n_new = np.where(eos.any(1), np.argmax(eos, axis=1) + 1, n_new)
            row, col = np.nonzero(j < n_new[:, None])
            at = prompt_len[r[row]] + n_generated[r[row]] + col
            texts[r[row], at] = new[row, col]
            margins[r[row], at] = step_margins[slots_out[row], col]
            n_generated[r] += n_new
            stats.generated += int(n_new.sum())
            stats.drafted += int(drafted[slots_out].sum())
            stats.accepted += int(accepted[slots_out].sum())
            ended = (n_generated[r] >= max_new_tokens) | eos.any(1)
            finished[r[ended]] = True
            request[slots_out[ended]] = -1  # refilled at the next dispatch
            bar.update(int(ended.sum()))
    finally:
        # Nothing may still read the tables when the caller frees them.
        for pending in in_flight:
            pending.out.next_tokens.block_until_ready()
        bar.close()
    jax.block_until_ready(state)
    stats.wall_s = time.perf_counter() - start
    stats.processed += int(prompt_len.sum())
    ends = prompt_len + n_generated
    outputs = [texts[i, prompt_len[i] : ends[i]].tolist() for i in range(count)]
    stats.margins = [margins[i, prompt_len[i] : ends[i]] for i in range(count)]
    return outputs, stats, state
