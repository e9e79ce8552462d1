"""A Flax NNX language model with an Engram layer (``engram_jax.nnx.Engram``), trained a few steps.

    pip install ".[flax]" && python examples/flax_model.py

A small decoder (embedding, residual MLP blocks that also see the previous
token, a linear head) with the Engram layer before block 1. Its table is one
frozen fp8 table in host memory (plain memory on the CPU); its lookup starts
before block 0 and finishes at the Engram layer, so on a GPU the gather runs
behind block 0. The Engram layer's own weights train with the rest of the model
(optax, through ``nnx.Optimizer``). Checks that the prefetched forward pass
equals the plain one, then trains on text from a toy trigram language.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx

import engram_jax as ej
from engram_jax.nnx import Engram

VOCAB, WIDTH, ROW_DIM, BLOCKS, ENGRAM_AT = 256, 64, 32, 3, 1


class Block(nnx.Module):
    """Pre-norm residual MLP over each token and the one before it (causal)."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        self.up = nnx.Linear(2 * width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm(x)
        previous = jnp.pad(h, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        return x + self.down(jax.nn.gelu(self.up(jnp.concatenate([h, previous], axis=-1))))


class EngramLM(nnx.Module):
    def __init__(
        self, layout: ej.EngramLayout, table: ej.EngramTable, rngs: nnx.Rngs, prefetch: bool
    ) -> None:
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(WIDTH, rngs) for _ in range(BLOCKS)])
        # The table stays frozen: once engram_jax's trainable tables exist, the rows'
        # gradient is the cotangent of `rows` in Engram.fuse.
        self.engram = Engram(layout, table, WIDTH, rngs=rngs, param_dtype=jnp.float32)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)
        self.prefetch = prefetch

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """``tokens``: compressed ids ``[B, T]`` -> logits ``[B, T, VOCAB]``."""
        if self.prefetch:
            # Started with the step: block 0 waits for the start (README, Prefetch).
            started = self.engram.start(tokens)
            tokens, started = jax.lax.optimization_barrier((tokens, started))
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            if i == ENGRAM_AT:
                if self.prefetch:
                    # Done at the layer, tied to one value of its input.
                    started, _ = jax.lax.optimization_barrier((started, x[:1, :1]))
                    x = self.engram(x, prefetched=started)
                else:
                    x = self.engram(x, tokens)
            x = block(x)
        return self.head(x)


def make_table(layout: ej.EngramLayout) -> ej.EngramTable:
    rng = np.random.default_rng(0)
    rows = layout.num_embeddings[0]
    weight = rng.normal(size=(rows, ROW_DIM)).astype(ml_dtypes.float8_e4m3fn)
    scale = np.full((rows, ROW_DIM // 32), 127, np.uint8)  # 2**0
    placement = "pinned" if jax.default_backend() == "gpu" else "cpu"
    return ej.EngramTable.from_arrays(weight, scale, placement=placement)


def trigram_text(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Token ids where each token follows from the two before it 3 times in 4."""
    tokens = rng.integers(1, VOCAB, (batch, length)).astype(np.int32)
    for t in range(2, length):
        follows = (tokens[:, t - 2] * 31 + tokens[:, t - 1] * 7) % (VOCAB - 1) + 1
        tokens[:, t] = np.where(rng.random(batch) < 0.75, follows, tokens[:, t])
    return tokens


def loss_fn(model: EngramLM, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model: EngramLM, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=33)
    args = parser.parse_args(argv)

    layout = ej.EngramLayout(
        engram_vocab_size=2000,
        layer_ids=(ENGRAM_AT,),
        max_ngram_size=3,
        n_heads=4,
        head_dim=ROW_DIM,
        compressed_vocab_size=VOCAB,
        pad_id=0,
    )
    rng = np.random.default_rng(1)
    with make_table(layout) as table:
        model = EngramLM(layout, table, nnx.Rngs(0), prefetch=True)
        tokens = jnp.asarray(trigram_text(rng, args.batch, args.seq))
        prefetched = nnx.jit(lambda m, t: m(t))(model, tokens)
        model.prefetch = False
        plain = nnx.jit(lambda m, t: m(t))(model, tokens)
        model.prefetch = True
        gap = float(jnp.abs(prefetched - plain).max())
        assert gap <= 1e-5, f"prefetched and plain logits differ by {gap}"

        optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
        losses = []
        for _ in range(args.steps):
            tokens = jnp.asarray(trigram_text(rng, args.batch, args.seq))
            losses.append(float(train_step(model, optimizer, tokens)))
    trained = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    engram = sum(p.size for p in jax.tree.leaves(nnx.state(model.engram, nnx.Param)))
    print(
        f"{table.num_rows} Engram rows ({layout.n_cols} per token) in a frozen table; "
        f"{trained} trained parameters ({engram} in the Engram layer); "
        f"prefetched = plain logits (max gap {gap:.1e}); "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps"
    )
    return {"first_loss": losses[0], "last_loss": losses[-1], "gap": gap}


if __name__ == "__main__":
    main()
