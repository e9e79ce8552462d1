"""engram_jax.hot_rows: a host table's most frequent rows, copied to HBM.

A :class:`HotRowProfile` counts how often each row is read; a
:class:`HotRowCache` holds the hottest rows of a table in HBM, refreshable
between steps while lookups run. ``engram_jax.lookup(table, ids, cache=...)``
reads hits from the copy and only misses from the table, bit for bit the
same rows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import numpy as np

from engram_jax import _native, storage
from engram_jax._args import check_table
from engram_jax.sharded_table import ShardedTable, handler_ordinal
from engram_jax.storage import Allocation, MemoryKind
from engram_jax.table import EngramTable

# The registry ordinal of the one host-memory copy every CPU device reads.
_ANY_DEVICE = int(_native.native.any_device)
_cache_keys = itertools.count(1)
_cache_keys_lock = threading.Lock()


def _next_cache_key() -> int:
    with _cache_keys_lock:
        return next(_cache_keys)


def check_cache(table: EngramTable | ShardedTable, cache: HotRowCache | None) -> None:
    """Raise unless ``cache`` is None or an open :class:`HotRowCache` of ``table``."""
    if cache is None:
        return
    if not isinstance(cache, HotRowCache):
        raise TypeError(f"cache must be a HotRowCache or None, got {type(cache).__name__}")
    if cache.closed:
        raise ValueError(f"{cache!r} is closed")
    if cache.table_key != table.key:
        raise ValueError(
            f"{cache!r} caches another table than {table!r}: build the cache for this table "
            "(for a sharded lookup, for the ShardedTable itself)"
        )


# -- frequency profiles ------------------------------------------------------


def profile_path(checkpoint_dir: str | os.PathLike, layer_id: int) -> Path:
    """Where a layer's profile lives beside its checkpoint: ``engram_profile.layer{L}.npy``."""
    return Path(checkpoint_dir) / f"engram_profile.layer{int(layer_id)}.npy"


@dataclasses.dataclass(frozen=True, eq=False)
class HotRowProfile:
    """How often each row was looked up: ``rows`` (int32 global row ids, most
    frequent first, ties by row) and ``counts`` (int64, non-increasing).

    Build one offline from the row ids of a corpus (:meth:`from_ids`), save it
    beside the checkpoint (:meth:`save`, one ``.npy``: ``[2, n]`` int64 of rows
    and counts; see :func:`profile_path`), and fill a :class:`HotRowCache` from it.
    """

    rows: np.ndarray
    counts: np.ndarray

    def __post_init__(self) -> None:
        rows = np.asarray(self.rows)
        counts = np.asarray(self.counts)
        if rows.ndim != 1 or counts.shape != rows.shape:
            raise ValueError(
                f"rows and counts must be 1-D of one length, got {rows.shape}, {counts.shape}"
            )
        for name, values in (("rows", rows), ("counts", counts)):
            if values.size and not np.issubdtype(values.dtype, np.integer):
                raise TypeError(f"profile {name} must be integers, got {values.dtype}")
        if rows.size and (rows.min() < 0 or rows.max() >= 2**31):
            raise ValueError("profile rows must be int32 row ids >= 0")
        # The cache index is the cached rows strictly increasing: a row twice would
        # take two slots of the budget and break that order.
        if np.unique(rows).size != rows.size:
            raise ValueError("profile rows must be distinct (use from_counts or from_ids)")
        if counts.size and (counts.min() < 1 or np.any(np.diff(counts) > 0)):
            raise ValueError("profile counts must be >= 1 and non-increasing")
        object.__setattr__(self, "rows", rows.astype(np.int32))
        object.__setattr__(self, "counts", counts.astype(np.int64))

    @classmethod
    def from_counts(cls, rows: np.ndarray, counts: np.ndarray) -> HotRowProfile:
        """A profile of distinct ``rows`` with ``counts`` in any order."""
        rows = np.asarray(rows, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        keep = counts > 0
        rows, counts = rows[keep], counts[keep]
        order = np.lexsort((rows, -counts))
        return cls(rows[order], counts[order])

    @classmethod
    def from_ids(cls, ids: np.ndarray | jax.Array | Iterable[np.ndarray]) -> HotRowProfile:
        """Count the row ids of a corpus (an array, or an iterable of id batches).

        DEAD ids and every other negative id are not rows and are skipped.
        """
        if isinstance(ids, (np.ndarray, jax.Array)):
            batches: Iterable = [ids]
        else:
            batches = ids
        rows = np.zeros(0, np.int64)
        counts = np.zeros(0, np.int64)
        for batch in batches:
            flat = np.asarray(batch).reshape(-1)
            flat = flat[flat >= 0].astype(np.int64)
            if not flat.size:
                continue
            new_rows, new_counts = np.unique(flat, return_counts=True)
            rows, counts = _sum_counts(rows, counts, new_rows, new_counts.astype(np.int64))
        return cls.from_counts(rows, counts)

    def merged(self, other: HotRowProfile, weight: float = 1.0) -> HotRowProfile:
        """This profile's counts plus ``weight`` times ``other``'s (rounded; rows under 1 go)."""
        scaled = np.rint(other.counts * float(weight)).astype(np.int64)
        rows, counts = _sum_counts(
            self.rows.astype(np.int64), self.counts, other.rows.astype(np.int64), scaled
        )
        return HotRowProfile.from_counts(rows, counts)

    def top(self, n: int, row_range: tuple[int, int] | None = None) -> np.ndarray:
        """The ``n`` most frequent rows (inside ``[start, stop)`` if given), most frequent first."""
        rows = self.rows
        if row_range is not None:
            rows = rows[(rows >= row_range[0]) & (rows < row_range[1])]
        return rows[: max(0, int(n))]

    def __len__(self) -> int:
        return int(self.rows.size)

    def save(self, path: str | os.PathLike) -> None:
        np.save(path, np.stack([self.rows.astype(np.int64), self.counts]))

    @classmethod
    def load(cls, path: str | os.PathLike) -> HotRowProfile:
        data = np.load(path, allow_pickle=False)
        if data.ndim != 2 or data.shape[0] != 2 or data.dtype != np.int64:
            raise ValueError(
                f"{path} is not a row profile ([2, n] int64), got {data.shape} {data.dtype}"
            )
        return cls(data[0], data[1])


def _sum_counts(rows_a, counts_a, rows_b, counts_b):
    rows = np.concatenate([rows_a, rows_b])
    counts = np.concatenate([counts_a, counts_b])
    unique, inverse = np.unique(rows, return_inverse=True)
    return unique, np.bincount(inverse, weights=counts, minlength=unique.size).astype(np.int64)


# -- the HBM hot-row cache ---------------------------------------------------


def _index_geometry(num_rows: int, capacity: int) -> tuple[int, int]:
    """(shift, num_buckets): a directory of about one bucket per 8 cached rows."""
    target = max(1, capacity // 8)
    shift = 0
    while shift < 31 and (max(num_rows, 1) - 1 >> shift) + 1 > target:
        shift += 1
    return shift, (max(num_rows, 1) - 1 >> shift) + 1


@dataclasses.dataclass
class _BufferSet:
    records: Allocation  # capacity * row_stride bytes
    rows: Allocation  # capacity int32: cached table-local rows, ascending
    buckets: Allocation  # num_buckets + 1 int32

    def close(self) -> None:
        for allocation in (self.records, self.rows, self.buckets):
            allocation.close()


class _Shard:
    """One device's cache: its table, index geometry, and two buffer sets."""

    def __init__(
        self, device: jax.Device, handler_ordinal: int, table: EngramTable, budget: int
    ) -> None:
        self.device = device
        self.handler_ordinal = handler_ordinal
        self.table = table
        self.gpu = device.platform != "cpu"
        if self.gpu and table.allocation.kind == MemoryKind.HOST:
            raise ValueError(
                f"{device} cannot read {table!r}: place it as 'pinned' to cache it on a GPU"
            )
        if self.gpu and table.allocation.kind == MemoryKind.DEVICE:
            raise ValueError(f"{table!r} already lives in GPU memory: there is nothing to cache")
        stride = table.row_stride
        capacity = min(budget // (stride + 4), table.num_rows)
        shift, num_buckets = _index_geometry(table.num_rows, capacity)
        capacity = min(max(0, (budget - 4 * (num_buckets + 1)) // (stride + 4)), table.num_rows)
        self.capacity = int(capacity)
        self.shift, self.num_buckets = shift, num_buckets
        self.sets: list[_BufferSet | None] = [None, None]
        self.active = -1
        self.cached_rows = np.zeros(0, np.int32)  # host copy of the active set's rows (local)

    @property
    def placement(self) -> str:
        return "device" if self.gpu else "cpu"

    def allocate(self) -> _BufferSet:
        # A GPU's handler ordinal is its CUDA ordinal.
        device_ordinal = self.handler_ordinal if self.gpu else None
        made: list[Allocation] = []
        try:
            for nbytes in (
                max(1, self.capacity * self.table.row_stride),
                max(4, self.capacity * 4),
                4 * (self.num_buckets + 1),
            ):
                made.append(storage.allocate(self.placement, nbytes, device_ordinal))
        except BaseException:
            for allocation in made:
                allocation.close()
            raise
        return _BufferSet(*made)

    def nbytes(self) -> int:
        return sum(
            a.nbytes for s in self.sets if s is not None for a in (s.records, s.rows, s.buckets)
        )

    def fill(self, target: _BufferSet, hot: np.ndarray) -> np.ndarray:
        """Write rows ``hot`` (global ids, most frequent first) into ``target``; returns its
        table-local rows."""
        table = self.table
        held = hot[(hot >= table.row_start) & (hot < table.row_stop)]
        local = np.sort(held[: self.capacity].astype(np.int64) - table.row_start).astype(np.int32)
        per_bucket = np.bincount(local >> self.shift, minlength=self.num_buckets)
        buckets = np.zeros(self.num_buckets + 1, np.int32)
        np.cumsum(per_bucket, out=buckets[1:])
        if self.gpu:
            native = _native.native
            native.cache_upload_cuda(self.handler_ordinal, target.rows.address, local)
            native.cache_upload_cuda(self.handler_ordinal, target.buckets.address, buckets)
            native.cache_fill_cuda(
                table.key,
                self.handler_ordinal,
                target.rows.address,
                local.size,
                target.records.address,
            )
        else:
            stride = table.row_stride
            source = table.allocation.host_array[: table.num_rows * stride].reshape(-1, stride)
            target.rows.write(0, local)
            target.buckets.write(0, buckets)
            if local.size:
                target.records.write(0, source[local])
        return local


class _CacheState:
    """What the finaliser needs, without a reference back to the HotRowCache."""

    def __init__(self, key: int) -> None:
        self.key = key
        self.shards: list[_Shard] = []
        self.lock = threading.RLock()
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None

    def release(self) -> None:
        if self.executor is not None:
            # No join: the last reference may drop on the worker itself (a background
            # refresh), which cannot join itself. The lock waits out a running refresh,
            # and one that starts later finds the cache closed.
            self.executor.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            try:
                # Waits until no lookup holds a buffer set and every GPU read is done.
                # It fails only when a fence cannot be waited for (a broken CUDA
                # context, where nothing runs any more): the buffers go all the same.
                _native.native.cache_remove(self.key)
            finally:
                for shard in self.shards:
                    for buffer_set in shard.sets:
                        if buffer_set is not None:
                            buffer_set.close()
                    shard.sets = [None, None]


class HotRowCache:
    """The most frequent rows of a host table, copied to HBM (or, on the CPU
    backend, to host memory: the same code path, for tests).

    ``budget_gib`` per device covers the row records and the index. The index
    is the cached rows as a sorted int32 array (a row's slot is its position)
    plus a directory of about one int32 per 8 cached rows over the high bits
    of the row number: about 4.5 bytes per cached row and nothing per uncached
    row, one directory read and a short binary search per probe.

    ``table``: an :class:`EngramTable` (cached in the HBM of each GPU of
    ``devices``, default the first device of the default backend; for CPU
    devices one host-memory copy serves them all)
    or a :class:`ShardedTable` (each of its devices caches its own shard's
    rows). ``profile``: which rows are hot (:class:`HotRowProfile`); ``None``
    starts empty. Pass it to :func:`engram_jax.lookup` (or ``lookup_start``) as ``cache=``.

    Online refresh: :meth:`observe` records the ids of steps, :meth:`refresh`
    (optionally in the background) refills the idle buffer set from the
    profile plus what was observed and then makes it the one lookups read.
    Lookups already running keep the set they started with; a set is only
    rewritten once no lookup reads it. The first refresh allocates the second
    set, so a refreshed cache takes twice its budget. Rows are copies: after
    writing the table, refresh the cache (:meth:`reload`).
    """

    def __init__(
        self,
        table: EngramTable | ShardedTable,
        budget_gib: float,
        profile: HotRowProfile | None = None,
        *,
        devices: Sequence[jax.Device] | None = None,
        observe_window: int = 1 << 24,
    ) -> None:
        check_table(table)
        if not isinstance(budget_gib, (int, float, np.integer, np.floating)) or budget_gib < 0:
            raise ValueError(f"budget_gib must be a number >= 0, got {budget_gib!r}")
        if profile is not None and not isinstance(profile, HotRowProfile):
            raise TypeError(
                f"profile must be a HotRowProfile or None, got {type(profile).__name__}"
            )
        budget = int(float(budget_gib) * 2**30)
        shard_tables = self._shard_tables(table, devices)
        self._table_key = table.key
        self._dim = table.dim
        self._budget_gib = float(budget_gib)
        self._profile = profile if profile is not None else HotRowProfile.from_counts([], [])
        self._observed: collections.deque = collections.deque()
        self._observed_size = 0
        self._observe_window = int(observe_window)
        self._observe_lock = threading.Lock()
        self._state = _CacheState(_next_cache_key())
        self._finalizer = weakref.finalize(self, self._state.release)
        native = _native.native
        for device, ordinal, shard_table in shard_tables:
            shard = _Shard(device, ordinal, shard_table, budget)
            kind = MemoryKind.DEVICE if shard.gpu else MemoryKind.HOST
            native.cache_create(self.key, ordinal, self._table_key, self._dim, int(kind))
            self._state.shards.append(shard)
        with self._state.lock:
            for shard in self._state.shards:
                self._load(shard, self._profile)

    @staticmethod
    def _shard_tables(table, devices):
        if isinstance(table, ShardedTable):
            devices = table.devices if devices is None else list(devices)
        else:
            devices = [jax.devices()[0]] if devices is None else list(devices)
        if not devices:
            raise ValueError("devices must name at least one device")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices must be distinct, got {[str(d) for d in devices]}")
        if isinstance(table, ShardedTable):
            return [(d, handler_ordinal(d), table.table(d)) for d in devices]
        if all(d.platform == "cpu" for d in devices):
            # One host copy serves every CPU device.
            return [(devices[0], _ANY_DEVICE, table)]
        if any(d.platform == "cpu" for d in devices):
            raise ValueError("a cache is for CPU devices or for GPUs, not both")
        # Each GPU keeps its own copy in its own HBM.
        return [(d, handler_ordinal(d), table) for d in devices]

    # -- properties ---------------------------------------------------------

    @property
    def key(self) -> int:
        """The cache registry key lookups carry."""
        return self._state.key

    @property
    def table_key(self) -> int:
        return self._table_key

    @property
    def budget_gib(self) -> float:
        return self._budget_gib

    @property
    def capacity(self) -> int:
        """Rows each device's cache can hold (the smallest over devices)."""
        return min(shard.capacity for shard in self._state.shards)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return tuple(shard.device for shard in self._state.shards)

    @property
    def nbytes(self) -> int:
        """Bytes of cache memory allocated over every device (both buffer sets once refreshed)."""
        return sum(shard.nbytes() for shard in self._state.shards)

    @property
    def profile(self) -> HotRowProfile:
        return self._profile

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._state.shards)} device(s)"
        return (
            f"HotRowCache(table_key={self._table_key}, budget_gib={self._budget_gib:g}, "
            f"capacity={self.capacity if not self.closed else 0}, {state}, key={self.key})"
        )

    def cached_rows(self, device: jax.Device | None = None) -> np.ndarray:
        """Global ids of the rows the active set holds (on ``device``; default the first)."""
        shard = self._shard(device)
        return shard.cached_rows.astype(np.int64) + shard.table.row_start

    def hit_rate(self, ids: np.ndarray, device: jax.Device | None = None) -> float:
        """Fraction of ``ids`` held by the device's table that its cache holds (host-side count)."""
        shard = self._shard(device)
        ids = np.asarray(ids, dtype=np.int64).reshape(-1) - shard.table.row_start
        ids = ids[(ids >= 0) & (ids < shard.table.num_rows)]
        if not ids.size:
            return 0.0
        cached = shard.cached_rows
        if not cached.size:
            return 0.0
        pos = np.minimum(np.searchsorted(cached, ids), cached.size - 1)
        return float(np.count_nonzero(cached[pos] == ids)) / ids.size

    def serves(self, device: jax.Device) -> bool:
        """Whether a lookup running on ``device`` finds a copy of this cache there."""
        self._check_open()
        return any(
            shard.device == device
            or (shard.handler_ordinal == _ANY_DEVICE and device.platform == "cpu")
            for shard in self._state.shards
        )

    def _shard(self, device: jax.Device | None) -> _Shard:
        self._check_open()
        if device is None:
            return self._state.shards[0]
        for shard in self._state.shards:
            if shard.device == device:
                return shard
        raise ValueError(f"{self!r} has no cache on {device}")

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"HotRowCache (key {self.key}) is closed")

    # -- filling and refreshing ---------------------------------------------

    def _load(self, shard: _Shard, profile: HotRowProfile) -> None:
        """Fill the idle buffer set from ``profile`` and make it the active one."""
        target = 1 - shard.active if shard.active >= 0 else 0
        native = _native.native
        # Wait until no lookup reads the set any more (never the active one).
        native.cache_reserve(self.key, shard.handler_ordinal, target)
        if shard.sets[target] is None:
            shard.sets[target] = shard.allocate()
        buffer_set = shard.sets[target]
        hot = profile.top(shard.capacity, (shard.table.row_start, shard.table.row_stop))
        local = shard.fill(buffer_set, hot)
        native.cache_publish(
            self.key,
            shard.handler_ordinal,
            target,
            buffer_set.records.address,
            buffer_set.rows.address,
            buffer_set.buckets.address,
            local.size,
            shard.num_buckets,
            shard.shift,
        )
        shard.active = target
        shard.cached_rows = local

    def observe(self, ids: np.ndarray | jax.Array) -> None:
        """Record the ids of a step for the next :meth:`refresh`; never waits for them.

        A jax array starts its copy to the host here and is read at refresh
        time. The most recent ``observe_window`` ids are kept.
        """
        self._check_open()
        if isinstance(ids, jax.core.Tracer):
            raise TypeError(
                "HotRowCache.observe() needs concrete ids, got a traced value: call it outside "
                "jit/vmap/scan, on the ids the step returns"
            )
        if isinstance(ids, jax.Array):
            ids.copy_to_host_async()
        else:
            ids = np.array(ids, dtype=np.int32, copy=True)
        with self._observe_lock:
            self._observed.append(ids)
            self._observed_size += int(np.prod(ids.shape))
            while self._observed_size > self._observe_window and len(self._observed) > 1:
                self._observed_size -= int(np.prod(self._observed.popleft().shape))

    def observed_profile(self) -> HotRowProfile:
        """A profile of the ids recorded by :meth:`observe` (waits for jax arrays to arrive)."""
        with self._observe_lock:
            batches = list(self._observed)
        return HotRowProfile.from_ids(np.asarray(b) for b in batches)

    def _take_observed(self) -> HotRowProfile:
        """Like :meth:`observed_profile`, and forget those ids; ids observed meanwhile stay."""
        with self._observe_lock:
            batches = list(self._observed)
            self._observed.clear()
            self._observed_size = 0
        return HotRowProfile.from_ids(np.asarray(b) for b in batches)

    def refresh(
        self,
        profile: HotRowProfile | None = None,
        *,
        observed_weight: float = 1.0,
        background: bool = False,
    ) -> concurrent.futures.Future | None:
        """Refill the cache and switch lookups over to it, without stalling them.

        ``profile``: the new frequencies; by default the current profile plus
        ``observed_weight`` times the ids recorded by :meth:`observe` since
        (which are then cleared). ``background=True`` runs on a worker thread
        and returns its Future. The idle buffer set is filled on a private
        stream while steps run; lookups launched after the switch read the new
        contents, lookups in flight finish on the old ones.
        """
        self._check_open()
        if profile is not None and not isinstance(profile, HotRowProfile):
            raise TypeError(
                f"profile must be a HotRowProfile or None, got {type(profile).__name__}"
            )
        if background:
            with self._state.lock:
                if self._state.executor is None:
                    self._state.executor = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="engram-cache-refresh"
                    )
            return self._state.executor.submit(self._refresh, profile, observed_weight)
        self._refresh(profile, observed_weight)
        return None

    def _refresh(self, profile: HotRowProfile | None, observed_weight: float) -> None:
        if profile is None:
            observed = self._take_observed()
            profile = (
                self._profile.merged(observed, observed_weight) if len(observed) else self._profile
            )
        with self._state.lock:
            self._check_open()
            for shard in self._state.shards:
                self._load(shard, profile)
            self._profile = profile

    def reload(self) -> None:
        """Copy the current hot rows again (after the table's rows were rewritten)."""
        self.refresh(self._profile)

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Free the cache once no lookup reads it. Later lookups naming it raise."""
        self._finalizer()

    def __enter__(self) -> HotRowCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# Static under jit, like tables: hashed by identity, no array leaves.
jax.tree_util.register_static(HotRowCache)
