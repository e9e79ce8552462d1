"""Raw memory for Engram tables: placements and node-local sharing.

Knows nothing of rows or tables; :mod:`engram_jax.table` builds on it.
"""

from engram_jax.storage._cuda import CudaUnavailableError
from engram_jax.storage.base import Allocation, MemoryKind
from engram_jax.storage.placements import PLACEMENTS, allocate, choose_auto
from engram_jax.storage.shared import (
    NodeGroup,
    ShareCheck,
    SharedAllocation,
    SharedTableError,
    SharedTableTimeout,
    allocate_shared,
    can_share_tables,
)

__all__ = [
    "Allocation",
    "CudaUnavailableError",
    "MemoryKind",
    "NodeGroup",
    "PLACEMENTS",
    "ShareCheck",
    "SharedAllocation",
    "SharedTableError",
    "SharedTableTimeout",
    "allocate",
    "allocate_shared",
    "can_share_tables",
    "choose_auto",
]
