"""benchmarks/train.py on the CPU: its --smoke runs whole (every variant's rows
checked, the ratios recorded), its rows check failing on updates that are
wrong (another learning rate, a missing call, no update at all), the example
model's part (--parts model) and --profile. The smoke runs start as the file
does and run beside its other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from benchmarks import _common
from benchmarks import train as bench

from ._helpers import Background, scaled_timeout, under_sanitizer

ROOT = Path(__file__).resolve().parents[1]

# The model part's variants with the updates on the side stream (the grids' on a GPU).
SIDES = {"prefetch_exact_side", "prefetch_exact_split_side", "prefetch_stale_side"}
GRIDS = {"prefetch_stale_side_32", "prefetch_stale_side_32_token", "prefetch_stale_side_128"}


def _run(tmp_path, *flags, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    result = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "train.py", *flags, "--name", tmp_path / "train"],
        capture_output=True,
        text=True,
        timeout=scaled_timeout(timeout),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    name = "train_smoke.json" if "--smoke" in flags else "train.json"
    return result, json.loads((tmp_path / name).read_text())


SMOKE_TESTS = {"test_smoke_run_whole", "test_model_part_smoke", "test_profile_on_the_cpu"}


@pytest.fixture(scope="module", autouse=True)
def smoke_jobs(request, tmp_path_factory):
    """The two smoke runs the docstring of benchmarks/train.py gives, --smoke (its
    default parts, the updates and the proxy step) and --smoke --parts model, both
    profiled: started as the file begins, side by side (see _helpers.Background),
    while its other tests run."""
    background = Background(request)
    # The model part's compiles take the longest: first.
    for name, flags in (
        ("model", ["--parts", "model"]),
        ("updates_step", ["--parts", "updates", "step", "--log2-batches", "10"]),
    ):
        out = tmp_path_factory.mktemp(f"train_bench_{name}")
        background.start(name, SMOKE_TESTS, _run, out, "--smoke", *flags, "--profile")
    yield background
    background.close()


@pytest.fixture(scope="module")
def smoke_run(smoke_jobs):
    """Both smoke runs as one: the stdout of each, their records in the order of
    --parts updates step model."""
    (first, payload), (second, model) = (smoke_jobs.result(n) for n in ("updates_step", "model"))
    assert {"command", "machine"} <= set(model)
    for each in (first, second):
        assert "each equal to its reference" in each.stdout
    result = subprocess.CompletedProcess(
        [first.args, second.args], 0, first.stdout + second.stdout, first.stderr + second.stderr
    )
    return result, dict(payload, records=payload["records"] + model["records"])


@pytest.mark.parametrize("name", ["row_adagrad", "lazy_adam"])
def test_rows_check_tells_wrong_updates(name, monkeypatch):
    optim = bench.Optim(name, 0.002)
    num_rows = int(optim.gib * 2**30) // bench.ROW_BYTES
    lib = bench.Library(optim, num_rows, "cpu", jax.devices("cpu")[0])
    sample = np.arange(100, 100 + bench.SAMPLE_ROWS)
    known = bench.known_sample_state(optim, 0)
    rng = np.random.default_rng(0)
    batches = [bench.make_ids(rng, "zipf", 2048, num_rows, sample) for _ in range(8)]
    on_device = [jax.device_put(b) for b in batches]
    grads = [bench.grad_values(ids, k) for k, ids in enumerate(on_device)]
    try:
        compiled = lib.compile(on_device[0], grads[0])
        _, checks = bench.time_updates(
            lib, on_device, grads, batches, sample, 100, known, 1, compiled
        )
        assert checks[0]["ok"], checks
        got = lib.read(sample)
        # The same calls in one dispatch, rolled or unrolled, leave the same rows.
        stack, grads_stack = jax.numpy.stack(on_device), jax.numpy.stack(grads)
        for unroll in (False, True):
            _, checks = bench.time_updates(
                lib, on_device, grads, batches, sample, 100, known, 1,
                all_at_once=(lib.compile_all(stack, grads_stack, unroll), stack, grads_stack),
            )  # fmt: skip
            assert checks[0]["ok"], checks
            np.testing.assert_array_equal(lib.read(sample).view(np.uint16), got.view(np.uint16))
        # Gradients given to the wrong batches are seen.
        _, checks = bench.time_updates(
            lib, on_device, grads[::-1], batches, sample, 100, known, 1, compiled
        )
        assert not checks[0]["ok"], checks
        calls = list(range(8))
        assert not bench.check_pass(optim, got, *known, batches[:-1], calls[:-1], sample)["ok"]
        assert not bench.check_pass(optim, known[0], *known, batches, calls, sample)["ok"]
        monkeypatch.setattr(bench, "LR", 2 * bench.LR)
        assert not bench.check_pass(optim, got, *known, batches, calls, sample)["ok"]
    finally:
        lib.close()


def test_rawupdate_records_and_failures(tmp_path):
    """The kernel's JSON lines become records (its own rows check carried over); a
    kernel that fails or was never built leaves records that say why."""
    fake = tmp_path / "rawupdate"
    fake.write_text(
        "#!/bin/sh\n"
        'for n in $(echo "$RAWUPDATE_ROWS" | tr , " "); do\n'
        '  echo "{\\"what\\": \\"update_sorted\\", \\"rows\\": $n, \\"row_stride\\": '
        '$RAWUPDATE_STRIDE, \\"ms\\": 1.0, \\"mrows_per_s\\": 2.5, \\"gb_per_s_each_way\\": 1.0, '
        '\\"rows_compared\\": $n, \\"rows_mismatched\\": 0}"\n'
        "done\n"
    )
    fake.chmod(0o755)
    got = bench.run_rawupdate(fake, 1 << 20, 528, [100, 200])
    assert [r["rawupdate_rows"] for r in got] == [100, 200]
    assert all(r["rows_checked"] is True and r["mrows_per_s"] == 2.5 for r in got)
    # Both kernels run; the faster one's figure is the ceiling, each kept beside it.
    fake.write_text(
        "#!/bin/sh\n"
        'speed=2.5; [ "$RAWUPDATE_KERNEL" = warp ] && speed=4.0\n'
        'echo "{\\"what\\": \\"update_sorted\\", \\"kernel\\": \\"$RAWUPDATE_KERNEL\\", '
        '\\"rows\\": 7, \\"ms\\": 1.0, \\"mrows_per_s\\": $speed, \\"gb_per_s_each_way\\": 1.0, '
        '\\"rows_compared\\": 7, \\"rows_mismatched\\": 0}"\n'
    )
    (got,) = bench.run_rawupdate(fake, 1 << 20, 528, [7])
    assert got["mrows_per_s"] == 4.0 and got["rawupdate_kernel"] == "warp"
    assert got["mrows_per_s_by_kernel"] == {"flat": 2.5, "warp": 4.0}
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'no GPU' >&2\nexit 1\n")
    failing.chmod(0o755)
    for exe in (failing, "not built: no nvcc"):
        got = bench.run_rawupdate(exe, 1 << 20, 528, [100])
        assert got[0]["rows_checked"] is None and "mrows_per_s" not in got[0]
    assert "no GPU" in bench.run_rawupdate(failing, 1 << 20, 528, [1])[0]["rows_check"]


def test_ceiling_is_the_higher_of_before_and_after():
    """A cell's ceiling is the faster of the rawupdate runs before and after its
    optimizer's cells, both kept in its record, their row checks merged; with no run
    the lookup of the same rows stands in. (The GPU path: the CPU smoke run has no
    rawupdate.)"""

    def ceiling(speed, mismatched=0):
        return {"variant": "ceiling_rawupdate", "mrows_per_s": speed, "ms_per_call": 1.0,
                "rows_checked": mismatched == 0, "rows_checksums": 7,
                "rows_mismatched": mismatched}  # fmt: skip

    cell = {"optimizer": "sgd", "ids": "zipf", "batch": 1 << 10}
    host = dict(cell, variant="library_host", mrows_per_s=3.0)
    lookup = dict(cell, variant="lookup_of_the_rows", mrows_per_s=6.0)
    records = {"library_host": dict(host), "lookup_of_the_rows": dict(lookup)}
    out = bench.cell_with_ratios(cell, records, ceiling(2.0), ceiling(4.0, mismatched=1))
    (got,) = [r for r in out if r["variant"] == "ceiling_rawupdate"]
    assert got["mrows_per_s"] == 4.0 and got["optimizer"] == "sgd"
    assert (got["mrows_per_s_before"], got["mrows_per_s_after"]) == (2.0, 4.0)
    assert got["rows_checked"] is False and got["rows_mismatched"] == 1
    assert got["rows_checksums"] == 14
    (lib,) = [r for r in out if r["variant"] == "library_host"]
    assert lib["vs_ceiling"] == 0.75 and lib["ceiling"] == "ceiling_rawupdate"
    records = {"library_host": dict(host), "lookup_of_the_rows": dict(lookup)}
    out = bench.cell_with_ratios(cell, records, {"rows_checked": None}, {})
    (lib,) = [r for r in out if r["variant"] == "library_host"]
    assert lib["vs_ceiling"] == 0.5 and lib["ceiling"] == "lookup_of_the_rows"


def test_smoke_run_whole(smoke_run):
    result, payload = smoke_run
    assert {"command", "machine"} <= set(payload)
    updates = [r for r in payload["records"] if "optimizer" in r]
    variants = {r["variant"] for r in updates}
    # No CUDA here: no rawupdate kernel; the lookup of the same rows is the ceiling.
    assert variants == {"library_host", "library_host_one_dispatch", "library_host_unrolled",
                        "numpy_device_put",
                        "lookup_of_the_rows"}  # fmt: skip
    assert {r["optimizer"] for r in updates} == {"row_adagrad", "lazy_adam"}
    for r in updates:
        assert r["rows_checked"] is True, r
        assert r["mrows_per_s"] > 0 and r["distinct_rows"] <= r["batch"]
        if r["variant"].startswith("library_host"):
            assert r["vs_ceiling"] > 0 and r["vs_alternative"] > 0
            assert r["ceiling"] == "lookup_of_the_rows"
            assert r["values_compared"] > 0
    steps = {r["variant"]: r for r in payload["records"] if r.get("what") == "step"}
    assert set(steps) == {"no_prefetch", "prefetch_exact", "prefetch_stale"}
    assert steps["prefetch_exact"]["rows_checked"] is True
    assert "each equal to its reference" in result.stdout


def test_model_part_smoke(smoke_run):
    """The example's own model (micro, a tiny table): every variant from the same
    weights and rows, exact-order prefetch giving the plain step's losses bit for bit."""
    result, payload = smoke_run
    records = {r["variant"]: r for r in payload["records"] if r.get("what") == "model_step"}
    assert all(r["what"] == "model_step" for r in records.values())
    # No HBM on the CPU.
    old_exact = "prefetch_exact_no_dedup_one_stream"
    assert set(records) == {"no_prefetch", "prefetch_exact", "prefetch_stale", old_exact} | SIDES
    for r in records.values():
        assert r["model"] == "micro" and r["tokens"] == 4 * 32
        assert r["ids"] == r["tokens"] * r["n_cols"] * len(r["engram_layers"])
        assert r["rounds"] == 3 and len(r["ms_per_step_rounds"]) == 3 and r["ms_per_step"] > 0
        assert r["losses_finite"] is True and r["vs_no_prefetch"] > 0 and "vs_hbm" not in r
        assert r["table_optimizer"] == "lazy_adam" and r["table_dtype"] == "bfloat16"
        assert r["table_gib"] == pytest.approx(0.004, rel=0.1) and r["placement"] == "cpu"
        assert r["allocate_s"] >= 0 and r["init_rows_s"] >= 0
    assert records["prefetch_exact"]["rows_checked"] is True
    assert records[old_exact]["rows_checked"] is True
    # Updates on the side stream: the exact steps' losses as the reference's, the stale
    # steps' as the first stale step's.
    assert all(records[name]["rows_checked"] is True for name in SIDES)
    assert records["prefetch_stale_side"]["steps_options"]["update_ctas"] == 64
    assert records[old_exact]["steps_options"] == {"order": "plain", "update_stream": None}
    # The compiling step and the profiled ones too.
    assert records["prefetch_exact"]["rows_checksums"] == 1 + 3 + bench.PROFILE_STEPS
    assert records["no_prefetch"]["rows_checked"] is None
    assert records["prefetch_stale"]["rows_checked"] is None
    assert "rows written in" in result.stdout and "first step (compiling)" in result.stdout
    assert "each equal to its reference" in result.stdout


def test_profile_on_the_cpu(smoke_run):
    """--profile traces each variant; the CPU's trace has no GPU stream: None."""
    result, payload = smoke_run
    steps = [r for r in payload["records"] if r.get("what") in ("step", "model_step")]
    assert len(steps) == 10 and all(r["profile"] is None for r in steps)
    assert steps[1]["rows_checked"] is True  # the profiled steps compared too
    assert "profile prefetch_exact: no GPU stream in the trace" in result.stdout


def test_compact_profile():
    events = [(0, 1000_000, "GemmKernel"), (1500_000, 2000_000, "TrainableGatherKernel"),
              (2000_000, 2500_000, "GemmKernel")] + [(3e6 + i, 3e6 + i + 1, f"k{i}")
                                                    for i in range(10)]  # fmt: skip
    summary = {"Stream #1(compute)": _common.summarize_stream(events, steps=2)}
    got = bench.compact_profile(summary)["Stream #1(compute)"]
    assert set(got) == {*bench.PROFILE_FIELDS, "top_ms_per_step"}
    assert got["busy_ms_per_step"] == pytest.approx((2.0 + 10e-6) / 2)
    assert got["gather_ms_per_step"] == pytest.approx(0.25)
    assert list(got["top_ms_per_step"])[:2] == ["GemmKernel", "TrainableGatherKernel"]
    assert len(got["top_ms_per_step"]) == bench.PROFILE_TOP
    assert bench.compact_profile(None) is None and bench.compact_profile({}) is None


@pytest.mark.gpu
def test_gpu_model_part_with_profile(tmp_path):
    """On a GPU, at a small size: the twelve variants, exact order bit for bit (XLA's
    deterministic ops), the HBM step as the measure, and a profile per variant whose
    streams were busy."""
    result, payload = _run(
        tmp_path, "--parts", "model", "--model-name", "tiny", "--model-gib", "0.05",
        "--model-batch", "8", "--model-seq", "128", "--model-steps", "3", "--profile",
        timeout=600,
    )  # fmt: skip
    records = {r["variant"]: r for r in payload["records"]}
    old_exact = "prefetch_exact_no_dedup_one_stream"
    assert set(records) == {
        "no_prefetch", "prefetch_exact", "prefetch_exact_split", "prefetch_stale", old_exact,
        "no_prefetch_hbm",
    } | SIDES | GRIDS  # fmt: skip
    assert records["prefetch_exact"]["rows_checked"] is True
    assert records["prefetch_exact_split"]["rows_checked"] is True
    assert records[old_exact]["rows_checked"] is True
    # Updates on the side stream: the exact step's losses as the reference's, the stale
    # steps' as the first stale step's.
    assert all(records[name]["rows_checked"] is True for name in SIDES | GRIDS)
    assert records["prefetch_stale_side_128"]["steps_options"]["update_ctas"] == 128
    assert records["prefetch_exact"]["xla_deterministic"] is True
    assert records["prefetch_exact"]["prefetch_ctas"] >= 1
    assert (
        records["no_prefetch_hbm"]["vs_hbm"] == 1
        and records["no_prefetch_hbm"]["placement"] == "device"
    )
    for r in records.values():
        if under_sanitizer():  # no GPU kernel in a profile there: sanitize.py --probe
            assert r["profile"] is None, r["variant"]
            continue
        assert r["profile"], r["variant"]
        assert max(s["busy_ms_per_step"] for s in r["profile"].values()) > 0
    assert "each equal to its reference" in result.stdout
