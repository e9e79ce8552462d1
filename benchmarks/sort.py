"""The sort of a batch's ids by table row that sorted lookups and every update
start with: the library's chunk sort (chunks sorted in shared memory, merged by
rank) against CUB's device radix sort, which it replaces for small batches, on
the same fresh batches in one run (benchmarks/reference/sort_ids.cu, built with
nvcc against ffi/kernels/dedup.cuh). Every call's output of the two is compared
bit for bit, and one batch's with a stable sort on the host.

    python benchmarks/sort.py [--counts 1024 2048 ... 32768] [--name sort_ids]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import build_with_nvcc, print_table, write_results

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "benchmarks" / "reference" / "sort_ids.cu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+",
                        default=[1024, 2048, 4096, 8192, 16384, 32768])  # fmt: skip
    parser.add_argument("--rows", type=int, default=1 << 26, help="table rows (keys' range)")
    parser.add_argument("--name", default="sort_ids")
    args = parser.parse_args(argv)
    env = dict(os.environ, SORT_IDS_COUNTS=",".join(map(str, args.counts)),
               SORT_IDS_ROWS=str(args.rows))  # fmt: skip
    exe = build_with_nvcc(SOURCE, "-I", str(ROOT / "ffi"))
    proc = subprocess.run([str(exe)], env=env, capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    cub = {(r["ids"], r["distribution"]): r for r in lines if r["sort"] == "cub"}
    records = []
    for r in lines:
        if r["sort"] != "chunks":
            continue
        ref = cub[(r["ids"], r["distribution"])]
        records.append({
            **{k: r[k] for k in ("ids", "rows", "distribution", "batches", "passes")},
            "chunks_us": r["us_per_call"], "cub_us": ref["us_per_call"],
            "speedup_vs_cub": ref["us_per_call"] / r["us_per_call"],
            "entries_compared": ref["entries_compared"],
            "entries_mismatched": ref["entries_mismatched"],
            "rows_checked": ref["entries_mismatched"] == 0 and ref["entries_compared"] > 0,
            "rows_check": "every batch's sorted keys and positions, chunk sort vs CUB's, bit for "
                          "bit; the first batch's vs std::stable_sort on the host",
        })  # fmt: skip
    write_results(args.name, records)
    print_table(records, ["ids", "distribution", "chunks_us", "cub_us", "speedup_vs_cub",
                          "entries_mismatched"])  # fmt: skip
    return 0 if all(r["rows_checked"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
