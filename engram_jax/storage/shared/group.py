"""NodeGroup: the processes of one node that share tables, found through the
key-value store (from jax.distributed, a coordination service of their own,
or this process alone).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence

from engram_jax import _jax_private
from engram_jax.storage.shared.errors import SharedTableTimeout
from engram_jax.storage.shared.shm import SHM_DIR
from engram_jax.storage.shared.stores import (
    JaxKeyValueStore,
    KeyValueStore,
    LocalKeyValueStore,
    coordination_service,
)

DEFAULT_TIMEOUT_S = 300.0


def node_identity(shm_dir: str = SHM_DIR) -> str:
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
        distributed = _jax_private.distributed_client()
        if distributed is None:
            raise RuntimeError(
                "NodeGroup.from_jax needs jax.distributed.initialize() to have run in this process"
            )
        client, process_id, num_processes = distributed
        _jax_group = form_group(
            JaxKeyValueStore(client),
            process_id,
            num_processes,
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
        client = _jax_private.distributed_runtime().get_distributed_runtime_client(
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
            group = form_group(
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


def form_group(
    store: KeyValueStore, process_id: int, num_processes: int, *, root: str, timeout_s: float
) -> NodeGroup:
    identity = node_identity()
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
