"""Run the GPU tests under NVIDIA's compute-sanitizer: every tool (memcheck,
racecheck, synccheck, initcheck) over every test file that has `gpu` tests,
with XLA's command buffers on (its default) and off, and print one line per run.

    python tools/sanitize.py                                 # everything (long)
    python tools/sanitize.py --tools memcheck --command-buffers on tests/test_prefetch.py
    python tools/sanitize.py --json tools/sanitize.json
    python tools/sanitize.py --scale 1 tests/test_prefetch_safety.py   # the soak's full 1,000 steps
    python tools/sanitize.py --probe        # XLA's dropped executables, the profiler (plain jnp)
    python tools/sanitize.py --list         # the runs it would do, one a line
    python tools/sanitize.py --jobs 4 --deadline 540 --skip-clean tools/sanitize.json \
        --json tools/sanitize.json
    python tools/sanitize.py --tools racecheck --racecheck-kernels all tests/test_lookup.py
    python tools/sanitize.py --tools initcheck --print-limit 1000 tests/test_training.py
    python tools/sanitize.py --split --logs sanitize-logs tests/test_prefetch.py
    python tools/sanitize.py --split params --tools memcheck tests/test_prefetch_safety.py
    python tools/sanitize.py --minimal --tools memcheck   # the async lookup's minimal programs
    python tools/sanitize.py --minimal --tools initcheck no_library_step trainable_step
    python tools/sanitize.py --minimal --tools initcheck while_copy while_body   # CUDA alone
    python tools/sanitize.py --merge tools/sanitize.json a.json b.json --json tools/sanitize.json

The --jobs/--deadline/--skip-clean line splits the whole matrix over sessions of
ten minutes: each runs four at a time (of them the files heavy on the GPU's memory,
HEAVY_FILES, one at a time a GPU: --heavy-jobs; --gpus N spreads the runs over N
GPUs), starts nothing after 540 s and cuts what is still going then, and skips what
an earlier session found clean, keeping those records in the file. The runs that took
longest in the file's records start first, and a run that took longer there than is
left is not started (`"seconds_before"` in its skipped record); a run with no record
is guessed at the median time of its target's runs under the other tools and modes
(`"seconds_guessed"`). Invocations run side by side from one --skip-clean file,
each with a --json of its own, go back into it with --merge. Runs cut by the
deadline are recorded with `"cut": "deadline"`, runs not started with
`"skipped": true`; neither is clean. Each record keeps a digest
of the native sources it ran (`native_sources`); a clean record of other sources is
still skipped unless --rerun-stale, and stderr counts those records and the runs asked
for that are clean in them alone (the runs --rerun-stale adds).
Files that do not finish under a tool within one sitting (test_prefetch_safety.py's
soak took 200-440 s a command-buffer mode under memcheck and synccheck,
test_cache.py ran past 370 s under racecheck and initcheck, beside other runs) go
with `--split`: one run per gpu test function, each recorded under its node id, or
with `--split params` one per parametrisation (the soak: a worker process per mode).
A clean record of the whole file covers its functions, a function's its
parametrisations, and clean records of all of a file's (or a function's) parts cover
it, each only for the tests it ran: a record keeps their node ids (`nodes`), and one
made before records kept them covers its target only where it ran as many tests as
are collected there now (records of tools/sanitize.json made so were given the node
ids collected from the tests of the commit that first held them, where as many were
collected as they ran: `nodes_inferred` names that commit). Each record keeps the
tool's report lines (`reports`: which kernel, which access); `--logs DIR` keeps
every run's whole output. XLA's GEMM autotuning is off in every run. A run cut by
its timeout has the native stacks of its Python processes taken (gdb, or py-spy,
where either is on the PATH) before it is killed: in its log, and the main threads
first in the record's `native_stack`.

Needs a GPU machine with compute-sanitizer on the PATH and the CUDA build of
engram_jax (`pip install --no-build-isolation -e .`). API errors are not
reported (`--report-api-errors no`): cuda-python's driver bindings probe symbols
with cuGetProcAddress, which fails by design for names the driver lacks, once
per probe; kernel accesses, races, barriers and uninitialised reads are what is
checked. Child processes are followed (the command-buffer workers of
test_prefetch.py run in their own process). racecheck checks only the
library's own kernels unless `--racecheck-kernels all`; the other tools check every
kernel. Each process prints up to `--print-limit` reports (100,000), so that every
one can be told XLA's or the library's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# XLA_FLAGS per command-buffer mode: on is XLA's default.
COMMAND_BUFFERS = {"on": "", "off": "--xla_gpu_enable_command_buffer="}
# XLA's GEMM autotuner compiles and times dozens of candidate kernels per GEMM shape;
# the tools instrument every one, and under memcheck a test file with a model in it
# (test_nnx.py's one test, test_benchmarks.py's) ran past 400 s without finishing.
# The library's kernels are the same whichever GEMM XLA picks.
NO_AUTOTUNE = "--xla_gpu_autotune_level=0"
# XLA's compile on one thread. Under memcheck, compiles of programs holding a trainable
# table's lookup_start hung in XLA's threaded compile (the main thread waiting for its
# thunks in CompileModuleToLlvmIr): every run of two test functions (4 each), both
# processes of a six-compile probe, once in two runs of a third function. With this
# flag the probe's six compiles (kept as tools/sanitize_minimal.py's
# trainable_recompiles) and test_trainable_order.py's GPU test ran clean, one run each
# (H100). A later --xla-flags=--xla_gpu_force_compilation_parallelism=0 gives XLA's
# default back.
SERIAL_COMPILE = "--xla_gpu_force_compilation_parallelism=1"
ALLOCATORS = ("bfc", "platform")  # XLA_PYTHON_CLIENT_ALLOCATOR: unset, "platform"
SANITIZER = ("compute-sanitizer", "--tool")
# racecheck looks for shared-memory hazards within a kernel, so only the library's own
# kernels need it: XLA's and cuBLAS's are not ours, and under racecheck they make one
# test file run past any sensible timeout. Every kernel of the library is in C++
# namespace engram, so its mangled name holds "engram"; CUB's radix sort, which
# ffi/kernels/dedup.cuh calls, is NVIDIA's and is left out with them.
# initcheck checks every kernel: it does not see what a kernel it leaves out writes, so
# with `--kernel-name kns=engram` it reported the library's kernels reading CUB's
# sorted keys, and copies of XLA's outputs, uninitialised: 882,962 reports over
# test_training.py where every kernel checked gave about 67,000 (H100).
KERNEL_FILTERS = {"project": ("--kernel-name", "kns=engram"), "all": ()}
# memcheck, synccheck and initcheck sum up in an ERROR SUMMARY; racecheck only in its own
# line ("RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)"). Past the print
# limit a second ERROR SUMMARY line says how many of them were not printed: not more.
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?\s*$|RACECHECK SUMMARY: .*?\((\d+) error", re.M)
# Reports each process prints (compute-sanitizer's default is 100): a run is clean only
# when none of its reports is the library's, which takes every report printed.
PRINT_LIMIT = 100_000
# tests/conftest.py's reason for skipping a gpu test where no GPU is seen.
NO_GPU_SKIP = "needs a CUDA GPU and engram_jax built with CUDA"
PYTEST_LINE = re.compile(r"^=*\s*(\d+ (passed|failed|error|skipped).*) in [\d.]+s", re.M)
# pytest -v prints a test's node id as the test starts, its outcome when it ends.
TEST_STARTED = re.compile(r"^(tests/\S+\.py::\S+)", re.M)
# pytest's summary's counts of tests run ("3 passed, 1 skipped, 40 deselected").
TESTS_COUNTED = re.compile(r"(\d+) (?:passed|failed|skipped|errors?|xfailed|xpassed)\b")
# The stack dump comes this long before a run's timeout (or its share of the deadline).
STACK_DUMP_LEAD_S = 30
STACK_NOISE = ("/_pytest/", "/pluggy/", "<frozen ")
# faulthandler's first line of a timed dump: "Timeout (0:07:50)!", fractions optional.
STACK_DUMP = re.compile(r"Timeout \(\d+:\d\d:\d\d(\.\d+)?\)!")

# A cut run's Python processes' native stacks, taken before it is killed, by the first
# of these found on the PATH. faulthandler's Python stack put four memcheck runs of the
# training tests inside XLA's compile (backend_compile_and_load) for 8 minutes, and
# says nothing of where below that.
NATIVE_STACKERS = (
    ("py-spy", ("py-spy", "dump", "--native", "--pid")),
    ("gdb", ("gdb", "-batch", "-nx", "-ex", "thread apply all bt 40", "-p")),
)
NATIVE_MARK = "==== native stacks of pid "
NATIVE_STACK_S = 30  # per process; a run cut by --deadline may end this much later

# tool, command-buffer mode, target: a test file relative to the repository, or with
# --split one of its test functions ("tests/test_x.py::test_y", every parametrisation).
Run = tuple[str, str, str]
# The tool's own lines start with this; the banner and the summary are not reports.
REPORT_PREFIX = "========= "
REPORT_START = re.compile(r"(?<!=)========= ")  # pytest's banners hold longer runs of "="
REPORT_NOISE = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY")
MAX_REPORT_LINES = 200
MINIMAL = "tools/sanitize_minimal.py"  # --minimal's programs
# --minimal's programs in CUDA alone, no XLA and no engram_jax: the tools/*.cu with a main,
# each of whose modes (a `{"name", [] {` line of its kModes table) is a target
# ("tools/initcheck_graph_copy.cu::while_copy"). They show what the tools report of
# CUDA's own graphs and copies (initcheck's false reports among them), so they are
# built with nvcc for the GPU at hand, into CONTROLS_BUILD, and read no XLA flag: each
# runs once per tool, under the first command-buffer mode asked.
CONTROL_MODE = re.compile(r'^\s*\{"(\w+)", \[\] \{', re.M)
CONTROLS_BUILD = Path("build") / "controls"
NATIVE_SOURCES = ("ffi", "CMakeLists.txt")  # what _engram_native is built from
# Test files whose runs take much of the GPU's memory under a tool: test_examples.py's
# medium serving model (34 GB in one memcheck run; its float32 speculation run asks XLA's
# pool for 1.97 GiB at once: refused with the pool capped at 0.18 of an 80 GB GPU), the
# training benchmark's model, test_prefetch_safety.py's soak workers. Five such runs at
# a time took 71 of an H100's 80 GB and ran out (backends that failed to start,
# allocations refused), as did thirteen runs with some of them among them. They go
# --heavy-jobs at a time (default 1), beside the other runs. test_train_example.py is
# not among them: its processes (the tests' and the example's) held at most 2.9 GB each
# in one sitting's nineteen runs under all four tools, three at a time (nvidia-smi every
# 5 s, H100).
HEAVY_FILES = frozenset({
    "tests/test_examples.py", "tests/test_prefetch_safety.py", "tests/test_train_benchmark.py",
})  # fmt: skip


def gpu_test_files() -> list[Path]:
    """The test files with at least one `gpu`-marked test."""
    return sorted(p for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())


@functools.cache
def native_sources() -> str:
    """A digest of what the native module is built from (NATIVE_SOURCES), kept in each
    record: the records know which code they ran, so that a clean one of other sources
    can be told apart (--rerun-stale)."""
    digest = hashlib.sha256()
    for top in NATIVE_SOURCES:
        path = REPO / top
        for f in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
            digest.update(f"{f.relative_to(REPO)}\0".encode() + f.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def of_these_sources(record: dict) -> bool:
    """Whether a record ran the native sources here. Records made before they were kept
    carry none: they ran sources older than the first digest, so not these."""
    return record.get("native_sources") == native_sources()


def run_key(tool: str, mode: str, kernels: str, scale: float, target: str) -> dict:
    """The fields that say which run a record is, run or skipped."""
    return {"tool": tool, "command_buffers": mode, "kernels": kernels, "scale": scale,
            "file": target}  # fmt: skip


def run_of(record: dict) -> Run:
    return record["tool"], record["command_buffers"], record["file"]


def file_of(target: str) -> str:
    return target.split("::", 1)[0]


def program_of(target: str) -> str:
    """A minimal program's name ("tools/x.cu::while_copy" -> "while_copy")."""
    return target.split("::", 1)[1]


def function_of(target: str) -> str:
    """A node id without its parameters ("tests/test_x.py::test_y[a]" -> "...::test_y")."""
    return target.split("[", 1)[0]


def minimal_programs() -> list[str]:
    """tools/sanitize_minimal.py's programs as targets ("tools/sanitize_minimal.py::NAME")."""
    proc = subprocess.run(
        [sys.executable, MINIMAL, "--names"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [f"{MINIMAL}::{name}" for name in proc.stdout.split()]


def control_programs() -> list[str]:
    """The modes of the CUDA-only programs (CONTROL_MODE) as targets, file by file."""
    texts = {p: p.read_text() for p in sorted((REPO / "tools").glob("*.cu"))}
    return [f"{p.relative_to(REPO)}::{mode}" for p, text in texts.items() if "int main(" in text
            for mode in CONTROL_MODE.findall(text)]  # fmt: skip


def is_control(target: str) -> bool:
    return file_of(target).endswith(".cu")


def control_binary(source: str) -> Path:
    return REPO / CONTROLS_BUILD / Path(source).stem


def build_controls(sources: list[str]) -> None:
    """Each CUDA-only program, with nvcc, for the GPU of this machine (-arch=native);
    SystemExit with nvcc's words when one does not build."""
    (REPO / CONTROLS_BUILD).mkdir(parents=True, exist_ok=True)
    for source in sources:
        command = ["nvcc", "-O2", "-arch=native", "-o", str(control_binary(source)),
                   str(REPO / source), "-lcuda"]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"building {source}: nvcc rc {proc.returncode}\n"
                             f"{proc.stdout}{proc.stderr}")  # fmt: skip


def target_command(target: str, timeout_s: float) -> list[str]:
    """What runs under the tool: a minimal program, or pytest's gpu tests of the target,
    verbose (each test's node id is printed as it starts) and with every thread's Python
    stack dumped when one test runs for nearly the whole run's time, so that a run cut
    short says which test it was in and where (racecheck over test_update_start.py with
    command buffers off was cut at 488 s with only the tool's banner in its log)."""
    if file_of(target) == MINIMAL:
        return [sys.executable, MINIMAL, program_of(target)]
    if is_control(target):
        return [str(control_binary(file_of(target))), program_of(target)]
    dump_after = max(1, int(timeout_s - STACK_DUMP_LEAD_S))
    return [sys.executable, "-m", "pytest", "-v", "-m", "gpu", "-p", "no:cacheprovider",
            "-o", f"faulthandler_timeout={dump_after}", target]  # fmt: skip


def session_members(session: int, pythons_only: bool = False) -> list[int]:
    """The live processes of session ``session`` (a run's target and its children), or
    only its Python ones; not its zombies, dead and waiting to be reaped."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parens.
            comm = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            live = fields[0] != "Z"
            if (
                live
                and int(fields[3]) == session
                and (comm.startswith("python") or not pythons_only)
            ):
                pids.append(int(stat.parent.name))
    return sorted(pids)


def native_stacks(session: int) -> str:
    """Every thread's native stack in each Python process of ``session``, each under a
    NATIVE_MARK line; empty where neither stacker is on the PATH."""
    found = [(name, command) for name, command in NATIVE_STACKERS if shutil.which(name)]
    if not found:
        return ""
    name, command = found[0]
    parts = []
    for pid in session_members(session, pythons_only=True):
        try:
            proc = subprocess.run([*command, str(pid)], capture_output=True, text=True,
                                  timeout=NATIVE_STACK_S)  # fmt: skip
            text = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired:
            text = f"{name} took over {NATIVE_STACK_S} s"
        parts.append(f"{NATIVE_MARK}{pid} ({name}) ====\n{text}")
    return "\n".join(parts)


def native_stack(output: str) -> list[str]:
    """The native stack dumps at the end of a cut run's output (native_stacks), frames
    and thread lines only, at most MAX_REPORT_LINES."""
    at = output.find(NATIVE_MARK)
    if at < 0:
        return []
    # Per process, its header, then each thread's line and frames; gdb lists threads
    # newest first, so the main thread ("Thread 1 ") moves to the front.
    kept: list[str] = []
    for dump in output[at:].split(NATIVE_MARK)[1:]:
        lines = dump.splitlines()
        threads: list[list[str]] = []
        for line in lines[1:]:
            if line.startswith("Thread "):
                threads.append([line.rstrip()])
            elif threads and line.startswith(("#", "    ")):
                threads[-1].append(line.rstrip())
        threads.sort(key=lambda thread: not thread[0].startswith("Thread 1 "))
        kept += [NATIVE_MARK + lines[0], *(line for thread in threads for line in thread)]
    return kept[:MAX_REPORT_LINES]


def machine_free(output: str) -> str:
    """``output`` without the paths of the machine it ran on, for records that travel
    between machines: paths relative to the repository (its root "."), and a virtual
    environment's (pytest's header, the stacks) under "<venv>". A system Python's paths
    (/usr/lib/python3.12) say nothing of the machine and stay."""
    output = output.replace(f"{REPO}/", "").replace(str(REPO), ".")
    if sys.prefix != sys.base_prefix:
        output = output.replace(sys.prefix, "<venv>")
    return output


def stack_dump(output: str) -> list[str]:
    """The last Python stack dump's threads and frames (faulthandler's, see
    target_command), without pytest's and pluggy's own frames."""
    dumps = list(STACK_DUMP.finditer(output))
    if not dumps:
        return []
    lines = output[dumps[-1].end() :].splitlines()[1:]
    kept = [
        line for line in lines
        if line.startswith(("Thread ", "Current thread "))
        or (line.startswith('  File "') and not any(n in line for n in STACK_NOISE))
    ]  # fmt: skip
    return kept[:MAX_REPORT_LINES]


def last_test_started(output: str) -> str | None:
    """The node id of the last test pytest -v announced: in a run cut short, the one
    it was in (or had just finished)."""
    started = TEST_STARTED.findall(output)
    return started[-1] if started else None


def gpu_test_nodes(files: list[str], params: bool = False) -> list[str]:
    """Each file's `gpu` test functions as pytest node ids without their parameters (a
    node id so written runs all of them), or with them (``params``: one node id per
    parametrisation): runs small enough to finish under a tool where a whole file
    does not within one sitting (test_prefetch_safety.py's soak, one worker process
    per command-buffer mode, took 200-440 s a mode under memcheck and synccheck)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
         "-p", "no:cacheprovider", *files],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    nodes = [line if params else function_of(line) for line in proc.stdout.splitlines()
             if "::" in line]  # fmt: skip
    if proc.returncode != 0 or not nodes:
        raise SystemExit(f"collecting {files}: pytest rc {proc.returncode}\n{proc.stdout[-2000:]}")
    return list(dict.fromkeys(nodes))


def is_test(target: str) -> bool:
    """A target of pytest's (a test file, function or node id), not a minimal program."""
    return target.startswith("tests/")


def tests_counted(record: dict) -> int | None:
    """How many tests pytest ran in a record's run (its summary, less the deselected)."""
    counts = TESTS_COUNTED.findall(record.get("tests") or "")
    return sum(int(count) for count in counts) if counts else None


def ran_all_of(record: dict, target: str) -> bool:
    """Whether a clean record of ``target``, its function or its file ran every gpu test
    collected under ``target`` now, not only those there were when it ran: its `nodes`,
    or for a record made before records kept them, as many tests as its own target
    holds now (test_cache.py's file records ran 16 where there are 22 now). A minimal
    program's record is a run of that program."""
    if not is_test(record["file"]):
        return True
    if "nodes" in record:
        return set(nodes_under(target)) <= set(record["nodes"])
    counted = tests_counted(record)
    return counted is not None and counted >= len(nodes_under(record["file"]))


def covered(run: Run, clean: dict[Run, dict]) -> bool:
    """Whether ``run`` is done by the clean runs: its own, its function's or its file's,
    each of which ran every test under it (ran_all_of)."""
    tool, mode, target = run
    return any(
        (record := clean.get((tool, mode, t))) is not None and ran_all_of(record, target)
        for t in dict.fromkeys((target, function_of(target), file_of(target)))
    )


def covered_by_parts(run: Run, clean: dict[Run, dict]) -> bool:
    """Whether every gpu test under ``run``'s file or function was clean in runs of its
    own parts (functions, parametrisations): collected only where such records are."""
    tool, mode, target = run
    parts = (f"{target}::", f"{target}[")
    if not any(t == tool and m == mode and x.startswith(parts) for t, m, x in clean):
        return False
    return all(covered((tool, mode, n), clean) for n in nodes_under(target))


# Each test file's gpu node ids with their parameters, collected once per invocation.
COLLECTED: dict[str, tuple[str, ...]] = {}


def collect_nodes(files: list[str]) -> None:
    """The gpu node ids of those of ``files`` not yet in COLLECTED, in one pytest process
    (each is a process importing jax: all the gpu files at once took 15 s on 2 cores)."""
    if missing := [f for f in dict.fromkeys(files) if f not in COLLECTED]:
        nodes = gpu_test_nodes(missing, params=True)
        COLLECTED.update({f: tuple(n for n in nodes if file_of(n) == f) for f in missing})


def nodes_under(target: str) -> list[str]:
    """The gpu node ids, with their parameters, that ``target`` (a file, a function or
    a node id) runs."""
    collect_nodes([file_of(target)])
    return [n for n in COLLECTED[file_of(target)] if target in (file_of(n), function_of(n), n)]


def sanitizer_reports(blocks: list[list[str]], xla: list[bool]) -> list[str]:
    """The lines of the tool's reports ``blocks`` (which kernel, which access, where),
    those not XLA's own (``xla``, xla_findings) first, the first MAX_REPORT_LINES of
    them: a record's tail keeps only pytest's last words."""
    ordered = sorted(zip(xla, blocks, strict=True), key=lambda pair: pair[0])  # stable
    return [line for _, block in ordered for line in block][:MAX_REPORT_LINES]


# initcheck's findings in XLA's own while loops, none in the library. XLA keeps a loop's
# initial counter as an initialised global of the module it loads and copies it into
# the loop's buffer (its DeviceToDeviceCopyThunk, whose source is reported); initcheck
# does not carry a module global's value through a copy (tools/initcheck_module_copy.cu:
# CUDA alone), so every read of the counter by a fusion inside the loop, each thread's
# and each iteration's, is reported too. tools/sanitize_minimal.py's `no_library*`
# programs, plain jnp, show them (`--minimal --tools initcheck`: no_library_unique_scan
# 545 reports, all at one address). A record counts them apart (`xla_errors`) and is
# clean without them.
XLA_COPY = re.compile(r"Host Frame: xla::gpu::DeviceToDeviceCopyThunk::ExecuteOnStream")
# initcheck and copies inside XLA's command buffers (CUDA graphs): a graph's memcpy node
# whose source a kernel node of the same graph wrote just before is reported an
# uninitialised copy source at the graph's launch when XLA placed that buffer among
# bytes a custom call's larger result took before the graph, which nothing wrote.
# tools/sanitize_minimal.py's no_library_ffi_step_sized (plain jnp and a one-kernel
# custom call, no engram_jax) gives test_training.py's step test's 96 reports so, with
# command buffers on, and none off; the rows are right. In CUDA alone,
# tools/initcheck_graph_copy.cu while_copy (a memcpy node in a while node's body
# copying what the body's kernel wrote) gets the same report, the copy right. Only XLA
# copies inside its graphs (the library's handlers that XLA captures copy nothing), as
# XLA_COPY's thunk makes the same copies outside one: such a report is XLA's when the
# graph's launch is in its frames and no frame is the library's. Reads by kernels stay
# checked.
GRAPH_COPY_SOURCE = "on access by cudaMemcpy source"
GRAPH_LAUNCH = re.compile(r"Host Frame: stream_executor::gpu::CudaCommandBuffer::LaunchGraph")
SCALAR_READ = "Uninitialized __global__ memory read of size 4 bytes"
LIBRARY_FRAME = "in _engram_native"  # a host frame in the library's extension module
IN_XLA_LOOP = re.compile(r"Host Frame: xla::gpu::WhileThunk::ExecuteOnStream")
KERNEL_AT = re.compile(r"^=+\s+at (\S+?)(\(|\+0x)")
ADDRESS = re.compile(r"^=+\s+Address (0x[0-9a-f]+)")
READER = re.compile(r"^=+\s+by (thread \(\d+,\d+,\d+\) in block \(\d+,\d+,\d+\))")
COUNTER_STEP = re.compile(r"loop_add_fusion(_\d+)?$")  # counter + 1, in one thread


def report_blocks(output: str) -> list[list[str]]:
    """The tool's reports, one list of lines each: a report's first line is the
    tool's prefix and then text, its other lines the prefix and an indent."""
    blocks: list[list[str]] = []
    for line in output.splitlines():
        # A report may start after pytest -v's node id, on the test's own line.
        found = REPORT_START.search(line)
        if found is None or not line[found.end() :].strip() or any(n in line for n in REPORT_NOISE):
            continue  # the tool's blank lines between reports too
        line = line[found.start() :]
        if not line[len(REPORT_PREFIX) :].startswith(" ") or not blocks:
            blocks.append([])
        blocks[-1].append(line)
    return blocks


def first_match(pattern: re.Pattern, block: list[str]) -> str | None:
    found = next((m for m in map(pattern.search, block) if m), None)
    return found.group(1) if found else None


def xla_loop_read(block: list[str]) -> str | None:
    """The address of a 4-byte read by one of XLA's kernels inside an XLA while loop,
    else None: not by a kernel of the library's (in namespace engram), nor by one the
    library launched (CUB's sort, whose host frames pass through the library)."""
    kernel = first_match(KERNEL_AT, block)
    if SCALAR_READ not in block[0] or kernel is None or kernel.startswith("engram::"):
        return None
    if any(LIBRARY_FRAME in line for line in block):
        return None
    return first_match(ADDRESS, block) if any(map(IN_XLA_LOOP.search, block)) else None


def xla_graph_copy(block: list[str]) -> bool:
    """Whether a report is a copy source in XLA's graph launch (GRAPH_COPY_SOURCE)."""
    return (
        any(GRAPH_COPY_SOURCE in line for line in block)
        and any(map(GRAPH_LAUNCH.search, block))
        and not any(LIBRARY_FRAME in line for line in block)
    )


def xla_findings(tool: str, blocks: list[list[str]]) -> list[bool]:
    """Per report, whether it is XLA's own (see XLA_COPY, GRAPH_COPY_SOURCE): its copy of
    a loop's counter, a copy in its graph's launch, or a read of a loop's counter: a
    loop read at an address that other threads read too (a scalar every thread reads,
    where a kernel reading another kernel's output reads each element by one thread,
    in each iteration the same one), or by the one thread of the loop's own step of it."""
    if tool != "initcheck":
        return [False] * len(blocks)
    loop_reads = [xla_loop_read(block) for block in blocks]
    readers: dict[str, set[str | None]] = {}
    for block, address in zip(blocks, loop_reads, strict=True):
        if address is not None:
            readers.setdefault(address, set()).add(first_match(READER, block))
    return [
        any(map(XLA_COPY.search, block))
        or xla_graph_copy(block)
        or (address is not None and len(readers[address]) > 1)
        or (address is not None and bool(COUNTER_STEP.match(first_match(KERNEL_AT, block) or "")))
        for block, address in zip(blocks, loop_reads, strict=True)
    ]


def is_clean(record: dict) -> bool:
    errors = record.get("errors")
    return (
        record.get("returncode") == 0
        and not record.get("no_gpu")
        and errors is not None
        and errors - record.get("xla_errors", 0) == 0
    )


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


# No engram_jax in it either: a jitted matmul under the jax profiler, its GPU kernels
# counted as benchmarks/_common.stream_summary finds them. On an H100 it counted 1
# plainly and 0 under memcheck, where the training benchmark's profiles had no GPU
# stream either (why the profiler sees nothing under the tool is not looked into), so
# tests run by this script expect none (ENGRAM_SANITIZER is set in their environment).
PROFILE_PROBE = """
import pathlib, tempfile, jax, jax.numpy as jnp
from jax.profiler import ProfileData
f = jax.jit(lambda a: a @ a)
x = jnp.ones((1024, 1024))
f(x).block_until_ready()
with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
        f(x).block_until_ready()
    data = ProfileData.from_file(str(sorted(pathlib.Path(tmp).rglob("*.xplane.pb"))[-1]))
    kernels = sum(len(list(line.events)) for plane in data.planes
                  if plane.name.startswith("/device:GPU")
                  for line in plane.lines if line.name.startswith("Stream"))
print("GPU kernels in the profile:", kernels)
"""
# Each probe and the line of its output that answers it.
PROBES = {"dropped executables": (EXECUTABLES_PROBE, "still alive"),
          "profile": (PROFILE_PROBE, "GPU kernels")}  # fmt: skip


def probe(timeout_s: float) -> int:
    """Each probe plainly and under memcheck; prints what each says."""
    for name, (code, answer) in PROBES.items():
        for label, prefix in (
            ("plain", []),
            ("memcheck", [*SANITIZER, "memcheck", "--report-api-errors", "no"]),
        ):
            proc = subprocess.run(
                [*prefix, sys.executable, "-c", code],
                capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip
            said = [line for line in proc.stdout.splitlines() if answer in line]
            print(f"{name}, {label:9} rc {proc.returncode}: "
                  f"{said[-1] if said else proc.stderr[-500:]}", flush=True)  # fmt: skip
    return 0


class Children:
    """The sanitizer processes running now, each the leader of a session of its own,
    so that a run cut short ends with its target and the workers the target spawned,
    which would otherwise hold the GPU into the runs after it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen] = set()
        self.stopped = False

    def run(self, command: list[str], env: dict, timeout_s: float) -> tuple[str, int | None]:
        """Output and exit status; None for the status when it ran past timeout_s."""
        with self.lock:
            if self.stopped:
                return "", None
            proc = subprocess.Popen(
                command, cwd=REPO, env=env, text=True, start_new_session=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )  # fmt: skip
            self.live.add(proc)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
            return output, proc.returncode
        except subprocess.TimeoutExpired:
            stacks = native_stacks(proc.pid)  # the session's id is its leader's pid
            self.end(proc)
            try:
                output, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired as exc:  # something outside the group holds the pipe
                partial = exc.stdout or b""  # bytes whatever text= says
                output = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
            return f"{output}\n{stacks}" if stacks else output, None
        finally:
            with self.lock:
                self.live.discard(proc)

    def stop(self) -> None:
        """End every run and start no more; ^C and SIGTERM do not reach their sessions."""
        with self.lock:
            self.stopped = True
            for proc in self.live:
                self.end(proc)

    @staticmethod
    def end(proc: subprocess.Popen) -> None:
        """Kill every process of the run's session, not only its leader's process
        group, which misses a child that made a group of its own: one left running
        would hold GPU memory into the runs after it."""
        for _ in range(10):  # a process may start one more as it is killed
            members = session_members(proc.pid)
            if not members:
                return
            for pid in members:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)


def run_one(
    tool: str,
    mode: str,
    target: str,
    timeout_s: float,
    scale: float = 1.0,
    kernels: str = "all",
    children: Children | None = None,
    logs: Path | None = None,
    extra_xla_flags: str = "",
    print_limit: int = PRINT_LIMIT,
    allocator: str = "bfc",
    gpu: int | None = None,
) -> dict:
    # ENGRAM_TEST_SCALE: the fuzzed and soak GPU tests' examples and steps, and their
    # subprocesses' timeouts, over it (tests/_helpers.py: scaled, scaled_timeout);
    # ENGRAM_SANITIZER: the tool, under which a profile has no GPU kernels (PROFILE_PROBE).
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", ENGRAM_TEST_SCALE=str(scale),
               ENGRAM_SANITIZER=tool)  # fmt: skip
    xla_flags = " ".join(
        f for f in (COMMAND_BUFFERS[mode], NO_AUTOTUNE, SERIAL_COMPILE, extra_xla_flags) if f
    )
    env["XLA_FLAGS"] = xla_flags
    env.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
    if allocator == "platform":
        env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    if gpu is not None:  # --gpus: the one GPU this run sees
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    command = [
        *SANITIZER,
        tool,
        *KERNEL_FILTERS[kernels],
        "--print-limit",
        str(print_limit),
        "--report-api-errors",
        "no",
        "--target-processes",
        "all",
        *target_command(target, timeout_s),
    ]
    start = time.monotonic()
    # A TMPDIR of its own: pytest's tmp_path and the tests' and jax's temporary files
    # stay apart from those of the runs alongside it.
    with tempfile.TemporaryDirectory(prefix="sanitize-", ignore_cleanup_errors=True) as tmp:
        env["TMPDIR"] = tmp
        output, returncode = (children or Children()).run(command, env, timeout_s)
    output = machine_free(output)
    if logs is not None:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", target)
        (logs / f"{tool}-{mode}-{slug}.log").write_text(output)
    own = output.split(NATIVE_MARK, 1)[0]  # the run's output, less native_stacks'
    errors = [int(a or b) for a, b in SUMMARY.findall(own)]
    tests = PYTEST_LINE.findall(own)
    blocks = report_blocks(own)  # parsed once: a run may print 100,000 reports
    xla = xla_findings(tool, blocks)
    return {
        **run_key(tool, mode, kernels, scale, target),
        "xla_flags": xla_flags,
        "allocator": allocator,
        "native_sources": native_sources(),
        **({} if gpu is None else {"gpu": gpu}),
        "returncode": returncode,  # None: timed out; 139: the sanitizer itself crashed
        "errors": sum(errors) if errors else None,
        "xla_errors": sum(xla),  # of `errors`, XLA's own (xla_findings)
        "tests": tests[-1][0] if tests else None,
        # The gpu tests skipped for want of a GPU (the backend failed to start: the GPU's
        # memory was taken): nothing was checked.
        "no_gpu": NO_GPU_SKIP in own,
        "seconds": round(time.monotonic() - start, 1),
        "last_test": last_test_started(own),  # in a cut run: the test it was in
        # The tests it ran (started; a clean run ended them all): what it covers (ran_all_of).
        **({"nodes": sorted(set(TEST_STARTED.findall(own)))} if is_test(target) else {}),
        "stack": stack_dump(own),  # where that test was, when it ran that long
        "native_stack": native_stack(output),  # and below Python, when it was cut
        "reports": sanitizer_reports(blocks, xla),
        "tail": own[-3000:],
    }


class Estimate(NamedTuple):
    seconds: float
    own: bool  # from the run's own records; else from its target's under other tools or modes


def ended_early(record: dict) -> bool:
    """A run that stopped before its tests ran through: cut (no return code), a test
    failed (out of GPU memory beside the other runs, say) or the GPU was not to be had.
    Its time is only a lower bound on what the run needs."""
    tests = record.get("tests") or ""
    return (record.get("returncode") is None or bool(record.get("no_gpu"))
            or "failed" in tests or "error" in tests)  # fmt: skip


def expected_seconds(run: Run, earlier: list[dict]) -> Estimate | None:
    """How long ``run`` took before: the longest of its earlier records. A run whose
    records all ended early (ended_early: a cut run, an out-of-memory failure after ten
    seconds) takes at least the median of its target's full records under the other
    tools and modes (of its lower bounds where none ran through), as does a run never
    run, so that a file's new runs neither crowd out the short ones nor start with too
    little time left; None when the target has never run."""
    own = [r for r in earlier if run_of(r) == run and r.get("seconds")]
    longest = max((r["seconds"] for r in own), default=0.0)
    if any(not ended_early(r) for r in own):
        return Estimate(longest, own=True)
    others = [r for r in earlier if r.get("file") == run[2] and r.get("seconds")]
    others = [r for r in others if not ended_early(r)] or others  # else the lower bounds
    if not own and not others:
        return None
    median = statistics.median(r["seconds"] for r in others)  # others holds own's records
    return Estimate(longest, own=True) if longest >= median else Estimate(median, own=False)


def longest_first(plan: list[Run], estimates: dict[Run, Estimate | None]) -> list[Run]:
    """The plan with the runs that took (or likely take) longest first, those with no
    estimate ahead of them: under a deadline the long runs start while there is time
    for them, and the short ones fill the places left."""
    return sorted(plan, key=lambda run: -(e.seconds if (e := estimates.get(run)) else math.inf))


def estimate_column(estimate: Estimate | None) -> str:
    """A run's expected time in --list: its own records' ("412 s"), guessed from its
    target's other runs ("~412 s"), or unknown ("? s")."""
    if estimate is None:
        return "? s"
    return f"{'' if estimate.own else '~'}{estimate.seconds:.0f} s"


def plan_summary(plan: list[Run], estimates: dict[Run, Estimate | None]) -> str:
    """The plan's size and expected time one run at a time, to divide among sittings
    on a GPU machine (--jobs runs at once shorten it, as far as the GPU's memory
    allows)."""
    known = [e.seconds for run in plan if (e := estimates.get(run))]
    unknown = len(plan) - len(known)
    return (f"{len(plan)} runs, about {sum(known) / 60:.0f} min one at a time"
            + (f" and {unknown} never run (no estimate)" if unknown else ""))  # fmt: skip


def run_in_time(
    tool: str,
    mode: str,
    target: str,
    gpu: int,
    args: argparse.Namespace,
    deadline: float,
    children: Children,
    estimates: dict[Run, Estimate | None] | None = None,
) -> dict:
    """run_one on GPU ``gpu`` (of --gpus; all the machine's with one) within what is
    left before the deadline (time.monotonic()), or a skipped record when nothing is,
    or when the run took (or likely takes) longer (``estimates``) than is left: it would
    be cut."""
    # A CUDA-only program has no kernel of the library's: racecheck checks all of its.
    kernels = args.racecheck_kernels if tool == "racecheck" and not is_control(target) else "all"
    left = deadline - time.monotonic()
    estimate = (estimates or {}).get((tool, mode, target))
    if left <= 0 or (estimate is not None and estimate.seconds > left):
        # With time left, only an estimate skips a run: the record says which and how long.
        late = {} if left <= 0 else {
            "seconds_before" if estimate.own else "seconds_guessed": estimate.seconds,
            "seconds_left": round(left, 1),
        }  # fmt: skip
        return {
            **run_key(tool, mode, kernels, args.scale, target),
            "skipped": True,
            "returncode": None,
            "errors": None,
            **late,
        }
    record = run_one(
        tool, mode, target, min(args.timeout, left), args.scale, kernels, children, args.logs,
        args.xla_flags, args.print_limit, args.allocator, gpu if args.gpus > 1 else None,
    )  # fmt: skip
    if record["returncode"] is None and left < args.timeout:
        record["cut"] = "deadline"  # not a hang: it was given less than --timeout
    return record


def run_label(tool: str, mode: str) -> str:
    """A run's tool and command-buffer mode as the result lines and --list align them."""
    return f"{tool:9} buffers {mode:3}"


def result_line(r: dict) -> str:
    where = f"{run_label(r['tool'], r['command_buffers'])} {r['file']:40}"
    if r.get("skipped"):
        if "seconds_before" in r:
            estimate = f"took {r['seconds_before']} s before"
        elif "seconds_guessed" in r:
            estimate = f"guessed at {r['seconds_guessed']} s from its other tools' runs"
        else:
            return f"skip {where} (the deadline had passed)"
        return f"skip {where} ({estimate}; {r['seconds_left']} s left)"
    verdict = "ok  " if is_clean(r) else "cut " if r.get("cut") else "FAIL"
    xla = f", {r['xla_errors']} of them XLA's" if r.get("xla_errors") else ""
    line = (
        f"{verdict} {where} rc {r['returncode']} errors {r['errors']}{xla} ({r['tests']}) "
        f"{r['seconds']} s"
    )
    if r["returncode"] is None and r.get("last_test"):
        line += f"\n     in {r['last_test']}"
    if verdict == "FAIL" and r.get("reports"):
        line += "".join(f"\n     {report}" for report in r["reports"][:4])
    return line


def read_records(path: Path) -> list[dict]:
    """An earlier --json output; none when the file is not there yet, so that every
    session of a split matrix can be started with the same command."""
    if not path.exists():
        print(f"no {path} yet: nothing to skip", flush=True)
        return []
    records = json.loads(path.read_text())
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path} is not a list of run records")
    return records


def merge_records(base: list[dict], outputs: list[list[dict]]) -> dict[Run, dict]:
    """``base`` (the --skip-clean file several invocations started from) with what each
    of their --json ``outputs`` added. Each output holds the base's records too, so a
    record counts only where it differs from the base's (a later output's copy of the
    base does not undo an earlier output's new record); one that did not finish (cut,
    timed out, skipped) does not replace one that did."""
    merged = {run_of(r): r for r in base}
    before = dict(merged)
    for records in outputs:
        for r in records:
            run = run_of(r)
            if r == before.get(run) or r.get("skipped"):
                continue
            if r["returncode"] is None and merged.get(run, {}).get("returncode") is not None:
                continue
            merged[run] = r
    return merged


def write_records(path: Path, records: dict[Run, dict]) -> None:
    # Beside it and then renamed over it: a session ended mid-write leaves the last
    # whole file, with the earlier sessions' clean records in it.
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps([records[k] for k in sorted(records)], indent=1) + "\n")
    os.replace(part, path)


def run_plan(
    plan: list[Run],
    jobs: int,
    gpus: int,
    per_gpu: dict[str, int],
    per_machine: dict[str, int],
    group_of: Callable[[Run], str | None],
    start: Callable[..., dict],
) -> Iterator[dict]:
    """Each run's record as it ends (``start(tool, mode, target, gpu)``), ``jobs`` runs
    at a time spread over ``gpus`` GPUs (each run on the one with the fewest going), a
    group's runs (``group_of``: a key of ``per_gpu`` or ``per_machine``, or None) at most
    its limit at a time on one GPU, or on the machine. A run that may not start yet
    waits in the plan, not in a worker: the next run that may start takes the place,
    where a lock taken inside a worker would keep the place idle while it waits."""
    pending = list(plan)
    going: dict[Future, tuple[str | None, int]] = {}  # the run's group and GPU

    def place(run: Run) -> int | None:
        """The GPU ``run`` may start on now, or None."""
        group = group_of(run)
        placed = list(going.values())
        if group in per_machine and [g for g, _ in placed].count(group) >= per_machine[group]:
            return None
        free = [gpu for gpu in range(gpus)
                if group not in per_gpu or placed.count((group, gpu)) < per_gpu[group]]  # fmt: skip
        return min(free, key=lambda gpu: [p for _, p in placed].count(gpu), default=None)

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        while pending or going:
            while len(going) < jobs:
                startable = ((run, gpu) for run in pending if (gpu := place(run)) is not None)
                run, gpu = next(startable, (None, None))
                if run is None:
                    break
                pending.remove(run)
                going[pool.submit(start, *run, gpu)] = (group_of(run), gpu)
            finished, _ = wait(going, return_when=FIRST_COMPLETED)
            for future in finished:
                del going[future]
                yield future.result()
    finally:
        pool.shutdown(wait=not going, cancel_futures=True)


def main() -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "files",
        nargs="*",
        type=Path,
        help="test files (default: every gpu one), or with "
        "--minimal the programs' names (default: all)",
    )
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated tools")
    parser.add_argument(
        "--command-buffers", default="on,off", help="comma-separated modes: on (default), off"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default="bfc",
        help="jax's GPU memory allocator for the runs: bfc (its default, a pool) or "
        "platform (a cudaMalloc and cudaFree a buffer); each record keeps it",
    )
    parser.add_argument(
        "--xla-flags",
        default="",
        help="more XLA flags for every run, after the command-buffer mode's, the "
        "autotuner's and the one-thread compile's (a later flag wins: "
        "--xla-flags=--xla_gpu_force_compilation_parallelism=0 compiles on XLA's threads "
        "again), given as --xla-flags=...; each record keeps its flags (`xla_flags`)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=0.1,
        help="examples of the fuzzed GPU tests and steps of the soak, times this (the tools "
        "slow a GPU test tens of times)",
    )
    parser.add_argument(
        "--racecheck-kernels",
        choices=tuple(KERNEL_FILTERS),
        default="project",
        help="the kernels racecheck checks: the library's own (default) or all (XLA's, "
        "cuBLAS's: far slower); the other tools check all",
    )
    parser.add_argument(
        "--print-limit",
        type=int,
        default=PRINT_LIMIT,
        help=f"reports each process prints (default {PRINT_LIMIT:,}); a run with more is not "
        "clean, its reports not all classified",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at once, over all --gpus (default 1)"
    )
    parser.add_argument(
        "--heavy-jobs",
        type=int,
        default=1,
        help="of those, runs of the files that take much of the GPU's memory at once on "
        "one GPU (default 1: " + ", ".join(sorted(Path(f).name for f in HEAVY_FILES)) + ")",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="spread the runs over GPUs 0 .. N-1, each run seeing one (CUDA_VISIBLE_DEVICES, "
        "kept in its record as `gpu`); default 1: every run sees what the environment shows",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        help="seconds for the whole invocation: runs not started by then are skipped, runs "
        "going then are cut; a run that took longer in --skip-clean's records than is left "
        "is skipped too",
    )
    parser.add_argument("--json", type=Path, help="write every run's record here")
    parser.add_argument(
        "--logs", type=Path, metavar="DIR", help="write each run's whole output to a file here"
    )
    parser.add_argument(
        "--minimal",
        action="store_true",
        help=f"run {MINIMAL}'s programs (one jitted start and done, the pipelined scan, "
        "the same scan without the library) and the modes of the CUDA-only tools/*.cu "
        "(built with nvcc) instead of test files: those named in place of the files, or all",
    )
    parser.add_argument(
        "--split",
        nargs="?",
        const="functions",
        choices=("functions", "params"),
        help="one run per gpu test function instead of per file, or with `--split params` "
        "one per parametrisation (each file collected first; a file clean in --skip-clean "
        "is not split)",
    )
    parser.add_argument(
        "--skip-clean",
        type=Path,
        metavar="FILE.json",
        help="skip the runs clean in this earlier --json output, and keep its records in --json",
    )
    parser.add_argument(
        "--rerun-stale",
        action="store_true",
        help="with --skip-clean: run again the runs clean there with other native sources "
        "(ffi/, CMakeLists.txt) than the tree's; without it they are skipped and counted",
    )
    parser.add_argument(
        "--list", action="store_true", help="only: print the runs it would do, one a line"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="FILE.json",
        help="only: merge the --json outputs of invocations run side by side from the same "
        "--skip-clean file (given first) into --json",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="only: do dropped executables get freed, does the jax profiler see the GPU's "
        "kernels: plain and under memcheck",
    )
    args = parser.parse_args()
    if args.merge:
        if args.json is None or len(args.merge) < 2:
            parser.error("--merge takes the base file and at least one output, and --json")
        if missing := [str(path) for path in args.merge if not path.exists()]:
            parser.error(f"--merge: no such file {missing}")
        base, *outputs = (read_records(path) for path in args.merge)
        write_records(args.json, merge_records(base, outputs))
        return 0
    if args.probe:
        if shutil.which("compute-sanitizer") is None:
            parser.error("compute-sanitizer is not on the PATH (it ships with the CUDA toolkit)")
        return probe(args.timeout)
    if not args.scale > 0:
        parser.error("--scale must be > 0")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if args.heavy_jobs < 1:
        parser.error("--heavy-jobs must be >= 1")
    if args.gpus < 1:
        parser.error("--gpus must be >= 1")
    if args.print_limit < 1:
        parser.error("--print-limit must be >= 1")
    if args.deadline is not None and not args.deadline > 0:
        parser.error("--deadline must be > 0")
    if args.rerun_stale and args.skip_clean is None:
        parser.error("--rerun-stale goes with --skip-clean")
    tools = args.tools.split(",")
    modes = args.command_buffers.split(",")
    for name, chosen, allowed in (("tool", tools, TOOLS), ("mode", modes, COMMAND_BUFFERS)):
        if unknown := [c for c in chosen if c not in allowed]:
            parser.error(f"unknown {name} {unknown}; choose from {', '.join(allowed)}")
    try:
        earlier = read_records(args.skip_clean) if args.skip_clean else []
        clean_before = {run_of(r): r for r in earlier if is_clean(r)}
        stale = {run for run, r in clean_before.items() if not of_these_sources(r)}
        records = {run_of(r): r for r in earlier}
    except (ValueError, KeyError) as exc:  # json's errors are ValueErrors
        parser.error(f"--skip-clean: {exc!r}")
    if args.minimal:  # the files named are then the programs' names; all when none is
        programs = minimal_programs() + control_programs()
        names = [str(f) for f in args.files]
        known = {program_of(t) for t in programs}
        if unknown := [n for n in names if n not in known]:
            parser.error(f"--minimal: no program {unknown} in {MINIMAL} or tools/*.cu")
        targets = [t for t in programs if not names or program_of(t) in names]
    else:
        files = [str(f.resolve().relative_to(REPO)) for f in args.files] or [
            str(f.relative_to(REPO)) for f in gpu_test_files()
        ]
        targets = gpu_test_nodes(files, params=args.split == "params") if args.split else files
    matrix = [(tool, mode, target) for tool in tools for mode in modes for target in targets
              if not is_control(target) or mode == modes[0]]  # fmt: skip

    # A run is done when it, its function or its file was clean before, or all of its
    # functions or parametrisations were, each in a run of its own.
    def done_in(run: Run, clean: dict[Run, dict]) -> bool:
        return covered(run, clean) or covered_by_parts(run, clean)

    if args.split == "params" and not args.minimal:  # the targets are every node already
        COLLECTED.update({f: tuple(t for t in targets if file_of(t) == f) for f in files})
    if clean_before:
        collect_nodes([file_of(t) for t in targets if is_test(t)])
    fresh = {run: r for run, r in clean_before.items() if run not in stale}
    to_run = [r for r in matrix if not done_in(r, fresh)]
    # Counted over the runs asked for: a stale record of a whole file says nothing of a
    # plan split by parametrisation whose parts are clean on these sources.
    clean_in_stale_alone = {r for r in to_run if done_in(r, clean_before)}
    plan = to_run if args.rerun_stale else [r for r in to_run if r not in clean_in_stale_alone]
    if stale:  # on stderr: --list's stdout is the plan alone
        alone = len(clean_in_stale_alone)
        action = "run again" if args.rerun_stale else "not run again (--rerun-stale runs them)"
        print(f"clean in {args.skip_clean} with other native sources than these "
              f"({native_sources()}): {len(stale)} runs; {alone} of the runs asked for "
              f"are clean in those alone: {action if alone else 'none to run again'}",
              file=sys.stderr, flush=True)  # fmt: skip
    estimates = {run: expected_seconds(run, earlier) for run in plan}
    plan = longest_first(plan, estimates)
    if args.list:
        for run in plan:
            tool, mode, target = run
            print(f"{run_label(tool, mode)} {estimate_column(estimates[run]):>7} {target}")
        print(plan_summary(plan, estimates), file=sys.stderr)
        return 0
    if shutil.which("compute-sanitizer") is None:
        parser.error("compute-sanitizer is not on the PATH (it ships with the CUDA toolkit)")
    if controls := sorted({file_of(target) for _, _, target in plan if is_control(target)}):
        if shutil.which("nvcc") is None:
            parser.error("nvcc is not on the PATH: it builds the CUDA-only programs")
        build_controls(controls)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    if len(plan) < len(matrix):
        print(f"{len(matrix) - len(plan)} runs clean in {args.skip_clean}: not run again")

    deadline = math.inf if args.deadline is None else started + args.deadline
    children = Children()
    # Tests that count every shared table file in /dev/shm (tests/test_shared_tables.py,
    # tests/test_storage.py), not only their own, would see, and unlink, those of another
    # such run: those runs go one at a time.
    planned = {file_of(target) for target in targets}
    shm_users = {f for f in planned if "SHM_DIR" in (REPO / f).read_text()}

    def group_of(run: Run) -> str | None:
        file = file_of(run[2])
        return "shm" if file in shm_users else "heavy" if file in HEAVY_FILES else None

    per_gpu, per_machine = {"heavy": args.heavy_jobs}, {"shm": 1}
    done: list[dict] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        start = functools.partial(
            run_in_time, args=args, deadline=deadline, children=children, estimates=estimates
        )
        for r in run_plan(plan, args.jobs, args.gpus, per_gpu, per_machine, group_of, start):
            done.append(r)
            print(result_line(r), flush=True)
            # A run skipped now leaves an earlier record of it (a failure) as it was.
            if not (r.get("skipped") and run_of(r) in records):
                records[run_of(r)] = r
            if args.json:
                write_records(args.json, records)
    except BaseException:
        children.stop()
        raise
    clean = sum(is_clean(r) for r in done)
    not_run = sum(bool(r.get("skipped")) for r in done)
    print(f"{clean} of {len(done)} runs clean" + (f", {not_run} not run" if not_run else ""))
    return 0 if clean == len(done) else 1


if __name__ == "__main__":
    sys.exit(main())
