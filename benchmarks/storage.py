"""Host-table placements: lookup rate and allocation + load time of each.

Lookup Mrows/s and allocation + load seconds per GiB for pinned, hugepage,
numa, shared numa (cuMem host-NUMA passed by POSIX fd to a second process)
and shared /dev/shm, beside rawgather at the same footprint.

Shared tables are measured in the second process, the one that imported the
memory; the first (the writer) measures right before it, never at the same
time. Fresh random ids for every call. Loading is the dummy fill (constant
rows), so the seconds are allocation, page faulting/pinning and writing.

Run on a GPU machine (about 5 minutes for 16 + 64 GiB):
    python benchmarks/storage.py [--footprints 16 64] [--rows 2097152]
Writes benchmarks/results/storage.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback

# Two processes share the one GPU: neither may take 75 % of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

import engram_jax as ej
from engram_jax import checkpoint
from engram_jax.storage import NodeGroup, _cuda

try:
    from benchmarks import _common
except ImportError:  # run as a script
    import _common

DIM = 256
STRIDE = ej.row_stride(DIM)  # 272 bytes
SINGLE = ("pinned", "hugepage", "numa")
SHARED = {"shared_numa": "fd", "shared_shm": "shm"}
WAIT_S = 600.0


def id_batches(key, table_rows: int, batch_rows: int, count: int) -> list[jax.Array]:
    keys = jax.random.split(key, count)
    shape = (batch_rows // 24, 24)
    return [jax.random.randint(k, shape, 0, table_rows, dtype=jnp.int32) for k in keys]


def lookup_rate(table: ej.EngramTable, batch_rows: int, seed: int) -> float:
    """Median Mrows/s over 3 passes of 4 fresh batches each (the ids exist before timing)."""
    fn = jax.jit(lambda i: ej.lookup(table, i))
    batches = id_batches(jax.random.key(seed), table.num_rows, batch_rows, 4)
    jax.block_until_ready(batches)
    seconds = _common.time_calls(fn, batches, repeats=3)
    rows = (batch_rows // 24) * 24
    return rows / seconds / 1e6


def table_info(table: ej.EngramTable) -> dict:
    info = dict(table.allocation.info)
    return {k: v for k, v in info.items() if isinstance(v, (int, float, str))}


def measure_single(placement: str, gib: int, batch_rows: int, gpu) -> dict:
    rows = (gib << 30) // STRIDE
    start = time.perf_counter()
    table = ej.EngramTable.allocate(rows, DIM, placement=placement, device=gpu)
    alloc_s = time.perf_counter() - start
    try:
        load_s = checkpoint.fill_dummy(table)
        rate = lookup_rate(table, batch_rows, seed=gib)
        info = table_info(table)
    finally:
        table.close()
    return {
        "footprint_gib": gib,
        "placement": placement,
        "rows": batch_rows,
        "mrows_per_s": rate,
        "alloc_s": alloc_s,
        "load_s": load_s,
        "alloc_load_s_per_gib": (alloc_s + load_s) / gib,
        "info": info,
    }


def shared_steps(footprints: list[int]) -> list[tuple[int, str, str]]:
    return [(gib, name, method) for gib in footprints for name, method in SHARED.items()]


def run_shared(group: NodeGroup, gib: int, name: str, method: str, batch_rows: int) -> dict:
    """Both ranks: make the shared table (rank 0 fills it), measure in turn, close in turn."""
    rows = (gib << 30) // STRIDE
    key = f"bench/{gib}/{name}"
    store = group.store
    start = time.perf_counter()
    table = checkpoint.dummy_table(
        rows, DIM, placement="numa", device=0, group=group, share_method=method, name=name
    )
    alloc_load_s = time.perf_counter() - start
    try:
        if group.rank == 0:
            writer_rate = lookup_rate(table, batch_rows, seed=gib)
            store.set(f"{key}/writer_done", "1")
            peer = json.loads(store.get(f"{key}/peer", WAIT_S))
            info = table_info(table)
        else:
            store.get(f"{key}/writer_done", WAIT_S)
            rate = lookup_rate(table, batch_rows, seed=gib + 1)
            store.set(f"{key}/peer", json.dumps({"mrows_per_s": rate}))
            return {}
    finally:
        table.close()
        if group.rank != 0:
            store.set(f"{key}/closed", "1")
    # The next table may be as big: wait until the peer's mapping is gone too.
    store.get(f"{key}/closed", WAIT_S)
    return {
        "footprint_gib": gib,
        "placement": name,
        "rows": batch_rows,
        "mrows_per_s": peer["mrows_per_s"],
        "mrows_per_s_writer": writer_rate,
        "alloc_load_s_per_gib": alloc_load_s / gib,
        "info": info,
    }


def peer_main(args) -> None:
    """The second process: follows the leader's steps, told by it which to run."""
    group = NodeGroup.connect(f"127.0.0.1:{args.port}", 2, 1, timeout_s=180)
    try:
        for gib, name, method in shared_steps(args.footprints):
            if group.store.get(f"bench/{gib}/{name}/go", WAIT_S) == "1":
                run_shared(group, gib, name, method, args.rows)
    finally:
        group.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--footprints", type=int, nargs="+", default=[16, 64], help="GiB")
    parser.add_argument("--rows", type=int, default=2097152, help="rows per lookup call")
    parser.add_argument("--skip-shared", action="store_true", help="no two-process placements")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=330.0,
        help="start no new measurement after this many seconds (the rest is marked skipped)",
    )
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        peer_main(args)
        return
    began = time.perf_counter()
    records: list[dict] = []
    rawgather: dict[int, float] = {}

    def stamp(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f} s] {message}", flush=True)

    def save() -> None:
        # After every record, so a run cut short still leaves what it measured.
        for r in records:
            base = rawgather.get(r.get("footprint_gib"))
            if base and r.get("mrows_per_s") and r["placement"] != "rawgather":
                r["vs_rawgather"] = r["mrows_per_s"] / base
        _common.write_results(
            "storage",
            records,
            {"row_stride": STRIDE, "dim": DIM, "load": "fill_dummy (constant rows)"},
        )

    def add(record: dict) -> None:
        records.append(record)
        save()
        stamp(str(record))

    def over_time() -> bool:
        return time.perf_counter() - began > args.deadline_s

    gpu = jax.devices("gpu")[0]

    # 1. The reference, in its own process so its pinned buffer is gone before ours.
    exe = _common.build_rawgather()
    for r in _common.run_rawgather(exe, args.footprints, args.rows):
        if r["what"] == "gather_packed":
            rawgather[r["footprint_gib"]] = r["mrows_per_s"]
            add(
                {
                    "footprint_gib": r["footprint_gib"],
                    "placement": "rawgather",
                    "rows": args.rows,
                    "mrows_per_s": r["mrows_per_s"],
                    "alloc_load_s_per_gib": None,
                }
            )

    peer = group = None
    if not args.skip_shared:
        port = free_port()
        peer = subprocess.Popen(
            [sys.executable, __file__, "--peer", "--port", str(port), "--rows", str(args.rows)]
            + ["--footprints", *map(str, args.footprints)]
        )
    try:
        if peer is not None:
            group = NodeGroup.connect(f"127.0.0.1:{port}", 2, 0, timeout_s=180)
        shared_ok = group is not None
        # 2. Footprint by footprint, one table at a time (each freed before the next).
        for gib in args.footprints:
            for placement in SINGLE:
                if over_time():
                    add({"footprint_gib": gib, "placement": placement, "skipped": "deadline"})
                    continue
                try:
                    add(measure_single(placement, gib, args.rows, gpu))
                except Exception as exc:  # noqa: BLE001 - a placement failing here is a result
                    traceback.print_exc()
                    add({"footprint_gib": gib, "placement": placement, "error": str(exc)})
            # 3. Two processes on the one GPU, one table per node.
            for step_gib, name, method in shared_steps([gib]) if group is not None else []:
                go = shared_ok and not over_time()
                group.store.set(f"bench/{step_gib}/{name}/go", "1" if go else "0")
                if not go:
                    add({"footprint_gib": gib, "placement": name, "skipped": "deadline or error"})
                    continue
                try:
                    add(run_shared(group, step_gib, name, method, args.rows))
                except Exception as exc:  # noqa: BLE001 - recorded; later shared steps skipped
                    traceback.print_exc()
                    add({"footprint_gib": gib, "placement": name, "error": str(exc)})
                    shared_ok = False
    finally:
        if group is not None:
            try:
                group.close()
            except Exception as exc:  # noqa: BLE001 - a dead peer cannot say goodbye
                print(f"coordination service shutdown: {exc}", flush=True)
        if peer is not None:
            try:
                peer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                peer.kill()
    _cuda.synchronize_active_devices()
    save()
    stamp(f"wrote {_common.RESULTS / 'storage.json'}")
    _common.print_table(
        records,
        ["footprint_gib", "placement", "mrows_per_s", "vs_rawgather", "alloc_load_s_per_gib"],
    )


if __name__ == "__main__":
    main()
