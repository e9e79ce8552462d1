"""Which processes of this node are still alive: a pid plus its start time, so a
reused pid is not mistaken for the process a wait is for.
"""

from __future__ import annotations

import os

# How often a wait looks whether the process it waits for is still alive.
POLL_S = 0.5


class ProcessWatch:
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


def pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
