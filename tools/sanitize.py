"""Run the GPU tests under NVIDIA's compute-sanitizer: every tool (memcheck,
racecheck, synccheck, initcheck) over every test file that has `gpu` tests,
with XLA's command buffers on (its default) and off, and print one line per run.

    python tools/sanitize.py                                 # everything (long)
    python tools/sanitize.py --tools memcheck --command-buffers on tests/test_prefetch.py
    python tools/sanitize.py --json sanitize.json
    python tools/sanitize.py --scale 1 tests/test_prefetch_safety.py   # the soak's full 1,000 steps
    python tools/sanitize.py --probe        # does XLA free dropped executables? (plain jnp)

Needs a GPU machine with compute-sanitizer on the PATH and the CUDA build of
engram_jax (`pip install --no-build-isolation -e .`). API errors are not
reported (`--report-api-errors no`): cuda-python's driver bindings probe symbols
with cuGetProcAddress, which fails by design for names the driver lacks, once
per probe; kernel accesses, races, barriers and uninitialised reads are what is
checked. Child processes are followed (the command-buffer workers of
test_prefetch.py run in their own process).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# XLA_FLAGS per command-buffer mode: on is XLA's default.
COMMAND_BUFFERS = {"on": "", "off": "--xla_gpu_enable_command_buffer="}
SANITIZER = ("compute-sanitizer", "--tool")
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
PYTEST_LINE = re.compile(r"^=*\s*(\d+ (passed|failed|error|skipped).*) in [\d.]+s", re.M)


def gpu_test_files() -> list[Path]:
    """The test files with at least one `gpu`-marked test."""
    return sorted(p for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


# No engram_jax in it: 20 jitted functions compiled, run and dropped, then the PJRT
# client's live executables counted. Without a sanitizer they are freed; under
# compute-sanitizer (memcheck, CUDA 13, jax 0.11.2 on an H200) 21 were alive after
# the clearing, 2 before the loop: which is why the call-site tests bound live
# sites by live executables.
EXECUTABLES_PROBE = """
import gc, time, jax, jax.extend, jax.numpy as jnp
backend = jax.extend.backend.get_backend()
x = jnp.ones((8, 8))
jax.clear_caches(); gc.collect()
before = len(backend.live_executables())
for k in range(20):
    fn = jax.jit(lambda a, k=k: a * k + 1)
    fn(x).block_until_ready()
    del fn
jax.clear_caches(); gc.collect(); time.sleep(3)
print("dropped executables still alive:", len(backend.live_executables()) - before, "of 20")
"""


def probe_executables(timeout_s: float) -> int:
    """The probe plainly and under memcheck; prints what each says."""
    for label, prefix in (
        ("plain", []),
        ("memcheck", [*SANITIZER, "memcheck", "--report-api-errors", "no"]),
    ):
        proc = subprocess.run(
            [*prefix, sys.executable, "-c", EXECUTABLES_PROBE],
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        said = [line for line in proc.stdout.splitlines() if "still alive" in line]
        print(f"{label:9} rc {proc.returncode}: {said[-1] if said else proc.stderr[-500:]}")
    return 0


def run_one(tool: str, mode: str, path: Path, timeout_s: float, scale: float = 1.0) -> dict:
    # ENGRAM_TEST_SCALE: the fuzzed and soak GPU tests' examples and steps (tests/_helpers.py).
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", ENGRAM_TEST_SCALE=str(scale))
    env["XLA_FLAGS"] = COMMAND_BUFFERS[mode]
    command = [
        *SANITIZER,
        tool,
        "--report-api-errors",
        "no",
        "--target-processes",
        "all",
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        str(path.relative_to(REPO)),
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        output, returncode = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout or b""  # bytes whatever text= says
        output = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
        returncode = None
    errors = [int(n) for n in SUMMARY.findall(output)]
    tests = PYTEST_LINE.findall(output)
    return {
        "tool": tool,
        "command_buffers": mode,
        "scale": scale,
        "file": str(path.relative_to(REPO)),
        "returncode": returncode,  # None: timed out; 139: the sanitizer itself crashed
        "errors": sum(errors) if errors else None,
        "tests": tests[-1][0] if tests else None,
        "seconds": round(time.monotonic() - start, 1),
        "tail": output[-3000:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="test files (default: every gpu one)")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated tools")
    parser.add_argument(
        "--command-buffers", default="on,off", help="comma-separated modes: on (default), off"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument(
        "--scale",
        type=float,
        default=0.1,
        help="examples of the fuzzed GPU tests and steps of the soak, times this (the tools "
        "slow a GPU test tens of times)",
    )
    parser.add_argument("--json", type=Path, help="write every run's record here")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="only: do dropped executables get freed, plain and under memcheck",
    )
    args = parser.parse_args()
    if shutil.which("compute-sanitizer") is None:
        parser.error("compute-sanitizer is not on the PATH (it ships with the CUDA toolkit)")
    if args.probe:
        return probe_executables(args.timeout)
    if not args.scale > 0:
        parser.error("--scale must be > 0")
    tools = args.tools.split(",")
    modes = args.command_buffers.split(",")
    for name, chosen, allowed in (("tool", tools, TOOLS), ("mode", modes, COMMAND_BUFFERS)):
        if unknown := [c for c in chosen if c not in allowed]:
            parser.error(f"unknown {name} {unknown}; choose from {', '.join(allowed)}")
    files = [f.resolve() for f in args.files] or gpu_test_files()
    records = []
    for tool in tools:
        for mode in modes:
            for path in files:
                r = run_one(tool, mode, path, args.timeout, args.scale)
                records.append(r)
                clean = r["returncode"] == 0 and r["errors"] == 0
                print(
                    f"{'ok  ' if clean else 'FAIL'} {tool:9} buffers {mode:3} {r['file']:40} "
                    f"rc {r['returncode']} errors {r['errors']} ({r['tests']}) {r['seconds']} s",
                    flush=True,
                )
                if args.json:
                    args.json.write_text(json.dumps(records, indent=1) + "\n")
    failed = [r for r in records if not (r["returncode"] == 0 and r["errors"] == 0)]
    print(f"{len(records) - len(failed)} of {len(records)} runs clean")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
