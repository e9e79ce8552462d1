"""Lookup throughput: engram_jax.lookup from a pinned host table and from HBM,
beside rawgather (the raw row-moving limit, packed and split layouts), numpy
gather + jax.device_put, and the link's copy-engine ceiling. Fresh random ids
for every call, same footprints and batch sizes for every variant.

Rows checked: the tables' rows all differ (checkpoint.fill_distinct); every timed
call also returns a checksum of its rows, compared after timing with the
checksum of the rows the fill's definition gives for the same ids (computed on
the GPU, reading no table); rawgather compares every row of its last timed
call, and of its last bulk copy (the copy-engine ceiling), with its table's
bytes itself. A mismatch fails the run.

Run on a GPU machine:  python benchmarks/lookup.py [--footprints 1 16 64] [--rows 2097152 12288]
Writes benchmarks/results/lookup.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# The HBM table is cudaMalloc'ed beside XLA's pool: XLA must not take 75 % of the GPU first.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import engram_jax as ej
from engram_jax import checkpoint
from engram_jax.storage import _cuda

try:
    from benchmarks import _common
except ImportError:  # run as a script
    import _common

DIM = 256
STRIDE = ej.EngramTable.allocate(0, DIM).row_stride  # 272 bytes
# The fields of rawgather's own comparison of the rows it moved (_common.run_rawgather).
RAWGATHER_CHECK = ("rows_checked", "rows_check", "rows_checksums", "rows_mismatched")


def id_batches(key, rows_in_footprint: int, batch_rows: int, count: int, device) -> list[jax.Array]:
    keys = jax.random.split(key, count)
    return [
        jax.device_put(
            jax.random.randint(k, (batch_rows // 24, 24), 0, rows_in_footprint, dtype=jnp.int32),
            device,
        )
        for k in keys
    ]


def footprint_rows(gib: float) -> int:
    return int(gib * 2**30) // STRIDE


def batch_key(gib: float, rows: int) -> jax.Array:
    """The same ids for a footprint and batch size on every table."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), int(gib * 1024)), rows)


def with_checksum(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    return rows, _common.rows_checksum(rows)


HOW = (
    "uint32 checksum of the rows of every timed call, vs the checksum of the fill's "
    "definition (checkpoint.distinct_bytes, decoded on the device) of the same ids"
)


def lookup_records(table, variants, footprints, batch_rows, device, repeats: int = 5):
    """M rows/s of each ``(name, max_ctas)`` lookup variant of ``table`` (filled by
    fill_distinct) per footprint and batch size, every timed call's rows checked."""
    expected_checksum = jax.jit(
        lambda ids: _common.rows_checksum(_common.expected_rows(ids, DIM, row_stop=table.row_stop))
    )
    records = []
    for gib in footprints:
        for rows in batch_rows:
            count = 8 if rows >= 1 << 20 else 64
            batches = id_batches(batch_key(gib, rows), footprint_rows(gib), rows, count, device)
            expected = np.stack([np.asarray(expected_checksum(b)) for b in batches])
            for name, ctas in variants:
                fn = jax.jit(lambda i, c=ctas: with_checksum(ej.lookup(table, i, max_ctas=c)))
                sums: list = []
                seconds = _common.time_calls(fn, batches, repeats=repeats, checksums=sums)
                records.append(
                    {
                        "variant": name,
                        "footprint_gib": gib,
                        "rows": rows,
                        "mrows_per_s": rows / seconds / 1e6,
                        **_common.rows_check(np.stack(sums), np.tile(expected, repeats), HOW),
                    }
                )
                print(records[-1], flush=True)
    return records


def numpy_records(table, footprints, batch_rows, device) -> list[dict]:
    """What a user might do without engram_jax: numpy take of the raw records +
    device_put; the records that arrived are checked after each timed copy."""
    host = table.allocation.host_array[: table.nbytes].reshape(table.num_rows, STRIDE)
    rng = np.random.default_rng(0)
    checksum = jax.jit(_common.rows_checksum)
    expected_checksum = jax.jit(
        lambda ids: _common.rows_checksum(_common.expected_records(ids, DIM))
    )
    records = []
    for gib in footprints:
        for rows in batch_rows:
            times, sums, expected = [], [], []
            for _ in range(3 if rows >= 1 << 20 else 20):
                ids = rng.integers(0, footprint_rows(gib), rows)
                start = time.perf_counter()
                moved = jax.device_put(np.take(host, ids, axis=0), device).block_until_ready()
                times.append(time.perf_counter() - start)
                sums.append(np.asarray(checksum(moved)))
                expected.append(np.asarray(expected_checksum(jax.device_put(ids, device))))
                del moved
            records.append(
                {
                    "variant": "numpy_device_put",
                    "footprint_gib": gib,
                    "rows": rows,
                    "mrows_per_s": rows / statistics.median(times) / 1e6,
                    **_common.rows_check(
                        sums,
                        expected,
                        "uint32 checksum of the records each timed device_put moved, vs the "
                        "fill's definition (checkpoint.distinct_bytes) of the same ids",
                    ),
                }
            )
            print(records[-1], flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--footprints", type=int, nargs="+", default=[1, 16, 64], help="GiB")
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[2097152, 12288], help="rows per call"
    )
    parser.add_argument(
        "--small-ctas", type=int, default=8, help="CTA budget of the narrow variant"
    )
    args = parser.parse_args()
    gpu = jax.devices("gpu")[0]
    records: list[dict] = []

    # 1. The reference, in its own process so its pinned buffer is gone before ours.
    exe = _common.build_rawgather()
    for rows in args.rows:
        for r in _common.run_rawgather(exe, args.footprints, rows):
            # rawgather's own check of the rows it moved
            checked = {k: r[k] for k in RAWGATHER_CHECK if k in r} or {
                "rows_checked": None,
                "rows_check": "none: this rawgather compared no rows",
            }
            if r["what"] == "h2d_memcpy":
                if rows == args.rows[0]:
                    records.append(
                        {
                            "variant": "ceiling_h2d_memcpy",
                            "gb_per_s": r["gb_per_s"],
                            "mrows_per_s": r["gb_per_s"] * 1e3 / STRIDE,
                            **checked,
                        }
                    )
                continue
            variant = {
                "gather_packed": "rawgather_packed",
                "gather_split": "rawgather_split",
                "gather_packed_sorted": "rawgather_packed_sorted",
            }[r["what"]]
            records.append(
                {
                    "variant": variant,
                    "footprint_gib": r["footprint_gib"],
                    "rows": rows,
                    "mrows_per_s": r["mrows_per_s"],
                    "mrows_per_s_with_sort": r.get("mrows_per_s_with_sort"),
                    **checked,
                }
            )
    print("rawgather done", flush=True)

    # 2. engram_jax on a pinned host table and on an HBM table of the largest footprint.
    max_rows = footprint_rows(max(args.footprints))
    for placement in ("pinned", "device"):
        t0 = time.perf_counter()
        table = ej.EngramTable.allocate(max_rows, DIM, placement=placement, device=gpu)
        checkpoint.fill_distinct(table)  # every row different: a wrong row shows
        print(
            f"{placement}: {max(args.footprints)} GiB allocated and filled in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        with table:
            variants = [(f"lookup_{placement}", None)]
            if placement == "pinned":
                variants.append((f"lookup_pinned_{args.small_ctas}ctas", args.small_ctas))
            records += lookup_records(table, variants, args.footprints, args.rows, gpu)
            # 3. What a user might do without engram_jax: numpy take + device_put (raw records).
            if placement == "pinned":
                records += numpy_records(table, args.footprints, args.rows, gpu)
        _cuda.synchronize_active_devices()

    # Ratios against rawgather packed at the same footprint and batch.
    base = {
        (r["footprint_gib"], r["rows"]): r["mrows_per_s"]
        for r in records
        if r["variant"] == "rawgather_packed"
    }
    split = {
        (r["footprint_gib"], r["rows"]): r["mrows_per_s"]
        for r in records
        if r["variant"] == "rawgather_split"
    }
    for r in records:
        k = (r.get("footprint_gib"), r.get("rows"))
        if k in base:
            r["vs_rawgather_packed"] = r["mrows_per_s"] / base[k]
            r["vs_rawgather_split"] = r["mrows_per_s"] / split[k]
    path = _common.write_results("lookup", records, {"row_stride": STRIDE, "dim": DIM})
    print(f"wrote {path}")
    _common.print_table(
        [r for r in records if "footprint_gib" in r],
        [
            "variant",
            "footprint_gib",
            "rows",
            "mrows_per_s",
            "vs_rawgather_packed",
            "vs_rawgather_split",
            "rows_checked",
        ],
    )
    _common.finish_rows_checks(records)


if __name__ == "__main__":
    main()
