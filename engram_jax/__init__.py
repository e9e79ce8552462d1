"""engram_jax: Engram memory tables larger than GPU memory, for jitted JAX models.

Tables live in host memory (or HBM, or plain CPU memory); ``lookup`` gathers
the fp8 rows a step needs over PCIe and returns them as bf16, inside jit;
``TrainableTable`` and ``apply_gradients`` train float32 / bfloat16 tables in place.
"""

from importlib import metadata as _metadata

from engram_jax._format import (
    BLOCK_SIZE,
    DEAD_ID,
    narrow_ids,
    pack_records,
    packed_record_bytes,
    row_stride,
    unpack_records,
)
from engram_jax.checkpoint import (
    Checkpoint,
    CheckpointError,
    dummy_table,
    load_table,
    save_checkpoint,
)
from engram_jax.export import export_table, quantize_rows
from engram_jax.hashing import (
    commit_state,
    hash_draft,
    hash_ngrams,
    hash_step,
    init_state,
    update_state,
)
from engram_jax.hot_rows import HotRowCache, HotRowProfile
from engram_jax.layer import (
    EngramLayerConfig,
    EngramParams,
    engram_layer,
    engram_layer_step,
    init_conv_state,
    init_engram_params,
    params_from_deepseek,
    token_mask_from_ids,
)
from engram_jax.layout import EngramLayout, TokenCompressor
from engram_jax.ops import (
    ORDERS,
    PREFETCH_ORDER,
    LookupHandle,
    decode_records,
    lookup,
    lookup_done,
    lookup_records,
    lookup_start,
    make_sharded_lookup,
    prefetch_ctas,
)
from engram_jax.row_optimizers import RowOptimizer, adagrad, lazy_adam, row_adagrad, sgd
from engram_jax.sharded_table import ShardedTable
from engram_jax.sharding import (
    HeadShard,
    ShardPlan,
    engram_mesh,
    head_shards,
    pad_replicas,
    shard_table_from_arrays,
    split_replicas,
)
from engram_jax.storage import (
    PLACEMENTS,
    CudaUnavailableError,
    NodeGroup,
    SharedTableError,
    allocate_shared,
    can_share_tables,
)
from engram_jax.table import EngramTable
from engram_jax.trainable import TrainableTable
from engram_jax.trainable_sharded import ShardedTrainableTable, shard_trainable_from_array
from engram_jax.training import (
    UPDATE_CTAS,
    UpdateHandle,
    apply_gradients,
    apply_gradients_done,
    apply_gradients_start,
    make_sharded_update,
)

try:
    __version__ = _metadata.version("engram_jax")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BLOCK_SIZE",
    "Checkpoint",
    "CheckpointError",
    "CudaUnavailableError",
    "DEAD_ID",
    "EngramLayerConfig",
    "EngramLayout",
    "EngramParams",
    "EngramTable",
    "HeadShard",
    "HotRowCache",
    "HotRowProfile",
    "LookupHandle",
    "NodeGroup",
    "ORDERS",
    "PLACEMENTS",
    "PREFETCH_ORDER",
    "RowOptimizer",
    "ShardPlan",
    "ShardedTable",
    "ShardedTrainableTable",
    "SharedTableError",
    "TokenCompressor",
    "TrainableTable",
    "UPDATE_CTAS",
    "UpdateHandle",
    "adagrad",
    "allocate_shared",
    "apply_gradients",
    "apply_gradients_done",
    "apply_gradients_start",
    "can_share_tables",
    "commit_state",
    "decode_records",
    "dummy_table",
    "engram_layer",
    "engram_layer_step",
    "engram_mesh",
    "export_table",
    "hash_draft",
    "hash_ngrams",
    "hash_step",
    "head_shards",
    "init_conv_state",
    "init_engram_params",
    "init_state",
    "lazy_adam",
    "load_table",
    "lookup",
    "lookup_done",
    "lookup_records",
    "lookup_start",
    "make_sharded_lookup",
    "make_sharded_update",
    "narrow_ids",
    "pack_records",
    "packed_record_bytes",
    "pad_replicas",
    "params_from_deepseek",
    "prefetch_ctas",
    "quantize_rows",
    "row_adagrad",
    "row_stride",
    "save_checkpoint",
    "sgd",
    "shard_table_from_arrays",
    "shard_trainable_from_array",
    "split_replicas",
    "token_mask_from_ids",
    "unpack_records",
    "update_state",
]
