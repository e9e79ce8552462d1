"""Step time of the sharded lookup on every GPU of one host: EDP head sharding
with the all-to-all row exchange vs the all-gather + select exchange vs the
all-to-all of packed records vs one node-shared host table vs a full host copy
per GPU, beside rawgather on one GPU and on all GPUs at once (how the host link
scales with GPUs).

One process drives every local GPU: a (dp=1, edp=N, tp=1) mesh of the N GPUs,
512 and 4,096 tokens per replica, 24 hash columns of 256-dim rows, a table of
--table-gib GiB per node (DeepSeek-V4.1-Flash layer-sized at 64). Variants:

- ``edp_all_to_all`` / ``edp_all_gather_select`` / ``edp_all_to_all_packed``:
  GPU i holds head shard i (1/N of the columns; --table-gib in all); ids
  all-gathered over EDP, each GPU reads its heads for every replica's tokens,
  rows sent back by the exchange (packed: fp8 records, decoded after it).
- ``shared_table``: every GPU reads one host table (on GPU 0's NUMA node).
- ``full_copy_per_gpu``: GPU i reads its own full copy (on its own node):
  a plain lookup of its replica's ids. N copies must fit --host-budget-gib;
  if not, the copies (and the shared table, which is copy 0) are made smaller
  and the records say the size used.
- ``rawgather_one_gpu`` / ``rawgather_all_gpus``: benchmarks/reference/rawgather.cu
  alone on GPU 0, then one process per GPU at once (CUDA_VISIBLE_DEVICES=i, same
  footprint each), tokens x 24 rows per call; only measurements made while
  every process was gathering count (the footprint is passed several times so
  that each process gathers for some seconds after all have filled their tables).

Every GPU reads tokens x 24 rows per step in every variant. Fresh random ids
every step (drawn on the device from the step index, each waiting for the
previous step's rows); a jitted fori_loop of --steps steps, --repeats times;
the median ms per step is reported.

Rows checked: every table holds fill_distinct's rows (a function of the global
row id, so head shards agree with full copies). Before timing, each variant's
rows of random ids (DEAD ones among them) are compared bit for bit with the
numpy reference; every timed loop also returns, per replica, a checksum of each
step's rows, compared after timing with an untimed loop over the same ids that
computes the rows from the fill's definition on the device (reading no table).
A mismatch fails the run.

Host memory: tables are allocated by --placement (default auto: numa on the
GPU's node where cuMem host-NUMA works, else huge pages/pinned), falling back
to pinned, and halved if neither fits. The 2-GPU H200 machine's MemTotal reads
low until memory is touched (a VM that grows), so the budget is a flag.

NCCL's NVLink multicast stays off: this script sets NCCL_NVLS_ENABLE=0 for
itself and every process it starts, whatever the caller's environment says.

Run on a machine with 2+ GPUs (after ``pip install --no-build-isolation -e .``):
    python benchmarks/sharded.py            # 64 GiB -> benchmarks/results/sharded.json
    python benchmarks/sharded.py --quick    # 8 GiB  -> sharded_quick.json
    python benchmarks/sharded.py --smoke    # CPU backend, 4 virtual devices, no GPU
Runtime budget on 2 H200s (--quick measured: 31 s after the build; the rest is
estimated): host memory fills at about 3 s per 8 GiB while the VM grows it,
0.3-0.4 s/GiB once grown; compiles
take 1-2 s each (3 per variant); nvcc builds rawgather (30-60 s) meanwhile.
    default (64 GiB, 32 steps x 5, 512 and 4,096 tokens):
      jax start 10 s + EDP shards 64 GiB 30-50 s + EDP timing 15-20 s
      + 2 full copies 128 GiB 40-60 s + shared/copies timing 15-20 s
      + rawgather 4 runs (one GPU, all GPUs; 2 token counts; 64 GiB each,
        6 s of gathering) 90-120 s  =  about 4-5 min, under 6.
    --quick (8 GiB, 16 steps x 3, rawgather at 4,096 tokens only, 3 s):
      jax start 10 s + tables 8 + 16 GiB 10-15 s + timing 25-35 s
      + rawgather 2 runs 15-20 s  =  about 65-80 s; stages starting after
      140 s (--deadline-s) are skipped, so it ends within 2.5 min.
    --smoke: about 12 s on 2 CPU cores.
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
SMOKE_DEVICES = 4
# NVLink multicast (NVLS) can take a shared host's GPUs out of service: never on.
os.environ["NCCL_NVLS_ENABLE"] = "0"
# Tables and caches are allocated beside XLA's pool: XLA must not take 75 % up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if SMOKE:  # virtual CPU devices, set before jax is imported
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={SMOKE_DEVICES}"
    ).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import textwrap  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import engram_jax as ej  # noqa: E402
from engram_jax import checkpoint, testing  # noqa: E402

try:
    from benchmarks import _common
except ImportError:  # run as a script
    import _common

DIM = 256
N_COLS = 24  # DeepSeek-V4.1: orders 2-4 x 8 heads
STRIDE = ej.row_stride(DIM)  # 272 bytes
EDP_VARIANTS = ("edp_all_to_all", "edp_all_gather_select", "edp_all_to_all_packed")
COPY_VARIANTS = ("shared_table", "full_copy_per_gpu")
VARIANTS = EDP_VARIANTS + COPY_VARIANTS
CHECK_TOKENS = 64
COLLECTIVE = re.compile(r"\b(all-to-all|all-gather|all-reduce|collective-permute)(?:-start)?\(")

T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {message}", flush=True)


# -- layer, tables -------------------------------------------------------------------


def layer_sizes(table_gib: float) -> tuple[int, ...]:
    """Rows per hash column of a layer of about ``table_gib`` GiB (ids are int32)."""
    rows = min(int(table_gib * 2**30) // STRIDE, 2**31 - N_COLS)
    base, extra = divmod(rows, N_COLS)
    return tuple(base + (c < extra) for c in range(N_COLS))


def offsets_of(sizes) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def place_table(num_rows: int, row_start: int, device, placements: list[str]) -> ej.EngramTable:
    """An allocated table of fill_distinct's rows, by the first placement that works."""
    errors = []
    for placement in placements:
        try:
            table = ej.EngramTable.allocate(
                max(1, num_rows), DIM, placement=placement, row_start=row_start, device=device
            )
        except Exception as exc:  # MemoryError, CUDA errors: try the next placement
            errors.append(f"{placement}: {type(exc).__name__}: {exc}")
            log(f"  {placement} failed for {num_rows * STRIDE / 2**30:.2f} GiB: {errors[-1]}")
            continue
        try:
            seconds = checkpoint.fill_distinct(table)
        except BaseException:
            table.close()
            raise
        table.allocation.info["fill_s"] = seconds
        return table
    raise MemoryError("no placement worked: " + "; ".join(errors))


def make_tables(specs, placements: list[str]) -> list[ej.EngramTable]:
    """One table per ``(num_rows, row_start, device)``; all or none (closed on failure)."""
    made: list[ej.EngramTable] = []
    try:
        for num_rows, row_start, device in specs:
            start = time.perf_counter()
            table = place_table(num_rows, row_start, device, placements)
            made.append(table)
            info = table.allocation.info
            log(
                f"  table rows [{row_start:,}, {row_start + num_rows:,}) for {device}: "
                f"{table.nbytes / 2**30:.2f} GiB {table.placement}"
                + (f" node {info['numa_node']}" if "numa_node" in info else "")
                + f", {time.perf_counter() - start:.1f} s (fill {info['fill_s']:.1f} s)"
            )
        return made
    except BaseException:
        for table in made:
            table.close()
        raise


def shrinking(make, gib: float, what: str, floor_gib: float):
    """``make(gib)``, halving ``gib`` after a MemoryError until ``floor_gib``."""
    while True:
        try:
            return make(gib), gib
        except MemoryError as exc:
            if gib / 2 < floor_gib:
                raise
            log(f"{what}: {gib:g} GiB did not fit ({exc}); trying {gib / 2:g} GiB")
            gib /= 2


def table_summary(tables: list[ej.EngramTable]) -> dict:
    return {
        "placements": sorted({t.placement for t in tables}),
        "numa_nodes": sorted({t.allocation.info.get("numa_node", -1) for t in tables}),
        "host_gib": sum(t.nbytes for t in tables) / 2**30,
        "fill_s": sum(t.allocation.info.get("fill_s", 0.0) for t in tables),
    }


# -- the timed loop -------------------------------------------------------------------


def make_loop(table, mesh, plan: ej.ShardPlan, tokens: int, steps: int, rows_of=None):
    """jit(seed) -> uint32 ``[replicas, steps]``: per replica, a checksum of each step's
    rows, after ``steps`` sharded lookups of fresh ids. ``rows_of(ids)`` in place of
    the lookup makes the reference loop: the same ids, the rows computed instead."""
    sizes = np.asarray(plan.sizes, np.int32)
    offsets = offsets_of(plan.sizes).astype(np.int32)
    data_axes = tuple(name for name in mesh.axis_names if name != plan.tp_axis)
    if rows_of is None:
        rows_of = lambda ids: ej.lookup(table, ids, plan=plan)  # noqa: E731

    def body(seed):
        key = jax.random.fold_in(jax.random.key(seed), jax.lax.axis_index(data_axes))

        def step(i, sums):
            k = jax.random.fold_in(key, i)
            ids = jax.random.randint(k, (tokens, N_COLS), 0, sizes, jnp.int32) + offsets
            # Never true for right rows, but XLA cannot know: step i's ids wait for step i-1's.
            ids = ids + ((i > 0) & (sums[jnp.maximum(i - 1, 0)] == 0)).astype(jnp.int32)
            return sums.at[i].set(_common.rows_checksum(rows_of(ids)))

        return jax.lax.fori_loop(0, steps, step, jnp.zeros(steps, jnp.uint32))[None]

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(data_axes), check_vma=False)
    return jax.jit(mapped)


def reference_loop(mesh, plan: ej.ShardPlan, tokens: int, steps: int):
    """make_loop's reference: the rows from fill_distinct's definition, on the device."""
    rows_of = lambda ids: _common.expected_rows(ids, DIM, row_stop=sum(plan.sizes))  # noqa: E731
    return make_loop(None, mesh, plan, tokens, steps, rows_of=rows_of)


def time_loop(loop, steps: int, repeats: int, seed: int) -> tuple[list[float], str, np.ndarray]:
    """Milliseconds per step of each repeat (a new seed each: fresh ids), the HLO, and
    the repeats' row checksums ``[repeats, replicas, steps]``."""
    compiled = loop.lower(np.int32(seed)).compile()
    jax.block_until_ready(compiled(np.int32(seed)))  # warm up: NCCL setup, first touches
    per_step, sums = [], []
    for r in range(repeats):
        start = time.perf_counter()
        sums.append(jax.block_until_ready(compiled(np.int32(seed + 1 + r))))
        per_step.append((time.perf_counter() - start) * 1e3 / steps)
    return per_step, compiled.as_text(), np.stack([np.asarray(s) for s in sums])


def loop_sums(loop, repeats: int, seed: int) -> np.ndarray:
    """An untimed loop's checksums for time_loop's seeds."""
    return np.stack([np.asarray(loop(np.int32(seed + 1 + r))) for r in range(repeats)])


def check_rows(table, mesh, plan: ej.ShardPlan, replicas: int) -> bool:
    """The variant's rows of random ids, 10 % of them DEAD, equal the numpy reference."""
    rng = np.random.default_rng(plan.edp + len(plan.exchange))
    ids = rng.integers(0, plan.sizes, (replicas * CHECK_TOKENS, N_COLS)) + offsets_of(plan.sizes)
    ids[rng.random(ids.shape) < 0.1] = ej.DEAD_ID
    expected = testing.dequantize(*checkpoint.distinct_bytes(ids, DIM))
    expected[ids == ej.DEAD_ID] = 0
    out = np.asarray(ej.make_sharded_lookup(table, mesh, plan)(ids.astype(np.int32)))
    return bool(np.array_equal(out.view(np.uint16), expected.view(np.uint16)))


def measure(variant, table, mesh, plan, args, extra: dict) -> list[dict]:
    """Records of one variant, one per token count; a failure becomes an error record."""
    try:
        return _measure(variant, table(), mesh, plan, args, extra)
    except Exception as exc:  # keep the other variants' figures
        log(f"{variant} failed: {traceback.format_exc()}")
        return [
            {"variant": variant, "gpus": mesh.size, "tokens": t, "error": repr(exc)}
            for t in args.tokens
        ]


def _measure(variant, table, mesh, plan, args, extra: dict) -> list[dict]:
    n = mesh.size
    ok = check_rows(table, mesh, plan, n)
    log(f"{variant}: rows {'match' if ok else 'DO NOT MATCH'} the numpy reference")
    out = []
    for tokens in args.tokens:
        if past_deadline(args):
            log(f"{variant} {tokens} tokens: skipped (deadline)")
            out.append({"variant": variant, "gpus": n, "tokens": tokens, "skipped": "deadline"})
            continue
        loop = make_loop(table, mesh, plan, tokens, args.steps)
        times, hlo, sums = time_loop(loop, args.steps, args.repeats, seed=tokens)
        expected = loop_sums(reference_loop(mesh, plan, tokens, args.steps), args.repeats, tokens)
        ms = statistics.median(times)
        rows = tokens * N_COLS
        collectives: dict[str, int] = {}
        for name in COLLECTIVE.findall(hlo):
            collectives[name] = collectives.get(name, 0) + 1
        record = {
            "variant": variant,
            "gpus": n,
            "tokens": tokens,
            "step_ms": ms,
            "step_ms_min": min(times),
            "step_ms_max": max(times),
            "step_ms_repeats": times,
            "steps_per_repeat": args.steps,
            "rows_per_gpu_per_step": rows,
            "mrows_per_s_per_gpu": rows / ms / 1e3,
            "rows_match_reference": ok,
            **_common.rows_check(
                sums,
                expected,
                "uint32 checksum of each replica's rows of every timed step, vs an untimed "
                "loop over the same ids computing the rows from the fill's definition "
                "(checkpoint.distinct_bytes, decoded on the device)",
            ),
            "mode": plan.mode,
            "exchange": plan.exchange if plan.exchanges_rows else None,
            "edp": plan.edp,
            "hlo_collectives": collectives,
            "engram_calls_in_hlo": hlo.count('custom_call_target="engram_'),
            **extra,
        }
        out.append(record)
        log(
            f"{variant:22s} {tokens:5d} tokens  {ms:8.3f} ms/step  "
            f"{record['mrows_per_s_per_gpu']:7.1f} M rows/s per GPU  {collectives}"
        )
    return out


# -- rawgather, one process per GPU ------------------------------------------------

STAND_IN = textwrap.dedent(
    """
    # A stand-in for rawgather on machines without a GPU (--smoke): same output lines.
    import json, os, sys, time
    rows = int(os.environ.get("RAWGATHER_ROWS", "2097152"))
    time.sleep(0.05)
    print(json.dumps({"what": "h2d_memcpy", "bytes": 1 << 30, "gb_per_s": 0.0}), flush=True)
    for gib in sys.argv[1:]:
        for name in ("packed", "split", "packed_sorted"):
            time.sleep(0.02)
            ms = 0.02 * 1e3
            print(json.dumps({"what": "gather_" + name, "footprint_gib": int(gib), "rows": rows,
                              "row_stride": 272, "ms": ms, "mrows_per_s": rows / (ms * 1e3),
                              "sort_ms": 0.0, "mrows_per_s_with_sort": rows / (ms * 1e3)}),
                  flush=True)
    """
)


def stand_in_rawgather() -> Path:
    path = Path(tempfile.mkdtemp(prefix="rawgather-stand-in-")) / "rawgather"
    path.write_text(f"#!{sys.executable}\n{STAND_IN}")
    path.chmod(0o755)
    return path


def rawgather_passes(rows: int, target_s: float) -> int:
    """How often to repeat the footprint so one process gathers for about ``target_s``:
    3 layouts x (runs + 1) calls per pass at roughly 30 M rows/s plus 0.1 ms a call."""
    runs = 5 if rows >= 1 << 20 else 21
    pass_s = 3 * (runs + 1) * (rows / 30e6 + 1e-4)
    return max(3, min(200, math.ceil(target_s / pass_s)))


def run_concurrently(
    exe: Path, gpus: list[int], footprint: int, rows: int, passes: int, timeout_s: float
) -> list[dict]:
    """rawgather on each of ``gpus`` at once; per process its timed output lines and status."""
    stdbuf = shutil.which("stdbuf")  # line-buffered output: each line's time is its phase's end
    procs, traces = [], []
    for gpu in gpus:
        env = dict(
            os.environ,
            CUDA_VISIBLE_DEVICES=str(gpu),
            RAWGATHER_ROWS=str(rows),
            NCCL_NVLS_ENABLE="0",
        )
        cmd = [str(exe)] + [str(footprint)] * passes
        if stdbuf:
            cmd = [stdbuf, "-oL", *cmd]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
        traces.append([])

    def read(proc, trace):
        for line in proc.stdout:
            if line.startswith("{"):
                trace.append((time.monotonic(), json.loads(line)))

    readers = [
        threading.Thread(target=read, args=(p, t), daemon=True)
        for p, t in zip(procs, traces, strict=True)
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout_s
    results = []
    for gpu, proc, reader, trace in zip(gpus, procs, readers, traces, strict=True):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(10)
        results.append(
            {
                "gpu": gpu,
                "returncode": proc.returncode,
                "stderr": proc.stderr.read()[-2000:],
                "trace": trace,
            }
        )
    return results


def concurrent_phases(results: list[dict]) -> tuple[list[list[dict]], dict]:
    """Each process's gather phases that ran while every process was gathering, and
    the window's length and how far apart the processes began gathering.

    A phase runs from the line before it to its own line. All are gathering from
    the latest end of a first gather phase (every table is filled by then) to the
    earliest last line; a process's first gather phase is never counted (its
    start is the table fill's end, which buffered output may not show).
    """
    gathers = [
        [(t, r) for t, r in res["trace"] if r["what"].startswith("gather_")] for res in results
    ]
    if not all(gathers):
        return [[] for _ in results], {}
    firsts = [g[0][0] for g in gathers]
    start, end = max(firsts), min(g[-1][0] for g in gathers)
    phases = []
    for g in gathers:
        phases.append(
            [
                record
                for (t_prev, _), (t, record) in zip(g[:-1], g[1:], strict=True)
                if t_prev >= start and t <= end
            ]
        )
    return phases, {"window_s": max(0.0, end - start), "start_skew_s": start - min(firsts)}


def rawgather_record(variant, results, tokens, footprint, passes) -> dict:
    phases, window = concurrent_phases(results)
    record = {
        "variant": variant,
        "gpus": len(results),
        "tokens": tokens,
        "rows_per_gpu_per_step": tokens * N_COLS,
        "footprint_gib": footprint,
        "passes": passes,
        **window,
        "each_gpu": [],
    }
    for res, mine in zip(results, phases, strict=True):
        entry = {"gpu": res["gpu"], "returncode": res["returncode"]}
        for layout in ("packed", "packed_sorted"):
            counted = [r for r in mine if r["what"] == f"gather_{layout}"]
            entry[f"{layout}_phases_counted"] = len(counted)
            if counted:
                entry[f"{layout}_ms"] = statistics.median(r["ms"] for r in counted)
                entry[f"{layout}_mrows_per_s"] = statistics.median(
                    r["mrows_per_s"] for r in counted
                )
        h2d = [r for _, r in res["trace"] if r["what"] == "h2d_memcpy"]
        entry["h2d_gb_per_s"] = h2d[0]["gb_per_s"] if h2d else None
        if res["returncode"] != 0:
            entry["stderr"] = res["stderr"]
        record["each_gpu"].append(entry)
    rates = [e["packed_mrows_per_s"] for e in record["each_gpu"] if "packed_mrows_per_s" in e]
    times = [e["packed_ms"] for e in record["each_gpu"] if "packed_ms" in e]
    if len(rates) == len(results):
        record["step_ms"] = statistics.median(times)
        record["mrows_per_s_per_gpu"] = statistics.median(rates)
        record["mrows_per_s_all_gpus"] = sum(rates)
        sorted_rates = [e.get("packed_sorted_mrows_per_s") for e in record["each_gpu"]]
        if all(r is not None for r in sorted_rates):
            record["packed_sorted_mrows_per_s_per_gpu"] = statistics.median(sorted_rates)
    else:
        record["error"] = "a process failed or no phase ran while all were gathering"
    return record


def run_rawgather(exe, n_gpus: int, args, budget_gib: float, records: list, save) -> None:
    """rawgather alone on GPU 0 and on all GPUs at once, per token count, into ``records``."""
    footprint = max(1, min(int(args.table_gib), int(budget_gib // n_gpus)))
    for tokens in args.rawgather_tokens:
        rows = tokens * N_COLS
        passes = rawgather_passes(rows, args.rawgather_seconds)
        for variant, gpus in (
            ("rawgather_one_gpu", [0]),
            ("rawgather_all_gpus", list(range(n_gpus))),
        ):
            if past_deadline(args):
                records.append(
                    {"variant": variant, "gpus": len(gpus), "tokens": tokens, "skipped": "deadline"}
                )
                log(f"{variant} {tokens} tokens: skipped (deadline)")
                continue
            results = run_concurrently(exe, gpus, footprint, rows, passes, args.rawgather_timeout_s)
            record = rawgather_record(variant, results, tokens, footprint, passes)
            records.append(record)
            save()
            if "error" in record:
                log(f"{variant} {tokens} tokens: {record['error']}: {record['each_gpu']}")
            else:
                counted = [e["packed_phases_counted"] for e in record["each_gpu"]]
                log(
                    f"{variant:22s} {tokens:5d} tokens  {record['step_ms']:8.3f} ms/call  "
                    f"{record['mrows_per_s_per_gpu']:7.1f} M rows/s per GPU "
                    f"({footprint} GiB each, phases counted per GPU {counted})"
                )


# -- main ---------------------------------------------------------------------------


def past_deadline(args) -> bool:
    return args.deadline_s is not None and time.perf_counter() - T0 > args.deadline_s


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=64, help="host table per node")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096], help="per replica")
    parser.add_argument("--steps", type=int, default=32, help="steps per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument(
        "--placement",
        default="auto",
        help="host placement of the tables (pinned is tried next if it fails)",
    )
    parser.add_argument(
        "--host-budget-gib",
        type=float,
        default=200,
        help="host memory the tables and rawgather may take at once (the 2-GPU machine has "
        "256 GiB); sizes N full copies and N rawgather footprints",
    )
    parser.add_argument("--rawgather", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--rawgather-tokens", type=int, nargs="+", default=None, help="default: --tokens"
    )
    parser.add_argument(
        "--rawgather-seconds", type=float, default=6.0, help="gathering time per process and run"
    )
    parser.add_argument("--rawgather-timeout-s", type=float, default=180.0)
    parser.add_argument(
        "--deadline-s", type=float, default=None, help="skip what starts later than this"
    )
    parser.add_argument("--name", default=None, help="results file stem (default: by mode)")
    parser.add_argument(
        "--quick", action="store_true", help="8 GiB, fewer steps, rawgather at 4,096 tokens"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU backend, 4 virtual devices, tiny sizes"
    )
    args = parser.parse_args()
    given = {a.split("=")[0] for a in sys.argv[1:] if a.startswith("--")}

    def preset(name: str, value) -> None:
        if f"--{name.replace('_', '-')}" not in given:
            setattr(args, name, value)

    if args.quick:
        preset("table_gib", 8)
        preset("steps", 16)
        preset("repeats", 3)
        preset("rawgather_tokens", [max(args.tokens)])
        preset("rawgather_seconds", 3.0)
        preset("deadline_s", 140.0)
    if args.smoke:
        preset("table_gib", 0.02)
        preset("tokens", [64, 256])
        preset("steps", 4)
        preset("repeats", 2)
        preset("placement", "cpu")
        preset("rawgather_seconds", 0.3)
        preset("host_budget_gib", 1)
    if args.rawgather_tokens is None:
        args.rawgather_tokens = list(args.tokens)
    if args.name is None:
        args.name = "sharded_smoke" if args.smoke else "sharded_quick" if args.quick else "sharded"
    return args


class Run:
    """What every stage shares: arguments, mesh, placements, records and the results file."""

    def __init__(self, args: argparse.Namespace, mesh) -> None:
        self.args = args
        self.mesh = mesh
        self.devices = list(mesh.devices.flat)  # in mesh order: device i is EDP rank i
        self.n = len(self.devices)
        smoke_or_pinned = "cpu" if args.smoke else "pinned"
        self.placements = list(dict.fromkeys([args.placement, smoke_or_pinned]))
        self.floor_gib = min(1.0, args.table_gib / 8)
        self.records: list[dict] = []
        self.extra = {
            "n_cols": N_COLS,
            "dim": DIM,
            "row_stride": STRIDE,
            "table_gib_asked": args.table_gib,
            "host_budget_gib": args.host_budget_gib,
            "placements_tried": self.placements,
            "nccl_nvls_enable": os.environ["NCCL_NVLS_ENABLE"],
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "timing": f"median over {args.repeats} device loops of {args.steps} steps each; "
            "fresh random ids every step; rawgather: median over the phases (each the median "
            "of 21 calls, 5 from 2**20 rows) that ran while every process was gathering",
            "tables": {},
        }

    def save(self) -> Path:
        return _common.write_results(self.args.name, self.records, self.extra)

    def wants(self, variants) -> list[str]:
        return [v for v in variants if v in self.args.variants]

    def tables(self, what: str, gib: float, specs_for):
        """``specs_for(sizes)`` -> (num_rows, row_start, device) per table, made at ``gib``
        or halved until they fit; (sizes, tables, gib), or None (error records)."""

        def make(gib: float):
            sizes = layer_sizes(gib)
            return sizes, make_tables(specs_for(sizes), self.placements)

        try:
            (sizes, tables), gib = shrinking(make, gib, what, self.floor_gib)
        except MemoryError as exc:
            log(f"{what}: no tables ({exc})")
            variants = self.wants(EDP_VARIANTS if what == "edp" else COPY_VARIANTS)
            self.records += [
                {"variant": v, "gpus": self.n, "tokens": t, "error": repr(exc)}
                for v in variants
                for t in self.args.tokens
            ]
            return None
        self.extra["tables"][what] = {**table_summary(tables), "table_gib": gib}
        return sizes, tables, gib

    def measure(self, variant: str, make_table, plan, meta: dict) -> None:
        self.records += measure(variant, make_table, self.mesh, plan, self.args, meta)
        self.save()


def edp_stage(run: Run) -> None:
    """GPU i holds head shard i (columns [i * part, (i + 1) * part)), --table-gib in all."""
    log(f"EDP head shards: {run.args.table_gib:g} GiB over {run.n} devices")

    def specs(sizes):
        shards = ej.sharding.device_shards(run.mesh, ej.ShardPlan(sizes, edp=run.n))
        return [(shards[d].num_rows, shards[d].row_start, d) for d in run.devices]

    made = run.tables("edp", run.args.table_gib, specs)
    if made is None:
        return
    sizes, tables, gib = made
    meta = run.extra["tables"]["edp"]
    owner: list = []

    def sharded():  # built on first use, so that a failure is recorded as the variant's
        if not owner:
            owner.append(ej.ShardedTable(dict(zip(run.devices, tables, strict=True))))
        return owner[0]

    try:
        for variant, exchange in zip(EDP_VARIANTS, ej.sharding.EXCHANGES, strict=True):
            if variant in run.args.variants:
                plan = ej.ShardPlan(sizes, edp=run.n, exchange=exchange)
                run.measure(variant, sharded, plan, meta)
    finally:
        for table in owner + tables:
            table.close()
    log("EDP shards closed")


def copies_stage(run: Run) -> None:
    """One shared table (copy 0, on GPU 0's node) and a full copy per GPU (each on its
    own node); N copies within --host-budget-gib."""
    count = run.n if "full_copy_per_gpu" in run.args.variants else 1
    gib = min(run.args.table_gib, run.args.host_budget_gib / count)
    log(f"full copies: {count} x {gib:g} GiB")
    made = run.tables(
        "copies", gib, lambda sizes: [(sum(sizes), 0, d) for d in run.devices[:count]]
    )
    if made is None:
        return
    sizes, tables, gib = made
    plan = ej.ShardPlan(sizes, edp=run.n, mode="shared")
    # Both ShardedTables hold copy 0; each closes it, the second close does nothing.
    owners: list = []

    def owning(mapping):
        def make():
            owners.append(ej.ShardedTable(mapping))
            return owners[-1]

        return make

    try:
        if "shared_table" in run.args.variants:
            meta = {**table_summary(tables[:1]), "table_gib": gib}
            run.measure("shared_table", owning(dict.fromkeys(run.devices, tables[0])), plan, meta)
        if "full_copy_per_gpu" in run.args.variants and not past_deadline(run.args):
            meta = run.extra["tables"]["copies"]
            mapping = dict(zip(run.devices, tables, strict=True))
            run.measure("full_copy_per_gpu", owning(mapping), plan, meta)
    finally:
        for table in owners + tables:
            table.close()
    log("copies closed")


def add_ratios(records: list[dict]) -> None:
    """Beside each lookup record: step time over the full copies', and the per-GPU row
    rate over rawgather's on all GPUs at once (same tokens)."""
    by = {(r["variant"], r["tokens"]): r for r in records if "step_ms" in r}
    for r in records:
        if "step_ms" not in r or r["variant"].startswith("rawgather"):
            continue
        base = by.get(("full_copy_per_gpu", r["tokens"]))
        r["vs_full_copy"] = r["step_ms"] / base["step_ms"] if base else None
        raw = by.get(("rawgather_all_gpus", r["tokens"]))
        r["vs_rawgather_all_gpus"] = (
            r["mrows_per_s_per_gpu"] / raw["mrows_per_s_per_gpu"] if raw else None
        )


def main() -> None:
    args = parse_args()
    devices = jax.devices("cpu" if args.smoke else "gpu")
    build = None
    if args.rawgather:  # nvcc builds it while the lookups run
        pool = concurrent.futures.ThreadPoolExecutor(1)
        build = pool.submit(stand_in_rawgather if args.smoke else _common.build_rawgather)
    mesh = ej.engram_mesh(tp=1, devices=devices)  # (dp=1, edp=n, tp=1): one node
    assert dict(mesh.shape) == {"dp": 1, "edp": len(devices), "tp": 1}, mesh.shape
    run = Run(args, mesh)
    log(f"{run.n} devices: {[str(d) for d in run.devices]}; placements tried: {run.placements}")

    if run.wants(EDP_VARIANTS) and not past_deadline(args):
        edp_stage(run)
    if run.wants(COPY_VARIANTS) and not past_deadline(args):
        copies_stage(run)
    # rawgather alone on GPU 0, then on every GPU at once, with no table of ours held.
    if build is not None:
        try:
            exe = build.result()
        except Exception as exc:  # no nvcc, a failed build: the lookups still count
            log(f"rawgather not built: {exc}")
            run.extra["rawgather_error"] = str(exc)
        else:
            run_rawgather(exe, run.n, args, args.host_budget_gib, run.records, run.save)
            if args.smoke:
                run.extra["rawgather_stand_in"] = "smoke: a Python stand-in printing fixed figures"

    add_ratios(run.records)
    path = run.save()
    log(f"wrote {path}")
    _common.print_table(
        run.records,
        [
            "variant",
            "gpus",
            "tokens",
            "step_ms",
            "mrows_per_s_per_gpu",
            "vs_full_copy",
            "rows_checked",
        ],
    )
    _common.finish_rows_checks(run.records)
    bad = [r for r in run.records if r.get("rows_match_reference") is False]
    if bad:
        raise SystemExit(f"rows differ from the reference in {len(bad)} record(s)")


if __name__ == "__main__":
    main()
