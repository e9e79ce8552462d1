"""The errors of node-local table sharing, raised on every rank of a group alike."""

from __future__ import annotations


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
