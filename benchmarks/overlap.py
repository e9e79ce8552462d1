"""Prefetch overlap: a jitted decode-like step (a stack of bf16 MLP blocks, Engram
fused at two blocks) with no Engram, an HBM table, a host table read by a plain
lookup, and a host table read by lookup_start / lookup_done. Fresh random ids
every step, so no row stays in L2. Step time: a jitted loop of --steps steps run
--repeats times on the device (one launch each, host out of the loop); the
median of the per-step means is reported.

Run on a GPU machine:  python benchmarks/overlap.py [--table-gib 64] [--batches 64 512 4096]
Writes benchmarks/results/overlap.json and overlap.png.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import time

# The HBM table is cudaMalloc'ed beside XLA's pool: XLA must not take 75 % of the GPU first.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

import engram_jax as ej
from engram_jax import checkpoint, reference
from engram_jax.lookup import PREFETCH_CTAS

try:
    from benchmarks import _common
except ImportError:  # run as a script
    import _common

DIM = 256
HEADS = 24  # rows per token per Engram layer: orders 2-4 x 8 heads
VARIANTS = ("no_engram", "hbm", "host_sync", "host_prefetch")
# (width, MLP hidden) per batch, so that one step takes 5-30 ms on an H200:
# weight-bound at 64 tokens, compute-bound at 4,096.
MODEL = {64: (8192, 32768), 512: (8192, 32768), 4096: (4096, 8192)}
DEFAULT_MODEL = (4096, 16384)


# -- tables ----------------------------------------------------------------------


def hbm_copy(host: ej.EngramTable, gib: float, device) -> tuple[ej.EngramTable, float]:
    """A device table of the host table's first rows, halving the size until it fits."""
    while gib >= 0.5:
        rows = min(host.num_rows, int(gib * 2**30) // host.row_stride)
        try:
            table = ej.EngramTable.allocate(rows, DIM, placement="device", device=device)
        except Exception as exc:  # cudaMalloc's failure comes as several exception types
            print(f"HBM table of {gib:g} GiB does not fit ({exc}); trying {gib / 2:g} GiB")
            gib /= 2
            continue
        records = host.allocation.host_array[: rows * host.row_stride].reshape(
            rows, host.row_stride
        )
        table.write_records(0, records)
        return table, rows * host.row_stride / 2**30
    raise RuntimeError("no HBM table of at least 0.5 GiB fits")


# -- the model -------------------------------------------------------------------


def init_params(key, width: int, hidden: int, blocks: int, n_engram: int, device) -> dict:
    # One small jit per tensor keeps the peak at one tensor's temporaries (beside the table).
    make = jax.jit(
        lambda k, std, shape: jax.random.normal(k, shape, jnp.bfloat16) * std.astype(jnp.bfloat16),
        static_argnums=2,
        out_shardings=jax.sharding.SingleDeviceSharding(device),
    )

    def normal(k, shape, std):
        return make(k, np.float32(std), shape)

    # Separate arrays per block: a slice of one stacked tensor could cost XLA a copy.
    keys = iter(jax.random.split(key, 2 * blocks + n_engram))
    return {
        "w1": [normal(next(keys), (width, hidden), width**-0.5) for _ in range(blocks)],
        "w2": [normal(next(keys), (hidden, width), hidden**-0.5) for _ in range(blocks)],
        "we": [normal(next(keys), (HEADS * DIM, width), 0.01) for _ in range(n_engram)],
    }


def block(x, w1, w2):
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    h = jax.nn.gelu(h.astype(jnp.bfloat16) @ w1)
    return x + h @ w2


def make_loop(variant: str, tables: dict, layers: tuple[int, ...], steps: int, ctas: int):
    """jit(x, key, params) -> x after `steps` decode steps of `variant`."""

    def step(i, x, key, params):
        batch = x.shape[0]
        n_blocks = len(params["w1"])
        handles, ids = [], None
        if variant != "no_engram":
            rows_in = tables["hbm" if variant == "hbm" else "host"].num_rows
            # The step's hash ids: fresh every step, as if hashed right after the embedding.
            ids = jax.random.randint(
                jax.random.fold_in(key, i), (len(layers), batch, HEADS), 0, rows_in, jnp.int32
            )
        if variant == "host_prefetch":
            handles = [
                ej.lookup_start(tables["host"], ids[j], max_ctas=ctas) for j in range(len(layers))
            ]
            x, handles = jax.lax.optimization_barrier((x, handles))  # start before block 0
        for b in range(n_blocks):
            if b in layers and variant != "no_engram":
                j = layers.index(b)
                if variant == "host_prefetch":
                    x, handle = jax.lax.optimization_barrier((x, handles[j]))  # done at block b
                    rows = ej.lookup_done(handle)
                else:
                    rows = ej.lookup(tables["hbm" if variant == "hbm" else "host"], ids[j])
                x = x + rows.reshape(batch, HEADS * DIM) @ params["we"][j]
            x = block(x, params["w1"][b], params["w2"][b])
        return x

    @jax.jit
    def loop(x, key, params):
        return jax.lax.fori_loop(0, steps, lambda i, x: step(i, x, key, params), x)

    return loop


def time_loop(loop, x, params, steps: int, repeats: int, seed: int) -> list[float]:
    """Milliseconds per step for each repeat (fresh ids: a new key every repeat)."""
    jax.block_until_ready(loop(x, jax.random.key(seed), params))  # compile and warm up
    per_step = []
    for r in range(repeats):
        key = jax.random.key(seed + 1 + r)
        start = time.perf_counter()
        jax.block_until_ready(loop(x, key, params))
        per_step.append((time.perf_counter() - start) * 1e3 / steps)
    return per_step


def time_lookups_alone(
    table, batch: int, n_layers: int, steps: int, repeats: int, ctas: int | None
) -> float:
    """ms per step of only the step's host lookups (every Engram layer), back to back."""

    @jax.jit
    def loop(acc, key):
        def body(i, acc):
            ids = jax.random.randint(
                jax.random.fold_in(key, i), (n_layers, batch, HEADS), 0, table.num_rows, jnp.int32
            )
            return acc + ej.lookup(table, ids, max_ctas=ctas)[..., 0].astype(jnp.float32).sum()

        return jax.lax.fori_loop(0, steps, body, acc)

    times = time_loop(lambda a, k, _: loop(a, k), jnp.float32(0), None, steps, repeats, 7)
    return statistics.median(times)


# -- output ----------------------------------------------------------------------


def plot(records: list[dict], path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot")
        return
    batches = sorted({r["batch"] for r in records})
    by = {(r["batch"], r["variant"]): r["step_ms"] for r in records}
    fig, (ax_ms, ax_rel) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(VARIANTS)
    for k, variant in enumerate(VARIANTS):
        xs = [i + (k - (len(VARIANTS) - 1) / 2) * width for i in range(len(batches))]
        ax_ms.bar(xs, [by.get((b, variant), np.nan) for b in batches], width, label=variant)
        if variant != "hbm":
            rel = [by.get((b, variant), np.nan) / by[(b, "hbm")] for b in batches]
            ax_rel.plot(range(len(batches)), rel, marker="o", label=variant)
    for ax in (ax_ms, ax_rel):
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("tokens per step")
    ax_ms.set_ylabel("step time (ms, median)")
    ax_ms.legend(fontsize=8)
    ax_rel.axhline(1.01, color="gray", linestyle="--", linewidth=1, label="1.01 x hbm")
    ax_rel.set_ylabel("step time / hbm step time")
    ax_rel.legend(fontsize=8)
    fig.suptitle("Engram at blocks 2 and 15: host table, plain lookup vs prefetch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=64, help="host table size")
    parser.add_argument(
        "--hbm-gib", type=float, default=None, help="HBM table size (default: same)"
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--engram-layers", type=int, nargs="+", default=[2, 15])
    parser.add_argument("--steps", type=int, default=16, help="steps per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops per variant")
    parser.add_argument("--prefetch-ctas", type=int, default=PREFETCH_CTAS)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--name", default="overlap", help="results file stem")
    parser.add_argument(
        "--model",
        type=int,
        nargs=2,
        metavar=("WIDTH", "HIDDEN"),
        help="one model size for every batch (default: sized per batch)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="check the script on the CPU backend (tiny sizes, plain host memory)",
    )
    args = parser.parse_args()
    layers = tuple(args.engram_layers)
    device = jax.devices("cpu" if args.smoke else "gpu")[0]
    t0 = time.perf_counter()

    host_rows = int(args.table_gib * 2**30) // reference.row_stride(DIM)
    host = ej.EngramTable.allocate(host_rows, DIM, placement="cpu" if args.smoke else "pinned")
    t_alloc = time.perf_counter()
    checkpoint.fill_dummy(host)  # every value fp8 1.0 under scale 2^0
    t_fill = time.perf_counter()
    print(
        f"host table: {host.nbytes / 2**30:.1f} GiB {host.placement}, {host_rows:,} rows "
        f"(allocated in {t_alloc - t0:.1f} s, filled in {t_fill - t_alloc:.1f} s)"
    )
    tables = {"host": host}
    hbm_gib = None
    if "hbm" in args.variants:
        if args.smoke:  # no HBM on the CPU backend: a second plain host table stands in
            tables["hbm"], hbm_gib = host, host.nbytes / 2**30
        else:
            tables["hbm"], hbm_gib = hbm_copy(host, args.hbm_gib or args.table_gib, device)
        print(f"HBM table: {hbm_gib:.1f} GiB ({time.perf_counter() - t_fill:.1f} s)")

    records, diagnostics = [], []
    for batch in args.batches:
        width, hidden = args.model or MODEL.get(batch, DEFAULT_MODEL)
        params = init_params(jax.random.key(batch), width, hidden, args.blocks, len(layers), device)
        x = jax.device_put(jnp.ones((batch, width), jnp.bfloat16), device)
        for variant in args.variants:
            loop = make_loop(variant, tables, layers, args.steps, args.prefetch_ctas)
            times = time_loop(loop, x, params, args.steps, args.repeats, seed=batch)
            records.append(
                {
                    "batch": batch,
                    "variant": variant,
                    "step_ms": statistics.median(times),
                    "step_ms_min": min(times),
                    "step_ms_max": max(times),
                    "step_ms_repeats": times,
                    "steps_per_repeat": args.steps,
                    "width": width,
                    "mlp_hidden": hidden,
                    "blocks": args.blocks,
                    "engram_layers": list(layers),
                    "rows_per_step": batch * HEADS * len(layers),
                    "table_gib": (
                        hbm_gib
                        if variant == "hbm"
                        else None
                        if variant == "no_engram"
                        else host.nbytes / 2**30
                    ),
                    "prefetch_ctas": args.prefetch_ctas if variant == "host_prefetch" else None,
                }
            )
            print(
                f"batch {batch:5d} {variant:14s} {records[-1]['step_ms']:8.3f} ms/step "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        # Where the time goes: the host lookups alone, and the blocks they can hide behind.
        for ctas in (args.prefetch_ctas, None):
            diagnostics.append(
                {
                    "batch": batch,
                    "what": f"host lookups alone, {ctas or 'all'} CTAs",
                    "ms": time_lookups_alone(
                        host, batch, len(layers), args.steps, args.repeats, ctas
                    ),
                }
            )
        no_engram = next(
            (r["step_ms"] for r in records if r["batch"] == batch and r["variant"] == "no_engram"),
            None,
        )
        if no_engram is not None:
            diagnostics.append(
                {
                    "batch": batch,
                    "what": f"blocks before layer {layers[0]} (est.)",
                    "ms": no_engram * layers[0] / args.blocks,
                }
            )
        del params

    for r in records:
        hbm = next(
            (h["step_ms"] for h in records if h["batch"] == r["batch"] and h["variant"] == "hbm"),
            None,
        )
        r["vs_hbm"] = r["step_ms"] / hbm if hbm else None
    path = _common.write_results(
        args.name,
        records,
        {
            "engram_jax": importlib.metadata.version("engram_jax"),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "host_table_gib": host.nbytes / 2**30,
            "hbm_table_gib": hbm_gib,
            "timing": f"median over {args.repeats} device loops of {args.steps} steps each "
            "(one launch per loop, synchronised at its end)",
            "diagnostics": diagnostics,
        },
    )
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s in all)")
    plot(records, path.with_suffix(".png"))
    _common.print_table(
        records, ["batch", "variant", "step_ms", "vs_hbm", "width", "rows_per_step"]
    )
    _common.print_table(diagnostics, ["batch", "what", "ms"])
    for table in set(tables.values()):
        table.close()


if __name__ == "__main__":
    main()
