"""Scratch: why speculative tokens differ on the GPU, and where a verify step's time goes."""
import argparse, importlib.util, sys, time, json, os
from pathlib import Path
import numpy as np
import jax, jax.numpy as jnp
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
spec = importlib.util.spec_from_file_location("serve_example", REPO / "examples/serve.py")
serve_ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(serve_ex)
from serving import cli, engine, model, tables

p = argparse.ArgumentParser()
p.add_argument("--precision", default="default")
p.add_argument("--tag", default="")
p.add_argument("--timing", action="store_true")
a, rest = p.parse_known_args()
args = serve_ex.parse_args(rest)
device = jax.devices()[0]
dtype = jnp.dtype(args.dtype or "bfloat16")
tokenizer, compressor = cli.load_tokenizer()
prompts = cli.read_prompts(args, tokenizer)
layout = tables.make_layout(model.MODELS[args.model], compressor, args.table_gib)
t0 = time.time()
with jax.default_matmul_precision(a.precision):
    placement, results = serve_ex.serve_prompts(args, device, dtype, prompts, tokenizer, compressor, layout)
names = list(results)
(_, plain, ps), (_, specd, ss) = results[names[0]], results[names[1]]
same = sum(x == y for x, y in zip(plain, specd))
firsts, gaps = [], []
for i, (x, y) in enumerate(zip(plain, specd)):
    if x != y:
        j = next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y)))
        firsts.append(j)
        if j < min(len(x), len(y)):
            gaps.append((float(ps.margins[i][j]), float(ss.margins[i][j])))
allm = np.concatenate(ps.margins)
print(f"RESULT {a.tag} precision={a.precision} dtype={dtype} {names}: identical {same}/{len(plain)}; "
      f"first divergence at tokens {sorted(firsts)[:20]}")
if gaps:
    g = np.array(gaps)
    print(f"  margins at first divergence (plain, spec): median {np.median(g,0)}, max {g.max(0)}; "
          f"all plain tokens' margins: median {np.median(allm):.4g}, p1 {np.percentile(allm,1):.4g}")
    print("  first 10:", [(round(x,5), round(y,5)) for x, y in gaps[:10]])
for n, (_, _, st) in results.items():
    ms = np.median(st.decode_steps) * 1e3 if st.decode_steps else float('nan')
    print(f"  {n}: tok/s {st.generated/st.wall_s:.0f} wall {st.wall_s:.2f}s decode steps {len(st.decode_steps)} "
          f"median {ms:.2f} ms; wait {st.wait_s:.2f}s; drafted {st.drafted} accepted {st.accepted}")
print(f"  total {time.time()-t0:.1f}s")
