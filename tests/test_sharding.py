"""Sharded lookup over a device mesh: head-shard arithmetic, TP / EDP head
sharding / shared tables equal to the unsharded lookup bit for bit under jit
(8 virtual CPU devices), per-device tables, mesh checks, bad input, and a
two-process run through jax.distributed.
"""

import os
import re
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engram_jax as ej
from engram_jax import sharding, testing
from engram_jax.sharded_table import check_readable, handler_ordinal
from engram_jax.sharding import ShardPlan
from engram_jax.sharding import tables as sharding_tables

from ._helpers import (
    assert_bf16_equal,
    child_env,
    free_port,
    random_table_arrays,
    wait_all,
)

DIM = 64
# 7 columns: not divisible by any shard count; 3 columns: tp * edp = 4 leaves one shard empty.
SIZES_7 = (5, 7, 11, 13, 17, 19, 23)
SIZES_3 = (29, 31, 37)
# CPU tests name the CPU devices, so this file also runs where a GPU is the default backend.
CPUS = jax.devices("cpu")
FITS = [(tp, edp) for tp in (1, 2, 4) for edp in (1, 2, 4) if tp * edp <= 8]


def cpu_mesh(**kwargs):
    return ej.engram_mesh(devices=CPUS, **kwargs)


def offsets(sizes):
    return np.concatenate([[0], np.cumsum(sizes)[:-1]])


def random_ids(rng, sizes, tokens, dead_fraction=0.1):
    """Valid ids of every column for `tokens` tokens, with some DEAD_ID mixed in."""
    sizes = np.asarray(sizes)
    ids = rng.integers(0, sizes, (tokens, sizes.size)) + offsets(sizes)
    ids[rng.random(ids.shape) < dead_fraction] = ej.DEAD_ID
    return ids.astype(np.int32)


@pytest.fixture(scope="module")
def layers():
    """Whole-layer arrays and an unsharded table for each size set."""
    rng = np.random.default_rng(6)
    made = {}
    for sizes in (SIZES_7, SIZES_3):
        weight, scale = random_table_arrays(rng, sum(sizes), DIM)
        made[sizes] = (weight, scale, ej.EngramTable.from_arrays(weight, scale))
    yield made
    for _, _, table in made.values():
        table.close()


def unsharded(table, ids):
    with jax.default_device(CPUS[0]):
        return np.asarray(jax.jit(lambda i: ej.lookup(table, i))(ids))


def assert_bitwise(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual.view(np.uint16), expected.view(np.uint16))


# -- head-shard arithmetic -----------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    tp=st.integers(1, 8),
    edp=st.integers(1, 8),
    mode=st.sampled_from(sharding.MODES),
)
def test_head_shards_partition_columns_and_rows(sizes, tp, edp, mode):
    shards = ej.head_shards(np.array(sizes), tp, edp, mode=mode)
    n_cols = len(sizes)
    count = tp * edp if mode == "heads" else tp
    part = -(-n_cols // count)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    owner = {}
    for shard in shards:
        expected_rank = shard.tp_rank * edp + shard.edp_rank if mode == "heads" else shard.tp_rank
        assert shard.rank == expected_rank and shard.part == part
        assert shard.num_cols <= part
        assert (shard.row_start, shard.row_stop) == (
            bounds[shard.col_start],
            bounds[shard.col_stop],
        )
        for column in range(shard.col_start, shard.col_stop):
            owner.setdefault(column, set()).add(shard.rank)
    # Every column has exactly one owning rank, column c belongs to rank c // part.
    assert sorted(owner) == list(range(n_cols))
    assert all(ranks == {c // part} for c, ranks in owner.items())
    # TP-major order.
    assert [(s.tp_rank, s.edp_rank) for s in shards] == [
        (t, e) for t in range(tp) for e in range(edp)
    ]


def test_head_shard_example():
    # 24 columns (DeepSeek: orders 2-4 x 8 heads), tp 2, edp 4: 3 columns each.
    sizes = np.arange(100, 124)
    shard = ej.head_shards(sizes, 2, 4)[6]  # tp_rank 1, edp_rank 2
    assert (shard.rank, shard.col_start, shard.col_stop) == (6, 18, 21)
    assert shard.row_start == sizes[:18].sum() and shard.row_stop == sizes[:21].sum()
    # 5 columns over 4 shards: part 2, the last shard is all padding.
    last = ej.head_shards(np.ones(5, int), 2, 2)[3]
    assert (last.col_start, last.col_stop, last.num_rows) == (5, 5, 0)


def test_column_sizes_from_a_layout():
    primes = np.array([[11, 13, 17], [19, 23, 29]])
    layout = types.SimpleNamespace(
        offsets=np.concatenate([np.zeros((2, 1), int), np.cumsum(primes, 1)[:, :-1]], axis=1),
        num_embeddings=tuple(primes.sum(1)),
    )
    np.testing.assert_array_equal(sharding.column_sizes(layout, 1), primes[1])
    plan = ShardPlan.from_layout(layout, 1, tp=3)
    assert plan.sizes == (19, 23, 29) and plan.shard(2, 0).row_start == 42


def test_column_sizes_from_engram_layout():
    if not hasattr(ej, "EngramLayout"):
        pytest.skip("engram_jax.EngramLayout is not in this build yet")
    layout = ej.EngramLayout(
        engram_vocab_size=1000,
        layer_ids=(1, 5),
        max_ngram_size=3,
        n_heads=4,
        head_dim=32,
        compressed_vocab_size=900,
        pad_id=2,
    )
    for layer in range(2):
        sizes = sharding.column_sizes(layout, layer)
        assert sizes.sum() == layout.num_embeddings[layer]
        np.testing.assert_array_equal(np.asarray(layout.primes[layer]).reshape(-1), sizes)


# -- the sharded lookup equals the unsharded one ---------------------------------


def run_sharded(layers, sizes, tp, edp, mode, exchange, counts, rng, slot=None):
    weight, scale, full = layers[sizes]
    mesh = cpu_mesh(tp=tp, edp=edp)
    plan = ShardPlan(sizes, tp=tp, edp=edp, mode=mode, exchange=exchange)
    per_replica = [random_ids(rng, sizes, int(n)) for n in counts]
    ids, counts = ej.pad_replicas(per_replica, slot)
    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        out = np.asarray(ej.make_sharded_lookup(table, mesh, plan)(ids))
    assert_bitwise(out, unsharded(full, ids))
    for rows, own in zip(ej.split_replicas(out, counts), per_replica, strict=True):
        assert_bf16_equal(rows, testing.lookup_reference(weight, scale, own))
    # Padding tokens are DEAD: zero rows.
    slot = ids.shape[0] // len(counts)
    for replica, n in enumerate(counts):
        assert not np.any(out[replica * slot + n : (replica + 1) * slot].view(np.uint16))
    return out


@pytest.mark.parametrize("sizes", [SIZES_7, SIZES_3], ids=["7cols", "3cols"])
@pytest.mark.parametrize(("tp", "edp"), FITS, ids=[f"tp{t}-edp{e}" for t, e in FITS])
def test_head_sharding_equals_unsharded(layers, sizes, tp, edp):
    rng = np.random.default_rng(tp * 10 + edp)
    replicas = 8 // tp
    counts = rng.integers(0, 9, replicas)
    counts[0] = 0  # a replica with no tokens at all
    counts[-1] = 8  # and one that fills the slot
    run_sharded(layers, sizes, tp, edp, "heads", "all_to_all", counts, rng, slot=8)


@pytest.mark.parametrize(("tp", "edp"), [(1, 2), (2, 2), (1, 4), (2, 4)])
def test_all_gather_select_equals_all_to_all(layers, tp, edp):
    counts = np.random.default_rng(1).integers(0, 6, 8 // tp)
    outs = [
        run_sharded(layers, SIZES_7, tp, edp, "heads", exchange, counts, np.random.default_rng(2))
        for exchange in sharding.EXCHANGES
    ]
    for out in outs[1:]:
        assert_bitwise(out, outs[0])


# (tp, edp, mode) of the packed exchange: records cross EDP and TP, EDP alone or TP alone.
PACKED_FITS = [
    (1, 2, "heads"),
    (2, 2, "heads"),
    (1, 4, "heads"),
    (2, 4, "heads"),
    (2, 1, "heads"),
    (2, 2, "shared"),
]


@pytest.mark.parametrize("sizes", [SIZES_7, SIZES_3], ids=["7cols", "3cols"])
@pytest.mark.parametrize(
    ("tp", "edp", "mode"), PACKED_FITS, ids=[f"tp{t}-edp{e}-{m}" for t, e, m in PACKED_FITS]
)
def test_packed_exchange_equals_unsharded(layers, sizes, tp, edp, mode):
    """Packed records exchanged (over EDP and TP) and decoded at the end: the
    unsharded lookup's rows bit for bit, NaNs and subnormals included."""
    assert ShardPlan(sizes, tp=tp, edp=edp, mode=mode, exchange="all_to_all_packed").moves_records
    rng = np.random.default_rng(50 + tp * 10 + edp)
    counts = rng.integers(0, 9, 8 // tp)
    counts[0], counts[-1] = 0, 8  # a replica with no tokens, one filling the slot
    run_sharded(layers, sizes, tp, edp, mode, "all_to_all_packed", counts, rng, slot=8)


def test_packed_plan_moves_records_only_where_rows_cross_devices():
    packed = {"exchange": "all_to_all_packed"}
    assert ShardPlan(SIZES_7, edp=2, **packed).moves_records
    assert ShardPlan(SIZES_7, tp=2, **packed).moves_records
    assert ShardPlan(SIZES_7, tp=2, edp=4, mode="shared", **packed).moves_records
    assert not ShardPlan(SIZES_7, edp=4, mode="shared", **packed).moves_records
    assert not ShardPlan(SIZES_7, **packed).moves_records
    assert not ShardPlan(SIZES_7, tp=2, edp=2).moves_records


def row_collectives(fn, ids) -> list[tuple[str, list[tuple[str, str]]]]:
    """(op, [(dtype, dims), ...] of its result) for each collective of the compiled
    program that moves more than ids."""
    found = []
    for line in fn.lower(ids).compile().as_text().splitlines():
        match = re.search(r" = (.+?) (all-to-all|all-gather)(?:-start)?\(", line)
        if match:
            arrays = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", match[1])
            if arrays[0][0] != "s32":
                found.append((match[2], arrays))
    return found


def test_packed_exchange_moves_uint8_records_over_edp_and_tp(layers):
    """The collectives of the packed exchange carry dim + dim/32 bytes of uint8 a row,
    the all-to-all over EDP and the all-gather over TP alike (decoded after both);
    the bf16 exchange carries dim values a row."""
    weight, scale, _ = layers[SIZES_7]
    mesh = cpu_mesh(tp=2, edp=2)
    ids = jax.ShapeDtypeStruct((4 * 8, 7), np.int32)
    width = ej.packed_record_bytes(DIM)
    # The CPU backend widens bf16 collectives to f32; packed records stay uint8.
    for exchange, dtype, row in (("all_to_all", "f32", DIM), ("all_to_all_packed", "u8", width)):
        plan = ShardPlan(SIZES_7, tp=2, edp=2, exchange=exchange)
        with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
            found = row_collectives(ej.make_sharded_lookup(table, mesh, plan), ids)
        assert sorted(op for op, _ in found) == ["all-gather", "all-to-all"], found
        arrays = [array for _, result in found for array in result]
        assert all(t == dtype and dims.endswith(f",{row}") for t, dims in arrays), found


@pytest.mark.parametrize(("tp", "edp"), [(1, 2), (2, 4)])
def test_packed_start_and_done_split_around_other_work(layers, tp, edp):
    """lookup_start with a packed plan gathers records in the background; lookup_done
    exchanges and decodes them: the rows of the unsharded lookup."""
    weight, scale, full = layers[SIZES_7]
    mesh = cpu_mesh(tp=tp, edp=edp)
    plan = ShardPlan(SIZES_7, tp=tp, edp=edp, exchange="all_to_all_packed", slot=7)
    ids = random_ids(np.random.default_rng(51), SIZES_7, 8 // tp * 7)
    x = np.arange(ids.shape[0] * 3, dtype=np.float32).reshape(-1, 3)
    spec = P(("dp", "edp"))

    def step(i, h):
        handle = ej.lookup_start(table, i, plan=plan)
        assert handle.pending and handle.records
        h = jnp.tanh(h @ jnp.ones((3, 3), h.dtype))
        return ej.lookup_done(handle), h

    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
        sh = NamedSharding(mesh, spec)
        args = (jax.device_put(ids, sh), jax.device_put(x, sh))
        text = fn.lower(*args).as_text()
        starts = [ln for ln in text.splitlines() if "custom_call @engram_lookup_start(" in ln]
        assert len(starts) == 1 and "records = 1 " in starts[0], starts
        assert "custom_call @engram_decode_records(" in text
        rows, _ = jax.block_until_ready(fn(*args))
    assert_bitwise(rows, unsharded(full, ids))


def test_packed_exchange_rows_are_typed_as_varying(layers):
    """The decoded rows vary over EDP like the records they come from: out_specs that
    claim them replicated are refused (an FFI result is typed invariant)."""
    weight, scale, _ = layers[SIZES_7]
    mesh = cpu_mesh(tp=1, edp=4)
    plan = ShardPlan(SIZES_7, edp=4, exchange="all_to_all_packed")
    spec = P(("dp", "edp"))
    ids = jax.device_put(
        random_ids(np.random.default_rng(52), SIZES_7, 8), NamedSharding(mesh, spec)
    )
    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        fn = jax.shard_map(
            lambda i: ej.lookup(table, i, plan=plan), mesh=mesh, in_specs=spec, out_specs=P()
        )
        with pytest.raises(ValueError, match="vary|varying|replicat"):
            jax.jit(fn).lower(ids)


@pytest.mark.parametrize(("tp", "edp"), [(1, 4), (2, 2), (2, 4), (4, 2)])
def test_shared_tables_equal_unsharded(layers, tp, edp):
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 7, 8 // tp)
    run_sharded(layers, SIZES_7, tp, edp, "shared", "all_to_all", counts, rng)


def test_shared_mode_keeps_one_table_per_tp_rank(layers):
    weight, scale, _ = layers[SIZES_7]
    mesh = cpu_mesh(tp=2, edp=4)
    plan = ShardPlan(SIZES_7, tp=2, edp=4, mode="shared")
    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        held = {id(table.table(d)) for d in mesh.devices.flat}
        assert len(held) == 2
        for device, shard in sharding.device_shards(mesh, plan).items():
            assert table.row_range(device) == (shard.row_start, shard.row_stop)


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_user_shard_map_with_slot_and_batch_axes(layers, check_vma):
    """lookup with a plan inside the user's own shard_map: [batch, seq, n_cols] ids,
    padded to a slot inside."""
    weight, scale, full = layers[SIZES_7]
    tp, edp = 2, 2
    mesh = cpu_mesh(tp=tp, edp=edp)
    plan = ShardPlan(SIZES_7, tp=tp, edp=edp, slot=8)
    ids = random_ids(np.random.default_rng(4), SIZES_7, 4 * 2 * 3).reshape(4, 2, 3, 7)
    spec = P(("dp", "edp"))
    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        fn = jax.jit(
            jax.shard_map(
                lambda i: ej.lookup(table, i[0], plan=plan)[None],
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
                check_vma=check_vma,
            )
        )
        # Read before the table closes: dispatch is asynchronous.
        out = np.asarray(fn(jax.device_put(ids, NamedSharding(mesh, spec))))
    assert out.shape == (4, 2, 3, 7, DIM)
    assert_bitwise(out, unsharded(full, ids))


def test_start_and_done_split_around_other_work(layers):
    """The exchange can run later than the lookup start, with work in between."""
    weight, scale, full = layers[SIZES_7]
    mesh = cpu_mesh(tp=2, edp=4)
    plan = ShardPlan(SIZES_7, tp=2, edp=4)
    ids = random_ids(np.random.default_rng(5), SIZES_7, 4 * 6)
    x = np.arange(4 * 6 * 3, dtype=np.float32).reshape(4 * 6, 3)
    spec = P(("dp", "edp"))

    def step(i, h):
        handle = ej.lookup_start(table, i, plan=plan)
        assert handle.pending and handle.plan == plan  # exchanged at lookup_done
        h = jnp.tanh(h @ jnp.ones((3, 3), h.dtype))  # stands in for the blocks before Engram
        rows = ej.lookup_done(handle)
        return rows, h

    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))
        sh = NamedSharding(mesh, spec)
        rows, _ = jax.block_until_ready(fn(jax.device_put(ids, sh), jax.device_put(x, sh)))
    assert_bitwise(rows, unsharded(full, ids))


def test_two_simulated_nodes(layers):
    """dp across two 'nodes' of 4 devices; the EDP groups stay inside each."""
    mesh = cpu_mesh(tp=2, node_of=lambda d: d.id // 4)
    assert dict(mesh.shape) == {"dp": 2, "edp": 2, "tp": 2}
    for dp in range(2):
        assert {d.id // 4 for d in mesh.devices[dp].flat} == {dp}
    weight, scale, full = layers[SIZES_7]
    plan = ShardPlan(SIZES_7, tp=2, edp=2)
    ids, _ = ej.pad_replicas(
        [random_ids(np.random.default_rng(7), SIZES_7, n) for n in (3, 0, 5, 1)]
    )
    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        out = np.asarray(
            ej.make_sharded_lookup(table, mesh, plan, node_of=lambda d: d.id // 4)(ids)
        )
    assert_bitwise(out, unsharded(full, ids))


# -- per-device tables -----------------------------------------------------------


def test_lookup_reads_each_devices_own_table():
    """One key, eight different tables: one compiled program reads each device's own."""
    rng = np.random.default_rng(8)
    devices = CPUS
    arrays = [random_table_arrays(rng, 4, DIM) for _ in devices]
    tables = {
        d: ej.EngramTable.from_arrays(w, s, row_start=10 * i)
        for i, (d, (w, s)) in enumerate(zip(devices, arrays, strict=True))
    }
    mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
    ids = np.stack([10 * i + np.array([0, 3, 4, -1]) for i in range(len(devices))]).astype(np.int32)
    with ej.ShardedTable(tables) as table:
        fn = jax.jit(
            jax.shard_map(
                lambda i: ej.lookup(table, i), mesh=mesh, in_specs=P("x"), out_specs=P("x")
            )
        )
        out = np.asarray(fn(jax.device_put(ids, NamedSharding(mesh, P("x")))))
    for i, (w, s) in enumerate(arrays):
        assert_bf16_equal(out[i], testing.lookup_reference(w, s, ids[i], row_start=10 * i))
    assert all(t.closed for t in tables.values())


def test_close_unregisters_before_a_compiled_program_runs_again(layers):
    weight, scale, _ = layers[SIZES_7]
    mesh = cpu_mesh(tp=2, edp=2)
    plan = ShardPlan(SIZES_7, tp=2, edp=2)
    table = ej.shard_table_from_arrays(weight, scale, mesh, plan)
    shards = [table.table(d) for d in mesh.devices.flat]
    fn = ej.make_sharded_lookup(table, mesh, plan)
    ids, _ = ej.pad_replicas([random_ids(np.random.default_rng(9), SIZES_7, 4)] * 4)
    fn(ids).block_until_ready()
    table.close()
    table.close()  # a second close does nothing
    assert table.closed and all(s.closed for s in shards)
    with pytest.raises(Exception, match="closed or was never placed"):
        np.asarray(fn(ids))
    with pytest.raises(ValueError, match="closed"):
        ej.make_sharded_lookup(table, mesh, plan)


def test_sharded_table_rejects_bad_tables():
    rng = np.random.default_rng(10)
    d0, d1 = CPUS[:2]
    a = ej.EngramTable.from_arrays(*random_table_arrays(rng, 4, 64))
    b = ej.EngramTable.from_arrays(*random_table_arrays(rng, 4, 32))
    with pytest.raises(ValueError, match="same dim"):
        ej.ShardedTable({d0: a, d1: b})
    with pytest.raises(ValueError, match="at least one"):
        ej.ShardedTable({})
    with pytest.raises(TypeError, match="jax devices"):
        ej.ShardedTable({0: a})
    b.close()
    with pytest.raises(ValueError, match="closed"):
        ej.ShardedTable({d0: b})
    # A failed construction leaves the caller's tables open.
    assert not a.closed
    a.close()


# -- bad input and disagreements ----------------------------------------------------


def test_wrong_shard_for_a_rank_is_caught(layers):
    weight, scale, _ = layers[SIZES_7]
    mesh = cpu_mesh(tp=2, edp=2)
    plan = ShardPlan(SIZES_7, tp=2, edp=2)
    shards = sharding.device_shards(mesh, plan)
    devices = list(mesh.devices.flat)
    tables = {}
    for i, device in enumerate(devices):
        # Devices 1 and 2 get each other's shards.
        shard = shards[devices[{1: 2, 2: 1}.get(i, i)]]
        rows = slice(shard.row_start, shard.row_stop)
        tables[device] = ej.EngramTable.from_arrays(
            weight[rows], scale[rows], row_start=shard.row_start
        )
    with ej.ShardedTable(tables) as table:
        with pytest.raises(ValueError, match=r"cpu:1 \(tp_rank 1, edp_rank 0\) needs rows"):
            ej.make_sharded_lookup(table, mesh, plan)
    # Head shards are too small for shared mode, where each replica reads its
    # TP rank's every column (the other way round they cover it: a superset works).
    shared = ShardPlan(SIZES_7, tp=2, edp=2, mode="shared")
    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        with pytest.raises(ValueError, match="needs rows"):
            ej.make_sharded_lookup(table, mesh, shared)
    with ej.shard_table_from_arrays(weight, scale, mesh, shared) as table:
        ej.make_sharded_lookup(table, mesh, plan)
    # A table missing a device of the mesh.
    part = {d: ej.EngramTable.from_arrays(weight, scale) for d in devices[:4]}
    with ej.ShardedTable(part) as table:
        with pytest.raises(ValueError, match="holds no table"):
            ej.make_sharded_lookup(table, mesh, plan)
    # One whole-layer table serves every rank.
    full = layers[SIZES_7][2]
    ids, _ = ej.pad_replicas([random_ids(np.random.default_rng(11), SIZES_7, 3)] * 4)
    out = ej.make_sharded_lookup(full, mesh, plan)(ids)
    assert_bitwise(out, unsharded(full, ids))


def test_mesh_and_plan_must_agree(layers):
    weight, scale, full = layers[SIZES_7]
    mesh = cpu_mesh(tp=2, edp=2)
    with pytest.raises(ValueError, match="edp=4 but the mesh's axis 'edp' has size 2"):
        ej.make_sharded_lookup(full, mesh, ShardPlan(SIZES_7, tp=2, edp=4))
    with pytest.raises(ValueError, match="tp=1 but the mesh's axis 'tp' has size 2"):
        ej.make_sharded_lookup(full, mesh, ShardPlan(SIZES_7, tp=1, edp=2))
    # Inside a user's shard_map the axis sizes are checked at trace time.
    plan = ShardPlan(SIZES_7, tp=4, edp=2)
    spec = P(("dp", "edp"))
    fn = jax.shard_map(
        lambda i: ej.lookup(full, i, plan=plan), mesh=mesh, in_specs=spec, out_specs=spec
    )
    ids = jax.device_put(np.zeros((8, 7), np.int32), NamedSharding(mesh, spec))
    with pytest.raises(ValueError, match="tp=4 but mesh axis 'tp' has size 2"):
        jax.jit(fn)(ids)
    other = ShardPlan(SIZES_7, tp=2, edp=2, tp_axis="model")
    fn = jax.shard_map(
        lambda i: ej.lookup(full, i, plan=other), mesh=mesh, in_specs=spec, out_specs=spec
    )
    with pytest.raises(ValueError, match="no mesh axis 'model'"):
        jax.jit(fn)(ids)


def test_edp_never_spans_nodes():
    with pytest.raises(ValueError, match="EDP axis 'edp' spans nodes"):
        cpu_mesh(tp=1, edp=8, node_of=lambda d: d.id // 4)
    with pytest.raises(ValueError, match="same number of devices"):
        cpu_mesh(tp=1, node_of=lambda d: d.id < 3)
    with pytest.raises(ValueError, match="do not split"):
        cpu_mesh(tp=3, edp=1)
    # A hand-made mesh whose EDP groups cross the node boundary.
    grid = np.array(CPUS).reshape(2, 4).T.reshape(4, 2, 1)
    mesh = jax.sharding.Mesh(grid, sharding.MESH_AXES)
    with pytest.raises(ValueError, match="spans nodes"):
        sharding.check_mesh(mesh, ShardPlan(SIZES_7, edp=2), node_of=lambda d: d.id // 4)


def test_mesh_defaults_edp_to_every_replica_of_a_node():
    mesh = cpu_mesh(tp=2)
    assert dict(mesh.shape) == {"dp": 1, "edp": 4, "tp": 2}
    assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in CPUS)


def test_token_counts_above_the_slot(layers):
    with pytest.raises(ValueError, match="replica 1 has 5 tokens, more than the token slot 4"):
        ej.pad_replicas([np.zeros((2, 7)), np.zeros((5, 7))], slot=4)
    full = layers[SIZES_7][2]
    mesh = cpu_mesh(tp=1, edp=8)
    plan = ShardPlan(SIZES_7, edp=8, slot=2)
    with pytest.raises(ValueError, match="3 tokens on this replica exceed the token slot of 2"):
        ej.make_sharded_lookup(full, mesh, plan)(np.zeros((24, 7), np.int32))
    with pytest.raises(ValueError, match="with 8 replicas"):
        ej.make_sharded_lookup(full, mesh, ShardPlan(SIZES_7, edp=8))(np.zeros((12, 7), np.int32))
    with pytest.raises(ValueError, match=r"ids must be \[\.\.\., 7\]"):
        ej.make_sharded_lookup(full, mesh, ShardPlan(SIZES_7, edp=8))(np.zeros((8, 6), np.int32))


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        ShardPlan(SIZES_7, mode="rows")
    with pytest.raises(ValueError, match="exchange"):
        ShardPlan(SIZES_7, exchange="ring")
    with pytest.raises(ValueError, match="tp must be"):
        ShardPlan(SIZES_7, tp=0)
    with pytest.raises(ValueError, match="at least one row"):
        ShardPlan((3, 0, 2))
    with pytest.raises(ValueError, match="slot"):
        ShardPlan(SIZES_7, slot=0)


# -- GPU: the per-device registry with CUDA ordinals ----------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "device"])
def test_sharded_lookup_on_gpus(placement):
    gpus = jax.devices("gpu")
    tp = 2 if len(gpus) % 2 == 0 else 1
    mesh = ej.engram_mesh(tp=tp, devices=gpus)
    edp = mesh.shape["edp"]
    rng = np.random.default_rng(12)
    weight, scale = random_table_arrays(rng, sum(SIZES_7), 256)
    plan = ShardPlan(SIZES_7, tp=tp, edp=edp)
    counts = range(5, 5 + len(gpus) // tp)
    ids, _ = ej.pad_replicas([random_ids(rng, SIZES_7, n) for n in counts])
    with ej.shard_table_from_arrays(weight, scale, mesh, plan, placement=placement) as table:
        out = np.asarray(ej.make_sharded_lookup(table, mesh, plan)(ids))
    assert_bf16_equal(out, testing.lookup_reference(weight, scale, ids))


@pytest.mark.gpu
def test_sharded_start_and_done_on_gpus():
    gpus = jax.devices("gpu")
    mesh = ej.engram_mesh(devices=gpus)
    plan = ShardPlan(SIZES_7, edp=mesh.shape["edp"])
    rng = np.random.default_rng(13)
    weight, scale = random_table_arrays(rng, sum(SIZES_7), 256)
    ids = random_ids(rng, SIZES_7, 64 * len(gpus))
    spec = P(("dp", "edp"))

    def step(i):
        return ej.lookup_done(ej.lookup_start(table, i, plan=plan))

    with ej.shard_table_from_arrays(weight, scale, mesh, plan, placement="pinned") as table:
        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
        out = np.asarray(fn(jax.device_put(ids, NamedSharding(mesh, spec))))
    assert_bf16_equal(out, testing.lookup_reference(weight, scale, ids))


# -- two processes through jax.distributed ----------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.distributed.initialize(
        coordinator_address=f"localhost:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1])
    )
    import engram_jax as ej
    from engram_jax import testing

    sizes = (5, 7, 11, 13, 17, 19, 23)
    rng = np.random.default_rng(0)  # the same layer and ids in both processes
    weight = rng.integers(0, 256, (sum(sizes), 64), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0  # no NaN: compare bits plainly
    scale = rng.integers(100, 150, (sum(sizes), 2), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])

    def check(mesh, plan, node_of=None):
        replicas = mesh.size // plan.tp
        per = [
            (rng.integers(0, sizes, (n, 7)) + offsets).astype(np.int32)
            for n in rng.integers(0, 6, replicas)
        ]
        ids, _ = ej.pad_replicas(per, slot=6)
        spec = P(tuple(a for a in mesh.axis_names if a != "tp"))
        global_ids = jax.make_array_from_callback(
            ids.shape, NamedSharding(mesh, spec), lambda index: ids[index]
        )
        with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
            out = ej.make_sharded_lookup(table, mesh, plan, node_of=node_of)(global_ids)
            expected = testing.lookup_reference(weight, scale, ids)
            for shard in out.addressable_shards:
                got = np.asarray(shard.data).view(np.uint16)
                assert np.array_equal(got, expected[shard.index].view(np.uint16)), plan

    # Both processes run on this host: one node of 4 devices, EDP across processes.
    mesh = ej.engram_mesh(tp=2)
    assert dict(mesh.shape) == {"dp": 1, "edp": 2, "tp": 2}, mesh.shape
    check(mesh, ej.ShardPlan(sizes, tp=2, edp=2))
    check(mesh, ej.ShardPlan(sizes, tp=2, edp=2, exchange="all_gather_select"))
    mesh = ej.engram_mesh(tp=1, edp=4)
    check(mesh, ej.ShardPlan(sizes, edp=4))
    # Each process as its own node: dp across processes, EDP inside each.
    by_process = lambda d: d.process_index
    mesh = ej.engram_mesh(tp=1, node_of=by_process)
    assert dict(mesh.shape) == {"dp": 2, "edp": 2, "tp": 1}, mesh.shape
    check(mesh, ej.ShardPlan(sizes, edp=2), node_of=by_process)
    check(mesh, ej.ShardPlan(sizes, edp=2, mode="shared"), node_of=by_process)
    try:
        ej.engram_mesh(tp=1, edp=4, node_of=by_process)
        raise AssertionError("an EDP axis across processes-as-nodes was accepted")
    except ValueError as exc:
        assert "spans nodes" in str(exc)
    jax.distributed.shutdown()
    print("CHILD OK", jax.process_index())
    """
)


def test_two_processes_through_jax_distributed(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for rank, (code, output, _, _) in enumerate(wait_all(procs, 240)):
        assert code == 0 and f"CHILD OK {rank}" in output, output[-3000:]


# -- order and per-shard hot-row caches through the sharded lookup ---------------------

OPTIONS = [("dedup", True), ("sorted", True), ("plain", True), ("dedup", False), ("auto", True)]
CACHED_FITS = [(4, 1, "heads"), (1, 4, "heads"), (2, 4, "heads"), (2, 2, "shared")]


def layer_profile(rng, rows, hot):
    """A profile of `hot` random rows of the whole layer (each shard caches its own)."""
    picked = rng.permutation(rows)[:hot].astype(np.int32)
    return ej.HotRowProfile(picked, np.arange(hot, 0, -1, dtype=np.int64))


@pytest.mark.parametrize("exchange", ["all_to_all", "all_to_all_packed"])
@pytest.mark.parametrize(
    ("tp", "edp", "mode"), CACHED_FITS, ids=[f"tp{t}-edp{e}-{m}" for t, e, m in CACHED_FITS]
)
def test_sharded_lookup_with_per_shard_caches_equals_unsharded(layers, tp, edp, mode, exchange):
    weight, scale, full = layers[SIZES_7]
    rng = np.random.default_rng(20 + tp * 10 + edp)
    mesh = cpu_mesh(tp=tp, edp=edp)
    plan = ShardPlan(SIZES_7, tp=tp, edp=edp, mode=mode, exchange=exchange)
    ids, _ = ej.pad_replicas(
        [random_ids(rng, SIZES_7, int(n)) for n in rng.integers(0, 9, 8 // tp)], slot=8
    )
    expected = unsharded(full, ids)
    profile = layer_profile(rng, plan.num_rows, plan.num_rows // 2)
    with (
        ej.shard_table_from_arrays(weight, scale, mesh, plan) as table,
        ej.HotRowCache(table, 1.0, profile) as hot,
    ):
        for device, shard in sharding.device_shards(mesh, plan).items():
            mine = hot.cached_rows(device)
            assert np.all((mine >= shard.row_start) & (mine < shard.row_stop))
            assert bool(mine.size) == bool(shard.num_rows)
        for order, with_cache in OPTIONS:
            c = hot if with_cache else None
            out = ej.make_sharded_lookup(table, mesh, plan, order=order, cache=c)(ids)
            assert_bitwise(out, expected)


@pytest.mark.parametrize(
    ("exchange", "lookup_target"),
    [("all_to_all", "engram_cached_lookup"), ("all_to_all_packed", "engram_lookup_records")],
)
def test_sharded_start_done_with_caches_in_user_shard_map(layers, exchange, lookup_target):
    weight, scale, full = layers[SIZES_7]
    mesh = cpu_mesh(tp=2, edp=4)
    plan = ShardPlan(SIZES_7, tp=2, edp=4, exchange=exchange)
    rng = np.random.default_rng(40)
    ids = random_ids(rng, SIZES_7, 4 * 6)
    spec = P(("dp", "edp"))
    profile = layer_profile(rng, plan.num_rows, 40)

    def step(i):
        handle = ej.lookup_start(table, i, plan=plan, order="dedup", cache=hot)
        assert handle.pending and handle.order == "dedup" and handle.cache_key == hot.key
        return ej.lookup_done(handle)

    def direct(i):
        return ej.lookup(table, i, plan=plan, order="sorted", cache=hot, max_ctas=2)

    with (
        ej.shard_table_from_arrays(weight, scale, mesh, plan) as table,
        ej.HotRowCache(table, 1.0, profile) as hot,
    ):
        on_mesh = jax.device_put(ids, NamedSharding(mesh, spec))
        for fn, target in ((step, "engram_lookup_start"), (direct, lookup_target)):
            mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))
            # The rows match either way; the program shows that the cache is the one read.
            calls = [
                line
                for line in mapped.lower(on_mesh).as_text().splitlines()
                if f"custom_call @{target}(" in line
            ]
            assert len(calls) == 1 and f"cache_key = {hot.key} " in calls[0]
            assert_bitwise(mapped(on_mesh), unsharded(full, ids))


def test_sharded_lookup_rejects_a_cache_of_another_table_or_devices(layers):
    weight, scale, full = layers[SIZES_7]
    mesh = cpu_mesh(tp=2, edp=2)
    plan = ShardPlan(SIZES_7, tp=2, edp=2)
    profile = layer_profile(np.random.default_rng(41), plan.num_rows, 20)
    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        with ej.HotRowCache(full, 1.0, profile) as whole:  # the unsharded table's
            with pytest.raises(ValueError, match="another table"):
                ej.make_sharded_lookup(table, mesh, plan, cache=whole)
        with ej.HotRowCache(table, 1.0, profile, devices=table.devices[:3]) as partial:
            with pytest.raises(ValueError, match="no copy on"):
                ej.make_sharded_lookup(table, mesh, plan, cache=partial)
        with pytest.raises(ValueError, match="order must be"):
            ej.make_sharded_lookup(table, mesh, plan, order="fastest")
        with pytest.raises(TypeError, match="HotRowCache"):
            ej.make_sharded_lookup(table, mesh, plan, cache=profile)
        spec = P(("dp", "edp"))
        ids = jax.device_put(
            random_ids(np.random.default_rng(42), SIZES_7, 8), NamedSharding(mesh, spec)
        )
        with ej.HotRowCache(full, 1.0, profile) as whole:
            fn = jax.shard_map(
                lambda i: ej.lookup(table, i, plan=plan, cache=whole),
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
            )
            with pytest.raises(ValueError, match="another table"):
                jax.jit(fn)(ids)


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", ["all_to_all", "all_to_all_packed"])
def test_sharded_lookup_with_caches_on_gpus(exchange):
    gpus = jax.devices("gpu")
    tp = 2 if len(gpus) % 2 == 0 else 1
    mesh = ej.engram_mesh(tp=tp, devices=gpus)
    plan = ShardPlan(SIZES_7, tp=tp, edp=mesh.shape["edp"], exchange=exchange)
    rng = np.random.default_rng(43)
    weight, scale = random_table_arrays(rng, sum(SIZES_7), 256)
    ids, _ = ej.pad_replicas([random_ids(rng, SIZES_7, n) for n in range(5, 5 + len(gpus) // tp)])
    expected = testing.lookup_reference(weight, scale, ids)
    spec = P(("dp", "edp"))
    profile = layer_profile(rng, plan.num_rows, plan.num_rows // 2)
    with (
        ej.shard_table_from_arrays(weight, scale, mesh, plan, placement="pinned") as table,
        ej.HotRowCache(table, 0.01, profile) as hot,
    ):
        for order in ("plain", "sorted", "dedup"):
            out = ej.make_sharded_lookup(table, mesh, plan, order=order, cache=hot)(ids)
            assert_bf16_equal(out, expected)

        def step(i):
            handle = ej.lookup_start(table, i, plan=plan, order="dedup", cache=hot)
            return ej.lookup_done(handle)

        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
        flat = random_ids(rng, SIZES_7, 64 * len(gpus) // tp)
        out = fn(jax.device_put(flat, NamedSharding(mesh, spec)))
        assert_bf16_equal(out, testing.lookup_reference(weight, scale, flat))


def test_pad_and_split_replicas_check_their_input():
    with pytest.raises(ValueError, match="slot must be a positive int"):
        ej.pad_replicas([np.zeros((0, 3), np.int32)], slot=0)
    with pytest.raises(ValueError, match="replica counts"):
        ej.split_replicas(np.zeros((0, 3)), [])
    with pytest.raises(ValueError, match="replica counts"):
        ej.split_replicas(np.zeros((5, 3)), [1, 1])
    # A host id past int32 is held by no table: DEAD, not wrapped onto row 1.
    with pytest.warns(UserWarning, match="past the int32 range"):
        ids, counts = ej.pad_replicas([np.array([[2**32 + 1, 4]], np.int64)], slot=2)
    np.testing.assert_array_equal(ids, [[-1, 4], [-1, -1]])
    np.testing.assert_array_equal(counts, [1])


def test_mesh_of_no_devices_says_so():
    with pytest.raises(ValueError, match="at least one device"):
        ej.engram_mesh(devices=[])


# -- where host copies go, and which devices can read a table -------------------------


def test_host_copies_go_to_each_devices_numa_node(layers, monkeypatch):
    weight, scale, full = layers[SIZES_7]
    mesh = cpu_mesh(tp=2, edp=4)
    plan = ShardPlan(SIZES_7, tp=2, edp=4, mode="shared")
    # Stand-in topology: devices 0-3 sit on NUMA node 0, 4-7 on node 1.
    monkeypatch.setattr(
        sharding_tables,
        "_host_node",
        lambda d, placement: d.id // 4 if placement == "numa" else None,
    )
    made = []
    real = ej.EngramTable.from_arrays.__func__

    def from_arrays(cls, weight, scale, *, placement, row_start, device):
        made.append((placement, device, row_start))
        return real(cls, weight, scale, row_start=row_start)  # cpu memory stands in

    monkeypatch.setattr(ej.EngramTable, "from_arrays", classmethod(from_arrays))
    with ej.shard_table_from_arrays(weight, scale, mesh, plan, placement="numa") as table:
        # One copy per (TP rank, node), made for the first device of each, on its node.
        assert sorted(d.id for _, d, _ in made) == [0, 1, 4, 5]
        assert {p for p, _, _ in made} == {"numa"}
        for device in mesh.devices.flat:
            first = CPUS[device.id // 4 * 4 + device.id % 2]
            assert table.table(device) is table.table(first)
        ids, _ = ej.pad_replicas([random_ids(np.random.default_rng(40), SIZES_7, 5)] * 4)
        assert_bitwise(ej.make_sharded_lookup(table, mesh, plan)(ids), unsharded(full, ids))
    made.clear()
    with ej.shard_table_from_arrays(weight, scale, mesh, plan, placement="cpu") as table:
        assert [d for _, d, _ in made] == [None, None]  # no node to pick: one copy per rank


def test_host_node_follows_the_placement(monkeypatch):
    gpu = types.SimpleNamespace(platform="gpu", local_hardware_id=3, process_index=0)
    choice = {"auto": "numa"}
    monkeypatch.setattr(sharding_tables, "gpu_numa_node", lambda ordinal: ordinal // 2)
    monkeypatch.setattr(sharding_tables, "choose_auto", lambda ordinal: (choice["auto"], "why"))
    assert sharding_tables._host_node(gpu, "numa") == 1
    assert sharding_tables._host_node(gpu, "auto") == 1
    choice["auto"] = "hugepage"
    assert sharding_tables._host_node(gpu, "auto") is None
    for placement in ("pinned", "hugepage", "cpu", "device"):
        assert sharding_tables._host_node(gpu, placement) is None
    assert sharding_tables._host_node(CPUS[5], "numa") is None


def _table_in(kind, held_by, rows, dim=DIM):
    """A table whose allocation claims ``kind`` memory held for CUDA ordinal ``held_by``."""
    backing = np.zeros(rows * ej.row_stride(dim), np.uint8)
    allocation = ej.storage.Allocation(
        placement="stand-in",
        address=backing.ctypes.data,
        nbytes=backing.nbytes,
        kind=kind,
        release=lambda: backing,  # keeps the memory alive until the table closes
        device_ordinal=held_by,
    )
    return ej.EngramTable(allocation, num_rows=rows, dim=dim)


def test_gpu_memory_is_refused_for_cpu_devices_whatever_the_ordinals(layers):
    kinds = ej.storage.MemoryKind
    mesh = cpu_mesh(edp=8)
    plan = ShardPlan(SIZES_7, edp=8)
    # GPU 0's memory: cpu:0 has handler ordinal 0 too, but still cannot read it.
    with _table_in(kinds.DEVICE, 0, sum(SIZES_7)) as table:
        with pytest.raises(ValueError, match=r"cpu:0 cannot read .* GPU memory"):
            ej.make_sharded_lookup(table, mesh, plan)
    # Host memory mapped for GPU 3 only is registered under ordinal 3: only cpu:3 would find it.
    with _table_in(kinds.HOST_MAPPED, 3, sum(SIZES_7)) as table:
        with pytest.raises(ValueError, match=r"registered for GPU 3 only; cpu:0 \(ordinal 0\)"):
            ej.make_sharded_lookup(table, mesh, plan)


def test_host_memory_mapped_for_one_gpu_is_refused_for_another():
    kinds = ej.storage.MemoryKind
    gpu1 = types.SimpleNamespace(platform="gpu")
    with _table_in(kinds.HOST_MAPPED, 0, 4) as table:
        with pytest.raises(ValueError, match="is mapped for GPU 0 only"):
            check_readable(gpu1, table, 1)
        check_readable(gpu1, table, 0)
        check_readable(CPUS[1], table, 1)  # the CPU reads host memory whatever the GPUs may
    with _table_in(kinds.DEVICE, 0, 4) as table:
        with pytest.raises(ValueError, match="lives on GPU 0 only"):
            check_readable(gpu1, table, 1)
        with pytest.raises(ValueError, match="GPU memory"):
            check_readable(CPUS[0], table, 0)
    with _table_in(kinds.HOST, None, 4) as table:
        with pytest.raises(ValueError, match="plain host memory"):
            check_readable(gpu1, table, 0)


@pytest.mark.gpu
def test_plain_host_table_on_a_gpu_mesh_is_refused_up_front():
    gpus = jax.devices("gpu")
    mesh = ej.engram_mesh(devices=gpus)
    plan = ShardPlan(SIZES_7, edp=mesh.shape["edp"])
    weight, scale = random_table_arrays(np.random.default_rng(41), sum(SIZES_7), DIM)
    with ej.EngramTable.from_arrays(weight, scale, placement="cpu") as table:
        with pytest.raises(ValueError, match="plain host memory"):
            ej.make_sharded_lookup(table, mesh, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["numa", "auto"])
def test_sharded_host_tables_sit_on_each_gpus_numa_node(placement):
    from engram_jax.storage import _cuda, numa

    gpus = jax.devices("gpu")
    ordinals = [handler_ordinal(d) for d in gpus]
    if not all(
        _cuda.device_attribute(o, "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED") for o in ordinals
    ):
        pytest.skip("the driver has no cuMem host-NUMA support")
    mesh = ej.engram_mesh(devices=gpus)
    plan = ShardPlan(SIZES_7, edp=mesh.shape["edp"], mode="shared")
    rng = np.random.default_rng(42)
    weight, scale = random_table_arrays(rng, sum(SIZES_7), 256)
    ids = random_ids(rng, SIZES_7, 16 * len(gpus))
    with ej.shard_table_from_arrays(weight, scale, mesh, plan, placement=placement) as table:
        for device, ordinal in zip(gpus, ordinals, strict=True):
            allocation = table.table(device).allocation
            assert allocation.placement == "numa"
            assert allocation.info["numa_node"] == numa.gpu_numa_node(ordinal)
        out = np.asarray(ej.make_sharded_lookup(table, mesh, plan)(ids))
    assert_bf16_equal(out, testing.lookup_reference(weight, scale, ids))


# -- several GPUs of one host: real NCCL collectives (skipped below 2 GPUs) ---------------

# NCCL's NVLink multicast stays off here and in every process these tests start.
os.environ["NCCL_NVLS_ENABLE"] = "0"

# (tp, edp) meshes; each runs where the GPU count is a multiple of tp * edp (dp takes the rest).
GPU_FITS = [(2, 1), (1, 2), (2, 2), (1, 4), (4, 1), (2, 4)]
GPU_CASES = [
    ("heads", "all_to_all", "pinned"),
    ("heads", "all_gather_select", "pinned"),
    ("shared", "all_to_all", "pinned"),
    ("heads", "all_to_all", "device"),
    ("heads", "all_to_all_packed", "pinned"),
    ("heads", "all_to_all_packed", "device"),
]


def several_gpus(at_least: int = 2) -> list:
    gpus = jax.devices("gpu")
    if len(gpus) < at_least:
        pytest.skip(f"needs {at_least}+ GPUs on one host; {len(gpus)} visible")
    return gpus


def compiled_collectives(fn, ids) -> set[str]:
    """Collective ops in the compiled program (async ones count under their base name)."""
    text = fn.lower(ids).compile().as_text()
    ops = ("all-to-all", "all-gather", "all-reduce", "collective-permute")
    return {op for op in ops if f" {op}(" in text or f" {op}-start(" in text}


def check_sharded_on(devices, tp, edp, mode, exchange, placement, seed=0):
    """make_sharded_lookup on a (dp, edp, tp) mesh of ``devices``: the mesh has the sizes
    asked for, the program holds the collectives the plan needs (so EDP and TP really
    cross devices), and the rows equal the numpy reference for uneven replicas."""
    mesh = ej.engram_mesh(tp=tp, edp=edp, devices=devices)
    dp = len(devices) // (tp * edp)
    assert dict(mesh.shape) == {"dp": dp, "edp": edp, "tp": tp}
    plan = ShardPlan(SIZES_7, tp=tp, edp=edp, mode=mode, exchange=exchange)
    rng = np.random.default_rng(seed)
    weight, scale = random_table_arrays(rng, sum(SIZES_7), 256)
    counts = rng.integers(0, 9, dp * edp)
    counts[0], counts[-1] = 0, 8  # a replica with no tokens, one filling the slot
    ids, _ = ej.pad_replicas([random_ids(rng, SIZES_7, int(n)) for n in counts], slot=8)
    with ej.shard_table_from_arrays(weight, scale, mesh, plan, placement=placement) as table:
        # Host shards: one table per head shard (dp replicas share it); HBM: one per GPU.
        held = {id(table.table(d)) for d in mesh.devices.flat}
        assert len(held) == (len(devices) if placement == "device" else plan.shards)
        run = ej.make_sharded_lookup(table, mesh, plan)
        found = compiled_collectives(run, ids)
        out = np.asarray(run(ids))
    # (all-gather + select may still be rewritten into an all-to-all by XLA: not checked.)
    edp_rows = mode == "heads" and edp > 1
    if edp_rows and exchange in ("all_to_all", "all_to_all_packed"):
        assert "all-to-all" in found, found
    if not edp_rows:
        assert "all-to-all" not in found, found
    assert ("all-gather" in found) == (edp_rows or tp > 1), found
    if plan.moves_records:  # every collective of rows carries packed uint8 records
        moved = [t for _, result in row_collectives(run, ids) for t, _ in result]
        assert moved and set(moved) == {"u8"}, moved
    assert_bf16_equal(out, testing.lookup_reference(weight, scale, ids))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("mode", "exchange", "placement"), GPU_CASES, ids=["-".join(c) for c in GPU_CASES]
)
@pytest.mark.parametrize(("tp", "edp"), GPU_FITS, ids=[f"tp{t}-edp{e}" for t, e in GPU_FITS])
def test_sharded_lookup_on_several_gpus(tp, edp, mode, exchange, placement):
    """The existing GPU tests pick tp=2 (edp 1) or edp=N (tp 1) from the GPU count;
    this names each mesh, so 2 GPUs run tp=2 and edp=2 each, 4 GPUs tp=2 x edp=2 too."""
    gpus = several_gpus()
    if len(gpus) % (tp * edp):
        pytest.skip(f"{len(gpus)} GPUs do not split into tp * edp = {tp * edp}")
    check_sharded_on(gpus, tp, edp, mode, exchange, placement, seed=tp * 10 + edp)


@pytest.mark.gpu
def test_edp_exchanges_agree_on_gpus():
    """EDP head sharding over every GPU from pinned host shards: every exchange
    (all_to_all, all_gather_select, all_to_all_packed) gives the same bits, in one
    call and split into start/done."""
    gpus = several_gpus()
    outs = [
        check_sharded_on(gpus, 1, len(gpus), "heads", exchange, "pinned", seed=5)
        for exchange in sharding.EXCHANGES
    ]
    for out in outs[1:]:
        assert_bitwise(out, outs[0])
    mesh = ej.engram_mesh(tp=1, edp=len(gpus), devices=gpus)
    rng = np.random.default_rng(6)
    weight, scale = random_table_arrays(rng, sum(SIZES_7), 256)
    ids = random_ids(rng, SIZES_7, 48 * len(gpus))
    spec = P(("dp", "edp"))
    split = []
    for exchange in sharding.EXCHANGES:
        plan = ShardPlan(SIZES_7, edp=len(gpus), exchange=exchange)

        def step(i, plan=plan):
            return ej.lookup_done(ej.lookup_start(table, i, plan=plan))

        with ej.shard_table_from_arrays(weight, scale, mesh, plan, placement="pinned") as table:
            fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
            split.append(np.asarray(fn(jax.device_put(ids, NamedSharding(mesh, spec)))))
    for out in split[1:]:
        assert_bitwise(out, split[0])
    assert_bf16_equal(split[0], testing.lookup_reference(weight, scale, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["pinned", "numa"])
def test_shared_mode_on_gpus(placement):
    """Shared mode over every GPU: one host table per NUMA node (pinned: one in all)
    read by every GPU, no collective at all, rows equal to the reference; and one
    whole-layer pinned table serving head-sharded ranks too."""
    from engram_jax.storage import _cuda, numa

    gpus = several_gpus()
    ordinals = [handler_ordinal(d) for d in gpus]
    if placement == "numa" and not all(
        _cuda.device_attribute(o, "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED") for o in ordinals
    ):
        pytest.skip("the driver has no cuMem host-NUMA support")
    mesh = ej.engram_mesh(tp=1, devices=gpus)
    plan = ShardPlan(SIZES_7, edp=len(gpus), mode="shared")
    rng = np.random.default_rng(7)
    weight, scale = random_table_arrays(rng, sum(SIZES_7), 256)
    ids, _ = ej.pad_replicas([random_ids(rng, SIZES_7, n) for n in range(3, 3 + len(gpus))])
    expected = testing.lookup_reference(weight, scale, ids)
    with ej.shard_table_from_arrays(weight, scale, mesh, plan, placement=placement) as table:
        copies = {id(table.table(d)) for d in gpus}
        nodes = {numa.gpu_numa_node(o) for o in ordinals} if placement == "numa" else {0}
        assert len(copies) == len(nodes)
        run = ej.make_sharded_lookup(table, mesh, plan)
        assert compiled_collectives(run, ids) == set()
        assert_bf16_equal(run(ids), expected)
    heads = ShardPlan(SIZES_7, edp=len(gpus))
    with ej.EngramTable.from_arrays(weight, scale, placement="pinned") as whole:
        assert_bf16_equal(ej.make_sharded_lookup(whole, mesh, heads)(ids), expected)


# One process per GPU through jax.distributed: each holds only its own GPU's head
# shard in pinned memory; NCCL carries the exchange between the processes.
GPU_CHILD = textwrap.dedent(
    """
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(float(sys.argv[5]), exit=True)  # a hang shows where
    rank, size, port, platform = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    extra = {"local_device_ids": [rank]} if platform == "gpu" else {}
    jax.distributed.initialize(
        f"127.0.0.1:{port}", size, rank, initialization_timeout=60, **extra
    )
    import engram_jax as ej
    from engram_jax import testing

    (device,) = jax.local_devices()
    assert device.platform == platform, device
    sizes = (5, 7, 11, 13, 17, 19, 23)
    rng = np.random.default_rng(0)  # the same layer and ids in every process
    weight = rng.integers(0, 256, (sum(sizes), 256), dtype=np.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0  # no NaN: compare bits plainly
    scale = rng.integers(100, 150, (sum(sizes), 8), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    mesh = ej.engram_mesh(tp=1)  # one node: edp = every process's GPU
    assert dict(mesh.shape) == {"dp": 1, "edp": size, "tp": 1}, mesh.shape
    placement = "pinned" if platform == "gpu" else "cpu"
    for kwargs in ({}, {"exchange": "all_gather_select"}, {"mode": "shared"}):
        plan = ej.ShardPlan(sizes, edp=size, **kwargs)
        counts = rng.integers(0, 7, size)
        counts[0] = 0
        per = [(rng.integers(0, sizes, (n, 7)) + offsets).astype(np.int32) for n in counts]
        ids, _ = ej.pad_replicas(per, slot=6)
        spec = P(("dp", "edp"))
        global_ids = jax.make_array_from_callback(
            ids.shape, NamedSharding(mesh, spec), lambda index: ids[index]
        )
        with ej.shard_table_from_arrays(weight, scale, mesh, plan, placement=placement) as table:
            (mine,) = [d for d in mesh.devices.flat if d.process_index == rank]
            lo, hi = table.row_range(mine)
            if plan.mode == "heads":  # this process holds its head shard only
                assert hi - lo < sum(sizes), (lo, hi)
            out = ej.make_sharded_lookup(table, mesh, plan)(global_ids)
            expected = testing.lookup_reference(weight, scale, ids)
            for shard in out.addressable_shards:
                got = np.asarray(shard.data).view(np.uint16)
                assert np.array_equal(got, expected[shard.index].view(np.uint16)), plan
    print("CHILD OK", rank, flush=True)
    jax.distributed.shutdown()
    """
)


def run_one_process_per_device(tmp_path, size, platform, timeout_s=120):
    """GPU_CHILD in ``size`` processes; every output, whatever happened (killed at the bound)."""
    script = tmp_path / "gpu_child.py"
    script.write_text(GPU_CHILD)
    env = child_env(platform)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(rank),
                str(size),
                port,
                platform,
                str(timeout_s - 20),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(size)
    ]
    return [
        (code, output + ("\n[killed at the timeout]" if killed else ""))
        for code, output, _, killed in wait_all(procs, timeout_s)
    ]


@pytest.mark.gpu
def test_one_process_per_gpu_through_jax_distributed(tmp_path):
    gpus = several_gpus()
    results = run_one_process_per_device(tmp_path, len(gpus), "gpu")
    for rank, (code, output) in enumerate(results):
        assert code == 0 and f"CHILD OK {rank}" in output, output[-3000:]


def test_one_process_per_device_script_on_cpu(tmp_path):
    """The GPU test's child, run on the CPU backend (gloo), so the script stays right."""
    results = run_one_process_per_device(tmp_path, 2, "cpu")
    for rank, (code, output) in enumerate(results):
        assert code == 0 and f"CHILD OK {rank}" in output, output[-3000:]
