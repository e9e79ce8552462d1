"""engram_jax.lookup_start / lookup_done: the same rows as lookup, bit for bit,
under jit, vmap and scan, for 1,000 calls with changing ids, and with two
tables in one step; the scheduling recipe; bad input. Marked gpu: the same on
CUDA with XLA's command buffers disabled, default and forced (each in a fresh
process, since XLA reads its flags once), including where XLA schedules them.

Run as ``python -m tests.test_prefetch MODE`` it is the GPU worker those tests start.
"""

from __future__ import annotations

import functools
import gc
import json
import re
import sys
import time

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engram_jax as ej
from engram_jax import _native, testing
from tools.sanitize_minimal import pipelined_scan  # the minimal program is the test's scan

from ._helpers import (
    COMMAND_BUFFER_MODES,
    assert_bf16_equal,
    captured_calls,
    make_table,
    run_gpu_worker,
    scaled,
)


def random_ids(rng, rows, row_start, shape):
    """Held rows mixed with DEAD_ID and ids on both sides of the table."""
    ids = rng.integers(row_start - 3, row_start + rows + 3, shape)
    ids[rng.random(shape) < 0.1] = ej.DEAD_ID
    return ids.astype(np.int32)


def prefetched(table, ids, **kwargs):
    return ej.lookup_done(ej.lookup_start(table, ids, **kwargs))


def custom_calls(hlo_text: str, target: str) -> list[str]:
    return [line for line in hlo_text.splitlines() if f'custom_call_target="{target}"' in line]


# -- CPU (CI) -------------------------------------------------------------------


@pytest.mark.parametrize("dim", [32, 96, 256])
@pytest.mark.parametrize("shape", [(1,), (5, 7), (3, 2, 24)])
def test_matches_lookup_under_jit(dim, shape):
    rng = np.random.default_rng(dim + len(shape))
    rows, row_start = 41, 500
    table, weight, scale = make_table(rng, rows, dim, row_start=row_start)
    with table:
        ids = random_ids(rng, rows, row_start, shape)
        out = jax.jit(lambda i: prefetched(table, i))(ids)
        assert out.dtype == jnp.bfloat16 and out.shape == shape + (dim,)
        assert_bf16_equal(out, jax.jit(lambda i: ej.lookup(table, i))(ids))
        assert_bf16_equal(out, testing.lookup_reference(weight, scale, ids, row_start))


def test_eager_call_gathers_at_once():
    rng = np.random.default_rng(1)
    table, weight, scale = make_table(rng, 30, 64)
    with table:
        ids = random_ids(rng, 30, 0, (4, 3))
        handle = ej.lookup_start(table, ids)
        assert not handle.pending
        assert_bf16_equal(ej.lookup_done(handle), testing.lookup_reference(weight, scale, ids))


def test_handle_is_a_pytree_with_array_leaves():
    rng = np.random.default_rng(2)
    table, _, _ = make_table(rng, 10, 32)
    with table:

        def leaves(i):
            handle = ej.lookup_start(table, i)
            assert handle.pending
            # The ticket (start's only result) and the ids (done's operand); no rows yet.
            flat = jax.tree_util.tree_leaves(handle)
            assert [(x.shape, x.dtype) for x in flat] == [((4,), jnp.uint32), ((2, 3), jnp.int32)]
            return ej.lookup_done(handle)

        jax.jit(leaves)(np.zeros((2, 3), np.int32))


def test_vmap_and_scan():
    rng = np.random.default_rng(3)
    rows = 64
    table, weight, scale = make_table(rng, rows, 128)
    with table:
        ids = random_ids(rng, rows, 0, (6, 4, 5))
        expected = testing.lookup_reference(weight, scale, ids)
        vmapped = jax.jit(jax.vmap(lambda i: prefetched(table, i)))(ids)
        assert_bf16_equal(vmapped, expected)

        def body(carry, i):
            handle = ej.lookup_start(table, i)
            carry, handle = jax.lax.optimization_barrier((carry, handle))
            carry = carry + 1.0
            carry, handle = jax.lax.optimization_barrier((carry, handle))
            return carry, ej.lookup_done(handle)

        carry, scanned = jax.jit(lambda i: jax.lax.scan(body, jnp.float32(0), i))(ids)
        assert float(carry) == ids.shape[0]
        assert_bf16_equal(scanned, expected)


def expected_bits(dense_bits, ids, row_start):
    """uint16 bits of the reference rows for ``ids`` from a table's every row, dequantised."""
    rows = dense_bits.shape[0]
    local = ids.astype(np.int64) - row_start
    held = ((local >= 0) & (local < rows))[..., None]
    return np.where(held, dense_bits[np.clip(local, 0, rows - 1)], np.uint16(0))


def count_mismatches(got, want_bits) -> int:
    """Values that differ bitwise, except NaN against NaN (CPUs and GPUs pick different NaNs)."""
    got_bits = np.asarray(got).view(np.uint16)
    both_nan = ((want_bits & 0x7FFF) > 0x7F80) & ((got_bits & 0x7FFF) > 0x7F80)
    return int(np.count_nonzero((got_bits != want_bits) & ~both_nan))


def test_thousand_calls_no_stale_rows():
    rng = np.random.default_rng(4)
    rows, dim = 997, 64
    table, weight, scale = make_table(rng, rows, dim)
    dense = testing.lookup_reference(weight, scale, np.arange(rows)).view(np.uint16)
    with table:
        step = jax.jit(lambda i: prefetched(table, i))
        for call in range(1000):
            ids = random_ids(rng, rows, 0, (8, 3))
            assert count_mismatches(step(ids), expected_bits(dense, ids, 0)) == 0, call
        assert step._cache_size() == 1


def two_layer_step(t2, t15, x, ids2, ids15, weights):
    """The recipe: start every Engram layer's lookup, tie the handles to the first
    block's input and each layer's done to that layer's input."""
    h2 = ej.lookup_start(t2, ids2)
    h15 = ej.lookup_start(t15, ids15, after=h2)
    x, h2, h15 = jax.lax.optimization_barrier((x, h2, h15))
    outs = {}
    for i, w in enumerate(weights):
        for layer, handle in ((1, h2), (3, h15)):
            if i == layer:
                x, handle = jax.lax.optimization_barrier((x, handle))
                rows = ej.lookup_done(handle)
                outs[layer] = rows
                x = x + rows.astype(jnp.float32).sum(axis=(-2, -1))[..., None]
        with jax.named_scope(f"block{i}"):
            x = jnp.tanh(x @ w)
    return x, outs[1], outs[3]


def test_two_tables_in_one_step():
    rng = np.random.default_rng(5)
    t2, w2, s2 = make_table(rng, 50, 64, row_start=10)
    t15, w15, s15 = make_table(rng, 70, 128)
    weights = [jnp.asarray(rng.standard_normal((16, 16)) * 0.1, jnp.float32) for _ in range(5)]
    with t2, t15:
        step = jax.jit(lambda x, a, b: two_layer_step(t2, t15, x, a, b, weights))
        for _ in range(3):
            ids2 = random_ids(rng, 50, 10, (4, 6))
            ids15 = random_ids(rng, 70, 0, (4, 6))
            _, r2, r15 = step(jnp.ones((4, 16)), ids2, ids15)
            assert_bf16_equal(r2, testing.lookup_reference(w2, s2, ids2, 10))
            assert_bf16_equal(r15, testing.lookup_reference(w15, s15, ids15))


def test_each_start_has_its_own_slot_and_done_owns_its_rows():
    rng = np.random.default_rng(6)
    t2, _, _ = make_table(rng, 8, 32)
    t15, _, _ = make_table(rng, 8, 32)
    weights = [jnp.eye(4) for _ in range(5)]
    with t2, t15:
        args = (jnp.ones((2, 4)), np.zeros((2, 3), np.int32), np.zeros((2, 3), np.int32))
        text = (
            jax.jit(lambda x, a, b: two_layer_step(t2, t15, x, a, b, weights))
            .lower(*args)
            .compile()
            .as_text()
        )
    starts = custom_calls(text, "engram_lookup_start")
    dones = custom_calls(text, "engram_lookup_done")
    assert len(starts) == len(dones) == 2
    assert len(set(slots(starts))) == 2 and slots(starts) == slots(dones)
    # Start returns only its ticket; done writes rows into a result of its own.
    assert all(re.search(r"= u32\[4\]\{0\} custom-call\(", line) for line in starts), starts
    assert not any("output_to_operand_aliasing" in line for line in dones), dones


@pytest.mark.parametrize("sizes", [(7, 5, 3), (3, 5, 7), (5, 3, 7, 2)])
def test_after_issues_starts_in_the_order_given(sizes):
    """XLA may schedule starts that do not depend on each other in any order, and
    the side stream gathers in start order: with ``after`` each start follows the
    one it names, in the compiled schedule too (a start's id count names it)."""
    rng = np.random.default_rng(11)
    table, weight, scale = make_table(rng, 40, 32)

    def step(*ids):
        handles = []
        for layer_ids in ids:
            handles.append(ej.lookup_start(table, layer_ids, after=handles[-1:]))
        return [ej.lookup_done(h) for h in reversed(handles)]

    with table:
        args = [random_ids(rng, 40, 0, (n,)) for n in sizes]
        for rows, ids in zip(jax.jit(step)(*args), reversed(args), strict=True):
            assert_bf16_equal(rows, testing.lookup_reference(weight, scale, ids))
        text = jax.jit(step).lower(*args).compile().as_text()
    assert start_order(text) == list(sizes)
    # What holds the order in any schedule: each start's ids wait for the ticket before.
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    made_by = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    tickets = []
    for eqn in jaxpr.eqns:
        if eqn.params.get("target_name") == "engram_lookup_start":
            if tickets:
                barrier = made_by.get(eqn.invars[0])
                assert barrier is not None and barrier.primitive.name == "optimization_barrier"
                assert tickets[-1] in barrier.invars
            tickets.append(eqn.outvars[0])
    assert len(tickets) == len(sizes)


def start_order(text: str) -> list[int]:
    """The id counts of the compiled program's lookup starts, in schedule order
    (XLA may wrap a start that reads a slice into a fusion of its own)."""
    bodies, name = {}, None
    for line in text.splitlines():
        header = re.match(r"(?:ENTRY )?%(\S+) .*\{$", line)
        if header:
            name = header.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)

    def ids_of(line):
        if 'custom_call_target="engram_lookup_start"' in line:
            dims = re.search(r"operand_layout_constraints=\{s32\[([\d,]*)\]", line).group(1)
            return int(np.prod([int(d) for d in dims.split(",") if d]))
        called = re.search(r"calls=%([^,\s]+)", line)
        inner = [ids_of(ln) for ln in bodies.get(called.group(1), [])] if called else []
        return next((n for n in inner if n is not None), None)

    entry = next(n for n in bodies if f"ENTRY %{n} " in text)
    return [n for n in map(ids_of, bodies[entry]) if n is not None]


@pytest.mark.gpu
def test_gpu_after_orders_the_starts_of_one_arrays_slices(gpu_device):
    """On the GPU XLA wraps a start that reads a slice in a fusion of its own, and
    orders independent starts as it likes (benchmarks/overlap.py's step had its
    later layer's start first): ``after`` holds the order given there too."""
    rng = np.random.default_rng(13)
    rows = 5000
    table, weight, scale = make_table(rng, rows, 256, placement="pinned", device=gpu_device)
    sizes = (700, 500, 300)
    cuts = np.cumsum((0, *sizes))

    def step(x, ids):
        ids = ids + (x[0, 0] > 1e30).astype(jnp.int32)  # made by a fusion, after x
        handles = []
        for begin, end in zip(cuts[:-1], cuts[1:], strict=True):
            handles.append(ej.lookup_start(table, ids[begin:end], after=handles[-1:]))
        x, handles = jax.lax.optimization_barrier((x, handles))
        out = []
        for handle in handles:
            x = jnp.tanh(x @ x)
            handle, _ = jax.lax.optimization_barrier((handle, x))
            out.append(ej.lookup_done(handle))
        return x, out

    with table:
        x = jax.device_put(jnp.eye(128, dtype=jnp.bfloat16), gpu_device)
        ids = jax.device_put(random_ids(rng, rows, 0, (int(cuts[-1]),)), gpu_device)
        _, out = jax.jit(step)(x, ids)
        for got, begin, end in zip(out, cuts[:-1], cuts[1:], strict=True):
            want = testing.lookup_reference(weight, scale, np.asarray(ids)[begin:end])
            assert_bf16_equal(got, want)
        assert start_order(jax.jit(step).lower(x, ids).compile().as_text()) == list(sizes)


def test_after_takes_handles_only():
    rng = np.random.default_rng(12)
    table, _, _ = make_table(rng, 5, 32)
    with table, pytest.raises(TypeError, match="after must be a LookupHandle"):
        jax.jit(lambda i: ej.lookup_start(table, i, after=[i]))(np.zeros(3, np.int32))


def slots(lines: list[str]) -> list[int]:
    return sorted(int(re.search(r"slot = (-?\d+)", line).group(1)) for line in lines)


def test_empty_ids():
    rng = np.random.default_rng(7)
    table, _, _ = make_table(rng, 5, 32)
    with table:
        out = jax.jit(lambda i: prefetched(table, i))(np.zeros((0, 3), np.int32))
        assert out.shape == (0, 3, 32)


def test_bad_input():
    rng = np.random.default_rng(8)
    table, _, _ = make_table(rng, 5, 32)
    with pytest.raises(TypeError, match="ids must be int32"):
        ej.lookup_start(table, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="max_ctas"):
        ej.lookup_start(table, np.zeros(3, np.int32), max_ctas=0)
    with pytest.raises(TypeError, match="EngramTable"):
        ej.lookup_start("table", np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="LookupHandle"):
        ej.lookup_done(np.zeros((3, 32), jnp.bfloat16))
    escaped = jax.jit(lambda i: ej.lookup_start(table, i))(np.zeros(3, np.int32))
    jax.block_until_ready(escaped)  # the table closes below: nothing may still read it
    assert escaped.pending
    with pytest.raises(ValueError, match="same jit"):
        ej.lookup_done(escaped)
    table.close()
    with pytest.raises(ValueError, match="closed"):
        jax.jit(lambda i: prefetched(table, i))(np.zeros(3, np.int32))


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 300),
    row_start=st.integers(0, 1000),
    dim=st.sampled_from([32, 64, 160]),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    seed=st.integers(0, 2**32 - 1),
)
def test_fuzz_against_reference(rows, row_start, dim, shape, seed):
    rng = np.random.default_rng(seed)
    table, weight, scale = make_table(rng, rows, dim, row_start=row_start)
    with table:
        ids = random_ids(rng, rows, row_start, shape)
        out = jax.jit(lambda i: prefetched(table, i))(ids)
        assert_bf16_equal(out, testing.lookup_reference(weight, scale, ids, row_start))


# -- GPU --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(COMMAND_BUFFER_MODES))
def test_gpu_command_buffers(mode):
    result = run_gpu_worker("tests.test_prefetch", mode)
    assert result["calls"] == WORKER_STEPS and result["mismatches"] == 0, result
    if mode == "disabled":
        assert result["done_captured"] == 0, result
        # The recipe holds in XLA's schedule: start before block 0, done after block 1.
        order = result["order"]
        assert order["start"] < order["first_block0"], order
        assert order["done"] > order["last_block1"], order
    if mode == "forced":
        # Done is recorded into XLA's graphs (start, not graph-compatible, runs
        # between them), and its consumers right after it still see finished rows.
        assert result["done_captured"] > 0, result


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
def test_gpu_matches_lookup(placement, gpu_device):
    rng = np.random.default_rng(9)
    rows = 5000
    table, weight, scale = make_table(
        rng, rows, 256, placement=placement, row_start=7, device=gpu_device
    )
    with table:
        ids = jax.device_put(random_ids(rng, rows, 7, (64, 24)), gpu_device)
        for kwargs in ({}, {"max_ctas": 1}, {"max_ctas": 132}):
            out = jax.jit(lambda i, kw=kwargs: prefetched(table, i, **kw))(ids)
            assert_bf16_equal(out, testing.lookup_reference(weight, scale, np.asarray(ids), 7))
        batched = ids[:8].reshape(2, 4, 24)
        out = jax.jit(jax.vmap(lambda i: prefetched(table, i)))(batched)
        want = testing.lookup_reference(weight, scale, np.asarray(batched), 7)
        assert_bf16_equal(out, want)
        chunks = ids.reshape(4, 16, 24)
        scan = jax.jit(lambda c: jax.lax.scan(lambda _, i: (None, prefetched(table, i)), None, c))
        _, out = scan(chunks)
        want = testing.lookup_reference(weight, scale, np.asarray(chunks), 7)
        assert_bf16_equal(out, want)


WORKER_STEPS = scaled(1000)  # a tenth under tools/sanitize.py


def _gpu_worker(mode: str) -> dict:
    """1,000 steps (WORKER_STEPS) with fresh ids, a slow one-CTA gather and its consumer right
    after done (a missing wait shows as stale or half-written rows), two tables."""
    device = jax.devices("gpu")[0]
    rng = np.random.default_rng(10)
    rows_a, rows_b = 200_000, 50_000
    ta, wa, sa = make_table(rng, rows_a, 256, placement="pinned")
    tb, wb, sb = make_table(rng, rows_b, 128, placement="pinned", row_start=3)
    dense_a = testing.lookup_reference(wa, sa, np.arange(rows_a)).view(np.uint16)
    dense_b = testing.lookup_reference(wb, sb, np.arange(3, 3 + rows_b), 3).view(np.uint16)
    weights = [jnp.asarray(rng.standard_normal((256, 256)) * 0.05, jnp.bfloat16) for _ in range(5)]

    def step(x, ids_a, ids_b):
        h_a = ej.lookup_start(ta, ids_a, max_ctas=1)
        h_b = ej.lookup_start(tb, ids_b, max_ctas=1)
        x, h_a, h_b = jax.lax.optimization_barrier((x, h_a, h_b))
        for i, w in enumerate(weights):
            if i == 2:
                x, h_a, h_b = jax.lax.optimization_barrier((x, h_a, h_b))
                rows_a_, rows_b_ = ej.lookup_done(h_a), ej.lookup_done(h_b)
                # Consumers right after done: they would race a gather done did not wait for.
                copy_a = rows_a_ * jnp.bfloat16(1)
                copy_b = rows_b_ * jnp.bfloat16(1)
                x = x + copy_a[:, 0, :] + jnp.sum(copy_b, axis=(1, 2))[:, None]
            with jax.named_scope(f"block{i}"):
                x = jnp.tanh(x @ w)
        return x, copy_a, copy_b

    jitted = jax.jit(step)
    x = jax.device_put(jnp.ones((64, 256), jnp.bfloat16), device)
    ids_shape = (64, 24)
    zeros = np.zeros(ids_shape, np.int32)
    text = jitted.lower(x, zeros, zeros).compile().as_text()
    mismatches = 0
    for _ in range(WORKER_STEPS):
        ids_a = random_ids(rng, rows_a, 0, ids_shape)
        ids_b = random_ids(rng, rows_b, 3, ids_shape)
        _, got_a, got_b = jitted(x, ids_a, ids_b)
        mismatches += count_mismatches(got_a, expected_bits(dense_a, ids_a, 0))
        mismatches += count_mismatches(got_b, expected_bits(dense_b, ids_b, 3))
    ta.close()
    tb.close()
    return {
        "mode": mode,
        "calls": WORKER_STEPS,
        "mismatches": mismatches,
        "done_captured": captured_calls()["engram_lookup_done"],
        "order": schedule_order(text),
    }


def schedule_order(text: str) -> dict:
    """Where XLA's schedule put start, done and the blocks (line numbers)."""
    entry = text[text.index("ENTRY") :].splitlines()

    def first(pred):
        return next((i for i, line in enumerate(entry) if pred(line)), -1)

    def last(pred):
        return max((i for i, line in enumerate(entry) if pred(line)), default=-1)

    # A block's work on the hidden state: its kernels (fusions, library calls). Its
    # weight is a constant named after the block too, which the schedule lists first.
    def block_work(i):
        return lambda ln: f"block{i}/" in ln and (" fusion(" in ln or " custom-call(" in ln)

    return {
        "start": first(lambda ln: "engram_lookup_start" in ln),
        "done": first(lambda ln: "engram_lookup_done" in ln),
        "first_block0": first(block_work(0)),
        "last_block1": last(block_work(1)),
    }


@pytest.mark.gpu
def test_gpu_ids_made_in_the_loop_are_the_ones_gathered(gpu_device):
    """Ids computed on the device inside a loop from its carried state (as a decode
    step hashes the token it just sampled), started, overlapped with matmuls, done:
    the same rows as a plain lookup of those ids, every iteration. A gather that ran
    before the ids were written would read the previous iteration's ids. The plain
    lookup reads a copy computed apart, before the start: read after done, the
    started ids would be kept alive, hiding a gather that reads them too late."""
    rng = np.random.default_rng(12)
    rows = 1 << 20
    table, _, _ = make_table(rng, rows, 256, placement="pinned", device=gpu_device)
    weight = jax.device_put(
        jnp.asarray(rng.standard_normal((1024, 1024)) * 0.03, jnp.bfloat16), gpu_device
    )
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint16)

    def make_ids(i, x):
        dep = (x[0, 0] > 1e30).astype(jnp.int32)  # never 1, but XLA cannot know
        key = jax.random.fold_in(jax.random.key(3), i)
        return jax.random.randint(key, (2, 4096, 24), 0, rows, jnp.int32) + dep

    def body(i, carry):
        x, mismatches = carry
        copies = make_ids(i, x)
        want = [ej.lookup(table, copies[j]) for j in range(2)]
        i, x, want = jax.lax.optimization_barrier((i, x, want))
        ids = make_ids(i, x)  # read by the starts alone
        handles = [ej.lookup_start(table, ids[j]) for j in range(2)]
        x, handles = jax.lax.optimization_barrier((x, handles))
        for _ in range(4):
            x = jnp.tanh(x @ weight)
        x, handles = jax.lax.optimization_barrier((x, handles))
        for j, handle in enumerate(handles):
            got = ej.lookup_done(handle)
            mismatches += jnp.sum(bits(got) != bits(want[j]), dtype=jnp.int32)
        return x, mismatches

    with table:
        x = jax.device_put(jnp.ones((4096, 1024), jnp.bfloat16), gpu_device)
        # Two iterations at least: the second's ids replace the first's.
        steps = max(2, scaled(16))
        loop = jax.jit(lambda x: jax.lax.fori_loop(0, steps, body, (x, jnp.int32(0))))
        _, mismatches = loop(x)
        assert int(mismatches) == 0


def test_handle_finished_in_a_later_call():
    """A handle returned by one jitted call and finished in the next (the rows of
    the next chunk gathered a whole step ahead) gives the start's rows."""
    rng = np.random.default_rng(13)
    table, weight, scale = make_table(rng, 300, 64, row_start=5)
    with table:
        start = jax.jit(lambda i: ej.lookup_start(table, i))
        finish = jax.jit(ej.lookup_done)
        for _ in range(3):
            ids = random_ids(rng, 300, 5, (7, 3))
            handle = start(ids)
            assert handle.pending
            assert_bf16_equal(finish(handle), testing.lookup_reference(weight, scale, ids, 5))


def test_pipelined_scan_reads_every_chunks_rows():
    rng = np.random.default_rng(16)
    table, weight, scale = make_table(rng, 500, 64)
    with table:
        chunks = random_ids(rng, 500, 0, (6, 10, 3))
        assert_bf16_equal(
            pipelined_scan(table, chunks), testing.lookup_reference(weight, scale, chunks)
        )


@pytest.mark.gpu
def test_gpu_pipelined_scan_reads_every_chunks_rows(gpu_device):
    rng = np.random.default_rng(17)
    rows = 1 << 18
    table, weight, scale = make_table(rng, rows, 256, placement="pinned", device=gpu_device)
    with table:
        chunks = jax.device_put(random_ids(rng, rows, 0, (12, 512, 24)), gpu_device)
        want = testing.lookup_reference(weight, scale, np.asarray(chunks))
        assert_bf16_equal(pipelined_scan(table, chunks), want)


def all_nan_or_equal(got, want_bits) -> str:
    """'equal' or 'nan' for rows that are the right ones or all NaN; anything else fails."""
    got_bits = np.asarray(got).view(np.uint16)
    if count_mismatches(got, want_bits) == 0:
        return "equal"
    assert np.all(got_bits == 0x7FC0), "a stale handle read rows that are neither its own nor NaN"
    return "nan"


@pytest.mark.gpu
def test_gpu_a_handle_kept_past_its_sites_next_start_reads_nan(gpu_device):
    """The ticket names its start: once the call site started again, the old
    handle's rows come back as NaN, never as the newer start's rows; the newer
    handle still reads its own. And after the site's executable is gone its
    tickets read NaN or (if it lives on) their own rows, never freed memory."""
    rng = np.random.default_rng(14)
    rows = 4096
    table, weight, scale = make_table(rng, rows, 256, placement="pinned", device=gpu_device)
    dense = testing.lookup_reference(weight, scale, np.arange(rows)).view(np.uint16)
    with table:
        start = jax.jit(lambda i: ej.lookup_start(table, i))
        finish = jax.jit(ej.lookup_done)
        ids_a = random_ids(rng, rows, 0, (64, 24))
        ids_b = random_ids(rng, rows, 0, (64, 24))
        handle_a = start(ids_a)
        handle_b = start(ids_b)  # the same site: restages, a new generation
        assert all_nan_or_equal(finish(handle_b), expected_bits(dense, ids_b, 0)) == "equal"
        assert all_nan_or_equal(finish(handle_a), expected_bits(dense, ids_a, 0)) == "nan"
        del start
        jax.clear_caches()
        outcome = all_nan_or_equal(finish(handle_b), expected_bits(dense, ids_b, 0))
        assert outcome in ("equal", "nan")


def live_executables(module: str | None = None) -> int:
    """Executables the PJRT client holds (those of jitted functions named ``module``,
    when given). Under compute-sanitizer a dropped jitted function's executable stays
    alive after ``jax.clear_caches()`` and a collection, with or without this library
    in it (tools/sanitize.py --probe shows it with plain jnp code), so its call sites
    cannot be released: the tests below bound the live sites by the executables
    still alive, not by zero."""
    alive = jax.extend.backend.get_backend().live_executables()
    if module is None:
        return len(alive)
    return sum(any(m.name == f"jit_{module}" for m in e.hlo_modules()) for e in alive)


def sites_once_released(limit: int, deadline_s: float = 120.0) -> tuple[dict, int]:
    """The call-site counts once fewer than ``limit`` are live and none is retired
    (destroyed, its release still queued), or at the deadline, and the most seen
    retired meanwhile. XLA frees a dropped executable, and the
    site's release runs behind its side stream, when the device gets there: a slow
    device (a sanitizer, a long gather) takes longer, so wait for it, do not read
    the count at once."""
    deadline = time.monotonic() + deadline_s
    most_retired = 0
    while True:
        jax.clear_caches()
        gc.collect()
        jax.block_until_ready(jnp.zeros(()))
        sites = _native.native.prefetch_sites()
        most_retired = max(most_retired, sites["retired"])
        if sites["live"] < limit and not sites["retired"] or time.monotonic() > deadline:
            return sites, most_retired
        time.sleep(0.05)


@pytest.mark.gpu
def test_gpu_call_sites_come_and_go(gpu_device):
    """Compiling and dropping many functions with a start releases their call sites
    (numbers and staging), so they do not pile up; every one reads its own rows."""
    rng = np.random.default_rng(15)
    rows = 2048
    table, weight, scale = make_table(rng, rows, 128, placement="pinned", device=gpu_device)
    with table:
        before, executables = _native.native.prefetch_sites()["live"], live_executables()
        for k in range(200):
            ids = random_ids(rng, rows, 0, (8, 4 + k % 5))
            fn = jax.jit(lambda i: prefetched(table, i))
            assert_bf16_equal(fn(ids), testing.lookup_reference(weight, scale, ids))
            del fn
            if k % 50 == 49:
                jax.clear_caches()
        kept = live_executables() - executables  # ~0, or ~200 under compute-sanitizer
        after, _ = sites_once_released(before + 50 + kept)
    assert after["leaked"] == 0, after  # a release that could not be queued says why
    assert after["live"] - before < 50 + kept, (after, kept)


@pytest.mark.gpu
def test_gpu_call_sites_released_behind_a_slow_side_stream(gpu_device):
    """A dropped executable's sites wait for their side stream, however long it is
    busy, and are then released with no later work queued: here the stream is held
    by a 2 s kernel while the functions are dropped."""
    rng = np.random.default_rng(16)
    rows = 2048
    table, weight, scale = make_table(rng, rows, 128, placement="pinned", device=gpu_device)
    with table:
        before = _native.native.prefetch_sites()["live"]

        def slow_stream_probe(i):
            return prefetched(table, i)

        functions = []
        for k in range(12):
            ids = random_ids(rng, rows, 0, (4, 3 + k))  # a shape each: a site each
            functions.append(jax.jit(slow_stream_probe))
            assert_bf16_equal(functions[-1](ids), testing.lookup_reference(weight, scale, ids))
        assert _native.native.prefetch_sites()["live"] >= before + 12
        assert live_executables("slow_stream_probe") >= 12
        _native.native.stall_side_stream(gpu_device.id, 2_000_000)
        del functions
        stalled = time.monotonic()
        jax.clear_caches()
        gc.collect()
        # Counted by name: clearing the caches may free other executables while these stay.
        if live_executables("slow_stream_probe"):
            pytest.skip("dropped executables stay alive here (compute-sanitizer): none to release")
        after, most_retired = sites_once_released(before + 1)
        waited = time.monotonic() - stalled
    assert after["leaked"] == 0, after
    assert after["live"] <= before and after["retired"] == 0, after
    # Destroyed while the stream was held, released only once it ran on.
    assert most_retired >= 1 and waited > 1.0, (most_retired, waited)


def test_prefetch_ctas_by_order_and_cache():
    # benchmarks/overlap.py: plain gathers cost the model least on 4 CTAs at every
    # size; sorted, deduplicated and cached ones grow with the batch.
    sizes = [0, 1, 6144, 6145, 12_288, 50_000, 98_304, 10**7]
    assert [ej.prefetch_ctas(n, order="plain") for n in sizes] == [4] * len(sizes)
    grown = [4, 4, 4, 4, 4, 9, 16, 16]
    assert [ej.prefetch_ctas(n, order="sorted") for n in sizes] == grown
    # The default is lookup_start's: its default order, sorted.
    assert ej.PREFETCH_ORDER == "sorted"
    assert [ej.prefetch_ctas(n) for n in sizes] == grown
    assert [ej.prefetch_ctas(n, order="dedup") for n in sizes] == grown
    # "auto" is resolved first: plain below AUTO_DEDUP_MIN_IDS, dedup from it on.
    assert ej.prefetch_ctas(12_288, order="auto") == 4
    assert ej.prefetch_ctas(98_304, order="auto") == 16
    rng = np.random.default_rng(14)
    table, _, _ = make_table(rng, 64, 32)
    with table, ej.HotRowCache(table, 1e-3, devices=[jax.devices("cpu")[0]]) as cache:
        assert ej.prefetch_ctas(98_304, order="plain", cache=cache) == 16
    with pytest.raises(ValueError, match="num_ids"):
        ej.prefetch_ctas(-1)
    with pytest.raises(ValueError, match="order"):
        ej.prefetch_ctas(8, order="backwards")


if __name__ == "__main__":
    print(json.dumps(_gpu_worker(sys.argv[1])))
