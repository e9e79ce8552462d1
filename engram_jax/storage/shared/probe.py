"""Whether tables can be shared here, and why not: the checks :func:`can_share_tables`
makes up front (group size, GPU and cuMem support, NUMA memory, /dev/shm).
"""

from __future__ import annotations

from dataclasses import dataclass

from engram_jax import _native
from engram_jax.storage import _cuda
from engram_jax.storage import numa as _numa
from engram_jax.storage.shared.group import NodeGroup
from engram_jax.storage.shared.shm import SHM_DIR, shm_problem

BACKENDS = ("auto", "cpu", "gpu")


@dataclass(frozen=True)
class ShareCheck:
    """Whether tables can be shared here: ``ok``, the ``method`` that would be tried
    first (``fabric``, ``fd`` or ``shm``), and ``reason`` in words. True when ok."""

    ok: bool
    method: str | None
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    return "gpu" if _native.built_with_cuda() and _cuda.device_count() > 0 else "cpu"


def cumem_methods(ordinal: int) -> tuple[list[str], str]:
    """cuMem sharing paths this GPU offers, best first, and a note on what is missing."""
    try:
        if not _cuda.device_attribute(ordinal, "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
            return [], "no cuMem host-NUMA support"
        # POSIX fds are Linux's own handle type: tried whenever host-NUMA memory exists.
        methods = ["fd"]
        if _cuda.device_attribute(ordinal, "HANDLE_TYPE_FABRIC_SUPPORTED"):
            methods.insert(0, "fabric")
    except (RuntimeError, AttributeError) as exc:
        return [], f"cuMem attributes could not be read ({exc})"
    return methods, ""


def can_share_tables(
    nbytes: int = 0,
    *,
    group: NodeGroup | int | None = None,
    backend: str = "auto",
    device_ordinal: int | None = None,
    shm_dir: str = SHM_DIR,
) -> ShareCheck:
    """Say up front whether :func:`allocate_shared` can work here, and why not.

    Checks the group size (two or more processes; pass the group or its
    size), a GPU for the GPU backend, cuMem handle support, the NUMA node's
    free memory for cuMem paths, and /dev/shm (present, writable, big enough)
    for the file path. FABRIC may still be refused at allocation time
    (``CUDA_ERROR_NOT_PERMITTED`` without an IMEX channel); ``auto`` then
    falls back on its own.
    """
    size = group.size if isinstance(group, NodeGroup) else group
    if size is not None and size < 2:
        return ShareCheck(False, None, f"the node-local group has {size} process; sharing needs 2+")
    backend = resolve_backend(backend)
    shm_reason = shm_problem(shm_dir, nbytes)
    if backend == "cpu":
        if shm_reason:
            return ShareCheck(
                False, None, f"CPU tables are shared through {shm_dir}, but {shm_reason}"
            )
        return ShareCheck(True, "shm", f"a {shm_dir} file mapped by every process")
    try:
        ordinal = _cuda.require_device(device_ordinal, "shared (GPU backend)")
    except _cuda.CudaUnavailableError as exc:
        return ShareCheck(False, None, str(exc))
    methods, missing = cumem_methods(ordinal)
    notes = []
    if methods:
        node = _numa.gpu_numa_node(ordinal)
        total, available = _numa.node_memory(node)
        reserve = _numa.default_reserve(total)
        if available - nbytes >= reserve:
            return ShareCheck(
                True,
                methods[0],
                f"cuMem host-NUMA memory on node {node} shared by {' or '.join(methods)} handle",
            )
        notes.append(
            f"NUMA node {node} has {available / 2**30:.2f} GiB available, under the table's "
            f"{nbytes / 2**30:.2f} GiB plus the {reserve / 2**30:.2f} GiB reserve"
        )
    else:
        notes.append(missing)
    if shm_reason:
        notes.append(shm_reason)
        return ShareCheck(False, None, "; ".join(notes))
    return ShareCheck(
        True, "shm", f"a {shm_dir} file registered with CUDA by every process ({'; '.join(notes)})"
    )
