"""Loads engram_jax's native module and registers its FFI targets with jax.

The one registration path: every public function that emits an ``ffi_call``
goes through :func:`ensure_registered` first, so targets are registered once,
lazily, whichever entry point a user starts from.
"""

from __future__ import annotations

import threading

import jax

try:
    from engram_jax import _engram_native as native
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "engram_jax's native module is missing: install the package with "
        "`pip install .` (it builds the C++/CUDA extension)"
    ) from exc

_lock = threading.Lock()
_registered = False


def ensure_registered() -> None:
    """Register every handler the native module has, for each platform it was built for.

    State types go first (a stateful handler names its type), and only once the
    backends exist: jax applies registrations queued before a backend starts in
    an order that puts targets ahead of types.
    """
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        jax.devices()  # starts every backend
        for platform, types in native.type_registrations().items():
            for name, registration in types.items():
                jax.ffi.register_ffi_type(name, registration, platform=platform)
        for platform, targets in native.registrations().items():
            for name, handler in targets.items():  # a capsule, or a dict of stages
                jax.ffi.register_ffi_target(name, handler, platform=platform, api_version=1)
        _registered = True


def built_with_cuda() -> bool:
    """Whether the native module holds the CUDA handlers."""
    return bool(native.has_cuda)


def gpu_available() -> bool:
    """Whether CUDA handlers exist and jax sees at least one CUDA GPU."""
    if not built_with_cuda():
        return False
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False
