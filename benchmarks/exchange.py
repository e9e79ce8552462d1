"""Bytes each rank sends per step in the EDP row exchange: all-to-all (this
project) vs all-gather + select (the reference system) vs the all-to-all of
packed fp8 records (264 bytes a row, decoded after the exchange), edp 2/4/8,
4,096 tokens per replica of 24 x 256-dim rows. Computed from the layout and
measured from the collectives of the compiled HLO (CPU virtual devices, no timing).

Run: python benchmarks/exchange.py  ->  benchmarks/results/exchange.json
"""

from __future__ import annotations

import os

# Eight virtual CPU devices, before jax is imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from importlib import metadata  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import engram_jax as ej  # noqa: E402

TOKENS = 4096  # per replica
N_COLS = 24  # DeepSeek-V4.1: orders 2-4 x 8 heads
DIM = 256
EDPS = (2, 4, 8)
# Small per-column tables: only the shapes reach the compiled program.
SIZES = tuple([31] * N_COLS)
RESULT = pathlib.Path(__file__).parent / "results" / "exchange.json"

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2}
BYTES.update({"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8})
# Bytes per element as the program sends them: the CPU backend widens bf16
# collectives to f32 (the lookup has no f32 of its own); ids are s32, packed
# records u8.
PROGRAM_BYTES = {"s32": 4, "bf16": 2, "f32": 2, "u8": 1}
COLLECTIVE = re.compile(
    r"^\s*%?\S+ = (?P<shape>.+?) (?P<op>all-gather|all-to-all|all-reduce|reduce-scatter|"
    r"collective-permute)(?:-start)?\((?P<rest>.*)$"
)
ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


def group_size(rest: str) -> int:
    """Devices per replica group: explicit {{0,1},{2,3}} or iota [groups,size]<=[n]."""
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if explicit:
        return len(explicit.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if iota:
        return int(iota.group(2))
    raise ValueError(f"cannot read replica groups of: {rest[:200]}")


def collectives(hlo: str) -> list[dict]:
    """Each collective of a compiled module: op, result arrays, group size, bytes sent per rank.

    Per rank and step, counting what leaves a device: an all-gather of an
    ``n``-byte operand over ``g`` ranks sends ``n * (g - 1)``; an all-to-all of
    ``n`` bytes keeps ``n / g`` and sends the rest. Both read as
    ``result_bytes * (g - 1) / g``.
    """
    found = []
    for line in hlo.splitlines():
        match = COLLECTIVE.match(line)
        if not match:
            continue
        arrays = [
            (dtype, [int(d) for d in dims.split(",") if d])
            for dtype, dims in ARRAY.findall(match["shape"])
        ]
        g = group_size(match["rest"])
        result_bytes = sum(BYTES[dtype] * math.prod(dims) for dtype, dims in arrays)
        if match["op"] not in ("all-gather", "all-to-all"):
            raise ValueError(f"unexpected collective in the lookup: {line.strip()[:200]}")
        found.append(
            {
                "op": match["op"],
                "dtype": arrays[0][0],
                "result": ", ".join(f"{t}[{','.join(map(str, d))}]" for t, d in arrays),
                "group_size": g,
                "result_bytes": result_bytes,
                "sent_bytes_per_rank": result_bytes * (g - 1) // g,
                "elements_sent_per_rank": sum(math.prod(d) for _, d in arrays) * (g - 1) // g,
            }
        )
    return found


def computed(edp: int, method: str) -> dict:
    """Bytes per rank from the layout alone (tp = 1, no column padding here)."""
    part = -(-N_COLS // edp)
    ids = (edp - 1) * TOKENS * edp * part * 4  # the all-gather of int32 ids over EDP
    block = edp * TOKENS * part * DIM * 2  # this rank's rows: its heads for every replica
    packed = edp * TOKENS * part * ej.packed_record_bytes(DIM)  # the same rows' packed records
    rows = {"all_to_all": block * (edp - 1) // edp, "all_gather_select": block * (edp - 1)}
    rows["all_to_all_packed"] = packed * (edp - 1) // edp
    rows["shared_table"] = 0
    if method == "shared_table":
        ids = 0
    return {"ids": ids, "rows": rows[method]}


def measure(edp: int, method: str) -> dict:
    devices = jax.devices()[:edp]
    mesh = ej.engram_mesh(tp=1, edp=edp, devices=devices)
    if method == "shared_table":
        plan = ej.ShardPlan(SIZES, edp=edp, mode="shared")
    else:
        plan = ej.ShardPlan(SIZES, edp=edp, exchange=method)
    weight = np.zeros((plan.num_rows, DIM), np.uint8)
    scale = np.full((plan.num_rows, DIM // 32), 127, np.uint8)
    with ej.shard_table_from_arrays(weight, scale, mesh, plan) as table:
        run = ej.make_sharded_lookup(table, mesh, plan)
        spec = NamedSharding(mesh, P(("dp", "edp")))
        ids = jax.ShapeDtypeStruct((edp * TOKENS, N_COLS), np.int32, sharding=spec)
        hlo = run.lower(ids).compile().as_text()
    ops = collectives(hlo)
    # The CPU backend widens bf16 collectives to f32; count the rows at the
    # program's bf16 (what a GPU build sends) and keep the CPU's own figure too.
    sent = {dtype: 0 for dtype in PROGRAM_BYTES}
    for o in ops:
        sent[o["dtype"]] += o["elements_sent_per_rank"] * PROGRAM_BYTES[o["dtype"]]
    ids_bytes = sent.pop("s32")
    rows_bytes = sum(sent.values())
    want = computed(edp, method)
    return {
        "edp": edp,
        "method": method,
        "tokens_per_replica": TOKENS,
        "n_cols": N_COLS,
        "dim": DIM,
        "bytes_per_rank": ids_bytes + rows_bytes,
        "rows_bytes_per_rank": rows_bytes,
        "ids_bytes_per_rank": ids_bytes,
        "computed_bytes_per_rank": want["ids"] + want["rows"],
        "computed_rows_bytes_per_rank": want["rows"],
        "measured_equals_computed": (ids_bytes, rows_bytes) == (want["ids"], want["rows"]),
        "cpu_hlo_bytes_per_rank": sum(o["sent_bytes_per_rank"] for o in ops),
        "hlo_collectives": ops,
    }


def versions() -> dict:
    names = ("jax", "jaxlib", "numpy", "ml_dtypes", "engram_jax")
    found = {"python": platform.python_version()}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def main() -> None:
    records = [measure(edp, method) for edp in EDPS for method in ej.sharding.EXCHANGES]
    records += [measure(edp, "shared_table") for edp in EDPS]
    packed = {}
    for edp in EDPS:
        by = {r["method"]: r for r in records if r["edp"] == edp}
        packed[str(edp)] = {
            f"{key}_ratio": by["all_to_all_packed"][key] / by["all_to_all"][key]
            for key in ("rows_bytes_per_rank", "bytes_per_rank")
        }
    for r in records:
        mib = {k: v / 2**20 for k, v in r.items() if k.endswith("bytes_per_rank")}
        print(
            f"edp {r['edp']}  {r['method']:<18} {mib['bytes_per_rank']:9.2f} MiB/rank "
            f"(rows {mib['rows_bytes_per_rank']:8.2f}, ids {mib['ids_bytes_per_rank']:6.2f})"
            f"  computed {mib['computed_bytes_per_rank']:9.2f}"
            f"  {'ok' if r['measured_equals_computed'] else 'MISMATCH'}"
        )
    for edp, ratios in packed.items():
        rows, total = ratios["rows_bytes_per_rank_ratio"], ratios["bytes_per_rank_ratio"]
        print(f"edp {edp}  all_to_all_packed / all_to_all: rows {rows:.4f}, with ids {total:.4f}")
    result = {
        "what": (
            "bytes each rank sends per step in the EDP exchange of the sharded lookup "
            "(tp=1, one node-local EDP group), from the collectives of the compiled HLO; "
            "rows counted as bf16 (the CPU backend widens bf16 collectives to f32: "
            "cpu_hlo_bytes_per_rank is that literal figure), packed records as uint8"
        ),
        "command": "python " + " ".join(sys.argv),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "backend": jax.default_backend(),
            "devices": jax.device_count(),
        },
        "versions": versions(),
        "packed_vs_all_to_all": packed,
        "records": records,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULT}")
    if not all(r["measured_equals_computed"] for r in records):
        raise SystemExit("the compiled program's collectives do not match the computed bytes")


if __name__ == "__main__":
    main()
