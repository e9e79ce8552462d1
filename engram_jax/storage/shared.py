"""One copy of a table per node: host memory shared by every process of a
node-local group (one process per GPU, JAX multi-controller).

Ways to share, best first: cuMem host-NUMA memory exported by FABRIC handle;
the same memory exported as POSIX file descriptors and handed to the peers
over a Unix socket (SCM_RIGHTS); a /dev/shm file mapped MAP_SHARED by every
process (and registered with CUDA on GPUs). The CPU backend uses /dev/shm.
The handshake goes through jax.distributed's key-value store: every step is
published by every rank, failures are gathered and raised on all ranks, waits
are bounded, and whatever a failed setup took is released.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import mmap
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engram_jax.storage import _cuda
from engram_jax.storage import numa as _numa
from engram_jax.storage.base import Allocation, MemoryKind, buffer_address, host_view

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
FILE_PREFIX = "engram_jax-"
DEFAULT_TIMEOUT_S = 300.0
# The fence waits for the writer to load the table, which can take minutes.
DEFAULT_FENCE_TIMEOUT_S = 3600.0
METHODS = ("auto", "fabric", "fd", "shm")
BACKENDS = ("auto", "cpu", "gpu")
# Fds per SCM_RIGHTS message, well under the kernel's limit of 253.
_FDS_PER_MESSAGE = 64
# How often a wait looks whether the process it waits for is still alive.
_POLL_S = 0.5
# Once one rank has failed, how long to wait for the others' reports.
_GRACE_S = 2.0

# Tests only: called as hook(point, rank) at each step of the handshake.
_fault_hook: Callable[[str, int], None] | None = None


def _at(point: str, rank: int) -> None:
    if _fault_hook is not None:
        _fault_hook(point, rank)


class SharedTableError(RuntimeError):
    """Setting up or fencing a shared table failed on one or more ranks.

    Raised on every rank with the same per-rank messages; ``failures`` maps
    each failing rank to its message.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = dict(failures)


class SharedTableTimeout(SharedTableError, TimeoutError):
    """Some rank neither reported nor was seen to die within the wait's bound."""


# -- key-value stores ----------------------------------------------------------


class KeyValueStore(Protocol):
    """What the handshake needs: set a key once, read it with a bounded wait."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str, timeout_s: float) -> str:
        """The value of ``key``; :class:`TimeoutError` if nobody sets it within ``timeout_s``."""
        ...


class JaxKeyValueStore:
    """The key-value store of jax.distributed's coordination service.

    Wraps the client ``jax.distributed.initialize`` creates (or one that
    :meth:`NodeGroup.connect` starts). jax has no public accessor for it yet,
    so it is taken from ``jax._src.distributed.global_state.client``.
    """

    def __init__(self, client: Any) -> None:
        self._client = client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

    def get(self, key: str, timeout_s: float) -> str:
        timeout_ms = max(1, int(timeout_s * 1000))
        try:
            return self._client.blocking_key_value_get(key, timeout_ms)
        except Exception as exc:
            text = str(exc)
            if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower():
                raise TimeoutError(f"key {key!r} was not set within {timeout_s:.1f} s") from exc
            raise


class LocalKeyValueStore:
    """An in-process store: a group of one process, or ranks played by threads."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._changed:
            if key in self._values:
                raise KeyError(f"key {key!r} is already set")
            self._values[key] = value
            self._changed.notify_all()

    def get(self, key: str, timeout_s: float) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, timeout=max(0.0, timeout_s)):
                raise TimeoutError(f"key {key!r} was not set within {timeout_s:.1f} s")
            return self._values[key]


# -- node-local groups ---------------------------------------------------------


def _node_identity(shm_dir: str = SHM_DIR) -> str:
    """Equal exactly for processes that can share memory: same kernel, same network
    namespace (abstract Unix sockets live there) and the same /dev/shm."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    for path in ("/proc/self/ns/net", "/proc/self/ns/ipc", shm_dir):
        with contextlib.suppress(OSError):
            st = os.stat(path)
            parts.append(f"{st.st_dev}:{st.st_ino}")
    return "|".join(parts)


class NodeGroup:
    """The processes of one node that share tables, and the store they talk through.

    ``rank`` is this process's place in the group (rank 0 leads and writes),
    ``size`` the number of processes, ``process_ids`` their global process
    ids. Every process of the group must create its shared tables in the
    same order: each gets the next name from :meth:`next_namespace`.
    """

    def __init__(
        self,
        store: KeyValueStore,
        rank: int,
        size: int,
        *,
        scope: str = "engram_jax/group",
        process_ids: Sequence[int] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        closers: Sequence[Callable[[], None]] = (),
    ) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, size), got rank {rank} of {size}")
        self.store = store
        self.rank = int(rank)
        self.size = int(size)
        self.scope = scope
        self.process_ids = tuple(process_ids) if process_ids is not None else tuple(range(size))
        self.timeout_s = float(timeout_s)
        self._seq = itertools.count()
        self._closers = list(closers)

    def __repr__(self) -> str:
        return f"NodeGroup(rank={self.rank}, size={self.size}, scope={self.scope!r})"

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def next_namespace(self, name: str) -> str:
        """A store prefix for the next shared table, equal on every rank that asks in turn."""
        if "/" in name:
            raise ValueError(f"name must not contain '/', got {name!r}")
        return f"{self.scope}/{name}/{next(self._seq)}"

    @classmethod
    def single(cls) -> NodeGroup:
        """A group of this process alone (sharing degenerates to a private mapping)."""
        return cls(LocalKeyValueStore(), 0, 1, scope=f"engram_jax/single/{uuid.uuid4().hex}")

    @classmethod
    def from_jax(cls, *, timeout_s: float | None = None) -> NodeGroup:
        """The node-local group of a jax multi-controller job (after jax.distributed.initialize).

        Processes publish which node they are on and group with those on the
        same one; the first call per process forms the group, later calls
        return it. ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`) bounds
        the group's waits and is fixed by the first call: a later call may
        omit it or repeat it, and raises :class:`ValueError` for another value.
        """
        global _jax_group
        if _jax_group is not None:
            if timeout_s is not None and float(timeout_s) != _jax_group.timeout_s:
                raise ValueError(
                    f"NodeGroup.from_jax(timeout_s={timeout_s}): this process's group was "
                    f"formed with timeout_s={_jax_group.timeout_s:g}, which stays; omit "
                    "timeout_s, or pass timeout_s= to allocate_shared or writing() for one table"
                )
            return _jax_group
        if timeout_s is None:
            timeout_s = DEFAULT_TIMEOUT_S
        from jax._src import distributed

        state = distributed.global_state
        if state.client is None:
            raise RuntimeError(
                "NodeGroup.from_jax needs jax.distributed.initialize() to have run in this process"
            )
        _jax_group = _form_group(
            JaxKeyValueStore(state.client),
            int(state.process_id),
            int(state.num_processes),
            root="engram_jax",
            timeout_s=timeout_s,
        )
        return _jax_group

    @classmethod
    def connect(
        cls,
        coordinator_address: str,
        num_processes: int,
        process_id: int,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        start_service: bool | None = None,
    ) -> NodeGroup:
        """Join (and, on process 0, start) a jax coordination service just for sharing tables.

        For several processes on one node that do not run jax multi-controller
        (a serving engine's workers, tests with two processes on one GPU). It
        is the same service and store ``jax.distributed`` uses, without
        touching jax's backends. ``start_service=False`` joins a service run
        elsewhere (:func:`coordination_service`). :meth:`close` shuts it down.
        """
        service = None
        if (process_id == 0) if start_service is None else start_service:
            service = coordination_service(coordinator_address, num_processes)
        client = _jax_runtime().get_distributed_runtime_client(
            coordinator_address,
            process_id,
            init_timeout=int(timeout_s),
            shutdown_timeout=10,
            use_compression=True,
        )
        try:
            client.connect()
        except BaseException:
            if service is not None:
                service.shutdown()
            raise
        closers = [client.shutdown] + ([service.shutdown] if service is not None else [])
        try:
            group = _form_group(
                JaxKeyValueStore(client),
                process_id,
                num_processes,
                root="engram_jax",
                timeout_s=timeout_s,
            )
        except BaseException:
            for close in closers:
                with contextlib.suppress(Exception):
                    close()
            raise
        group._closers = closers
        return group

    def close(self) -> None:
        """Shut down a coordination service :meth:`connect` started (else nothing)."""
        closers, self._closers = self._closers, []
        for close in closers:
            close()


_jax_group: NodeGroup | None = None


def coordination_service(address: str, num_processes: int) -> Any:
    """Start jax's coordination service (the key-value store behind jax.distributed).

    Returns the service; call ``.shutdown()`` on it when done.
    """
    return _jax_runtime().get_distributed_runtime_service(
        address, num_processes, shutdown_timeout=10
    )


def _jax_runtime():
    """jaxlib's extension module with the coordination service (its name moved over releases)."""
    try:
        from jax._src.lib import _jax
    except ImportError:  # older jaxlib
        from jax._src.lib import xla_extension as _jax
    return _jax


def _form_group(
    store: KeyValueStore, process_id: int, num_processes: int, *, root: str, timeout_s: float
) -> NodeGroup:
    identity = _node_identity()
    store.set(f"{root}/node/{process_id}", identity)
    members = []
    deadline = time.monotonic() + timeout_s
    for pid in range(num_processes):
        try:
            other = store.get(f"{root}/node/{pid}", max(0.001, deadline - time.monotonic()))
        except TimeoutError as exc:
            raise SharedTableTimeout(
                f"process {pid} did not say which node it is on within {timeout_s:.0f} s",
                {pid: "no report"},
            ) from exc
        if other == identity:
            members.append(pid)
    return NodeGroup(
        store,
        members.index(process_id),
        len(members),
        scope=f"{root}/group{members[0]}",
        process_ids=members,
        timeout_s=timeout_s,
    )


# -- can it work? ------------------------------------------------------------


@dataclass(frozen=True)
class ShareCheck:
    """Whether tables can be shared here: ``ok``, the ``method`` that would be tried
    first (``fabric``, ``fd`` or ``shm``), and ``reason`` in words. True when ok."""

    ok: bool
    method: str | None
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    from engram_jax import _native

    return "gpu" if _native.built_with_cuda() and _cuda.device_count() > 0 else "cpu"


def _shm_problem(shm_dir: str, nbytes: int) -> str | None:
    if not os.path.isdir(shm_dir):
        return f"{shm_dir} does not exist"
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        return f"{shm_dir} is not writable by this user"
    st = os.statvfs(shm_dir)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        return (
            f"{shm_dir} has {free / 2**30:.2f} GiB free and the table needs "
            f"{nbytes / 2**30:.2f} GiB (a container may need a larger --shm-size)"
        )
    return None


def _cumem_methods(ordinal: int) -> tuple[list[str], str]:
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
    backend = _resolve_backend(backend)
    shm_problem = _shm_problem(shm_dir, nbytes)
    if backend == "cpu":
        if shm_problem:
            return ShareCheck(
                False, None, f"CPU tables are shared through {shm_dir}, but {shm_problem}"
            )
        return ShareCheck(True, "shm", f"a {shm_dir} file mapped by every process")
    try:
        ordinal = _cuda.require_device(device_ordinal, "shared (GPU backend)")
    except _cuda.CudaUnavailableError as exc:
        return ShareCheck(False, None, str(exc))
    methods, missing = _cumem_methods(ordinal)
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
    if shm_problem:
        notes.append(shm_problem)
        return ShareCheck(False, None, "; ".join(notes))
    return ShareCheck(
        True, "shm", f"a {shm_dir} file registered with CUDA by every process ({'; '.join(notes)})"
    )


# -- the shared allocation -----------------------------------------------------


class SharedAllocation(Allocation):
    """Memory every rank of a :class:`NodeGroup` maps; rank 0 is the one writer.

    Fill it inside :meth:`writing` (the writer loads, everybody waits at the
    fence, a writer's failure is raised on every rank) before any lookup.
    Readers' ``host_array`` is read-only and :meth:`write` refuses them.
    """

    def __init__(self, *, group: NodeGroup, namespace: str, method: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.group = group
        self.namespace = namespace
        self.method = method
        self._fences = itertools.count()
        self._watch: dict[int, _ProcessWatch] = {}
        self.fenced = False

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def is_writer(self) -> bool:
        return self.group.rank == 0

    def write(self, offset: int, data: np.ndarray) -> None:
        if not self.is_writer:
            raise PermissionError(
                f"rank {self.rank} of a shared table may not write: rank 0 is the one writer"
            )
        super().write(offset, data)

    @contextlib.contextmanager
    def writing(self, timeout_s: float | None = None) -> Iterator[bool]:
        """``with alloc.writing() as is_writer: if is_writer: fill(...)`` then a fence.

        Every rank enters; the body runs everywhere and yields whether this
        rank writes. On exit all ranks wait until the writer is done; an
        exception on any rank is raised as :class:`SharedTableError` on all.
        A ``KeyboardInterrupt`` (or other non-``Exception``) is published to
        the others, which raise at once, and re-raised here without waiting.
        """
        try:
            yield self.is_writer
        except Exception as exc:
            self.fence(error=exc, timeout_s=timeout_s)
            raise  # fence raised already; kept for type checkers
        except BaseException as exc:
            self._abandon(exc)
            raise
        self.fence(timeout_s=timeout_s)

    def _abandon(self, error: BaseException) -> None:
        """Publish ``error`` at the next fence without waiting for the others."""
        if self.closed:
            return
        step = next(self._fences)
        try:
            _Handshake(self.group, self.namespace, 0.0).publish(f"fence{step}", _describe(error))
        except Exception:  # the interrupt matters more than telling the peers
            log.warning("could not tell the other ranks of %s", type(error).__name__, exc_info=True)

    def fence(self, error: BaseException | None = None, timeout_s: float | None = None) -> None:
        """Publish this rank's state (``error`` or done) and wait for every rank's."""
        if self.closed:
            raise ValueError("the shared allocation is closed")
        step = next(self._fences)
        handshake = _Handshake(
            self.group,
            self.namespace,
            DEFAULT_FENCE_TIMEOUT_S if timeout_s is None else timeout_s,
            watch=self._watch,
        )
        _at(f"fence{step}", self.rank)
        handshake.publish(f"fence{step}", None if error is None else _describe(error))
        handshake.gather(f"fence{step}", cause=error)
        self.fenced = True


# -- the handshake -------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _ProcessWatch:
    """Whether a process on this node is still alive (pid plus its start time)."""

    def __init__(self, pid: int, start: str | None) -> None:
        self.pid = pid
        self.start = start

    @staticmethod
    def start_time(pid: int) -> str | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        # fields[0] is the state, fields[19] the start time in clock ticks.
        return None if fields[0] in ("Z", "X") else fields[19]

    def alive(self) -> bool:
        return self.start_time(self.pid) == self.start


class _Handshake:
    """Per-rank records under ``namespace/phase/rank`` in the group's store."""

    def __init__(
        self,
        group: NodeGroup,
        namespace: str,
        timeout_s: float,
        watch: dict[int, _ProcessWatch] | None = None,
    ) -> None:
        self.group = group
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.watch = watch if watch is not None else {}

    def _key(self, phase: str, rank: int) -> str:
        return f"{self.namespace}/{phase}/{rank}"

    def publish(self, phase: str, error: str | None, data: dict | None = None) -> None:
        record = {"ok": error is None, "error": error, "data": data or {}}
        self.group.store.set(self._key(phase, self.group.rank), json.dumps(record))

    def gather(self, phase: str, cause: BaseException | None = None) -> list[dict]:
        """Every rank's data for ``phase``; raises on all ranks if any failed or is missing."""
        deadline = time.monotonic() + self.timeout_s
        records: list[dict | None] = [None] * self.group.size
        failures: dict[int, str] = {}
        store_error: Exception | None = None

        def failed(rank: int, message: str) -> float:
            failures[rank] = message
            # The outcome is decided: give the others a short grace to report, no more.
            return min(deadline, time.monotonic() + _GRACE_S)

        for rank in range(self.group.size):
            while True:
                remaining = deadline - time.monotonic()
                wait = max(0.001, min(remaining, _POLL_S))
                try:
                    raw = self.group.store.get(self._key(phase, rank), wait)
                except Exception as exc:
                    if not isinstance(exc, TimeoutError):
                        # The store itself failed (its host process died?): wait, look again.
                        store_error = exc
                        time.sleep(wait)
                    watch = self.watch.get(rank)
                    if watch is not None and not watch.alive():
                        deadline = failed(rank, f"process {watch.pid} died")
                        break
                    if remaining <= _POLL_S:
                        if store_error is not None:
                            message = f"no report; the key-value store failed: {store_error}"
                        elif failures:
                            message = "no report (stopped waiting once another rank failed)"
                        else:
                            message = f"no report within {self.timeout_s:.1f} s"
                        deadline = failed(rank, message)
                        break
                    continue
                record = json.loads(raw)
                if not record["ok"]:
                    deadline = failed(rank, record["error"])
                records[rank] = record["data"]
                break
        if failures:
            pids = self.group.process_ids
            lines = "\n".join(
                f"  rank {r} (process {pids[r] if r < len(pids) else '?'}): {m}"
                for r, m in sorted(failures.items())
            )
            where = self.namespace.rsplit("/", 2)[-2] if "/" in self.namespace else self.namespace
            message = (
                f"shared table {where!r}, step {phase!r}, failed on rank(s) "
                f"{sorted(failures)}:\n{lines}"
            )
            timed_out = all(m.startswith("no report within") for m in failures.values())
            error = (SharedTableTimeout if timed_out else SharedTableError)(message, failures)
            raise error from cause
        return records  # type: ignore[return-value]

    def step(self, phase: str, work: Callable[[], dict | None]) -> list[dict]:
        """Run ``work`` here, publish its outcome, gather everybody's."""
        try:
            _at(phase, self.group.rank)
            data = work()
        except Exception as exc:
            self.publish(phase, _describe(exc))
            self.gather(phase, cause=exc)
            raise  # gather raised; kept for type checkers
        except BaseException as exc:
            # An interrupt: tell the others so they stop now rather than at
            # their timeout, and leave at once without waiting for them.
            with contextlib.suppress(Exception):
                self.publish(phase, _describe(exc))
            raise
        self.publish(phase, None, data)
        return self.gather(phase)


# -- setup -----------------------------------------------------------------------


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def shm_file_name(shm_dir: str = SHM_DIR) -> str:
    """A fresh name for a shared table file: ``engram_jax-<uid>-<pidns>-<pid>-<random>``."""
    return os.path.join(
        shm_dir,
        f"{FILE_PREFIX}{os.getuid()}-{_pid_namespace() or 0}-{os.getpid()}-{uuid.uuid4().hex[:12]}",
    )


def sweep_stale_files(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove shared table files of this user whose creating process is gone.

    Only the window between creating a file and every rank mapping it can
    leave one behind (the leader killed in it); the next leader cleans up.
    """
    removed = []
    prefix = f"{FILE_PREFIX}{os.getuid()}-{_pid_namespace() or 0}-"
    with contextlib.suppress(OSError):
        for entry in os.scandir(shm_dir):
            if not entry.name.startswith(prefix):
                continue
            try:
                pid = int(entry.name[len(prefix) :].split("-", 1)[0])
            except ValueError:
                continue
            if _ProcessWatch.start_time(pid) is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.path)
    if removed:
        log.warning("removed %d stale shared table file(s): %s", len(removed), removed)
    return removed


def _peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def serve_fds(
    sock: socket.socket,
    fds: Sequence[int],
    peers: Sequence[tuple[int, int]],
    deadline: float,
    watch: dict[int, _ProcessWatch] | None = None,
) -> None:
    """Hand ``fds`` to each peer (``(pid, rank)`` pairs) that connects to ``sock``.

    A connection is served only if the kernel says it comes from a pending
    peer's pid under this uid (SO_PEERCRED), so nobody else gets the memory.
    """
    pending = list(peers)
    watch = watch or {}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            ranks = sorted(rank for _, rank in pending)
            raise TimeoutError(f"rank(s) {ranks} never came for the memory handles")
        sock.settimeout(min(remaining, _POLL_S))
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            dead = [r for _, r in pending if r in watch and not watch[r].alive()]
            if dead:
                raise ConnectionError(
                    f"rank(s) {dead} died before taking the memory handles"
                ) from None
            continue
        with conn:
            pid, uid, _ = _peer_credentials(conn)
            match = next((p for p in pending if p[0] == pid), None)
            if uid != os.getuid() or match is None:
                log.warning(
                    "refused memory handles to pid %d uid %d: not a peer of this group", pid, uid
                )
                continue
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            for start in range(0, len(fds), _FDS_PER_MESSAGE):
                batch = list(fds[start : start + _FDS_PER_MESSAGE])
                socket.send_fds(conn, [struct.pack("<II", start, len(batch))], batch)
            # Wait for the peer's one-byte receipt so no fd is in flight when we go on.
            if conn.recv(1) != b"\x01":
                raise ConnectionError(f"rank {match[1]} did not confirm it got the handles")
            pending.remove(match)


def receive_fds(name: str, count: int, deadline: float) -> list[int]:
    """Connect to the leader's socket ``name`` and take ``count`` fds."""
    fds: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        sock.connect(name)
        try:
            while len(fds) < count:
                header, got, flags, _ = socket.recv_fds(sock, 8, _FDS_PER_MESSAGE)
                fds.extend(got)
                if flags & socket.MSG_CTRUNC:
                    raise ConnectionError("memory handles were cut off in transit (MSG_CTRUNC)")
                if len(header) < 8:
                    raise ConnectionError(
                        f"the leader closed the connection after {len(fds)} of {count} handles"
                    )
            sock.sendall(b"\x01")
        except BaseException:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
    return fds


class _Setup:
    """One rank's side of :func:`allocate_shared`; whatever it takes goes on ``stack``."""

    def __init__(
        self,
        group: NodeGroup,
        nbytes: int,
        *,
        name: str,
        backend: str,
        method: str,
        device_ordinal: int | None,
        timeout_s: float,
        shm_dir: str,
        chunk_bytes: int | None,
        reserve_bytes: int | None,
        check: Callable[[], object] | None,
    ) -> None:
        self.group = group
        self.check = check
        self.rank = group.rank
        self.nbytes = int(nbytes)
        self.backend = backend
        self.requested = method
        self.device_ordinal = device_ordinal
        self.shm_dir = shm_dir
        self.chunk_bytes = chunk_bytes
        self.reserve_bytes = reserve_bytes
        self.namespace = group.next_namespace(name)
        self.watch: dict[int, _ProcessWatch] = {}
        self.handshake = _Handshake(group, self.namespace, timeout_s, watch=self.watch)
        self.stack = contextlib.ExitStack()
        self.ordinal: int | None = None
        self.path: str | None = None
        self.address = 0
        self.method = ""
        self.info: dict = {}
        # The fd method's leader side: exported fds and the socket it hands them out on.
        self._exported: list[int] = []
        self._socket: socket.socket | None = None
        self._devices: tuple[int, ...] = ()  # CUDA ordinals the cuMem memory is mapped for

    # -- driver ---------------------------------------------------------------

    def run(self) -> SharedAllocation:
        try:
            hello = self.handshake.step("hello", self._hello)
            for rank, record in enumerate(hello):
                if record.get("pidns") == _pid_namespace() and rank != self.rank:
                    self.watch[rank] = _ProcessWatch(record["pid"], record["start"])
            self.path = hello[0]["path"]
            # The ordinal is known to be valid on every rank once hello succeeded.
            context = (
                _cuda.in_context(self.ordinal)
                if self.backend == "gpu"
                else contextlib.nullcontext()
            )
            with context:
                created = self.handshake.step("create", lambda: self._create(hello))
                self.method = created[0]["method"]
                self.handshake.step("map", lambda: self._attach(hello, created[0]))
            # Every rank has mapped it: the name can go, the memory stays until the last unmap.
            self._unlink()
            return self._allocation()
        except BaseException:
            try:
                self.stack.close()
            finally:
                self._unlink()
            raise

    def _unlink(self) -> None:
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    # -- steps --------------------------------------------------------------

    def _hello(self) -> dict:
        record: dict = {
            "pid": os.getpid(),
            "start": _ProcessWatch.start_time(os.getpid()),
            "uid": os.getuid(),
            "pidns": _pid_namespace(),
            "nbytes": self.nbytes,
            "cumem": [],
        }
        if self.check is not None:
            self.check()
        if self.backend == "gpu":
            self.ordinal = _cuda.require_device(self.device_ordinal, "shared (GPU backend)")
            record["cumem"], _ = _cumem_methods(self.ordinal)
        if self.rank == 0:
            record["path"] = shm_file_name(self.shm_dir)
        return record

    def _candidates(self, hello: list[dict]) -> list[str]:
        if self.backend == "cpu":
            if self.requested not in ("auto", "shm"):
                raise ValueError(
                    f"the CPU backend shares through /dev/shm only, not {self.requested!r}"
                )
            return ["shm"]
        common = set(hello[0]["cumem"])
        for record in hello[1:]:
            common &= set(record["cumem"])
        same_ns = len({(r["pidns"], r["uid"]) for r in hello}) == 1
        if not same_ns:
            common.discard("fd")
        order = [m for m in ("fabric", "fd") if m in common] + ["shm"]
        if self.requested == "auto":
            return order
        if self.requested not in order:
            raise RuntimeError(
                f"sharing method {self.requested!r} is not available on every rank here "
                f"(available on all: {order})"
            )
        return [self.requested]

    def _create(self, hello: list[dict]) -> dict:
        if self.rank != 0:
            return {}
        sizes = {r: record["nbytes"] for r, record in enumerate(hello)}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"the ranks ask for different sizes (rank: bytes): {sizes}")
        errors = []
        for method in self._candidates(hello):
            try:
                if method == "shm":
                    return self._create_shm()
                return self._create_cumem(method, hello)
            except _cuda.CudaCallError as exc:
                # auto tries the next way; MemoryError (the node is full) is no CUDA error.
                if self.requested != "auto":
                    raise
                errors.append(f"{method}: {exc}")
                log.info(
                    "sharing by %s is not available here (%s); trying the next way", method, exc
                )
        raise RuntimeError("no way to share memory worked: " + "; ".join(errors))

    def _create_shm(self) -> dict:
        problem = _shm_problem(self.shm_dir, self.nbytes)
        if problem:
            raise OSError(28, f"cannot create the shared table file: {problem}")  # ENOSPC
        sweep_stale_files(self.shm_dir)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(self.path, flags, 0o600)
        self.stack.callback(self._unlink)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask, owner only
            _at("created", self.rank)
            # Reserve every page now: a full /dev/shm fails here, not as SIGBUS later.
            os.posix_fallocate(fd, 0, self.nbytes)
            self._map_file(fd, populate=False)
        finally:
            os.close(fd)
        return {"method": "shm", "path": self.path}

    def _map_file(self, fd: int, *, populate: bool) -> None:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        mm = mmap.mmap(fd, self.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.stack.callback(mm.close)
        self.address = buffer_address(mm)

    def _create_cumem(self, method: str, hello: list[dict]) -> dict:
        kind = _numa.HANDLE_FABRIC if method == "fabric" else _numa.HANDLE_FD
        # Held locally until the method fully works, so a fallback keeps nothing of it.
        with contextlib.ExitStack() as local:
            memory = _numa.HostNumaMemory.create(
                self.nbytes,
                ordinal=self.ordinal,
                handle=kind,
                chunk_bytes=self.chunk_bytes,
                reserve_bytes=self.reserve_bytes,
            )
            local.callback(memory.close)
            record = {"method": method, "sizes": memory.sizes, "node": memory.node}
            if method == "fabric":
                record["handles"] = [blob.hex() for blob in memory.export_fabric()]
            else:
                self._exported = memory.export_fds()
                local.callback(self._close_exported)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                local.callback(sock.close)
                # Abstract namespace: no file to clean up; SO_PEERCRED guards who gets the fds.
                name = f"\0{FILE_PREFIX}{os.getuid()}-{uuid.uuid4().hex}"
                sock.bind(name)
                sock.listen(max(1, self.group.size))
                self._socket = sock
                record["socket"] = name[1:]
            self.stack.enter_context(local.pop_all())
        self._adopt(memory)
        return record

    def _close_exported(self) -> None:
        for fd in self._exported:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._exported = []

    def _adopt(self, memory: _numa.HostNumaMemory) -> None:
        self.address = memory.address
        self.info.update(numa_node=memory.node, chunks=len(memory.sizes))
        self._devices = memory.devices

    def _attach(self, hello: list[dict], created: dict) -> dict:
        method = created["method"]
        deadline = time.monotonic() + self.handshake.timeout_s
        if method == "shm":
            if self.rank != 0:
                flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
                fd = os.open(created["path"], flags)
                try:
                    st = os.fstat(fd)
                    if st.st_uid != os.getuid() or st.st_size < self.nbytes:
                        raise PermissionError(
                            f"{created['path']} is not this group's table file "
                            f"(owner {st.st_uid}, {st.st_size} bytes)"
                        )
                    self._map_file(fd, populate=True)
                finally:
                    os.close(fd)
            _at("mapped", self.rank)
            if self.backend == "gpu":
                _cuda.host_register(self.address, self.nbytes)
                self.stack.callback(_cuda.host_unregister, self.address)
            return {}
        if self.rank == 0:
            if method == "fd":
                peers = [(hello[r]["pid"], r) for r in range(1, self.group.size)]
                serve_fds(self._socket, self._exported, peers, deadline, self.watch)
                self._close_exported()
                self._socket.close()
            return {}
        node = int(created["node"])
        if method == "fd":
            fds = receive_fds("\0" + created["socket"], len(created["sizes"]), deadline)
            _at("received", self.rank)
            memory = _numa.HostNumaMemory.import_fds(
                fds, created["sizes"], ordinal=self.ordinal, node=node
            )
        else:
            memory = _numa.HostNumaMemory.import_fabric(
                [bytes.fromhex(h) for h in created["handles"]],
                created["sizes"],
                ordinal=self.ordinal,
                node=node,
            )
        self.stack.callback(memory.close)
        self._adopt(memory)
        return {}

    def _allocation(self) -> SharedAllocation:
        gpu = self.backend == "gpu"
        view = host_view(self.address, self.nbytes)
        if self.rank != 0:
            view.flags.writeable = False
        if self.method == "shm":
            placement = "shared_shm"
            device_ordinal = None
        else:
            placement = "shared_numa"
            devices = self._devices
            device_ordinal = None if len(devices) == _cuda.device_count() else self.ordinal
        release = self.stack.pop_all()
        self.info.update(method=self.method, rank=self.rank, group_size=self.group.size)
        try:
            allocation = SharedAllocation(
                group=self.group,
                namespace=self.namespace,
                method=self.method,
                placement=placement,
                address=self.address,
                nbytes=self.nbytes,
                kind=MemoryKind.HOST_MAPPED if gpu else MemoryKind.HOST,
                release=release.close,
                host_array=view,
                device_ordinal=device_ordinal,
                info=self.info,
            )
        except BaseException:
            # The cleanup left self.stack above: run() can no longer free it.
            release.close()
            raise
        allocation._watch = self.watch
        if self.rank == 0:
            log.info(
                "shared table: %.2f GiB by %s among %d process(es)",
                self.nbytes / 2**30,
                self.method,
                self.group.size,
            )
        return allocation


def allocate_shared(
    nbytes: int,
    group: NodeGroup,
    *,
    name: str = "table",
    backend: str = "auto",
    method: str = "auto",
    device_ordinal: int | None = None,
    timeout_s: float | None = None,
    shm_dir: str = SHM_DIR,
    chunk_bytes: int | None = None,
    reserve_bytes: int | None = None,
    check: Callable[[], object] | None = None,
) -> SharedAllocation:
    """``nbytes`` of host memory mapped by every rank of ``group``; collective.

    Every rank calls it with the same arguments, in the same order as its
    other shared tables. ``method``: ``auto`` (GPU: FABRIC, else POSIX fd,
    else /dev/shm; CPU: /dev/shm), or one of ``fabric``, ``fd``, ``shm``.
    ``backend``: ``cpu`` (plain mapping for the CPU backend), ``gpu`` (page-
    locked and mapped for the GPUs), ``auto`` (gpu where CUDA sees a GPU).
    Waits are bounded by ``timeout_s`` (default: the group's); a failure on
    any rank raises :class:`SharedTableError` on every rank, naming the ranks,
    and everything already taken is released. The /dev/shm file is unlinked
    as soon as every rank has mapped it. Then fill it with
    :meth:`SharedAllocation.writing`. ``check``, if given, runs first on every
    rank inside the handshake, so a local precondition failing (a missing
    checkpoint file) is raised on all ranks before anything is allocated.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if nbytes <= 0:
        raise ValueError(f"nbytes must be > 0, got {nbytes}")
    if not isinstance(group, NodeGroup):
        raise TypeError(f"group must be a NodeGroup, got {type(group).__name__}")
    setup = _Setup(
        group,
        nbytes,
        name=name,
        backend=_resolve_backend(backend),
        method=method,
        device_ordinal=device_ordinal,
        timeout_s=group.timeout_s if timeout_s is None else timeout_s,
        shm_dir=shm_dir,
        chunk_bytes=chunk_bytes,
        reserve_bytes=reserve_bytes,
        check=check,
    )
    return setup.run()
