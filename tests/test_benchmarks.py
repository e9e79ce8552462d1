"""The benchmarks' rows checks: the checksum every timed step returns, the rows a
fill_distinct table must give, the record fragment and the failing exit, and the
timed functions of overlap.py, cache.py, lookup.py, dispatch.py and sharded.py at tiny sizes
on the CPU (their checks pass on right rows and fail on wrong ones), and overlap.py's
--smoke run whole. Marked gpu:
overlap.py's step, whose prefetches take slices of one ids array, on a pinned table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engram_jax as ej
from benchmarks import _common, overlap, sharded
from benchmarks import cache as cache_bench
from benchmarks import dispatch as dispatch_bench
from benchmarks import lookup as lookup_bench
from engram_jax import checkpoint

checksum = jax.jit(_common.rows_checksum)
ROOT = Path(__file__).resolve().parents[1]


def distinct_table(rows: int, dim: int = 256, *, seed: int = 0, row_start: int = 0):
    return checkpoint.dummy_table(
        rows, dim, placement="cpu", fill="distinct", seed=seed, row_start=row_start
    )


# -- the checksum and the expected rows ------------------------------------------------


def test_checksum_tells_wrong_zero_swapped_and_stale_rows_from_right_ones():
    rng = np.random.default_rng(0)
    with distinct_table(10_000) as table:
        ids = jnp.asarray(rng.integers(0, 10_000, (64, 24)), jnp.int32)
        rows = ej.lookup(table, ids)
        right = int(checksum(rows))
        assert right == int(checksum(ej.lookup(table, ids)))  # deterministic
        other_id = ids.at[5, 3].set((ids[5, 3] + 4096) % 10_000)  # shares all but 8 values
        stale = jnp.asarray(rng.integers(0, 10_000, (64, 24)), jnp.int32)
        wrong = {
            "zero row": rows.at[5, 3].set(0),
            "row of another id": ej.lookup(table, other_id),
            "two rows swapped": rows.at[[5, 6], 3].set(rows[[6, 5], 3]),
            "stale rows": ej.lookup(table, stale),
        }
        for what, bad in wrong.items():
            assert int(checksum(bad)) != right, what
        assert int(checksum(jnp.zeros_like(rows))) == 0


@settings(max_examples=50, deadline=None)
@given(
    shape=st.sampled_from([(7,), (3, 32), (2, 5, 64)]),
    dtype=st.sampled_from(["bfloat16", "uint8", "int32"]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_checksum_changes_with_any_single_element(shape, dtype, seed, data):
    """One changed element always changes the sum: its multiplier is odd, hence
    invertible modulo 2**32, and its bits change by less than 2**32."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**16 if dtype == "bfloat16" else 256, shape)
    where = data.draw(st.tuples(*(st.integers(0, n - 1) for n in shape)))
    changed = bits.copy()
    changed[where] = (bits[where] + data.draw(st.integers(1, 255))) % (
        2**16 if dtype == "bfloat16" else 256
    )

    def as_values(b):
        if dtype == "bfloat16":
            return jax.lax.bitcast_convert_type(jnp.asarray(b, jnp.uint16), jnp.bfloat16)
        return jnp.asarray(b, dtype)

    assert int(checksum(as_values(bits))) != int(checksum(as_values(changed)))


@pytest.mark.parametrize("dim, row_start, seed", [(32, 0, 0), (96, 13, 4), (256, 5000, 9)])
def test_expected_rows_and_records_are_what_the_table_holds(dim, row_start, seed):
    rng = np.random.default_rng(dim)
    with distinct_table(9000, dim, seed=seed, row_start=row_start) as table:
        ids = rng.integers(-3, row_start + 9003, (50, 24)).astype(np.int32)
        ids[0, :3] = [row_start, table.row_stop - 1, ej.DEAD_ID]
        expected = jax.jit(
            lambda i: _common.expected_rows(
                i, dim, seed=seed, row_start=row_start, row_stop=table.row_stop
            )
        )(ids)
        got = ej.lookup(table, ids)
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint16), np.asarray(expected).view(np.uint16)
        )
        held = np.arange(row_start, table.row_stop, 7)
        records = jax.jit(lambda i: _common.expected_records(i, dim, seed=seed))(held)
        stored = table.allocation.host_array[: table.nbytes].reshape(table.num_rows, -1)
        np.testing.assert_array_equal(np.asarray(records), stored[held - row_start])


def test_rows_check_fragment_and_the_failing_exit(capsys):
    right = np.array([[3, 4], [5, 6]], np.uint32)
    ok = _common.rows_check(right, right, "how")
    assert ok == {
        "rows_checked": True,
        "rows_check": "how",
        "rows_checksums": 4,
        "rows_mismatched": 0,
        "rows_zero_in_reference": 0,
    }
    wrong = _common.rows_check(right + np.uint32([[0, 1], [0, 0]]), right, "how")
    assert (wrong["rows_checked"], wrong["rows_mismatched"]) == (False, 1)
    zeros = np.zeros((2, 2), np.uint32)
    assert not _common.rows_check(zeros, zeros, "how")["rows_checked"]  # zero rows prove nothing
    assert _common.rows_check(zeros, zeros, "how", zero_is_wrong=False)["rows_checked"]
    assert not _common.rows_check(zeros[:0], zeros[:0], "how")["rows_checked"]
    with pytest.raises(ValueError, match="shape"):
        _common.rows_check(right, right[:1], "how")

    _common.finish_rows_checks([{"variant": "a", **ok}, {"variant": "b", "rows_checked": None}])
    assert "rows checked: 1 records" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="FAILED: the rows of 1 of 2 records are wrong"):
        _common.finish_rows_checks([{"variant": "a", **ok}, {"variant": "b", **wrong}])
    assert "FAILED rows check: {'variant': 'b'}: 1 of 4 checksums differ" in capsys.readouterr().out


def test_time_calls_hands_back_every_timed_calls_checksum():
    with distinct_table(1000, 32) as table:
        batches = [jnp.full((4, 3), i, jnp.int32) for i in range(3)]
        fn = jax.jit(lambda ids: lookup_bench.with_checksum(ej.lookup(table, ids)))
        sums: list = []
        assert _common.time_calls(fn, batches, repeats=2, checksums=sums) > 0
        expected = [int(checksum(ej.lookup(table, b))) for b in batches]
        assert [int(s) for s in sums] == expected * 2


def test_stream_summary_times_busy_idle_and_the_side_kernels():
    # Two steps on one stream (ns): a 30 us wait in step 0, 10 us of launch gaps.
    events = [
        (1000, 11_000, "gemm"),
        (16_000, 26_000, "GatherKernel<Decode>"),
        (56_000, 66_000, "gemm"),
        (60_000, 70_000, "fusion"),  # overlaps the gemm: busy counts it once
        (80_000, 90_000, "GatherKernel<Decode>"),
    ]
    got = _common.summarize_stream(events, steps=2, origin=1000)
    assert got["kernels_per_step"] == 2.5
    assert got["busy_ms_per_step"] == pytest.approx(44e3 / 1e6 / 2)
    assert got["span_ms_per_step"] == pytest.approx(89e3 / 1e6 / 2)
    assert got["gather_ms_per_step"] == pytest.approx(20e3 / 1e6 / 2)
    assert got["gaps_over_20us_per_step"] == 0.5  # the 5 and 10 us gaps are launches
    assert got["gap_ms_over_20us_per_step"] == pytest.approx(30e3 / 1e6 / 2)
    assert got["first_side_kernels_ms"] == [[0.015, 0.025], [0.079, 0.089]]
    assert got["first_gaps_over_20us_ms"] == [[0.025, 0.055]]
    assert got["top_gaps_before_ms_per_step"] == {"gemm": pytest.approx(30e3 / 1e6 / 2)}
    assert list(got["top_ms_per_step"]) == ["gemm", "GatherKernel<Decode>", "fusion"]


def test_beside_side_kernels_finds_what_ran_beside_another_streams_gather():
    # Two gathers on the side stream, one 10 us and one 20 us (two overlapping kernels
    # count once); the compute stream's kernels run 5 + 10 us beside them, the sort
    # 5 us beside the first, the gemm partly beside the second, the fusion beside none.
    lines = {
        "side": [(10_000, 20_000, "TrainableGatherKernel"),
                 (40_000, 55_000, "TrainableGatherKernel"),
                 (50_000, 60_000, "TrainableGatherKernel")],
        "compute": [(0, 15_000, "DeviceRadixSort"), (30_000, 45_000, "fusion_gemm"),
                    (45_000, 50_000, "fusion_gemm"), (60_000, 70_000, "fusion")],
    }  # fmt: skip
    got = _common.beside_side_kernels(lines, steps=1)
    assert got["compute"]["beside_side_ms_per_step"] == pytest.approx(15e3 / 1e6)
    assert got["compute"]["top_beside_side_ms_per_step"] == pytest.approx(
        {"fusion_gemm": 10e3 / 1e6, "DeviceRadixSort": 5e3 / 1e6}
    )
    # Its own gathers are not beside themselves; the compute stream runs none.
    assert got["side"] == {"beside_side_ms_per_step": 0.0, "top_beside_side_ms_per_step": {}}


# -- each benchmark's timed functions, tiny, on the CPU --------------------------------


def overlap_setup(cpu_device, hbm_seed: int = 0):
    host = distinct_table(4000)
    hbm = host if hbm_seed == 0 else distinct_table(4000, seed=hbm_seed)
    params = overlap.init_params(jax.random.key(0), 32, 64, 4, 2, cpu_device)
    x = jax.device_put(jnp.ones((8, 32), jnp.bfloat16), cpu_device)
    return {"host": host, "hbm": hbm}, (x, params)


def overlap_checks(tables, args, names, steps=3, repeats=2):
    variants = overlap.variants_for(names, [], None)
    compiled = {
        v.name: overlap.compile_loop(
            overlap.make_loop(v, tables, None, (1, 3), steps, None, 4000), args, 0
        )[0]
        for v in variants
    }
    _, sums = overlap.time_rounds(compiled, args, steps, repeats, seed=5)
    ref_name = next((n for n in ("hbm", "host_sync") if n in compiled), None)
    if ref_name is None:
        ref_loop = overlap.make_loop(
            overlap.Variant("reference", "host"), tables, None, (1, 3), steps, None, 4000
        )
        ref = overlap.reference_sums(overlap.compile_loop(ref_loop, args, 0)[0], args, repeats, 5)
    else:
        ref = sums[ref_name]
    assert ref.shape == (repeats, steps, 2)
    return overlap.check_variants(variants, sums, ref, "plain lookup", ref_name)


def test_overlap_step_rows_checked_against_the_plain_lookup(cpu_device):
    tables, args = overlap_setup(cpu_device)
    names = ["no_engram", "hbm", "host_sync", "host_prefetch", "hbm_prefetch"]
    levers = [
        "host_prefetch_ahead",
        "host_prefetch_any_order",
        "host_prefetch_sorted",
        "host_prefetch_ahead_sorted",
    ]
    checks = overlap_checks(tables, args, names + levers)
    assert checks["no_engram"]["rows_checked"] is None
    for name in ("hbm", "host_sync", "host_prefetch", "hbm_prefetch", *levers):
        assert checks[name]["rows_checked"] is True, (name, checks[name])
        assert checks[name]["rows_checksums"] == 12
    # Without a plain variant timed, an untimed plain host lookup is the reference.
    assert overlap_checks(tables, args, ["host_prefetch"])["host_prefetch"]["rows_checked"]
    tables["host"].close()


def test_overlap_grid_sweep_repeats_every_host_prefetch_variant():
    names = ["hbm", "host_sync", "host_prefetch_ahead_sorted", "host_prefetch_cache_dedup"]
    swept = {v.name: v for v in overlap.variants_for(names, [4, 8], None)}
    assert set(swept) == set(names) | {f"{n}_ctas{c}" for n in names[2:] for c in (4, 8)}
    ahead = swept["host_prefetch_ahead_sorted_ctas8"]
    assert (ahead.ctas, ahead.order, ahead.ahead, ahead.cache) == (8, "sorted", True, False)
    cached = swept["host_prefetch_cache_dedup_ctas4"]
    assert (cached.ctas, cached.order, cached.cache) == (4, "dedup", True)


def test_overlap_smoke_sizes_itself_for_the_cpu(tmp_path):
    """``overlap.py --smoke`` with no sizes given runs whole on a small machine (it once
    took the GPU run's 64 GiB table and 8192 x 32768 model), its rows checked."""
    result = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "overlap.py", "--smoke", "--ids", "uniform"]
        + ["--variants", "hbm", "host_prefetch", "--name", tmp_path / "overlap"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    results = json.loads((tmp_path / "overlap_smoke.json").read_text())
    assert results["host_table_gib"] < 0.02
    checked = [r for r in results["records"] if "rows_checked" in r]
    assert {r["variant"] for r in checked} == {"hbm", "host_prefetch"}
    assert all(r["rows_checked"] is True for r in checked)
    assert "each equal to its reference" in result.stdout


def test_overlap_rows_check_fails_on_other_rows(cpu_device):
    tables, args = overlap_setup(cpu_device, hbm_seed=1)  # the "HBM" table holds other rows
    checks = overlap_checks(
        tables, args, ["hbm", "host_sync", "host_prefetch", "host_prefetch_ahead"]
    )
    assert checks["hbm"]["rows_checked"] is True  # the reference itself
    for name in ("host_sync", "host_prefetch", "host_prefetch_ahead"):
        assert checks[name]["rows_checked"] is False
        assert checks[name]["rows_mismatched"] == 12
    for table in tables.values():
        table.close()


def test_overlap_lookups_alone_return_their_checksums(cpu_device):
    with distinct_table(4000) as table:
        ms, sums, summary = overlap.time_lookups_alone(table, None, 8, 2, 3, 2, None, None, 4000)
        _, again, _ = overlap.time_lookups_alone(
            table, None, 8, 2, 3, 2, 4, None, 4000, side_stream=True
        )
        assert ms > 0 and summary is None and sums.shape == (2, 3)
        assert _common.rows_check(again, sums, "how")["rows_checked"]


def test_cache_levers_checksums_match_the_plain_lookup(cpu_device):
    rng = np.random.default_rng(1)
    with distinct_table(5000) as table:
        batches = [jnp.asarray(rng.integers(0, 5000, (40, 24)), jnp.int32) for _ in range(3)]
        _, plain = cache_bench.timed(lambda i: ej.lookup(table, i), batches, 2)
        _, dedup = cache_bench.timed(lambda i: ej.lookup(table, i, order="dedup"), batches, 2)
        assert plain.shape == (2, 3)
        np.testing.assert_array_equal(
            plain[0], [int(checksum(ej.lookup(table, b))) for b in batches]
        )
        assert _common.rows_check(dedup, plain, "how")["rows_checked"]
        _, off = cache_bench.timed(lambda i: ej.lookup(table, i + 1), batches, 2)
        assert not _common.rows_check(off, plain, "how")["rows_checked"]


@pytest.mark.parametrize("seed, right", [(0, True), (1, False)])
def test_lookup_benchmark_checks_every_timed_call(cpu_device, seed, right):
    """lookup.py compares with the fill's definition for seed 0: a table of other rows fails."""
    rows = lookup_bench.footprint_rows(0.001)
    with distinct_table(rows, seed=seed) as table:
        records = lookup_bench.lookup_records(
            table, [("lookup_cpu", None)], [0.001], [240], cpu_device, repeats=2
        )
        records += lookup_bench.numpy_records(table, [0.001], [240], cpu_device)
    for r in records:
        assert r["rows_checked"] is right, r
        assert r["rows_checksums"] == (128 if r["variant"] == "lookup_cpu" else 20)
        assert r["rows_mismatched"] == (0 if right else r["rows_checksums"])


@pytest.mark.parametrize("seed, right", [(0, True), (1, False)])
def test_dispatch_benchmark_checks_every_timed_call(cpu_device, seed, right):
    """dispatch.py compares with the fill's definition for seed 0: a table of other rows fails."""
    orders = ["plain", "sorted"]
    names = ["ids_only", "lookup_plain", "start_done_plain", "start_done_sorted"]
    with distinct_table(3000, seed=seed) as table:
        records = dispatch_bench.measure(table, 48, names, orders, cpu_device, calls=3, repeats=2)
    assert [r["variant"] for r in records] == names
    for r in records:
        assert r["enqueue_us"] > 0 and r["per_call_us"] > 0
        assert r["rows_checksums"] == 9  # 3 calls, 2 timed passes and the enqueue pass
        assert r["rows_checked"] is (True if r["variant"] == "ids_only" else right), r


@pytest.mark.parametrize("exchange", ej.sharding.EXCHANGES)
def test_sharded_loop_rows_checked_against_the_definition(exchange):
    devices = jax.devices("cpu")[:4]
    mesh = ej.engram_mesh(tp=1, devices=devices)
    sizes = sharded.layer_sizes(0.002)
    plan = ej.ShardPlan(sizes, edp=4, exchange=exchange)
    shards = ej.sharding.device_shards(mesh, plan)
    tables = sharded.make_tables(
        [(shards[d].num_rows, shards[d].row_start, d) for d in devices], ["cpu"]
    )
    table = ej.ShardedTable(dict(zip(devices, tables, strict=True)))
    try:
        assert sharded.check_rows(table, mesh, plan, 4)
        _, _, sums = sharded.time_loop(sharded.make_loop(table, mesh, plan, 16, 3), 3, 2, seed=16)
        expected = sharded.loop_sums(sharded.reference_loop(mesh, plan, 16, 3), 2, 16)
        assert sums.shape == (2, 4, 3)
        assert _common.rows_check(sums, expected, "how")["rows_checked"]
        checkpoint.fill_distinct(tables[2], seed=1)  # one shard's rows go wrong
        assert not sharded.check_rows(table, mesh, plan, 4)
        _, _, sums = sharded.time_loop(sharded.make_loop(table, mesh, plan, 16, 3), 3, 2, seed=16)
        assert not _common.rows_check(sums, expected, "how")["rows_checked"]
    finally:
        table.close()
        for t in tables:
            t.close()


# -- on the GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_overlap_step_prefetched_rows_are_the_plain_lookups(gpu_device):
    """overlap.py's timed step as it runs on a GPU: the prefetches take slices of one
    ids array made in the step; their rows, from a pinned and an HBM table, must be the
    plain HBM-table lookup's every step (the check its results records carry)."""
    rows = 1 << 21  # 0.53 GiB: hbm_copy makes no HBM table under 0.5 GiB
    host = ej.EngramTable.allocate(rows, 256, placement="pinned", device=gpu_device)
    checkpoint.fill_distinct(host)
    hbm, _ = overlap.hbm_copy(host, host.nbytes / 2**30, gpu_device)
    tables = {"host": host, "hbm": hbm}
    try:
        params = overlap.init_params(jax.random.key(0), 1024, 2048, 6, 2, gpu_device)
        x = jax.device_put(jnp.ones((512, 1024), jnp.bfloat16), gpu_device)
        names = ["hbm", "host_sync", "host_prefetch", "hbm_prefetch"]
        variants = overlap.variants_for(names, [], None)
        compiled = {
            v.name: overlap.compile_loop(
                overlap.make_loop(v, tables, None, (1, 4), 8, None, rows), (x, params), 0
            )[0]
            for v in variants
        }
        _, sums = overlap.time_rounds(compiled, (x, params), 8, 3, seed=5)
        checks = overlap.check_variants(variants, sums, sums["hbm"], "plain HBM lookup", "hbm")
        for name in names:
            assert checks[name]["rows_checked"] is True, (name, checks[name])
    finally:
        hbm.close()
        host.close()


def test_rawgather_lines_carry_its_rows_check(tmp_path):
    """run_rawgather turns the reference's own row comparison into a record's rows
    check: a gather line with mismatched rows fails it, a line that compared nothing (an
    older rawgather's copy-engine line) has none, the bulk copy's comparison counts."""
    fake = tmp_path / "rawgather"
    fake.write_text(
        "#!/bin/sh\n"
        'echo \'{"what": "h2d_memcpy", "bytes": 16, "gb_per_s": 50.0}\'\n'
        'echo \'{"what": "h2d_memcpy", "gb_per_s": 50.0, '
        '"rows_compared": 8, "rows_mismatched": 0}\'\n'
        'echo \'{"what": "gather_packed", "mrows_per_s": 1.0, '
        '"rows_compared": 8, "rows_mismatched": 0}\'\n'
        'echo \'{"what": "gather_split", "mrows_per_s": 1.0, '
        '"rows_compared": 8, "rows_mismatched": 3}\'\n'
    )
    fake.chmod(0o755)
    copy, checked_copy, packed, split = _common.run_rawgather(fake, [1], 8)
    assert "rows_checked" not in copy
    assert checked_copy["rows_checked"] is True and checked_copy["rows_checksums"] == 8
    assert packed["rows_checked"] is True and packed["rows_checksums"] == 8
    assert split["rows_checked"] is False and split["rows_mismatched"] == 3
    with pytest.raises(SystemExit, match="FAILED"):
        _common.finish_rows_checks([packed, split])
