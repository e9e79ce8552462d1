"""Key-value stores a node group's handshake talks through: jax.distributed's
coordination service (and starting one), or an in-process store for a group
of one process or of threads.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from engram_jax import _jax_private


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
    so it is taken from jax's internals (:func:`engram_jax._jax_private.distributed_client`).
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


def coordination_service(address: str, num_processes: int) -> Any:
    """Start jax's coordination service (the key-value store behind jax.distributed).

    Returns the service; call ``.shutdown()`` on it when done.
    """
    return _jax_private.distributed_runtime().get_distributed_runtime_service(
        address, num_processes, shutdown_timeout=10
    )
