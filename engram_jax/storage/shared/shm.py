"""Shared table files in /dev/shm: their names (owner, pid namespace and pid in
the name), the sweep of files a killed leader left behind, and the free-space check.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid

from engram_jax.storage.shared.processes import ProcessWatch, pid_namespace

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
FILE_PREFIX = "engram_jax-"


def shm_file_name(shm_dir: str = SHM_DIR) -> str:
    """A fresh name for a shared table file: ``engram_jax-<uid>-<pidns>-<pid>-<random>``."""
    return os.path.join(
        shm_dir,
        f"{FILE_PREFIX}{os.getuid()}-{pid_namespace() or 0}-{os.getpid()}-{uuid.uuid4().hex[:12]}",
    )


def sweep_stale_files(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove shared table files of this user whose creating process is gone.

    Only the window between creating a file and every rank mapping it can
    leave one behind (the leader killed in it); the next leader cleans up.
    """
    removed = []
    prefix = f"{FILE_PREFIX}{os.getuid()}-{pid_namespace() or 0}-"
    with contextlib.suppress(OSError):
        for entry in os.scandir(shm_dir):
            if not entry.name.startswith(prefix):
                continue
            try:
                pid = int(entry.name[len(prefix) :].split("-", 1)[0])
            except ValueError:
                continue
            if ProcessWatch.start_time(pid) is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.path)
    if removed:
        log.warning("removed %d stale shared table file(s): %s", len(removed), removed)
    return removed


def shm_problem(shm_dir: str, nbytes: int) -> str | None:
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
