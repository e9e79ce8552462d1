"""allocate_shared: one rank's side of setting up a shared table (hello, create,
map), by FABRIC handle, POSIX fds or a /dev/shm file, releasing whatever a
failed setup took.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import time
import uuid
from collections.abc import Callable

from engram_jax.storage import _cuda
from engram_jax.storage import numa as _numa
from engram_jax.storage.base import MemoryKind, buffer_address, host_view
from engram_jax.storage.shared.allocation import SharedAllocation
from engram_jax.storage.shared.fd_passing import receive_fds, serve_fds
from engram_jax.storage.shared.group import NodeGroup
from engram_jax.storage.shared.handshake import Handshake, fault_point
from engram_jax.storage.shared.probe import cumem_methods, resolve_backend
from engram_jax.storage.shared.processes import ProcessWatch, pid_namespace
from engram_jax.storage.shared.shm import (
    FILE_PREFIX,
    SHM_DIR,
    shm_file_name,
    shm_problem,
    sweep_stale_files,
)

log = logging.getLogger(__name__)

METHODS = ("auto", "fabric", "fd", "shm")


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
        self.watch: dict[int, ProcessWatch] = {}
        self.handshake = Handshake(group, self.namespace, timeout_s, watch=self.watch)
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
                if record.get("pidns") == pid_namespace() and rank != self.rank:
                    self.watch[rank] = ProcessWatch(record["pid"], record["start"])
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
            "start": ProcessWatch.start_time(os.getpid()),
            "uid": os.getuid(),
            "pidns": pid_namespace(),
            "nbytes": self.nbytes,
            "cumem": [],
        }
        if self.check is not None:
            self.check()
        if self.backend == "gpu":
            self.ordinal = _cuda.require_device(self.device_ordinal, "shared (GPU backend)")
            record["cumem"], _ = cumem_methods(self.ordinal)
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
        problem = shm_problem(self.shm_dir, self.nbytes)
        if problem:
            raise OSError(28, f"cannot create the shared table file: {problem}")  # ENOSPC
        sweep_stale_files(self.shm_dir)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(self.path, flags, 0o600)
        self.stack.callback(self._unlink)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask, owner only
            fault_point("created", self.rank)
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
            fault_point("mapped", self.rank)
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
            fault_point("received", self.rank)
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
                watch=self.watch,
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
        backend=resolve_backend(backend),
        method=method,
        device_ordinal=device_ordinal,
        timeout_s=group.timeout_s if timeout_s is None else timeout_s,
        shm_dir=shm_dir,
        chunk_bytes=chunk_bytes,
        reserve_bytes=reserve_bytes,
        check=check,
    )
    return setup.run()
