"""Row updates of a trainable bf16 table: distinct rows updated per second by
engram_jax.apply_gradients (host table, and the same update on an HBM table),
beside what a JAX user would write instead (unique ids with numpy, rows through
jax.device_put, the optimizer's math on the GPU (optax's Adam; row-wise Adagrad
by hand: optax has none), written back with numpy), the library's own lookup of
the same distinct rows (read only), and the ceiling of the design: the GPU
update reads and writes random rows over PCIe, so reference/rawupdate.cu (built
and run by this script in its own process, on the same row counts and record
size) reads and writes that many distinct rows of pinned memory with the
simplest kernels (a thread per 16-byte word, a warp per row; the faster
counts); where it cannot run, the lookup stands in. Batches of 2**14..2**20
ids, Zipf (text-like: few hot rows) and uniform, fresh ids for every call, 2**21
ids a pass (64 calls of 2**14 ids, 2 of 2**20); each library cell's calls also in
one dispatch per pass, a `scan` over the stacked batches, rolled
(`*_one_dispatch`) and unrolled (`*_unrolled`).
Then the cost of hiding the reads: a training step with the next batch's rows
prefetched (exact order: started after the step's update; stale: gathered from the
top of the step, finished before its update; each on prefetch_ctas's CTAs and, on a
GPU, on every SM) against no prefetch, and the same step with the table in HBM; the
step variants take turns over three rounds (`--parts step` runs only them).

`--parts model` (not in the default parts): the training step of examples/train.py's
own model (its setup, tables, optax Adam and Steps; `--model-name small`, batch 32 x
512 tokens, float32 weights, bf16 tables, lazy_adam at 5x the learning rate), with
the host table (pinned) without prefetch, with exact-order and stale prefetch on
every SM, and with the table in HBM without prefetch, in turns over three rounds
as the proxy step's variants. Every variant has its own tables, all written with
the same distinct rows (training.steps.init_rows), and starts from the same
weights; all are held at once, so `--model-gib` (rows of all tables, per variant)
defaults to 8: lazy_adam's bf16 moments triple a table to 24 GiB, the three host
variants hold 72 GiB of the GPU machine's 128 GiB of host memory and the HBM one
24 GiB of 139 (the example's 16 GiB would need 144 GiB of host memory). On a GPU
the steps are compiled with XLA's deterministic ops (`--no-model-deterministic`
turns that off and the exact check into information): the embedding's gradient
is an atomic scatter-add otherwise, and no two runs of one program would agree
bit for bit. `--profile`: after the timed rounds, a few more steps of each step
or model variant under the jax profiler, and one more pass of each library
update cell, each record's `profile` per GPU stream (busy ms per step or call,
top kernels; None on the CPU).

Rows checked: every batch also holds a block of sample rows (each 1-4 times);
before each timed pass the sample's rows and state are set to known values, and
after it the rows read back are compared with a numpy reference of the optimizer
run over the pass's calls (gradients are a function of (id, batch), values k/8, so
their sums are exact). Each batch's gradients are made on the device before the
timed calls, as a model's backward pass makes them: a timed call is the update
alone, as the ceiling is the row moves alone. The exact-order prefetch step must
give the no-prefetch step's losses bit for bit. A mismatch fails the run.

Run on a GPU machine (about 4 minutes):  python benchmarks/train.py
The example's model (a few minutes):      python benchmarks/train.py --parts model --profile
CPU smoke run (tiny table, no HBM):       python benchmarks/train.py --smoke [--parts model]
Writes benchmarks/results/train.json (train_smoke.json with --smoke).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The HBM table is cudaMalloc'ed beside XLA's pool: XLA must not take 75 % of the GPU first.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import engram_jax as ej  # noqa: E402
from engram_jax import testing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The model part runs the training example's own pieces (examples/train.py, training/).
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import train as train_example  # noqa: E402  (examples/train.py: examples/ comes first)
from serving.cli import UserError  # noqa: E402
from serving.tables import check_fits  # noqa: E402
from training import data  # noqa: E402
from training import model as train_model  # noqa: E402
from training import steps as train_steps  # noqa: E402

from benchmarks import _common  # noqa: E402

DIM = 256
ROW_BYTES = DIM * 2  # bf16
LR = 0.01
SAMPLE_ROWS = 64
ZIPF_A = 1.1
# Per update a value may differ from the reference by about two bf16 steps of itself
# or of the update (which moves it by about LR): float32 sums of squares (row_adagrad's
# mean), bias corrections (lazy Adam's power) and moments (optax keeps them unrounded
# within a step) are rounded in other orders, and one float32 ulp can flip the bf16
# rounding of a value or a moment. Over a pass the differences can add up.
TOL_PER_UPDATE = 2.0**-7
BF16 = ml_dtypes.bfloat16


@dataclasses.dataclass(frozen=True)
class Optim:
    name: str
    gib: float  # rows of the table, GiB (state not counted)

    def spec(self) -> ej.RowOptimizer:
        if self.name == "lazy_adam":
            return ej.lazy_adam(moment_dtype=jnp.bfloat16)
        return ej.row_adagrad()


# -- gradients, ids and the numpy reference ------------------------------------------


def grad_values(ids, key, xp=jnp):
    """bf16 gradients ``ids.shape + (DIM,)``: k/8 for k in -8..8, a hash of (id, key, d)
    (key: the batch's index in its cell)."""
    d = xp.arange(DIM, dtype=xp.uint32)
    x = xp.asarray(ids).astype(xp.uint32)[..., None] * xp.uint32(0x9E3779B1)
    x = x ^ (xp.asarray(key).astype(xp.uint32) * xp.uint32(0x85EBCA6B) + d * xp.uint32(0xC2B2AE35))
    x = x ^ (x >> 15)
    x = x * xp.uint32(0x2C1B3C6D)
    x = x ^ (x >> 12)
    k = (x % xp.uint32(17)).astype(xp.int32) - 8
    return (k.astype(xp.float32) / 8).astype(jnp.bfloat16 if xp is jnp else BF16)


make_grads = jax.jit(grad_values)  # one jitted function for every cell's batches


def make_ids(rng, kind: str, n: int, num_rows: int, sample: np.ndarray) -> np.ndarray:
    """``n`` int32 ids: Zipf ranks scattered over the table, or uniform; the sample rows
    at random places, row j of the sample ``1 + j % 4`` times."""
    if kind == "zipf":
        ranks = rng.zipf(ZIPF_A, n).astype(np.uint64)
        ids = (ranks * np.uint64(0x9E3779B97F4A7C15) % np.uint64(num_rows)).astype(np.int64)
    else:
        ids = rng.integers(0, num_rows, n)
    extra = np.repeat(sample, 1 + np.arange(sample.size) % 4)
    ids[rng.choice(n, extra.size, replace=False)] = extra
    return ids.astype(np.int32)


def summed_grads(ids: np.ndarray, key: int, rows: np.ndarray) -> np.ndarray:
    """float32 sum of each of ``rows``' gradients in batch ``ids`` (exact: k/8 values)."""
    counts = np.array([np.count_nonzero(ids == r) for r in rows], np.float32)
    return counts[:, None] * grad_values(rows, key, np).astype(np.float32)


def reference_step(optim: Optim, p, state, g, call: int):
    """One update of the sample rows ``p`` (bf16) by engram_jax.testing's numpy reference
    of the optimizer, each row's summed gradient ``g`` given once."""
    ids = np.arange(p.shape[0])
    if optim.name == "row_adagrad":
        p, acc = testing.row_adagrad_reference(p, state["accumulator"], ids, g, LR)
        return p, {"accumulator": acc}
    # The library's own float32 step size (jnp's power), so the row math compares bitwise.
    size = float(optim.spec().step_size(LR, call + 1))
    p, m, v = testing.lazy_adam_reference(
        p, state["exp_avg"], state["exp_avg_sq"], ids, g, LR, call + 1, step_size=size
    )
    return p, {"exp_avg": m, "exp_avg_sq": v}


def known_sample_state(optim: Optim, seed: int) -> tuple[np.ndarray, dict]:
    """Rows and state the sample is reset to before each timed pass: values about LR, so
    that a bf16 step of a value is far below an update's size."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((SAMPLE_ROWS, DIM)) * LR).astype(BF16)
    if optim.name == "row_adagrad":
        return rows, {"accumulator": rng.uniform(0.5, 2.0, SAMPLE_ROWS).astype(np.float32)}
    m = (rng.standard_normal((SAMPLE_ROWS, DIM)) * 0.1).astype(BF16)
    v = rng.uniform(0.01, 0.1, (SAMPLE_ROWS, DIM)).astype(BF16)
    return rows, {"exp_avg": m, "exp_avg_sq": v}


def check_pass(optim, got, start_rows, start_state, batches, calls, sample, exact=True) -> dict:
    """Compare the sample rows after a pass with the reference run over its calls (batch
    k's gradients keyed by k): bitwise (``exact``), or within ``TOL_PER_UPDATE`` per call
    (the alternative)."""
    p, state = start_rows, dict(start_state)
    for key, (ids, call) in enumerate(zip(batches, calls, strict=True)):
        p, state = reference_step(optim, p, state, summed_grads(ids, key, sample), call)
    ref = p.astype(np.float32)
    got = np.asarray(got).astype(np.float32)
    diff = np.abs(got - ref)
    tol = TOL_PER_UPDATE * len(calls) * (np.abs(ref) + LR)
    close = bool(np.all(got == ref)) if exact else bool(np.all(diff <= tol))
    return dict(
        ok=close and bool(np.any(got != start_rows.astype(np.float32))),
        compared=int(ref.size),
        equal=int(np.count_nonzero(got == ref)),
        max_rel=float(np.max(diff / tol)),
    )


def merge_checks(checks: list[dict], how: str) -> dict:
    compared = sum(c["compared"] for c in checks)
    return {
        "rows_checked": bool(checks) and all(c["ok"] for c in checks),
        "rows_check": how,
        "rows_checksums": len(checks),
        "rows_mismatched": sum(not c["ok"] for c in checks),
        "values_compared": compared,
        "values_bitwise_equal": sum(c["equal"] for c in checks) / max(1, compared),
        "max_diff_over_tolerance": max((c["max_rel"] for c in checks), default=None),
    }


HOW = (
    f"{SAMPLE_ROWS} sample rows in every batch, reset to known rows and state before each "
    "pass; after it, rows vs engram_jax.testing's numpy reference of the optimizer over the "
    "pass's calls: bitwise for the library, within "
    f"{TOL_PER_UPDATE} x calls x (|reference| + lr) for numpy + device_put (optax's Adam "
    "rounds in another order)"
)


# -- the variants ---------------------------------------------------------------------


class Library:
    """apply_gradients on a TrainableTable (host placement or HBM)."""

    def __init__(self, optim: Optim, num_rows: int, placement: str, device) -> None:
        self.optim = optim
        self.table = ej.TrainableTable.allocate(
            num_rows, DIM, dtype=jnp.bfloat16, optimizer=optim.spec(), placement=placement,
            device=device if device.platform == "gpu" else None,
        )  # fmt: skip
        table = self.table

        def update(ids, grads, call):
            return ej.apply_gradients(table, ids[:, None], grads[:, None], LR, step=call + 1)

        self.update = jax.jit(update)

        def update_all(ids_stack, grads_stack, call0, unroll):
            # Every batch of a pass in one jitted call: a dispatch of a program holding
            # an update costs about 0.6 ms on an H200 (its side effect keeps jax off its
            # C++ fast path; train_32g_ceiling.json), more than a small batch's update.
            def body(token, xs):
                ids, grads, i = xs
                call = call0 + i
                token = ej.apply_gradients(table, ids[:, None], grads[:, None], LR,
                                           step=call + 1, after=token)  # fmt: skip
                return token, None

            steps = jnp.arange(ids_stack.shape[0], dtype=jnp.int32)
            xs = (ids_stack, grads_stack, steps)
            return jax.lax.scan(body, jnp.zeros((), jnp.int32), xs, unroll=unroll)[0]

        # Rolled, and unrolled (straight-line code, as a training step is): to see
        # whether a rolled loop leaves the GPU waiting for the host between its
        # iterations. It does not: the same time a call at 2^14 ids, within 4 %
        # (H100, train_small_profile.json).
        self.update_all = {
            unroll: jax.jit(functools.partial(update_all, unroll=unroll))
            for unroll in (False, True)
        }

    def reset(self, lo: int, rows, state) -> None:
        self.table.write_rows(lo, rows)
        self.table.write_state(lo, state)

    def read(self, sample: np.ndarray) -> np.ndarray:
        return self.table.read_rows(sample)

    def compile(self, ids, grads):
        return self.update.lower(ids, grads, jnp.int32(0)).compile()

    def compile_all(self, ids_stack, grads_stack, unroll: bool):
        return self.update_all[unroll].lower(ids_stack, grads_stack, jnp.int32(0)).compile()

    def close(self) -> None:
        self.table.close()


class Alternative:
    """What a JAX user would write: numpy arrays in host memory, unique ids on the host,
    rows (and state) to the device with jax.device_put, the update there, back with numpy."""

    def __init__(self, optim: Optim, num_rows: int, device) -> None:
        self.optim, self.device = optim, device
        self.rows = np.zeros((num_rows, DIM), BF16)
        self.rows.view(np.uint16)[:] = 0  # touch every page now, not in the timed calls
        if optim.name == "row_adagrad":
            self.state = {"accumulator": np.zeros(num_rows, np.float32)}
        else:
            self.state = {k: np.zeros((num_rows, DIM), BF16) for k in ("exp_avg", "exp_avg_sq")}
            for v in self.state.values():
                v.view(np.uint16)[:] = 0
        adam = optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)

        @jax.jit
        def update(p, state, grads, inverse, call):
            g = grads.astype(jnp.float32)
            g = jax.ops.segment_sum(g, inverse, num_segments=p.shape[0])
            p32 = p.astype(jnp.float32)
            if optim.name == "row_adagrad":  # optax has no row-wise Adagrad: by hand
                acc = state["accumulator"] + jnp.mean(g * g, axis=1)
                new = p32 - (LR / (jnp.sqrt(acc) + 1e-8))[:, None] * g
                return new.astype(p.dtype), {"accumulator": acc}
            s = optax.ScaleByAdamState(
                count=call, mu=state["exp_avg"].astype(jnp.float32),
                nu=state["exp_avg_sq"].astype(jnp.float32),
            )  # fmt: skip
            u, s = adam.update(g, s)
            new = optax.apply_updates(p32, -LR * u)
            return new.astype(p.dtype), {
                "exp_avg": s.mu.astype(p.dtype),
                "exp_avg_sq": s.nu.astype(p.dtype),
            }

        self.jitted = update

    def update(self, ids_dev, grads_dev, call):
        ids = np.asarray(ids_dev)
        unique, inverse = np.unique(ids, return_inverse=True)
        # Buckets of powers of two, so a handful of shapes compile.
        size = 1 << int(np.ceil(np.log2(unique.size)))
        padded = np.concatenate([unique, np.full(size - unique.size, unique[0], unique.dtype)])
        p = jax.device_put(self.rows[padded], self.device)
        state = {k: jax.device_put(v[padded], self.device) for k, v in self.state.items()}
        inv = jax.device_put(inverse.astype(np.int32), self.device)
        new, new_state = self.jitted(p, state, grads_dev, inv, jnp.int32(call))
        self.rows[unique] = np.asarray(new)[: unique.size]
        for k, v in new_state.items():
            self.state[k][unique] = np.asarray(v)[: unique.size]
        return None

    def reset(self, lo: int, rows, state) -> None:
        self.rows[lo : lo + len(rows)] = rows
        for k, v in state.items():
            self.state[k][lo : lo + len(v)] = v

    def read(self, sample: np.ndarray) -> np.ndarray:
        return self.rows[sample]

    def close(self) -> None:
        self.rows = self.state = None


def time_updates(
    variant, batches_dev, grads_dev, batches_np, sample, lo, known, passes, compiled=None,
    all_at_once=None,
):  # fmt: skip
    """Seconds per call (median over passes) and the rows check of every pass: one
    dispatch per batch, or with ``all_at_once`` (a compiled ``update_all`` and the
    batches and their gradients stacked) every batch of the pass in one dispatch."""
    times, checks = [], []
    call0 = 0
    for _ in range(passes):
        variant.reset(lo, *known)
        calls = list(range(call0, call0 + len(batches_dev)))
        call0 += len(batches_dev)
        start = time.perf_counter()
        if all_at_once is not None:
            fn, stack, grads_stack = all_at_once
            out = fn(stack, grads_stack, jnp.int32(calls[0]))
        else:
            out = None
            for ids, grads, call in zip(batches_dev, grads_dev, calls, strict=True):
                out = (compiled(ids, grads, jnp.int32(call)) if compiled
                       else variant.update(ids, grads, call))  # fmt: skip
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / len(batches_dev))
        checks.append(
            check_pass(
                variant.optim,
                variant.read(sample),
                known[0],
                known[1],
                batches_np,
                calls,
                sample,
                exact=isinstance(variant, Library),
            )
        )
    return float(np.median(times)), checks


def ceiling_proxy(table, distinct: list[np.ndarray], sample, passes, device):
    """The library's lookup of each batch's distinct rows (read only; padded with DEAD
    ids to one shape, which read nothing), and a check that the sample rows it
    returned are the table's."""
    width = max(d.size for d in distinct)
    padded = [np.concatenate([d, np.full(width - d.size, ej.DEAD_ID)]).astype(np.int32)
              for d in distinct]  # fmt: skip
    ids_dev = [jax.device_put(d, device) for d in padded]
    fn = jax.jit(lambda ids: ej.lookup(table, ids[:, None])).lower(ids_dev[0]).compile()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        out = None
        for ids in ids_dev:
            out = fn(ids)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / len(ids_dev))
    where = np.flatnonzero(np.isin(padded[-1], sample))
    got = np.asarray(out)[where, 0]
    ok = bool(where.size) and np.array_equal(
        got.view(np.uint16), table.read_rows(padded[-1][where]).view(np.uint16)
    )
    check = {
        "rows_checked": ok,
        "rows_check": "the sample rows the last lookup returned vs read_rows, bitwise",
        "rows_checksums": 1,
        "rows_mismatched": int(not ok),
    }
    return float(np.median(times)), check


# -- the ceiling: a raw read+write of the same rows (reference/rawupdate.cu) ------------

RAWUPDATE_SRC = Path(__file__).resolve().parent / "reference" / "rawupdate.cu"


def record_bytes(optim: Optim) -> int:
    """Bytes of one row's record (values and state) in the library's tables."""
    with ej.TrainableTable.allocate(1, DIM, dtype=jnp.bfloat16, optimizer=optim.spec(),
                                    placement="cpu") as table:  # fmt: skip
        return table.record_bytes


def build_rawupdate() -> Path | str:
    """The compiled kernel's path, or why there is none."""
    out = Path(tempfile.mkdtemp(prefix="rawupdate-")) / "rawupdate"
    try:
        subprocess.run(["nvcc", "-O3", "-arch=sm_90", "-o", str(out), str(RAWUPDATE_SRC)],
                       check=True, timeout=600, capture_output=True, text=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return f"not built: {exc}"
    return out


RAWUPDATE_KERNELS = ("flat", "warp")


def run_rawupdate(exe, nbytes: int, stride: int, counts: list[int]) -> list[dict]:
    """Per row count, the faster of the kernel's two ways of moving the rows (a thread
    per 16-byte word, or a warp per row as the library's update; each checks its own
    rows), or a record saying why it did not run."""

    def not_run(why: str) -> list[dict]:
        return [{"variant": "ceiling_rawupdate", "rows_checked": None, "rows_check": why}
                for _ in counts]  # fmt: skip

    if not isinstance(exe, Path):
        return not_run(exe or "not run (--smoke or --no-rawupdate)")
    by_kernel = {}
    for kernel in RAWUPDATE_KERNELS:
        env = dict(os.environ, RAWUPDATE_BYTES=str(nbytes), RAWUPDATE_STRIDE=str(stride),
                   RAWUPDATE_ROWS=",".join(str(max(1, c)) for c in counts),
                   RAWUPDATE_KERNEL=kernel)  # fmt: skip
        try:
            proc = subprocess.run([str(exe)], env=env, capture_output=True, text=True,
                                  check=True, timeout=300)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            return not_run(f"failed: {exc}; {getattr(exc, 'stderr', '') or ''}".strip())
        by_kernel[kernel] = [
            json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")
        ]
    out = []
    for lines in zip(*by_kernel.values(), strict=True):
        best = max(lines, key=lambda line: line["mrows_per_s"])
        out.append({
            "variant": "ceiling_rawupdate",
            "ms_per_call": best["ms"],
            "mrows_per_s": best["mrows_per_s"],
            "rawupdate_rows": best["rows"],
            "rawupdate_kernel": best.get("kernel"),
            "mrows_per_s_by_kernel": dict(zip(by_kernel, (ln["mrows_per_s"] for ln in lines),
                                              strict=True)),
            "gb_per_s_each_way": best["gb_per_s_each_way"],
            "rows_checked": all(ln["rows_compared"] > 0 and ln["rows_mismatched"] == 0
                                for ln in lines),
            "rows_check": "rawupdate: every row of each kernel's last call vs the fill plus "
            "its updates",
            "rows_checksums": sum(ln["rows_compared"] for ln in lines),
            "rows_mismatched": sum(ln["rows_mismatched"] for ln in lines),
        })  # fmt: skip
    return out


# -- the training steps: variants in turns ------------------------------------------------

STEP_ROUNDS = 3
PROFILE_STEPS = 3
PROFILE_TOP = 6
PROFILE_FIELDS = ("kernels_per_step", "busy_ms_per_step", "span_ms_per_step",
                  "gather_ms_per_step", "gaps_over_20us_per_step", "gap_ms_over_20us_per_step",
                  "top_gaps_before_ms_per_step", "beside_side_ms_per_step",
                  "top_beside_side_ms_per_step")  # fmt: skip


def take_turns(runs, per_round: int) -> None:
    """One untimed step of each run (it compiles: ``first_s``), then STEP_ROUNDS rounds
    of ``per_round`` steps of each, the runs in turns and each round starting one run
    later, so a drifting clock or a noisy neighbour weighs on all alike (``round_s``:
    seconds per step of each round). A run has ``run(count)``, which returns once its
    steps are done, and the lists ``round_s`` and ``losses``."""
    for run in runs:
        start = time.perf_counter()
        run.run(1)
        run.first_s = time.perf_counter() - start
    for r in range(STEP_ROUNDS):
        for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
            start = time.perf_counter()
            run.run(per_round)
            run.round_s.append((time.perf_counter() - start) / per_round)


def compact_profile(summary: dict | None) -> dict | None:
    """Per stream of ``_common.stream_summary``: its per-step times and top kernels;
    ``None`` where the trace holds no GPU stream (the CPU)."""
    if not summary:
        return None
    return {
        stream: {k: s.get(k) for k in PROFILE_FIELDS}
        | {"top_ms_per_step": dict(list(s["top_ms_per_step"].items())[:PROFILE_TOP])}
        for stream, s in summary.items()
    }


def profile_runs(runs, steps: int) -> None:
    """``steps`` more steps of each run under the jax profiler, after the timed rounds:
    its :func:`compact_profile` in ``run.profile``, one printed line per stream."""
    for run in runs:
        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp)
            try:
                run.run(steps)
            finally:
                jax.profiler.stop_trace()
            run.profile = compact_profile(_common.stream_summary(tmp, steps))
        if run.profile is None:
            print(f"profile {run.name}: no GPU stream in the trace", flush=True)
        for stream, s in (run.profile or {}).items():

            def listed(field, s=s):  # a field's kernels and ms, names cut short
                return ", ".join(f"{n[:40]} {ms:.3g}" for n, ms in (s[field] or {}).items())

            top, beside = listed("top_ms_per_step"), listed("top_beside_side_ms_per_step")
            waits = listed("top_gaps_before_ms_per_step")
            print(f"profile {run.name} {stream}: busy {s['busy_ms_per_step']:.3g} ms/step, "
                  f"span {s['span_ms_per_step']:.3g}, gather {s['gather_ms_per_step']:.3g}, "
                  f"idle gaps {s['gap_ms_over_20us_per_step']:.3g} (before {waits}), "
                  f"beside another stream's "
                  f"gather {s['beside_side_ms_per_step'] or 0:.3g} ({beside}); top: {top}",
                  flush=True)  # fmt: skip


class UpdateCalls:
    """:func:`profile_runs`' run for the updates part: ``run(count)`` makes the first
    ``count`` calls of a cell, a dispatch each (a profile's "step" is one call)."""

    def __init__(self, name: str, compiled, batches, grads) -> None:
        self.name, self.compiled, self.batches, self.grads = name, compiled, batches, grads

    def run(self, count: int) -> None:
        out = None
        for i, (ids, grads) in enumerate(zip(self.batches[:count], self.grads, strict=False)):
            out = self.compiled(ids, grads, jnp.int32(10**6 + i))
        jax.block_until_ready(out)


def one_dispatch_records(
    rec, variant, batches_dev, grads_dev, batches_np, sample, lo, known, passes, distinct_used,
    profile_as: str | None,
) -> dict:  # fmt: skip
    """The records of a library cell's calls made in one dispatch per pass: a rolled
    ``scan`` (``*_one_dispatch``) and an unrolled one (``*_unrolled``), each run once
    more under the profiler unless ``profile_as`` (the per-call run's name) is None."""
    stack, grads_stack = jnp.stack(batches_dev), jnp.stack(grads_dev)
    out = {}
    for unroll, suffix in ((False, "_one_dispatch"), (True, "_unrolled")):
        fn = variant.compile_all(stack, grads_stack, unroll)
        seconds, checks = time_updates(
            variant, batches_dev, grads_dev, batches_np, sample, lo, known, passes,
            all_at_once=(fn, stack, grads_stack),
        )  # fmt: skip
        name = rec["variant"] + suffix
        one = {k: v for k, v in rec.items() if k != "profile"}
        one.update(variant=name, ms_per_call=seconds * 1e3, dispatches_per_pass=1,
                   mrows_per_s=distinct_used / seconds / 1e6, unrolled=unroll,
                   **merge_checks(checks, HOW))  # fmt: skip
        if profile_as is not None:
            run = OneDispatch(profile_as + suffix, fn, stack, grads_stack)
            profile_runs([run], len(batches_dev))
            one["profile"] = run.profile
        out[name] = one
    return out


class OneDispatch:
    """:func:`profile_runs`' run for a one-dispatch variant: ``run(count)`` makes all
    of a cell's calls (``count`` of them, a profile's "step" being one call) in one
    dispatch of ``fn``."""

    def __init__(self, name: str, fn, stack, grads_stack) -> None:
        self.name, self.fn, self.stack, self.grads_stack = name, fn, stack, grads_stack

    def run(self, count: int) -> None:
        assert count == self.stack.shape[0], (count, self.stack.shape)
        jax.block_until_ready(self.fn(self.stack, self.grads_stack, jnp.int32(10**6)))


def turn_records(runs, what: str, common: dict, bitwise: bool = True) -> list[dict]:
    """A record per run that took turns: ms per step (the median round's) and its losses
    checked by ``run.mode``. The first run ("off": rows looked up in the step, host
    table) is the reference; "exact" (prefetched after the last update) and "exact_split"
    (its shared rows read again after their update) must give its losses bit for bit
    (with ``bitwise``; else the comparison is information only); "stale" rows differ by
    design and are only checked finite, the later stale runs against the first one's
    losses bit for bit (with ``bitwise``); "hbm" (the reference with the table in HBM) is
    what the others are measured against (``vs_hbm``), its losses' equality information.
    Closes the runs."""
    records, reference, stale = [], None, None
    for run in runs:
        run.close()
        losses = np.asarray(jax.device_get(run.losses))
        record = {
            "what": what,
            "variant": run.name,
            **common,
            "ms_per_step": statistics.median(run.round_s) * 1e3,
            "ms_per_step_rounds": [t * 1e3 for t in run.round_s],
            "rounds": len(run.round_s),
            "first_step_s": getattr(run, "first_s", None),
            "losses_finite": bool(np.all(np.isfinite(losses))),
            **getattr(run, "fields", {}),
        }
        if run.mode == "off":
            reference = losses
            record.update(rows_checked=None, rows_check="the reference of the exact-order steps")
        elif run.mode in EXACT_MODES and bitwise:
            same = bool(np.array_equal(losses, reference))
            record.update(
                rows_checked=same,
                rows_check="every step's loss equal, bitwise, to the no-prefetch step's (fresh "
                "tables, same ids)",
                rows_checksums=losses.size,
                rows_mismatched=int(np.count_nonzero(losses != reference)),
            )
        elif run.mode in EXACT_MODES:
            record.update(
                rows_checked=None,
                rows_check="not compared: the program is not deterministic",
                losses_equal_no_prefetch=bool(np.array_equal(losses, reference)),
            )
        elif run.mode == "hbm":
            # Information, not a rows check: XLA's own kernels need not give the
            # same bits in another program, whatever the table returns.
            record.update(
                rows_checked=None,
                rows_check="the host table's step measured against this one",
                losses_equal_host=bool(np.array_equal(losses, reference)),
            )
        elif stale is not None and bitwise:
            # Another stale run (the updates elsewhere): the first stale run's losses.
            same = bool(np.array_equal(losses, stale))
            record.update(
                rows_checked=same,
                rows_check="every step's loss equal, bitwise, to the first stale variant's",
                rows_checksums=losses.size,
                rows_mismatched=int(np.count_nonzero(losses != stale)),
            )
        else:
            # Stale rows give other losses by design; NaN ones never.
            stale = losses
            finite = record["losses_finite"]
            record.update(
                rows_checked=None if finite else False,
                rows_check="stale rows by design: not compared with the reference, only "
                "checked finite (the stale variants after it are compared with it)",
            )
        if hasattr(run, "profile"):
            record["profile"] = run.profile
        records.append(record)
        print({k: v for k, v in record.items() if k != "profile"}, flush=True)
    base = records[0]["ms_per_step"]
    on_hbm = [r["ms_per_step"] for r in records if r["variant"].endswith("hbm")]
    for r in records:
        r["vs_no_prefetch"] = r["ms_per_step"] / base
        if on_hbm:
            r["vs_hbm"] = r["ms_per_step"] / on_hbm[0]
    return records


# -- the proxy step: GEMMs over the looked-up rows --------------------------------------


def step_variants(device, hbm: bool) -> list[tuple[str, str, int | None]]:
    """(name, mode, max_ctas) of each training step measured: the rows looked up in
    the step ("off"), or prefetched a step ahead in exact order or one step stale, on
    prefetch_ctas's CTAs and, on a GPU, on every SM (a training step has no model
    beside the gather to spare, and the exact order cannot overlap it with anything);
    "hbm": the no-prefetch step with the table in HBM, what the host table's step is
    measured against (issue goal: within 1.1x)."""
    variants = [("no_prefetch", "off", None), ("prefetch_exact", "exact", None),
                ("prefetch_stale", "stale", None)]  # fmt: skip
    if device.platform == "gpu":
        sms = getattr(device, "core_count", None) or 132
        variants += [
            ("prefetch_exact_all_sms", "exact", sms),
            ("prefetch_stale_all_sms", "stale", sms),
        ]
        if hbm:
            variants.append(("no_prefetch_hbm", "hbm", None))
    return variants


def step_records(args, device, num_rows: int) -> list[dict]:
    """A training step whose rows are looked up in the step, or prefetched a step ahead
    (exact order / stale), each on a fresh table: ms per step, losses compared. The
    variants take turns (:func:`take_turns`: STEP_ROUNDS rounds of step_count /
    STEP_ROUNDS steps each after an untimed compiling step); ms_per_step is the median
    round's. With ``--profile``, PROFILE_STEPS more steps of each under the profiler."""
    tokens, cols, width, layers = args.step_tokens, 24, args.step_width, args.step_layers
    rng = np.random.default_rng(1)
    per_round = max(1, args.step_count // STEP_ROUNDS)
    steps = 1 + STEP_ROUNDS * per_round + (PROFILE_STEPS if args.profile else 0)
    ids_np = [make_ids(rng, "zipf", tokens * cols, num_rows, np.arange(SAMPLE_ROWS))
              for _ in range(steps + 1)]  # fmt: skip
    ids = [jax.device_put(i.reshape(tokens, cols), device) for i in ids_np]
    key = jax.random.key(0)
    w_in = jax.random.normal(key, (cols * DIM, width), jnp.bfloat16) * (cols * DIM) ** -0.5
    ws = [jax.random.normal(jax.random.fold_in(key, i), (width, width), jnp.bfloat16) * width**-0.5
          for i in range(layers)]  # fmt: skip
    x = jax.random.normal(jax.random.fold_in(key, 99), (tokens, width), jnp.bfloat16)

    def loss_fn(rows):
        h = rows.reshape(tokens, -1).astype(jnp.bfloat16) @ w_in + x
        for w in ws:
            h = jax.nn.gelu(h @ w)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    class Run:
        """One variant: its own table, compiled step, carry and losses."""

        def __init__(self, name: str, mode: str, max_ctas: int | None):
            self.name, self.mode, self.done = name, mode, 0
            self.losses, self.round_s = [], []
            self.table = table = ej.TrainableTable.allocate(
                num_rows, DIM, dtype=jnp.bfloat16, optimizer=ej.row_adagrad(),
                placement="device" if mode == "hbm" else args.placement,
                device=device if device.platform == "gpu" else None,
            )  # fmt: skip
            options = {} if max_ctas is None else {"max_ctas": max_ctas}

            def grads_and_update(rows, i):
                loss, g = jax.value_and_grad(loss_fn)(rows)
                return loss, ej.apply_gradients(table, i, g, LR)

            if mode in ("off", "hbm"):
                self.step = jax.jit(lambda i: grads_and_update(ej.lookup(table, i), i))
                return

            # exact: the carry is this step's lookup, started after the last update;
            # stale: this step's rows, gathered during the last step before its update.
            # Starts carry a tag: an untagged start's event, part of the handle's pytree
            # structure, is new at each trace, so every step would compile again.
            def step(carry, i, nxt):
                if mode == "exact":
                    loss, update = grads_and_update(ej.lookup_done(carry), i)
                    return loss, ej.lookup_start(table, nxt, tag="step ahead", after=update,
                                                 **options)  # fmt: skip
                # Issued before the step's GEMMs (tied to the rows they read): untied,
                # XLA may issue the start just before its done.
                carry, h = jax.lax.optimization_barrier(
                    (carry, ej.lookup_start(table, nxt, **options))
                )
                loss, g = jax.value_and_grad(loss_fn)(carry)
                nxt_rows = ej.lookup_done(h)
                # The update (a side effect, kept) waits for the next rows' gather.
                ej.apply_gradients(table, i, g, LR, after=(carry, nxt_rows))
                return loss, nxt_rows

            self.step = jax.jit(step)
            # Kept while the carry is in flight: a dropped executable's call site
            # zeroes its descriptor, and a handle it started then reads NaN rows.
            if mode == "exact":
                self.first = jax.jit(
                    lambda i: ej.lookup_start(table, i, tag="step ahead", **options)
                )
                self.finish = jax.jit(lambda h: ej.lookup_done(h).sum())
            else:
                self.first = jax.jit(lambda i: ej.lookup(table, i))
                self.finish = jax.jit(lambda rows: rows.sum())
            self.carry = self.first(ids[0])

        def run(self, count: int) -> None:
            for _ in range(count):
                s = self.done
                if self.mode in ("off", "hbm"):
                    self.losses.append(self.step(ids[s])[0])
                else:
                    loss, self.carry = self.step(self.carry, ids[s], ids[s + 1])
                    self.losses.append(loss)
                self.done += 1
            jax.block_until_ready(self.losses)

        def close(self) -> None:
            if self.mode not in ("off", "hbm"):
                jax.block_until_ready(self.finish(self.carry))
            self.table.close()

    runs = [Run(*v) for v in step_variants(device, not args.no_hbm)]
    take_turns(runs, per_round)
    if args.profile:
        profile_runs(runs, PROFILE_STEPS)
    return turn_records(runs, "step", {"tokens": tokens, "ids": tokens * cols})


# -- the example's own model (examples/training) ----------------------------------------

# Rows ~ N(0, MODEL_INIT_STD), all distinct (steps.init_rows): a zero row read in
# place of a real one changes the loss.
MODEL_INIT_STD = 0.02
# XLA's GPU scatter-add (the gradient of the token embedding over repeated tokens)
# adds with atomics in arrival order, so without this two runs of one program
# differ in the last bits after a step or two, whatever the tables return.
DETERMINISTIC = {"xla_gpu_exclude_nondeterministic_ops": True}
# The prefetch modes whose rows are the no-prefetch step's, so its losses bit for bit.
EXACT_MODES = ("exact", "exact_split")


# The example's Steps as the last release had them: rows gathered as given, every
# update on XLA's own stream (the comparison for what dedup and the update stream gain).
BEFORE_DEDUP_AND_STREAM = {"order": "plain", "update_stream": None}


def model_variants(
    device, hbm: bool, old_exact: bool = True
) -> list[tuple[str, str, int | None, dict]]:
    """(name, mode, max_ctas, Steps options) of each step of the example's model: the host
    table's rows looked up in the step, prefetched in exact order and one step stale on
    every SM (as the README advises for training; the CPU ignores the grid), both with the
    updates on XLA's stream 1 and on the library's side stream (``*_side``: on 64 CTAs,
    the stale step also on 32 and 128 on a GPU, and on 32 with XLA's stream waiting for
    the update before the next gather, ``_token``, as the last release did), exact order
    with the update split (``exact_split``: the rows the next batch reads updated at once,
    the rest beside the next forward pass on the side stream, and on a GPU also on XLA's
    stream 1), exact order without dedup and without the update stream (unless
    ``old_exact`` is off: --no-old-exact), and the no-prefetch step with the table in HBM
    (GPU, unless --no-hbm)."""
    sms = getattr(device, "core_count", None) if device.platform == "gpu" else None

    def side(ctas):
        return {"update_stream": "side", "update_ctas": ctas}

    variants = [("no_prefetch", "off", None, {}), ("prefetch_exact", "exact", sms, {}),
                ("prefetch_stale", "stale", sms, {}),
                ("prefetch_exact_side", "exact", sms, side(64)),
                ("prefetch_exact_split_side", "exact_split", sms, side(64)),
                ("prefetch_stale_side", "stale", sms, side(64))]  # fmt: skip
    if device.platform == "gpu":  # the CPU ignores the grid: these would be the same step
        at = [name for name, *_ in variants].index("prefetch_stale_side")
        variants[at:at] = [("prefetch_stale_side_32", "stale", sms, side(32)),
                         ("prefetch_stale_side_32_token", "stale", sms,
                          {**side(32), "gather_after": "token"})]  # fmt: skip
        variants.append(("prefetch_stale_side_128", "stale", sms, side(128)))
        # On the CPU, XLA's stream 1 is XLA's own; left out there to keep the CPU suite
        # short (tests/test_train_example.py runs it on a GPU, on stream 1).
        at = [name for name, *_ in variants].index("prefetch_exact_split_side")
        variants.insert(at, ("prefetch_exact_split", "exact_split", sms, {}))
    if old_exact:
        variants.append(
            ("prefetch_exact_no_dedup_one_stream", "exact", sms, BEFORE_DEDUP_AND_STREAM)
        )
    if hbm and device.platform == "gpu":
        variants.append(("no_prefetch_hbm", "hbm", None, {}))
    return variants


def model_records(args, device) -> list[dict]:
    """The training step of examples/train.py's model (its Setup, tables, optax Adam
    and Steps), one run per :func:`model_variants` entry, each from the same weights
    and table rows, taking turns as the proxy step's variants do."""
    per_round = max(1, args.model_steps // STEP_ROUNDS)
    steps = 1 + STEP_ROUNDS * per_round + (PROFILE_STEPS if args.profile else 0)
    flags = ["--model", args.model_name, "--batch", args.model_batch, "--seq", args.model_seq,
             "--table-gib", args.model_gib, "--table-dtype", "bfloat16",
             "--table-optimizer", args.model_optimizer, "--table-init-std", MODEL_INIT_STD,
             "--steps", steps, *(["--vocab", 512] if args.smoke else [])]  # fmt: skip
    ex = train_example.parse_args([str(f) for f in flags])
    variants = model_variants(device, not args.no_hbm, not args.no_old_exact)
    if args.model_variants:
        known = [name for name, *_ in variants]
        unknown = sorted(set(args.model_variants) - set(known))
        if unknown or variants[0][0] not in args.model_variants:
            raise SystemExit(
                f"train.py --model-variants: {', '.join(unknown) or 'no_prefetch missing'}; "
                f"this machine's variants are {', '.join(known)} (no_prefetch, the "
                "reference, always among them)"
            )
        variants = [v for v in variants if v[0] in args.model_variants]
    on_host = sum(mode != "hbm" for _, mode, _, _ in variants)
    try:
        setup = train_example.setup(ex, device)
        # Every variant's tables are held at once.
        check_fits(setup.host_bytes * on_host, args.placement, device)
        if on_host < len(variants):
            check_fits(setup.host_bytes, "device", device)
    except UserError as exc:
        raise SystemExit(f"train.py --parts model: {exc}") from None
    cfg, layout = setup.cfg, setup.layout
    batches = data.Batches(setup.corpus.train, setup.corpus.train_docs, setup.vocab, ex.batch,
                           ex.seq, ex.seed)  # fmt: skip
    batches = [next(batches) for _ in range(steps + 1)]  # the last prefetch reads one more
    hash_batch = train_steps.make_hash(layout)
    ids = [hash_batch(*(jax.device_put(b[k], device) for k in ("compressed", "segments")))
           for b in batches]  # fmt: skip
    inputs = [jax.device_put(b["inputs"], device) for b in batches]
    targets = [jax.device_put(b["targets"], device) for b in batches]
    counters = [jax.device_put(np.int32(i), device) for i in range(steps)]
    dense, schedule = train_steps.dense_optimizer(ex.lr, ex.warmup)
    params = train_model.init_params(cfg, ex.seed, setup.dtype)
    deterministic = args.model_deterministic and device.platform == "gpu"
    compiler_options = DETERMINISTIC if deterministic else None
    tokens = ex.batch * ex.seq
    rows_gib = setup.rows_gib
    common = dict(
        model=ex.model, batch=ex.batch, seq=ex.seq, tokens=tokens,
        ids=tokens * layout.n_cols * layout.n_layers, vocab=setup.vocab.size, dtype=ex.dtype,
        table_gib=rows_gib, table_gib_with_state=setup.host_bytes / 2**30,
        table_rows=sum(layout.num_embeddings), table_dtype=setup.table_dtype.name,
        table_optimizer=ex.table_optimizer, table_lr_mult=train_steps.TABLE_LR_MULT,
        table_init_std=ex.table_init_std, engram_layers=list(cfg.engram_layers),
        n_cols=layout.n_cols, row_dim=cfg.row_dim, xla_deterministic=deterministic,
        steps_per_round=per_round,
    )  # fmt: skip
    print(f"model {ex.model}: {tokens} tokens x {layout.n_cols} ids x {layout.n_layers} layers "
          f"per step; tables {rows_gib:.3f} GiB of rows, {setup.host_bytes / 2**30:.3f} GiB "
          f"with {ex.table_optimizer} state, per variant; {len(variants)} variants",
          flush=True)  # fmt: skip

    class Run:
        """One variant: its own tables (the same rows), weights, optimizer state, carry."""

        def __init__(self, name: str, mode: str, max_ctas: int | None, options: dict):
            self.name, self.mode, self.done = name, mode, 0
            self.losses, self.round_s = [], []
            placement = "device" if mode == "hbm" else args.placement
            self.fields = dict(placement=placement, prefetch_ctas=max_ctas, steps_options=options)
            self.stack = contextlib.ExitStack()
            start = time.perf_counter()
            self.tables = train_steps.build_tables(
                layout, setup.table_dtype, ex.table_optimizer, placement, device, 0.0, ex.seed,
                self.stack,
            )  # fmt: skip
            allocated = time.perf_counter()
            for i, table in enumerate(self.tables):  # as build_tables seeds them
                train_steps.init_rows(table, ex.table_init_std, (ex.seed, i))
            filled = time.perf_counter()
            self.fields.update(allocate_s=allocated - start, init_rows_s=filled - allocated)
            print(f"model {name}: tables ({placement}) allocated in {allocated - start:.1f} s, "
                  f"rows written in {filled - allocated:.1f} s", flush=True)  # fmt: skip
            self.steps = train_steps.Steps(
                cfg, self.tables, dense, schedule, "off" if mode == "hbm" else mode,
                prefetch_ctas=max_ctas, compiler_options=compiler_options, **options,
            )  # fmt: skip
            # Each run donates its own copy; committed to the device from the first step,
            # as the step's outputs are (else the second step compiles again).
            self.params = jax.device_put(jax.tree.map(jnp.copy, params), device)
            self.opt_state = jax.device_put(dense.init(self.params), device)
            self.carry = self.steps.begin(ids[0])

        def run(self, count: int) -> None:
            for _ in range(count):
                s = self.done
                self.params, self.opt_state, loss, self.carry = self.steps.advance(
                    self.params, self.opt_state, counters[s], self.carry, ids[s], inputs[s],
                    targets[s], ids[s + 1],
                )  # fmt: skip
                self.losses.append(loss)
                self.done += 1
            jax.block_until_ready((self.losses, self.params))

        def close(self) -> None:
            self.steps.end(self.carry)
            self.stack.close()
            # Its compiled steps hold their call sites' staging (outside XLA's pool):
            # dropped now, so the next run's end has room on an 80 GB card (it failed
            # there with every run's sites alive).
            self.steps = self.params = self.opt_state = self.carry = None
            gc.collect()

    runs = []
    try:
        for v in variants:
            runs.append(Run(*v))
        take_turns(runs, per_round)
        for run in runs:
            print(f"model {run.name}: first step (compiling) {run.first_s:.1f} s", flush=True)
        if args.profile:
            profile_runs(runs, PROFILE_STEPS)
    except BaseException:
        for run in runs:
            run.stack.close()
        raise
    bitwise = deterministic or device.platform != "gpu"  # XLA on the CPU is deterministic
    return turn_records(runs, "model_step", common, bitwise)


# -- the run ----------------------------------------------------------------------------


def cell_with_ratios(cell: dict, cell_records: dict, before: dict, after: dict) -> list[dict]:
    """A cell's records with ``vs_ceiling`` (the library's host rows against the higher
    of the ceilings measured before and after the cell's optimizer ran, or the lookup
    of the same rows where no kernel ran) and ``vs_alternative``."""
    runs = [c for c in (before, after) if c.get("mrows_per_s")]
    if runs:
        best = max(runs, key=lambda c: c["mrows_per_s"])
        cell_records["ceiling_rawupdate"] = {
            **cell, **best, "mrows_per_s_before": before.get("mrows_per_s"),
            "mrows_per_s_after": after.get("mrows_per_s"),
            "rows_checked": all(c["rows_checked"] for c in runs),
            "rows_mismatched": sum(c["rows_mismatched"] for c in runs),
            "rows_checksums": sum(c["rows_checksums"] for c in runs),
        }  # fmt: skip
        ceiling, ceiling_name = best["mrows_per_s"], "ceiling_rawupdate"
    else:  # no kernel ran: the read-only lookup of the same rows stands in
        ceiling = cell_records["lookup_of_the_rows"]["mrows_per_s"]
        ceiling_name = "lookup_of_the_rows"
    alt = cell_records.get("numpy_device_put", {}).get("mrows_per_s")
    out = []
    for rec in cell_records.values():
        host = rec["variant"].startswith("library_host")
        rec["vs_ceiling"] = rec["mrows_per_s"] / ceiling if host else None
        rec["ceiling"] = ceiling_name if host else None
        rec["vs_alternative"] = (
            rec["mrows_per_s"] / alt if alt and rec["variant"].startswith("library") else None
        )
        out.append(rec)
        print({k: rec.get(k) for k in ("optimizer", "ids", "batch", "variant", "mrows_per_s",
               "vs_ceiling", "vs_alternative", "rows_checked")}, flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny tables, small batches")
    parser.add_argument("--adagrad-gib", type=float, help="row_adagrad table rows, GiB (32)")
    parser.add_argument(
        "--adam-gib",
        type=float,
        help="lazy_adam table rows, GiB (8: its "
        "bf16 moments triple it, and the alternative holds as much again)",
    )
    parser.add_argument(
        "--log2-batches", type=int, nargs="+", help="ids per call, 2**k (14 16 18 20; smoke 10 12)"
    )
    parser.add_argument(
        "--ids", nargs="+", default=["zipf", "uniform"], choices=["zipf", "uniform"]
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=["row_adagrad", "lazy_adam"],
        choices=["row_adagrad", "lazy_adam"],
    )
    parser.add_argument("--placement", default=None, help="host table placement (pinned; cpu)")
    parser.add_argument("--no-hbm", action="store_true", help="skip the HBM-table variant")
    parser.add_argument(
        "--model-variants",
        nargs="+",
        metavar="NAME",
        help="--parts model: only these variants (no_prefetch, the reference, among them)",
    )
    parser.add_argument(
        "--no-old-exact",
        action="store_true",
        help="--parts model: skip the exact order as the last release ran it (host memory)",
    )
    parser.add_argument("--no-alternative", action="store_true", help="skip numpy + device_put")
    parser.add_argument(
        "--no-rawupdate", action="store_true", help="skip the read+write kernel's ceiling"
    )
    parser.add_argument("--step-gib", type=float, help="prefetch step's table, GiB (8)")
    parser.add_argument("--step-tokens", type=int, help="tokens per step (4096; smoke 64)")
    parser.add_argument("--step-width", type=int, help="the step's GEMM width (4096; smoke 64)")
    parser.add_argument("--step-layers", type=int, default=8, help="the step's GEMMs")
    parser.add_argument(
        "--step-count", type=int, default=12, help="steps timed per variant, over 3 rounds"
    )
    parser.add_argument(
        "--model-name",
        choices=sorted(train_model.MODELS),
        help="--parts model: examples/train.py's --model (small; smoke micro)",
    )
    parser.add_argument(
        "--model-gib",
        type=float,
        help="--parts model: rows of all Engram tables, GiB, per variant (8: lazy_adam's bf16 "
        "moments triple it, and the three host variants hold 72 GiB at once; smoke 0.004)",
    )
    parser.add_argument("--model-batch", type=int, help="--parts model: sequences (32; smoke 4)")
    parser.add_argument("--model-seq", type=int, help="--parts model: tokens each (512; smoke 32)")
    parser.add_argument(
        "--model-optimizer",
        default="lazy_adam",
        choices=train_steps.TABLE_OPTIMIZERS,
        help="--parts model: the tables' optimizer",
    )
    parser.add_argument(
        "--model-steps", type=int, help="--parts model: steps timed per variant, over 3 rounds "
        "(12; smoke 3)"
    )  # fmt: skip
    parser.add_argument(
        "--model-deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--parts model on a GPU: compile the steps with XLA's deterministic ops, so "
        "exact-order prefetch can be checked bit for bit (without: information only)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"after the timed rounds, {PROFILE_STEPS} more steps of each step or model "
        "variant and one more pass of each library update cell under the jax profiler: "
        "per GPU stream busy time and top kernels",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["updates", "step"],
        choices=["updates", "step", "model"],
        help="the update calls, the proxy training step, the example's model's step "
        "(not in the default)",
    )
    parser.add_argument("--name", default="train", help="results file name")
    args = parser.parse_args()
    smoke = args.smoke
    args.adagrad_gib = args.adagrad_gib or (0.03 if smoke else 32.0)
    args.adam_gib = args.adam_gib or (0.01 if smoke else 8.0)
    args.log2_batches = args.log2_batches or ([10, 12] if smoke else [14, 16, 18, 20])
    args.placement = args.placement or ("cpu" if smoke else "pinned")
    args.step_gib = args.step_gib or (0.01 if smoke else 8.0)
    args.step_tokens = args.step_tokens or (64 if smoke else 4096)
    args.step_width = args.step_width or (64 if smoke else 4096)
    args.model_name = args.model_name or ("micro" if smoke else "small")
    args.model_gib = args.model_gib or (0.004 if smoke else 8.0)
    args.model_batch = args.model_batch or (4 if smoke else 32)
    args.model_seq = args.model_seq or (32 if smoke else 512)
    args.model_steps = args.model_steps or (3 if smoke else 12)
    device = jax.devices("cpu" if smoke else "gpu")[0]
    hbm = not (smoke or args.no_hbm)
    profiled = args.profile and device.platform == "gpu"  # the CPU's trace has no streams

    records: list[dict] = []
    sample_lo = 12345
    exe = None if smoke or args.no_rawupdate or "updates" not in args.parts else build_rawupdate()
    for name in args.optimizers if "updates" in args.parts else ():
        optim = Optim(name, args.adagrad_gib if name == "row_adagrad" else args.adam_gib)
        num_rows = int(optim.gib * 2**30) // ROW_BYTES
        sample = np.arange(sample_lo, sample_lo + SAMPLE_ROWS)
        known = known_sample_state(optim, seed=len(records))
        # Every cell's ids first: the ceiling's own process runs on the same row counts
        # before the tables take the host memory.
        rng = np.random.default_rng(7)
        cells = []
        for kind in args.ids:
            for log2 in args.log2_batches:
                n = 1 << log2
                # 2**21 ids a pass, 2 to 64 calls: a dispatch of a pass's calls waits
                # 0.6-0.8 ms for the host before its first kernel (H100 profile,
                # train_small_profile.json), a tenth of 16 calls of 2**14 ids.
                # The smoke run's 8 keep its unrolled dispatches quick to compile.
                calls = max(2, min(8 if smoke else 64, (1 << 21) // n))
                batches_np = [make_ids(rng, kind, n, num_rows, sample) for _ in range(calls)]
                cells.append((kind, n, batches_np, [np.unique(b) for b in batches_np]))
        stride = record_bytes(optim)
        counts = [int(np.mean([d.size for d in c[3]])) for c in cells]
        ceilings = run_rawupdate(exe, num_rows * stride, stride, counts)
        cells_done = []
        t0 = time.perf_counter()
        variants = {"library_host": Library(optim, num_rows, args.placement, device)}
        if hbm:
            variants["library_hbm"] = Library(optim, num_rows, "device", device)
        if not args.no_alternative:
            variants["numpy_device_put"] = Alternative(optim, num_rows, device)
        print(f"{name}: {optim.gib:g} GiB of rows x {len(variants)} tables ready in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
        for (kind, n, batches_np, distinct), ceiling_run in zip(cells, ceilings, strict=True):
            batches_dev = [jax.device_put(b, device) for b in batches_np]
            # Made before the timed calls, as a model's backward pass makes them.
            grads_dev = jax.block_until_ready(
                [make_grads(ids, jnp.int32(k)) for k, ids in enumerate(batches_dev)]
            )
            rows_per_call = float(np.mean([d.size for d in distinct]))
            cell = dict(optimizer=name, ids=kind, batch=n, distinct_rows=rows_per_call,
                        table_gib=optim.gib, record_bytes=stride, dtype="bfloat16",
                        dim=DIM)  # fmt: skip
            cell_records = {}
            for vname, variant in variants.items():
                is_lib = isinstance(variant, Library)
                passes = 3 if is_lib else (1 if n >= 1 << 18 and not smoke else 2)
                # numpy's calls take up to seconds: at most 4 of the batches per pass.
                used = len(batches_dev) if is_lib else min(len(batches_dev), 4)
                if not is_lib:  # compile its shape buckets (untimed; the pass resets)
                    variant.update(batches_dev[0], grads_dev[0], 10**6)
                compiled = variant.compile(batches_dev[0], grads_dev[0]) if is_lib else None
                seconds, checks = time_updates(
                    variant, batches_dev[:used], grads_dev[:used], batches_np[:used], sample,
                    sample_lo, known, passes, compiled,
                )  # fmt: skip
                distinct_used = float(np.mean([d.size for d in distinct[:used]]))
                rec = dict(cell, variant=vname, ms_per_call=seconds * 1e3, calls=used,
                           passes=passes, mrows_per_s=distinct_used / seconds / 1e6,
                           dispatches_per_pass=used, **merge_checks(checks, HOW))  # fmt: skip
                cell_records[vname] = rec
                label = f"{name} {kind} 2^{n.bit_length() - 1} {vname}"
                if is_lib and profiled:
                    run = UpdateCalls(label, compiled, batches_dev, grads_dev)
                    profile_runs([run], len(batches_dev))
                    rec["profile"] = run.profile
                if is_lib:  # the same calls in one dispatch per pass
                    cell_records |= one_dispatch_records(
                        rec, variant, batches_dev, grads_dev, batches_np, sample, sample_lo,
                        known, passes, distinct_used, label if profiled else None,
                    )  # fmt: skip
            seconds, check = ceiling_proxy(
                variants["library_host"].table, distinct, sample, 3, device
            )
            cell_records["lookup_of_the_rows"] = dict(
                cell, variant="lookup_of_the_rows", ms_per_call=seconds * 1e3,
                mrows_per_s=rows_per_call / seconds / 1e6, **check,
            )  # fmt: skip
            cells_done.append((cell, cell_records, ceiling_run))
        for variant in variants.values():
            variant.close()
        # The ceiling again, now the tables are gone: PCIe's rate drifts on a shared
        # machine, and a ceiling taken once, minutes before, let the library's rate
        # exceed it (lazy Adam, 1.08-1.13x, train_32g_runs.json). The higher of the two
        # is the ceiling.
        again = run_rawupdate(exe, num_rows * stride, stride, counts)
        for (cell, cell_records, before), after in zip(cells_done, again, strict=True):
            records += cell_with_ratios(cell, cell_records, before, after)

    if "step" in args.parts:
        records += step_records(args, device, int(args.step_gib * 2**30) // ROW_BYTES)
    if "model" in args.parts:
        records += model_records(args, device)
    extra = {
        "ceiling": "ceiling_rawupdate: reference/rawupdate.cu, a read+write of the same number "
        "of distinct rows (uniform, sorted) of records of the table's size in pinned memory, "
        "kernel time only, the faster of a thread per 16-byte word and a warp per row; where "
        "it did not run, lookup_of_the_rows (engram_jax.lookup of each batch's distinct rows, "
        "read only) stands in and each record's `ceiling` says so",
        "alternative": "numpy unique + gather, jax.device_put, optax.scale_by_adam (lazy_adam) "
        "or row-wise Adagrad by hand, np.asarray and a numpy scatter back",
        "mrows_per_s": "distinct rows updated (or read, for the ceiling) per second",
        "model_step": "examples/train.py's training step (what=model_step): ms_per_step is the "
        "median of three rounds in turns; ids = tokens x hash columns x Engram layers",
        "smoke": smoke,
    }
    path = _common.write_results(args.name + ("_smoke" if smoke else ""), records, extra)
    print(f"wrote {path}")
    _common.print_table(
        [r for r in records if "optimizer" in r],
        ["optimizer", "ids", "batch", "variant", "distinct_rows", "mrows_per_s", "vs_ceiling",
         "vs_alternative", "rows_checked"],
    )  # fmt: skip
    for what in ("step", "model_step"):
        _common.print_table(
            [r for r in records if r.get("what") == what],
            ["what", "variant", "tokens", "ms_per_step", "vs_no_prefetch", "vs_hbm",
             "rows_checked"],
        )  # fmt: skip
    _common.finish_rows_checks(records)


if __name__ == "__main__":
    main()
