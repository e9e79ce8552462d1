"""Minimal programs of the asynchronous lookup for compute-sanitizer, one per name:
`python tools/sanitize_minimal.py NAME` runs it on the first GPU, checks the rows
against engram_jax.testing's reference and exits 1 on a mismatch. They narrow a
failure of a whole test file to its parts (`tools/sanitize.py --minimal` runs them
all under the tools); `no_library` (the scan), `no_library_loop` (a fori_loop of
test_prefetch.py's), `no_library_unique*` (jnp.unique, as a trainable table's
dedup start sorts its ids, alone and in a scan), `no_library_thread_copies`
(steps beside a thread's copies), `no_library_pool_growth` (test_cache.py's
allocations, then steps), `no_library_step` (test_training.py's step test),
`no_library_callback_step` (that with jax's side-effecting host callback in it) and
`no_library_ffi_step` and `no_library_ffi_step_sized` (that with a custom call of
the update's shape, and of its result size and operands too,
tools/initcheck_ffi_workspace.cu) are plain jnp and CUDA, the controls;
`trainable_dedup_start` and `trainable_recompiles` are a trainable table's starts,
whose compile hung under memcheck, `trainable_step` that step test alone and
`trainable_step_ffi` that with the workspace call in the update's place;
`cache_refresh_*` a hot-row cache refreshed while lookups run.
"""

from __future__ import annotations

import ctypes
import faulthandler
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import engram_jax as ej
from engram_jax import testing

CHUNKS = (12, 512, 24)  # chunks x tokens x ids, the pipelined scan's test shape
ROWS = 1 << 18


def nan_free_table(rng, rows: int, dim: int = 256):
    weight = rng.integers(0, 256, (rows, dim), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0  # no NaN encodings: equal rows compare equal
    scale = rng.integers(100, 150, (rows, dim // 32), dtype=np.uint8)
    return weight, scale


def start_and_done(table, ids):
    # The start's compiled function is kept until its rows are out: a handle that
    # outlives its executable reads NaN rows (lookup_start's rules).
    start = jax.jit(lambda i: ej.lookup_start(table, i))
    rows = jax.jit(ej.lookup_done)(start(ids))
    return np.asarray(rows)


def pipelined_scan(table, chunks):
    """The start of chunk k+1 in iteration k, its done in iteration k+1."""

    def body(handle, next_ids):
        rows = ej.lookup_done(handle)
        next_ids, rows = jax.lax.optimization_barrier((next_ids, rows))
        return ej.lookup_start(table, next_ids, tag="chunks"), rows

    def run(chunks):
        first = ej.lookup_start(table, chunks[0], tag="chunks")
        last, rows = jax.lax.scan(body, first, chunks[1:])
        return jnp.concatenate([rows, ej.lookup_done(last)[None]])

    return jax.jit(run)(chunks)


def scan_of_lookups(table, chunks):
    return jax.jit(lambda c: jax.lax.scan(lambda k, i: (k, ej.lookup(table, i)), 0, c)[1])(chunks)


PROGRAMS = {
    "start_done_pinned": ("pinned", 1 << 12, (64, 24), start_and_done),
    "start_done_device": ("device", 1 << 12, (64, 24), start_and_done),
    "scan_pinned": ("pinned", ROWS, CHUNKS, pipelined_scan),
    "scan_device": ("device", ROWS, CHUNKS, pipelined_scan),
    "scan_of_lookups": ("pinned", ROWS, CHUNKS, scan_of_lookups),
}


def arange_table(device) -> jax.Array:
    """The controls' table: ROWS distinct float32 rows of 256 values in HBM."""
    return jax.device_put(jnp.arange(ROWS * 256, dtype=jnp.float32).reshape(ROWS, 256), device)


def no_library(device) -> None:
    """The pipelined scan's shape with jnp.take from an HBM array: no engram_jax."""
    table = arange_table(device)
    chunks = jax.device_put(np.random.default_rng(0).integers(0, ROWS, CHUNKS), device)

    def body(previous, ids):
        ids, previous = jax.lax.optimization_barrier((ids, previous))
        return jnp.take(table, ids, axis=0), previous

    def run(chunks):
        last, rows = jax.lax.scan(body, jnp.take(table, chunks[0], axis=0), chunks[1:])
        return jnp.concatenate([rows, last[None]])

    got = np.asarray(jax.jit(run)(chunks))
    want = np.asarray(table)[np.asarray(chunks)]
    raise SystemExit(0 if np.array_equal(got, want) else 1)


def no_library_loop(device) -> None:
    """tests/test_prefetch.py's loop of ids made in the loop, jnp.take from an HBM
    array in place of the lookups: no engram_jax. The loop counter goes through
    optimization barriers as there."""
    table = arange_table(device)
    weight = jax.device_put(jnp.eye(1024, dtype=jnp.bfloat16), device)

    def make_ids(i, x):
        dep = (x[0, 0] > 1e30).astype(jnp.int32)  # never 1, but XLA cannot know
        return (
            jax.random.randint(jax.random.fold_in(jax.random.key(3), i), (4096, 24), 0, ROWS) + dep
        )

    def body(i, carry):
        x, mismatches = carry
        want = jnp.take(table, make_ids(i, x), axis=0)
        i, x, want = jax.lax.optimization_barrier((i, x, want))
        got = jnp.take(table, make_ids(i, x), axis=0)
        x, got = jax.lax.optimization_barrier((jnp.tanh(x @ weight), got))
        return x, mismatches + jnp.sum(got != want, dtype=jnp.int32)

    x = jax.device_put(jnp.ones((4096, 1024), jnp.bfloat16), device)
    _, mismatches = jax.jit(lambda x: jax.lax.fori_loop(0, 2, body, (x, jnp.int32(0))))(x)
    raise SystemExit(0 if int(mismatches) == 0 else 1)


def distinct(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The distinct ids, padded with -1, and each id's place among them: jnp.unique as a
    trainable table's dedup start calls it (engram_jax.training.distinct_ids)."""
    return jnp.unique(ids.reshape(-1), size=ids.size, fill_value=-1, return_inverse=True)


def distinct_equal(unique: np.ndarray, inverse: np.ndarray, host: np.ndarray) -> bool:
    want = np.unique(host.reshape(-1))
    rebuilt = unique[inverse.reshape(-1)].reshape(host.shape)
    return np.array_equal(unique[: want.size], want) and np.array_equal(rebuilt, host)


def no_library_unique(device) -> None:
    """The distinct ids and their inverse as a trainable table's dedup start makes them
    (jnp.unique: XLA's sort on the GPU), no engram_jax: the control of
    trainable_dedup_start."""
    host = np.random.default_rng(0).integers(-1, 5000, 512 * 24).astype(np.int32)
    unique, inverse = (np.asarray(x) for x in jax.jit(distinct)(jax.device_put(host, device)))
    raise SystemExit(0 if distinct_equal(unique, inverse, host) else 1)


def no_library_unique_small(device) -> None:
    """no_library_unique at test_training.py's step test's batch (64 x 12 ids, dead and
    past-the-end ones among them): XLA sorts it in one block and fuses the inverse's
    scatter base (zeros) into the reduction, then copies it. Under initcheck with
    command buffers on, that copy's source was reported uninitialised, 3,072 bytes,
    in test_gpu_step_lookup_update_lookup[bf16-pinned] (H100): this is its control."""
    host = np.random.default_rng(9).integers(-5, 310, (64, 12)).astype(np.int32)
    unique, inverse = (np.asarray(x) for x in jax.jit(distinct)(jax.device_put(host, device)))
    raise SystemExit(0 if distinct_equal(unique, inverse, host) else 1)


def no_library_unique_repeat(device) -> None:
    """no_library_unique_small run six times, on fresh ids each time, as the step test
    runs its step: with command buffers on, XLA records its graph at the first run and
    points the graph's nodes at each later run's buffers."""
    rng = np.random.default_rng(10)
    step = jax.jit(distinct)
    equal = True
    for _ in range(6):
        host = rng.integers(-5, 310, (64, 12)).astype(np.int32)
        unique, inverse = (np.asarray(x) for x in step(jax.device_put(host, device)))
        equal = equal and distinct_equal(unique, inverse, host)
    raise SystemExit(0 if equal else 1)


def no_library_unique_scan(device) -> None:
    """The distinct ids of each chunk in a scan (6 chunks of 64 x 8 ids), as
    test_training.py's scan-ahead test dedups its chunks: XLA fuses the chunk's slice
    at the loop counter into the reduction, which initcheck reported reading 4
    uninitialised bytes (command buffers off, H100): this is its control."""
    host = np.random.default_rng(12).integers(0, 4000, (6, 64, 8)).astype(np.int32)

    def run(chunks):
        return jax.lax.scan(lambda carry, c: (carry, distinct(c)), 0, chunks)[1]

    unique, inverse = (np.asarray(x) for x in jax.jit(run)(jax.device_put(host, device)))
    equal = all(distinct_equal(u, i, h) for u, i, h in zip(unique, inverse, host, strict=True))
    raise SystemExit(0 if equal else 1)


def refresh_profile(rows: int, seed: int) -> ej.HotRowProfile:
    """A third of the table's rows, at random, as the hot ones."""
    picked = np.random.default_rng(seed).permutation(rows)[: rows // 3]
    return ej.HotRowProfile(picked.astype(np.int32), np.arange(picked.size, 0, -1) + 10)


def cache_refresh(device, background: bool) -> None:
    """tests/test_cache.py's test_gpu_refresh_under_load at the sanitizer's scale: 20
    dedup lookups through a hot-row cache queued back to back, a refresh every 2, on
    the cache's worker thread (``background``) or on this one between the steps.
    Under initcheck that test's lookups read their ids, and CUB's sort its bins,
    uninitialised (H100, both command-buffer modes), reads of memory written by a
    device_put's copy and by CUB's memset, when it ran after
    test_gpu_long_runs_across_tiles in one process; alone it was clean, and so were
    both of these (H100)."""
    rows = 100_000
    rng = np.random.default_rng(22)
    weight, scale = nan_free_table(rng, rows)
    batches = [rng.integers(-1, rows, (1024, 24)).astype(np.int32) for _ in range(4)]
    want = [testing.lookup_reference(weight, scale, b).view(np.uint16) for b in batches]
    placement = "pinned" if device.platform == "gpu" else "cpu"  # the CPU: the tests' run
    with (
        ej.EngramTable.from_arrays(weight, scale, placement=placement, device=device) as table,
        ej.HotRowCache(
            table, rows * 280 / 3 / 2**30, refresh_profile(rows, 0), devices=[device]
        ) as hot,
    ):
        step = jax.jit(lambda i: ej.lookup(table, i, cache=hot, order="dedup"))
        on_device = [jax.device_put(b, device) for b in batches]
        outs, refreshes = [], []
        for k in range(20):
            outs.append(step(on_device[k % 4]))
            if k % 2 == 0:
                refreshes.append(hot.refresh(refresh_profile(rows, k), background=background))
        for refresh in refreshes:
            if refresh is not None:
                refresh.result(timeout=600)
        equal = all(
            np.array_equal(np.asarray(out).view(np.uint16), want[k % 4])
            for k, out in enumerate(outs)
        )
    raise SystemExit(0 if equal else 1)


def sorted_take(table: jax.Array):
    """A jitted step of XLA's sort of device_put ids then jnp.take of their rows: the
    refresh test's lookup with no engram_jax."""
    return jax.jit(lambda ids: jnp.take(table, jnp.sort(ids, axis=None), axis=0))


def sorted_take_equal(table: jax.Array, host: np.ndarray, got: list[np.ndarray]) -> bool:
    """Whether step k's rows (of sorted_take) are those of batch ``host[k % len(host)]``."""
    rows = np.asarray(table)
    return all(
        np.array_equal(g, rows[np.sort(host[k % len(host)], axis=None)]) for k, g in enumerate(got)
    )


def no_library_thread_copies(device) -> None:
    """cache_refresh's shape with no engram_jax: 20 jitted steps (XLA's sort of
    device_put ids, then jnp.take from an HBM array) queued back to back while a
    second thread copies pageable host memory into cudaMalloc memory on a stream of
    its own and waits for it, as a cache refresh's upload does. Clean under initcheck
    both ways (H100)."""
    from cuda.bindings import runtime as rt  # the storage module's binding, needed here only

    table = arange_table(device)
    host = np.random.default_rng(22).integers(0, ROWS, (4, 1024 * 24)).astype(np.int32)
    on_device = [jax.device_put(h, device) for h in host]
    step = sorted_take(table)
    payload = np.arange(1 << 20, dtype=np.int32)
    stop = threading.Event()
    failed: list[str] = []  # the copier's CUDA errors: a thread's exception stays in it

    def check(result: tuple, what: str):
        if result[0] != rt.cudaError_t.cudaSuccess:
            failed.append(f"{what}: {result[0]}")
            raise RuntimeError(failed[-1])
        return result[1] if len(result) > 1 else None

    def copy_loop() -> None:
        stream = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "stream")
        dst = check(rt.cudaMalloc(payload.nbytes), "cudaMalloc")
        while not stop.is_set():
            check(rt.cudaMemcpyAsync(dst, payload.ctypes.data, payload.nbytes,
                                     rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream),
                  "cudaMemcpyAsync")  # fmt: skip
            check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        check(rt.cudaFree(dst), "cudaFree")
        check(rt.cudaStreamDestroy(stream), "cudaStreamDestroy")

    copier = threading.Thread(target=copy_loop)
    copier.start()
    try:
        outs = [step(on_device[k % 4]) for k in range(20)]
        got = [np.asarray(out) for out in outs]
    finally:
        stop.set()
        copier.join()
    if failed:
        raise SystemExit(f"no_library_thread_copies: {failed[0]}")
    raise SystemExit(0 if sorted_take_equal(table, host, got) else 1)


def no_library_pool_growth(device) -> None:
    """test_cache.py's long-run tests then its refresh test with no engram_jax: three
    rounds of a 10 MB HBM table and about 20,000 device_put ids gathered six times
    (the long runs' orders with and without the cache), then 20 jitted steps of
    XLA's sort of device_put ids and jnp.take, as the refresh test's lookups. Under
    initcheck the refresh test read its device_put ids uninitialised only after all
    three long-run tests in one process (H100). This program does not reproduce it: 0
    reports under initcheck, command buffers on (H100)."""
    rng = np.random.default_rng(20)
    for _ in range(3):
        table = jax.device_put(rng.integers(0, 256, (40_000, 256), dtype=np.uint8), device)
        ids = rng.integers(0, 40_000, (20_300, 1)).astype(np.int32)
        on_device = jax.device_put(ids, device)
        gather = jax.jit(lambda t, i: jnp.take(t, i, axis=0).astype(jnp.bfloat16))
        rows = np.asarray(table)
        for _ in range(6):
            if not np.array_equal(np.asarray(gather(table, on_device)), rows[ids]):
                raise SystemExit(1)
        del table, on_device
    table = arange_table(device)
    host = rng.integers(0, ROWS, (4, 1024, 24)).astype(np.int32)
    on_device = [jax.device_put(h, device) for h in host]
    step = sorted_take(table)
    got = [np.asarray(step(on_device[k % 4])) for k in range(20)]
    raise SystemExit(0 if sorted_take_equal(table, host, got) else 1)


def sgd_table(weight: np.ndarray, device) -> ej.TrainableTable:
    """The trainable programs' table: ``weight`` pinned for a GPU, in CPU memory for the
    CPU (the tests' run)."""
    placement = "pinned" if device.platform == "gpu" else "cpu"
    return ej.TrainableTable.from_array(
        weight, optimizer=ej.sgd(), placement=placement, device=device
    )


def trainable_dedup_start(device) -> None:
    """A trainable table's lookup_start in dedup order and its done, the first program
    of test_gpu_dedup_lookup_and_prefetch_on_the_side_stream, which hung under
    memcheck inside XLA's compile of it (H100, two sittings)."""
    rng = np.random.default_rng(6)
    weight = rng.standard_normal((5000, 64)).astype(np.float32)
    host = rng.integers(-1, 5000, (512, 24)).astype(np.int32)
    with sgd_table(weight, device) as table:
        # The start's compiled function is kept until its rows are out, as above.
        start = jax.jit(lambda i: ej.lookup_start(table, i, order="dedup"))
        got = np.asarray(jax.jit(ej.lookup_done)(start(jax.device_put(host, device))))
    want = testing.trainable_lookup_reference(weight, host)
    raise SystemExit(0 if np.array_equal(got.view(np.uint32), want.view(np.uint32)) else 1)


def trainable_recompiles(device) -> None:
    """The first program of test_gpu_dedup_lookup_and_prefetch_on_the_side_stream
    (a start and a lookup of one trainable table, ids from one fusion) compiled six
    times, as the test compiles it (three orders, two grids), every compiled function
    kept, the rows checked after each. Under memcheck the probe this was made from
    hung in XLA's compile, at the first or second compile, in two processes of two
    (H100); with --xla_gpu_force_compilation_parallelism=1 all six compiled
    (tools/sanitize.py passes that flag now: give
    --xla-flags=--xla_gpu_force_compilation_parallelism=0 to see XLA's threaded
    compile)."""
    rng = np.random.default_rng(6)
    weight = rng.standard_normal((5000, 64)).astype(np.float32)
    host = rng.integers(-2, 5002, (3, 512, 24)).astype(np.int32)
    want = testing.trainable_lookup_reference(weight, host).view(np.uint32)
    kept, equal = [], True
    with sgd_table(weight, device) as table:
        for order in ("dedup", "sorted", "auto"):
            for max_ctas in (None, 132):

                def run(ids, o=order, m=max_ctas):
                    fused = jnp.where(ids < -1, ej.DEAD_ID, ids)  # a fusion, two consumers
                    handle = ej.lookup_start(table, fused[1:], order=o, max_ctas=m)
                    return ej.lookup(table, fused[:1], order=o), ej.lookup_done(handle)

                kept.append(jax.jit(run))
                at_once, done = (np.asarray(x) for x in kept[-1](jax.device_put(host, device)))
                equal &= np.array_equal(at_once.view(np.uint32), want[:1])
                equal &= np.array_equal(done.view(np.uint32), want[1:])
                print(f"trainable_recompiles: {order} {max_ctas} compiled and ran", flush=True)
    raise SystemExit(0 if equal else 1)


def held_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table``'s rows at ``ids``, zeros for ids it does not hold: a trainable lookup."""
    held = (ids >= 0) & (ids < table.shape[0])
    rows = table[jnp.clip(ids, 0, table.shape[0] - 1)]
    return jnp.where(held[..., None], rows, jnp.zeros((), table.dtype))


STEP_SHAPE = (64, 12)  # test_training.py's step test: 768 ids, 3,072 bytes as int32
STEP_IDS = STEP_SHAPE[0] * STEP_SHAPE[1]
STEP_DIM = 40  # its table's values a row


def step_inputs(device) -> tuple[np.ndarray, np.ndarray, jax.Array]:
    """test_gpu_step_lookup_update_lookup's bf16 table (300 rows of 40) and ids (dead
    and past-the-end ones among them)."""
    rng = np.random.default_rng(9)
    weight = rng.standard_normal((300, STEP_DIM)).astype(jnp.bfloat16)
    host = rng.integers(-5, 310, STEP_SHAPE).astype(np.int32)
    return weight, host, jax.device_put(host, device)


def sgd_by_scatter(table: jax.Array, ids: jax.Array, grads: jax.Array, lr) -> jax.Array:
    """``table`` after an SGD step of ``grads`` at ``ids``, duplicates summed and ids it
    does not hold dropped, in plain jnp (a scatter-add)."""
    held = (ids >= 0) & (ids < table.shape[0])
    flat = jnp.where(held, ids, table.shape[0]).reshape(-1)
    summed = jnp.zeros((table.shape[0] + 1, table.shape[1]), jnp.float32)
    summed = summed.at[flat].add(grads.reshape(flat.size, -1).astype(jnp.float32))
    return (table.astype(jnp.float32) - lr * summed[:-1]).astype(table.dtype)


def step_rows_equal(weight, host, before, after, done) -> bool:
    """Whether a plain-jnp step's first lookup read ``weight``'s rows and its dedup
    lookup after the update gave the plain lookup's rows, bit for bit."""
    want = testing.trainable_lookup_reference(weight, host)
    equal = np.array_equal(before.view(np.uint16), want.view(np.uint16))
    return equal and np.array_equal(after.view(np.uint16), done.view(np.uint16))


def plain_step(side_call=None):
    """trainable_step's program in plain jnp, the table an HBM array: the lookup, the
    gradient of a sum of squares, an SGD update by scatter-add, a dedup lookup of the new
    rows (jnp.unique, each row taken once and copied back to every position) and a
    plain one. ``side_call(ids, grads, lr, rows)``, if given, runs after the gradients
    and gives a token the dedup lookup is ordered after (an optimization_barrier, as
    ``after=`` orders one), where trainable_step has the library's update."""

    @jax.jit
    def step(table, ids, lr):
        rows = held_rows(table, ids)
        grads = jax.grad(lambda r: jnp.sum(r.astype(jnp.float32) ** 2))(rows)
        token = None if side_call is None else side_call(ids, grads, lr, rows)
        new = sgd_by_scatter(table, ids, grads, lr)
        after_ids = ids if token is None else jax.lax.optimization_barrier((ids, [token]))[0]
        unique, inverse = distinct(after_ids)
        done = held_rows(new, unique)[inverse].reshape(rows.shape)
        return rows, held_rows(new, ids), done

    return step


def run_plain_step(device, side_call=None) -> bool:
    """plain_step on test_training.py's step test's inputs; whether its rows are right."""
    weight, host, ids = step_inputs(device)
    step = plain_step(side_call)
    before, after, done = (np.asarray(x) for x in step(jax.device_put(weight, device), ids, 0.1))
    return step_rows_equal(weight, host, before, after, done)


def no_library_step(device) -> None:
    """plain_step alone. initcheck with command buffers on reported a 3,072-byte copy in
    XLA's graph launch 96 times in trainable_step's test's bf16 cases, with custom calls
    out of the graphs too (--xla_gpu_enable_command_buffer=FUSION); this is its control."""
    raise SystemExit(0 if run_plain_step(device) else 1)


def no_library_callback_step(device) -> None:
    """plain_step with a side-effecting custom call in it, as the library's update is
    one, but jax's own: an ``io_callback`` (XLA's host-callback custom call) takes the
    ids and gradients and returns a zero token. Without the update call the trainable
    step gave initcheck no reports (command buffers on); with it, 96. This program gave
    0 in both modes (H100), where trainable_step gave its 96: a side-effecting custom
    call alone does not bring them on."""
    calls = []

    def host_update(ids, grads):
        calls.append(int(np.asarray(ids).size) + int(np.asarray(grads).size))
        return np.int32(0)

    def side_call(ids, grads, *_):
        return io_callback(host_update, jax.ShapeDtypeStruct((), jnp.int32), ids, grads)

    equal = run_plain_step(device, side_call)
    equal &= calls == [STEP_IDS * (1 + STEP_DIM)]
    raise SystemExit(0 if equal else 1)


WORKSPACE_SOURCE = Path(__file__).with_name("initcheck_ffi_workspace.cu")
WORKSPACE_TARGET = "initcheck_workspace_call"


def register_workspace_call() -> None:
    """tools/initcheck_ffi_workspace.cu built with nvcc (as its header says) and its
    handler registered as WORKSPACE_TARGET for CUDA."""
    library = Path(tempfile.mkdtemp(prefix="initcheck-ffi-")) / "libinitcheck_ffi_workspace.so"
    command = ["nvcc", "-O2", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90",
               f"-I{jax.ffi.include_dir()}", "-o", str(library), str(WORKSPACE_SOURCE)]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    handler = ctypes.cdll.LoadLibrary(str(library)).WorkspaceCall
    jax.ffi.register_ffi_target(WORKSPACE_TARGET, jax.ffi.pycapsule(handler), platform="CUDA")


# engram_jax's UpdateResultBytes(STEP_IDS, STEP_DIM) (ffi/kernels/train_rows.h): the
# update's one result in trainable_step, the token and then its sort's buffers and the
# sums of hot rows' chunks. Spelled here, not asked of engram_jax, so that the controls
# load none of it; tests/test_sanitize_tool.py checks it against the library.
UPDATE_RESULT_BYTES = 148_752


def workspace_call(result_bytes: int, update_operands: bool):
    """A side_call for plain_step: the custom call of tools/initcheck_ffi_workspace.cu
    with ``result_bytes`` of result, its token bitcast to an int32 as the update's is.
    ``update_operands``: it takes the update's operands too (the learning rate, and the
    rows its ``after=`` orders it behind), which it does not read."""
    register_workspace_call()
    call = jax.ffi.ffi_call(
        WORKSPACE_TARGET, jax.ShapeDtypeStruct((result_bytes,), jnp.uint8), has_side_effect=True
    )

    def side_call(ids, grads, lr, rows):
        more = (jnp.asarray(lr, jnp.float32), rows) if update_operands else ()
        result = call(ids.reshape(-1), grads.reshape(-1, grads.shape[-1]), *more)
        return jax.lax.bitcast_convert_type(result[:4], jnp.int32)

    return side_call


def no_library_ffi_step(device) -> None:
    """plain_step with a custom call of the library's update's shape in it, built from
    tools/initcheck_ffi_workspace.cu (no engram_jax): not command-buffer compatible,
    side-effecting, one uint8 result whose 4-byte token its kernel zeroes and whose
    workspace it writes only in part, the token bitcast to an int32 as the update's is.
    Whether such a call, where jax's io_callback did not, brings on trainable_step's 96
    initcheck reports with command buffers on: it did not (0 both ways, H100), with a
    result of 6,148 bytes and the ids and gradients its only operands. A GPU program:
    the call has no CPU handler."""
    side_call = workspace_call(4 + 8 * STEP_IDS, update_operands=False)
    raise SystemExit(0 if run_plain_step(device, side_call) else 1)


def no_library_ffi_step_sized(device) -> None:
    """no_library_ffi_step with the update's own result size (UPDATE_RESULT_BYTES, 24
    times the first control's) and operands (the learning rate and the rows as well):
    XLA assigns and reuses buffers by their sizes and lives, so this is the update's
    call as XLA's buffer assignment sees it, with no engram_jax. Under initcheck with
    command buffers on it gives trainable_step's 96 reports (the 3,072-byte copy source
    in XLA's graph launch), 0 with them off (H100): the reports need no engram_jax.
    XLA's dump places jnp.unique's zeros, the copy's source, inside the bytes the call's
    result took, which its kernel never wrote; the graph's fusion writes them before the
    copy node reads them, and the rows come out right."""
    side_call = workspace_call(UPDATE_RESULT_BYTES, update_operands=True)
    raise SystemExit(0 if run_plain_step(device, side_call) else 1)


def trainable_step(device) -> None:
    """tests/test_training.py's test_gpu_step_lookup_update_lookup[bf16-pinned] alone:
    a trainable table's lookup, row_adagrad update, a dedup start and done after it and
    a lookup after it, in one jitted step, the rows checked against the references."""
    weight, host, ids = step_inputs(device)
    placement = "pinned" if device.platform == "gpu" else "cpu"
    with ej.TrainableTable.from_array(
        weight, optimizer=ej.row_adagrad(), placement=placement, device=device
    ) as table:

        @jax.jit
        def step(ids, lr):
            rows = ej.lookup(table, ids)
            grads = jax.grad(lambda r: jnp.sum(r.astype(jnp.float32) ** 2))(rows)
            update = ej.apply_gradients(table, ids, grads, lr, after=rows)
            done = ej.lookup_done(ej.lookup_start(table, ids, after=update))
            return rows, ej.lookup(table, ids, after=update), done

        before, after, done = (np.asarray(x) for x in step(ids, jnp.float32(0.1)))
    num_rows = len(weight)
    grads = (2 * weight[np.clip(host, 0, num_rows - 1)].astype(np.float32)).astype(weight.dtype)
    grads[(host < 0) | (host >= num_rows)] = 0
    expected, _ = testing.row_adagrad_reference(
        weight, np.zeros(num_rows, np.float32), host, grads, 0.1
    )
    equal = np.array_equal(before, testing.trainable_lookup_reference(weight, host))
    equal &= np.array_equal(after, testing.trainable_lookup_reference(expected, host))
    equal &= np.array_equal(done, after)
    raise SystemExit(0 if equal else 1)


def trainable_step_ffi(device) -> None:
    """trainable_step with no update: the workspace call of no_library_ffi_step_sized
    where the library's update is, the dedup start and the last lookup ordered after its
    token, so every lookup reads the table as it was. The library's lookups with a
    custom call that writes no table: whether the update's own work is needed for the
    reports. It is not: 96 with command buffers on, 0 off (H100), as trainable_step."""
    weight, host, ids = step_inputs(device)
    side_call = workspace_call(UPDATE_RESULT_BYTES, update_operands=True)
    with ej.TrainableTable.from_array(
        weight, optimizer=ej.row_adagrad(), placement="pinned", device=device
    ) as table:

        @jax.jit
        def step(ids, lr):
            rows = ej.lookup(table, ids)
            grads = jax.grad(lambda r: jnp.sum(r.astype(jnp.float32) ** 2))(rows)
            token = side_call(ids, grads, lr, rows)
            done = ej.lookup_done(ej.lookup_start(table, ids, after=token))
            return rows, ej.lookup(table, ids, after=token), done

        rows = [np.asarray(x) for x in step(ids, jnp.float32(0.1))]
    want = testing.trainable_lookup_reference(weight, host)
    raise SystemExit(0 if all(np.array_equal(r, want) for r in rows) else 1)


# Programs that check their rows and exit themselves: the controls (no_library*: no
# engram_jax), the cache's refreshes and a trainable table's starts.
SELF_CHECKED = {"no_library": no_library, "no_library_loop": no_library_loop,
                "no_library_unique": no_library_unique,
                "no_library_unique_small": no_library_unique_small,
                "no_library_unique_repeat": no_library_unique_repeat,
                "no_library_unique_scan": no_library_unique_scan,
                "no_library_thread_copies": no_library_thread_copies,
                "no_library_pool_growth": no_library_pool_growth,
                "cache_refresh_background": lambda d: cache_refresh(d, background=True),
                "cache_refresh_inline": lambda d: cache_refresh(d, background=False),
                "trainable_dedup_start": trainable_dedup_start,
                "trainable_recompiles": trainable_recompiles,
                "no_library_step": no_library_step,
                "no_library_callback_step": no_library_callback_step,
                "no_library_ffi_step": no_library_ffi_step,
                "no_library_ffi_step_sized": no_library_ffi_step_sized,
                "trainable_step": trainable_step,
                "trainable_step_ffi": trainable_step_ffi}  # fmt: skip
NAMES = (*PROGRAMS, *SELF_CHECKED)


def main(name: str) -> int:
    faulthandler.enable()  # a crash of the process, not of the tool, prints its stack
    device = jax.devices("gpu")[0]
    if name in SELF_CHECKED:
        SELF_CHECKED[name](device)
    placement, rows, shape, program = PROGRAMS[name]
    rng = np.random.default_rng(17)
    weight, scale = nan_free_table(rng, rows)
    with ej.EngramTable.from_arrays(weight, scale, placement=placement, device=device) as table:
        ids = jax.device_put(rng.integers(0, rows, shape).astype(np.int32), device)
        got = np.asarray(program(table, ids)).view(np.uint16)
    want = np.asarray(testing.lookup_reference(weight, scale, np.asarray(ids))).view(np.uint16)
    equal = np.array_equal(got, want)
    print(f"{name}: rows {'equal' if equal else 'DIFFER'}", flush=True)
    return 0 if equal else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--names"]:  # for tools/sanitize.py --minimal
        print(" ".join(NAMES))
        sys.exit(0)
    if len(sys.argv) != 2 or sys.argv[1] not in NAMES:
        raise SystemExit(f"usage: sanitize_minimal.py {{{','.join(NAMES)}}}")
    sys.exit(main(sys.argv[1]))
