"""The Engram tables as trainable host tables and the jitted training steps: rows
looked up (or prefetched a step ahead), the gradient of the loss with respect to
them, ``ej.apply_gradients`` for the rows and optax for the rest of the model.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from serving.cli import UserError

import engram_jax as ej

from . import model

# DeepSeek trains the tables with Adam at 5x the base learning rate, no weight decay.
TABLE_LR_MULT = 5.0
TABLE_OPTIMIZERS = ("lazy_adam", "row_adagrad")
PREFETCH_MODES = ("off", "exact", "stale")
INIT_CHUNK_ROWS = 1 << 16


def table_optimizer(name: str, dtype) -> ej.RowOptimizer:
    if name == "lazy_adam":
        # Moments in the table's dtype: a bf16 table with bf16 moments is 3x its rows.
        return ej.lazy_adam(moment_dtype=dtype)
    return ej.row_adagrad()


def bytes_per_row(dim: int, dtype, optimizer: str) -> int:
    """Host bytes of one row and its optimizer state."""
    itemsize = jnp.dtype(dtype).itemsize
    state = 2 * dim * itemsize if optimizer == "lazy_adam" else 4
    return dim * itemsize + state


def build_tables(
    layout,
    dtype,
    optimizer: str,
    placement: str,
    device,
    init_std: float,
    seed: int,
    stack: contextlib.ExitStack,
) -> tuple:
    """One trainable table per Engram layer (closed by ``stack``), rows ~ N(0, init_std)
    (:func:`init_rows`; zero rows for ``init_std`` 0)."""
    tables = []
    for i, rows in enumerate(layout.num_embeddings):
        try:
            table = ej.TrainableTable.allocate(
                rows,
                layout.head_dim,
                dtype=dtype,
                optimizer=table_optimizer(optimizer, dtype),
                placement=placement,
                device=device if device.platform == "gpu" else None,
            )
        except (ValueError, RuntimeError, MemoryError) as exc:
            raise UserError(f"cannot allocate the Engram tables ({placement}): {exc}") from None
        stack.callback(table.close)
        tables.append(table)
        if init_std > 0:
            init_rows(table, init_std, (seed, i))
    return tuple(tables)


def init_rows(table, init_std: float, seed, chunk_rows: int = INIT_CHUNK_ROWS) -> None:
    """Write rows ~ N(0, init_std) into ``table``, every row distinct, at memory speed.

    One block of random values (at least ``num_rows / dim`` rows, so the table takes
    at most ``dim`` blocks), read as a cycle: block c of the table starts ``c``
    values before the block's start, so row j of block c is the ``dim`` values from
    position ``(j * dim - c) mod size``. No two rows start at the same position, and
    two windows of ``dim`` random values at different positions are equal only by a
    chance of about ``p ** dim`` (``p``: that two values are equal). On two CPU cores
    this writes 1 GiB of bf16 rows (lazy_adam records) in 0.7 s, where a fresh normal
    draw per block took 6.4 s.
    """
    num_rows, dim = table.num_rows, table.dim
    if not num_rows:
        return
    block_rows = min(num_rows, max(chunk_rows, -(-num_rows // dim)))
    size = block_rows * dim
    values = np.random.default_rng(seed).standard_normal(size, np.float32)
    values = (values * np.float32(init_std)).astype(table.dtype)
    cycle = np.concatenate([values, values])
    for c, lo in enumerate(range(0, num_rows, block_rows)):
        n = min(block_rows, num_rows - lo)
        table.write_rows(lo, cycle[size - c : 2 * size - c].reshape(block_rows, dim)[:n])


def make_hash(layout):
    """Compressed ids and segments ``[B, S]`` -> each Engram layer's row ids ``[B, S, n_cols]``."""

    @jax.jit
    def hash_batch(compressed, segments):
        b, s = compressed.shape
        ids = ej.hash_ngrams(layout, compressed.reshape(-1), segment_ids=segments.reshape(-1))
        ids = ids.reshape(b, s, layout.n_layers, layout.n_cols)
        return tuple(ids[:, :, i] for i in range(layout.n_layers))

    return hash_batch


def dense_optimizer(lr: float, warmup: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """optax's Adam for the model's weights and its schedule: a linear warmup over
    ``warmup`` steps from ``lr / (warmup + 1)`` (step 0 moves the weights too) to ``lr``."""
    schedule = optax.linear_schedule(lr / (warmup + 1), lr, warmup)
    return optax.adam(schedule), schedule


class Steps:
    """The jitted steps of one model: with Engram (``tables``) or without (``None``).

    ``prefetch_ctas``: the prefetch's grid (``max_ctas`` of ``ej.lookup_start``; ``None``
    is the library's default, sized to leave a serving model its SMs: a training step
    has nothing beside the gather to spare them for, so pass the SM count there).
    ``compiler_options``: XLA options for the steps' executables (``jax.jit``'s).
    Run a model with :meth:`begin`, :meth:`advance` per step and :meth:`end`.
    """

    def __init__(
        self,
        cfg,
        tables,
        dense: optax.GradientTransformation,
        schedule,
        prefetch,
        prefetch_ctas: int | None = None,
        compiler_options: dict | None = None,
    ):
        if prefetch_ctas is not None and (
            isinstance(prefetch_ctas, bool)
            or not isinstance(prefetch_ctas, (int, np.integer))
            or prefetch_ctas < 1
        ):
            raise ValueError(f"prefetch_ctas must be an int >= 1 or None, got {prefetch_ctas!r}")
        self.cfg, self.tables, self.dense, self.schedule = cfg, tables, dense, schedule
        self.prefetch = prefetch if tables is not None else "off"
        self.prefetch_ctas = None if prefetch_ctas is None else int(prefetch_ctas)
        jit = dict(compiler_options=compiler_options)
        donate = dict(donate_argnums=(0, 1), **jit)
        if self.prefetch == "off":
            self.step = jax.jit(self._step, **donate)
        else:
            self.step = jax.jit(self._prefetch_step, **donate)
            self.first = jax.jit(self._first, **jit)
            self.finish = jax.jit(self._finish, **jit)
        self.eval = jax.jit(self._eval, **jit)

    # -- running --------------------------------------------------------------

    def begin(self, ids):
        """What the first step takes in (``carry``): ``None`` without prefetch."""
        return None if self.prefetch == "off" else self.first(ids)

    def advance(self, params, opt_state, step, carry, ids, inputs, targets, next_ids=None):
        """One training step: ``(params, opt_state, loss, carry)``. ``params`` and
        ``opt_state`` are donated; ``next_ids`` (the next step's row ids) is read only
        with prefetch; ``carry`` is what the last step (or :meth:`begin`) returned."""
        if self.prefetch == "off":
            params, opt_state, loss = self.step(params, opt_state, step, ids, inputs, targets)
            return params, opt_state, loss, None
        return self.step(params, opt_state, step, carry, ids, inputs, targets, next_ids)

    def end(self, carry) -> None:
        """Finish the last step's prefetch, which no step uses (its rows are dropped)."""
        if carry is not None:
            jax.block_until_ready(self.finish(carry))

    # -- pieces ---------------------------------------------------------------

    def _start(self, ids, after=None):
        # One tag per layer: a handle's completion event is part of its pytree
        # structure, and an untagged start gets a new one each time it is traced, so
        # the handles one step returns would not match what the step was compiled for
        # and every step would compile again.
        handles = []
        for e, table in enumerate(self.tables):
            handles.append(
                ej.lookup_start(
                    table,
                    ids[e],
                    tag=("engram layer", e),
                    after=None if after is None else after[e],
                    max_ctas=self.prefetch_ctas,
                )
            )
        return handles

    def _grads(self, params, rows, ids, inputs, targets):
        if rows is None:
            loss, g = jax.value_and_grad(model.loss, argnums=1)(
                self.cfg, params, None, ids, inputs, targets
            )
            return loss, g, None
        loss, (g, g_rows) = jax.value_and_grad(model.loss, argnums=(1, 2))(
            self.cfg, params, rows, ids, inputs, targets
        )
        return loss, g, g_rows

    def _update(self, params, opt_state, step, ids, g, g_rows, after=None):
        lr = self.schedule(step)
        updates = []
        if g_rows is not None:
            for e, table in enumerate(self.tables):
                updates.append(
                    ej.apply_gradients(
                        table, ids[e], g_rows[e], lr * TABLE_LR_MULT, step=step + 1, after=after
                    )
                )
        dense_updates, opt_state = self.dense.update(g, opt_state, params)
        return optax.apply_updates(params, dense_updates), opt_state, updates

    # -- steps ----------------------------------------------------------------

    def _step(self, params, opt_state, step, ids, inputs, targets):
        rows = (
            None
            if self.tables is None
            else [ej.lookup(t, ids[e]) for e, t in enumerate(self.tables)]
        )
        loss, g, g_rows = self._grads(params, rows, ids, inputs, targets)
        params, opt_state, _ = self._update(params, opt_state, step, ids, g, g_rows)
        return params, opt_state, loss

    def _first(self, ids):
        """What the first step carries in: its lookups in flight ("exact"), or its rows."""
        handles = self._start(ids)
        return handles if self.prefetch == "exact" else [ej.lookup_done(h) for h in handles]

    def _finish(self, carry):
        """Ends the last step's prefetch, which no step uses."""
        rows = [ej.lookup_done(h) for h in carry] if self.prefetch == "exact" else carry
        return sum(r.sum() for r in rows)

    def _prefetch_step(self, params, opt_state, step, carry, ids, inputs, targets, next_ids):
        """The next step's rows gathered during this one. "exact": ``carry`` holds this
        step's lookups, started a step ago after that step's updates; the next ones
        start after this step's updates (the rows a plain lookup would read). "stale":
        ``carry`` holds this step's rows; the next rows are gathered from the top of
        the step and finished before the updates, which wait for them (``after=``),
        so they miss this step's update of the rows both batches share."""
        if self.prefetch == "exact":
            rows = [ej.lookup_done(h) for h in carry]
            loss, g, g_rows = self._grads(params, rows, ids, inputs, targets)
            params, opt_state, updates = self._update(params, opt_state, step, ids, g, g_rows)
            return params, opt_state, loss, self._start(next_ids, after=updates)
        # Started before the forward pass reads this step's rows: untied, XLA may
        # issue a start as late as just before its done, and the gather then overlaps
        # nothing (the README's "early" rule for prefetch).
        rows, handles = jax.lax.optimization_barrier((carry, self._start(next_ids)))
        loss, g, g_rows = self._grads(params, rows, ids, inputs, targets)
        next_rows = [ej.lookup_done(h) for h in handles]
        params, opt_state, _ = self._update(
            params, opt_state, step, ids, g, g_rows, after=(rows, next_rows)
        )
        return params, opt_state, loss, next_rows

    def _eval(self, params, ids, inputs, targets):
        rows = (
            None
            if self.tables is None
            else [ej.lookup(t, ids[e]) for e, t in enumerate(self.tables)]
        )
        return model.loss(self.cfg, params, rows, ids, inputs, targets)
