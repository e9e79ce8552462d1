"""Slow, obvious references for engram_jax's kernels and layer, for tests and benchmarks.

numpy (the lookup, the row optimizers, the layout and the hashing) or plain jnp (the layer);
none shares code with what it checks.
"""

from engram_jax.testing.hashing import (
    hash_ngrams_reference,
    hash_sequence_reference,
    layout_reference,
)
from engram_jax.testing.layer import engram_layer_reference
from engram_jax.testing.lookup import (
    decode_records_reference,
    dequantize,
    lookup_records_reference,
    lookup_reference,
)
from engram_jax.testing.quantize import (
    e4m3_grid,
    quantization_bound,
    quantize_rows_reference,
)
from engram_jax.testing.row_optimizers import (
    GRAD_CHUNK,
    adagrad_reference,
    lazy_adam_reference,
    lazy_adam_step_size,
    row_adagrad_reference,
    sgd_reference,
    summed_gradients,
    trainable_lookup_reference,
)

__all__ = [
    "GRAD_CHUNK",
    "adagrad_reference",
    "decode_records_reference",
    "dequantize",
    "e4m3_grid",
    "engram_layer_reference",
    "hash_ngrams_reference",
    "hash_sequence_reference",
    "layout_reference",
    "lazy_adam_reference",
    "lazy_adam_step_size",
    "lookup_records_reference",
    "lookup_reference",
    "quantization_bound",
    "quantize_rows_reference",
    "row_adagrad_reference",
    "sgd_reference",
    "summed_gradients",
    "trainable_lookup_reference",
]
