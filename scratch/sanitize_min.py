"""Scratch: smallest programs for compute-sanitizer: jax alone, a lookup, a start/done."""
import sys
import numpy as np
import jax, jax.numpy as jnp
what = sys.argv[1]
if what == "jax":
    f = jax.jit(lambda x: jnp.sin(x @ x) + 1)
    x = jnp.ones((256, 256))
    for _ in range(3):
        y = f(x)
    print("jax ok", float(y.sum()))
    sys.exit(0)
import engram_jax as ej
table = ej.dummy_table(4096, 256, placement=sys.argv[2] if len(sys.argv) > 2 else "pinned", fill="distinct")
rng = np.random.default_rng(0)
if what == "lookup":
    f = jax.jit(lambda i: ej.lookup(table, i))
elif what == "prefetch":
    def body(i):
        h = ej.lookup_start(table, i)
        return ej.lookup_done(h)
    f = jax.jit(body)
bad = 0
for k in range(4):
    ids = rng.integers(-1, 4096, (64, 8)).astype(np.int32)
    got = np.asarray(f(ids))
    want = np.asarray(jax.jit(lambda i: ej.lookup(table, i))(ids))
    bad += int((got.view(np.uint16) != want.view(np.uint16)).any(-1).sum())
print(what, "rows differing:", bad)
table.close()
