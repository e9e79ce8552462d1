"""lookup_start / lookup_done where XLA may reuse or copy the start's buffers: ids
that are slices or fusions and die at the start, freed buffers refilled by
temporaries before done, loops, a jitted inner step called twice, vmap, cached
and sharded starts. Hypothesis builds the programs; every prefetched row is
compared bitwise with a plain lookup of a separately computed copy of its ids,
looked up before the start. On the CPU backend (CI) the prefetch is synchronous;
marked gpu: the same programs on CUDA, and a 1,000-step soak with XLA's command
buffers disabled, default and forced.

Run as ``python -m tests.test_prefetch_safety MODE`` it is the soak's GPU worker.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import engram_jax as ej
from engram_jax import DEAD_ID, testing

from ._helpers import COMMAND_BUFFER_MODES, captured_calls, run_gpu_worker, scaled

barrier = jax.lax.optimization_barrier


# -- tables whose rows all differ ------------------------------------------------


def distinct_table_arrays(rows: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """fp8 rows that differ from each other and from a zero row, without NaN, filled fast
    enough for million-row tables: row ``r`` starts with ``r``'s four base-64 digits
    (block 0 at scale 1, so distinct bytes are distinct values), then a random pattern."""
    if rows > 64**4:
        raise ValueError(f"at most {64**4} distinct rows, got {rows}")
    rng = np.random.default_rng(seed)
    magnitude = rng.integers(1, 0x7F, dim, dtype=np.uint8)  # 0x7F is NaN
    pattern = magnitude | (rng.integers(0, 2, dim, dtype=np.uint8) << 7)
    weight = np.empty((rows, dim), np.uint8)
    weight[:] = pattern
    row = np.arange(rows)
    for digit in range(4):
        weight[:, digit] = (row >> (6 * digit)) & 63
    scale = rng.integers(120, 135, (rows, dim // 32), dtype=np.uint8)
    scale[:, 0] = 127
    return weight, scale


def hot_profile(rows: int, seed: int) -> ej.HotRowProfile:
    """A third of the table's rows, as the hot rows of a cache."""
    picked = np.random.default_rng(seed).permutation(rows)[: rows // 3]
    return ej.HotRowProfile.from_counts(picked.astype(np.int32), np.arange(picked.size, 0, -1))


# -- the sharded calls, in one place ---------------------------------------------


def sharded_start(table, ids, plan, **kwargs):
    return ej.lookup_start(table, ids, plan=plan, **kwargs)


def sharded_done(handle):
    return ej.lookup_done(handle)


def sharded_lookup(table, ids, plan):
    return ej.lookup(table, ids, plan=plan)


# -- where the programs run ------------------------------------------------------


class Setup:
    """A backend's tables (one per Engram layer of ``layout``, each row distinct), their
    hot-row caches, a mesh with the sharded tables of each layer, and the program sizes."""

    def __init__(self, device, layout, placement, mesh, tokens, iterations, temp_size, hidden):
        self.device = device
        self.layout = layout
        self.placement = placement
        self.mesh = mesh
        self.tokens = tokens  # per device and step
        self.iterations = iterations  # of every loop
        self.temp_size = temp_size  # side of the square temporaries
        self.hidden = hidden
        self._open: dict = {}

    def plan(self, layer: int) -> ej.ShardPlan:
        return ej.ShardPlan.from_layout(
            self.layout, layer, tp=self.mesh.shape["tp"], edp=self.mesh.shape["edp"]
        )

    def table(self, layer: int, sharded: bool):
        key = ("table", layer, sharded)
        if key not in self._open:
            weight, scale = distinct_table_arrays(
                self.layout.num_embeddings[layer], self.layout.head_dim, layer
            )
            self._open[key] = (
                ej.shard_table_from_arrays(
                    weight, scale, self.mesh, self.plan(layer), placement=self.placement
                )
                if sharded
                else ej.EngramTable.from_arrays(
                    weight, scale, placement=self.placement, device=self.device
                )
            )
        return self._open[key]

    def cache(self, layer: int, sharded: bool) -> ej.HotRowCache:
        key = ("cache", layer, sharded)
        if key not in self._open:
            table = self.table(layer, sharded)
            profile = hot_profile(self.layout.num_embeddings[layer], 100 + layer)
            devices = None if sharded else [self.device]
            self._open[key] = ej.HotRowCache(table, 1.0, profile, devices=devices)
        return self._open[key]

    def close(self) -> None:
        # Caches first: each reads its table.
        for key in sorted(self._open, key=lambda k: k[0] != "cache"):
            self._open[key].close()
        self._open.clear()


def make_layout(engram_vocab_size: int, dim: int) -> ej.EngramLayout:
    """Three Engram layers of 24 hash columns (orders 2-4, 8 heads), as DeepSeek's."""
    return ej.EngramLayout(
        engram_vocab_size,
        layer_ids=(1, 4, 7),
        max_ngram_size=4,
        n_heads=8,
        head_dim=dim,
        compressed_vocab_size=5000,
        pad_id=0,
    )


@pytest.fixture(scope="module")
def cpu_setup():
    cpus = jax.devices("cpu")
    setup = Setup(
        device=cpus[0],
        layout=make_layout(40, 64),
        placement="cpu",
        mesh=ej.engram_mesh(tp=2, devices=cpus),  # (dp 1, edp 4, tp 2): rows cross devices
        tokens=8,
        iterations=3,
        temp_size=64,
        hidden=32,
    )
    yield setup
    setup.close()


@pytest.fixture(scope="module")
def gpu_setup(gpu_device):
    setup = Setup(
        device=gpu_device,
        layout=make_layout(40_000, 256),  # about 10^6 rows per layer
        placement="pinned",
        mesh=ej.engram_mesh(devices=[gpu_device]),
        tokens=1024,
        iterations=4,
        temp_size=2048,
        hidden=256,
    )
    yield setup
    setup.close()


# -- ids made on the device -------------------------------------------------------


def token_ids(seed: jax.Array, count: int, vocab: int) -> jax.Array:
    """Tokens of a step from its seed: every other one from a short cycle (repeated
    n-grams, so dedup has work), the rest spread over the vocabulary."""
    index = jnp.arange(count, dtype=jnp.int32)
    spread = (seed * 7919 + index * 104_729) % vocab
    return jnp.where(index % 2 == 0, (index // 2) % 5 + 1, spread).astype(jnp.int32)


def remap(layout: ej.EngramLayout, hashed: jax.Array, layer: int, seed: jax.Array) -> jax.Array:
    """Arithmetic on one layer's hash output ``[T, n_cols]``: each id moved by the seed
    within its own column's rows (so sharded lookups find it), about 1 in 13 made DEAD."""
    sizes = jnp.asarray(layout.column_sizes[layer], jnp.int32)
    offsets = jnp.asarray(layout.offsets[layer], jnp.int32)
    moved = offsets + (hashed - offsets + seed * (2 * layer + 1)) % sizes
    dead = (hashed < 0) | ((hashed + seed) % 13 == 0)
    return jnp.where(dead, DEAD_ID, moved)


def layer_ids(layout, seed, replica, count, layers) -> list[jax.Array]:
    """Each Engram layer's ids ``[count, n_cols]`` for one step, as fusions of the hash."""
    tokens = token_ids(seed + 1000 * replica, count, layout.compressed_vocab_size)
    hashed = ej.hash_ngrams(layout, tokens)  # [count, n_layers, n_cols]
    return [remap(layout, hashed[:, layer], layer, seed) for layer in range(layers)]


# -- program shapes ---------------------------------------------------------------

IDS = ("slice", "fusion")
USES = ("once", "shared", "reused")
LOOPS = ("none", "scan", "fori_loop", "inner_jit", "vmap")


@dataclasses.dataclass(frozen=True)
class Shape:
    """How one generated program uses the prefetch.

    ``ids``: ``slice`` (each layer's ids a slice of one ``[L, T, H]`` array) or
    ``fusion`` (each layer's ids arithmetic on the hash output). ``use``: ``once`` (read
    by their start alone: they die there), ``shared`` (one ids array for every start,
    at least two) or ``reused`` (also read after the start). ``layers``: Engram layers,
    each one start on the shared side stream, done at its own block. ``loop``: one
    step, or several with fresh ids each in ``scan``, ``fori_loop``, a jitted inner
    step called per iteration (one trace, so the copies carry the same call-site
    attributes) or ``vmap``. ``temporaries``: buffers the size of the ids and the
    rows, and square matmuls, made between start and done. ``order``, ``cache``,
    ``max_ctas``: the start's arguments; ``sharded``: a sharded start in ``shard_map``.
    """

    ids: str = "slice"
    use: str = "once"
    layers: int = 2
    loop: str = "none"
    temporaries: bool = True
    order: str = "plain"
    cache: bool = False
    sharded: bool = False
    max_ctas: int | None = None


shapes = st.builds(
    Shape,
    ids=st.sampled_from(IDS),
    use=st.sampled_from(USES),
    layers=st.integers(1, 3),
    loop=st.sampled_from(LOOPS),
    temporaries=st.booleans(),
    order=st.sampled_from(("plain", "dedup")),
    cache=st.booleans(),
    sharded=st.booleans(),
    max_ctas=st.sampled_from((None, 1)),
)


def row_counts(got: jax.Array, want: jax.Array) -> jax.Array:
    """int32 ``[rows that differ bitwise, rows of want that are not zero]``."""
    got_bits = jax.lax.bitcast_convert_type(got, jnp.uint16)
    want_bits = jax.lax.bitcast_convert_type(want, jnp.uint16)
    differ = jnp.any(got_bits != want_bits, axis=-1)
    held = jnp.any(want_bits != 0, axis=-1)
    return jnp.stack([jnp.sum(differ, dtype=jnp.int32), jnp.sum(held, dtype=jnp.int32)])


def temporaries(x: jax.Array, ids_shape: tuple[int, ...], dim: int, size: int) -> jax.Array:
    """Buffers XLA may place where a freed ids or rows buffer was, filled from ``x`` (so
    after the start), and matmuls that let XLA's stream run ahead of the gather."""
    fill = (x[0, 0] * 1e3).astype(jnp.int32)
    junk_ids = jnp.arange(np.prod(ids_shape), dtype=jnp.int32).reshape(ids_shape) * 7 + fill
    junk_rows = jnp.full(ids_shape + (dim,), x[0, 0], jnp.bfloat16)
    junk_ids, junk_rows = barrier((junk_ids, junk_rows))  # written out, not fused away
    square = jnp.full((size, size), x[0, 0], x.dtype) + jnp.eye(size, dtype=x.dtype)
    for _ in range(2):
        square = jnp.tanh(square @ square)
    spill = (jnp.sum(junk_ids % 3) + jnp.sum(junk_rows.astype(jnp.int32))).astype(x.dtype)
    return x + 1e-9 * spill + 1e-6 * jnp.mean(square)


def build_program(shape: Shape, setup: Setup):
    """``(seeds [n], x [T, hidden]) -> int32 [differing rows, held rows]`` summed over
    the program's steps and starts (per device when sharded)."""
    layout = setup.layout
    shared = shape.use == "shared"
    starts = max(shape.layers, 2) if shared else shape.layers
    layers = 1 if shared else shape.layers
    cache = setup.cache if shape.cache else (lambda layer, sharded: None)
    kwargs = [
        dict(order=shape.order, cache=cache(layer, shape.sharded), max_ctas=shape.max_ctas)
        for layer in range(layers)
    ]
    tables = [setup.table(layer, shape.sharded) for layer in range(layers)]
    site = [0] * starts if shared else list(range(starts))
    plans = [setup.plan(layer) for layer in range(layers)]

    def start(k, ids):
        table, kw = tables[site[k]], kwargs[site[k]]
        if shape.sharded:
            return sharded_start(table, ids, plans[site[k]], **kw)
        return ej.lookup_start(table, ids, **kw)

    def done(handle):
        return sharded_done(handle) if shape.sharded else ej.lookup_done(handle)

    def plain(k, ids):
        table = tables[site[k]]
        if shape.sharded:
            return sharded_lookup(table, ids, plans[site[k]])
        return ej.lookup(table, ids)

    rng = np.random.default_rng(0)
    weights = [
        rng.standard_normal((setup.hidden, setup.hidden)).astype(np.float32) / setup.hidden**0.5
        for _ in range(starts + 1)
    ]

    def ids_of(seed, replica):
        per_layer = layer_ids(layout, seed, replica, setup.tokens, layers)
        if shape.ids == "slice":
            stacked = barrier(jnp.stack(per_layer))  # one [L, T, H] buffer
            per_layer = [stacked[layer] for layer in range(layers)]
        return per_layer * starts if shared else per_layer

    def step(x, seed):
        replica = jax.lax.axis_index(setup.mesh.axis_names[1]) if shape.sharded else 0
        seed = seed + (x[0, 0] > 1e30).astype(jnp.int32)  # never 1: no hoisting out of loops
        # The reference first, from ids computed apart; nothing reads the started ids
        # again (but done's operand), unless the shape shares them.
        copies = ids_of(seed, replica)
        want = [plain(k, copies[k]) for k in range(starts)]
        seed, x, want = barrier((seed, x, want))
        ids = ids_of(seed, replica)
        handles = [start(k, ids[k]) for k in range(starts)]
        if shape.use == "reused":  # read again after the start, below
            x, handles, ids = barrier((x, handles, ids))
        else:
            x, handles = barrier((x, handles))
            del ids
        counts = jnp.zeros(2, jnp.int32)
        for block, weight in enumerate(weights):
            if shape.temporaries:
                x = temporaries(x, copies[0].shape, layout.head_dim, setup.temp_size)
            if block > 0:
                k = block - 1
                x, handle = barrier((x, handles[k]))
                rows = done(handle)
                counts += row_counts(rows, want[k])
                x = x + jnp.mean(rows.astype(jnp.float32), axis=(-2, -1))[:, None]
                if shape.use == "reused":
                    x = x + jnp.mean((ids[k] >= 0).astype(jnp.float32))
            x = jnp.tanh(x @ weight)
        return x, counts

    def program(seeds, x):
        if shape.loop == "none":
            return step(x, seeds[0])[1]
        if shape.loop == "scan":
            return jnp.sum(jax.lax.scan(step, x, seeds)[1], axis=0)
        if shape.loop == "fori_loop":

            def body(i, carry):
                x, counts = step(carry[0], seeds[i])
                return x, carry[1] + counts

            return jax.lax.fori_loop(0, seeds.shape[0], body, (x, jnp.zeros(2, jnp.int32)))[1]
        if shape.loop == "inner_jit":
            inner = jax.jit(step)
            total = jnp.zeros(2, jnp.int32)
            for i in range(seeds.shape[0]):
                x, counts = inner(x, seeds[i])
                total += counts
            return total
        return jnp.sum(jax.vmap(step, in_axes=(None, 0))(x, seeds)[1], axis=0)

    if not shape.sharded:
        return jax.jit(program), starts
    mapped = jax.shard_map(
        lambda seeds, x: program(seeds, x)[None],
        mesh=setup.mesh,
        in_specs=(P(), P()),
        out_specs=P(tuple(setup.mesh.axis_names)),
        check_vma=False,  # the carried state becomes per-device inside loops
    )
    return jax.jit(mapped), starts


START_TARGETS = ("engram_lookup_start",)
LOOKUP_TARGETS = ("engram_lookup", "engram_cached_lookup")


def ffi_operands(jaxpr, targets) -> set:
    """The ids operands of every ``targets`` call in ``jaxpr`` and the jaxprs inside it."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ffi_call" and eqn.params["target_name"] in targets:
            found.add(eqn.invars[0])
        for inner in jaxprs_in_params(eqn.params):
            found |= ffi_operands(inner, targets)
    return found


def run_shape(shape: Shape, setup: Setup) -> None:
    program, starts = build_program(shape, setup)
    steps = 1 if shape.loop == "none" else setup.iterations
    seeds = np.arange(11, 11 + steps, dtype=np.int32)
    x = np.full((setup.tokens, setup.hidden), 0.5, np.float32)
    if shape.sharded:
        replicated = NamedSharding(setup.mesh, P())
        seeds, x = (jax.device_put(a, replicated) for a in (seeds, x))
        devices = setup.mesh.size
    else:
        seeds, x = (jax.device_put(a, setup.device) for a in (seeds, x))
        devices = 1
    traced = program.trace(seeds, x)
    started = ffi_operands(traced.jaxpr.jaxpr, START_TARGETS)
    assert started and not started & ffi_operands(traced.jaxpr.jaxpr, LOOKUP_TARGETS), (
        "the reference lookup must read its own copy of the ids, not the started ones"
    )
    counts = np.asarray(traced.lower().compile()(seeds, x)).reshape(-1, 2).sum(axis=0)
    rows = steps * starts * setup.tokens * setup.layout.n_cols * devices
    differ, held = int(counts[0]), int(counts[1])
    assert differ == 0, f"{differ} of {rows} prefetched rows differ from lookup's ({shape})"
    # Ids that mostly name held rows: a zero row (a garbage id) cannot pass for one.
    assert held > rows // 2, (held, rows, shape)


# Explicit shapes: every loop kind, every kind of start, ids of each kind and use.
EXAMPLES = [
    Shape(max_ctas=1),
    Shape(ids="fusion", layers=3, loop="scan"),
    Shape(layers=3, loop="fori_loop", order="dedup"),
    Shape(loop="inner_jit", cache=True, max_ctas=1),
    Shape(loop="vmap"),
    Shape(use="shared", layers=1, loop="scan", order="dedup", cache=True),
    Shape(use="reused", loop="fori_loop", temporaries=False),
    Shape(loop="scan", sharded=True),
    Shape(ids="fusion", layers=3, loop="fori_loop", order="dedup", cache=True, sharded=True),
]


def with_examples(test):
    for shape in reversed(EXAMPLES):
        test = example(shape=shape)(test)
    return test


# -- CPU (CI) -----------------------------------------------------------------------


@settings(max_examples=3, deadline=None)
@with_examples
@given(shape=shapes)
def test_program_shapes(cpu_setup, shape):
    with jax.default_device(cpu_setup.device):
        run_shape(shape, cpu_setup)


def test_inner_jit_copies_share_their_call_site(cpu_setup):
    """The premise of the ``inner_jit`` shape: jax traces the inner step once, so both
    copies in the compiled program carry the same slot (completion event)."""
    shape = Shape(ids="fusion", loop="inner_jit", temporaries=False)
    program, _ = build_program(shape, cpu_setup)
    with jax.default_device(cpu_setup.device):
        seeds = np.arange(2, dtype=np.int32)
        x = np.zeros((cpu_setup.tokens, cpu_setup.hidden), np.float32)
        text = program.lower(seeds, x).compile().as_text()
    slots = re.findall(r'custom_call_target="engram_lookup_start".*?slot = (-?\d+)', text)
    assert len(slots) == 2 * shape.layers, text
    assert len(set(slots)) == shape.layers, slots


def test_distinct_tables_have_no_equal_rows():
    weight, scale = distinct_table_arrays(5000, 64, 3)
    rows = testing.lookup_reference(weight, scale, np.arange(5000)).view(np.uint16)
    assert not np.isnan(rows.astype(np.float32)).any()
    assert len(np.unique(rows, axis=0)) == 5000
    assert np.all(np.any(rows != 0, axis=1))


# -- GPU ------------------------------------------------------------------------------


# No shrinking: each program compiles anew, and a failing shape is small already.
@pytest.mark.gpu
@settings(max_examples=scaled(15), deadline=None, phases=(Phase.explicit, Phase.generate))
@with_examples
@given(shape=shapes)
def test_gpu_program_shapes(gpu_setup, shape):
    with jax.default_device(gpu_setup.device):
        run_shape(shape, gpu_setup)


SOAK_STEPS = scaled(1000)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(COMMAND_BUFFER_MODES))
def test_gpu_soak(mode):
    result = run_gpu_worker("tests.test_prefetch_safety", mode)
    assert result["steps"] == SOAK_STEPS and result["differ"] == 0, result
    assert result["held"] > result["rows"] // 2, result
    if mode == "disabled":
        assert not any(result["captured"].values()), result
    if mode == "forced":  # the mode took effect: the hash went into XLA's graphs
        assert result["captured"]["engram_ngram_hash"] > 0, result


def _soak_worker(mode: str) -> dict:
    """1,000 decode-like steps: three Engram layers at blocks 1, 4 and 7 of an MLP
    stack, their ids sliced from one ``[3, B, 24]`` array hashed on the device from
    the step's tokens, started before block 0 and done at their blocks, with
    temporaries in between; every row compared with a plain lookup made before the
    starts from ids hashed apart."""
    device = jax.devices("gpu")[0]
    layout = make_layout(40_000, 256)
    tokens, hidden, blocks = 1024, 1024, 9
    tables = [
        ej.EngramTable.from_arrays(
            *distinct_table_arrays(layout.num_embeddings[layer], 256, layer),
            placement="pinned",
            device=device,
        )
        for layer in range(layout.n_layers)
    ]
    rng = np.random.default_rng(14)
    weights = [
        jnp.asarray(rng.standard_normal((hidden, hidden)) / hidden**0.5, jnp.bfloat16)
        for _ in range(blocks)
    ]
    embed = jnp.asarray(rng.standard_normal((layout.compressed_vocab_size, hidden)), jnp.bfloat16)

    def sliced_ids(tokens_):
        hashed = ej.hash_ngrams(layout, tokens_)
        seed = tokens_[0]
        # One buffer, as a kernel hashing every layer at once writes it (XLA would
        # otherwise fuse each slice of the stack into its own fusion).
        return barrier(jnp.stack([remap(layout, hashed[:, i], i, seed) for i in range(3)]))

    def step(x, tokens_):
        copies = sliced_ids(tokens_)
        want = [ej.lookup(tables[i], copies[i]) for i in range(3)]
        tokens_, want = barrier((tokens_, want))
        ids = sliced_ids(tokens_)  # [3, B, 24], one buffer; each start reads a slice
        handles = [ej.lookup_start(tables[i], ids[i]) for i in range(3)]
        x = x + embed[tokens_]
        x, handles = barrier((x, handles))
        counts = jnp.zeros(2, jnp.int32)
        for block, weight in enumerate(weights):
            x = temporaries(x, ids.shape[1:], 256, hidden)
            if block in layout.layer_ids:
                i = layout.layer_ids.index(block)
                x, handle = barrier((x, handles[i]))
                rows = ej.lookup_done(handle)
                counts += row_counts(rows, want[i])
                x = x + jnp.mean(rows, axis=-2)[:, :1].astype(x.dtype)
            x = jnp.tanh(x @ weight)
        return x, counts

    jitted = jax.jit(step)
    x = jax.device_put(jnp.zeros((tokens, hidden), jnp.bfloat16), device)
    all_tokens = rng.integers(0, layout.compressed_vocab_size, (SOAK_STEPS, tokens), np.int32)
    counts = []
    for tokens_ in all_tokens:
        x, step_counts = jitted(x, tokens_)
        counts.append(step_counts)
    differ, held = np.sum(np.stack(jax.device_get(counts)), axis=0)
    for table in tables:
        table.close()
    return {
        "mode": mode,
        "steps": SOAK_STEPS,
        "rows": SOAK_STEPS * 3 * tokens * layout.n_cols,
        "differ": int(differ),
        "held": int(held),
        "captured": captured_calls(),
    }


if __name__ == "__main__":
    print(json.dumps(_soak_worker(sys.argv[1])))
