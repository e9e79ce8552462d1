"""The jax internals engram_jax needs that jax has no public API for, in one place.

Each shim says what it reads and what public API would replace it; nothing
else in the package imports from ``jax._src`` or jaxlib's extension.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def backends_are_initialized() -> bool:
    """Whether jax has started its backends, without starting them.

    ``jax.devices()`` and ``jax.extend.backend.backends()`` would start them
    (and block in a multi-process job whose peer died); jax has no public
    query. Replace with one if ``jax.extend.backend`` grows it.
    """
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def distributed_client() -> tuple[Any, int, int] | None:
    """``(client, process_id, num_processes)`` of ``jax.distributed.initialize``, or None.

    The coordination service's client (and so its key-value store) has no
    public accessor: ``jax.distributed`` only offers ``is_initialized``, and
    ``jax.process_index()`` would start the backends. Replace with a public
    client or key-value store API when jax has one.
    """
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None:
        return None
    return state.client, int(state.process_id), int(state.num_processes)


def distributed_runtime() -> ModuleType:
    """jaxlib's extension module, for ``get_distributed_runtime_client`` / ``_service``.

    Starting a coordination service (or joining one) without
    ``jax.distributed.initialize`` touching the backends has no public API;
    the module was renamed from ``xla_extension`` to ``_jax`` over releases.
    """
    try:
        from jax._src.lib import _jax
    except ImportError:  # older jaxlib
        from jax._src.lib import xla_extension as _jax
    return _jax
