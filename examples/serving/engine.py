"""The serving engine: one jitted step over every slot (chunked prefill and decode),
each step's Engram rows hashed from the slot's lookback state and fetched from the
tables, and the continuous-batching loop that feeds it and refills finished slots.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
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

    ``next_tokens``: each slot's greedy token after its last token. ``fetched``:
    Engram rows read. ``checks``: uint32 ``[Engram layers, 2]`` checksums of each
    layer's ids and rows (zeros without a ``checksum``).
    """

    next_tokens: jax.Array
    fetched: jax.Array
    checks: jax.Array


def cache_length(max_prompt_tokens: int, max_new_tokens: int, prefill_chunk: int):
    """KV positions per slot: a step writes its whole width past the slot's position."""
    return max_prompt_tokens + max_new_tokens + max(step_widths(prefill_chunk))


def step_widths(prefill_chunk: int) -> list[int]:
    """Tokens per slot of a decode step and of a step with prompts in it: one step
    shape each, compiled once."""
    return sorted({1, prefill_chunk})


def init_slot_state(cfg: model.ModelConfig, layout, slots: int, max_len: int, dtype) -> dict:
    """Each slot's KV cache and position, and its n-gram lookback state."""
    return dict(
        kv=model.init_kv_state(cfg, slots, max_len, dtype), lookback=ej.init_state(layout, slots)
    )


def step_fn(
    cfg,
    layout,
    compressor,
    tables,
    caches,
    mode,
    prefetch_ctas,
    checksum,
    params,
    state,
    tokens,
    n_valid,
    reset,
    prev_tokens,
    from_prev,
):
    """One engine step over every slot: ``tokens`` ``[slots, C]``, the first
    ``n_valid`` of each row real. Where ``from_prev``, the slot's first token is
    ``prev_tokens`` (the previous step's ``next_tokens``, still on the device: the
    host need not read it before this step starts). ``reset`` starts a slot's
    sequence over.
    """
    slots, width = tokens.shape
    tokens = tokens.at[:, 0].set(jnp.where(from_prev, prev_tokens, tokens[:, 0]))
    valid = jnp.arange(width)[None, :] < n_valid[:, None]
    pos = jnp.where(reset, 0, state["kv"]["pos"])
    lookback = jnp.where(reset[:, None], layout.pad_id, state["lookback"])
    x = model.embed(cfg, params, jnp.where(valid, tokens, 0))
    fetched = jnp.zeros((), jnp.int32)
    checks = [jnp.zeros(2, jnp.uint32)] * len(cfg.engram_layers)
    engram_rows = None
    if mode != "none":
        compressed = jnp.where(valid, compressor(tokens), ej.DEAD_ID).reshape(-1)
        # Padding tokens name no sequence: they neither hash nor move a lookback row.
        segments = jnp.where(valid, jnp.arange(slots)[:, None], -1).reshape(-1)
        ids, lookback = ej.hash_step(layout, lookback, compressed, segment_ids=segments)
        ids = ids.reshape(slots, width, layout.n_layers, layout.n_cols)
        if mode != "zeros":
            fetched = jnp.sum(ids != ej.DEAD_ID, dtype=jnp.int32)
        if mode == "prefetch":
            handles = [
                ej.lookup_start(t, ids[:, :, i], cache=c, max_ctas=prefetch_ctas)
                for i, (t, c) in enumerate(zip(tables, caches, strict=True))
            ]
            # Tie the starts to the first block's input so XLA issues them first.
            x, handles = jax.lax.optimization_barrier((x, handles))

        def engram_rows(e, x):
            layer_ids = ids[:, :, e]
            if mode == "prefetch":
                # Tied to x, x not routed through: a bf16 x out of a barrier would be
                # rounded where the plain lookup's program may not (other tokens).
                handle, _ = jax.lax.optimization_barrier((handles[e], x))
                rows = ej.lookup_done(handle)
            elif mode == "sync":
                rows = ej.lookup(tables[e], layer_ids, cache=caches[e])
            else:
                rows = jnp.zeros(layer_ids.shape + (layout.head_dim,), jnp.bfloat16)
            if checksum is not None:
                checks[e] = jnp.stack([checksum(layer_ids), checksum(rows)])
            return rows, ej.token_mask_from_ids(layer_ids) & valid

    x, kv = model.run_blocks(cfg, params, state["kv"], x, pos, engram_rows)
    last = x[jnp.arange(slots), jnp.maximum(n_valid - 1, 0)][:, None]
    next_tokens = jnp.argmax(model.logits(cfg, params, last)[:, 0], axis=-1).astype(jnp.int32)
    new_state = dict(kv=dict(kv, pos=pos + n_valid), lookback=lookback)
    return new_state, StepOutput(next_tokens, fetched, jnp.stack(checks))


def make_step(
    cfg: model.ModelConfig,
    layout,
    compressor,
    tables,
    mode: str,
    *,
    caches=None,
    prefetch_ctas: int | None = None,
    checksum: Callable[[jax.Array], jax.Array] | None = None,
):
    """The jitted engine step of ``mode`` (see MODES) over ``tables`` (one per Engram
    layer; ``caches``: a hot-row cache per table, or None), its state donated.
    ``checksum(array) -> uint32`` adds each layer's ids and rows checksums to the
    output (for comparing runs)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    caches = tuple(caches) if caches else (None,) * len(tables)
    fn = functools.partial(
        step_fn, cfg, layout, compressor, tables, caches, mode, prefetch_ctas, checksum
    )
    return jax.jit(fn, donate_argnums=1)


def idle_inputs(slots: int, width: int) -> tuple:
    """A step's inputs after ``params, state`` where every slot is idle: it changes nothing."""
    zeros = np.zeros(slots, np.int32)
    return np.zeros((slots, width), np.int32), zeros, np.zeros(slots, bool), zeros, zeros > 0


def warm_up(step, params, state, slots: int, widths: list[int]):
    """Compile ``step`` for every step width before any clock starts; returns the state."""
    for width in widths:
        state, out = step(params, state, *idle_inputs(slots, width))
    jax.block_until_ready(out)
    return state


# -- continuous batching ----------------------------------------------------------------


@dataclasses.dataclass
class RunStats:
    wall_s: float = 0.0
    generated: int = 0
    processed: int = 0
    rows: int = 0
    decode_steps: list[float] = dataclasses.field(default_factory=list)
    prefill_steps: list[float] = dataclasses.field(default_factory=list)
    checks: list[np.ndarray] = dataclasses.field(default_factory=list)  # per step, in order


@dataclasses.dataclass
class InFlight:
    """A dispatched step the host has not read yet."""

    out: StepOutput
    request: np.ndarray  # each slot's request when the step was dispatched
    emits: np.ndarray  # slots whose prompt is all in after this step: they emit a token
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
    between_steps: Callable[[], None] | None = None,
    progress: bool = False,
):
    """Greedy-decode every prompt, ``slots`` at a time; a finished sequence's slot is refilled.

    The host runs one step ahead: it dispatches step k (decode slots take step
    k-1's tokens on the device), then reads step k-1 and does its bookkeeping
    while step k runs, so the device never waits for Python between steps. The
    price: a sequence's end (EOS or its token budget) is seen a step late, so its
    slot runs one step whose output is dropped, and is refilled a step later.
    The bookkeeping is numpy over all slots at once, not a loop over slots.
    ``between_steps`` is called before each dispatch (it may raise to stop).
    Returns each request's tokens, the run's RunStats and the state.
    """
    count = len(prompts)
    prompt_len = np.array([len(p) for p in prompts], np.int32)
    prompt = np.zeros((count, prompt_len.max() + prefill_chunk), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, : len(p)] = p
    generated = np.zeros((count, max_new_tokens), np.int32)
    n_generated = np.zeros(count, np.int32)
    finished = np.zeros(count, bool)
    request = np.full(slots, -1)  # which request each slot serves
    done = np.zeros(slots, np.int32)  # prompt tokens already fed
    columns = np.arange(prefill_chunk)
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
                prefill = bool(prefilling.any())
                width = prefill_chunk if prefill else 1
                n_valid = np.where(prefilling, np.minimum(prompt_len[req] - done, width), active)
                n_valid = n_valid.astype(np.int32)
                tokens = prompt[req[:, None], done[:, None] + columns[None, :width]]
                from_prev = active & ~prefilling
                state, out = step(params, state, tokens, n_valid, reset, prev_tokens, from_prev)
                prev_tokens = out.next_tokens
                done += np.where(prefilling, n_valid, 0)
                emits = active & (done >= prompt_len[req])
                in_flight.append(InFlight(out, request.copy(), emits, prefill))
                stats.processed += int(n_valid.sum())
            if not in_flight:
                break
            if active.any() and len(in_flight) < 2:
                continue  # keep one step queued behind the one being read
            # Read the oldest step while the newest runs.
            pending = in_flight.popleft()
            next_tokens = np.asarray(pending.out.next_tokens)
            now = time.perf_counter()
            times = stats.prefill_steps if pending.prefill else stats.decode_steps
            times.append(now - last_read)  # in steady state: one step's time on the device
            last_read = now
            stats.rows += int(pending.out.fetched)
            stats.checks.append(np.asarray(pending.out.checks))
            slots_out = np.flatnonzero(pending.emits)
            r = pending.request[slots_out]
            live = ~finished[r]  # a request that ended a step ago emits nothing more
            slots_out, r = slots_out[live], r[live]
            generated[r, n_generated[r]] = next_tokens[slots_out]
            n_generated[r] += 1
            stats.generated += r.size
            ended = (n_generated[r] >= max_new_tokens) | (next_tokens[slots_out] == model.EOS_ID)
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
    outputs = [generated[i, : n_generated[i]].tolist() for i in range(count)]
    return outputs, stats, state
