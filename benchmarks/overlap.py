"""Prefetch overlap: a jitted decode-like step (a stack of bf16 MLP blocks, Engram
fused at two blocks) with no Engram, an HBM table, a host table read by a plain
lookup, and a host table read by lookup_start / lookup_done (plain, and with an
HBM hot-row cache). Each step's ids depend on the step's input, as a decode
step's hashes depend on the token sampled last: nothing can start before it.

Two id sources: ``uniform`` (fresh random rows every step: the worst case, no
row is ever hot) and ``text`` (each step's tokens drawn from random places of
held-out real text, hashed with DeepSeek-V4.1-Flash's layout: tools/workload.py;
the cache is profiled on the rest of the text). Step time: a jitted loop of
--steps steps on the device (one launch each, the host out of the loop). The
variants of one batch run in --repeats interleaved rounds (each round times
every variant once, in rotating order), so a drift of the machine's speed hits
all of them alike: the step time is the median over rounds, and ``vs_hbm`` the
median of each round's ratio to that round's HBM step.

Rows checked: the table's rows all differ (checkpoint.fill_distinct), and every
timed loop also returns a checksum of each Engram layer's rows of every step,
compared after timing with the plain HBM-table lookup's of the same ids (the
plain host lookup's without an HBM variant); a mismatch fails the run.

Run on a GPU machine:  python benchmarks/overlap.py [--table-gib 64] [--batches 64 512 4096]
Writes benchmarks/results/overlap.json and overlap.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The HBM table is cudaMalloc'ed beside XLA's pool: XLA must not take 75 % of the GPU first.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools import workload  # noqa: E402

DIM = 256
HEADS = 24  # rows per token per Engram layer: orders 2-4 x 8 heads
VARIANTS = ("no_engram", "hbm", "host_sync", "host_prefetch", "host_prefetch_cache")
# Beside them, for ids known a step early (a chunked prefill knows its next chunk):
# each layer's done is followed at once by the start of the next step's lookup, so
# the gather has a whole step to finish. Compared with the same HBM step.
AHEAD_VARIANTS = ("host_prefetch_ahead",)
# Diagnostics beside them: the start/done machinery on the HBM table (no PCIe
# reads, so only the mechanism and the gather's SMs cost), the starts left in the
# order XLA schedules them (no after=), rows visited in table order (and, with the
# cache, each tile's repeated rows read once: dedup), and prefetch on other grids:
# --sweep-ctas (every layer alike), --stagger (the first layer's apart).
EXTRA_VARIANTS = (
    "hbm_prefetch",
    "host_prefetch_any_order",
    "host_prefetch_sorted",
    "host_prefetch_ahead_sorted",
    "host_prefetch_cache_sorted",
    "host_prefetch_cache_dedup",
)
# (width, MLP hidden) per batch, so that one step takes 5-30 ms on an H200:
# weight-bound at 64 tokens, compute-bound at 4,096.
MODEL = {64: (8192, 32768), 512: (8192, 32768), 4096: (4096, 8192)}
DEFAULT_MODEL = (4096, 16384)
# --smoke's sizes where no flag gives them: the GPU defaults would fill a 64 GiB table
# and a 20-block model of 8192 x 32768 in host memory.
SMOKE_DEFAULTS = dict(
    table_gib=0.01, cache_gib=0.001, batches=[8], model=[64, 128], steps=2, repeats=1
)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    table: str | None  # "hbm", "host" or None (no Engram)
    prefetch: bool = False
    ctas: int | None = None
    cache: bool = False
    later_ctas: int | None = None  # grid of every Engram layer's lookup but the first
    ahead: bool = False  # each layer's rows started a step ahead (ids known early: chunked prefill)
    order: str = "plain"  # the prefetch's visiting order
    any_order: bool = False  # starts not chained with after=: XLA picks which gathers first


def variants_for(
    names: list[str],
    sweep_ctas: list[int],
    default_ctas: int | None,
    stagger: list[tuple[int, int]] = (),
) -> list[Variant]:
    known = {
        "no_engram": Variant("no_engram", None),
        "hbm": Variant("hbm", "hbm"),
        "host_sync": Variant("host_sync", "host"),
        "host_prefetch": Variant("host_prefetch", "host", True, default_ctas),
        "host_prefetch_cache": Variant("host_prefetch_cache", "host", True, default_ctas, True),
        "hbm_prefetch": Variant("hbm_prefetch", "hbm", True, default_ctas),
        "host_prefetch_ahead": Variant(
            "host_prefetch_ahead", "host", True, default_ctas, ahead=True
        ),
        "host_prefetch_any_order": Variant(
            "host_prefetch_any_order", "host", True, default_ctas, any_order=True
        ),
        "host_prefetch_sorted": Variant(
            "host_prefetch_sorted", "host", True, default_ctas, order="sorted"
        ),
        "host_prefetch_ahead_sorted": Variant(
            "host_prefetch_ahead_sorted", "host", True, default_ctas, ahead=True, order="sorted"
        ),
        "host_prefetch_cache_sorted": Variant(
            "host_prefetch_cache_sorted", "host", True, default_ctas, True, order="sorted"
        ),
        "host_prefetch_cache_dedup": Variant(
            "host_prefetch_cache_dedup", "host", True, default_ctas, True, order="dedup"
        ),
    }
    chosen = [known[n] for n in names]
    # Every host prefetch chosen, again on each grid of the sweep.
    chosen += [
        dataclasses.replace(v, name=f"{v.name}_ctas{c}", ctas=c)
        for v in list(chosen)
        if v.prefetch and v.table == "host"
        for c in sweep_ctas
    ]
    if "host_prefetch" in names:
        chosen += [
            Variant(f"host_prefetch_ctas{first}_{later}", "host", True, first, later_ctas=later)
            for first, later in stagger
        ]
    return chosen


# -- tables and ids --------------------------------------------------------------


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


@dataclasses.dataclass
class TextIds:
    """Row ids of real text, folded into the benchmark's table: ``measure`` [T, 2, 24]
    (the held-out tokens, on the device) and the profile of the rest."""

    measure: jax.Array
    profile: ej.HotRowProfile
    layer_ids: tuple[int, ...]


def text_ids(path: Path, num_rows: int, n_layers: int, device) -> TextIds:
    data = workload.load(path)
    layout = workload.flash_layout(data)
    if layout.n_cols != HEADS or layout.n_layers < n_layers:
        raise SystemExit(f"the text layout has {layout.n_layers} x {layout.n_cols} columns")
    # Both Engram layers read the one benchmark table: their ids share its rows.
    measure = workload.row_ids(data, "measure", layout)[:, :n_layers] % num_rows
    profile_ids = workload.row_ids(data, "profile", layout)[:, :n_layers] % num_rows
    profile = ej.HotRowProfile.from_ids(profile_ids)
    return TextIds(
        jax.device_put(measure.astype(np.int32), device), profile, layout.layer_ids[:n_layers]
    )


def step_ids(source, key, i, dep, n_layers: int, batch: int, num_rows: int) -> jax.Array:
    """[n_layers, batch, HEADS] ids of step ``i``; ``dep`` (0, computed from the
    step's input) makes them wait for the previous step, as a decode step's do."""
    k = jax.random.fold_in(key, i)
    if source is None:  # uniform
        ids = jax.random.randint(k, (n_layers, batch, HEADS), 0, num_rows, jnp.int32)
        return ids + dep
    positions = jax.random.randint(k, (batch,), 0, source.shape[0], jnp.int32) + dep
    return jnp.moveaxis(source[positions], 1, 0)


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


def make_loop(v: Variant, tables: dict, cache, layers, steps: int, source, num_rows: int):
    """jit(x, key, params) -> (x after ``steps`` decode steps of variant ``v``, uint32
    ``[steps, n_layers]`` checksums of each step's rows per Engram layer; zeros without)."""

    def start(table, layer_ids, j, after=()):
        """Layer ``j``'s lookup started; a step ahead, each layer's starts share a tag."""
        return ej.lookup_start(
            table,
            layer_ids,
            order=v.order,
            cache=cache if v.cache else None,
            max_ctas=(v.later_ctas or v.ctas) if j else v.ctas,
            tag=(v, j) if v.ahead else None,
            after=after,
        )

    def start_layers(table, ids):
        handles = []
        for j in range(len(layers)):
            # gathered in the order the layers need them
            handles.append(start(table, ids[j], j, () if v.any_order else handles[-1:]))
        return handles

    def step(i, carry, key, params):
        x, sums, handles = carry
        batch = x.shape[0]
        table = tables.get(v.table)
        ids = None
        if table is not None:
            # Never true, but XLA cannot know: the ids wait for the step's input.
            dep = (x[0, 0] > 1e30).astype(jnp.int32)
            ids = step_ids(source, key, i + v.ahead, dep, len(layers), batch, num_rows)
        if v.ahead:
            handles = list(handles)
        elif v.prefetch:
            handles = start_layers(table, ids)
            x, handles = jax.lax.optimization_barrier((x, handles))  # start before block 0
        for b in range(len(params["w1"])):
            if b in layers and table is not None:
                j = layers.index(b)
                if v.ahead:
                    x, handle = jax.lax.optimization_barrier((x, handles[j]))
                    rows = ej.lookup_done(handle)
                    # The next step's lookup of this layer, once this one is done.
                    next_ids, rows = jax.lax.optimization_barrier((ids[j], rows))
                    handles[j] = start(table, next_ids, j)
                elif v.prefetch:
                    x, handle = jax.lax.optimization_barrier((x, handles[j]))  # done at block b
                    rows = ej.lookup_done(handle)
                else:
                    rows = ej.lookup(table, ids[j])
                sums = sums.at[i, j].set(_common.rows_checksum(rows))
                x = x + rows.reshape(batch, HEADS * DIM) @ params["we"][j]
            x = block(x, params["w1"][b], params["w2"][b])
        return x, sums, tuple(handles) if v.ahead else ()

    @jax.jit
    def loop(x, key, params):
        sums = jnp.zeros((steps, len(layers)), jnp.uint32)
        handles = ()
        if v.ahead:  # step 0's lookups, started before the loop
            first = step_ids(source, key, 0, 0, len(layers), x.shape[0], num_rows)
            handles = tuple(start_layers(tables[v.table], first))
        # The last step's handles (the lookups of a step after it) are dropped.
        x, sums, _ = jax.lax.fori_loop(
            0, steps, lambda i, c: step(i, c, key, params), (x, sums, handles)
        )
        return x, sums

    return loop


def compile_loop(loop, args, seed: int):
    """The compiled loop, run once, and the Engram custom calls in it (more than one
    step's worth would mean XLA unrolled the loop, and a step's lookups could start
    during the previous one)."""
    x, params = args
    compiled = loop.lower(x, jax.random.key(seed), params).compile()
    jax.block_until_ready(compiled(x, jax.random.key(seed), params))  # warm up
    return compiled, compiled.as_text().count('custom_call_target="engram_')


def round_key(seed: int, r: int) -> jax.Array:
    return jax.random.key(seed + 1 + r)


def time_rounds(compiled: dict, args, steps: int, repeats: int, seed: int) -> tuple[dict, dict]:
    """Milliseconds per step of each compiled loop, ``repeats`` rounds interleaved:
    every round runs each loop once (the same fresh key for all: the same ids),
    starting one further along the list each round; and each loop's row checksums,
    ``[repeats, steps, n_layers]``."""
    x, params = args
    names = list(compiled)
    times = {name: [] for name in names}
    sums = {name: [] for name in names}
    for r in range(repeats):
        key = round_key(seed, r)
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            out = jax.block_until_ready(compiled[name](x, key, params))
            times[name].append((time.perf_counter() - start) * 1e3 / steps)
            sums[name].append(np.asarray(out[1]))
    return times, {name: np.stack(found) for name, found in sums.items()}


def reference_sums(compiled, args, repeats: int, seed: int) -> np.ndarray:
    """The row checksums of the untimed reference loop, for the rounds' keys."""
    x, params = args
    return np.stack(
        [np.asarray(compiled(x, round_key(seed, r), params)[1]) for r in range(repeats)]
    )


def check_variants(chosen, sums: dict, reference: np.ndarray, what: str, ref_name) -> dict:
    """Each variant's rows-check record fragment against the reference's checksums."""
    checks = {}
    for v in chosen:
        if v.table is None:
            checks[v.name] = {"rows_checked": None, "rows_check": "no Engram rows"}
        elif v.name == ref_name:
            check = _common.rows_check(reference, reference, f"the reference ({what})")
            checks[v.name] = {**check, "rows_check": check["rows_check"] + ": no zero checksum"}
        else:
            checks[v.name] = _common.rows_check(
                sums[v.name],
                reference,
                "uint32 checksum of each Engram layer's rows, every step of every round, "
                f"vs the {what} of the same ids",
            )
    return checks


def trace_summary(run, steps: int) -> dict | None:
    """Run ``run()`` once under the jax profiler: ``_common.stream_summary`` of it."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            run()
        return _common.stream_summary(tmp, steps)


def time_lookups_alone(
    table,
    source,
    batch,
    n_layers,
    steps,
    repeats,
    ctas,
    cache,
    num_rows,
    trace=False,
    side_stream=False,
    order="plain",
):
    """ms per step of only the step's lookups (every Engram layer), back to back, on
    XLA's stream or (``side_stream``) through lookup_start / lookup_done, the
    timed loops' row checksums ``[repeats, steps]``, and (``trace``) the profile
    summary of one more loop."""

    @jax.jit
    def loop(key):
        def body(i, sums):
            ids = step_ids(source, key, i, 0, n_layers, batch, num_rows)
            kw = dict(order=order, max_ctas=ctas, cache=cache)
            if side_stream:
                rows = ej.lookup_done(ej.lookup_start(table, ids, **kw))
            else:
                rows = ej.lookup(table, ids, **kw)
            return sums.at[i].set(_common.rows_checksum(rows))

        return jax.lax.fori_loop(0, steps, body, jnp.zeros(steps, jnp.uint32))

    per_step, sums = [], []
    jax.block_until_ready(loop(jax.random.key(7)))
    for r in range(repeats):
        start = time.perf_counter()
        sums.append(jax.block_until_ready(loop(jax.random.key(8 + r))))
        per_step.append((time.perf_counter() - start) * 1e3 / steps)
    summary = None
    if trace:
        summary = trace_summary(lambda: jax.block_until_ready(loop(jax.random.key(99))), steps)
    return statistics.median(per_step), np.stack([np.asarray(s) for s in sums]), summary


# -- output ----------------------------------------------------------------------


def plot(records: list[dict], path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot")
        return
    sources = sorted({r["ids"] for r in records}, reverse=True)
    fig, axes = plt.subplots(1, len(sources), figsize=(5.5 * len(sources), 4), squeeze=False)
    for ax, source in zip(axes[0], sources, strict=True):
        mine = [r for r in records if r["ids"] == source]
        batches = sorted({r["batch"] for r in mine})
        by = {(r["batch"], r["variant"]): r["vs_hbm"] for r in mine}
        for variant in VARIANTS:
            if variant == "hbm" or not any(r["variant"] == variant for r in mine):
                continue
            ax.plot(
                range(len(batches)),
                [by.get((b, variant), np.nan) for b in batches],
                marker="o",
                label=variant,
            )
        ax.axhline(1.01, color="gray", linestyle="--", linewidth=1, label="1.01 x hbm")
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("tokens per step")
        ax.set_ylabel("step time / HBM-table step time")
        ax.set_title(f"{source} ids")
        ax.legend(fontsize=8)
    fig.suptitle("Engram at blocks 2 and 15, 64 GiB host table: plain lookup vs prefetch")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _first_later(text: str) -> tuple[int, int]:
    try:
        first, later = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST:LATER CTAs, got {text!r}") from None
    if first < 1 or later < 1:
        raise argparse.ArgumentTypeError(f"CTA counts must be >= 1, got {text!r}")
    return first, later


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-gib", type=float, default=64, help="host table size")
    parser.add_argument(
        "--hbm-gib", type=float, default=None, help="HBM table size (default: same)"
    )
    parser.add_argument("--cache-gib", type=float, default=4, help="HBM hot-row cache budget")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument(
        "--ids", nargs="+", default=["uniform", "text"], choices=["uniform", "text"]
    )
    parser.add_argument("--data", type=Path, default=workload.DEFAULT_PATH)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--engram-layers", type=int, nargs="+", default=[2, 15])
    parser.add_argument("--steps", type=int, default=16, help="steps per timed loop")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved timing rounds")
    parser.add_argument(
        "--prefetch-ctas",
        type=int,
        default=None,
        help="grid of the prefetch gathers (default: engram_jax.prefetch_ctas of the ids)",
    )
    parser.add_argument(
        "--trace",
        nargs="*",
        default=[],
        help="variants to profile once (jax profiler): per-stream busy and idle time; "
        "'alone' profiles the lookups-alone loops too",
    )
    parser.add_argument(
        "--sweep-ctas",
        type=int,
        nargs="*",
        default=[],
        help="also time every host prefetch variant chosen on these grid sizes",
    )
    parser.add_argument(
        "--stagger",
        type=_first_later,
        nargs="*",
        default=[],
        metavar="FIRST:LATER",
        help="also time host_prefetch with FIRST CTAs for the first Engram layer's lookup "
        "and LATER for the others (uniform ids)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=VARIANTS + AHEAD_VARIANTS + EXTRA_VARIANTS,
    )
    parser.add_argument("--name", default="overlap", help="results file stem")
    parser.add_argument(
        "--hlo-dir", type=Path, default=None, help="write each compiled loop's HLO here"
    )
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
        help="check the script on the CPU backend (plain host memory; unless given, a 10 MiB "
        "table, batch 8, a 64 x 128 model, 2 steps, 1 round)",
    )
    args = parser.parse_args()
    if args.smoke:
        parser.set_defaults(**SMOKE_DEFAULTS)
        args = parser.parse_args()
    layers = tuple(args.engram_layers)
    device = jax.devices("cpu" if args.smoke else "gpu")[0]
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {message}", flush=True)

    host_rows = int(args.table_gib * 2**30) // ej.row_stride(DIM)
    host = ej.EngramTable.allocate(host_rows, DIM, placement="cpu" if args.smoke else "pinned")
    fill_s = checkpoint.fill_distinct(host)  # every row different: a wrong row shows
    log(
        f"host table: {host.nbytes / 2**30:.1f} GiB {host.placement}, {host_rows:,} rows, "
        f"filled at {host.nbytes / 2**30 / fill_s:.1f} GiB/s"
    )
    tables = {"host": host}
    hbm_gib = None
    if {"hbm", "hbm_prefetch"} & set(args.variants):
        if args.smoke:  # no HBM on the CPU backend: the host table stands in
            tables["hbm"], hbm_gib = host, host.nbytes / 2**30
        else:
            tables["hbm"], hbm_gib = hbm_copy(host, args.hbm_gib or args.table_gib, device)
        log(f"HBM table: {hbm_gib:.1f} GiB")
    # Every variant reads the same ids: those both tables hold.
    num_rows = min(t.num_rows for t in tables.values())

    text, cache = None, None
    if "text" in args.ids:
        text = text_ids(args.data, num_rows, len(layers), device)
        log(f"text ids: {text.measure.shape[0]:,} held-out tokens, layers {text.layer_ids}")
        if any(v.startswith("host_prefetch_cache") for v in args.variants):
            cache = ej.HotRowCache(host, args.cache_gib, text.profile, devices=[device])
            log(f"cache: {cache.capacity:,} rows, {cache.nbytes / 2**30:.2f} GiB")

    variants = variants_for(args.variants, args.sweep_ctas, args.prefetch_ctas, args.stagger)
    records, diagnostics = [], []
    hit_rate = cache.hit_rate(np.asarray(text.measure).reshape(-1)) if cache else None

    def save(complete: bool) -> Path:
        """Write what has been measured so far: a run cut short still leaves its figures."""
        for r in records:
            r.setdefault("vs_hbm", None)
        extra = {
            "engram_jax": importlib.metadata.version("engram_jax"),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "complete": complete,
            "host_table_gib": host.nbytes / 2**30,
            "hbm_table_gib": hbm_gib,
            "cache_gib": cache.nbytes / 2**30 if cache else None,
            "cache_hit_rate_text": hit_rate,
            "text_layers": list(text.layer_ids) if text else None,
            "timing": f"median over {args.repeats} interleaved rounds of one device loop of "
            f"{args.steps} steps per variant (one launch per loop, synchronised at its end); "
            "vs_hbm: median of the rounds' ratios",
            "diagnostics": diagnostics,
        }
        return _common.write_results(args.name + ("_smoke" if args.smoke else ""), records, extra)

    for batch in args.batches:
        width, hidden = args.model or MODEL.get(batch, DEFAULT_MODEL)
        params = init_params(jax.random.key(batch), width, hidden, args.blocks, len(layers), device)
        x = jax.device_put(jnp.ones((batch, width), jnp.bfloat16), device)

        def default_grid(order, hot=None, batch=batch):
            """--prefetch-ctas, else engram_jax's grid for a gather of this batch's ids."""
            return args.prefetch_ctas or ej.prefetch_ctas(batch * HEADS, order=order, cache=hot)

        for source_name in args.ids:
            source = text.measure if source_name == "text" else None
            chosen = [
                v
                for v in variants
                # a cache of uniform ids would only hold its budget's share
                if not (v.cache and (source is None or cache is None))
                # grid sweeps of uncached prefetches on uniform ids only
                and not ("_ctas" in v.name and not v.cache and source is not None)
            ]
            compiled, engram_calls = {}, {}
            for v in chosen:
                loop = make_loop(v, tables, cache, layers, args.steps, source, num_rows)
                compiled[v.name], engram_calls[v.name] = compile_loop(loop, (x, params), batch)
                if args.hlo_dir:
                    args.hlo_dir.mkdir(parents=True, exist_ok=True)
                    hlo_path = args.hlo_dir / f"{batch}_{source_name}_{v.name}.hlo.txt"
                    hlo_path.write_text(compiled[v.name].as_text())
            times, sums = time_rounds(compiled, (x, params), args.steps, args.repeats, seed=batch)
            # The rows' reference: the plain lookup of a variant timed here, else an untimed one.
            ref_name = next((n for n in ("hbm", "host_sync") if n in compiled), None)
            if ref_name is None:
                ref = Variant("reference", "host")
                ref_loop = make_loop(ref, tables, cache, layers, args.steps, source, num_rows)
                ref_compiled = compile_loop(ref_loop, (x, params), batch)[0]
                ref_sums = reference_sums(ref_compiled, (x, params), args.repeats, batch)
            else:
                ref_sums = sums[ref_name]
            what = {
                "hbm": "plain lookup of the host table as HBM's"
                if args.smoke
                else "plain HBM-table lookup",
                "host_sync": "plain host-table lookup",
                None: "plain host-table lookup, untimed",
            }[ref_name]
            checks = check_variants(chosen, sums, ref_sums, what, ref_name)
            for v in chosen:
                mine = times[v.name]
                record = {
                    "batch": batch,
                    "ids": source_name,
                    "variant": v.name,
                    "step_ms": statistics.median(mine),
                    "step_ms_min": min(mine),
                    "step_ms_max": max(mine),
                    "step_ms_repeats": mine,
                    "steps_per_repeat": args.steps,
                    "engram_calls_in_hlo": engram_calls[v.name],
                    "width": width,
                    "mlp_hidden": hidden,
                    "blocks": args.blocks,
                    "engram_layers": list(layers),
                    "rows_per_step": batch * HEADS * len(layers) if v.table else 0,
                    "table_gib": (
                        None
                        if v.table is None
                        else hbm_gib
                        if v.table == "hbm"
                        else host.nbytes / 2**30
                    ),
                    "prefetch_ctas": (v.ctas or default_grid(v.order, cache if v.cache else None))
                    if v.prefetch
                    else None,
                    "cache_gib": cache.nbytes / 2**30 if v.cache else None,
                    "later_layers_ctas": v.later_ctas,
                    **checks[v.name],
                }
                if "hbm" in times:
                    rounds = [t / h for t, h in zip(mine, times["hbm"], strict=True)]
                    record["vs_hbm"] = statistics.median(rounds)
                    record["vs_hbm_rounds"] = rounds
                if v.name in args.trace and not args.smoke:
                    call_args = (x, jax.random.key(batch + 99), params)
                    record["trace"] = trace_summary(
                        lambda c=compiled[v.name], a=call_args: jax.block_until_ready(c(*a)),
                        args.steps,
                    )
                records.append(record)
                log(
                    f"batch {batch:5d} {source_name:7s} {v.name:22s} "
                    f"{record['step_ms']:8.3f} ms/step  {record.get('vs_hbm') or 0:.4f} x hbm"
                )
            del compiled
            # Where the time goes: the step's host lookups alone, and the blocks before layer 2.
            default_ctas = default_grid("plain")
            alone = [(default_ctas, None), (None, None)]
            alone += [(c, None) for c in args.sweep_ctas if source is None]
            if source is not None and cache is not None:
                alone.append((default_grid("plain", cache), cache))
            # The same gathers through lookup_start / lookup_done (the side stream) and
            # from the HBM table: what a prefetch grid moves when nothing else runs.
            probes = [("host", ctas, hot, False, "plain") for ctas, hot in alone]
            probes.append(("host", default_ctas, None, True, "plain"))
            if "host_prefetch_sorted" in args.variants:
                probes.append(("host", default_grid("sorted"), None, False, "sorted"))
            if "hbm" in tables and "alone" in args.trace:
                probes.append(("hbm", default_ctas, None, False, "plain"))
            # Their rows' reference: the plain host lookup on every SM, (None, None) above.
            plain_probe = ("host", None, None, False, "plain")
            alone_sums, alone_records = {}, []
            for probe in probes:
                table_name, ctas, hot, side_stream, order = probe
                ms, alone_sums[probe], summary = time_lookups_alone(
                    tables[table_name],
                    source,
                    batch,
                    len(layers),
                    args.steps,
                    args.repeats,
                    ctas,
                    hot,
                    num_rows,
                    trace="alone" in args.trace and not args.smoke,
                    side_stream=side_stream,
                    order=order,
                )
                alone_records.append(
                    {
                        "batch": batch,
                        "ids": source_name,
                        "what": f"{table_name} lookups alone, {ctas or 'all'} CTAs"
                        + (f", cache {args.cache_gib:g} GiB" if hot else "")
                        + (", lookup_start/done" if side_stream else "")
                        + (f", order {order}" if order != "plain" else ""),
                        "ms": ms,
                        "trace": summary,
                    }
                )
            for probe, record in zip(probes, alone_records, strict=True):
                how = "uint32 checksum of every step's rows (all layers), every timed loop"
                how += (
                    ": the reference"
                    if probe == plain_probe
                    else ", vs the plain host lookup on every SM of the same ids"
                )
                record.update(_common.rows_check(alone_sums[probe], alone_sums[plain_probe], how))
            diagnostics += alone_records
            save(complete=False)
        no_engram = [
            r["step_ms"] for r in records if (r["batch"], r["variant"]) == (batch, "no_engram")
        ]
        if no_engram:
            diagnostics.append(
                {
                    "batch": batch,
                    "ids": "-",
                    "what": f"blocks before layer {layers[0]} (est.)",
                    "ms": statistics.median(no_engram) * layers[0] / args.blocks,
                }
            )
        del params

    path = save(complete=True)
    log(f"wrote {path}")
    plot(records, path.with_suffix(".png"))
    _common.print_table(
        records,
        ["batch", "ids", "variant", "step_ms", "vs_hbm", "engram_calls_in_hlo", "rows_checked"],
    )
    _common.print_table(diagnostics, ["batch", "ids", "what", "ms", "rows_checked"])
    if cache is not None:
        cache.close()
    for table in set(tables.values()):
        table.close()
    _common.finish_rows_checks(records + diagnostics)


if __name__ == "__main__":
    main()
