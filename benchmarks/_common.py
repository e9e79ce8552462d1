"""Pieces every benchmark shares: the machine/version record, building and
running the rawgather reference, fresh random ids, and writing results.

Benchmarks run on a GPU machine; results go to benchmarks/results/*.json with
the machine, versions and the command that produced them.
"""

from __future__ import annotations

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

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RAWGATHER_SRC = HERE / "reference" / "rawgather.cu"


def machine_info() -> dict:
    """CPU, GPU, driver and package versions, for the results file."""
    import jax
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


def build_rawgather(workdir: str | None = None) -> Path:
    """Compile the reference gather with nvcc; returns the executable's path."""
    out_dir = Path(workdir or tempfile.mkdtemp(prefix="rawgather-"))
    exe = out_dir / "rawgather"
    subprocess.run(
        ["nvcc", "-O3", "-arch=sm_90", "-o", str(exe), str(RAWGATHER_SRC)], check=True, timeout=600
    )
    return exe


def run_rawgather(exe: Path, footprints_gib: list[int], rows: int, **env: str) -> list[dict]:
    """Run rawgather for the footprints and row count; one dict per JSON line it prints."""
    environ = dict(os.environ, RAWGATHER_ROWS=str(rows), **{k: str(v) for k, v in env.items()})
    proc = subprocess.run(
        [str(exe), *map(str, footprints_gib)],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
    )
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def time_calls(fn, batches, repeats: int = 5) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` passes.

    Each pass queues every batch back to back (async dispatch keeps the GPU
    busy, as in a serving loop) and synchronises once at the end, so the
    figure includes jax's dispatch. The first batch is run once beforehand to
    compile.
    """
    fn(batches[0]).block_until_ready()
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for batch in batches:
            out = fn(batch)
        out.block_until_ready()
        per_call.append((time.perf_counter() - start) / len(batches))
    return statistics.median(per_call)


def stream_summary(trace_dir, steps: int, side_kernels=("Gather",)) -> dict | None:
    """Per GPU stream of the jax profiler trace under ``trace_dir``, per step: kernel
    time (busy), the span from first kernel to last, the ``side_kernels`` time and the
    top kernels. What a step loses to waiting shows as the compute stream's idle time
    (span - busy); what it loses to sharing SMs, as its busy time."""
    from jax.profiler import ProfileData

    paths = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    if not paths:
        return None
    data = ProfileData.from_file(str(paths[-1]))
    streams = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            events = sorted((e.start_ns, e.end_ns, e.name) for e in line.events)
            if not events:
                continue
            busy, reach = 0.0, events[0][0]
            totals: dict[str, float] = {}
            for start, end, name in events:
                busy += max(0.0, end - max(start, reach))
                reach = max(reach, end)
                totals[name] = totals.get(name, 0.0) + (end - start)
            top = sorted(totals.items(), key=lambda kv: -kv[1])[:4]
            side = sum(t for n, t in totals.items() if any(k in n for k in side_kernels))
            streams[line.name] = {
                "kernels_per_step": len(events) / steps,
                "busy_ms_per_step": busy / 1e6 / steps,
                "span_ms_per_step": (reach - events[0][0]) / 1e6 / steps,
                "gather_ms_per_step": side / 1e6 / steps,
                "top_ms_per_step": {n[:60]: t / 1e6 / steps for n, t in top},
            }
    return streams


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
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in records)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in records:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return "" if value is None else str(value)
