"""Row optimizers: what :func:`~engram_jax.apply_gradients` does to each row of a
:class:`~engram_jax.TrainableTable` that got a gradient.

A :class:`RowOptimizer` is a frozen, hashable spec (static under ``jit``); the
table holds its state beside each row. The math, one value at a time, is the
native ``kernels/train_rows.h``; :mod:`engram_jax.testing.row_optimizers` has a
numpy reference for each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.typing import ArrayLike

from engram_jax import _native

# RowOptimizerKind of the native code (ffi/kernels/train_rows.h), by name.
OPTIMIZER_CODES: dict[str, int] = dict(_native.native.row_optimizers)
# RowFormat of the native code, by numpy dtype name: the rows' and the moments' dtypes.
FORMAT_CODES: dict[str, int] = dict(_native.native.row_formats)
ROW_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


def as_row_dtype(dtype: object, what: str = "dtype") -> np.dtype:
    """``dtype`` (numpy, jnp or a name) as float32 or bfloat16, else a TypeError."""
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what} must be float32 or bfloat16, got {dtype!r}") from None
    if resolved not in ROW_DTYPES:
        raise TypeError(f"{what} must be float32 or bfloat16, got {resolved}")
    return resolved


@dataclasses.dataclass(frozen=True)
class RowOptimizer:
    """One optimizer's spec; build it with :func:`sgd`, :func:`adagrad`,
    :func:`row_adagrad` or :func:`lazy_adam` (the fields not used by ``name`` stay 0)."""

    name: str
    initial_accumulator_value: float = 0.0
    eps: float = 0.0
    b1: float = 0.0
    b2: float = 0.0
    moment_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_CODES:
            raise ValueError(
                f"optimizer must be one of {tuple(OPTIMIZER_CODES)}, got {self.name!r}"
            )
        for field in ("initial_accumulator_value", "eps", "b1", "b2"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
                raise TypeError(f"{field} must be a Python float, got {value!r}")
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"{field} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, field, float(value))
        if not (self.b1 < 1 and self.b2 < 1):
            raise ValueError(f"b1 and b2 must be < 1, got {self.b1}, {self.b2}")
        object.__setattr__(
            self, "moment_dtype", as_row_dtype(self.moment_dtype, "moment_dtype").name
        )

    @property
    def code(self) -> int:
        """The native RowOptimizerKind."""
        return OPTIMIZER_CODES[self.name]

    @property
    def moment_code(self) -> int:
        return FORMAT_CODES[self.moment_dtype]

    def state_fields(self, dim: int) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
        """The state one row holds: ``(name, shape per row, dtype)`` for each array."""
        if self.name == "adagrad":
            return (("sum_of_squares", (dim,), np.dtype(np.float32)),)
        if self.name == "row_adagrad":
            return (("accumulator", (), np.dtype(np.float32)),)
        if self.name == "lazy_adam":
            moment = np.dtype(self.moment_dtype)
            return (("exp_avg", (dim,), moment), ("exp_avg_sq", (dim,), moment))
        return ()

    def initial_state(self, num_rows: int, dim: int) -> dict[str, np.ndarray]:
        """The state of ``num_rows`` fresh rows (accumulators at their initial value,
        moments at zero)."""
        fill = self.initial_accumulator_value if self.name in ("adagrad", "row_adagrad") else 0.0
        return {
            name: np.full((num_rows, *shape), fill, dtype)
            for name, shape, dtype in self.state_fields(dim)
        }

    @property
    def needs_step(self) -> bool:
        """Whether :func:`~engram_jax.apply_gradients` needs ``step`` (bias correction)."""
        return self.name == "lazy_adam"

    def scalars(self) -> dict[str, np.float32]:
        """The float attributes of the native update: eps, 1 - b1, 1 - b2 (each rounded
        to float32 once, from the Python floats)."""
        return {
            "eps": np.float32(self.eps),
            "one_minus_b1": np.float32(1.0 - self.b1),
            "one_minus_b2": np.float32(1.0 - self.b2),
        }

    def step_size(self, learning_rate: ArrayLike, step: ArrayLike | None) -> jax.Array:
        """The float32 scalar the native update scales by: the learning rate, or for
        lazy Adam ``lr * sqrt(1 - b2**step) / (1 - b1**step)`` (torch SparseAdam's
        bias correction, ``step`` counted from 1), computed in float32 with jnp, the
        same bits whether ``learning_rate`` and ``step`` are traced or constants."""
        lr = jnp.asarray(learning_rate, jnp.float32)
        if not self.needs_step:
            return lr
        t = jnp.asarray(step, jnp.float32)
        # Constant inputs (a Python step in an unrolled loop) would let XLA fold the
        # power on the host, whose pow rounds otherwise than the compiled one: the
        # same step would update other bits traced than constant (74 rows of 11,081
        # in four unrolled batches). The barrier keeps every step on the compiled path.
        lr, t = jax.lax.optimization_barrier((lr, t))
        correction1 = 1.0 - jnp.power(jnp.float32(self.b1), t)
        correction2 = 1.0 - jnp.power(jnp.float32(self.b2), t)
        return lr * jnp.sqrt(correction2) / correction1


def sgd() -> RowOptimizer:
    """Plain SGD: ``p -= lr * g`` (optax.sgd's update, bit for bit). No state."""
    return RowOptimizer("sgd")


def adagrad(initial_accumulator_value: float = 0.1, eps: float = 1e-7) -> RowOptimizer:
    """optax.adagrad's math per value: ``acc += g**2``; ``p -= lr * g / sqrt(acc + eps)``
    (0 where ``acc`` is 0). One float32 accumulator per value."""
    return RowOptimizer("adagrad", initial_accumulator_value=initial_accumulator_value, eps=eps)


def row_adagrad(initial_accumulator_value: float = 0.0, eps: float = 1e-8) -> RowOptimizer:
    """Row-wise Adagrad (TorchRec's): one float32 accumulator per row,
    ``acc += mean(g**2 over the row)``; ``p -= lr * g / (sqrt(acc) + eps)``.
    4 bytes of state a row instead of 4 per value."""
    return RowOptimizer("row_adagrad", initial_accumulator_value=initial_accumulator_value, eps=eps)


def lazy_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, moment_dtype: object = jnp.float32
) -> RowOptimizer:
    """Lazy Adam (torch.optim.SparseAdam): only rows with a gradient move and only
    their moments decay; bias correction by the global ``step`` (1-based) given to
    :func:`~engram_jax.apply_gradients`. Moments in float32 or bfloat16."""
    return RowOptimizer(
        "lazy_adam",
        eps=eps,
        b1=b1,
        b2=b2,
        moment_dtype=as_row_dtype(moment_dtype, "moment_dtype").name,
    )
