"""Loads engram_jax's native module and registers its FFI targets with jax.

The one registration path: every public function that emits an ``ffi_call``
goes through :func:`ensure_registered` first, so targets are registered once,
lazily, whichever entry point a user starts from.
"""

from __future__ import annotations

import base64
import hashlib
import sys
import threading
import warnings
from importlib import machinery, metadata, util
from pathlib import Path
from types import ModuleType

import jax

MODULE = "engram_jax._engram_native"
_HERE = Path(__file__).resolve().parent


def _installed_copy() -> tuple[Path, metadata.Distribution] | None:
    """The compiled module of the installed ``engram_jax`` distribution when it lies
    outside this package's folder (and this interpreter can load it), else None.

    After ``pip install .``, a script run from the repository root finds the source
    tree's ``engram_jax/`` first on ``sys.path``; that folder has no compiled module,
    but the installed distribution beside the interpreter does.
    """
    try:
        dist = metadata.distribution("engram_jax")
    except metadata.PackageNotFoundError:
        return None
    names = {MODULE.rpartition(".")[2] + suffix for suffix in machinery.EXTENSION_SUFFIXES}
    for file in dist.files or ():
        if len(file.parts) == 2 and file.parts[0] == "engram_jax" and file.parts[1] in names:
            path = Path(dist.locate_file(file))
            if path.parent.resolve() != _HERE and path.is_file():
                return path, dist
    return None


def _differing_sources(dist: metadata.Distribution) -> list[str]:
    """This folder's Python files whose contents differ from what ``dist`` installed
    (by the sha256 of its RECORD), or that it did not install."""
    recorded = {
        str(file): file.hash.value
        for file in dist.files or ()
        if file.parts[0] == "engram_jax" and file.suffix == ".py" and file.hash
    }
    differing = []
    for path in sorted(_HERE.rglob("*.py")):
        name = path.relative_to(_HERE.parent).as_posix()
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
        if recorded.get(name) != digest.rstrip(b"=").decode():
            differing.append(name)
    return differing


def _load() -> ModuleType:
    try:
        from engram_jax import _engram_native

        return _engram_native
    except ImportError as exc:
        missing = exc
    found = _installed_copy()
    if found is None:
        raise ImportError(
            f"engram_jax's native module is missing from {_HERE} and no installed "
            "engram_jax has one: install the package with `pip install .` (it builds "
            "the C++/CUDA extension), or `pip install -e .` to work on the source tree"
        ) from missing
    path, dist = found
    differing = _differing_sources(dist)
    if differing:
        shown = ", ".join(differing[:3]) + (", ..." if len(differing) > 3 else "")
        warnings.warn(
            f"engram_jax is imported from {_HERE}, which has no compiled module, so it "
            f"uses the one installed at {path.parent} ({dist.version}); that install was "
            f"built from other Python files ({len(differing)} of this tree's differ: {shown}). "
            "Reinstall with `pip install .`, or install editable (`pip install -e .`) "
            "to run this tree as it is.",
            RuntimeWarning,
            stacklevel=2,
        )
    spec = util.spec_from_file_location(MODULE, path)
    module = util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    return module


native = _load()

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
