"""Past the PCIe row limit: visiting order, deduplication and the HBM hot-row
cache, each alone and together, on the row ids of real text (tools/workload.py:
Python docstrings, DeepSeek-V4 tokenizer, DeepSeek-V4.1-Flash layout, layer 1),
from a 64 GiB pinned host table, beside rawgather (packed, and packed sorted)
on uniform random ids at the same footprint and batch size.

Batches: decode steps of 512 and 4,096 sequences and a prefill of 87,381
tokens (2 M rows), 24 rows per token. The cache is filled from the profile
part of the text; every batch comes from the held-out part. Layer 1's table
has 384 M rows (97.6 GiB); the 64 GiB table holds 252.6 M, so ids are folded
modulo its row count. Rates count every id of a call, duplicates included.

Rows checked: the table's rows all differ (checkpoint.fill_distinct); each timed
call also returns a checksum of its rows, and every lever's checksums are
compared with the plain lookup's for the same batches; a mismatch fails the run.

Run on a GPU machine (about 5 minutes):  python benchmarks/cache.py
Writes benchmarks/results/cache.json and benchmarks/results/cache.svg.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

# Caches are cudaMalloc'ed beside XLA's pool: XLA must not take 75 % of the GPU first.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import engram_jax as ej
from engram_jax import checkpoint
from engram_jax._args import AUTO_DEDUP_MIN_IDS, choose_order

try:
    from benchmarks import _common
except ImportError:  # run as a script
    import _common

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools import workload  # noqa: E402

DIM = 256
STRIDE = 272
TOKENS_PER_BATCH = {"decode_512": 512, "decode_4096": 4096, "prefill_87381": 87381}


def timed(fn, batches: list[jax.Array], repeats: int) -> tuple[float, np.ndarray]:
    """Median seconds per lookup: every batch in one jitted call (one dispatch for all,
    so the figure is the GPU's time), repeated. Also the checksums of every batch's
    rows in every timed call, ``[repeats, batches]``."""

    @jax.jit
    def many(stacked):
        # Only a checksum of each output leaves: it reads every row, the host copies nothing.
        return jnp.stack([_common.rows_checksum(fn(ids)) for ids in stacked])

    many(batches).block_until_ready()
    times, sums = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        sums.append(many(batches).block_until_ready())
        times.append((time.perf_counter() - start) / len(batches))
    return statistics.median(times), np.stack([np.asarray(s) for s in sums])


def svg_plot(records: list[dict], raw: dict, path: Path) -> None:
    """Hit rate and rate against the cache budget, one colour per batch (plain SVG)."""
    budgets = sorted({r["cache_gib"] for r in records if r["lever"] in ("cache", "all")})
    colours = dict(zip(TOKENS_PER_BATCH, ("#1f77b4", "#d62728", "#2ca02c"), strict=True))
    width, height, pad = 380, 260, 50

    def value(batch: str, lever: str, budget: float, key: str) -> float:
        found = [
            r[key]
            for r in records
            if (r["batch"], r["lever"], r["cache_gib"]) == (batch, lever, budget)
        ]
        return found[0] if found else 0.0

    def panel(x0: int, title: str, ylabel: str, lines: list, ymax: float, refs: dict) -> list[str]:
        def x_of(i: int) -> float:
            return pad + (width - pad - 20) * i / max(1, len(budgets) - 1)

        def y_of(v: float) -> float:
            return height - pad - (height - pad - 40) * v / ymax

        out = [
            f'<g transform="translate({x0},0)">',
            f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>',
            f'<path d="M{pad},30 V{height - pad} H{width - 10}" fill="none" stroke="black"/>',
            f'<text x="{width / 2}" y="{height - 14}" text-anchor="middle" font-size="11">'
            "cache budget (GiB)</text>",
            f'<text x="12" y="{height / 2}" font-size="11" text-anchor="middle" '
            f'transform="rotate(-90 12 {height / 2})">{ylabel}</text>',
        ]
        for i, budget in enumerate(budgets):
            out.append(
                f'<text x="{x_of(i):.1f}" y="{height - pad + 14}" text-anchor="middle" '
                f'font-size="10">{budget:g}</text>'
            )
        for k in range(5):
            v = ymax * k / 4
            out.append(
                f'<text x="{pad - 4}" y="{y_of(v) + 3:.1f}" text-anchor="end" '
                f'font-size="10">{v:.3g}</text>'
            )
        for batch, dash, values in lines:
            points = " ".join(f"{x_of(i):.1f},{y_of(v):.1f}" for i, v in enumerate(values))
            out.append(
                f'<polyline points="{points}" fill="none" stroke="{colours[batch]}" '
                f'stroke-width="2" stroke-dasharray="{dash}"/>'
            )
        for batch, v in refs.items():
            out.append(
                f'<line x1="{pad}" y1="{y_of(v):.1f}" x2="{width - 20}" y2="{y_of(v):.1f}" '
                f'stroke="{colours[batch]}" stroke-dasharray="2,3"/>'
            )
        return [*out, "</g>"]

    hits = [(b, "", [value(b, "all", g, "hit_rate") for g in budgets]) for b in colours]
    rates = [
        (b, dash, [value(b, lever, g, "effective_mrows_per_s") for g in budgets])
        for lever, dash in (("all", ""), ("cache", "6,3"))
        for b in colours
    ]
    finite = [v for _, _, vs in rates for v in vs] + [v for v in raw.values() if v == v]
    ymax = max(finite + [1.0]) * 1.1
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width + 40}" '
        f'height="{height + 45}" font-family="sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
        *panel(0, "hit rate (real-text ids, layer 1)", "fraction of ids", hits, 1.0, {}),
        *panel(
            width + 20,
            "rows returned per second",
            "M rows/s",
            rates,
            ymax,
            {b: v for b, v in raw.items() if v == v},
        ),
    ]
    for i, (batch, colour) in enumerate(colours.items()):
        svg.append(
            f'<rect x="{60 + 230 * i}" y="{height + 5}" width="12" height="4" fill="{colour}"/>'
            f'<text x="{76 + 230 * i}" y="{height + 11}" font-size="11">{batch}</text>'
        )
    svg.append(
        f'<text x="60" y="{height + 30}" font-size="10">solid: dedup + cache (all); dashed: '
        "cache alone (ids in the given order); dotted: rawgather packed on uniform ids, "
        "same rows and footprint</text>"
    )
    path.write_text("\n".join([*svg, "</svg>"]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--footprint-gib", type=int, default=64)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 1, 2, 4], help="GiB")
    parser.add_argument(
        "--decode-steps", type=int, default=32, help="decode batches timed per size"
    )
    parser.add_argument("--prefill-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data", type=Path, default=workload.DEFAULT_PATH)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a quick run on the CPU backend (1 GiB table, no rawgather): checks the script works",
    )
    args = parser.parse_args()
    if args.smoke:
        args.footprint_gib, args.budgets = 1, [0.01, 0.02]
        args.decode_steps, args.prefill_batches, args.repeats = 4, 1, 1
    t_start = time.perf_counter()
    device = jax.devices("cpu" if args.smoke else "gpu")[0]
    num_rows = (args.footprint_gib << 30) // STRIDE

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {message}", flush=True)

    # 1. rawgather, in its own process, before our table takes the host memory.
    exe = None if args.smoke else _common.build_rawgather()
    raw_packed, raw_sorted = {}, {}
    for batch, tokens in TOKENS_PER_BATCH.items():
        if exe is None:
            raw_packed[batch] = raw_sorted[batch] = float("nan")
            continue
        for r in _common.run_rawgather(exe, [args.footprint_gib], tokens * 24):
            if r["what"] == "gather_packed":
                raw_packed[batch] = r["mrows_per_s"]
            elif r["what"] == "gather_packed_sorted":
                raw_sorted[batch] = r["mrows_per_s_with_sort"]
        log(f"rawgather {batch}: packed {raw_packed[batch]:.1f}, sorted {raw_sorted[batch]:.1f}")

    # 2. The workload: profile part -> frequency profile; held-out part -> batches.
    data = workload.load(args.data)
    layout = workload.flash_layout(data)
    profile_ids = workload.row_ids(data, "profile", layout)[:, 0] % num_rows
    measure_ids = workload.row_ids(data, "measure", layout)[:, 0] % num_rows
    _, segments = data.part("measure")
    profile = ej.HotRowProfile.from_ids(profile_ids)
    del profile_ids
    host_batches = {
        "decode_512": workload.decode_batches(measure_ids, segments, 512, args.decode_steps),
        "decode_4096": workload.decode_batches(measure_ids, segments, 4096, args.decode_steps // 2),
        "prefill_87381": workload.prefill_batches(measure_ids, 87381, args.prefill_batches),
    }
    log(f"workload: {len(profile)} distinct profile rows, layer {layout.layer_ids[0]}")

    # 3. The host table, every row different: a wrong row a lever returns shows.
    placement = "cpu" if args.smoke else "pinned"
    table = ej.EngramTable.allocate(num_rows, DIM, placement=placement, device=device)
    fill_s = checkpoint.fill_distinct(table, threads=os.cpu_count())
    log(
        f"{args.footprint_gib} GiB {placement} table allocated and filled "
        f"({table.nbytes / 2**30 / fill_s:.1f} GiB/s)"
    )
    batches = {k: [jax.device_put(b, device) for b in v] for k, v in host_batches.items()}
    distinct = {
        k: float(np.mean([np.unique(b).size / b.size for b in v])) for k, v in host_batches.items()
    }

    records: list[dict] = []
    plain_sums: dict[str, np.ndarray] = {}
    hit_rates: dict[tuple[str, float], float] = {}

    def measure(batch: str, lever: str, order: str, hot, budget: float) -> None:
        fn = lambda ids: ej.lookup(table, ids, cache=hot, order=order)  # noqa: E731
        seconds, sums = timed(fn, batches[batch], args.repeats)
        rows = batches[batch][0].size
        how = f"uint32 checksum of every batch's rows in each of the {args.repeats} timed calls"
        if lever == "plain":
            plain_sums[batch] = sums
            check = _common.rows_check(sums, sums, f"{how}: the reference (plain lookup)")
        else:
            check = _common.rows_check(
                sums, plain_sums[batch], f"{how}, vs the plain lookup's of the same batches"
            )
        hit_rate = 0.0
        if hot is not None:
            if (batch, budget) not in hit_rates:
                hit_rates[batch, budget] = hot.hit_rate(np.concatenate(host_batches[batch]))
            hit_rate = hit_rates[batch, budget]
        record = {
            "batch": batch,
            "tokens": TOKENS_PER_BATCH[batch],
            "rows_per_call": rows,
            "lever": lever,
            "order": order,
            "cache_gib": budget,
            "hit_rate": hit_rate,
            "distinct_fraction": distinct[batch],
            "ms_per_call": seconds * 1e3,
            "effective_mrows_per_s": rows / seconds / 1e6,
            "rawgather_packed_mrows_per_s": raw_packed[batch],
            "rawgather_packed_sorted_mrows_per_s": raw_sorted[batch],
            "vs_rawgather_packed": rows / seconds / 1e6 / raw_packed[batch],
            **check,
        }
        records.append(record)
        log(
            f"{batch:14s} {lever:6s} {budget:4g} GiB  hit {record['hit_rate']:.3f}  "
            f"{record['effective_mrows_per_s']:7.1f} Mrows/s  "
            f"({record['vs_rawgather_packed']:.2f}x rawgather packed)"
        )

    # 4. Each lever alone, then the cache at each budget alone and with dedup.
    for batch in batches:
        for lever in ("plain", "sorted", "dedup"):
            measure(batch, lever, lever, None, 0.0)
    for budget in args.budgets:
        start = time.perf_counter()
        with ej.HotRowCache(table, budget, profile, devices=[device]) as hot:
            log(
                f"cache {budget:g} GiB: {hot.capacity} rows, {hot.nbytes / 2**30:.3f} GiB, "
                f"built in {time.perf_counter() - start:.1f} s"
            )
            for batch in batches:
                measure(batch, "cache", "plain", hot, budget)
                measure(batch, "all", "dedup", hot, budget)
    table.close()

    # What order="auto" picks against what measured faster, per batch and budget.
    auto = []
    for batch in batches:
        for budget in [0.0, *args.budgets]:
            pair = {
                r["order"]: r["effective_mrows_per_s"]
                for r in records
                if r["batch"] == batch
                and r["cache_gib"] == budget
                and r["order"] in ("plain", "dedup")
            }
            auto.append(
                {
                    "batch": batch,
                    "cache_gib": budget,
                    "auto_order": choose_order(batches[batch][0].size),
                    "faster_order": max(pair, key=pair.get),
                    "dedup_over_plain": pair["dedup"] / pair["plain"],
                }
            )
    extra = {
        "footprint_gib": args.footprint_gib,
        "row_stride": STRIDE,
        "workload": data.meta,
        "layer": layout.layer_ids[0],
        "profile_rows": len(profile),
        "auto_dedup_min_ids": AUTO_DEDUP_MIN_IDS,
        "auto_order_check": auto,
        "goals": {
            # Each decode batch: a lever with at most 4 GiB of HBM at >= 2x rawgather packed.
            "decode_2x_rawgather_packed_within_4gib": all(
                max(
                    r["vs_rawgather_packed"]
                    for r in records
                    if r["batch"] == batch and r["cache_gib"] <= 4
                )
                >= 2
                for batch in ("decode_512", "decode_4096")
            ),
            "prefill_at_least_90_mrows_per_s": max(
                r["effective_mrows_per_s"] for r in records if r["batch"] == "prefill_87381"
            )
            >= 90,
        },
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    path = _common.write_results("cache_smoke" if args.smoke else "cache", records, extra)
    svg_plot(records, raw_packed, path.with_suffix(".svg"))
    log(f"wrote {path} and {path.with_suffix('.svg')}")
    _common.print_table(
        records,
        [
            "batch",
            "lever",
            "cache_gib",
            "hit_rate",
            "effective_mrows_per_s",
            "rawgather_packed_mrows_per_s",
            "vs_rawgather_packed",
            "rows_checked",
        ],
    )
    for a in auto:
        print(a)
    _common.finish_rows_checks(records)


if __name__ == "__main__":
    main()
