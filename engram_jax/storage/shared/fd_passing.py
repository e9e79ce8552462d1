"""Handing memory file descriptors to the peers of a node group over a Unix
socket (SCM_RIGHTS), only to connections the kernel says come from a peer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence

from engram_jax.storage.shared.processes import POLL_S, ProcessWatch

log = logging.getLogger(__name__)

# Fds per SCM_RIGHTS message, well under the kernel's limit of 253.
_FDS_PER_MESSAGE = 64


def _peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def serve_fds(
    sock: socket.socket,
    fds: Sequence[int],
    peers: Sequence[tuple[int, int]],
    deadline: float,
    watch: dict[int, ProcessWatch] | None = None,
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
        sock.settimeout(min(remaining, POLL_S))
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
