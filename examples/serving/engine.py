"""The serving engine: one jitted step over every slot (chunked prefill, decode, or a
speculative verify pass), each step's Engram rows hashed from the slot's lookback
state and fetched from the tables, and the continuous-batching loop that feeds it,
refills finished slots and, with speculation, drafts by prompt lookup.
"""

from __future__ import annotations

import collections
import dataclasses
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


class StepOutput(NamedTuple):
    """What a step returns beside the new state, all on the device.

    ``predictions`` ``[slots, speculate + 1]``: greedy tokens after the slot's last
    committed token and after each of its drafts (a prefill slot: after its last
    prompt token, in column 0). ``accepted``: drafts the predictions agree with, a
    prefix. ``next_tokens``: the token after everything committed,
    ``predictions[b, accepted[b]]``. ``fetched``: Engram rows read. ``checks``:
    uint32 ``[Engram layers, 2]`` checksums of each layer's ids and rows, and with
    ``expected`` a third, of the rows the table should have returned (zeros
    without a ``checksum``). ``margins`` ``[slots, speculate + 1]`` float32: how far
    each prediction's logit lies above the runner-up's (a near tie flips with the
    rounding of another step shape).
    """

    next_tokens: jax.Array
    predictions: jax.Array
    accepted: jax.Array
    fetched: jax.Array
    checks: jax.Array
    margins: jax.Array


def cache_length(max_prompt_tokens: int, max_new_tokens: int, prefill_chunk: int, speculate: int):
    """KV positions per slot: a step writes its whole width past the slot's position."""
    return max_prompt_tokens + max_new_tokens + max(step_widths(prefill_chunk, speculate))


def step_widths(prefill_chunk: int, speculate: int) -> list[int]:
    """Tokens per slot of a decode step and of a step with prompts in it: one step
    shape each, compiled once."""
    return sorted({speculate + 1, max(prefill_chunk, speculate + 1)})


def init_slot_state(cfg: model.ModelConfig, layout, slots: int, max_len: int, dtype) -> dict:
    """Each slot's KV cache and position, and its n-gram lookback state."""
    return dict(
        kv=model.init_kv_state(cfg, slots, max_len, dtype), lookback=ej.init_state(layout, slots)
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
    prefetch_ctas: int | None = None,
    order: str = ej.PREFETCH_ORDER,
    checksum: Callable[[jax.Array], jax.Array] | None = None,
    expected: Callable[[int, jax.Array], jax.Array] | None = None,
):
    """The jitted engine step of ``mode`` (see MODES) over ``tables`` (one per Engram
    layer; ``caches``: a hot-row cache per table, or None), verifying up to
    ``speculate`` drafts per slot, its state donated; prefetched lookups visit their
    rows in ``order`` (see :func:`engram_jax.lookup`). ``checksum(array) -> uint32``
    adds each layer's ids and rows checksums to the output (for comparing runs);
    ``expected(layer, ids) -> rows``, the rows layer ``layer``'s table holds for
    ``ids``, adds their checksum (for checking a run's rows against its tables)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    caches = tuple(caches) if caches else (None,) * len(tables)

    def step(
        params,
        state,
        tokens,
        n_valid,
        n_drafts,
        reset,
        prev_tokens,
        from_prev,
    ):
        """One engine step over every slot: ``tokens`` ``[slots, C]``, the first
        ``n_valid`` of each row real, the last ``n_drafts`` of those drafts to verify
        (0 for prompt chunks and plain decode). Where ``from_prev``, the slot's first
        token is ``prev_tokens`` (the previous step's ``next_tokens``, still on the
        device: the host need not read it before this step starts). ``reset`` starts
        a slot's sequence over.

        A slot commits its tokens up to the last accepted draft: its position and
        lookback state move past them, and whatever the step wrote beyond is
        overwritten by the next step.
        """
        slots, width = tokens.shape
        tokens = tokens.at[:, 0].set(jnp.where(from_prev, prev_tokens, tokens[:, 0]))
        valid = jnp.arange(width)[None, :] < n_valid[:, None]
        pos = jnp.where(reset, 0, state["kv"]["pos"])
        lookback = jnp.where(reset[:, None], layout.pad_id, state["lookback"])
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
        base = jnp.maximum(n_valid - 1 - n_drafts, 0)
        at = jnp.minimum(base[:, None] + jnp.arange(speculate + 1), width - 1)
        hidden = x[jnp.arange(slots)[:, None], at]
        scores = model.logits(cfg, params, hidden)
        predictions = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        margins = top2_margin(scores, predictions)
        accepted = accepted_drafts(predictions, tokens, base, n_drafts)
        committed = n_valid - n_drafts + accepted
        if mode != "none":
            lookback = ej.commit_state(layout, lookback, compressed, committed)
        next_tokens = jnp.take_along_axis(predictions, accepted[:, None], axis=1)[:, 0]
        new_state = dict(kv=dict(kv, pos=pos + committed), lookback=lookback)
        out = StepOutput(next_tokens, predictions, accepted, fetched, jnp.stack(checks), margins)
        return new_state, out

    return jax.jit(step, donate_argnums=1)


def idle_inputs(slots: int, width: int) -> tuple:
    """A step's inputs after ``params, state`` where every slot is idle: it changes nothing."""
    zeros = np.zeros(slots, np.int32)
    return np.zeros((slots, width), np.int32), zeros, zeros, np.zeros(slots, bool), zeros, zeros > 0


def warm_up(step, params, state, slots: int, widths: list[int]):
    """Compile ``step`` for every step width before any clock starts; returns the state."""
    for width in widths:
        state, out = step(params, state, *idle_inputs(slots, width))
    jax.block_until_ready(out)
    return state


# -- drafting -------------------------------------------------------------------------


def prompt_lookup(
    texts: np.ndarray, lengths: np.ndarray, k: int, sizes: tuple[int, ...] = (3, 2)
) -> tuple[np.ndarray, np.ndarray]:
    """Drafts without a draft model: for each row of ``texts`` (its first ``lengths``
    tokens), the up to ``k`` tokens that followed the last earlier occurrence of its
    final n-gram, the longest of ``sizes`` that occurs. Returns ``[n, k]`` drafts
    and how many of each are real (0: no match)."""
    n, width = texts.shape
    drafts = np.zeros((n, k), np.int32)
    found = np.zeros(n, np.int32)
    for size in sizes:
        if width <= size:
            continue
        key = np.take_along_axis(texts, np.maximum(lengths[:, None] - size + np.arange(size), 0), 1)
        windows = np.lib.stride_tricks.sliding_window_view(texts, size, axis=1)
        starts = np.arange(windows.shape[1])
        # An earlier occurrence with a token after it: the final n-gram itself is not one.
        match = (windows == key[:, None, :]).all(-1) & (starts + size < lengths[:, None])
        new = match.any(1) & (found == 0)
        last = windows.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)
        follow = last + size
        take = np.take_along_axis(texts, np.minimum(follow[:, None] + np.arange(k), width - 1), 1)
        count = np.minimum(k, lengths - follow)
        drafts[new] = np.where(np.arange(k) < count[new, None], take[new], 0)
        found[new] = count[new]
    return drafts, found


# -- continuous batching ----------------------------------------------------------------


@dataclasses.dataclass
class RunStats:
    wall_s: float = 0.0
    generated: int = 0
    processed: int = 0
    rows: int = 0
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    decode_steps: list[float] = dataclasses.field(default_factory=list)
    prefill_steps: list[float] = dataclasses.field(default_factory=list)
    checks: list[np.ndarray] = dataclasses.field(default_factory=list)  # per step, in order
    # Per request, each generated token's logit margin over the runner-up.
    margins: list[np.ndarray] = dataclasses.field(default_factory=list)
    wait_s: float = 0.0  # host time blocked reading a step's results

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


@dataclasses.dataclass
class InFlight:
    """A dispatched step the host has not read yet."""

    out: StepOutput
    request: np.ndarray  # each slot's request when the step was dispatched
    emits: np.ndarray  # slots whose prompt is all in after this step: they emit tokens
    n_drafts: np.ndarray
    prefill: bool


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
    draft=prompt_lookup,
    between_steps: Callable[[], None] | None = None,
    progress: bool = False,
):
    """Greedy-decode every prompt, ``slots`` at a time; a finished sequence's slot is refilled.

    Without speculation the host runs one step ahead: it dispatches step k (decode
    slots take step k-1's tokens on the device), then reads step k-1 and does its
    bookkeeping while step k runs, so the device never waits for Python between
    steps. The price: a sequence's end (EOS or its token budget) is seen a step
    late, so its slot runs one step whose output is dropped. With ``speculate``
    K, each decode slot verifies its last token and up to K drafts (``draft``,
    from its own text) per step and emits every token greedy decoding agrees
    with, plus one; the drafts need the tokens just accepted, so each step is
    read before the next is dispatched. The bookkeeping is numpy over all slots
    at once. ``between_steps`` is called before each dispatch (it may raise to
    stop). Returns each request's tokens, the run's RunStats and the state.
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
    columns = np.arange(widths[-1])
    ahead = 1 if speculate else 2  # steps dispatched before the oldest is read
    prev_tokens = jnp.zeros(slots, jnp.int32)
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
            next_request += free.size
            active = request >= 0
            if active.any():
                req = np.maximum(request, 0)
                prefilling = active & (done < prompt_len[req])
                decoding = active & ~prefilling
                prefill = bool(prefilling.any())
                width = widths[-1] if prefill else widths[0]
                n_valid = np.where(prefilling, np.minimum(prompt_len[req] - done, prefill_chunk), 1)
                n_valid = np.where(active, n_valid, 0).astype(np.int32)
                tokens = texts[req[:, None], done[:, None] + columns[None, :width]]
                n_drafts = np.zeros(slots, np.int32)
                from_prev = decoding
                if speculate:  # every step before this one has been read
                    d = np.flatnonzero(decoding)
                    r = req[d]
                    length = prompt_len[r] + n_generated[r]
                    drafts, found = draft(texts[r], length, speculate)
                    found = np.minimum(found, max_new_tokens - n_generated[r] - 1)
                    tokens[d, 0] = texts[r, length - 1]
                    tokens[d, 1 : speculate + 1] = drafts
                    n_drafts[d] = found
                    n_valid[d] += found
                    from_prev = np.zeros(slots, bool)
                state, out = step(
                    params, state, tokens, n_valid, n_drafts, reset, prev_tokens, from_prev
                )
                prev_tokens = out.next_tokens
                done += np.where(prefilling, n_valid, 0)
                emits = active & (done >= prompt_len[req])
                in_flight.append(InFlight(out, request.copy(), emits, n_drafts, prefill))
                stats.processed += int(n_valid.sum())
            if not in_flight:
                break
            if active.any() and len(in_flight) < ahead:
                continue  # keep a step queued behind the one being read
            # Read the oldest step (while the newest runs, without speculation).
            pending = in_flight.popleft()
            waited = time.perf_counter()
            predictions = np.asarray(pending.out.predictions)
            accepted = np.asarray(pending.out.accepted)
            step_margins = np.asarray(pending.out.margins)
            now = time.perf_counter()
            stats.wait_s += now - waited
            times = stats.prefill_steps if pending.prefill else stats.decode_steps
            times.append(now - last_read)  # in steady state: one step's time on the device
            last_read = now
            stats.rows += int(pending.out.fetched)
            stats.checks.append(np.asarray(pending.out.checks))
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
            stats.drafted += int(pending.n_drafts[slots_out].sum())
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
    ends = prompt_len + n_generated
    outputs = [texts[i, prompt_len[i] : ends[i]].tolist() for i in range(count)]
    stats.margins = [margins[i, prompt_len[i] : ends[i]] for i in range(count)]
    return outputs, stats, state
