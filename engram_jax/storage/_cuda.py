"""Checked calls into the CUDA runtime and driver through cuda.bindings.

Every storage placement that touches CUDA goes through :func:`check`, so a
failed call raises with the function's name and CUDA's own message instead of
returning an error code that nobody reads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class CudaUnavailableError(RuntimeError):
    """Raised when a placement needs CUDA and this process has no usable driver or GPU."""


def _runtime():
    try:
        from cuda.bindings import runtime
    except ImportError as exc:  # pragma: no cover - dependency of the package
        raise CudaUnavailableError("cuda-bindings is not installed") from exc
    return runtime


def _driver():
    from cuda.bindings import driver

    return driver


def check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings result tuple, raising on any error code."""
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if int(err) != 0:
        runtime = _runtime()
        if isinstance(err, runtime.cudaError_t):
            _, name = runtime.cudaGetErrorName(err)
            _, message = runtime.cudaGetErrorString(err)
        else:
            driver = _driver()
            _, name = driver.cuGetErrorName(err)
            _, message = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        message = message.decode() if isinstance(message, bytes) else message
        error = (
            CudaUnavailableError
            if name in ("cudaErrorNoDevice", "cudaErrorInsufficientDriver", "CUDA_ERROR_NO_DEVICE")
            else RuntimeError
        )
        raise error(f"{what} failed: {name}: {message}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def runtime():
    """The cuda.bindings runtime module (raises CudaUnavailableError if absent)."""
    return _runtime()


def device_count() -> int:
    """CUDA devices visible to this process; 0 without a driver."""
    rt = _runtime()
    err, count = rt.cudaGetDeviceCount()
    return int(count) if int(err) == 0 else 0


@contextlib.contextmanager
def on_device(ordinal: int) -> Iterator[None]:
    """Make ``ordinal`` current for the calling thread, restoring the previous device after."""
    rt = _runtime()
    previous = check(rt.cudaGetDevice(), "cudaGetDevice")
    check(rt.cudaSetDevice(ordinal), f"cudaSetDevice({ordinal})")
    try:
        yield
    finally:
        check(rt.cudaSetDevice(previous), f"cudaSetDevice({previous})")


def synchronize_active_devices() -> None:
    """Wait for all work on every device whose primary context is live.

    Called before freeing memory a kernel may still read. Devices that were
    never used have no context and are skipped, so this never creates one.
    """
    driver = _driver()
    if int(driver.cuInit(0)[0]) != 0:
        return
    count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    for ordinal in range(count):
        device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        _, active = check(driver.cuDevicePrimaryCtxGetState(device), "cuDevicePrimaryCtxGetState")
        if not active:
            continue
        context = check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        try:
            check(driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
            try:
                check(driver.cuCtxSynchronize(), "cuCtxSynchronize")
            finally:
                check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")
        finally:
            check(driver.cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease")
