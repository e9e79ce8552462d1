"""One copy of a table per node: host memory shared by every process of a
node-local group (one process per GPU, JAX multi-controller).

Ways to share, best first: cuMem host-NUMA memory exported by FABRIC handle;
the same memory exported as POSIX file descriptors and handed to the peers
over a Unix socket (SCM_RIGHTS, :mod:`.fd_passing`); a /dev/shm file mapped
MAP_SHARED by every process (and registered with CUDA on GPUs, :mod:`.shm`).
The CPU backend uses /dev/shm. The handshake (:mod:`.handshake`) goes through
jax.distributed's key-value store (:mod:`.stores`): every step is published
by every rank, failures are gathered and raised on all ranks, waits are
bounded, and whatever a failed setup took is released (:mod:`.allocate`).
"""

from engram_jax.storage.shared.allocate import METHODS, allocate_shared
from engram_jax.storage.shared.allocation import DEFAULT_FENCE_TIMEOUT_S, SharedAllocation
from engram_jax.storage.shared.errors import SharedTableError, SharedTableTimeout
from engram_jax.storage.shared.fd_passing import receive_fds, serve_fds
from engram_jax.storage.shared.group import DEFAULT_TIMEOUT_S, NodeGroup
from engram_jax.storage.shared.probe import BACKENDS, ShareCheck, can_share_tables
from engram_jax.storage.shared.shm import FILE_PREFIX, SHM_DIR, shm_file_name, sweep_stale_files
from engram_jax.storage.shared.stores import (
    JaxKeyValueStore,
    KeyValueStore,
    LocalKeyValueStore,
    coordination_service,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_FENCE_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "FILE_PREFIX",
    "JaxKeyValueStore",
    "KeyValueStore",
    "LocalKeyValueStore",
    "METHODS",
    "NodeGroup",
    "SHM_DIR",
    "ShareCheck",
    "SharedAllocation",
    "SharedTableError",
    "SharedTableTimeout",
    "allocate_shared",
    "can_share_tables",
    "coordination_service",
    "receive_fds",
    "serve_fds",
    "shm_file_name",
    "sweep_stale_files",
]
