"""engram_jax: Engram memory tables larger than GPU memory, for jitted JAX models.

Tables live in host memory (or HBM, or plain CPU memory); ``lookup`` gathers
the fp8 rows a step needs over PCIe and returns them as bf16, inside jit.
"""

from engram_jax.lookup import lookup
from engram_jax.reference import DEAD_ID
from engram_jax.storage import PLACEMENTS, CudaUnavailableError
from engram_jax.table import EngramTable

__all__ = [
    "DEAD_ID",
    "PLACEMENTS",
    "CudaUnavailableError",
    "EngramTable",
    "lookup",
]
