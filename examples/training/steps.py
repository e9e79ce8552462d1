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
PREFETCH_MODES = ("off", "exact", "exact_split", "stale")
# The modes whose carry holds rows and an update left for the next step to apply.
DEFERRING_MODES = ("stale", "exact_split")
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


def _committed(tree):
    """``tree`` with every array committed to the device it is on (the others as they are)."""
    return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, x.sharding), tree)


class Steps:
    """The jitted steps of one model: with Engram (``tables``) or without (``None``).

    ``prefetch``: "off" (rows looked up in the step), "exact" (the next step's rows
    gathered after this step's updates: what "off" reads), "exact_split" (the same rows,
    with each update split in two: the rows the next batch reads updated at once, the
    rest deferred beside the next forward pass) or "stale" (one step stale, as
    jax-tpu-embedding's option: a step trains on rows that miss the last step's update).
    ``prefetch_ctas``: the prefetch's grid (``max_ctas`` of ``ej.lookup_start``; ``None``
    is the library's default, sized to leave a serving model its SMs: a training step
    has nothing beside the gather to spare them for, so pass the SM count there).
    ``order``: the lookups' and gathers' ``order`` ("dedup": each distinct row read once).
    ``update_stream``: where the row updates run: an XLA GPU stream (``apply_gradients``'s
    ``stream``; ``None``: XLA's own), or ``"side"``: ``ej.apply_gradients_start`` on the
    library's side stream, on ``update_ctas`` CTAs (``None``: ``ej.UPDATE_CTAS``).
    ``gather_after`` (stale and exact_split, side stream): ``"handle"`` queues the next
    gather behind the update on the side stream they share, XLA's stream waiting for the
    update only at the step's end; ``"token"`` makes XLA's stream wait for it before the
    gather starts (what the last release did: the comparison in benchmarks/train.py).
    ``compiler_options``: XLA options for the steps' executables (``jax.jit``'s).
    Run a model with :meth:`begin`, :meth:`advance` per step, :meth:`flush` before
    reading the tables (an evaluation) and :meth:`end`.
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
        order: str = "dedup",
        update_stream: int | str | None = 1,
        update_ctas: int | None = None,
        gather_after: str = "handle",
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
        if update_stream == "side":
            self.side, self.update_stream = True, None
        elif update_stream is None or isinstance(update_stream, int):
            self.side, self.update_stream = False, update_stream
        else:
            raise ValueError(f"update_stream must be an int, None or 'side', got {update_stream!r}")
        if gather_after not in ("handle", "token"):
            raise ValueError(f"gather_after must be 'handle' or 'token', got {gather_after!r}")
        self.order, self.update_ctas, self.gather_after = order, update_ctas, gather_after
        self._advanced = False
        self._defers = self.prefetch in DEFERRING_MODES
        jit = dict(compiler_options=compiler_options)
        donate = dict(donate_argnums=(0, 1), **jit)
        if self.prefetch == "off":
            self.step = jax.jit(self._step, **donate)
        else:
            step = {"exact": self._exact_step, "exact_split": self._exact_split_step,
                    "stale": self._stale_step}[self.prefetch]  # fmt: skip
            self.step = jax.jit(step, **donate)
            self.first = jax.jit(self._first, **jit)
            self.finish = jax.jit(self._finish, **jit)
            if self._defers:
                self.apply_pending = jax.jit(self._apply_pending, donate_argnums=0, **jit)
        self.eval = jax.jit(self._eval, **jit)

    # -- running --------------------------------------------------------------

    def begin(self, ids):
        """What the first step takes in (``carry``): ``None`` without prefetch."""
        return None if self.prefetch == "off" else self.first(ids)

    def advance(self, params, opt_state, step, carry, ids, inputs, targets, next_ids=None):
        """One training step: ``(params, opt_state, loss, carry)``. ``params`` and
        ``opt_state`` are donated; ``next_ids`` (the next step's row ids) is read only
        with prefetch; ``carry`` is what the last step (or :meth:`begin`) returned."""
        # An update on a stream commits the step's outputs to their device, so the
        # values a step hands back in are committed from the second step on: commit
        # them on the first too, or the second step compiles again.
        if not self._advanced:
            params, opt_state, carry = _committed((params, opt_state, carry))
            self._advanced = True
        if self.prefetch == "off":
            params, opt_state, loss = self.step(params, opt_state, step, ids, inputs, targets)
            return params, opt_state, loss, None
        return self.step(params, opt_state, step, carry, ids, inputs, targets, next_ids)

    def flush(self, carry):
        """``carry`` with every update written to the tables: a stale step leaves its
        own update to the next step (which applies it beside its forward pass, before
        it gathers the rows after next), an exact_split step the part of it that the
        next batch does not read; this applies it now, so the tables hold every step so
        far. The next step then trains as it would have."""
        if not self._defers or carry is None:
            return carry
        return self.apply_pending(carry)

    def end(self, carry) -> None:
        """Write the last update (stale, exact_split) and finish the last prefetch, whose
        rows no step uses."""
        if carry is not None:
            jax.block_until_ready(self.finish(self.flush(carry)))

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
                    order=self.order,
                    tag=("engram layer", e),
                    after=None if after is None else after[e],
                    max_ctas=self.prefetch_ctas,
                )
            )
        return handles

    def _grads(self, params, rows, ids, inputs, targets, between=None):
        """``(loss, dense grads, row grads, extra)``. ``between(loss)`` -> ``(extra, loss)``
        runs between the forward and the backward pass: what it issues comes after the
        forward pass if its inputs pass through an ``optimization_barrier`` with the
        loss, and the backward pass starts from the loss it returns, so after that too
        if the loss leaves through a barrier with its outputs. Barriers on the forward
        pass's residuals instead would make XLA fuse the forward pass otherwise and
        round the loss differently from a step without."""
        if rows is None:
            loss, g = jax.value_and_grad(model.loss, argnums=1)(
                self.cfg, params, None, ids, inputs, targets
            )
            return loss, g, None, None
        loss, backward = jax.vjp(
            lambda p, r: model.loss(self.cfg, p, r, ids, inputs, targets), params, rows
        )
        extra, seed = None, jnp.ones_like(loss)
        if between is not None:
            extra, tied = between(loss)
            # d loss / d loss, computed from the tied loss so it comes after ``extra``.
            seed = tied * 0 + 1
        g, g_rows = backward(seed)
        return loss, g, g_rows, extra

    def _start_updates(self, step, ids, g_rows, after=None):
        """Each table's row update for ``step``'s gradients: update handles on the side
        stream (``update_stream="side"``), else the updates' tokens."""
        lr = self.schedule(step) * TABLE_LR_MULT
        if self.side:
            return [
                ej.apply_gradients_start(
                    table, ids[e], g_rows[e], lr, step=step + 1, after=after,
                    max_ctas=self.update_ctas,
                )
                for e, table in enumerate(self.tables)
            ]  # fmt: skip
        return [
            ej.apply_gradients(
                table, ids[e], g_rows[e], lr, step=step + 1, after=after, stream=self.update_stream
            )
            for e, table in enumerate(self.tables)
        ]

    def _finish_updates(self, started):
        """The update tokens of :meth:`_start_updates`' result."""
        return [ej.apply_gradients_done(u) if self.side else u for u in started]

    def _update_rows(self, step, ids, g_rows, after=None):
        """Each table's row update for ``step``'s gradients: their tokens."""
        return self._finish_updates(self._start_updates(step, ids, g_rows, after))

    def _update_dense(self, params, opt_state, g):
        dense_updates, opt_state = self.dense.update(g, opt_state, params)
        return optax.apply_updates(params, dense_updates), opt_state

    # -- steps ----------------------------------------------------------------

    def _step(self, params, opt_state, step, ids, inputs, targets):
        rows = (
            None
            if self.tables is None
            else [ej.lookup(t, ids[e], order=self.order) for e, t in enumerate(self.tables)]
        )
        loss, g, g_rows, _ = self._grads(params, rows, ids, inputs, targets)
        if g_rows is not None:
            self._update_rows(step, ids, g_rows)
        params, opt_state = self._update_dense(params, opt_state, g)
        return params, opt_state, loss

    def _first(self, ids):
        """What the first step carries in: its lookups in flight ("exact"), or its rows
        and a pending update that writes nothing (dead ids: "stale", "exact_split")."""
        handles = self._start(ids)
        if self.prefetch == "exact":
            return handles
        rows = [ej.lookup_done(h) for h in handles]
        return rows, self._nothing_pending(ids, rows)

    @staticmethod
    def _nothing_pending(ids, rows):
        dead = [jnp.full_like(i, ej.DEAD_ID) for i in ids]
        return dead, [jnp.zeros_like(r) for r in rows], jnp.zeros((), jnp.int32)

    def _finish(self, carry):
        """Ends the last step's prefetch, which no step uses."""
        rows = [ej.lookup_done(h) for h in carry] if self.prefetch == "exact" else carry[0]
        return sum(r.sum() for r in rows)

    def _apply_pending(self, carry):
        rows, (ids, g_rows, step) = carry
        tokens = self._update_rows(step, ids, g_rows)
        # The carry comes back once the updates are written.
        rows, tokens = jax.lax.optimization_barrier((rows, tokens))
        return rows, self._nothing_pending(ids, rows)

    def _exact_step(self, params, opt_state, step, carry, ids, inputs, targets, next_ids):
        """``carry`` holds this step's lookups, started a step ago after that step's
        updates; the next ones start after this step's updates (the rows a plain lookup
        would read)."""
        rows = [ej.lookup_done(h) for h in carry]
        loss, g, g_rows, _ = self._grads(params, rows, ids, inputs, targets)
        started = self._start_updates(step, ids, g_rows)
        params, opt_state = self._update_dense(params, opt_state, g)
        if self.side:  # waited for once the weights are updated, which run beside it
            params, started = jax.lax.optimization_barrier((params, started))
        return params, opt_state, loss, self._start(next_ids, after=self._finish_updates(started))

    def _stale_step(self, params, opt_state, step, carry, ids, inputs, targets, next_ids):
        """``carry`` holds this step's rows (gathered during the last step) and the last
        step's row gradients, not yet applied. Their update runs on ``update_stream``
        beside this step's forward pass; the next step's rows are gathered after it,
        between the forward and the backward pass, so they miss only this step's
        update (one step stale), which the next step applies in turn. So none of the
        PCIe traffic waits for this step's gradients, and both the update and the gather
        can run beside compute; how much of them does is measured in
        benchmarks/README.md ("Training updates")."""
        loss, g, g_rows, next_rows, finish = self._behind_pending(
            params, carry, ids, inputs, targets, next_ids
        )
        params, opt_state = self._update_dense(params, opt_state, g)
        return finish(params), opt_state, loss, (next_rows, (list(ids), g_rows, step))

    def _exact_split_step(self, params, opt_state, step, carry, ids, inputs, targets, next_ids):
        """Exact order, with the update of the rows the next batch does not read left to
        the next step. ``carry`` holds this step's rows (what a plain lookup reads) and
        the last step's gradients of the rows this batch does not read, not yet applied.
        That update runs beside this step's forward pass and the next rows are gathered
        behind it, as in :meth:`_stale_step`; once this step's gradients exist, only the
        rows both batches hold are updated (about a sixth of the distinct rows on the
        example's text) and read again into the gathered ones, so the next step trains on
        exactly the rows it would read after the whole update. Every row's update is the
        same arithmetic as in one call (all of a row's gradients go to one of the two), so
        the losses equal the plain step's bit for bit. Only the shared rows' update and
        second read wait for the gradients, against the whole update and gather in
        "exact"."""
        loss, g, g_rows, gathered, finish = self._behind_pending(
            params, carry, ids, inputs, targets, next_ids
        )
        lr = self.schedule(step) * TABLE_LR_MULT
        next_rows, later_ids = [], []
        for e, table in enumerate(self.tables):
            # Sorting the next batch's ids and searching them scales; jnp.isin's default
            # compares every pair.
            read_next = jnp.isin(ids[e], next_ids[e], method="binary_search")
            # After the gather has read the rows (their old values, replaced below).
            token = ej.apply_gradients(
                table, jnp.where(read_next, ids[e], ej.DEAD_ID), g_rows[e], lr, step=step + 1,
                after=gathered[e], stream=self.update_stream,
            )  # fmt: skip
            updated = jnp.isin(next_ids[e], ids[e], method="binary_search")
            fresh = ej.lookup(
                table, jnp.where(updated, next_ids[e], ej.DEAD_ID), order=self.order, after=token
            )
            next_rows.append(jnp.where(updated[..., None], fresh, gathered[e]))
            later_ids.append(jnp.where(read_next, ej.DEAD_ID, ids[e]))
        params, opt_state = self._update_dense(params, opt_state, g)
        return finish(params), opt_state, loss, (next_rows, (later_ids, g_rows, step))

    def _behind_pending(self, params, carry, ids, inputs, targets, next_ids):
        """The forward and backward pass of a step whose ``carry`` holds its rows and an
        update left by the last step: that update started beside the forward pass, the
        next rows gathered behind it beside the backward pass. ``(loss, dense grads, row
        grads, next rows, finish)``; ``finish(params)`` ties the wait for the update to
        the updated weights (side stream)."""
        rows, (last_ids, last_g_rows, last_step) = carry
        started = self._start_updates(last_step, last_ids, last_g_rows)
        if self.side:  # queued before the forward pass, which needs the rows
            rows, started = jax.lax.optimization_barrier((rows, started))

        queue = self.side and self.gather_after == "handle"

        def start_next(loss):
            # After the forward pass, which the updates run beside; before the backward
            # pass, which the gathers run beside. Queued behind the updates on the side
            # stream, the gathers need no wait on XLA's stream, which then waits for the
            # updates only once the weights are updated; else it waits here.
            next_ids_, loss, started_ = jax.lax.optimization_barrier((next_ids, loss, started))
            after = started_ if queue else self._finish_updates(started_)
            handles = self._start(next_ids_, after=after)
            return jax.lax.optimization_barrier(((handles, started_), loss))

        loss, g, g_rows, (handles, started) = self._grads(
            params, rows, ids, inputs, targets, start_next
        )
        next_rows = [ej.lookup_done(h) for h in handles]

        def finish(params):
            if not queue:
                return params
            return jax.lax.optimization_barrier((params, self._finish_updates(started)))[0]

        return loss, g, g_rows, next_rows, finish

    def _eval(self, params, ids, inputs, targets):
        rows = (
            None
            if self.tables is None
            else [ej.lookup(t, ids[e], order=self.order) for e, t in enumerate(self.tables)]
        )
        return model.loss(self.cfg, params, rows, ids, inputs, targets)
