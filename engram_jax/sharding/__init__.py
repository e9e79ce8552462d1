"""engram_jax.sharding: Engram lookups spread over a device mesh.

:mod:`~engram_jax.sharding.plan` (which columns and rows each device holds),
:mod:`~engram_jax.sharding.exchange` (the collectives around a lookup with a
plan inside ``shard_map``: TP column gather; node-local EDP head sharding with
an all-to-all row exchange; shared host tables), :mod:`~engram_jax.sharding.mesh`
(a mesh whose EDP axis never spans two nodes), :mod:`~engram_jax.sharding.tables`
(each device's head shard) and :mod:`~engram_jax.sharding.replicas` (one block
of tokens per replica):

    mesh = engram_mesh(tp=2)                          # (dp, edp, tp); edp = replicas per node
    plan = ShardPlan.from_layout(layout, 0, tp=2, edp=mesh.shape["edp"])
    table = shard_table_from_arrays(weight, scale, mesh, plan)   # each device's head shard
    rows = make_sharded_lookup(table, mesh, plan)(ids)           # [replicas * slot, n_cols, dim]
"""

from engram_jax.sharding.exchange import ShardedBatch, exchange_rows, gather_ids
from engram_jax.sharding.mesh import (
    MESH_AXES,
    NodeOf,
    check_mesh,
    default_node_of,
    device_shards,
    engram_mesh,
)
from engram_jax.sharding.plan import (
    EXCHANGES,
    MODES,
    HeadShard,
    ShardPlan,
    column_sizes,
    head_shard,
    head_shards,
)
from engram_jax.sharding.replicas import map_over_replicas, pad_replicas, split_replicas
from engram_jax.sharding.tables import (
    Table,
    build_device_shards,
    check_mesh_cache,
    check_table,
    shard_table_from_arrays,
)

__all__ = [
    "EXCHANGES",
    "HeadShard",
    "MESH_AXES",
    "MODES",
    "NodeOf",
    "ShardPlan",
    "ShardedBatch",
    "Table",
    "build_device_shards",
    "check_mesh",
    "check_mesh_cache",
    "check_table",
    "column_sizes",
    "default_node_of",
    "device_shards",
    "engram_mesh",
    "exchange_rows",
    "gather_ids",
    "head_shard",
    "head_shards",
    "map_over_replicas",
    "pad_replicas",
    "shard_table_from_arrays",
    "split_replicas",
]
