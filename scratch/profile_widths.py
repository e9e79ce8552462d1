"""Scratch: device time of the engine step by width, and its top kernels."""
import sys, time, json, tempfile
from pathlib import Path
import numpy as np
import jax, jax.numpy as jnp
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples")); sys.path.insert(0, str(REPO))
from serving import cli, engine, model, tables
from benchmarks import _common
import contextlib
slots = int(sys.argv[1]) if len(sys.argv) > 1 else 128
dtype = jnp.bfloat16
cfg = model.MODELS[sys.argv[3] if len(sys.argv) > 3 else "medium"]
tok, comp = cli.load_tokenizer()
layout = tables.make_layout(cfg, comp, 4.0)
dev = jax.devices()[0]
out = {}
with contextlib.ExitStack() as stack:
    built = tables.build_tables(layout, "pinned" if dev.platform == "gpu" else "cpu", dev, stack, seed=0, progress=False)
    params = model.init_params(cfg, 0, dtype)
    for spec in (0, 1, 3, 7):
        width = spec + 1
        step = engine.make_step(cfg, layout, comp, built, "prefetch", speculate=spec)
        state = engine.init_slot_state(cfg, layout, slots, 200, dtype)
        rng = np.random.default_rng(0)
        def inputs():
            t = rng.integers(3, 100000, (slots, width)).astype(np.int32)
            nv = np.full(slots, width, np.int32); nd = np.full(slots, spec, np.int32)
            z = np.zeros(slots, np.int32)
            return t, nv, nd, np.zeros(slots, bool), z, z > 0
        for _ in range(3):
            state, o = step(params, state, *inputs())
        jax.block_until_ready(o)
        times = []
        for _ in range(15):
            inp = inputs(); t0 = time.perf_counter()
            state, o = step(params, state, *inp); jax.block_until_ready(o)
            times.append(time.perf_counter() - t0)
            state = dict(state, kv=dict(state["kv"], pos=jnp.zeros_like(state["kv"]["pos"])))
        ms = 1e3 * float(np.median(times))
        d = tempfile.mkdtemp()
        jax.profiler.start_trace(d)
        for _ in range(5):
            state, o = step(params, state, *inputs()); jax.block_until_ready(o)
        jax.profiler.stop_trace()
        s = _common.stream_summary(d, 5)
        out[width] = dict(ms=ms, streams={k: {kk: v[kk] for kk in ("top_ms_per_step",) if kk in v} | {"busy": v.get("busy_ms_per_step")} for k, v in (s or {}).items()})
        print(f"WIDTH {width} slots {slots}: {ms:.2f} ms/step", flush=True)
        for k, v in (s or {}).items():
            top = v.get("top_ms_per_step", {})
            print("  ", k, "busy", round(v["busy_ms_per_step"], 3), {n[:70]: round(t, 3) for n, t in list(top.items())[:8]}, flush=True)
json.dump(out, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/widths.json", "w"), indent=1, default=str)
