"""Hashing cost against the lookup it feeds: engram_jax.hash_ngrams on the GPU
for 4,096 and 65,536 tokens with DeepSeek-V4.1-Flash's layout (2 layers x 24
columns), beside engram_jax.lookup of the same tokens' 48 rows each from a
pinned host table. The issue's bar: hashing under 5 % of the lookup.

Run on a GPU machine:  python benchmarks/hashing.py [--tokens 4096 65536] [--table-gib 4]
Writes benchmarks/results/hashing.json.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import engram_jax as ej
from engram_jax import row_stride

try:
    from benchmarks import _common
except ImportError:  # run as a script
    import _common

# DeepSeek-V4.1-Flash: engram_vocab_size 16M, layers (1, 14), orders 2..4, 8 heads, 256 values.
LAYOUT = ej.EngramLayout(16_000_000, (1, 14), 4, 8, 256, 99_092, 2)
SEQUENCE = 4096  # tokens per packed sequence
BIG_CALL = 1 << 22  # tokens of the one large call that gives the kernel's throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument(
        "--table-gib",
        type=int,
        default=4,
        help="pinned table footprint; smaller tables gather faster, so the ratio is stricter",
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="check the script on the CPU backend with a plain-memory table; writes no results",
    )
    args = parser.parse_args()
    gpu = jax.devices("cpu" if args.cpu_smoke else "gpu")[0]
    placement = "cpu" if args.cpu_smoke else "pinned"
    cols = LAYOUT.n_layers * LAYOUT.n_cols
    rng = np.random.default_rng(0)

    t0 = time.perf_counter()
    rows = (args.table_gib << 30) // row_stride(LAYOUT.head_dim)
    # Fresh pinned pages read as zeros: valid rows, and the gather's cost does
    # not depend on their values.
    table = ej.EngramTable.allocate(rows, LAYOUT.head_dim, placement=placement, device=gpu)
    print(
        f"{placement} table: {args.table_gib} GiB, {rows} rows in {time.perf_counter() - t0:.1f} s"
    )

    hash_fn = jax.jit(lambda t, s: ej.hash_ngrams(LAYOUT, t, segment_ids=s))
    lookup_fn = jax.jit(lambda ids: ej.lookup(table, ids))
    fused_fn = jax.jit(
        lambda t, s: ej.lookup(table, ej.hash_ngrams(LAYOUT, t, segment_ids=s) % rows)
    )

    # Kernel throughput: one call large enough that launch and dispatch vanish.
    big_call = BIG_CALL >> 4 if args.cpu_smoke else BIG_CALL
    big_tokens = [
        jax.device_put(rng.integers(0, LAYOUT.compressed_vocab_size, big_call, dtype=np.int32), gpu)
        for _ in range(2)
    ]
    big_segments = jax.device_put(np.arange(big_call, dtype=np.int32) // SEQUENCE, gpu)
    big = _common.time_calls(lambda t, s=big_segments: hash_fn(t, s), big_tokens)
    tokens_per_s = big_call / big
    print(f"hash throughput: {tokens_per_s / 1e6:.1f} Mtokens/s ({big_call} tokens per call)")
    del big_tokens, big_segments

    records = []
    with table:
        for n in args.tokens:
            segments = jax.device_put(np.arange(n, dtype=np.int32) // SEQUENCE, gpu)
            count = 8 if n * cols >= 1 << 20 else 64  # distinct batches: rows never stay in L2
            token_batches = [
                jax.device_put(
                    rng.integers(0, LAYOUT.compressed_vocab_size, n, dtype=np.int32), gpu
                )
                for _ in range(count)
            ]
            hash_call = _common.time_calls(lambda t, s=segments: hash_fn(t, s), token_batches)

            id_batches = [hash_fn(t, segments) % rows for t in token_batches]
            lookup = _common.time_calls(lookup_fn, id_batches)
            fused = _common.time_calls(lambda t, s=segments: fused_fn(t, s), token_batches)

            record = {
                "tokens": n,
                "rows_per_call": n * cols,
                "hash_us_per_call": hash_call * 1e6,
                "hash_us_at_throughput": n / tokens_per_s * 1e6,
                "hash_mtokens_per_s_large_calls": tokens_per_s / 1e6,
                "lookup_ms": lookup * 1e3,
                "lookup_mrows_per_s": n * cols / lookup / 1e6,
                "hash_plus_lookup_ms": fused * 1e3,
                "hash_pct_of_lookup": 100 * hash_call / lookup,
                "hash_pct_of_lookup_at_throughput": 100 * n / tokens_per_s / lookup,
            }
            record["under_5_pct"] = record["hash_pct_of_lookup"] < 5
            records.append(record)
            print(record, flush=True)
            del id_batches

    if args.cpu_smoke:
        return
    path = _common.write_results(
        "hashing",
        records,
        {
            "layout": repr(LAYOUT),
            "table_gib": args.table_gib,
            "table_rows": rows,
            "sequence_tokens": SEQUENCE,
            "engram_jax_hash_target": "engram_ngram_hash (CUDA)",
        },
    )
    print(f"wrote {path}")
    _common.print_table(
        records,
        [
            "tokens",
            "rows_per_call",
            "hash_us_per_call",
            "hash_us_at_throughput",
            "lookup_ms",
            "lookup_mrows_per_s",
            "hash_plus_lookup_ms",
            "hash_pct_of_lookup",
        ],
    )


if __name__ == "__main__":
    main()
