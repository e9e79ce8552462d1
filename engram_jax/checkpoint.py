"""Engram tables from safetensors checkpoints with DeepSeek's tensor names, and back.

A layer's table is ``layers.{L}.engram.embed.weight`` ``[rows, dim]`` F8_E4M3
and ``layers.{L}.engram.embed.scale`` ``[rows, dim/32]`` F8_E8M0. Loading reads
only the table's row range (its head shard), a bounded chunk at a time, and
interleaves values and scales straight into the table's row records: there is
never a second full copy. ``fill_dummy`` gives a table of ones in seconds, and
``fill_distinct`` one whose every row differs (benchmarks check rows against it).

safetensors opens and validates every file (a truncated file is an error).
Its numpy reader cannot hand out fp8 arrays (it looks the dtype up on the
numpy module, which has no float8 types), so when ``get_slice`` fails for
that reason the rows are read as raw bytes at the offsets in the file's header.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from engram_jax import storage
from engram_jax._format import BLOCK_SIZE, pack_records, row_stride
from engram_jax.storage import NodeGroup
from engram_jax.table import EngramTable, device_ordinal

log = logging.getLogger(__name__)

WEIGHT_NAME = "layers.{layer}.engram.embed.weight"
SCALE_NAME = "layers.{layer}.engram.embed.scale"
WEIGHT_DTYPE = "F8_E4M3"
SCALE_DTYPE = "F8_E8M0"
# Bytes of row records each loading step fills: bounds the read buffers.
CHUNK_BYTES = 64 << 20
# fp8 1.0 and UE8M0 2**0: the dummy table's every value is 1.0.
DUMMY_WEIGHT_BYTE = 0x38
DUMMY_SCALE_BYTE = 127
# fill_distinct: rows r and r + DISTINCT_PERIOD share all values but the first
# DISTINCT_ID_VALUES, which encode r; a power of two, so the fill copies a block.
DISTINCT_PERIOD = 4096
DISTINCT_ID_VALUES = 8
FILLS = ("ones", "distinct")
_HEADER_LIMIT = 100 << 20


class CheckpointError(ValueError):
    """A checkpoint does not hold what the table needs; the message names tensor and file."""


def tensor_names(layer: int) -> tuple[str, str]:
    """DeepSeek's names of layer ``layer``'s Engram weight and scale tensors."""
    return WEIGHT_NAME.format(layer=layer), SCALE_NAME.format(layer=layer)


# -- writing ------------------------------------------------------------------


def save_checkpoint(
    path: str | os.PathLike,
    layers: Mapping[int, tuple[np.ndarray, np.ndarray]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``{layer: (weight [rows, dim] fp8 e4m3, scale [rows, dim/32] e8m0)}`` as one file.

    uint8 arrays are taken as the raw bytes of those types. For tests and
    examples; a real checkpoint comes from the model's own release.
    """
    from safetensors.numpy import save_file

    tensors = {}
    for layer, (weight, scale) in layers.items():
        weight = np.ascontiguousarray(weight)
        scale = np.ascontiguousarray(scale)
        if weight.dtype == np.uint8:
            weight = weight.view(ml_dtypes.float8_e4m3fn)
        if scale.dtype == np.uint8:
            scale = scale.view(ml_dtypes.float8_e8m0fnu)
        if weight.dtype != ml_dtypes.float8_e4m3fn or weight.ndim != 2:
            raise TypeError(f"layer {layer}: weight must be 2-D float8_e4m3fn, got {weight.dtype}")
        rows, dim = weight.shape
        if dim % BLOCK_SIZE:
            raise ValueError(f"layer {layer}: dim {dim} is not a multiple of {BLOCK_SIZE}")
        if scale.dtype != ml_dtypes.float8_e8m0fnu or scale.shape != (rows, dim // BLOCK_SIZE):
            raise TypeError(
                f"layer {layer}: scale must be float8_e8m0fnu {(rows, dim // BLOCK_SIZE)}, "
                f"got {scale.dtype} {scale.shape}"
            )
        weight_name, scale_name = tensor_names(layer)
        tensors[weight_name] = weight
        tensors[scale_name] = scale
    path = Path(path)
    if not path.parent.is_dir():  # safetensors would say only "No such file or directory"
        raise FileNotFoundError(
            f"cannot write checkpoint {str(path)!r}: folder {str(path.parent)!r} does not exist"
        )
    save_file(tensors, str(path), metadata=dict(metadata) if metadata else None)
    return path


# -- reading ------------------------------------------------------------------


@dataclass
class TensorInfo:
    """Where one tensor's bytes are: file, dtype, shape, absolute byte offset."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1


def _read_header(path: Path) -> tuple[int, dict]:
    """The safetensors header: (offset of the data area, {name: entry})."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > _HEADER_LIMIT:
            raise CheckpointError(f"{path}: header length {length} is not plausible")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def _files(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files in this directory")
            return files
        return [path]
    return [Path(p) for p in source]


def _safe_open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except SafetensorError as exc:
        raise CheckpointError(
            f"{file}: not a valid safetensors file (truncated or corrupt?): {exc}"
        ) from exc


class Checkpoint:
    """The tensors of one or more safetensors files (a file, a list, or a directory).

    Opening validates every file with safetensors (headers, offsets, and that
    the file covers them: a truncated file raises :class:`CheckpointError`).
    """

    def __init__(self, source: str | os.PathLike | Sequence[str | os.PathLike]) -> None:
        self.files = _files(source)
        self.tensors: dict[str, TensorInfo] = {}
        for file in self.files:
            if not file.is_file():
                raise CheckpointError(f"{file}: no such checkpoint file")
            with _safe_open(file) as handle:
                specs = {}
                for name in handle.keys():
                    view = handle.get_slice(name)
                    specs[name] = (view.get_dtype(), view.get_shape())
            data_start, header = _read_header(file)
            for name, (dtype, shape) in specs.items():
                begin, end = header[name]["data_offsets"]
                if name in self.tensors:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self.tensors[name].file} and {file}"
                    )
                self.tensors[name] = TensorInfo(
                    name, file, dtype, tuple(int(d) for d in shape), data_start + begin, end - begin
                )

    def __repr__(self) -> str:
        return f"Checkpoint({len(self.files)} file(s), {len(self.tensors)} tensors)"

    def layer(self, layer: int) -> tuple[TensorInfo, TensorInfo]:
        """Layer ``layer``'s (weight, scale), checked against each other and the format."""
        weight_name, scale_name = tensor_names(layer)
        found = []
        for name in (weight_name, scale_name):
            if name not in self.tensors:
                engram = sorted(n for n in self.tensors if ".engram." in n)
                raise CheckpointError(
                    f"tensor {name!r} is not in {[str(f) for f in self.files]}; "
                    f"Engram tensors there: {engram or 'none'}"
                )
            found.append(self.tensors[name])
        weight, scale = found
        for info, dtype in ((weight, WEIGHT_DTYPE), (scale, SCALE_DTYPE)):
            if info.dtype != dtype:
                raise CheckpointError(
                    f"tensor {info.name!r} in {info.file} is {info.dtype}, expected {dtype}"
                )
            if len(info.shape) != 2:
                raise CheckpointError(
                    f"tensor {info.name!r} in {info.file} has shape {list(info.shape)}, "
                    "expected 2-D"
                )
        rows, dim = weight.shape
        if dim % BLOCK_SIZE or dim == 0:
            raise CheckpointError(
                f"tensor {weight.name!r} in {weight.file} has dim {dim}, "
                f"not a positive multiple of {BLOCK_SIZE}"
            )
        if scale.shape != (rows, dim // BLOCK_SIZE):
            raise CheckpointError(
                f"tensor {scale.name!r} in {scale.file} has shape {list(scale.shape)}, expected "
                f"{[rows, dim // BLOCK_SIZE]} to match {weight.name!r} {list(weight.shape)}"
            )
        return weight, scale


class _RowReader:
    """Reads row ranges of 1-byte tensors: through ``get_slice`` when safetensors can
    produce the dtype in numpy, else as raw bytes at the header's offsets."""

    def __init__(self, checkpoint: Checkpoint, infos: Sequence[TensorInfo]) -> None:
        self._fds = {}
        self._handles = {}
        self._slices = {}
        self._lock = threading.Lock()
        self.raw = False
        try:
            for info in infos:
                if info.file not in self._fds:
                    self._fds[info.file] = os.open(info.file, os.O_RDONLY | os.O_CLOEXEC)
                    self._handles[info.file] = _safe_open(info.file)
                self._slices[info.name] = self._handles[info.file].get_slice(info.name)
            # One probe decides for the whole load; see the module docstring.
            probe = infos[0]
            try:
                self._slices[probe.name][0:1]
            except (AttributeError, TypeError) as exc:
                self.raw = True
                log.debug(
                    "safetensors cannot give %s as numpy (%s): reading raw bytes", probe.dtype, exc
                )
        except BaseException:
            self.close()
            raise

    def read(self, info: TensorInfo, lo: int, hi: int, out: np.ndarray) -> np.ndarray:
        """Rows ``[lo, hi)`` of ``info`` as ``[hi - lo, row_bytes]`` uint8 (raw: in ``out``)."""
        rows = hi - lo
        width = info.row_bytes
        if not self.raw:
            with self._lock:  # the slice objects are not documented as thread-safe
                data = self._slices[info.name][lo:hi]
            return np.ascontiguousarray(data).view(np.uint8).reshape(rows, width)
        view = out[: rows * width]
        fd = self._fds[info.file]
        offset = info.offset + lo * width
        done = 0
        while done < view.nbytes:
            got = os.preadv(fd, [memoryview(view[done:])], offset + done)
            if got <= 0:
                raise CheckpointError(
                    f"tensor {info.name!r} in {info.file}: file ends after "
                    f"{offset + done} bytes, inside rows [{lo}, {hi}) (truncated?)"
                )
            done += got
        return view.reshape(rows, width)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._slices.clear()


@dataclass(frozen=True)
class LoadStats:
    """What a load did: rows and record bytes written, seconds, and whether rows were read raw."""

    rows: int
    nbytes: int
    seconds: float
    raw_reads: bool

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / 2**30 / self.seconds if self.seconds > 0 else float("inf")


def _threads(threads: int | None) -> int:
    return threads or max(1, min(8, len(os.sched_getaffinity(0))))


def load_layer(
    table: EngramTable,
    checkpoint: Checkpoint | str | os.PathLike | Sequence[str | os.PathLike],
    layer: int,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    threads: int | None = None,
    progress: bool = True,
) -> LoadStats:
    """Fill ``table`` with global rows ``[table.row_start, table.row_stop)`` of layer ``layer``.

    Reads ``chunk_bytes`` worth of rows at a time per thread and writes them
    as row records in place; memory beyond the table is ``threads`` chunks.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
    weight, scale = ckpt.layer(layer)
    rows, dim = weight.shape
    if dim != table.dim:
        raise CheckpointError(
            f"tensor {weight.name!r} in {weight.file} has dim {dim}, the table {table.dim}"
        )
    if table.row_stop > rows:
        raise CheckpointError(
            f"tensor {weight.name!r} in {weight.file} has {rows} rows; the table needs rows "
            f"[{table.row_start}, {table.row_stop})"
        )
    stride = table.row_stride
    scale_width = dim // BLOCK_SIZE
    chunk = max(1, chunk_bytes // stride)
    starts = range(0, table.num_rows, chunk)
    allocation = table.allocation
    host = allocation.host_array
    direct = host is not None and host.flags.writeable
    local = threading.local()
    reader = _RowReader(ckpt, [weight, scale])

    def step(lo: int) -> int:
        hi = min(table.num_rows, lo + chunk)
        n = hi - lo
        if not hasattr(local, "weight"):
            local.weight = np.empty(chunk * dim, np.uint8)
            local.scale = np.empty(chunk * scale_width, np.uint8)
        g0, g1 = table.row_start + lo, table.row_start + hi
        w = reader.read(weight, g0, g1, local.weight)
        s = reader.read(scale, g0, g1, local.scale)
        if direct:
            records = host[lo * stride : hi * stride].reshape(n, stride)
            records[:, :dim] = w
            records[:, dim : dim + scale_width] = s
            records[:, dim + scale_width :] = 0
        else:
            table.write_records(lo, pack_records(w, s))
        return n * stride

    total = table.num_rows * stride
    start = time.perf_counter()
    try:
        with (
            tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"engram layer {layer}",
                disable=not progress,
            ) as bar,
            ThreadPoolExecutor(_threads(threads), thread_name_prefix="engram-load") as pool,
        ):
            for written in pool.map(step, starts):
                bar.update(written)
    finally:
        reader.close()
    stats = LoadStats(table.num_rows, total, time.perf_counter() - start, reader.raw)
    log.info(
        "loaded layer %d rows [%d, %d) from %d file(s): %.2f GiB in %.1f s, %.2f GiB/s%s",
        layer,
        table.row_start,
        table.row_stop,
        len({weight.file, scale.file}),
        total / 2**30,
        stats.seconds,
        stats.gib_per_s,
        " (raw reads)" if reader.raw else "",
    )
    return stats


def fill_dummy(
    table: EngramTable,
    *,
    weight_byte: int = DUMMY_WEIGHT_BYTE,
    scale_byte: int = DUMMY_SCALE_BYTE,
    threads: int | None = None,
) -> float:
    """Write the same record into every row (default: every value 1.0); returns seconds.

    Copies one prepared block over the table on several threads: as fast as
    memory bandwidth, no random numbers.
    """
    stride = table.row_stride
    dim = table.dim
    record = np.zeros(stride, np.uint8)
    record[:dim] = weight_byte
    record[dim : dim + dim // BLOCK_SIZE] = scale_byte
    block_rows = max(1, (4 << 20) // stride)
    block = np.tile(record, (block_rows, 1))
    host = table.allocation.host_array
    start = time.perf_counter()
    if host is None or not host.flags.writeable:
        for lo in range(0, table.num_rows, block_rows):
            n = min(block_rows, table.num_rows - lo)
            table.write_records(lo, block[:n])
        return time.perf_counter() - start
    records = host[: table.num_rows * stride].reshape(table.num_rows, stride)
    workers = _threads(threads) * 2
    span = max(block_rows, -(-table.num_rows // workers))

    def fill(lo: int) -> None:
        for a in range(lo, min(table.num_rows, lo + span), block_rows):
            b = min(a + block_rows, lo + span, table.num_rows)
            records[a:b] = block[: b - a]

    with ThreadPoolExecutor(workers, thread_name_prefix="engram-fill") as pool:
        list(pool.map(fill, range(0, table.num_rows, span)))
    return time.perf_counter() - start


def dummy_reference(num_rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The weight and scale arrays :func:`fill_dummy` writes, for comparisons."""
    weight = np.full((num_rows, dim), DUMMY_WEIGHT_BYTE, np.uint8)
    scale = np.full((num_rows, dim // BLOCK_SIZE), DUMMY_SCALE_BYTE, np.uint8)
    return weight.view(ml_dtypes.float8_e4m3fn), scale.view(ml_dtypes.float8_e8m0fnu)


# -- distinct rows --------------------------------------------------------------


def _fmix32(xp, x):
    """murmur3's 32-bit finaliser: a bijection of uint32 that spreads every input bit."""
    x = x ^ (x >> 16)
    x = x * xp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * xp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _distinct_key(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return (int(seed) * 0x9E3779B9 + 0x7F4A7C15) & 0xFFFFFFFF


def _id_codes(nibbles):
    """fp8 +-(1 + m/8) whose sign and mantissa bits are the 4 bits of ``nibbles``."""
    return ((nibbles & 8) << 4) | 0x38 | (nibbles & 7)


def distinct_bytes(
    ids: np.ndarray | jax.Array, dim: int, *, seed: int = 0
) -> tuple[np.ndarray, np.ndarray] | tuple[jax.Array, jax.Array]:
    """The weight and scale bytes :func:`fill_distinct` writes for global rows ``ids``:
    ``(uint8 [..., dim], uint8 [..., dim/32])``; numpy arrays for numpy ids, jax arrays
    for jax ids (traced ones too: a benchmark can compute the rows it expects on the device).

    Row r's first 8 values are fp8 +-(1 + m/8), their sign and mantissa bits the
    nibbles of ``fmix32(r ^ key)`` (a bijection: no two ids below 2**32 share
    them). Its other values and its scales are those of base row ``r % 4096``:
    bytes of ``fmix32`` of their position, values +-(1 + m/8) * 2**(-2..1) (no NaN,
    no zero) under scales 2**(-3..0). Every row decodes finite and exactly in bf16.
    ``key`` is a function of ``seed``; ids are taken modulo 2**32.
    """
    if (
        isinstance(dim, bool)
        or not isinstance(dim, (int, np.integer))
        or dim <= 0
        or dim % BLOCK_SIZE
    ):
        raise ValueError(f"dim must be a positive multiple of {BLOCK_SIZE}, got {dim!r}")
    xp = jnp if isinstance(ids, jax.Array) else np
    key = xp.uint32(_distinct_key(seed))
    rows = xp.asarray(ids).astype(xp.uint32)
    base = (rows & xp.uint32(DISTINCT_PERIOD - 1))[..., None]
    # Value and scale positions hash apart: bit 31 set for values, bits 31 and 30 for scales.
    values = xp.arange(DISTINCT_ID_VALUES, dim, dtype=xp.uint32)
    word = _fmix32(xp, (xp.uint32(1 << 31) | (base * xp.uint32(dim) + values)) ^ key) & 0xFF
    rest = (word & 0x87) | ((5 + ((word >> 3) & 3)) << 3)
    shifts = xp.arange(DISTINCT_ID_VALUES, dtype=xp.uint32) * 4
    nibbles = (_fmix32(xp, rows ^ key)[..., None] >> shifts) & 15
    weight = xp.concatenate([_id_codes(nibbles), rest], axis=-1).astype(xp.uint8)
    blocks = xp.arange(dim // BLOCK_SIZE, dtype=xp.uint32)
    word = _fmix32(xp, (xp.uint32(3 << 30) | (base * xp.uint32(dim // BLOCK_SIZE) + blocks)) ^ key)
    scale = (124 + (word & 3)).astype(xp.uint8)
    return weight, scale


class _DistinctWriter:
    """Records of :func:`distinct_bytes` for runs of consecutive rows, fast: a copy of
    the base rows (tiled, so any run starts anywhere in them) and the 8 id values."""

    def __init__(self, dim: int, seed: int, run_rows: int) -> None:
        self.key = np.uint32(_distinct_key(seed))
        self.run_rows = run_rows
        base = pack_records(*distinct_bytes(np.arange(DISTINCT_PERIOD), dim, seed=seed))
        reps = -(-(run_rows + DISTINCT_PERIOD) // DISTINCT_PERIOD)
        self.tiled = np.tile(base, (reps, 1))
        # A byte of fmix32 holds two nibbles: its two id values, as one little-endian uint16.
        byte = np.arange(256, dtype=np.uint16)
        self.pair = (_id_codes(byte & 15) | (_id_codes(byte >> 4) << 8)).astype("<u2")

    def write(self, out: np.ndarray, first_row: int) -> None:
        """Fill ``out`` ``[n, stride]`` with the records of rows ``first_row ..``."""
        for lo in range(0, len(out), self.run_rows):
            n = min(self.run_rows, len(out) - lo)
            row = first_row + lo
            start = row % DISTINCT_PERIOD
            out[lo : lo + n] = self.tiled[start : start + n]
            ids = np.arange(row, row + n, dtype=np.uint32)  # row ids are below 2**31
            hashed = _fmix32(np, ids ^ self.key).astype("<u4").view(np.uint8).reshape(n, 4)
            out[lo : lo + n, :DISTINCT_ID_VALUES] = self.pair[hashed].view(np.uint8)


# Rows per copy-and-patch run: small enough that a run's records are still in the
# CPU's cache when their id values are written over them.
_DISTINCT_RUN_ROWS = 4096


def fill_distinct(
    table: EngramTable,
    *,
    seed: int = 0,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> float:
    """Write :func:`distinct_bytes` into every row (global ids, so shards of one layer
    agree with a whole copy); returns seconds.

    Unlike :func:`fill_dummy`'s table of ones, a wrong, zero or stale row read from
    this table differs from the right one. Copies a block of base rows and writes 8
    values per row, on several threads, at several GB/s each. ``progress`` is
    called on this thread with the bytes of each chunk done; an exception it raises
    stops the fill.
    """
    stride = table.row_stride
    writer = _DistinctWriter(table.dim, seed, _DISTINCT_RUN_ROWS)
    chunk = max(1, CHUNK_BYTES // stride)
    host = table.allocation.host_array
    direct = host is not None and host.flags.writeable
    records = host[: table.num_rows * stride].reshape(table.num_rows, stride) if direct else None
    local = threading.local()

    def fill(lo: int) -> int:
        n = min(chunk, table.num_rows - lo)
        if direct:
            writer.write(records[lo : lo + n], table.row_start + lo)
        else:
            if not hasattr(local, "buffer"):
                local.buffer = np.empty((chunk, stride), np.uint8)
            writer.write(local.buffer[:n], table.row_start + lo)
            table.write_records(lo, local.buffer[:n])
        return n * stride

    start = time.perf_counter()
    workers = _threads(threads)
    starts = iter(range(0, table.num_rows, chunk))
    with ThreadPoolExecutor(workers, thread_name_prefix="engram-fill") as pool:
        # At most one chunk per worker queued beyond those running: once ``progress``
        # raises, nothing past them is written.
        first = itertools.islice(starts, 2 * workers)
        pending = collections.deque(pool.submit(fill, lo) for lo in first)
        try:
            while pending:
                written = pending.popleft().result()
                if progress is not None:
                    progress(written)
                pending.extend(pool.submit(fill, lo) for lo in itertools.islice(starts, 1))
        except BaseException:
            for future in pending:
                future.cancel()
            raise
    return time.perf_counter() - start


# -- tables ---------------------------------------------------------------------


def _new_table(
    num_rows: int,
    dim: int,
    *,
    row_start: int,
    placement: str,
    device: jax.Device | int | None,
    group: NodeGroup | None,
    share_method: str,
    name: str,
    check=None,
) -> EngramTable:
    if group is None:
        if check is not None:
            check()
        return EngramTable.allocate(
            num_rows, dim, placement=placement, row_start=row_start, device=device
        )
    # A shared table is host memory, mapped by every rank: the placement only
    # says which backend reads it.
    if placement not in storage.PLACEMENTS or placement == "device":
        host = sorted(set(storage.PLACEMENTS) - {"device"})
        raise ValueError(
            f"placement {placement!r} cannot be shared by a node group; choose one of {host}"
        )
    backend = {"cpu": "cpu", "auto": "auto"}.get(placement, "gpu")
    allocation = storage.allocate_shared(
        max(1, num_rows * row_stride(dim)),
        group,
        name=name,
        backend=backend,
        method=share_method,
        device_ordinal=device_ordinal(device, placement),
        check=check,
    )
    try:
        return EngramTable(allocation, num_rows=num_rows, dim=dim, row_start=row_start)
    except BaseException:
        allocation.close()
        raise


def _fill(table: EngramTable, fill) -> None:
    allocation = table.allocation
    try:
        if isinstance(allocation, storage.SharedAllocation):
            with allocation.writing() as is_writer:
                if is_writer:
                    fill()
        else:
            fill()
    except BaseException:
        table.close()
        raise


def load_table(
    checkpoint: Checkpoint | str | os.PathLike | Sequence[str | os.PathLike],
    layer: int,
    *,
    row_start: int = 0,
    num_rows: int | None = None,
    placement: str = "auto",
    device: jax.Device | int | None = None,
    group: NodeGroup | None = None,
    share_method: str = "auto",
    progress: bool = True,
    threads: int | None = None,
) -> EngramTable:
    """A table holding rows ``[row_start, row_start + num_rows)`` of layer ``layer``.

    ``layer`` is the model layer id in the tensor names (an entry of
    ``EngramLayout.layer_ids``, not its index). ``num_rows`` defaults to the
    rest of the layer. Without ``group`` the table gets its own memory from
    ``placement``; with a :class:`NodeGroup` every rank calls this, one copy
    is shared per node (``placement`` "cpu" means the CPU backend, "auto" the
    GPU one where CUDA sees a GPU, anything else the GPU one; ``share_method`` as in
    :func:`~engram_jax.storage.allocate_shared`), rank 0 loads it and all
    ranks return once it is loaded.
    """
    found: dict = {}

    def check() -> None:
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        weight, _ = ckpt.layer(layer)
        rows, dim = weight.shape
        count = rows - row_start if num_rows is None else num_rows
        if row_start < 0 or count < 0 or row_start + count > rows:
            raise CheckpointError(
                f"tensor {weight.name!r} in {weight.file} has {rows} rows; asked for rows "
                f"[{row_start}, {row_start + count})"
            )
        found.update(ckpt=ckpt, dim=dim, rows=count)

    try:
        check()
        error = None
    except CheckpointError as exc:
        if group is None:
            raise
        error = exc  # raised inside the handshake, so every rank sees it

    def recheck() -> None:
        if error is not None:
            raise error

    table = _new_table(
        found.get("rows", 1),
        found.get("dim", BLOCK_SIZE),
        row_start=row_start,
        placement=placement,
        device=device,
        group=group,
        share_method=share_method,
        name=f"layer{layer}",
        check=recheck,
    )
    _fill(
        table, lambda: load_layer(table, found["ckpt"], layer, progress=progress, threads=threads)
    )
    return table


def dummy_table(
    num_rows: int,
    dim: int,
    *,
    row_start: int = 0,
    placement: str = "auto",
    device: jax.Device | int | None = None,
    group: NodeGroup | None = None,
    share_method: str = "auto",
    name: str = "dummy",
    fill: str = "ones",
    seed: int = 0,
) -> EngramTable:
    """A table of ``num_rows`` rows made in seconds, for benchmarks and tests.

    ``fill="ones"``: every value 1.0 (:func:`fill_dummy`; a wrong row read from it
    cannot show, so time fills with it, not lookups). ``fill="distinct"``: every
    row different (:func:`fill_distinct` with ``seed``), for checking the rows a
    benchmark reads.
    """
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
    _distinct_key(seed)  # a bad seed fails before anything is allocated
    table = _new_table(
        num_rows,
        dim,
        row_start=row_start,
        placement=placement,
        device=device,
        group=group,
        share_method=share_method,
        name=name,
    )
    if fill == "ones":
        _fill(table, lambda: fill_dummy(table))
    else:
        _fill(table, lambda: fill_distinct(table, seed=seed))
    return table
