"""Train a small decoder with Engram layers whose tables live in host memory, beside
the same decoder without Engram, on real text.

The text is the repository's workload (Python docstrings in DeepSeek-V4 tokens,
compressed as Engram compresses them; benchmarks/data/docstrings.npz) or any text
file (--text), tokenised with the DeepSeek-V4 tokenizer and compressed here. The
Engram tables are ej.TrainableTable rows in host memory: each step looks up the
rows its n-grams hash to (ej.lookup, or with --prefetch ej.lookup_start a step
ahead), takes the loss's gradient with respect to them, and updates each distinct
row in place (ej.apply_gradients: lazy Adam at 5x the base learning rate, as
DeepSeek trains them, or row-wise Adagrad); optax updates the rest of the model.
Both models start from the same seed and see the same batches; the script prints
their losses and writes a PNG of both curves.

    python examples/train.py                         # CPU: about two minutes
    python examples/train.py --steps 50 --prefetch --out /tmp/loss.png
    python examples/train.py --model small --table-gib 16 --batch 32 --seq 512   # GPU

The pieces are in training/: data.py (text, vocabulary, batches), model.py (the
decoder, reusing serving/model.py's blocks), steps.py (tables and jitted steps).
"""

from __future__ import annotations

import os

# A table placed in HBM is allocated outside XLA's pool (a user's own setting wins).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from serving.cli import HelpFormatter, UserError, load_tokenizer  # noqa: E402
from serving.tables import check_fits  # noqa: E402
from training import data, model, steps  # noqa: E402

import engram_jax as ej  # noqa: E402

GPU_DEFAULTS = dict(table_gib=16.0, table_dtype="bfloat16")
CPU_DEFAULTS = dict(table_gib=0.1, table_dtype="float32")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", choices=sorted(model.MODELS), default="tiny", help="decoder size")
    p.add_argument("--steps", type=int, default=300, metavar="N", help="training steps per model")
    p.add_argument("--batch", type=int, default=8, metavar="N", help="sequences per step")
    p.add_argument("--seq", type=int, default=64, metavar="N", help="tokens per sequence")
    p.add_argument(
        "--vocab",
        type=int,
        default=4096,
        metavar="N",
        help="decoder vocabulary: the N-1 most frequent tokens of the text and one for the rest "
        "(the n-gram hashes see every token)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="base learning rate (Adam, optax)")
    p.add_argument("--warmup", type=int, default=20, metavar="N", help="linear warmup steps")
    p.add_argument(
        "--table-gib",
        type=float,
        metavar="GIB",
        help="rows of all Engram tables together, GiB, optimizer state not counted "
        f"(default: {GPU_DEFAULTS['table_gib']:g} on GPU, {CPU_DEFAULTS['table_gib']:g} on CPU)",
    )
    p.add_argument(
        "--table-dtype",
        choices=("float32", "bfloat16"),
        help="rows (and lazy_adam moments); default: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument(
        "--table-optimizer",
        choices=steps.TABLE_OPTIMIZERS,
        default="lazy_adam",
        help="lazy_adam: DeepSeek's choice, 2 moments per value; row_adagrad: 4 bytes per row, "
        "for tables whose Adam state would not fit in host memory",
    )
    p.add_argument(
        "--table-init-std", type=float, default=0.0, metavar="S", help="rows start ~ N(0, S)"
    )
    p.add_argument(
        "--placement", default="auto", choices=sorted(ej.PLACEMENTS), help="where the tables live"
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="gather the next step's rows (ej.lookup_start) while this step runs, started "
        "after this step's row updates: the same rows as without",
    )
    p.add_argument(
        "--stale",
        action="store_true",
        help="with --prefetch: one step stale: each step's row update runs in the next step, "
        "in the background on the side stream beside its forward pass, and the rows after "
        "next are gathered behind it during the backward pass, so no PCIe traffic waits for "
        "a step's gradients; a step trains on rows that miss the last step's update",
    )
    p.add_argument(
        "--split-update",
        action="store_true",
        help="with --prefetch (exact order): update at once only the rows the next batch "
        "reads, and read those again into the gathered rows; the rest of the update runs in "
        "the next step on the side stream beside its forward pass: the same rows as without",
    )
    p.add_argument(
        "--prefetch-ctas",
        type=int,
        metavar="N",
        help="with --prefetch: CTAs of each gather (ej.lookup_start's max_ctas); default: the "
        "GPU's SM count (nothing runs beside a training step's gather to leave SMs for), the "
        "library's default on the CPU",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's weights and activations (the tables: --table-dtype)",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=4,
        metavar="N",
        help="held-out batches scored at each evaluation",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        help="steps between held-out evaluations (default: a quarter of --steps)",
    )
    p.add_argument("--log-every", type=int, default=25, metavar="N", help="steps between prints")
    p.add_argument("--data", type=Path, default=data.DEFAULT_DATA, help="the workload token file")
    p.add_argument(
        "--text",
        type=Path,
        metavar="FILE",
        help="train on this text instead, one document per line",
    )
    p.add_argument("--out", type=Path, default=Path("train_loss.png"), help="the loss plot (PNG)")
    p.add_argument("--losses", type=Path, metavar="FILE", help="write every loss as JSON")
    p.add_argument(
        "--export",
        type=Path,
        metavar="DIR",
        help="write the trained tables as fp8 serving checkpoints, one file per layer",
    )
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train the model without Engram (same seed, batches, steps)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="N", help="weights, tables, batches")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "eval_batches", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.vocab < 2:
        p.error("--vocab must be >= 2")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if not args.lr > 0:
        p.error("--lr must be > 0")
    if args.table_gib is not None and not args.table_gib > 0:
        p.error("--table-gib must be > 0")
    if not args.table_init_std >= 0:
        p.error("--table-init-std must be >= 0")
    if args.eval_every is not None and args.eval_every < 1:
        p.error("--eval-every must be >= 1")
    if args.prefetch_ctas is not None and args.prefetch_ctas < 1:
        p.error("--prefetch-ctas must be >= 1")
    if args.stale and not args.prefetch:
        p.error("--stale needs --prefetch")
    if args.split_update and (args.stale or not args.prefetch):
        p.error("--split-update needs --prefetch without --stale")
    if args.out.suffix.lower() != ".png":
        p.error(f"--out must name a .png file, got {args.out}")
    return args


def evaluate(run, params, held_out, hash_batch) -> float:
    losses = []
    for batch in held_out:
        ids = hash_batch(batch["compressed"], batch["segments"])
        losses.append(run.eval(params, ids, batch["inputs"], batch["targets"]))
    return float(np.mean(jax.device_get(losses)))


def train(run, params, dense, batches, held_out, hash_batch, args, name) -> dict:
    """``args.steps`` steps of one model; its losses, held-out losses and seconds."""
    opt_state = dense.init(params)
    every = args.eval_every or max(1, args.steps // 4)
    losses, evals = [], []
    # With --prefetch: what the next step takes in (lookups in flight, or rows).
    first = batches[0]
    carry = run.begin(hash_batch(first["compressed"], first["segments"]))
    start = time.perf_counter()
    for i in range(args.steps):
        batch = batches[i]
        ids = hash_batch(batch["compressed"], batch["segments"])
        next_ids = None
        if carry is not None:
            nxt = batches[i + 1]
            next_ids = hash_batch(nxt["compressed"], nxt["segments"])
        params, opt_state, loss, carry = run.advance(
            params, opt_state, jnp.int32(i), carry, ids, batch["inputs"], batch["targets"], next_ids
        )
        losses.append(loss)
        if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
            print(f"{name:>8} step {i + 1:5d}  loss {float(loss):.4f}", flush=True)
        if (i + 1) % every == 0 or i + 1 == args.steps:
            carry = run.flush(carry)  # the tables as of this step (a stale step defers it)
            evals.append((i + 1, evaluate(run, params, held_out, hash_batch)))
    run.end(carry)  # the last prefetch, never used
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    return dict(
        losses=[float(x) for x in jax.device_get(losses)],
        held_out=evals,
        seconds=seconds,
        params=params,
    )


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for (name, res), color in zip(results.items(), ("tab:blue", "tab:orange"), strict=False):
        y = np.asarray(res["losses"])
        x = np.arange(1, y.size + 1)
        ax.plot(x, y, color=color, alpha=0.25, linewidth=0.8)
        k = max(1, y.size // 20)
        smooth = np.convolve(y, np.ones(k) / k, mode="valid")
        ax.plot(x[k - 1 :], smooth, color=color, label=f"{name} (train, mean of {k})")
        ex, ey = zip(*res["held_out"], strict=True)
        ax.plot(ex, ey, "o--", color=color, label=f"{name} (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token cross-entropy (nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc}") from None
    finally:
        plt.close(fig)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a run trains on and with, from its flags: the text, the decoder's vocabulary
    and config, the tables' layout and dtypes, the prefetch's grid."""

    corpus: data.Corpus
    vocab: data.Vocabulary
    cfg: model.ModelConfig
    layout: ej.EngramLayout
    table_gib: float
    table_dtype: np.dtype
    dtype: np.dtype  # the model's weights
    host_bytes: int  # rows and optimizer state of every table
    prefetch_ctas: int | None

    @property
    def rows_gib(self) -> float:
        """GiB of the tables' rows, optimizer state not counted."""
        rows = sum(self.layout.num_embeddings)
        return rows * self.cfg.row_dim * self.table_dtype.itemsize / 2**30


def setup(args, device) -> Setup:
    """The run's :class:`Setup` on ``device`` (defaults by platform); allocates nothing."""
    defaults = GPU_DEFAULTS if device.platform == "gpu" else CPU_DEFAULTS
    table_gib = args.table_gib or defaults["table_gib"]
    table_dtype = jnp.dtype(args.table_dtype or defaults["table_dtype"])
    if args.placement == "device" and device.platform != "gpu":
        raise UserError("--placement device puts the tables in GPU memory; no GPU is in use")

    tokenizer, compressor = load_tokenizer()
    if args.text is not None:
        corpus = data.from_text(args.text, tokenizer, compressor)
    else:
        corpus = data.from_workload(args.data, compressor)
    vocab = data.Vocabulary(corpus.train, corpus.compressed_vocab_size, args.vocab)
    cfg = model.config(args.model, vocab.size)
    per_row = cfg.row_dim * table_dtype.itemsize
    try:
        layout = model.layout(cfg, corpus, table_gib * 2**30, per_row)
    except ValueError as exc:
        raise UserError(f"cannot lay out tables of {table_gib} GiB: {exc}") from None
    rows = sum(layout.num_embeddings)
    host_bytes = rows * steps.bytes_per_row(cfg.row_dim, table_dtype, args.table_optimizer)
    ctas = args.prefetch_ctas
    if ctas is None and device.platform == "gpu":
        ctas = getattr(device, "core_count", None)
    return Setup(
        corpus, vocab, cfg, layout, table_gib, table_dtype, jnp.dtype(args.dtype), host_bytes, ctas
    )


def run(args) -> None:
    device = jax.devices()[0]
    run_setup = setup(args, device)
    corpus, vocab, cfg, layout = (
        run_setup.corpus, run_setup.vocab, run_setup.cfg, run_setup.layout
    )  # fmt: skip
    table_gib, table_dtype, host_bytes = (
        run_setup.table_gib, run_setup.table_dtype, run_setup.host_bytes
    )  # fmt: skip
    rows = sum(layout.num_embeddings)
    check_fits(host_bytes, args.placement, device)  # before anything is allocated
    # One batch more than the steps: the last prefetch reads it.
    stream = data.Batches(corpus.train, corpus.train_docs, vocab, args.batch, args.seq, args.seed)
    batches = [next(stream) for _ in range(args.steps + 1)]
    held = data.Batches(
        corpus.held_out, corpus.held_out_docs, vocab, args.batch, args.seq, args.seed + 1
    )
    held_out = [next(held) for _ in range(args.eval_batches)]
    hash_batch = steps.make_hash(layout)

    mode = "off"
    if args.prefetch:
        mode = "stale" if args.stale else "exact_split" if args.split_update else "exact"
    grid = run_setup.prefetch_ctas or "the library's default"
    print(
        f"text: {corpus.source}, {corpus.train.size:,} training tokens, {corpus.held_out.size:,} "
        f"held out; vocabulary {vocab.size} ({vocab.coverage:.1%} of tokens)\n"
        f"model {args.model}: {cfg.n_layers} blocks, d_model {cfg.d_model}, Engram at blocks "
        f"{cfg.engram_layers}, {cfg.n_cols} rows of {cfg.row_dim} per token per layer\n"
        f"tables: {rows:,} rows of {table_dtype.name}, {run_setup.rows_gib:.3f} GiB "
        f"({host_bytes / 2**30:.3f} GiB with {args.table_optimizer} state), "
        f"placement {args.placement}; prefetch {mode}"
        + (f" on {grid} CTAs" if mode != "off" else "")
        + f"; device {device.platform}",
        flush=True,
    )

    dense, schedule = steps.dense_optimizer(args.lr, args.warmup)
    params = model.init_params(cfg, args.seed, run_setup.dtype)
    results = {}
    with contextlib.ExitStack() as stack:
        tables = steps.build_tables(
            layout,
            table_dtype,
            args.table_optimizer,
            args.placement,
            device,
            args.table_init_std,
            args.seed,
            stack,
        )
        # One step stale (or the part of the update the next batch does not read), the
        # updates run on the library's side stream beside the next step's forward pass
        # (benchmarks/README.md: 1.10x the HBM-table step vs 1.24x).
        updates = dict(update_stream="side") if mode in steps.DEFERRING_MODES else {}
        engram = steps.Steps(
            cfg, tables, dense, schedule, mode, prefetch_ctas=run_setup.prefetch_ctas, **updates
        )
        copy = jax.tree.map(jnp.copy, params)  # the step donates its params
        results["engram"] = train(
            engram, copy, dense, batches, held_out, hash_batch, args, "engram"
        )
        if args.export is not None:
            args.export.mkdir(parents=True, exist_ok=True)
            for layer_id, table in zip(layout.layer_ids, tables, strict=True):
                path = ej.export_table(
                    table, args.export / f"layer{layer_id}.safetensors", layer_id
                )
                print(f"exported layer {layer_id}'s table to {path}")
    baseline = steps.Steps(cfg, None, dense, schedule, "off")
    if args.baseline:
        params = jax.tree.map(jnp.copy, params)  # two leaves share a buffer: donate copies
        results["baseline"] = train(
            baseline, params, dense, batches, held_out, hash_batch, args, "baseline"
        )

    tokens = args.batch * args.seq
    tail = max(1, args.steps // 10)
    for name, res in results.items():
        res.pop("params")
        final = float(np.mean(res["losses"][-tail:]))
        print(
            f"{name:>8}: loss {res['losses'][0]:.3f} -> {final:.3f} (mean of the last {tail} "
            f"steps), held out {res['held_out'][-1][1]:.3f}; {res['seconds']:.1f} s, "
            f"{tokens * args.steps / res['seconds']:,.0f} tokens/s"
        )
    if args.baseline:
        gap = results["baseline"]["held_out"][-1][1] - results["engram"]["held_out"][-1][1]
        print(f"held-out loss, baseline minus Engram: {gap:+.3f} nats")
    title = (
        f"{args.model}, {args.steps} steps x {args.batch} x {args.seq} tokens; Engram tables "
        f"{table_gib:g} GiB {table_dtype.name}, {args.table_optimizer}, prefetch {mode}"
    )
    plot(results, args.out, title)
    print(f"wrote {args.out}")
    if args.losses is not None:
        record = dict(config=vars(args) | dict(mode=mode, table_gib=table_gib), results=results)
        args.losses.write_text(json.dumps(record, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except UserError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
