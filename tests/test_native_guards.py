"""The native layer's own guards, below the Python checks: what the registries
refuse, the cache refresh handshake under races, CPU lookups at the process's
thread limit or racing a close, and the build without CUDA.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engram_jax import _native, pack_records, testing

from ._helpers import nan_free_table_arrays

native = _native.native
HOST, MAPPED, DEVICE = 0, 1, 2
_keys = itertools.count(2**50)  # far from the keys tables and caches take


def _ffi_lookup(key: int, dim: int, ids, order: str = "plain"):
    """The lookup custom call itself, with no Python-side checks in front."""
    _native.ensure_registered()
    rows = jax.ShapeDtypeStruct(ids.shape + (dim,), jnp.bfloat16)
    attrs = {"table_key": np.int64(key), "dim": np.int64(dim), "max_ctas": np.int64(0)}
    if order == "plain":
        return jax.ffi.ffi_call("engram_lookup", rows, vmap_method="broadcast_all")(ids, **attrs)
    code = {"sorted": 1, "dedup": 2}[order]
    workspace = jax.ShapeDtypeStruct((native.lookup_workspace_bytes(ids.size, code),), jnp.uint8)
    call = jax.ffi.ffi_call("engram_cached_lookup", (rows, workspace), vmap_method="broadcast_all")
    return call(ids, order=np.int64(code), cache_key=np.int64(0), **attrs)[0]


# -- the table registry ----------------------------------------------------------

BAD_ENTRIES = {
    "dim 0": dict(dim=0),
    "dim not a multiple of 32": dict(dim=48),
    "dim past 16384": dict(dim=16384 + 32),
    "negative rows": dict(num_rows=-1),
    "negative row_start": dict(row_start=-5),
    "rows past int32 ids": dict(row_start=2**31 - 4, num_rows=5),
    "more rows than int32 ids": dict(num_rows=2**32),
    "null base": dict(base=0),
    "device memory for any device": dict(kind=DEVICE, ordinal=-1),
    "ordinal below -1": dict(ordinal=-2),
}


@pytest.mark.parametrize("bad", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_register_table_refuses_entries_no_gather_can_read(bad):
    memory = np.zeros(4096, np.uint8)
    entry = dict(ordinal=-1, base=memory.ctypes.data, row_start=0, num_rows=8, dim=32, kind=HOST)
    entry.update(bad)
    key = next(_keys)
    try:
        with pytest.raises(ValueError, match="register_table"):
            native.register_table(
                key,
                entry["ordinal"],
                entry["base"],
                entry["row_start"],
                entry["num_rows"],
                entry["dim"],
                entry["kind"],
            )
    finally:
        native.unregister_table(key)


def test_register_table_accepts_the_edges():
    memory = np.zeros(4096, np.uint8)
    key = next(_keys)
    try:
        native.register_table(key, -1, 0, 2**31, 0, 32, HOST)  # no rows, no memory
        native.register_table(key, 3, memory.ctypes.data, 2**31 - 8, 8, 16384, MAPPED)
        native.register_table(key, 0, memory.ctypes.data, 0, 8, 32, DEVICE)
    finally:
        assert native.unregister_table(key) == 3


def test_register_table_refuses_a_second_entry_for_one_device():
    """Replacing an entry would drop its lease: unregister could then return
    while a CPU gather still reads the first entry's memory."""
    memory = np.zeros(4096, np.uint8)
    key = next(_keys)
    try:
        native.register_table(key, 1, memory.ctypes.data, 0, 8, 32, HOST)
        with pytest.raises(ValueError, match="already has an entry for device 1"):
            native.register_table(key, 1, memory.ctypes.data, 0, 8, 32, HOST)
        native.register_table(key, 2, memory.ctypes.data, 0, 8, 32, HOST)
    finally:
        assert native.unregister_table(key) == 2


def test_host_view_refuses_a_null_address():
    with pytest.raises(ValueError, match="null address"):
        native.host_view(0, 16)
    assert native.host_view(0, 0).size == 0


# -- the lookup handlers' own checks ----------------------------------------------


@pytest.mark.parametrize("order", ["plain", "sorted"])
def test_lookup_output_must_be_ids_shape_plus_dim(order):
    weight, scale = nan_free_table_arrays(16, 32)
    records = pack_records(weight, scale)
    key = next(_keys)
    native.register_table(key, -1, records.ctypes.data, 0, 16, 32, HOST)
    try:
        ids = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
        good = _ffi_lookup(key, 32, ids, order)
        np.testing.assert_array_equal(
            np.asarray(good).view(np.uint16),
            testing.lookup_reference(weight, scale, np.asarray(ids)).view(np.uint16),
        )
        # Same element count, wrong shape: (3, 2, 32) is not ids.shape + (dim,).
        _native.ensure_registered()
        wrong = jax.ShapeDtypeStruct((3, 2, 32), jnp.bfloat16)
        attrs = {"table_key": np.int64(key), "dim": np.int64(32), "max_ctas": np.int64(0)}
        if order == "plain":
            call = jax.ffi.ffi_call("engram_lookup", wrong, vmap_method="broadcast_all")
        else:
            workspace = jax.ShapeDtypeStruct((native.lookup_workspace_bytes(6, 1),), jnp.uint8)
            call = jax.ffi.ffi_call(
                "engram_cached_lookup", (wrong, workspace), vmap_method="broadcast_all"
            )
            attrs.update(order=np.int64(1), cache_key=np.int64(0))
        with pytest.raises(Exception, match=r"ids.shape \+ \(dim,\)"):
            jax.block_until_ready(call(ids, **attrs))
    finally:
        native.unregister_table(key)


# -- the hot-row cache registry ---------------------------------------------------


def test_cache_publish_refuses_an_index_without_memory():
    key = next(_keys)
    native.cache_create(key, -1, 1, 32, HOST)
    try:
        with pytest.raises(ValueError, match="needs its records, rows and buckets"):
            native.cache_publish(key, -1, 0, 0, 0, 0, 1, 1, 0)
        with pytest.raises(ValueError, match="out of range"):
            native.cache_publish(key, -1, 0, 1, 1, 1, 2**31, 1, 0)
        native.cache_publish(key, -1, 0, 0, 0, 0, 0, 1, 0)  # empty: nothing is read
        assert native.cache_active(key, -1) == 0
    finally:
        native.cache_remove(key)


def test_cache_in_device_memory_needs_its_device():
    with pytest.raises(ValueError, match="belongs to one GPU"):
        native.cache_create(next(_keys), -1, 1, 32, DEVICE)


def test_cache_fill_and_upload_refuse_bad_arguments_before_any_cuda_call():
    with pytest.raises(ValueError, match="count out of range"):
        native.cache_fill_cuda(1, 0, 16, -1, 16)
    with pytest.raises(ValueError, match="null rows or destination"):
        native.cache_fill_cuda(1, 0, 0, 5, 0)
    with pytest.raises(ValueError, match="null destination"):
        native.cache_upload_cuda(0, 0, np.zeros(4, np.uint8))


class _Cache:
    """A registry entry whose set 0 a pretend lookup holds while set 1 is active."""

    def __init__(self):
        self.key = next(_keys)
        self.table_key = next(_keys)
        native.cache_create(self.key, -1, self.table_key, 32, HOST)
        native.cache_publish(self.key, -1, 0, 0, 0, 0, 0, 1, 0)
        self.token, held = native.cache_hold(self.key, -1, self.table_key, 32)
        assert held == 0
        native.cache_publish(self.key, -1, 1, 0, 0, 0, 0, 1, 0)

    def reserve_in_background(self, buffer):
        outcome = {}

        def reserve():
            try:
                native.cache_reserve(self.key, -1, buffer)
                outcome["result"] = "reserved"
            except RuntimeError as exc:
                outcome["result"] = str(exc)

        thread = threading.Thread(target=reserve)
        thread.start()
        time.sleep(0.3)  # long enough to be waiting for the lease
        assert "result" not in outcome, outcome
        return thread, outcome


def test_reserve_fails_when_its_set_becomes_active_while_it_waits():
    cache = _Cache()
    try:
        thread, outcome = cache.reserve_in_background(0)
        native.cache_publish(cache.key, -1, 0, 0, 0, 0, 0, 1, 0)  # set 0 active again
        thread.join(timeout=5)
        # Had it returned once the lease was gone, the refresh would rewrite the active set.
        assert not thread.is_alive(), "reserve still waits for a set lookups now read"
        assert "is the one lookups read" in outcome["result"]
        assert native.cache_active(cache.key, -1) == 0
    finally:
        native.cache_unhold(cache.token)
        native.cache_remove(cache.key)


def test_reserve_fails_when_the_cache_is_removed_while_it_waits():
    cache = _Cache()
    thread, outcome = cache.reserve_in_background(0)
    remover = threading.Thread(target=native.cache_remove, args=(cache.key,))
    remover.start()
    thread.join(timeout=5)
    try:
        assert not thread.is_alive(), "reserve still waits on a removed cache"
        assert "was removed" in outcome["result"]
        assert remover.is_alive()  # removal itself waits for the lease
    finally:
        native.cache_unhold(cache.token)
        remover.join(timeout=5)
        thread.join(timeout=5)
    assert not remover.is_alive()
    assert native.cache_active(cache.key, -1) == -2


# -- CPU lookups against the process's limits and a concurrent close ---------------


def _run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")  # the CPU handlers, on any machine
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=Path(__file__).resolve().parents[1],  # the child imports this file's helpers
    )


_CHILD_PRELUDE = """
    import ctypes, resource, sys, threading, time
    import numpy as np, jax, jax.numpy as jnp
    from engram_jax import _native, pack_records, row_stride, testing
    from tests.test_native_guards import _ffi_lookup
    from tests._helpers import nan_free_table_arrays
    native = _native.native
"""

_THREAD_LIMIT_CHILD = (
    _CHILD_PRELUDE
    + """
    order = sys.argv[1]
    rows, dim, n = 64, 32, 40000  # 40000 ids: several threads wanted
    weight, scale = nan_free_table_arrays(rows, dim)
    records = pack_records(weight, scale)
    native.register_table(7, -1, records.ctypes.data, 0, rows, dim, 0)
    ids = np.random.default_rng(1).integers(-2, rows + 2, n).astype(np.int32)
    want = testing.lookup_reference(weight, scale, ids)
    compiled = jax.jit(lambda i: _ffi_lookup(7, dim, i, order)).lower(ids).compile()
    ids = jax.device_put(ids)
    vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize"))
    # Room for the output, none for another thread's stack.
    resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (6 << 20), resource.RLIM_INFINITY))
    try:
        threading.Thread(target=lambda: None).start()
        print("THREADS-STILL-START")
        sys.exit(0)
    except RuntimeError:
        pass
    got = np.asarray(compiled(ids))
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), "rows differ"
    print("OK")
"""
)


@pytest.mark.parametrize("order", ["plain", "sorted", "dedup"])
def test_cpu_lookup_at_the_thread_limit_runs_on_the_calling_thread(order):
    """A helper thread that cannot start must not fail the lookup (nor, with
    threads already running, end the process through std::terminate)."""
    result = _run_child(_THREAD_LIMIT_CHILD, order)
    if "THREADS-STILL-START" in result.stdout:
        pytest.skip("an address-space limit does not stop thread starts here")
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-2000:]


_CLOSE_RACE_CHILD = (
    _CHILD_PRELUDE
    + """
    order = sys.argv[1]
    rows, dim, n = 512, 1024, 1 << 17
    stride = row_stride(dim)
    weight, scale = nan_free_table_arrays(rows, dim)
    records = pack_records(weight, scale)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    nbytes = records.nbytes
    ids = jax.device_put(np.random.default_rng(2).integers(0, rows, n).astype(np.int32))
    step = jax.jit(lambda i: _ffi_lookup(9, dim, i, order))

    def place():
        address = libc.mmap(None, nbytes, 3, 0x22, -1, 0)  # read/write, private anonymous
        ctypes.memmove(address, records.ctypes.data, nbytes)
        native.register_table(9, -1, address, 0, rows, dim, 0)
        return address

    address = place()
    jax.block_until_ready(step(ids))  # compiles
    start = time.perf_counter()
    jax.block_until_ready(step(ids))
    duration = time.perf_counter() - start
    native.unregister_table(9)
    libc.munmap(address, nbytes)
    for attempt in range(8):
        address = place()
        outcome = []
        def run():
            try:
                jax.block_until_ready(step(ids))
                outcome.append("read")
            except Exception as exc:
                outcome.append(str(exc))
        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(duration * 0.3)
        native.unregister_table(9)  # must wait for a gather still reading
        libc.munmap(address, nbytes)  # a read after this is a segfault
        thread.join()
        if outcome == ["read"]:
            print("OK")
            sys.exit(0)
        assert "closed or was never placed" in outcome[0], outcome
    print("NEVER-OVERLAPPED")
"""
)


@pytest.mark.parametrize("order", ["plain", "sorted"])
def test_unregister_waits_for_a_cpu_lookup_still_reading(order):
    """The CPU lookups hold a lease on the table, so its memory can be freed as
    soon as unregister_table returns, even with a lookup started on another thread."""
    result = _run_child(_CLOSE_RACE_CHILD, order)
    if "NEVER-OVERLAPPED" in result.stdout:
        pytest.skip("the close never landed while the lookup ran")
    assert result.returncode == 0 and "OK" in result.stdout, (
        result.returncode,
        result.stderr[-2000:],
    )


# -- the build without CUDA --------------------------------------------------------


def test_module_compiles_without_cuda():
    """Builds without nvcc leave ENGRAM_HAS_CUDA undefined; the binding must compile then."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    import nanobind

    root = Path(__file__).resolve().parents[1]
    if not (root / "ffi" / "bindings" / "module.cc").exists():
        pytest.skip("no sources next to the tests")
    robin_map = Path(nanobind.include_dir()).parent / "ext" / "robin_map" / "include"
    includes = [jax.ffi.include_dir(), nanobind.include_dir(), str(robin_map)]
    includes.append(sysconfig.get_paths()["include"])
    command = [
        compiler,
        "-std=c++17",
        "-fsyntax-only",
        "-UENGRAM_HAS_CUDA",
        "-I",
        str(root / "ffi"),
    ]
    command += [flag for path in includes for flag in ("-isystem", path)]
    bindings = root / "ffi" / "bindings"
    command += [str(bindings / "module.cc"), str(bindings / "cache_module.cc")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
