"""Host cost of an asynchronous lookup: how long a jitted lookup_start + lookup_done
pair takes per call, by visiting order and batch, from an HBM table (no PCIe reads:
at small batches its gathers are short and what a call costs the host shows; at
large ones the calls wait for the GPU), beside the jitted plain and sorted lookups
and a jitted function of the ids alone (jax's own dispatch).

Two figures per variant: ``enqueue_us``, the median time for the call to return
(jax's dispatch and whatever the handlers do on the calling thread), and
``per_call_us``, calls queued back to back and synchronised once (the host's or
the GPU's time, whichever is longer). Rows checked: the table's rows all differ
(checkpoint.fill_distinct) and every timed call's rows checksum is compared with
the checksum of the rows the fill's definition gives for its ids.

    python benchmarks/dispatch.py [--batches 1536 12288 98304] [--orders plain sorted dedup]
    python benchmarks/dispatch.py --smoke          # the script itself, on the CPU
Writes benchmarks/results/dispatch.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# The HBM table is allocated beside XLA's pool: XLA must not take 75 % of the GPU first.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import engram_jax as ej
from engram_jax import checkpoint

try:
    from benchmarks import _common
except ImportError:  # run as a script
    import _common

DIM = 256
HOW = (
    "uint32 checksum of the rows of every timed call, vs the checksum of the fill's "
    "definition (checkpoint.distinct_bytes, decoded on the device) of the same ids"
)


def with_checksum(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    return rows, _common.rows_checksum(rows)


def variants(table: ej.EngramTable, orders: list[str]) -> dict:
    """name -> function of the ids returning (output, checksum)."""
    chosen = {
        "ids_only": lambda ids: (ids, _common.rows_checksum(ids)),
        "lookup_plain": lambda ids: with_checksum(ej.lookup(table, ids)),
        "lookup_sorted": lambda ids: with_checksum(ej.lookup(table, ids, order="sorted")),
    }
    for order in orders:
        chosen[f"start_done_{order}"] = lambda ids, o=order: with_checksum(
            ej.lookup_done(ej.lookup_start(table, ids, order=o))
        )
    return chosen


def enqueue_times(fn, batches) -> tuple[list[float], list]:
    """Seconds each call took to return, and its checksum (the calls are not awaited)."""
    seconds, sums = [], []
    for ids in batches:
        start = time.perf_counter()
        _, checksum = fn(ids)
        seconds.append(time.perf_counter() - start)
        sums.append(checksum)
    jax.block_until_ready(sums)
    return seconds, [np.asarray(s) for s in sums]


def measure(table, batch: int, names: list[str], orders, device, calls: int, repeats: int):
    keys = jax.random.split(jax.random.fold_in(jax.random.key(0), batch), calls)
    batches = [
        jax.device_put(
            jax.random.randint(k, (batch // 24, 24), 0, table.num_rows, jnp.int32), device
        )
        for k in keys
    ]
    expected_checksum = jax.jit(
        lambda ids: _common.rows_checksum(_common.expected_rows(ids, DIM, row_stop=table.row_stop))
    )
    expected = np.stack([np.asarray(expected_checksum(b)) for b in batches])
    id_sums = np.stack([np.asarray(jax.jit(_common.rows_checksum)(b)) for b in batches])
    fns = variants(table, orders)
    records = []
    for name in names:
        fn = jax.jit(fns[name])
        sums: list = []
        per_call = _common.time_calls(fn, batches, repeats=repeats, checksums=sums)
        enqueue, more = enqueue_times(fn, batches)
        got = np.concatenate([np.stack(sums), np.stack(more)])
        reference = np.tile(id_sums if name == "ids_only" else expected, repeats + 1)
        records.append(
            {
                "variant": name,
                "rows": batch,
                "enqueue_us": statistics.median(enqueue) * 1e6,
                "per_call_us": per_call * 1e6,
                **_common.rows_check(
                    got, reference, "checksum of the ids themselves" if name == "ids_only" else HOW
                ),
            }
        )
        print(records[-1], flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1536, 12288, 98304])
    parser.add_argument("--orders", nargs="+", default=["plain", "sorted", "dedup"])
    parser.add_argument("--table-gib", type=float, default=1.0)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed pass")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU backend")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.table_gib, args.calls, args.repeats = [48], 1 / 1024, 4, 1
    device = jax.devices("cpu" if args.smoke else "gpu")[0]
    rows = int(args.table_gib * 2**30) // ej.row_stride(DIM)
    placement = "cpu" if args.smoke else "device"
    names = ["ids_only", "lookup_plain", "lookup_sorted"] + [f"start_done_{o}" for o in args.orders]
    records = []
    with ej.EngramTable.allocate(rows, DIM, placement=placement, device=device) as table:
        checkpoint.fill_distinct(table)  # every row different: a wrong row shows
        for batch in args.batches:
            records += measure(table, batch, names, args.orders, device, args.calls, args.repeats)
    base = {r["rows"]: r for r in records if r["variant"] == "ids_only"}
    for r in records:
        r["enqueue_us_over_ids_only"] = r["enqueue_us"] - base[r["rows"]]["enqueue_us"]
    if not args.smoke:
        path = _common.write_results(
            "dispatch", records, {"dim": DIM, "table_gib": args.table_gib, "placement": placement}
        )
        print(f"wrote {path}")
    _common.print_table(
        records,
        [
            "variant",
            "rows",
            "enqueue_us",
            "enqueue_us_over_ids_only",
            "per_call_us",
            "rows_checked",
        ],
    )
    _common.finish_rows_checks(records)


if __name__ == "__main__":
    main()
