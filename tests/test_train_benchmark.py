"""benchmarks/train.py on the CPU: its --smoke run whole (every variant's rows
checked, the ratios recorded), and its rows check failing on updates that are
wrong (another learning rate, a missing call, no update at all).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from benchmarks import train as bench

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_whole(tmp_path):
    result = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "train.py", "--smoke", "--name", tmp_path / "train"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "train_smoke.json").read_text())
    assert {"command", "machine"} <= set(payload)
    updates = [r for r in payload["records"] if "optimizer" in r]
    variants = {r["variant"] for r in updates}
    # No CUDA here: no rawupdate kernel; the lookup of the same rows is the ceiling.
    assert variants == {"library_host", "numpy_device_put", "lookup_of_the_rows"}
    assert {r["optimizer"] for r in updates} == {"row_adagrad", "lazy_adam"}
    for r in updates:
        assert r["rows_checked"] is True, r
        assert r["mrows_per_s"] > 0 and r["distinct_rows"] <= r["batch"]
        if r["variant"] == "library_host":
            assert r["vs_ceiling"] > 0 and r["vs_alternative"] > 0
            assert r["ceiling"] == "lookup_of_the_rows"
            assert r["values_compared"] > 0
    steps = {r["variant"]: r for r in payload["records"] if r.get("what") == "step"}
    assert set(steps) == {"no_prefetch", "prefetch_exact", "prefetch_stale"}
    assert steps["prefetch_exact"]["rows_checked"] is True
    assert "each equal to its reference" in result.stdout


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
    try:
        _, checks = bench.time_updates(
            lib, on_device, batches, sample, 100, known, 1, lib.compile(on_device[0])
        )
        assert checks[0]["ok"], checks
        got = lib.read(sample)
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
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'no GPU' >&2\nexit 1\n")
    failing.chmod(0o755)
    for exe in (failing, "not built: no nvcc"):
        got = bench.run_rawupdate(exe, 1 << 20, 528, [100])
        assert got[0]["rows_checked"] is None and "mrows_per_s" not in got[0]
    assert "no GPU" in bench.run_rawupdate(failing, 1 << 20, 528, [1])[0]["rows_check"]
