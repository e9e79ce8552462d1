"""Run the GPU tests under NVIDIA's compute-sanitizer: every tool (memcheck,
racecheck, synccheck, initcheck) over every test file that has `gpu` tests,
with XLA's command buffers on (its default) and off, and print one line per run.

    python tools/sanitize.py                                 # everything (long)
    python tools/sanitize.py --tools memcheck --command-buffers on tests/test_prefetch.py
    python tools/sanitize.py --json sanitize.json

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
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
PYTEST_LINE = re.compile(r"^=*\s*(\d+ (passed|failed|error|skipped).*) in [\d.]+s", re.M)


def gpu_test_files() -> list[Path]:
    """The test files with at least one `gpu`-marked test."""
    return sorted(p for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


def run_one(tool: str, mode: str, path: Path, timeout_s: float) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["XLA_FLAGS"] = COMMAND_BUFFERS[mode]
    command = [
        "compute-sanitizer",
        "--tool",
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
    parser.add_argument("--json", type=Path, help="write every run's record here")
    args = parser.parse_args()
    if shutil.which("compute-sanitizer") is None:
        parser.error("compute-sanitizer is not on the PATH (it ships with the CUDA toolkit)")
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
                r = run_one(tool, mode, path, args.timeout)
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
