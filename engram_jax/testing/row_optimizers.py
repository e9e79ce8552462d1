"""numpy references for :func:`engram_jax.apply_gradients`: each row optimizer
applied to a table held as a numpy array, one distinct row at a time.

The contract they check: ids the table does not hold are ignored; the
gradients of equal ids are summed in chunks (:func:`summed_gradients` says how);
each distinct row is updated once; every float operation is rounded as written here (float32
numpy scalars and arrays, no fused multiply-add), rows and moments stored in
their dtype. They share no code with the kernels.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32

# Entries per chunk of a row's gradient sum: kGradChunk of ffi/kernels/train_rows.h.
GRAD_CHUNK = 64


def summed_gradients(
    ids: np.ndarray, grads: np.ndarray, row_start: int, num_rows: int, *, chunk: int = GRAD_CHUNK
) -> tuple[np.ndarray, np.ndarray]:
    """(distinct held table-local rows ascending, their float32 summed gradients
    ``[n, dim]``). A row's positions, ascending, are cut into chunks of ``chunk``
    from the first; each chunk is summed in order from +0.0, then the chunk sums
    are added in order from +0.0 (so a row seen at most ``chunk`` times gets its
    plain position-order sum, and the kernels can sum a hot row's chunks at once)."""
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    grads = np.asarray(grads)
    grads = grads.reshape(ids.size, grads.shape[-1]).astype(F32)
    local = ids - row_start
    held = (local >= 0) & (local < num_rows)
    rows = np.unique(local[held])
    sums = np.zeros((rows.size, grads.shape[1]), F32)
    for k, row in enumerate(rows):
        positions = np.flatnonzero(local == row)  # ascending
        total = np.zeros(grads.shape[1], F32)
        for start in range(0, positions.size, chunk):
            acc = np.zeros(grads.shape[1], F32)
            for pos in positions[start : start + chunk]:
                acc = (acc + grads[pos]).astype(F32)
            total = (total + acc).astype(F32)
        sums[k] = total
    return rows, sums


def _store(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` (float32) as stored in ``dtype`` and read back as float32."""
    return values.astype(dtype).astype(F32)


def sgd_reference(
    weight: np.ndarray, ids: np.ndarray, grads: np.ndarray, lr: float, *, row_start: int = 0
) -> np.ndarray:
    """``weight`` after one SGD update: ``p + (-lr) * g`` per held row."""
    out = np.array(weight)
    rows, g = summed_gradients(ids, grads, row_start, weight.shape[0])
    p = out[rows].astype(F32)
    out[rows] = (p + (-F32(lr)) * g).astype(out.dtype)
    return out


def adagrad_reference(
    weight: np.ndarray,
    sum_of_squares: np.ndarray,
    ids: np.ndarray,
    grads: np.ndarray,
    lr: float,
    *,
    eps: float = 1e-7,
    row_start: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(weight, sum_of_squares) after one Adagrad update in optax.adagrad's order of
    roundings, with ``1 / sqrt`` correctly rounded."""
    out, acc_out = np.array(weight), np.array(sum_of_squares, F32)
    rows, g = summed_gradients(ids, grads, row_start, weight.shape[0])
    acc = (g * g + acc_out[rows]).astype(F32)
    with np.errstate(divide="ignore"):
        scale = np.where(acc > 0, F32(1) / np.sqrt(acc + F32(eps)), F32(0)).astype(F32)
    p = out[rows].astype(F32)
    out[rows] = (p + (-F32(lr)) * (scale * g)).astype(out.dtype)
    acc_out[rows] = acc
    return out, acc_out


def row_adagrad_reference(
    weight: np.ndarray,
    accumulator: np.ndarray,
    ids: np.ndarray,
    grads: np.ndarray,
    lr: float,
    *,
    eps: float = 1e-8,
    row_start: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """(weight, accumulator ``[rows]``) after one row-wise Adagrad update:
    ``acc += mean(g**2)`` (squares summed into 32 lanes, value j into lane j % 32 in
    order of j, the lanes folded in halves 16, 8, 4, 2, 1), ``p - lr / (sqrt(acc) + eps) * g``."""
    out, acc_out = np.array(weight), np.array(accumulator, F32)
    rows, g = summed_gradients(ids, grads, row_start, weight.shape[0])
    dim = weight.shape[1]
    lanes = np.zeros((rows.size, 32), F32)
    for j in range(dim):
        lanes[:, j % 32] = (lanes[:, j % 32] + g[:, j] * g[:, j]).astype(F32)
    half = 16
    while half >= 1:
        lanes[:, :half] = (lanes[:, :half] + lanes[:, half : 2 * half]).astype(F32)
        half //= 2
    acc = (acc_out[rows] + lanes[:, 0] / F32(dim)).astype(F32)
    multiplier = (F32(lr) / (np.sqrt(acc) + F32(eps))).astype(F32)
    p = out[rows].astype(F32)
    out[rows] = (p - multiplier[:, None] * g).astype(out.dtype)
    acc_out[rows] = acc
    return out, acc_out


def lazy_adam_step_size(lr: float, step: int, b1: float, b2: float) -> np.float32:
    """torch SparseAdam's bias-corrected step size, in float64, rounded once."""
    return F32(lr * np.sqrt(1.0 - b2**step) / (1.0 - b1**step))


def lazy_adam_reference(
    weight: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    ids: np.ndarray,
    grads: np.ndarray,
    lr: float,
    step: int,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    row_start: int = 0,
    step_size: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight, exp_avg, exp_avg_sq) after one lazy Adam update (torch SparseAdam):
    only held rows with a gradient move; their moments, stored in the moments' dtype
    and used as stored, are ``m += (g - m) * (1 - b1)``, ``v += (g*g - v) * (1 - b2)``;
    ``p + (-step_size) * (m / (sqrt(v) + eps))``. ``step_size`` defaults to
    :func:`lazy_adam_step_size` (pass the library's own float32 figure to compare the
    row math bit for bit)."""
    out, m_out, v_out = np.array(weight), np.array(exp_avg), np.array(exp_avg_sq)
    rows, g = summed_gradients(ids, grads, row_start, weight.shape[0])
    size = lazy_adam_step_size(lr, step, b1, b2) if step_size is None else F32(step_size)
    m0, v0 = m_out[rows].astype(F32), v_out[rows].astype(F32)
    m = _store(m0 + (g - m0) * F32(1.0 - b1), m_out.dtype)
    v = _store(v0 + (g * g - v0) * F32(1.0 - b2), v_out.dtype)
    p = out[rows].astype(F32)
    out[rows] = (p + (-size) * (m / (np.sqrt(v) + F32(eps)))).astype(out.dtype)
    m_out[rows], v_out[rows] = m.astype(m_out.dtype), v.astype(v_out.dtype)
    return out, m_out, v_out


def trainable_lookup_reference(weight: np.ndarray, ids: np.ndarray, *, row_start: int = 0):
    """Rows of ``weight`` for ``ids`` ``[...]`` -> ``[..., dim]``, zeros where not held."""
    ids = np.asarray(ids).astype(np.int64)
    local = ids - row_start
    held = (local >= 0) & (local < weight.shape[0])
    out = np.zeros(ids.shape + (weight.shape[1],), weight.dtype)
    out[held] = weight[local[held]]
    return out
