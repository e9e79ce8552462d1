"""Sharded training on eight CPU devices: a ShardedTrainableTable read with a
ShardPlan (TP heads, EDP head sharding, shared tables, copies over dp) and
updated through make_sharded_update / apply_gradients(plan=...) (or its start
and done), whose gradient rows travel back to the owning shard through the
transpose of the row exchange. Every sharded update must equal the unsharded update of the same
table with the same ids and gradients, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import engram_jax as ej

SIZES = (29, 31, 37, 41, 43)
CPUS = jax.devices("cpu")


def _ids(rng, tokens):
    offsets = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    ids = rng.integers(0, SIZES, (tokens, len(SIZES))) + offsets
    ids[rng.random(ids.shape) < 0.1] = ej.DEAD_ID
    half = tokens // 2
    ids[:half] = ids[half : 2 * half]  # repeats within and across replicas
    return ids.astype(np.int32)


def _unsharded(weight, opt, ids, grads, lr, step):
    with jax.default_device(CPUS[0]):
        with ej.TrainableTable.from_array(weight, optimizer=opt, placement="cpu") as table:
            jax.block_until_ready(
                jax.jit(lambda i, g: ej.apply_gradients(table, i, g, lr, step=step))(ids, grads)
            )
            return table.read_rows(np.arange(weight.shape[0])), table.state()


def _sharded_rows(table, mesh, plan, rows):
    """Every row of the layer as the devices' tables hold it (the first device holding
    each row), after checking that copies of a row agree."""
    out = {}
    for device, shard in ej.sharding.device_shards(mesh, plan).items():
        got = table.table(device).read_rows(np.arange(shard.row_start, shard.row_stop))
        for k, row in enumerate(range(shard.row_start, shard.row_stop)):
            if row in out:
                np.testing.assert_array_equal(out[row], got[k])  # copies agree
            out[row] = got[k]
    return np.stack([out[r] for r in range(rows)])


@pytest.mark.parametrize(
    "tp, edp, mode, placement_dp",
    [
        (1, 1, "heads", 1),
        (2, 1, "heads", 1),
        (2, 2, "heads", 1),
        (1, 4, "heads", 2),
        (2, 2, "shared", 2),
        (4, 2, "heads", 1),
        (1, 2, "heads", 4),
    ],
)
@pytest.mark.parametrize("opt", [ej.sgd(), ej.row_adagrad(), ej.lazy_adam()], ids=lambda o: o.name)
def test_sharded_update_equals_unsharded(tp, edp, mode, placement_dp, opt):
    devices = CPUS[: tp * edp * placement_dp]
    mesh = ej.engram_mesh(tp=tp, edp=edp, devices=devices)
    plan = ej.ShardPlan(SIZES, tp=tp, edp=edp, mode=mode)
    replicas = edp * placement_dp
    rng = np.random.default_rng(tp * 10 + edp + placement_dp)
    rows = sum(SIZES)
    weight = rng.normal(size=(rows, 8)).astype(np.float32)
    slot = 6
    ids = _ids(rng, replicas * slot)
    grads = rng.normal(size=ids.shape + (8,)).astype(np.float32)
    expected, expected_state = _unsharded(weight, opt, ids, grads, 0.1, 2)
    with ej.shard_trainable_from_array(weight, mesh, plan, optimizer=opt) as table:
        lookup = ej.make_sharded_lookup(table, mesh, plan)
        np.testing.assert_array_equal(
            lookup(ids), weight[np.maximum(ids, 0)] * (ids >= 0)[..., None]
        )
        token = ej.make_sharded_update(table, mesh, plan)(ids, grads, 0.1, 2)
        assert token.shape == ()
        np.testing.assert_array_equal(_sharded_rows(table, mesh, plan, rows), expected)
        np.testing.assert_array_equal(
            lookup(ids), expected[np.maximum(ids, 0)] * (ids >= 0)[..., None]
        )


@pytest.mark.parametrize("background", [False, True], ids=["apply_gradients", "start_done"])
def test_train_step_in_shard_map_lookup_grad_update(background):
    # The step as a user writes it: lookup with the plan, grad of a loss, update with it
    # (at once, or through apply_gradients_start / apply_gradients_done with the plan).
    mesh = ej.engram_mesh(tp=2, edp=2, devices=CPUS[:4])
    plan = ej.ShardPlan(SIZES, tp=2, edp=2)
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(sum(SIZES), 8)).astype(np.float32)
    ids = _ids(rng, 2 * 5)
    spec = P(("dp", "edp"))
    with ej.shard_trainable_from_array(weight, mesh, plan, optimizer=ej.sgd()) as table:

        def body(ids):
            rows = ej.lookup(table, ids, plan=plan)
            grads = jax.grad(lambda r: jnp.sum(r**2))(rows)
            if background:
                handle = ej.apply_gradients_start(table, ids, grads, 0.5, plan=plan, after=rows)
                token = ej.apply_gradients_done(handle)
            else:
                token = ej.apply_gradients(table, ids, grads, 0.5, plan=plan, after=rows)
            return ej.lookup(table, ids, plan=plan, after=token)

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
        after = np.asarray(step(jax.device_put(ids, jax.sharding.NamedSharding(mesh, spec))))
        grads = 2 * weight[np.maximum(ids, 0)] * (ids >= 0)[..., None]
        expected, _ = _unsharded(weight, ej.sgd(), ids, grads, 0.5, None)
        np.testing.assert_array_equal(after, expected[np.maximum(ids, 0)] * (ids >= 0)[..., None])


def test_one_table_shared_by_several_devices_is_refused_for_a_sharded_update():
    mesh = ej.engram_mesh(tp=1, edp=2, devices=CPUS[:2])
    plan = ej.ShardPlan(SIZES, edp=2, mode="shared")
    weight = np.zeros((sum(SIZES), 4), np.float32)
    with jax.default_device(CPUS[0]):
        with ej.TrainableTable.from_array(weight, optimizer=ej.sgd(), placement="cpu") as table:
            update = ej.make_sharded_update(table, mesh, plan)
            with pytest.raises(ValueError, match="ShardedTrainableTable"):
                update(np.zeros((4, 5), np.int32), np.zeros((4, 5, 4), np.float32), 0.1)
            with pytest.raises(ValueError, match="packed exchange"):
                ej.make_sharded_update(
                    table, mesh, ej.ShardPlan(SIZES, edp=2, exchange="all_to_all_packed")
                )
