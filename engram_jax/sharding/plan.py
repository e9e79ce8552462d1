"""Head-shard arithmetic: which hash columns, and so which contiguous rows of
a layer's table, each (tp_rank, edp_rank) of a mesh holds, and the
:class:`ShardPlan` that says how one layer's lookup is spread.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

MODES = ("heads", "shared")
EXCHANGES = ("all_to_all", "all_gather_select", "all_to_all_packed")


def column_sizes(layout: Any, layer: int = 0) -> np.ndarray:
    """Rows per hash column of one layer, int64 ``[n_cols]``.

    ``layout`` is an :class:`~engram_jax.EngramLayout` (or anything with
    ``offsets`` ``[n_layers, n_cols]`` and per-layer ``num_embeddings``; ``layer``
    is the row of ``offsets``, i.e. the index in ``layer_ids`` order), or the
    per-column sizes themselves (1-D, the layout's primes for that layer).
    """
    if hasattr(layout, "offsets") and hasattr(layout, "num_embeddings"):
        offsets = np.asarray(layout.offsets, dtype=np.int64)
        totals = np.asarray(layout.num_embeddings, dtype=np.int64).reshape(-1)
        if offsets.ndim == 2:
            offsets = offsets[layer]
        total = totals[layer] if totals.size > 1 else totals[0]
        if offsets.size == 0 or offsets[0] != 0:
            raise ValueError(f"layer {layer}'s offsets must start at 0, got {offsets[:1]}")
        sizes = np.diff(np.append(offsets, total))
    else:
        sizes = np.asarray(layout)
        if sizes.ndim != 1 or not np.issubdtype(sizes.dtype, np.integer):
            raise TypeError(
                "expected an EngramLayout or 1-D integer per-column sizes, "
                f"got {type(layout).__name__} {getattr(sizes, 'shape', '')}"
            )
        sizes = sizes.astype(np.int64)
    if sizes.size == 0 or np.any(sizes <= 0):
        raise ValueError(f"every hash column needs at least one row, got sizes {sizes.tolist()}")
    if sizes.sum() > 2**31:
        raise ValueError("a layer's rows are int32 ids: at most 2**31 rows")
    return sizes


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """What one (tp_rank, edp_rank) owns: columns ``[col_start, col_stop)`` and
    their rows ``[row_start, row_stop)`` of the layer table.

    ``rank`` is the head-shard rank (``tp_rank * edp + edp_rank`` for head
    sharding, ``tp_rank`` for shared tables); it covers columns
    ``[rank * part, (rank + 1) * part)``, of which those past ``n_cols`` are
    padding (zero rows, cut from the result), so a shard may hold no rows.
    """

    tp_rank: int
    edp_rank: int
    rank: int
    part: int
    col_start: int
    col_stop: int
    row_start: int
    row_stop: int

    @property
    def num_rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def num_cols(self) -> int:
        return self.col_stop - self.col_start


def _shard_count(tp: int, edp: int, mode: str) -> int:
    return tp * edp if mode == "heads" else tp


def head_shard(
    layout: Any,
    tp: int,
    edp: int,
    tp_rank: int,
    edp_rank: int,
    *,
    layer: int = 0,
    mode: str = "heads",
) -> HeadShard:
    """The columns and rows ``(tp_rank, edp_rank)`` owns; see :class:`HeadShard`.

    ``mode="heads"``: tp * edp head shards, TP-major. ``mode="shared"``: the EDP
    replicas of a node share one table, so only TP splits the columns.
    """
    sizes = column_sizes(layout, layer)
    check_sizes(tp, edp, mode)
    if not (0 <= tp_rank < tp and 0 <= edp_rank < edp):
        raise ValueError(f"rank ({tp_rank}, {edp_rank}) is outside tp={tp}, edp={edp}")
    n_cols = sizes.size
    shards = _shard_count(tp, edp, mode)
    part = -(-n_cols // shards)
    rank = tp_rank * edp + edp_rank if mode == "heads" else tp_rank
    col_start = min(rank * part, n_cols)
    col_stop = min(col_start + part, n_cols)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return HeadShard(
        tp_rank=tp_rank,
        edp_rank=edp_rank,
        rank=rank,
        part=part,
        col_start=col_start,
        col_stop=col_stop,
        row_start=int(bounds[col_start]),
        row_stop=int(bounds[col_stop]),
    )


def head_shards(
    layout: Any, tp: int, edp: int = 1, *, layer: int = 0, mode: str = "heads"
) -> list[HeadShard]:
    """Every (tp_rank, edp_rank)'s :class:`HeadShard`, in TP-major order."""
    return [
        head_shard(layout, tp, edp, t, e, layer=layer, mode=mode)
        for t in range(tp)
        for e in range(edp)
    ]


def check_sizes(tp: int, edp: int, mode: str) -> None:
    """Raise unless ``tp`` and ``edp`` are positive ints and ``mode`` is one of :data:`MODES`."""
    for name, value in (("tp", tp), ("edp", edp)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How one layer's lookup is spread over a mesh (static, hashable).

    ``sizes``: rows per hash column (the layer's primes; see :meth:`from_layout`).
    ``mode``: ``"heads"`` (EDP head sharding; with ``edp=1`` this is TP only) or
    ``"shared"`` (the node-local EDP group reads one shared table per TP rank).
    ``exchange``: how head-sharded rows go back to their replica: ``"all_to_all"``
    (each rank sends 1/edp of its rows to each peer), ``"all_gather_select"``
    (every rank receives every row and keeps its own: edp times the bytes) or
    ``"all_to_all_packed"`` (the all-to-all of the packed fp8 records instead of
    bf16 rows, ``dim + dim/32`` bytes a row: 0.52x for dim 256; the TP all-gather
    moves records too, and each rank decodes its tokens' rows at the end, with
    the lookup's own decode, so the rows are the same bits).
    ``slot``: tokens per replica after padding with DEAD_ID (default: the local
    token count); a replica with more tokens than the slot is an error.
    ``tp_axis``/``edp_axis``: mesh axis names; an axis of size 1 may be absent.
    """

    sizes: tuple[int, ...]
    tp: int = 1
    edp: int = 1
    mode: str = "heads"
    exchange: str = "all_to_all"
    slot: int | None = None
    tp_axis: str = "tp"
    edp_axis: str = "edp"

    def __post_init__(self) -> None:
        sizes = column_sizes(np.asarray(self.sizes, dtype=np.int64))
        object.__setattr__(self, "sizes", tuple(int(s) for s in sizes))
        check_sizes(self.tp, self.edp, self.mode)
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if self.slot is not None and (
            not isinstance(self.slot, (int, np.integer)) or self.slot < 1
        ):
            raise ValueError(f"slot must be a positive int or None, got {self.slot!r}")
        if self.tp_axis == self.edp_axis:
            raise ValueError(f"tp_axis and edp_axis must differ, both are {self.tp_axis!r}")

    @classmethod
    def from_layout(cls, layout: Any, layer: int = 0, **kwargs: Any) -> ShardPlan:
        """The plan for the layer at index ``layer`` of ``layout.layer_ids`` (the row of
        its ``offsets``, not the model layer id), or for per-column sizes."""
        return cls(tuple(int(s) for s in column_sizes(layout, layer)), **kwargs)

    @property
    def n_cols(self) -> int:
        return len(self.sizes)

    @property
    def num_rows(self) -> int:
        return sum(self.sizes)

    @property
    def shards(self) -> int:
        """Head shards the columns are split into."""
        return _shard_count(self.tp, self.edp, self.mode)

    @property
    def part(self) -> int:
        """Columns per head shard, padding included."""
        return -(-self.n_cols // self.shards)

    @property
    def exchanges_rows(self) -> bool:
        """Whether rows cross the EDP axis (head sharding over more than one replica)."""
        return self.mode == "heads" and self.edp > 1

    @property
    def moves_records(self) -> bool:
        """Whether packed records, not bf16 rows, cross devices (and are decoded
        after): a packed exchange with rows crossing EDP or TP."""
        return self.exchange == "all_to_all_packed" and (self.exchanges_rows or self.tp > 1)

    def shard(self, tp_rank: int, edp_rank: int) -> HeadShard:
        return head_shard(self.sizes, self.tp, self.edp, tp_rank, edp_rank, mode=self.mode)
