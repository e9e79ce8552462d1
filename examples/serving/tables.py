"""The Engram tables a serving run reads: the hash layout sized to a memory budget,
one table per Engram layer (seeded rows that all differ, or a DeepSeek-named
safetensors checkpoint), refused up front where it cannot fit, and HBM hot-row
caches chosen by hashing profile text.
"""

from __future__ import annotations

import contextlib
import sys
import time

import jax
import numpy as np

import engram_jax as ej

from . import model
from .cli import UserError, check_stop


def make_layout(cfg: model.ModelConfig, compressor: ej.TokenCompressor, table_gib: float):
    """The hash layout whose tables together take about ``table_gib`` GiB."""
    stride = ej.row_stride(cfg.row_dim)
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
            pad_id=compressor.compress_id(model.PAD_TOKEN_ID),
        )
    except ValueError as exc:
        raise UserError(f"cannot lay out tables of {table_gib} GiB: {exc}") from None


def table_bytes(layout) -> int:
    return sum(layout.num_embeddings) * ej.row_stride(layout.head_dim)


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
    """The seed of an Engram layer's distinct rows: the layers' rows differ too."""
    return 1000 * seed + layer_index


def write_checkpoint(path: str, layout, seed: int) -> None:
    """The random tables of this configuration, whole, as a DeepSeek-named checkpoint."""
    layers = {}
    for i, layer_id in enumerate(layout.layer_ids):
        rows = layout.num_embeddings[i]
        with ej.dummy_table(
            rows, layout.head_dim, placement="cpu", fill="distinct", seed=table_seed(seed, i)
        ) as table:
            layers[layer_id] = table.read_rows(np.arange(rows))
    try:
        ej.save_checkpoint(path, layers)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc}") from None


def open_checkpoint(path: str, layout) -> ej.Checkpoint:
    """Open the checkpoint and check it holds a table of the layout's shape for every layer."""
    try:
        found = ej.Checkpoint(path)
        weights = [found.layer(layer_id)[0] for layer_id in layout.layer_ids]
    except (ej.CheckpointError, OSError) as exc:
        raise UserError(f"cannot use checkpoint {path}: {exc}") from None
    for weight, rows in zip(weights, layout.num_embeddings, strict=True):
        want = (rows, layout.head_dim)
        if tuple(weight.shape) != want:
            raise UserError(
                f"{weight.name} in {weight.file} is {tuple(weight.shape)}; this model's layout "
                f"needs {want} (--model and --table-gib must match the checkpoint's)"
            )
    return found


def build_tables(
    layout,
    placement: str,
    device,
    stack: contextlib.ExitStack,
    *,
    checkpoint: ej.Checkpoint | None = None,
    fill: str = "distinct",
    seed: int = 0,
    progress: bool = True,
) -> tuple[ej.EngramTable, ...]:
    """One table per Engram layer, each closed by ``stack``: the checkpoint's rows, or
    ``fill`` ("distinct": seeded rows that all differ; "ones": every value 1.0)."""
    on_device = device if device.platform == "gpu" else None
    tables = []
    for i, layer_id in enumerate(layout.layer_ids):
        check_stop()
        start = time.perf_counter()
        try:
            if checkpoint is not None:
                table = ej.load_table(
                    checkpoint, layer_id, placement=placement, device=on_device, progress=progress
                )
            else:
                table = ej.dummy_table(
                    layout.num_embeddings[i],
                    layout.head_dim,
                    placement=placement,
                    device=on_device,
                    fill=fill,
                    seed=table_seed(seed, i),
                )
        except (ValueError, RuntimeError, MemoryError) as exc:  # CudaUnavailableError included
            raise UserError(f"cannot build the Engram tables ({placement}): {exc}") from None
        stack.callback(table.close)
        tables.append(table)
        if progress:
            print(
                f"engram table {layer_id} ({table.placement}): {table.nbytes / 2**30:.3f} GiB "
                f"in {time.perf_counter() - start:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return tuple(tables)


PROFILE_CHUNK_TOKENS = 1 << 17


def hot_row_profiles(texts, tokenizer, compressor, layout) -> list[ej.HotRowProfile]:
    """Per Engram layer, how often prefilling ``texts`` reads each row: what a cache should hold."""
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    docs = [np.asarray([model.BOS_ID, *e.ids], np.int64)[:PROFILE_CHUNK_TOKENS] for e in encoded]
    hash_fn = jax.jit(lambda t, s: ej.hash_ngrams(layout, t, segment_ids=s))
    per_layer: list[list[np.ndarray]] = [[] for _ in range(layout.n_layers)]
    start = 0
    while start < len(docs):
        # Whole documents per call, padded to one shape (one compile): DEAD tokens read nothing.
        stop, size = start, 0
        while stop < len(docs) and size + docs[stop].size <= PROFILE_CHUNK_TOKENS:
            size += docs[stop].size
            stop += 1
        tokens = np.full(PROFILE_CHUNK_TOKENS, ej.DEAD_ID, np.int32)
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


def describe(name: str, layout) -> str:
    """Model ``name`` and its Engram tables, for a run's summary."""
    cfg = model.MODELS[name]
    return (
        f"model {name} ({cfg.n_layers} blocks, d_model {cfg.d_model}, hc_mult {cfg.hc_mult}); "
        f"Engram at "
        f"blocks {cfg.engram_layers}: {layout.n_cols} rows of {layout.head_dim} values per token "
        f"per layer, {table_bytes(layout) / 2**30:.3f} GiB of tables"
    )
