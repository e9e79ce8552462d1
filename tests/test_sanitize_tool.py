"""tools/sanitize.py without a GPU: a stand-in compute-sanitizer on the PATH runs the
target as the real one would and reports one race, so the script's bookkeeping
(one run per test function, the tool's report lines and error count kept in the
record, XLA's flags, runs skipped when an earlier record of their file is clean, the
files heavy on the GPU's memory run one at a time) is checked where CI runs."""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from engram_jax import _native

from ._helpers import load_file, scaled_timeout

REPO = Path(__file__).resolve().parents[1]
TARGET = "tests/test_layer.py"  # two gpu parametrisations of one function; they skip here
# The pytest summary of a clean record without node ids that ran every gpu test of its
# target: such a record covers where it ran as many tests as are collected there now.
RAN_ALL = {"tests": "999 passed"}
FAKE_SANITIZER = """#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in
    --tool|--kernel-name|--print-limit|--report-api-errors|--target-processes) shift 2;;
    *) break;;
  esac
done
echo "========= COMPUTE-SANITIZER"
"$@"; rc=$?
echo "========= Error: Race reported between Write access at 0x10 in engram::FakeKernel"
echo "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"
exit $rc
"""


def sanitize(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "tools/sanitize.py", "--tools", "racecheck", "--command-buffers", "on",
         *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_split_runs_keep_the_tools_reports_and_errors(tmp_path):
    out = tmp_path / "records.json"
    logs = tmp_path / "logs"
    more = "--xla_gpu_force_compilation_parallelism=0"  # XLA's threaded compile back
    proc = sanitize(tmp_path, "--split", "--json", str(out), "--logs", str(logs),
                    f"--xla-flags={more}", TARGET)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the stand-in's race is an error
    (record,) = json.loads(out.read_text())
    assert record["file"] == f"{TARGET}::test_fed_by_lookup_gpu"
    assert record["returncode"] == 0 and record["errors"] == 1
    assert record["reports"] == [
        "========= Error: Race reported between Write access at 0x10 in engram::FakeKernel"
    ]
    assert record["xla_flags"].split() == [
        "--xla_gpu_autotune_level=0", "--xla_gpu_force_compilation_parallelism=1", more
    ]  # fmt: skip
    assert record["last_test"].startswith(f"{TARGET}::test_fed_by_lookup_gpu[")  # pytest -v
    assert record["stack"] == []  # no test ran long enough for a stack dump
    assert "Race reported" in proc.stdout  # the failing line shows the first reports
    (log,) = logs.iterdir()
    assert "RACECHECK SUMMARY" in log.read_text()


def test_every_report_is_printed_and_counted_once(tmp_path):
    """The tool is asked to print up to --print-limit reports a process, and a summary's
    count of those not printed is not added to its errors."""
    sanitize_module = load_sanitize()
    runs = []
    output = ("========= ERROR SUMMARY: 545 errors\n"
              "========= ERROR SUMMARY: 445 errors were not printed. Use --print-limit\n"
              "========= ERROR SUMMARY: 3 errors\n")  # fmt: skip
    children = canned_children(sanitize_module, output, runs)
    record = sanitize_module.run_one("initcheck", "on", TARGET, 5, children=children)
    assert record["errors"] == 548  # two processes' summaries, not the "not printed" line
    sanitize_module.run_one("initcheck", "on", TARGET, 5, children=children, print_limit=7)
    default, seven = (command for command, _ in runs)
    assert default[default.index("--print-limit") + 1] == str(sanitize_module.PRINT_LIMIT)
    assert seven[seven.index("--print-limit") + 1] == "7"
    proc = sanitize(tmp_path, "--print-limit", "0", TARGET)
    assert proc.returncode == 2 and "--print-limit must be >= 1" in proc.stderr


def test_the_allocator_is_the_runs_and_recorded(monkeypatch):
    """--allocator platform sets jax's allocator for the run under the tool; the default
    leaves jax's own (its pool), whatever the caller's environment says."""
    sanitize_module = load_sanitize()
    runs = []
    children = canned_children(sanitize_module, "========= ERROR SUMMARY: 0 errors\n", runs)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    record = sanitize_module.run_one("initcheck", "on", TARGET, 5, children=children)
    assert record["allocator"] == "bfc" and "XLA_PYTHON_CLIENT_ALLOCATOR" not in runs[0][1]
    assert record["native_sources"] == sanitize_module.native_sources()
    record = sanitize_module.run_one(
        "initcheck", "on", TARGET, 5, children=children, allocator="platform"
    )
    assert record["allocator"] == "platform"
    assert runs[1][1]["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"


def test_a_record_names_no_path_of_the_machine(monkeypatch):
    """Records travel between machines: the repository's paths relative to it, a virtual
    environment's under "<venv>", the rest (a system Python's) as printed."""
    sanitize_module = load_sanitize()
    venv = "/opt/some/.venv"
    monkeypatch.setattr(sys, "prefix", venv)
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    output = (f"platform linux -- Python 3.12.3 -- {venv}/bin/python3\nrootdir: {REPO}\n"
              f"  File \"{REPO}/tests/test_layer.py\", line 3\n"
              "  File \"/usr/lib/python3.12/threading.py\", line 9\n"
              "1 passed in 1.00s\n========= ERROR SUMMARY: 0 errors\n")  # fmt: skip
    record = sanitize_module.run_one(
        "memcheck", "on", TARGET, 5, children=canned_children(sanitize_module, output)
    )
    tail = record["tail"]
    assert str(REPO) not in tail and venv not in tail, tail
    assert "-- <venv>/bin/python3" in tail and "rootdir: .\n" in tail
    assert '"tests/test_layer.py", line 3' in tail and "/usr/lib/python3.12/threading.py" in tail
    assert record["tests"] == "1 passed" and record["errors"] == 0


def test_a_clean_record_of_the_file_covers_its_functions(tmp_path):
    earlier = tmp_path / "earlier.json"
    other = "tests/test_sanitize_tool.py"  # this file: a failing record, so split and listed
    earlier.write_text(json.dumps([
        {"tool": "racecheck", "command_buffers": "on", "file": TARGET, "returncode": 0,
         "errors": 0, **RAN_ALL},
        {"tool": "racecheck", "command_buffers": "on", "file": other, "returncode": 1,
         "errors": 3},
    ]))  # fmt: skip
    proc = sanitize(tmp_path, "--split", "--list", "--skip-clean", str(earlier), TARGET, other)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = [line.split()[-1] for line in proc.stdout.splitlines()]
    assert listed == [f"{other}::test_gpu_minimal_programs_read_their_rows"], proc.stdout


def listed_in_process(sanitize_module, monkeypatch, capsys, *argv: str) -> list[str]:
    """The runs ``sanitize.py ARGV`` (with --list) plans, from its main() in this process:
    a run of the script is a process importing jax, seconds each."""
    monkeypatch.setattr(sys, "argv", ["sanitize.py", *argv])
    assert sanitize_module.main() == 0
    return [line.split()[-1] for line in capsys.readouterr().out.splitlines()]


def collect_once(sanitize_module, monkeypatch) -> None:
    """sanitize.py's pytest collections, each once in this test (a collection is a
    pytest process importing jax, seconds each)."""
    collect = functools.cache(
        lambda files, params, real=sanitize_module.gpu_test_nodes: real(list(files), params)
    )
    monkeypatch.setattr(
        sanitize_module, "gpu_test_nodes", lambda files, params=False: collect(tuple(files), params)
    )


def test_clean_parametrisations_cover_their_function_and_file(tmp_path, monkeypatch, capsys):
    """`--split params` runs one parametrisation each; once every one of a function's
    was clean, neither the function nor the file is run again, and one that was not
    keeps both listed. The six plans are listed in this process, the target collected
    once with its parametrisations and once without (a collection is a pytest process
    importing jax: six took 23 s of the suite)."""
    function = f"{TARGET}::test_fed_by_lookup_gpu"
    sanitize_module = load_sanitize()
    collect_once(sanitize_module, monkeypatch)

    def listed(*params_clean: str, split: str | None = None) -> list[str]:
        earlier = tmp_path / "earlier.json"
        earlier.write_text(json.dumps([
            {"tool": "racecheck", "command_buffers": "on", "file": f"{function}[{param}]",
             "returncode": 0, "errors": 0, "tests": "1 passed"}
            for param in params_clean
        ]))  # fmt: skip
        flags = ["--split", split] if split else []
        argv = ["--tools", "racecheck", "--command-buffers", "on", *flags, "--list",
                "--skip-clean", str(earlier), str(REPO / TARGET)]  # fmt: skip
        return listed_in_process(sanitize_module, monkeypatch, capsys, *argv)

    assert listed(split="params") == [f"{function}[pinned]", f"{function}[device]"]
    assert listed("pinned", split="params") == [f"{function}[device]"]
    assert listed("pinned") == [TARGET]
    assert listed("pinned", split="functions") == [function]
    assert listed("pinned", "device") == []
    assert listed("pinned", "device", split="functions") == []


def test_a_clean_record_covers_only_the_tests_it_ran(tmp_path, monkeypatch, capsys):
    """A clean record of a file or function covers a test collected there now only where
    it ran it: by its node ids (`nodes`), or, a record made before records kept them, by
    as many tests as its target holds now; a test added since is run. A run keeps the
    node ids pytest -v announced; a minimal program's run keeps none."""
    function = f"{TARGET}::test_fed_by_lookup_gpu"
    pinned, device = f"{function}[pinned]", f"{function}[device]"
    sanitize_module = load_sanitize()
    collect_once(sanitize_module, monkeypatch)
    earlier = tmp_path / "earlier.json"

    def listed(target: str, split: str | None, **fields) -> list[str]:
        earlier.write_text(json.dumps([{"tool": "racecheck", "command_buffers": "on",
                                         "file": target, "returncode": 0, "errors": 0,
                                         **fields}]))  # fmt: skip
        flags = ["--split", split] if split else []
        argv = ["--tools", "racecheck", "--command-buffers", "on", *flags, "--list",
                "--skip-clean", str(earlier), TARGET]  # fmt: skip
        return listed_in_process(sanitize_module, monkeypatch, capsys, *argv)

    assert listed(TARGET, "params", tests="1 passed, 23 deselected") == [pinned, device]
    assert listed(TARGET, None, tests="1 passed, 23 deselected") == [TARGET]
    assert listed(TARGET, None, tests=None) == [TARGET]  # nothing known of what it ran
    assert listed(TARGET, "params", tests="1 passed, 1 skipped, 23 deselected") == []
    assert listed(function, None, tests="2 passed") == []
    assert listed(TARGET, "params", tests="2 passed", nodes=[pinned]) == [device]
    assert listed(function, "functions", tests="2 passed", nodes=[pinned]) == [function]
    assert listed(TARGET, None, tests="2 passed", nodes=[device, pinned]) == []

    said = f"{pinned} PASSED\n{device} PASSED\n2 passed in 1.00s\n"
    children = canned_children(sanitize_module, said)
    record = sanitize_module.run_one("racecheck", "on", TARGET, 5, children=children)
    assert record["nodes"] == [device, pinned] and record["tests"] == "2 passed"
    minimal = "tools/sanitize_minimal.py::no_library"
    record = sanitize_module.run_one("racecheck", "on", minimal, 5, children=children)
    assert "nodes" not in record


def test_clean_records_of_other_native_sources_are_counted_and_rerun_on_request(tmp_path):
    """A clean record of other native sources than the tree's, or of none (made before
    records kept them: older sources), is skipped and counted, and listed again with
    --rerun-stale; one of these sources is skipped either way. The count of runs that
    rest on such records alone leaves out those whose parts are clean on these
    sources."""
    current = load_sanitize().native_sources()
    files = (TARGET, "tests/test_sanitize_tool.py", "tests/test_lookup.py")
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps([
        {"tool": "racecheck", "command_buffers": "on", "file": file, "returncode": 0,
         "errors": 0, **RAN_ALL, **({"native_sources": sources} if sources else {})}
        for file, sources in zip(files, ("0" * 12, current, None), strict=True)
    ]))  # fmt: skip
    proc = sanitize(tmp_path, "--list", "--skip-clean", str(earlier), *files)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    said = f"clean in {earlier} with other native sources than these ({current}): 2 runs; "
    assert (
        said + "2 of the runs asked for are clean in those alone: not run again "
        "(--rerun-stale runs them)" in proc.stderr
    )
    proc = sanitize(tmp_path, "--list", "--rerun-stale", "--skip-clean", str(earlier), *files)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert said + "2 of the runs asked for are clean in those alone: run again" in proc.stderr
    listed = sorted(line.split()[-1] for line in proc.stdout.splitlines())
    assert listed == sorted([TARGET, "tests/test_lookup.py"]), proc.stdout
    # Split by parametrisation, TARGET's runs are its two parts, clean on these sources:
    # its stale record of the whole file is then no run's only clean one.
    function = f"{TARGET}::test_fed_by_lookup_gpu"
    earlier.write_text(json.dumps([
        {"tool": "racecheck", "command_buffers": "on", "file": target, "returncode": 0,
         "errors": 0, **RAN_ALL, **({"native_sources": current} if "::" in target else {})}
        for target in (TARGET, f"{function}[pinned]", f"{function}[device]")
    ]))  # fmt: skip
    proc = sanitize(
        tmp_path, "--list", "--rerun-stale", "--split", "params", "--skip-clean", str(earlier),
        TARGET,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    assert (
        f"clean in {earlier} with other native sources than these ({current}): 1 runs; "
        "0 of the runs asked for are clean in those alone: none to run again" in proc.stderr
    )
    proc = sanitize(tmp_path, "--list", "--rerun-stale", TARGET)
    assert proc.returncode == 2 and "--rerun-stale goes with --skip-clean" in proc.stderr


def test_the_longest_runs_go_first_and_none_starts_that_would_be_cut(tmp_path, monkeypatch):
    """With --skip-clean's records, the runs that took longest there come first in the
    plan (a cut record's time counts: the run needs more), those never run ahead of
    them; a run that took longer there than is left before the deadline is skipped,
    not started only to be cut, and one that fits is run."""
    function = f"{TARGET}::test_fed_by_lookup_gpu"

    def record(target, seconds, returncode=1, **more):
        return {"tool": "racecheck", "command_buffers": "on", "file": target,
                "returncode": returncode, "errors": 0, "seconds": seconds, **more}  # fmt: skip

    earlier = [record(f"{function}[pinned]", 30.0),
               record(f"{function}[pinned]", 90.0, None, cut="deadline"),
               record(f"{function}[device]", 200.0)]  # fmt: skip
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    proc = sanitize(tmp_path, "--split", "params", "--list", "--skip-clean", str(path), TARGET)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listed = [line.split()[-1] for line in proc.stdout.splitlines()]
    assert listed == [f"{function}[device]", f"{function}[pinned]"], proc.stdout
    assert [line.split()[-3:-1] for line in proc.stdout.splitlines()] == [["200", "s"], ["90", "s"]]
    assert "2 runs, about 5 min one at a time\n" in proc.stderr, proc.stderr

    sanitize_module = load_sanitize()
    runs = [("racecheck", "on", f"{function}[{p}]") for p in ("pinned", "device", "new")]
    estimates = {run: sanitize_module.expected_seconds(run, earlier) for run in runs}
    assert [e and (e.seconds, e.own) for e in estimates.values()] == [
        (90.0, True), (200.0, True), None]  # fmt: skip
    assert sanitize_module.longest_first(runs, estimates) == [runs[2], runs[1], runs[0]]

    started = []
    monkeypatch.setattr(sanitize_module, "run_one", lambda *a, **k: started.append(a[2]) or {
        "returncode": 0, "errors": 0})  # fmt: skip
    args = argparse.Namespace(racecheck_kernels="project", scale=0.1, timeout=600.0,
                              logs=None, xla_flags="", print_limit=1, allocator="bfc",
                              gpus=1)  # fmt: skip
    deadline = time.monotonic() + 120
    records = [sanitize_module.run_in_time(*run, 0, args, deadline, None, estimates)
               for run in runs]  # fmt: skip
    assert started == [runs[0][2], runs[2][2]]
    skipped = records[1]
    assert skipped["skipped"] and skipped["seconds_before"] == 200.0, skipped
    assert 100 < skipped["seconds_left"] <= 120
    assert "(took 200.0 s before;" in sanitize_module.result_line(skipped)


def test_a_run_never_run_is_guessed_from_its_target_under_the_other_tools(monkeypatch):
    """A run with no record of its own takes the median time of its target's records
    under the other tools and modes: it goes in its place in the longest-first order and
    is skipped, its guess recorded, where that is more than is left; a target never run
    under any tool has no estimate."""
    sanitize_module = load_sanitize()
    earlier = [{"tool": tool, "command_buffers": mode, "file": TARGET, "returncode": 0,
                "errors": 0, "seconds": seconds}
               for tool, mode, seconds in (("memcheck", "on", 300.0), ("racecheck", "on", 100.0),
                                           ("racecheck", "off", 140.0))]  # fmt: skip
    guessed = ("synccheck", "off", TARGET)
    estimate = sanitize_module.expected_seconds(guessed, earlier)
    assert (estimate.seconds, estimate.own) == (140.0, False)
    assert sanitize_module.expected_seconds(("memcheck", "on", "tests/other.py"), earlier) is None
    own = ("memcheck", "on", TARGET)
    estimates = {own: sanitize_module.expected_seconds(own, earlier), guessed: estimate}
    assert sanitize_module.longest_first([guessed, own], estimates) == [own, guessed]
    assert [sanitize_module.estimate_column(e) for e in (*estimates.values(), None)] == [
        "300 s", "~140 s", "? s"]  # fmt: skip
    never = ("memcheck", "on", "tests/other.py")
    summary = sanitize_module.plan_summary([own, guessed, never], {**estimates, never: None})
    assert summary == "3 runs, about 7 min one at a time and 1 never run (no estimate)"

    monkeypatch.setattr(sanitize_module, "run_one", lambda *a, **k: pytest.fail("started"))
    args = argparse.Namespace(racecheck_kernels="project", scale=0.1, timeout=600.0,
                              logs=None, xla_flags="", print_limit=1, allocator="bfc",
                              gpus=1)  # fmt: skip
    record = sanitize_module.run_in_time(*guessed, 0, args, time.monotonic() + 60, None, estimates)
    assert record["skipped"] and record["seconds_guessed"] == 140.0, record
    assert "seconds_before" not in record
    assert "(guessed at 140.0 s from its other tools' runs;" in sanitize_module.result_line(record)


def test_a_run_that_ended_early_is_expected_to_take_its_targets_median_at_least():
    """A run whose only records ended early (out of GPU memory after 10 s, no GPU, cut)
    is expected to take the median of its target's full runs, not its 10 s: the deadline
    scheduler would otherwise start it with too little time left. Its own time stands
    where it is the longer, or where one of its records ran through; with no full run
    of its target anywhere, the median of the lower bounds stands in."""
    sanitize_module = load_sanitize()

    def record(tool, seconds, **more):
        return {"tool": tool, "command_buffers": "on", "file": TARGET, "returncode": 0,
                "errors": 0, "seconds": seconds, "tests": "1 passed", **more}  # fmt: skip

    run = ("memcheck", "on", TARGET)
    early = [{"returncode": 1, "tests": "1 failed"}, {"returncode": None, "tests": None},
             {"no_gpu": True, "tests": "1 skipped"},
             {"returncode": 1, "tests": "1 error"}]  # fmt: skip
    full = [record("racecheck", 100.0), record("synccheck", 140.0), record("initcheck", 300.0)]
    for how in early:
        assert sanitize_module.ended_early(record("memcheck", 10.0, **how)), how
        estimate = sanitize_module.expected_seconds(run, [*full, record("memcheck", 10.0, **how)])
        assert (estimate.seconds, estimate.own) == (140.0, False), how
    assert not any(sanitize_module.ended_early(r) for r in full)

    longer = [*full, record("memcheck", 200.0, returncode=None)]
    assert sanitize_module.expected_seconds(run, longer) == (200.0, True)
    through = [*full, record("memcheck", 10.0, returncode=None), record("memcheck", 20.0)]
    assert sanitize_module.expected_seconds(run, through) == (20.0, True)
    bounds = [record("racecheck", 30.0, returncode=None),
              record("synccheck", 50.0, returncode=None),
              record("initcheck", 90.0, no_gpu=True)]  # fmt: skip
    assert sanitize_module.expected_seconds(run, bounds) == (50.0, False)


def test_the_native_sources_digest_follows_each_source_file(tmp_path, monkeypatch):
    """A change to any file under ffi/, a new one, or a change to CMakeLists.txt gives
    another digest; a file beside them does not."""
    sanitize_module = load_sanitize()
    (tmp_path / "ffi" / "kernels").mkdir(parents=True)
    (tmp_path / "ffi" / "kernels" / "a.cuh").write_text("a")
    (tmp_path / "CMakeLists.txt").write_text("project(x)")
    monkeypatch.setattr(sanitize_module, "REPO", tmp_path)
    changes = (
        lambda: None,
        lambda: (tmp_path / "ffi" / "kernels" / "a.cuh").write_text("b"),
        lambda: (tmp_path / "ffi" / "b.h").write_text(""),
        lambda: (tmp_path / "CMakeLists.txt").write_text("project(y)"),
        lambda: (tmp_path / "README.md").write_text("not a source"),
    )
    digests = []
    for change in changes:
        change()
        sanitize_module.native_sources.cache_clear()
        digests.append(sanitize_module.native_sources())
    assert len(set(digests[:4])) == 4 and digests[4] == digests[3], digests


def test_side_by_side_outputs_merge_into_their_base(tmp_path):
    """Each output holds the base's records too: a record counts where it differs from
    the base's, and one that did not finish never replaces one that did."""

    def record(file, returncode, errors=0, **more):
        return {"tool": "memcheck", "command_buffers": "on", "file": file,
                "returncode": returncode, "errors": errors, **more}  # fmt: skip

    base = [record("a", 0), record("b", 0, 3)]
    first = [*base[:1], record("b", 0), record("c", None, None, cut="deadline"), record("e", 0)]
    second = [*base, record("c", 0, 2), record("d", None, None, skipped=True),
              record("e", None, None, cut="deadline")]  # fmt: skip
    paths = []
    for name, records in (("base", base), ("first", first), ("second", second)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(records))
    out = tmp_path / "merged.json"
    proc = sanitize(tmp_path, "--merge", *map(str, paths), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    merged = {r["file"]: r for r in json.loads(out.read_text())}
    assert merged == {"a": base[0], "b": first[1], "c": second[2], "e": first[3]}
    proc = sanitize(tmp_path, "--merge", str(paths[0]), "--json", str(out))
    assert proc.returncode == 2 and "at least one output" in proc.stderr
    proc = sanitize(tmp_path, "--merge", str(paths[0]), str(tmp_path / "none.json"),
                    "--json", str(out))  # fmt: skip
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_minimal_programs_are_targets(monkeypatch, capsys):
    """All of tools/sanitize_minimal.py's programs and the CUDA-only programs' modes, or
    those named, in their order."""
    sanitize_module = load_sanitize()
    programs = functools.cache(sanitize_module.minimal_programs)
    monkeypatch.setattr(sanitize_module, "minimal_programs", programs)

    def listed(*names: str) -> list[str]:
        argv = ["--minimal", "--list", "--tools", "initcheck", "--command-buffers", "on", *names]
        return listed_in_process(sanitize_module, monkeypatch, capsys, *argv)

    targets = listed()
    python = [t for t in targets if t.startswith("tools/sanitize_minimal.py::")]
    assert len(python) == 23 and "tools/sanitize_minimal.py::no_library_loop" in python, targets
    assert targets[23:] == sanitize_module.control_programs()
    assert listed("trainable_step", "no_library_step") == [
        "tools/sanitize_minimal.py::no_library_step",
        "tools/sanitize_minimal.py::trainable_step",
    ]
    with pytest.raises(SystemExit) as exit_info:
        listed("no_library_steps")
    assert exit_info.value.code == 2
    assert "no program ['no_library_steps']" in capsys.readouterr().err
    assert listed("while_copy", "memcpy", "no_library") == [
        "tools/sanitize_minimal.py::no_library",
        "tools/initcheck_graph_copy.cu::while_copy",
        "tools/initcheck_module_copy.cu::memcpy",
    ]
    # And run: the names are programs, not files (the shared-memory check read them as
    # files once, and stopped the run).
    ran = []

    def run_one(tool, mode, target, *rest):
        ran.append(target)
        return {**sanitize_module.run_key(tool, mode, "all", 1.0, target), "returncode": 0,
                "errors": 0, "tests": "", "seconds": 1.0}  # fmt: skip

    monkeypatch.setattr(sanitize_module, "run_one", run_one)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(sys, "argv", ["sanitize.py", "--minimal", "--tools", "initcheck",
                                      "--command-buffers", "on", "no_library_step"])  # fmt: skip
    assert sanitize_module.main() == 0
    assert ran == ["tools/sanitize_minimal.py::no_library_step"]
    assert "1 of 1 runs clean" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name",
    ["no_library_unique", "no_library_unique_small", "no_library_unique_repeat",
     "no_library_unique_scan", "cache_refresh_background", "cache_refresh_inline",
     "trainable_dedup_start", "trainable_recompiles", "no_library_pool_growth",
     "no_library_step", "no_library_callback_step", "trainable_step"],
)  # fmt: skip
def test_self_checked_minimal_programs_on_the_cpu(name, monkeypatch):
    """The programs that check their own rows do on the CPU too (the GPU runs them
    under the tools): exit 0, and 1 when the reference differs."""
    minimal = load_file("sanitize_minimal", REPO / "tools" / "sanitize_minimal.py")
    cpu = jax.devices("cpu")[0]
    with pytest.raises(SystemExit) as exit_info:
        minimal.SELF_CHECKED[name](cpu)
    assert exit_info.value.code == 0
    if name.startswith("no_library_unique"):  # every id, repeats kept: not the distinct ones
        monkeypatch.setattr(minimal.np, "unique", np.sort)
    elif name.startswith("cache_refresh"):
        reference = minimal.testing.lookup_reference
        monkeypatch.setattr(minimal.testing, "lookup_reference",
                            lambda w, s, ids: reference(w, s, ids) * 2)  # fmt: skip
    elif name == "no_library_pool_growth":  # the steps gather the ids unsorted
        monkeypatch.setattr(minimal.jnp, "sort", lambda ids, axis: ids.reshape(-1))
    elif name in ("no_library_step", "no_library_callback_step"):  # inverse shifted by one
        distinct = minimal.distinct

        def shifted(ids):
            unique, inverse = distinct(ids)
            return unique, minimal.jnp.roll(inverse, 1)

        monkeypatch.setattr(minimal, "distinct", shifted)
    else:
        reference = minimal.testing.trainable_lookup_reference
        monkeypatch.setattr(minimal.testing, "trainable_lookup_reference",
                            lambda w, ids: reference(w, ids) + 1)  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        minimal.SELF_CHECKED[name](cpu)
    assert exit_info.value.code == 1


# initcheck's output as the H100 and H200 gave it (host frames cut short): XLA's loop
# counter read by two threads of a fusion in the loop (a report starting on pytest -v's
# line), read by the loop's step of it, and XLA's copy of it; then reads that stay
# errors: by a library kernel, by an XLA fusion in a loop at an address one thread
# reads in two iterations (an element of another kernel's output), by an XLA fusion
# outside a loop, and by two threads of CUB's sort that the library launched in a loop;
# last, a copy source in XLA's graph launch (XLA's), and one with a library frame.
LOOP = "xla::gpu::WhileThunk::ExecuteOnStream(...)"
LAUNCHED_BY_LIBRARY = " [0x177ca3] in _engram_native.cpython-312-x86_64-linux-gnu.so"


def scalar_read(at: str, reader: str, address: str, *frames: str) -> str:
    """initcheck's report of an uninitialised 4-byte read by kernel ``at``: ``reader``
    is "(thread) in block (block)", ``frames`` the host frames kept."""
    return "".join(
        f"========= {line}\n"
        for line in ("Uninitialized __global__ memory read of size 4 bytes",
                     f"    at {at}", f"    by thread {reader}", f"    Address {address}",
                     *(f"        Host Frame: {frame}" for frame in frames))
    )  # fmt: skip


COUNTER, ELEMENT, CUB_BINS = "0x7ff2a140b600", "0x7ff2a1500014", "0x2ad1b89900"
INITCHECK_OUTPUT = (
    "========= COMPUTE-SANITIZER\ntests/test_x.py::test_y "
    + scalar_read("input_broadcast_pad_reduce_select_fusion+0x2d0", "(0,0,0) in block (0,0,0)",
                  COUNTER, LOOP)
    + "=========\x20\n"
    + scalar_read("loop_dynamic_update_slice_fusion_1+0x80", "(1,0,0) in block (0,0,0)",
                  COUNTER, LOOP)
    + scalar_read("loop_add_fusion+0x40", "(0,0,0) in block (0,0,0)", "0x7ff2a140c000", LOOP)
    + """========= Host API memory access error at host access to 0x48f90c0200 of size 4 bytes
=========     Uninitialized access to 0x48f90c0200 on access by cudaMemcpy source
=========         Host Frame: stream_executor::gpu::CudaStream::Memcpy(...)
=========         Host Frame: xla::gpu::DeviceToDeviceCopyThunk::ExecuteOnStream(...)
========= Uninitialized __global__ memory read of size 16 bytes
=========     at engram::UpdateRowsKernel(engram::UpdateParams, unsigned int const*)+0x1a0
=========     Address 0x7ff2a140b600
=========         Host Frame: xla::gpu::WhileThunk::ExecuteOnStream(...)
"""
    + 2 * scalar_read("loop_convert_fusion+0x10", "(5,0,0) in block (2,0,0)", ELEMENT, LOOP)
    + scalar_read("loop_convert_fusion+0x10", "(0,0,0) in block (0,0,0)", "0x7ff2a140d000")
    + "".join(
        scalar_read("atomicAdd(unsigned int *, unsigned int)+0x1e90 in "
                    "device_atomic_functions.hpp:112", f"(0,0,0) in block ({b},0,0)", CUB_BINS,
                    LAUNCHED_BY_LIBRARY, LOOP)
        for b in (8, 9)
    )
    + "".join(
        f"""========= Host API memory access error at host access to 0x7f37 of size 3,072 bytes
=========     Uninitialized access to 0x7f37 on access by cudaMemcpy source
=========         Host Frame: {frame}
=========         Host Frame: stream_executor::gpu::CudaCommandBuffer::LaunchGraph(...)
"""
        for frame in ("stream_executor::gpu::GpuCommandBuffer::Submit(...)", LAUNCHED_BY_LIBRARY)
    )
    + "========= ERROR SUMMARY: 12 errors\n"
)  # fmt: skip


def load_sanitize():
    return load_file("sanitize", REPO / "tools" / "sanitize.py")


def canned_children(sanitize_module, output: str, seen: list | None = None):
    """A stand-in for sanitize.py's Children whose every run prints ``output`` and exits
    0, keeping each run's (command, env) in ``seen``."""

    class Canned(sanitize_module.Children):
        def run(self, command, env, timeout_s):
            if seen is not None:
                seen.append((command, env))
            return output, 0

    return Canned()


def test_xlas_own_initcheck_findings_are_counted_apart():
    sanitize_module = load_sanitize()
    blocks = sanitize_module.report_blocks(INITCHECK_OUTPUT)
    assert len(blocks) == 12 and blocks[0][0].startswith("========= Uninitialized")
    xla = sanitize_module.xla_findings("initcheck", blocks)
    assert xla == [True] * 4 + [False] * 6 + [True, False]
    assert sanitize_module.xla_findings("memcheck", blocks) == [False] * 12  # initcheck's only
    reports = sanitize_module.sanitizer_reports(blocks, xla)
    assert reports[1].endswith("at engram::UpdateRowsKernel(engram::UpdateParams, "
                               "unsigned int const*)+0x1a0")  # fmt: skip
    record = {"returncode": 0, "errors": 12, "xla_errors": 5}
    assert not sanitize_module.is_clean(record)  # the library's read is an error
    assert sanitize_module.is_clean(record | {"errors": 5})
    assert not sanitize_module.is_clean({"returncode": None, "errors": None})


# A run cut short in a test: pytest -v's line for it, faulthandler's dump after it
# (as pytest -o faulthandler_timeout wrote it), then the kill.
CUT_OUTPUT = """========= COMPUTE-SANITIZER
tests/test_update_start.py::test_refusals_before_anything_compiles PASSED [ 40%]
tests/test_update_start.py::test_gpu_handles_across_steps_and_a_dropped_start Timeout (0:07:50)!
Thread 0x00007f0000000001 (most recent call first):
  File "jax/_src/array.py", line 655 in block_until_ready
  File "tests/test_update_start.py", line 281 in test_gpu_handles_across_steps_and_a_dropped_start
  File "/usr/lib/python3/site-packages/_pytest/python.py", line 187 in pytest_pyfunc_call
  File "/usr/lib/python3/site-packages/pluggy/_callers.py", line 103 in _multicall
  File "<frozen runpy>", line 88 in _run_code
"""


def test_a_cut_run_says_which_test_and_where():
    sanitize_module = load_sanitize()
    command = sanitize_module.target_command("tests/test_update_start.py", 500)
    assert "-v" in command and "faulthandler_timeout=470" in command
    assert "-v" not in sanitize_module.target_command("tools/sanitize_minimal.py::scan_device", 9)
    assert sanitize_module.last_test_started(CUT_OUTPUT) == (
        "tests/test_update_start.py::test_gpu_handles_across_steps_and_a_dropped_start"
    )
    assert sanitize_module.stack_dump(CUT_OUTPUT) == [
        "Thread 0x00007f0000000001 (most recent call first):",
        '  File "jax/_src/array.py", line 655 in block_until_ready',
        '  File "tests/test_update_start.py", line 281 in '
        "test_gpu_handles_across_steps_and_a_dropped_start",
    ]
    assert sanitize_module.stack_dump(INITCHECK_OUTPUT) == []
    assert sanitize_module.last_test_started(INITCHECK_OUTPUT) == "tests/test_x.py::test_y"
    assert sanitize_module.last_test_started("========= COMPUTE-SANITIZER\n") is None


def test_a_cut_run_keeps_its_native_stacks():
    """A run past its time has each Python process of its session's native stacks taken
    before it is killed (gdb or py-spy), kept apart from the run's own output."""
    sanitize_module = load_sanitize()
    if not any(shutil.which(name) for name, _ in sanitize_module.NATIVE_STACKERS):
        pytest.skip("neither gdb nor py-spy is on the PATH")
    sleeper = "import time; print('asleep', flush=True); time.sleep(300)"
    start = time.monotonic()
    output, returncode = sanitize_module.Children().run(
        [sys.executable, "-c", sleeper], dict(os.environ), 3
    )
    assert returncode is None and time.monotonic() - start < 120
    assert output.startswith("asleep") and sanitize_module.NATIVE_MARK in output
    stack = sanitize_module.native_stack(output)
    if any("not permitted" in line for line in output.splitlines()):
        pytest.skip("this machine does not let a process be traced by its sibling")
    assert stack[0].startswith(sanitize_module.NATIVE_MARK)
    assert any("sleep" in line or "select" in line for line in stack), stack
    assert sanitize_module.native_stack("no marker here") == []


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_cut_run_ends_its_whole_session(tmp_path, monkeypatch):
    """A run past its time is killed with every process of its session, a child in a
    process group of its own too: a process left running holds the GPU's memory into
    the runs after it."""
    sanitize_module = load_sanitize()
    # No stacks taken: gdb's attaching may end the child itself.
    monkeypatch.setattr(sanitize_module, "native_stacks", lambda session: "")
    pid_file = tmp_path / "pid"
    parent = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
        " process_group=0)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n"
    )
    output, returncode = sanitize_module.Children().run(
        [sys.executable, "-c", parent], dict(os.environ), 5
    )
    assert returncode is None, output
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


def test_a_run_that_saw_no_gpu_is_not_clean():
    """Tests skipped because no GPU was seen (its backend failed to start) checked
    nothing: such a run is recorded `no_gpu` and is not clean, whatever its status."""
    sanitize_module = load_sanitize()
    assert sanitize_module.NO_GPU_SKIP in (REPO / "tests" / "conftest.py").read_text()

    output = (f"SKIPPED [1] {TARGET}:9: {sanitize_module.NO_GPU_SKIP}\n"
              "============ 1 skipped in 2.05s ============\n"
              "========= ERROR SUMMARY: 0 errors\n")  # fmt: skip
    children = canned_children(sanitize_module, output)
    record = sanitize_module.run_one("initcheck", "on", TARGET, 5, children=children)
    assert record["no_gpu"] and record["returncode"] == 0 and record["errors"] == 0
    assert not sanitize_module.is_clean(record)
    assert sanitize_module.is_clean(record | {"no_gpu": False})


def plan_run(sanitize_module, plan, jobs, gpus, per_gpu, per_machine):
    """run_plan over stand-in runs of 50 ms: the order they started in (target, GPU),
    the most going at once, and the most of each group going at once on one GPU."""
    lock = threading.Lock()
    going, started, peak = [], [], {"all": 0}

    def group_of(run):
        return run[2].rstrip("0123456789") if not run[2].startswith("light") else None

    def start(tool, mode, target, gpu):
        with lock:
            going.append((target, gpu))
            started.append((target, gpu))
            peak["all"] = max(peak["all"], len(going))
            for group in ("heavy", "shm"):
                for g in range(gpus):
                    on_gpu = sum(t.startswith(group) and p == g for t, p in going)
                    peak[group] = max(peak.get(group, 0), on_gpu)
            peak["shm anywhere"] = max(peak.get("shm anywhere", 0),
                                       sum(t.startswith("shm") for t, _ in going))  # fmt: skip
        time.sleep(0.05)
        with lock:
            going.remove((target, gpu))
        return {"file": target}

    runs = sanitize_module.run_plan(plan, jobs, gpus, per_gpu, per_machine, group_of, start)
    assert sorted(r["file"] for r in runs) == sorted(t for *_, t in plan)
    return started, peak


def test_a_groups_runs_wait_in_the_plan_not_in_a_worker(tmp_path):
    """run_plan starts at most `jobs` runs at once and a group's at most its limit (on
    one GPU, or on the machine); a run that may not start yet leaves its place to the
    next run that may (heavy files first in the plan, the light ones still start beside
    the first); over several GPUs each run goes where the fewest are going."""
    sanitize_module = load_sanitize()
    heavy = [("memcheck", "on", f"heavy{i}") for i in range(4)]
    light = [("memcheck", "on", f"light{i}") for i in range(3)]
    shm = [("memcheck", "on", f"shm{i}") for i in range(2)]
    started, peak = plan_run(sanitize_module, [*heavy, *light], 3, 1, {"heavy": 1}, {})
    assert peak == {"all": 3, "heavy": 1, "shm": 0, "shm anywhere": 0}
    assert started[:3] == [("heavy0", 0), ("light0", 0), ("light1", 0)]

    started, peak = plan_run(sanitize_module, [*heavy, *shm, *light], 4, 2, {"heavy": 1},
                             {"shm": 1})  # fmt: skip
    assert peak["all"] == 4 and peak["heavy"] == 1 and peak["shm anywhere"] == 1
    assert started[:4] == [("heavy0", 0), ("heavy1", 1), ("shm0", 0), ("light0", 1)]

    assert sanitize_module.HEAVY_FILES <= {
        str(f.relative_to(REPO)) for f in REPO.glob("tests/*.py")
    }
    for flag in ("--heavy-jobs", "--gpus"):
        proc = sanitize(tmp_path, flag, "0", TARGET)
        assert proc.returncode == 2 and f"{flag} must be >= 1" in proc.stderr


def test_a_run_sees_the_gpu_it_was_given(monkeypatch):
    sanitize_module = load_sanitize()
    seen = []
    children = canned_children(sanitize_module, "1 passed in 1.00s\n", seen)
    record = sanitize_module.run_one("memcheck", "on", TARGET, 5, children=children, gpu=3)
    assert seen[0][1]["CUDA_VISIBLE_DEVICES"] == "3" and record["gpu"] == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    record = sanitize_module.run_one("memcheck", "on", TARGET, 5, children=children)
    assert seen[1][1]["CUDA_VISIBLE_DEVICES"] == "1" and "gpu" not in record


def test_update_controls_have_the_updates_result_size():
    """The workspace call of no_library_ffi_step_sized and trainable_step_ffi has the
    result the library's update call of trainable_step has (its size spelled in the
    program, which loads no engram_jax for it)."""
    minimal = load_file("sanitize_minimal", REPO / "tools" / "sanitize_minimal.py")
    size = _native.native.update_result_bytes(minimal.STEP_IDS, minimal.STEP_DIM)
    assert minimal.UPDATE_RESULT_BYTES == size


def test_cuda_only_programs_are_targets_once_per_tool(monkeypatch, capsys):
    """Each mode of each tools/*.cu with a main is a --minimal target, read from its
    kModes table (every entry, each name once over all the programs); it reads no XLA
    flag, so it runs once per tool, under the first command-buffer mode asked, with
    every kernel checked under racecheck too, as the binary nvcc built of its file (each
    file built once, before the runs)."""
    sanitize_module = load_sanitize()
    targets = sanitize_module.control_programs()
    for source in sorted(p for p in (REPO / "tools").glob("*.cu") if "int main(" in p.read_text()):
        text = source.read_text()
        table = text[text.index("kModes[] = {") : text.index("};", text.index("kModes[] = {"))]
        entries = table.count('{"')
        names = [t.split("::")[1] for t in targets if t.startswith(f"tools/{source.name}::")]
        assert entries > 0 and len(names) == entries, (source.name, names)
    names = [t.split("::")[1] for t in targets]
    assert len(set(names)) == len(names) and {"while_copy", "kernel"} <= set(names)
    assert "tools/initcheck_ffi_workspace.cu" not in {t.split("::")[0] for t in targets}

    argv = ["--minimal", "--list", "--tools", "initcheck,racecheck", "--command-buffers", "off,on",
            "while_copy", "no_library"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["sanitize.py", *argv])
    assert sanitize_module.main() == 0
    lines = sorted(line.split() for line in capsys.readouterr().out.splitlines())
    assert [(tool, mode, target) for tool, _, mode, *_, target in lines] == [
        ("initcheck", "off", "tools/initcheck_graph_copy.cu::while_copy"),
        ("initcheck", "off", "tools/sanitize_minimal.py::no_library"),
        ("initcheck", "on", "tools/sanitize_minimal.py::no_library"),
        ("racecheck", "off", "tools/initcheck_graph_copy.cu::while_copy"),
        ("racecheck", "off", "tools/sanitize_minimal.py::no_library"),
        ("racecheck", "on", "tools/sanitize_minimal.py::no_library"),
    ]

    built, ran = [], []

    def run_one(tool, mode, target, timeout_s, scale, kernels, *rest):
        ran.append((tool, target, kernels, sanitize_module.target_command(target, timeout_s)))
        return {**sanitize_module.run_key(tool, mode, kernels, 1.0, target), "returncode": 0,
                "errors": 0, "tests": None, "seconds": 1.0}  # fmt: skip

    monkeypatch.setattr(sanitize_module, "run_one", run_one)
    monkeypatch.setattr(sanitize_module, "build_controls", built.append)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(sys, "argv", ["sanitize.py", *argv[:1], *argv[2:]])
    assert sanitize_module.main() == 0
    assert built == [["tools/initcheck_graph_copy.cu"]]
    binary = str(REPO / "build" / "controls" / "initcheck_graph_copy")
    assert sorted(r for r in ran if r[1].endswith("while_copy")) == [
        ("initcheck", "tools/initcheck_graph_copy.cu::while_copy", "all", [binary, "while_copy"]),
        ("racecheck", "tools/initcheck_graph_copy.cu::while_copy", "all", [binary, "while_copy"]),
    ]
    library_races = {kernels for tool, t, kernels, _ in ran if tool == "racecheck" and ".py" in t}
    assert library_races == {"project"}
    capsys.readouterr()
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "nvcc" else name)
    with pytest.raises(SystemExit) as exit_info:
        sanitize_module.main()
    assert exit_info.value.code == 2 and "nvcc is not on the PATH" in capsys.readouterr().err


FAKE_NVCC = """#!/bin/sh
echo "$@" >> "$NVCC_LOG"
if [ -n "$NVCC_FAIL" ]; then
  case "$*" in *"$NVCC_FAIL"*) echo "nvcc: an error" >&2; exit 1;; esac
fi
while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done
"""


def test_cuda_only_programs_are_built_for_the_gpu_at_hand(tmp_path, monkeypatch):
    """Each program once, with the driver API linked, for this machine's GPU, into the
    binary a run's command names; a program that does not build stops the invocation
    with nvcc's words."""
    sanitize_module = load_sanitize()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvcc").write_text(FAKE_NVCC)
    (bin_dir / "nvcc").chmod(0o755)
    log = tmp_path / "nvcc.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NVCC_LOG", str(log))
    monkeypatch.setattr(sanitize_module, "REPO", tmp_path)
    sources = ["tools/initcheck_graph_copy.cu", "tools/initcheck_module_copy.cu"]
    sanitize_module.build_controls(sources)
    binaries = [tmp_path / "build" / "controls" / Path(source).stem for source in sources]
    assert log.read_text().splitlines() == [
        f"-O2 -arch=native -o {binary} {tmp_path / source} -lcuda"
        for binary, source in zip(binaries, sources, strict=True)
    ]
    assert all(binary.exists() for binary in binaries)
    target = "tools/initcheck_module_copy.cu::memcpy"
    assert sanitize_module.target_command(target, 60) == [str(binaries[1]), "memcpy"]
    monkeypatch.setenv("NVCC_FAIL", "initcheck_module_copy")
    with pytest.raises(SystemExit) as exit_info:
        sanitize_module.build_controls(sources)
    said = str(exit_info.value.code)
    assert "building tools/initcheck_module_copy.cu: nvcc rc 1" in said and "an error" in said


@pytest.mark.parametrize("source", sorted(p.name for p in (REPO / "tools").glob("*.cu")))
def test_the_cuda_only_controls_compile(source, tmp_path):
    """tools/*.cu, the programs without engram_jax that show the tools' own reports, run
    on a GPU machine by `tools/sanitize.py --minimal` (and the shared library by
    tools/sanitize_minimal.py); compiled here (no libcuda needed for an object file), a
    mode added between sittings cannot reach the machine broken."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    command = [nvcc, "-c", "-O2", "-arch=sm_90", f"-I{jax.ffi.include_dir()}",
               "-o", str(tmp_path / "control.o"), str(REPO / "tools" / source)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=scaled_timeout(120))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name",
    ["start_done_pinned", "scan_device", "no_library", "no_library_loop", "no_library_unique",
     "no_library_unique_small", "no_library_unique_repeat", "no_library_unique_scan",
     "no_library_thread_copies", "no_library_pool_growth", "cache_refresh_background",
     "cache_refresh_inline", "trainable_dedup_start", "trainable_recompiles",
     "no_library_step", "no_library_callback_step", "no_library_ffi_step",
     "no_library_ffi_step_sized", "trainable_step", "trainable_step_ffi"],
)  # fmt: skip
def test_gpu_minimal_programs_read_their_rows(name):
    proc = subprocess.run(
        [sys.executable, "tools/sanitize_minimal.py", name],
        cwd=REPO, capture_output=True, text=True, timeout=scaled_timeout(300),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
