"""Pieces every benchmark shares: the machine/version record, building and
running the rawgather reference, fresh random ids, checking the rows a timed
program returned, and writing results.

Benchmarks run on a GPU machine; results go to benchmarks/results/*.json with
the machine, versions and the command that produced them.
"""

from __future__ import annotations

import bisect
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engram_jax import BLOCK_SIZE, checkpoint, row_stride

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RAWGATHER_SRC = HERE / "reference" / "rawgather.cu"


def machine_info() -> dict:
    """CPU, GPU, driver and package versions, for the results file."""
    import jaxlib

    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "devices": [str(d) for d in jax.devices()],
    }
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        info["gpu"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["gpu"] = None
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
    except OSError:
        pass
    try:
        import cuda.bindings

        info["cuda_bindings"] = cuda.bindings.__version__
    except (ImportError, AttributeError):
        pass
    return info


def build_with_nvcc(source: Path, *flags: str, workdir: str | None = None) -> Path:
    """Compile a benchmark's CUDA program (sm_90, -O3, ``flags``) with nvcc into
    ``workdir`` (default: a new temporary folder); returns the executable's path."""
    exe = Path(workdir or tempfile.mkdtemp(prefix=f"{source.stem}-")) / source.stem
    subprocess.run(
        ["nvcc", "-O3", "-arch=sm_90", *flags, "-o", str(exe), str(source)], check=True, timeout=600
    )
    return exe


def build_rawgather(workdir: str | None = None) -> Path:
    """Compile the reference gather with nvcc; returns the executable's path."""
    return build_with_nvcc(RAWGATHER_SRC, workdir=workdir)


def run_rawgather(exe: Path, footprints_gib: list[int], rows: int, **env: str) -> list[dict]:
    """Run rawgather for the footprints and row count; one dict per JSON line it prints,
    each gather's and the bulk copy's with the rows-check fields of its own comparison
    of every row of its last call or copy with the table's bytes (a table whose 8-byte
    words all differ)."""
    environ = dict(os.environ, RAWGATHER_ROWS=str(rows), **{k: str(v) for k, v in env.items()})
    proc = subprocess.run(
        [str(exe), *map(str, footprints_gib)],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in lines:
        if "rows_compared" in r:
            r.update(
                rows_checked=r["rows_compared"] > 0 and r["rows_mismatched"] == 0,
                rows_check="rawgather: every row of the last timed call or copy vs the table's "
                "bytes (every 8-byte word of the table differs)",
                rows_checksums=r["rows_compared"],
            )
    return lines


def time_calls(fn, batches, repeats: int = 5, checksums: list | None = None) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` passes.

    Each pass queues every batch back to back (async dispatch keeps the GPU
    busy, as in a serving loop) and synchronises once at the end, so the
    figure includes jax's dispatch. The first batch is run once beforehand to
    compile. With ``checksums`` (a list), ``fn`` returns ``(output, checksum)``
    and every timed call's checksum is appended to it, pass after pass, in
    batch order: the timed calls are the checked ones.
    """
    jax.block_until_ready(fn(batches[0]))
    per_call, kept = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for batch in batches:
            out = fn(batch)  # the previous output is freed: one batch's rows at a time
            if checksums is not None:
                out, checksum = out
                kept.append(checksum)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / len(batches))
    if checksums is not None:
        checksums += [np.asarray(c) for c in kept]
    return statistics.median(per_call)


# -- the rows a timed program returned ---------------------------------------------

# Odd, so that position p's multiplier 2 * (p * _GOLDEN) + 1 differs for every p below 2**31.
_GOLDEN = 0x9E3779B1


def rows_checksum(values: jax.Array) -> jax.Array:
    """uint32 checksum of ``values`` (bf16 rows, uint8 records or integer ids), on the
    device: the sum of every element's bits times an odd multiplier of its position,
    wrapping around.

    A fused multiply-add reduction over what a lookup returned, cheap beside the
    lookup, so a timed step returns it. A zero row, a row of another id and a stale
    row all change it: a change at one position always does (an odd multiplier is
    invertible modulo 2**32), changes at several could cancel by a 2**-32 chance.
    """
    if jnp.issubdtype(values.dtype, jnp.floating):
        bits = jax.lax.bitcast_convert_type(values, jnp.uint16).astype(jnp.uint32)
    else:
        bits = values.astype(jnp.uint32)  # int32 ids wrap: -1 is 0xFFFFFFFF
    positions = jnp.arange(values.size, dtype=jnp.uint32).reshape(values.shape)
    multipliers = (positions * jnp.uint32(_GOLDEN)) << 1 | 1
    return jnp.sum(bits * multipliers, dtype=jnp.uint32)


def expected_records(ids: jax.Array, dim: int, *, seed: int = 0) -> jax.Array:
    """The uint8 records ``[..., row_stride]`` a :func:`~engram_jax.checkpoint.fill_distinct`
    table holds for ``ids`` (computed on the device from the fill's definition)."""
    weight, scale = checkpoint.distinct_bytes(ids, dim, seed=seed)
    padding = jnp.zeros(ids.shape + (row_stride(dim) - dim - dim // 32,), jnp.uint8)
    return jnp.concatenate([weight, scale, padding], axis=-1)


def expected_rows(
    ids: jax.Array, dim: int, *, seed: int = 0, row_start: int = 0, row_stop: int = 2**31
) -> jax.Array:
    """bf16 rows ``[..., dim]`` a lookup of ``ids`` returns from a
    :func:`~engram_jax.checkpoint.fill_distinct` table of rows ``[row_start, row_stop)``,
    computed on the device without reading any table (zeros where it holds no row)."""
    weight, scale = checkpoint.distinct_bytes(ids, dim, seed=seed)
    values = jax.lax.bitcast_convert_type(weight, jnp.float8_e4m3fn).astype(jnp.float32)
    # 2**(s - 127) from its float32 bits: exact, where exp2 may be approximated.
    scales = jax.lax.bitcast_convert_type(scale.astype(jnp.uint32) << 23, jnp.float32)
    rows = (values * jnp.repeat(scales, BLOCK_SIZE, axis=-1)).astype(jnp.bfloat16)
    held = (ids >= row_start) & (ids < row_stop)
    return jnp.where(held[..., None], rows, jnp.zeros((), jnp.bfloat16))


def rows_check(got, expected, how: str, *, zero_is_wrong: bool = True) -> dict:
    """The rows-check part of a results record: ``got`` and ``expected`` are checksums
    (any shape, one per step or call and layer) of the timed variant's rows and of
    the reference's for the same ids. ``zero_is_wrong``: a zero checksum in the
    reference (all-zero rows, which prove nothing) fails the check too."""
    got = np.asarray(got, np.uint32)
    expected = np.asarray(expected, np.uint32)
    if got.shape != expected.shape:
        raise ValueError(f"checksums of shape {got.shape} against {expected.shape}")
    mismatched = int(np.count_nonzero(got != expected))
    zeros = int(np.count_nonzero(expected == 0)) if zero_is_wrong else 0
    return {
        "rows_checked": bool(expected.size) and not mismatched and not zeros,
        "rows_check": how,
        "rows_checksums": int(expected.size),
        "rows_mismatched": mismatched,
        **({"rows_zero_in_reference": zeros} if zero_is_wrong else {}),
    }


# What names a record in a FAILED line.
_LABEL_KEYS = ("variant", "lever", "what", "batch", "ids", "tokens", "rows", "footprint_gib")


def finish_rows_checks(records: list[dict], file=None) -> None:
    """The run's last word on its rows, on ``file`` (default stdout): one line if every
    checked record passed, else a FAILED line per failed record and exit status 1
    (write the results first, with ``rows_checked: false``: a timing of wrong rows
    must not pass unnoticed)."""
    checked = [r for r in records if r.get("rows_checked") is not None]
    failed = [r for r in checked if not r["rows_checked"]]
    for r in failed:
        label = {k: r[k] for k in _LABEL_KEYS if k in r}
        print(
            f"FAILED rows check: {label}: {r['rows_mismatched']} of {r['rows_checksums']} "
            f"checksums differ, {r.get('rows_zero_in_reference', 0)} zero in the reference, "
            f"{r.get('rows_not_compared', 0)} not compared ({r['rows_check']})",
            file=file,
            flush=True,
        )
    if failed:
        raise SystemExit(f"FAILED: the rows of {len(failed)} of {len(checked)} records are wrong")
    if checked:
        print(f"rows checked: {len(checked)} records, each equal to its reference", file=file)
    else:
        print("rows not checked: no record had a reference to compare with", file=file)


def stream_summary(trace_dir, steps: int, side_kernels=("Gather",)) -> dict | None:
    """Per GPU stream of the jax profiler trace under ``trace_dir``:
    :func:`summarize_stream` of its kernels, times from the device's first kernel,
    with each top kernel's launch details as the profiler gives them (grid, block,
    registers, shared memory: whether a kernel leaves room on an SM beside it)."""
    from jax.profiler import ProfileData

    paths = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    if not paths:
        return None
    data = ProfileData.from_file(str(paths[-1]))
    streams = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines, details = {}, {}
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            lines[line.name] = [(e.start_ns, e.end_ns, e.name) for e in line.events]
            for e in line.events:
                if e.name[:80] not in details:
                    details[e.name[:80]] = dict(e.stats).get("kernel_details")
        starts = [start for events in lines.values() for start, _, _ in events]
        beside = beside_side_kernels(lines, steps, side_kernels)
        for name, events in lines.items():
            if events:
                streams[name] = summarize_stream(events, steps, side_kernels, min(starts))
                streams[name].update(beside[name])
                streams[name]["top_kernel_details"] = {
                    n: details.get(n) for n in streams[name]["top_ms_per_step"]
                }
    return streams


def beside_side_kernels(lines: dict, steps: int, side_kernels=("Gather",)) -> dict:
    """Per stream of ``lines`` (name -> ``(start_ns, end_ns, name)`` kernels): how long
    its kernels ran while a ``side_kernels`` kernel ran on another stream, per step,
    and which kernels those were (the top five): what a gather on a side stream
    overlapped, and so what it was hidden behind or competed with."""
    side = {
        name: [(a, b) for a, b, n in events if any(k in n for k in side_kernels)]
        for name, events in lines.items()
    }
    out = {}
    for name, events in lines.items():
        merged: list[list[int]] = []
        for a, b in sorted(span for other, spans in side.items() if other != name
                           for span in spans):  # fmt: skip
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        firsts = [a for a, _ in merged]
        totals: dict[str, float] = {}
        for start, end, kernel in events:
            i, overlap = max(0, bisect.bisect_right(firsts, start) - 1), 0.0
            while i < len(merged) and merged[i][0] < end:
                overlap += max(0.0, min(end, merged[i][1]) - max(start, merged[i][0]))
                i += 1
            if overlap:
                totals[kernel[:80]] = totals.get(kernel[:80], 0.0) + overlap
        top = sorted(totals.items(), key=lambda kv: -kv[1])[:5]
        out[name] = {
            "beside_side_ms_per_step": sum(totals.values()) / 1e6 / steps,
            "top_beside_side_ms_per_step": {n: t / 1e6 / steps for n, t in top},
        }
    return out


def summarize_stream(events, steps: int, side_kernels=("Gather",), origin: int = 0) -> dict:
    """One stream's ``(start_ns, end_ns, name)`` kernels, per step: kernel time
    (busy), the span from first kernel to last, the ``side_kernels`` time, the
    idle stretches over 20 us (and the kernels each ended before: what the stream
    waited to run) and the top kernels; and a timeline of the first
    ones (ms from ``origin``): the side kernels and the long idle stretches, to
    line a wait on one stream up with the gather on another. What a step loses
    to waiting shows as the compute stream's idle time; what it loses to
    sharing the GPU, as its busy time."""
    events = sorted(events)
    busy, reach = 0.0, events[0][0]
    totals: dict[str, float] = {}
    long_gaps = []  # idle stretches a launch or a wait leaves, not a kernel's tail
    waits: dict[str, float] = {}  # the long gaps by the kernel that ended each one
    side = []
    for start, end, name in events:
        if start - reach > 20e3:
            long_gaps.append((reach, start))
            waits[name] = waits.get(name, 0.0) + (start - reach)
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
        totals[name] = totals.get(name, 0.0) + (end - start)
        if any(k in name for k in side_kernels):
            side.append((start, end))
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:10]

    def ms(spans):
        return [[round((a - origin) / 1e6, 4), round((b - origin) / 1e6, 4)] for a, b in spans[:16]]

    return {
        "kernels_per_step": len(events) / steps,
        "busy_ms_per_step": busy / 1e6 / steps,
        "span_ms_per_step": (reach - events[0][0]) / 1e6 / steps,
        "gather_ms_per_step": sum(b - a for a, b in side) / 1e6 / steps,
        "gaps_over_20us_per_step": len(long_gaps) / steps,
        "gap_ms_over_20us_per_step": sum(b - a for a, b in long_gaps) / 1e6 / steps,
        "top_gaps_before_ms_per_step": {
            n[:80]: t / 1e6 / steps for n, t in sorted(waits.items(), key=lambda kv: -kv[1])[:5]
        },
        "top_ms_per_step": {n[:80]: t / 1e6 / steps for n, t in top},
        "first_side_kernels_ms": ms(side),
        "first_gaps_over_20us_ms": ms(long_gaps),
    }


def write_results(name: str, records: list[dict], extra: dict | None = None) -> Path:
    """Write benchmarks/results/<name>.json with machine info and the command line."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        **(extra or {}),
        "records": records,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def print_table(records: list[dict], columns: list[str]) -> None:
    """A plain aligned table on stdout, the last thing a benchmark prints."""
    widths = [max([len(c)] + [len(_fmt(r.get(c))) for r in records]) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in records:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return "" if value is None else str(value)
