"""Serve a small decoder with Engram layers whose tables live in host memory.

The DeepSeek-V4 tokenizer and its Engram token compression, a decoder with
seeded random weights (no downloads) and two Engram layers, continuous batching
of many prompts with greedy decoding, per-sequence lookback state for the
n-gram hashes, and a summary: tokens/s, step time, rows fetched per token.
With --speculate K it serves the prompts a second time with speculative
decoding (prompt-lookup drafts, verified K + 1 tokens per sequence per step),
reports the share of drafts accepted beside the plain run, and checks that both
generated the same tokens.

    python examples/serve.py                          # CPU, built-in prompts, < 1 minute
    python examples/serve.py --prompts my.txt --max-new-tokens 64 --speculate 3
    python examples/serve.py --model medium --table-gib 64 --slots 512   # GPU

The pieces are in serving/: model.py (the decoder), tables.py (the Engram
tables), engine.py (the jitted step and the batching loop), cli.py (flags,
prompts, errors). benchmarks/serve.py compares table placements with them.
"""

from __future__ import annotations

import os

# Tables placed in HBM are allocated outside XLA's pool: keep XLA from taking
# most of the GPU up front (a user's own setting wins).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from serving import cli, engine, model, tables  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py",
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        formatter_class=cli.HelpFormatter,
    )
    cli.add_arguments(p)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    cli.check_arguments(p, args)
    return args


def serve_prompts(args, device, dtype, prompts, tokenizer, compressor, layout):
    """The tables' placement and {run: (speculate, outputs, stats)}: greedy decoding,
    then with --speculate, speculative decoding."""
    cfg = model.MODELS[args.model]
    name, mode, placement, cached, order = cli.single_run(args, device)
    tables.check_fits(tables.table_bytes(layout), placement, device)  # before anything slow
    checkpoint = tables.open_checkpoint(args.checkpoint, layout) if args.checkpoint else None
    runs = {name: 0}
    if args.speculate:
        runs[f"{name}_speculate{args.speculate}"] = args.speculate
    max_len = engine.cache_length(
        args.max_prompt_tokens, args.max_new_tokens, args.prefill_chunk, args.speculate
    )
    results = {}
    with contextlib.ExitStack() as stack, jax.default_device(device):
        params = model.init_params(cfg, args.seed, dtype)
        state = engine.init_slot_state(cfg, layout, args.slots, max_len, dtype)
        built = tables.build_tables(
            layout,
            placement,
            device,
            stack,
            checkpoint=checkpoint,
            seed=args.seed,
            progress=not args.no_progress,
        )
        caches = None
        if cached:
            if args.cache_profile:
                texts = cli.read_lines(args.cache_profile, "profile text")
            else:
                texts = [tokenizer.decode(p[1:]) for p in prompts]
            profiles = tables.hot_row_profiles(texts, tokenizer, compressor, layout)
            caches = tables.build_caches(built, profiles, args.cache_gib, device, stack)
        for run_name, speculate in runs.items():
            step = engine.make_step(
                cfg,
                layout,
                compressor,
                built,
                mode,
                caches=caches,
                speculate=speculate,
                prefetch_ctas=args.prefetch_ctas,
                order=order,
            )
            shapes = engine.step_shapes(args.prefill_chunk, speculate)
            state = engine.warm_up(step, params, state, args.slots, shapes)
            outputs, stats, state = engine.serve(
                step,
                params,
                state,
                prompts,
                slots=args.slots,
                prefill_chunk=args.prefill_chunk,
                max_new_tokens=args.max_new_tokens,
                speculate=speculate,
                between_steps=cli.check_stop,
                progress=not args.no_progress,
            )
            results[run_name] = (speculate, outputs, stats)
        jax.block_until_ready(state)  # nothing may still read the tables when they are freed
    return built[0].placement, results


def summary(results, args, layout, placement: str, requests: int) -> str:
    lines = [
        f"{requests} requests, {args.slots} slots, {tables.describe(args.model, layout)} "
        f"({placement})",
        f"{'run':28} {'tokens/s':>9} {'step ms':>8} {'rows/token':>10}  accepted drafts",
    ]
    for name, (speculate, _, stats) in results.items():
        step_ms = 1e3 * statistics.median(stats.decode_steps or stats.prefill_steps)
        accepted = cli.acceptance(stats.drafted, stats.accepted) if speculate else "-"
        lines.append(
            f"{name:28} {stats.generated / stats.wall_s:9.1f} {step_ms:8.2f} "
            f"{stats.rows / stats.processed:10.1f}  {accepted}"
        )
    lines.append(
        "tokens/s: generated tokens per second of serving; step ms: median decode step; "
        "rows/token: Engram rows fetched per token processed (drafts included); accepted "
        "drafts: the share of drafted tokens that greedy decoding agreed with"
    )
    return "\n".join(lines)


def run(args) -> int:
    cli.writable(args.outputs)
    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype or ("bfloat16" if device.platform == "gpu" else "float32"))
    tokenizer, compressor = cli.load_tokenizer()
    prompts = cli.read_prompts(args, tokenizer)
    layout = tables.make_layout(model.MODELS[args.model], compressor, args.table_gib)
    if args.write_checkpoint:
        tables.write_checkpoint(args.write_checkpoint, layout, args.seed)
        print(
            f"wrote {args.write_checkpoint}: layers {layout.layer_ids}, "
            f"{tables.table_bytes(layout) / 2**30:.3f} GiB of rows"
        )
        return 0
    with jax.default_matmul_precision(args.precision):
        placement, results = serve_prompts(
            args, device, dtype, prompts, tokenizer, compressor, layout
        )
    outputs = {run_name: out for run_name, (_, out, _) in results.items()}
    cli.show_completions(outputs, prompts, tokenizer, args.show, sys.stdout)
    print("\n" + summary(results, args, layout, placement, len(prompts)))
    if args.outputs:
        cli.write_text(args.outputs, json.dumps(outputs))
    if args.speculate:
        (_, plain, plain_stats), (_, speculative, spec_stats) = results.values()
        agreement = cli.token_agreement(plain, plain_stats, speculative, spec_stats)
        print(f"speculative vs greedy decoding: {cli.describe_agreement(agreement)}")
        if agreement["identical"] != agreement["requests"]:
            if cli.strict_precision(args, device, dtype):
                print(
                    "FAILED: in float32 at highest matmul precision speculative decoding "
                    "must generate greedy decoding's tokens"
                )
                return 1
            print(
                f"(expected in {jnp.dtype(dtype).name} at {args.precision} precision: a verify "
                "step rounds otherwise than a one-token step, and near-tied picks flip; "
                "--dtype float32 --precision highest gives greedy's tokens exactly)"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(run, parse_args(argv), "serve.py")


if __name__ == "__main__":
    sys.exit(main())
