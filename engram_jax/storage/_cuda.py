"""Checked calls into the CUDA runtime and driver through cuda.bindings.

Every storage placement that touches CUDA goes through :func:`check`, so a
failed call raises with the function's name and CUDA's own message instead of
returning an error code that nobody reads.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from types import ModuleType
from typing import Any


class CudaUnavailableError(RuntimeError):
    """Raised when a placement needs CUDA and this process has no usable driver or GPU."""


class CudaCallError(RuntimeError):
    """A CUDA call returned an error; ``name`` is CUDA's name for it (``CUDA_ERROR_...``)."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


def _runtime() -> ModuleType:
    try:
        from cuda.bindings import runtime
    except ImportError as exc:  # pragma: no cover - dependency of the package
        raise CudaUnavailableError("cuda-bindings is not installed") from exc
    return runtime


def _driver() -> ModuleType:
    from cuda.bindings import driver

    return driver


def driver() -> ModuleType:
    """The cuda.bindings driver module, initialised; CudaUnavailableError without a driver."""
    module = _driver()
    try:
        err = module.cuInit(0)[0]
    except Exception as exc:  # cuda.pathfinder raises when libcuda.so is not installed
        raise CudaUnavailableError(f"the CUDA driver library cannot be loaded: {exc}") from exc
    if int(err) != 0:
        _, name = module.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else name
        raise CudaUnavailableError(f"cuInit failed: {name}: no usable CUDA driver or GPU")
    return module


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
        text = f"{what} failed: {name}: {message}"
        if name in ("cudaErrorNoDevice", "cudaErrorInsufficientDriver", "CUDA_ERROR_NO_DEVICE"):
            raise CudaUnavailableError(text)
        raise CudaCallError(text, name)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def runtime() -> ModuleType:
    """The cuda.bindings runtime module (raises CudaUnavailableError if absent)."""
    return _runtime()


def device_count() -> int:
    """CUDA devices visible to this process; 0 without a driver."""
    rt = _runtime()
    err, count = rt.cudaGetDeviceCount()
    return int(count) if int(err) == 0 else 0


def check_ordinal(ordinal: object, name: str = "device_ordinal") -> int | None:
    """``ordinal`` as a plain int (None stays None); TypeError or ValueError before any CUDA call.

    Python and numpy ints are accepted; bools, floats and strings are refused
    rather than truncated or parsed, and negative values (CUDA has none) too.
    """
    if ordinal is None:
        return None
    if isinstance(ordinal, bool) or not isinstance(ordinal, numbers.Integral):
        raise TypeError(
            f"{name} must be an int CUDA device ordinal or None, "
            f"got {type(ordinal).__name__} {ordinal!r}"
        )
    if ordinal < 0:
        raise ValueError(f"{name} must be >= 0, got {ordinal}")
    return int(ordinal)


def require_device(ordinal: int | None, placement: str) -> int:
    """The CUDA ordinal a placement should use (default 0), or CudaUnavailableError saying why.

    A malformed ordinal raises TypeError/ValueError first, even without a GPU;
    one past the visible devices raises ValueError before anything is set up.
    """
    ordinal = check_ordinal(ordinal)
    count = device_count()
    if count == 0:
        raise CudaUnavailableError(
            f"placement {placement!r} needs a CUDA GPU, and this process sees none "
            "(no driver, or no visible device); use 'cpu' for the CPU backend"
        )
    ordinal = 0 if ordinal is None else ordinal
    if ordinal >= count:
        raise ValueError(f"device ordinal {ordinal} is out of range: {count} CUDA device(s)")
    return ordinal


@contextlib.contextmanager
def in_context(ordinal: int) -> Iterator[None]:
    """Run the block with the primary context of ``ordinal`` created and current.

    Driver calls (cuMem*) act in the current context; XLA uses the same primary
    context, so memory set up here is visible to jax's kernels.
    """
    with on_device(ordinal):
        check(_runtime().cudaFree(0), "cudaFree(0) (context creation)")
        yield


def device_attribute(ordinal: int, name: str) -> int:
    """``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_<name>)`` of device ``ordinal``."""
    drv = driver()
    device = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
    attribute = getattr(drv.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    return int(check(drv.cuDeviceGetAttribute(attribute, device), f"cuDeviceGetAttribute({name})"))


def host_register(address: int, nbytes: int) -> None:
    """Page-lock host memory someone else mapped and map it for every GPU (UVA address)."""
    rt = _runtime()
    flags = rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable
    check(rt.cudaHostRegister(address, nbytes, flags), "cudaHostRegister")
    try:
        device_pointer = int(
            check(rt.cudaHostGetDevicePointer(address, 0), "cudaHostGetDevicePointer")
        )
        if device_pointer != address:
            # The registry takes one address for CPU and GPU, which holds on every UVA system.
            raise RuntimeError(
                f"registered host memory at {address:#x} has device address {device_pointer:#x}; "
                "engram_jax needs unified addressing"
            )
    except BaseException:
        rt.cudaHostUnregister(address)
        raise


def host_unregister(address: int) -> None:
    """Undo :func:`host_register` after every kernel that may read the memory is done."""
    synchronize_active_devices()
    check(_runtime().cudaHostUnregister(address), "cudaHostUnregister")


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
    try:
        if int(driver.cuInit(0)[0]) != 0:
            return
    except Exception:  # no driver library at all: no device can be running anything
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
