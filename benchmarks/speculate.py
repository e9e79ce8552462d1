"""Speculative decoding in the serving example's engine (examples/serving): a plain
greedy run and speculative runs (prompt-lookup drafts, and an oracle drafter at
set per-token acceptances) in one process, per slot count, host tables prefetched.

    python benchmarks/speculate.py --smoke                     # CPU, under a minute
    python benchmarks/speculate.py --no-progress --show 0      # GPU: medium model, 64 and 512 slots

Per ``--slots`` value: a plain run (speculate 0) serves every prompt once, untimed,
for the oracle's references; then the plain step and one speculative step per
drafter (``prompt_lookup``: drafts on the device from the sequence's own text;
``oracle`` at each ``--acceptance``: drafts from greedy's continuation, each token
right with that chance, else a wrong one), all over the same host tables and slot
state, are served ``--rounds`` times, interleaved. Figures are medians over
rounds; ``vs_plain`` is the median of each round's tokens/s over the plain step's
in the same round.

Greedy's continuation (``--oracle-references``): ``verify`` (default) takes it
from one more untimed run, an oracle at acceptance 1 over the plain run's tokens,
so the references are what the verify programs themselves compute; ``plain`` takes
the plain run's tokens. They are the same in exact arithmetic; in bf16 a verify
step's other GEMM shapes flip near-tied tokens, a request then leaves the plain
run's tokens for good (40 % of them at 64 slots, 32 new tokens) and an oracle over
those has no drafts for it from there on: its acceptance would not be the one set.

Rows are checked as in benchmarks/serve.py: every step returns checksums of each
Engram layer's rows and of the rows its tables hold for the step's ids (computed on
the device from the rows' definition); a difference is a FAILED line and exit
status 1. Tokens are compared with the untimed plain run's: ``same_tokens`` is the
share of identical requests, ``first_divergence`` the median index of the first
other token. A verify pass runs other shapes than a one-token step, so in bf16 (or
TF32: float32 at default precision on a GPU) other tokens are numerics and are only
reported; in float32 with exact matmuls (``--precision highest``, or the CPU) they
are a FAILED line and exit status 1.
"""

from __future__ import annotations

import os

# Consistent with serve.py (a user's own setting wins).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
from serving import cli, engine, model, tables  # noqa: E402

from benchmarks import _common  # noqa: E402
from benchmarks import serve as serve_bench  # noqa: E402

DRAFTERS = ("prompt_lookup", "oracle")
# Where no flag gives them. The GPU run: 1 plain + 6 speculative steps at 64 and 512
# slots; prompt chunks no wider than a verify step (K + 1), so each speculative step
# compiles for two widths (1 and K + 1), the wider one verifying and not.
GPU_DEFAULTS = dict(
    model="medium",
    slots=[64, 512],
    num_prompts=512,
    max_new_tokens=32,
    max_prompt_tokens=128,
    prefill_chunk=4,
    table_gib=16.0,
)
CPU_DEFAULTS = dict(model="tiny", slots=[8])
# --smoke: the script whole on two CPU cores in well under a minute.
SMOKE_DEFAULTS = dict(
    model="micro",
    slots=[4],
    num_prompts=8,
    max_new_tokens=8,
    # No wider than a verify step (K + 1): each speculative step compiles once.
    prefill_chunk=4,
    table_gib=0.005,
    acceptance=[0.0, 0.7],
    rounds=1,
)
COLUMNS = [
    "variant",
    "accepted_share",
    "tokens_per_step",
    "rows_per_token",
    "tokens_per_s",
    "vs_plain",
    "narrow_step_ms",
    "wide_step_ms",
    "prefill_step_ms_plain",
    "prefill_step_ms_verifying",
    "wide_steps",
    "verifying_prefill_steps",
    "same_tokens",
    "first_divergence",
    "rows_checked",
    "compile_s",
]


def flag_text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def share_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"acceptances lie in [0, 1], got {text!r}")
    return list(dict.fromkeys(values))


def drafter_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in DRAFTERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown drafters {unknown or names}; choose from {', '.join(DRAFTERS)}"
        )
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/speculate.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=cli.HelpFormatter,
        # The serving flags redefined below replace the example's.
        conflict_handler="resolve",
        epilog="Defaults where no flag gives them: on a GPU "
        + " ".join(f"--{k.replace('_', '-')} {flag_text(v)}" for k, v in GPU_DEFAULTS.items())
        + "; on a CPU "
        + " ".join(f"--{k.replace('_', '-')} {flag_text(v)}" for k, v in CPU_DEFAULTS.items())
        + "; --smoke "
        + " ".join(f"--{k.replace('_', '-')} {flag_text(v)}" for k, v in SMOKE_DEFAULTS.items()),
    )
    cli.add_arguments(p)
    p.add_argument(
        "--model",
        choices=sorted(model.MODELS),
        default=None,
        help="decoder size; default: medium on a GPU, tiny on a CPU, micro with --smoke",
    )
    p.add_argument(
        "--slots",
        type=int_list,
        metavar="LIST",
        default=None,
        help="comma-separated slot counts, each a plain run and its speculative runs; "
        "default: 64,512 on a GPU, 8 on a CPU",
    )
    p.add_argument(
        "--speculate",
        type=int,
        metavar="K",
        default=3,
        help="drafts verified per sequence per step in the speculative runs",
    )
    p.add_argument(
        "--drafters",
        type=drafter_list,
        metavar="LIST",
        default=list(DRAFTERS),
        help=f"comma-separated drafters of the speculative runs, of {', '.join(DRAFTERS)}",
    )
    p.add_argument(
        "--acceptance",
        type=share_list,
        metavar="LIST",
        default=[0.0, 0.3, 0.5, 0.7, 0.9],
        help="the oracle drafter's per-token acceptances, one run each",
    )
    p.add_argument(
        "--oracle-references",
        choices=("verify", "plain"),
        default="verify",
        help="where the oracle's greedy continuation comes from: an untimed oracle run "
        "at acceptance 1 (the verify programs' own tokens), or the plain run's",
    )
    p.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        default=1,
        help="serve the prompts this many times per step, the steps interleaved; "
        "figures are medians over rounds",
    )
    p.add_argument(
        "--name",
        default="speculate",
        help="results file stem under benchmarks/results (or a path without .json); "
        "--smoke appends _smoke",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check the script on the CPU: the micro model, a 5 MiB table, 8 prompts of "
        "8 new tokens, 4 slots, prefill chunks of 4, acceptance 0 and 0.7 (flags given win)",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.smoke:
        defaults = SMOKE_DEFAULTS
    elif jax.default_backend() == "gpu":
        defaults = GPU_DEFAULTS
    else:
        defaults = CPU_DEFAULTS
    # Defaults that differ per machine, under the flags given (the second parse keeps those).
    p.set_defaults(**defaults)
    args = p.parse_args(argv)
    # The example's checks take one slot count: check the smallest.
    cli.check_arguments(p, argparse.Namespace(**{**vars(args), "slots": min(args.slots)}))
    if args.speculate < 1:
        p.error("--speculate must be >= 1: the speculative runs verify K drafts per step")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    # What this benchmark measures: seeded distinct host tables, prefetched, rows checked.
    if args.checkpoint or args.write_checkpoint:
        p.error(
            "--checkpoint/--write-checkpoint: the rows are checked against seeded distinct "
            "tables, computed from their definition; serve a checkpoint with benchmarks/serve.py"
        )
    if args.placement == "device":
        p.error("--placement device: this benchmark reads host tables (auto, pinned, cpu, ...)")
    if not args.prefetch:
        p.error("--no-prefetch: this benchmark prefetches the host tables' rows")
    if args.cache_gib:
        p.error("--cache-gib: this benchmark runs without a hot-row cache")
    args.init = "random"  # serve.py's name for distinct rows: its step builder reads it
    return args


# -- the runs ---------------------------------------------------------------------------


def run_label(drafter: str | None, acceptance: float | None) -> str:
    if drafter is None:
        return "plain"
    return drafter if acceptance is None else f"{drafter}_{round(100 * acceptance)}"


def plan(args) -> list[tuple[str | None, float | None]]:
    """(drafter, acceptance target) of each run at one slot count, plain first."""
    runs: list[tuple[str | None, float | None]] = [(None, None)]
    for drafter in args.drafters:
        if drafter == "oracle":
            runs += [("oracle", a) for a in args.acceptance]
        else:
            runs.append((drafter, None))
    return runs


def build_step(setup, args, tables_, speculate: int, drafter):
    """serve.py's prefetching step over ``tables_`` with its rows checks, at ``speculate``."""
    step_args = copy.copy(args)
    step_args.speculate = speculate
    prefetch = dict(order=args.prefetch_order, prefetch_ctas=args.prefetch_ctas)
    return serve_bench.jitted_step(
        "prefetch", tables_, None, setup, step_args, prefetch, drafter=drafter
    )


def serve_once(step, setup, state, args, slots: int, speculate: int):
    return engine.serve(
        step,
        setup.params,
        state,
        setup.prompts,
        slots=slots,
        prefill_chunk=args.prefill_chunk,
        max_new_tokens=args.max_new_tokens,
        speculate=speculate,
        between_steps=cli.check_stop,
        progress=not args.no_progress,
    )


def kind_step_ms(rounds) -> dict:
    """Median ms of each kind of step over the rounds: decode steps narrow and wide,
    steps with prompts in them without and with verifying drafts (None: none ran)."""
    names = {
        (False, False): "narrow_step_ms",
        (False, True): "wide_step_ms",
        (True, False): "prefill_step_ms_plain",
        (True, True): "prefill_step_ms_verifying",
    }
    out = {}
    for kind, name in names.items():
        times = [t for r in rounds for t in r.kind_steps.get(kind, ())]
        out[name] = 1e3 * statistics.median(times) if times else None
    return out


def agreement_fields(agreement: dict) -> dict:
    """A record's tokens fields from :func:`cli.token_agreement` against the plain run:
    ``same_tokens`` (share of identical requests), the median index of the first
    other token, and the top-1 minus top-2 logit gap there (the plain run's, this
    run's): near ties are what other rounding flips."""
    firsts, gaps = agreement["first_divergence"], agreement["gaps_at_divergence"]
    return {
        "same_tokens": agreement["identical"] / agreement["requests"],
        "requests_differing": agreement["requests"] - agreement["identical"],
        "first_divergence": statistics.median(firsts) if firsts else None,
        "gap_at_divergence_plain": statistics.median(g[0] for g in gaps) if gaps else None,
        "gap_at_divergence": statistics.median(g[1] for g in gaps) if gaps else None,
        "median_gap_plain": agreement["median_gap"],
        "token_agreement": cli.describe_agreement(agreement),
    }


def token_lines(records: list[dict], strict: bool) -> tuple[list[str], bool]:
    """A line per record whose tokens differ from the plain run's, and whether that
    fails the run (``strict``: see :func:`cli.strict_precision`, where a verify step
    must give greedy's own tokens)."""
    what = "FAILED tokens check" if strict else "tokens differ (numerics, not checked)"
    differing = [r for r in records if r["same_tokens"] < 1]
    lines = [f"{what}: {r['variant']}: {r['token_agreement']}" for r in differing]
    return lines or ["tokens: every run generated the plain run's tokens"], strict and bool(
        differing
    )


def record_of(run_, drafter, acceptance, slots: int, speculate: int, plain, compile_s) -> dict:
    """A run's figures: medians over its rounds, counts from its last round."""
    stats = run_.rounds[-1]
    tokens_per_s = [r.generated / r.wall_s for r in run_.rounds]
    ratios = [
        (r.generated / r.wall_s) / (p.generated / p.wall_s)
        for r, p in zip(run_.rounds, plain.rounds, strict=True)
    ]
    decode = [t for r in run_.rounds for t in (r.decode_steps or r.prefill_steps)]
    # Each step a sequence decodes in emits its accepted drafts and one token more.
    emitting = stats.generated - stats.accepted
    return dict(
        variant=run_.name,
        slots=slots,
        drafter=drafter,
        acceptance_target=acceptance,
        speculate=speculate,
        accepted_share=stats.acceptance_rate,
        tokens_per_step=stats.generated / emitting if emitting > 0 else None,
        rows_per_token=stats.rows / stats.generated if stats.generated else None,
        rows_per_processed_token=stats.rows / stats.processed if stats.processed else None,
        vs_plain=statistics.median(ratios),
        tokens_per_s=statistics.median(tokens_per_s),
        tokens_per_s_rounds=tokens_per_s,
        step_ms=1e3 * statistics.median(decode) if decode else None,
        prefill_step_ms=1e3 * statistics.median(stats.prefill_steps)
        if stats.prefill_steps
        else None,
        wall_s=statistics.median(r.wall_s for r in run_.rounds),
        steps=stats.steps,
        decode_steps=len(stats.decode_steps),
        prefill_steps=len(stats.prefill_steps),
        wide_steps=stats.wide_steps,
        verifying_prefill_steps=stats.verifying_prefill_steps,
        **kind_step_ms(run_.rounds),
        generated_tokens=stats.generated,
        processed_tokens=stats.processed,
        drafted_tokens=stats.drafted,
        accepted_tokens=stats.accepted,
        compile_s=compile_s,
    )


def serve_slots(slots: int, setup, tables_, args, log) -> tuple[list[dict], dict, list]:
    """Every run at ``slots``: records, outputs and the VariantRuns (for the rows check)."""
    k = args.speculate
    max_len = engine.cache_length(
        args.max_prompt_tokens, args.max_new_tokens, args.prefill_chunk, k
    )
    # One state for every run: the plain step attends over the same cache length.
    state = engine.init_slot_state(setup.cfg, setup.layout, slots, max_len, setup.dtype)

    def compiled(drafter, speculate):
        nonlocal state
        start = time.perf_counter()
        step = build_step(setup, args, tables_, speculate, drafter)
        shapes = engine.step_shapes(args.prefill_chunk, speculate)
        state = engine.warm_up(step, setup.params, state, slots, shapes)
        return step, time.perf_counter() - start

    plain_step, plain_compile = compiled(None, 0)
    reference, ref_stats, state = serve_once(plain_step, setup, state, args, slots, 0)
    log(f"{slots} slots: plain compiled in {plain_compile:.1f} s, reference run served")
    references = [list(p) + out for p, out in zip(setup.prompts, reference, strict=True)]
    if "oracle" in args.drafters and args.oracle_references == "verify":
        exact, _ = compiled(engine.oracle_drafter(references, 1.0, seed=args.seed), k)
        verified, _, state = serve_once(exact, setup, state, args, slots, k)
        same = sum(a == b for a, b in zip(verified, reference, strict=True))
        log(f"{slots} slots: oracle references from a verifying run, {same} requests as plain's")
        references = [list(p) + out for p, out in zip(setup.prompts, verified, strict=True)]

    runs, meta = [], []
    for drafter, acceptance in plan(args):
        name = f"{run_label(drafter, acceptance)}@{slots}"
        if drafter is None:
            step, compile_s, speculate = plain_step, plain_compile, 0
        else:
            if drafter == "oracle":
                made = engine.oracle_drafter(references, acceptance, seed=args.seed)
            else:
                made = engine.prompt_lookup_drafter()
            step, compile_s = compiled(made, k)
            speculate = k
            log(f"{name}: compiled in {compile_s:.1f} s")
        runs.append(serve_bench.VariantRun(name, "prefetch", {}, tables_, None, step))
        meta.append((drafter, acceptance, speculate, compile_s))
    # Rounds interleave the runs, each round starting one further along.
    for r in range(args.rounds):
        order = list(range(len(runs)))
        order = order[r % len(runs) :] + order[: r % len(runs)]
        for i in order:
            runs[i].outputs, stats, state = serve_once(
                runs[i].step, setup, state, args, slots, meta[i][2]
            )
            runs[i].rounds.append(stats)
    jax.block_until_ready(state)  # nothing may still read the tables when they are freed
    log(f"{slots} slots: {args.rounds} round(s) of {len(runs)} runs served")

    # The untimed reference run's rows are checked too, with the plain step's.
    checked = [dataclasses.replace(run_, step=None) for run_ in runs]
    checked[0].rounds = [ref_stats, *runs[0].rounds]
    records = []
    for run_, (drafter, acceptance, speculate, compile_s) in zip(runs, meta, strict=True):
        record = record_of(run_, drafter, acceptance, slots, speculate, runs[0], compile_s)
        agreement = cli.token_agreement(reference, ref_stats, run_.outputs, run_.rounds[-1])
        record.update(agreement_fields(agreement))
        records.append(record)
    return records, {run_.name: run_.outputs for run_ in runs}, checked


def run(args) -> int:
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {message}", file=sys.stderr, flush=True)

    cli.writable(args.outputs)
    device = jax.devices("cpu")[0] if args.smoke else jax.devices()[0]
    dtype = jnp.dtype(args.dtype or ("bfloat16" if device.platform == "gpu" else "float32"))
    strict = cli.strict_precision(args, device, dtype)
    cfg = model.MODELS[args.model]
    tokenizer, compressor = cli.load_tokenizer()
    prompts = cli.read_prompts(args, tokenizer)
    layout = tables.make_layout(cfg, compressor, args.table_gib)
    tables.check_fits(tables.table_bytes(layout), args.placement, device)  # before anything slow
    records, outputs, runs = [], {}, []
    with (
        contextlib.ExitStack() as stack,
        jax.default_device(device),
        jax.default_matmul_precision(args.precision),
    ):
        params = model.init_params(cfg, args.seed, dtype)
        setup = serve_bench.Setup(cfg, layout, compressor, params, prompts, device, dtype)
        tables_ = tables.build_tables(
            layout,
            args.placement,
            device,
            stack,
            fill="distinct",
            seed=args.seed,
            progress=not args.no_progress,
        )
        log(f"tables: {tables.describe(args.model, layout)}, {tables_[0].placement}")
        for slots in args.slots:
            got, outs, slot_runs = serve_slots(slots, setup, tables_, args, log)
            records += got
            outputs.update(outs)
            runs += slot_runs
    checks = serve_bench.rows_checks(runs)
    for record in records:
        record.update(checks[record["variant"]])
        record.update(precision=args.precision, dtype=dtype.name)
    extra = {
        "engram_jax": importlib.metadata.version("engram_jax"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "model": args.model,
        "table_gib": tables.table_bytes(layout) / 2**30,
        "placement": tables_[0].placement,
        "requests": len(prompts),
        "prompts": args.prompts or "built-in",
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "prefill_chunk": args.prefill_chunk,
        "speculate": args.speculate,
        "dtype": dtype.name,
        "precision": args.precision,
        "oracle_references": args.oracle_references,
        "tokens_strict": strict,
        "rounds": args.rounds,
        "device": f"{device.platform}: {device.device_kind}",
        "timing": f"median over {args.rounds} interleaved round(s) of serving every prompt; "
        "vs_plain: median of each round's tokens/s over the plain step's in that round; "
        "tokens compared with an untimed plain run at the same slots",
        "wall_s": time.perf_counter() - t0,
    }
    path = _common.write_results(args.name + ("_smoke" if args.smoke else ""), records, extra)
    if args.outputs:
        cli.write_text(args.outputs, json.dumps(outputs))
    cli.show_completions(outputs, prompts, tokenizer, args.show, sys.stdout)
    print(f"\n{len(prompts)} requests, {tables.describe(args.model, layout)}; wrote {path}")
    _common.print_table(records, COLUMNS)
    lines, failed = token_lines(records, strict)
    print("\n".join(lines))
    _common.finish_rows_checks(records)  # exits with status 1 if rows differ
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(run, parse_args(argv), "speculate.py")


if __name__ == "__main__":
    sys.exit(main())
