"""Serving throughput of the example's engine (examples/serving) with its Engram
tables in HBM, on the host read at the layer, on the host prefetched, and
prefetched with an HBM hot-row cache, beside the same decoder without Engram.

    python benchmarks/serve.py --variants no_engram,host_sync,host_prefetch   # CPU too
    python benchmarks/serve.py --model medium --table-gib 64 --slots 512 \\
        --num-prompts 2048 --max-new-tokens 32 --calibration-steps 20 \\
        --variants no_engram,hbm,host_sync,host_prefetch --json serve.json     # GPU

Variants: ``no_engram`` (the same decoder without its Engram layers), ``hbm``
(tables in GPU memory: needs a GPU), ``host_sync`` (host tables, rows gathered
where the layer needs them), ``host_prefetch`` (host tables, every layer's rows
started right after the embedding and awaited at the layer; on the CPU backend
the rows are read at the layer, as engram_jax does there), ``host_prefetch_cache``
(the same, with the hottest rows in an HBM cache of ``--cache-gib``, chosen by
hashing the text of ``--cache-profile``). Without ``--variants`` one run uses
``--placement``, ``--prefetch/--no-prefetch`` and ``--cache-gib``. The other
flags are the example's (``python examples/serve.py --help``); ``--speculate K``
makes every variant speculate.

Rounds serve the prompts once per variant, the variants interleaved, so a drift
of the machine's speed hits all of them alike; figures are medians over rounds.
The row wait is priced by timing decode steps with lookups against steps with
zeros in their place. Rows are checked: every step returns checksums of each
Engram layer's ids and rows and (tables of distinct rows, the default) of the
rows its tables hold for those ids, computed on the device from the rows'
definition; each variant's rows are checked against those at every step, and
compared, step by step, with the ``hbm`` variant's (``host_sync``'s without
one), beside its generated tokens; a difference is reported as FAILED and the
exit status is 1.
"""

from __future__ import annotations

import os

# Tables placed in HBM are allocated outside XLA's pool: keep XLA from taking
# most of the GPU up front (a user's own setting wins).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
from serving import cli, engine, model, tables  # noqa: E402

from benchmarks import _common  # noqa: E402

VARIANTS = (
    "no_engram",
    "hbm",
    "host_sync",
    "host_prefetch",
    "host_prefetch_cache",
    # the same prefetches visiting their rows as given, not in table order
    "host_prefetch_plain",
    "host_prefetch_cache_plain",
)
# A prefetch variant's name with this suffix runs it on a grid of N CTAs
# (host_prefetch_ctas16), beside the same variant on --prefetch-ctas's.
CTAS_SUFFIX = re.compile(r"_ctas([1-9][0-9]*)$")


def split_variant(name: str) -> tuple[str, int | None]:
    """(variant, CTAs of its prefetches or None) of a --variants entry."""
    match = CTAS_SUFFIX.search(name)
    return (name[: match.start()], int(match.group(1))) if match else (name, None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/serve.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=cli.HelpFormatter,
    )
    cli.add_arguments(p)
    p.add_argument(
        "--variants",
        metavar="LIST",
        help=f"comma-separated list of {', '.join(VARIANTS)}: run each and report them "
        "side by side (overrides --placement/--prefetch); a prefetch variant with _ctasN "
        "appended runs on N CTAs",
    )
    p.add_argument(
        "--init",
        choices=("random", "dummy"),
        default="random",
        help="table content without --checkpoint: seeded rows that all differ, or every value "
        "1.0 (a wrong row read from it cannot show in the variants' rows check)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        default=1,
        help="serve the prompts this many times per variant, the variants interleaved; "
        "figures are medians over rounds",
    )
    p.add_argument(
        "--calibration-steps",
        type=int,
        metavar="N",
        default=10,
        help="steps timed with and without row fetches to measure the Engram wait (0: skip)",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON records ('-': stdout)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="write a jax profiler trace of 10 decode steps per variant to DIR/<variant> "
        "(open with TensorBoard or XProf)",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    cli.check_arguments(p, args)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.calibration_steps < 0:
        p.error("--calibration-steps must be >= 0")
    if args.variants:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = []
        for v in names:
            base, ctas = split_variant(v)
            if base not in VARIANTS or (ctas and "prefetch" not in base):
                unknown.append(v)
        if unknown or not names:
            p.error(
                f"--variants: unknown {unknown or names}; choose from {', '.join(VARIANTS)} "
                "(a prefetch variant may end in _ctasN)"
            )
        args.variants = list(dict.fromkeys(names))
        for name in args.variants:
            if "_cache" in name and not args.cache_gib > 0:
                p.error(f"variant {name} needs --cache-gib > 0")
    return args


def random_step(step, params, state, rng, slots: int, width: int, reset: bool):
    """One step of ``width`` fresh random tokens per slot (as many as a speculative
    run's verify step reads), awaited."""
    tokens = rng.integers(0, model.MODELS["tiny"].vocab_size, (slots, width), dtype=np.int32)
    inputs = engine.idle_inputs(slots, width)._replace(
        tokens=tokens, n_valid=np.full(slots, width, np.int32), reset=np.full(slots, reset)
    )
    state, out = step(params, state, inputs, verify=width > 1)
    out.next_tokens.block_until_ready()
    return state


def calibrate(step, step_zeros, params, state, slots: int, width: int, steps: int, seed: int):
    """Median decode-step seconds with row fetches and with zeros in their place, interleaved.

    Every slot decodes fresh random tokens each step, so every step reads
    rows it has not read before (repeated ids would be served from cache).
    """
    rng = np.random.default_rng(seed)
    timed: dict[int, list[float]] = {0: [], 1: []}
    for i in range(steps + 1):
        cli.check_stop()
        for which, fn in ((0, step), (1, step_zeros)):
            start = time.perf_counter()
            state = random_step(fn, params, state, rng, slots, width, reset=i == 0)
            if i:  # the first round compiles the zeros step
                timed[which].append(time.perf_counter() - start)
    return statistics.median(timed[0]), statistics.median(timed[1]), state


def profile_decode(step, params, state, slots: int, width: int, seed: int, path: Path):
    """Ten decode steps of fresh random tokens under the jax profiler, into ``path``."""
    rng = np.random.default_rng(seed)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cli.UserError(f"cannot write the profile to {path}: {exc}") from None
    with jax.profiler.trace(str(path)):
        for _ in range(10):
            cli.check_stop()
            state = random_step(step, params, state, rng, slots, width, reset=False)
    return state


# -- a run per variant --------------------------------------------------------------------


@dataclasses.dataclass
class VariantRun:
    """One variant of the comparison: its compiled step and what each round measured."""

    name: str
    mode: str
    prefetch: dict  # its prefetches' options: order, prefetch_ctas (None: default)
    tables: tuple
    caches: tuple | None
    step: object
    rounds: list[engine.RunStats] = dataclasses.field(default_factory=list)
    outputs: list[list[int]] | None = None


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every variant of a run shares."""

    cfg: model.ModelConfig
    layout: object
    compressor: object
    params: dict
    prompts: list
    device: object
    dtype: object


def jitted_step(mode, tables_, caches, setup: Setup, args, prefetch: dict, drafter=None):
    """The engine step of ``mode`` over ``tables_`` (prefetches with the options
    ``prefetch``: order, prefetch_ctas; speculating with ``drafter``, None: the
    engine's default), returning each layer's checksums: of
    its ids, its rows and, for tables of distinct rows, of the rows those ids should
    read (computed on the device from the rows' definition, reading no table)."""
    expected = None
    if table_content(args) == "distinct":
        layout = setup.layout

        def expected(layer, ids):
            return _common.expected_rows(
                ids,
                layout.head_dim,
                seed=tables.table_seed(args.seed, layer),
                row_stop=layout.num_embeddings[layer],
            )

    return engine.make_step(
        setup.cfg,
        setup.layout,
        setup.compressor,
        tables_,
        mode,
        caches=caches,
        speculate=args.speculate,
        drafter=drafter,
        **prefetch,
        checksum=_common.rows_checksum,
        expected=expected,
    )


def finish_variant(run: VariantRun, setup: Setup, args, state) -> tuple[dict, dict]:
    """The variant's record (medians over its rounds), after its calibration and profile."""
    width = args.speculate + 1
    wait_share = None
    if run.mode in ("sync", "prefetch") and args.calibration_steps:
        zeros = jitted_step("zeros", run.tables, run.caches, setup, args, run.prefetch)
        with_rows, without, state = calibrate(
            run.step,
            zeros,
            setup.params,
            state,
            args.slots,
            width,
            args.calibration_steps,
            args.seed,
        )
        wait_share = max(0.0, 1.0 - without / with_rows)
    if args.profile:
        path = Path(args.profile) / run.name
        state = profile_decode(run.step, setup.params, state, args.slots, width, args.seed, path)
    jax.block_until_ready(state)  # nothing may still read the tables when they are freed
    stats = run.rounds[-1]
    decode = [t for r in run.rounds for t in (r.decode_steps or r.prefill_steps)]
    prefill = [t for r in run.rounds for t in r.prefill_steps]
    tokens_per_s = [r.generated / r.wall_s for r in run.rounds]
    record = dict(
        variant=run.name,
        tokens_per_s=statistics.median(tokens_per_s),
        tokens_per_s_rounds=tokens_per_s,
        processed_tokens_per_s=statistics.median(r.processed / r.wall_s for r in run.rounds),
        step_ms=1e3 * statistics.median(decode),
        prefill_step_ms=1e3 * statistics.median(prefill) if prefill else None,
        engram_wait_share=wait_share,
        rows_per_token=stats.rows / stats.processed if run.mode != "none" else 0.0,
        generated_tokens=stats.generated,
        processed_tokens=stats.processed,
        wall_s=statistics.median(r.wall_s for r in run.rounds),
        rounds=len(run.rounds),
        decode_steps=len(stats.decode_steps),
        prefill_steps=len(stats.prefill_steps),
        speculate=args.speculate,
        drafted_tokens=stats.drafted,
        accepted_tokens=stats.accepted,
        acceptance_rate=stats.acceptance_rate,
        placement=run.tables[0].placement if run.tables else None,
        prefetch=run.mode == "prefetch",
        prefetch_ctas=run.prefetch["prefetch_ctas"] if run.mode == "prefetch" else None,
        prefetch_order=run.prefetch["order"] if run.mode == "prefetch" else None,
        cache_gib=sum(c.nbytes for c in run.caches) / 2**30 if run.caches else 0.0,
        table_gib=tables.table_bytes(setup.layout) / 2**30 if run.mode != "none" else 0.0,
        table_rows=None if run.mode == "none" else table_content(args),
        model=args.model,
        slots=args.slots,
        requests=len(setup.prompts),
        max_new_tokens=args.max_new_tokens,
        dtype=jnp.dtype(setup.dtype).name,
        device=f"{setup.device.platform}: {setup.device.device_kind}",
        jax=jax.__version__,
    )
    return record, state


def table_content(args) -> str:
    """What the tables hold: a checkpoint's rows, rows that all differ, or all ones."""
    return "checkpoint" if args.checkpoint else {"random": "distinct", "dummy": "ones"}[args.init]


def paired_ratios(records: list[dict]) -> None:
    """``vs_hbm``: the median over rounds of each round's tokens/s over the HBM variant's
    in the same round (rounds interleave the variants, so a drift of the machine's
    speed cancels)."""
    hbm = next((r for r in records if r["variant"] == "hbm"), None)
    for r in records:
        if hbm is not None:
            pairs = zip(r["tokens_per_s_rounds"], hbm["tokens_per_s_rounds"], strict=True)
            r["vs_hbm"] = statistics.median(mine / theirs for mine, theirs in pairs)


def rows_checks(runs: list[VariantRun]) -> dict[str, dict]:
    """Each variant's rows check, a results-record fragment. With tables of distinct
    rows every step also returned the checksum of the rows its tables hold for its
    ids: each layer's rows at every step of every round are checked against that,
    whatever tokens the variant generated. Beside it (and alone for other tables),
    the checksums of its ids and rows against the reference variant's (hbm, else
    host_sync) at the same step; a step whose ids differ (the tokens went another
    way) cannot be compared there and is counted apart. Its tokens are compared too."""
    ref = next((r for name in ("hbm", "host_sync") for r in runs if r.name == name), None)
    checks = {}
    for run_ in runs:
        if run_.mode == "none":
            checks[run_.name] = {"rows_checked": None, "rows_check": "no Engram rows"}
            continue
        own = own_rows_check(run_)
        other = reference_rows_check(run_, ref) if ref is not None and run_ is not ref else None
        if own is not None:
            mismatched = own["mismatched"] + (other["mismatched"] if other else 0)
            how = (
                "uint32 checksum of each Engram layer's rows at every step of every round vs "
                "the checksum of the rows its tables hold for the step's ids (from the rows' "
                "definition, on the device, in the same step)"
            )
            record = {
                "rows_checked": own["checksums"] > 0 and not mismatched,
                "rows_checked_against": "tables",
                "rows_check": how + (f"; and vs the {ref.name} variant's" if other else ""),
                "rows_checksums": own["checksums"],
                "rows_mismatched": mismatched,
            }
        elif ref is None:
            record = {
                "rows_checked": None,
                "rows_check": "not compared: no hbm or host_sync variant in this run",
            }
        elif other is None:
            total = sum(len(r.checks) for r in run_.rounds) * len(run_.tables)
            record = {
                "rows_checked": True,
                "rows_check": "the reference of the other variants' rows checks",
                "rows_checksums": total,
                "rows_mismatched": 0,
            }
        else:
            record = {
                # A step whose ids differ from the reference's (the tokens went
                # another way) checks nothing: the timing is then of other work.
                "rows_checked": other["compared"] > 0
                and not other["mismatched"]
                and not other["not_compared"],
                "rows_checked_against": ref.name,
                "rows_check": "uint32 checksums of each Engram layer's ids and rows at every "
                f"step of every round, vs the {ref.name} variant's at the same step",
                "rows_checksums": other["compared"],
                "rows_mismatched": other["mismatched"],
            }
        if other is not None:
            record["rows_vs_reference_compared"] = other["compared"]
            record["rows_not_compared"] = other["not_compared"]
            record["tokens_equal_reference"] = run_.outputs == ref.outputs
        checks[run_.name] = record
    return checks


def own_rows_check(run_: VariantRun) -> dict | None:
    """Rows against the checksums of the rows the tables hold (the steps' third
    column), or None when the steps did not return those."""
    steps = [c for r in run_.rounds for c in r.checks]
    if not steps or np.shape(steps[0])[-1] < 3:
        return None
    sums = np.stack(steps)  # [steps, layers, 3]
    return {
        "checksums": int(sums[..., 1].size),
        "mismatched": int(np.count_nonzero(sums[..., 1] != sums[..., 2])),
    }


def reference_rows_check(run_: VariantRun, ref: VariantRun) -> dict:
    """Ids and rows against the reference variant's, step by step, where the ids match."""
    compared = mismatched = not_compared = 0
    for mine, theirs in zip(run_.rounds, ref.rounds, strict=True):
        steps = min(len(mine.checks), len(theirs.checks))
        not_compared += abs(len(mine.checks) - len(theirs.checks)) * len(run_.tables)
        if not steps:
            continue
        a, b = np.stack(mine.checks[:steps]), np.stack(theirs.checks[:steps])
        same_ids = a[..., 0] == b[..., 0]  # [steps, layers]
        compared += int(same_ids.sum())
        not_compared += int((~same_ids).sum())
        mismatched += int((same_ids & (a[..., 1] != b[..., 1])).sum())
    return {"compared": compared, "mismatched": mismatched, "not_compared": not_compared}


class PlannedRun(NamedTuple):
    """A variant to serve: its step mode, tables and prefetch options."""

    name: str
    mode: str  # engine step mode
    placement: str | None  # of its tables; None: no Engram
    cached: bool  # with the hot-row cache
    prefetch: dict  # its prefetches' options: order, prefetch_ctas (None: default)


def variant_plan(args, device) -> list[PlannedRun]:
    """The runs, in the order of the first round: host variants (which share one set
    of tables) first, hbm last."""

    def prefetch(order, ctas=None) -> dict:
        return dict(order=order, prefetch_ctas=ctas or args.prefetch_ctas)

    if not args.variants:
        *run, order = cli.single_run(args, device)
        return [PlannedRun(*run, prefetch(order))]
    if "hbm" in args.variants and device.platform != "gpu":
        here = ", ".join(v for v in VARIANTS if v != "hbm")
        raise cli.UserError(
            f"variant hbm puts the tables in GPU memory, and no GPU is in use; on this "
            f"machine these variants run: {here}"
        )
    host = args.placement if args.placement != "device" else "auto"
    order = args.prefetch_order
    table = {
        "no_engram": ("none", None, False, order),
        "host_sync": ("sync", host, False, order),
        "host_prefetch": ("prefetch", host, False, order),
        "host_prefetch_cache": ("prefetch", host, True, order),
        "host_prefetch_plain": ("prefetch", host, False, "plain"),
        "host_prefetch_cache_plain": ("prefetch", host, True, "plain"),
        "hbm": ("sync", "device", False, order),
    }
    keyed = []
    for v in args.variants:
        base, ctas = split_variant(v)
        *run, order = table[base]
        keyed.append(
            ((v == "hbm", VARIANTS.index(base), v), PlannedRun(v, *run, prefetch(order, ctas)))
        )
    return [r for _, r in sorted(keyed)]  # the names are distinct: no two keys tie


def machine() -> dict:
    """Where the figures were taken, for the results file."""
    import jaxlib

    return {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "devices": sorted({f"{d.platform}: {d.device_kind}" for d in jax.devices()}),
    }


def summary(records, layout, prompts, args) -> str:
    speculating = args.speculate > 0
    lines = [
        f"{len(prompts)} requests, {args.slots} slots, {tables.describe(args.model, layout)}"
        + (f", speculating {args.speculate} tokens" if speculating else ""),
        f"{'variant':19} {'placement':9} {'tokens/s':>9} {'x hbm':>6} {'step ms':>8} "
        f"{'row wait':>9} {'rows/token':>10}" + ("  accepted drafts" if speculating else ""),
    ]
    for r in records:
        wait = "-" if r["engram_wait_share"] is None else f"{100 * r['engram_wait_share']:.1f} %"
        vs_hbm = f"{r['vs_hbm']:.3f}" if "vs_hbm" in r else "-"
        line = (
            f"{r['variant']:19} {r['placement'] or '-':9} {r['tokens_per_s']:9.1f} "
            f"{vs_hbm:>6} {r['step_ms']:8.2f} {wait:>9} {r['rows_per_token']:10.1f}"
        )
        if speculating:
            line += f"  {cli.acceptance(r['drafted_tokens'], r['accepted_tokens'])}"
        lines.append(line)
    rounds = f"median of {args.rounds} interleaved rounds; " if args.rounds > 1 else ""
    lines.append(
        f"{rounds}tokens/s: generated tokens per second of serving; x hbm: tokens/s over the "
        "hbm variant's (per round); step ms: median decode step; "
        "row wait: share of a decode step spent on Engram rows (timed with lookups vs with "
        "zeros in their place); rows/token: rows fetched per token processed"
    )
    return "\n".join(lines)


def serve_variants(plan, setup: Setup, tokenizer, args):
    """Every variant's records and outputs, the variants interleaved round by round."""
    cfg, layout, device = setup.cfg, setup.layout, setup.device
    checkpoint = tables.open_checkpoint(args.checkpoint, layout) if args.checkpoint else None
    profiles = None
    if any(r.cached for r in plan):
        if args.cache_profile:
            texts = cli.read_lines(args.cache_profile, "profile text")
        else:
            texts = [tokenizer.decode(p[1:]) for p in setup.prompts]
        profiles = tables.hot_row_profiles(texts, tokenizer, setup.compressor, layout)
    max_len = engine.cache_length(
        args.max_prompt_tokens, args.max_new_tokens, args.prefill_chunk, args.speculate
    )
    shapes = engine.step_shapes(args.prefill_chunk, args.speculate)
    records, runs, tables_at, caches = [], [], {}, None
    with contextlib.ExitStack() as stack, jax.default_device(device):
        state = engine.init_slot_state(cfg, layout, args.slots, max_len, setup.dtype)
        for name, mode, placement, cached, prefetch in plan:
            if placement is not None and placement not in tables_at:
                tables_at[placement] = tables.build_tables(
                    layout,
                    placement,
                    device,
                    stack,
                    checkpoint=checkpoint,
                    fill={"random": "distinct", "dummy": "ones"}[args.init],
                    seed=args.seed,
                    progress=not args.no_progress,
                )
            tables_ = tables_at[placement] if mode != "none" else ()
            if cached and caches is None:
                caches = tables.build_caches(tables_, profiles, args.cache_gib, device, stack)
            run_caches = caches if cached else None
            step = jitted_step(mode, tables_, run_caches, setup, args, prefetch)
            state = engine.warm_up(step, setup.params, state, args.slots, shapes)
            runs.append(VariantRun(name, mode, prefetch, tables_, run_caches, step))
        # Rounds interleave the variants, each round starting one further along.
        for r in range(args.rounds):
            for run_ in runs[r % len(runs) :] + runs[: r % len(runs)]:
                run_.outputs, stats, state = engine.serve(
                    run_.step,
                    setup.params,
                    state,
                    setup.prompts,
                    slots=args.slots,
                    prefill_chunk=args.prefill_chunk,
                    max_new_tokens=args.max_new_tokens,
                    speculate=args.speculate,
                    between_steps=cli.check_stop,
                    progress=not args.no_progress,
                )
                run_.rounds.append(stats)
        for run_ in runs:
            record, state = finish_variant(run_, setup, args, state)
            records.append(record)
        jax.block_until_ready(state)
    paired_ratios(records)
    checks = rows_checks(runs)
    for record in records:
        record.update(checks[record["variant"]])
    return records, {run_.name: run_.outputs for run_ in runs}


def run(args) -> int:
    cli.writable(args.json, args.outputs)
    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype or ("bfloat16" if device.platform == "gpu" else "float32"))
    cfg = model.MODELS[args.model]
    tokenizer, compressor = cli.load_tokenizer()
    prompts = cli.read_prompts(args, tokenizer)
    layout = tables.make_layout(cfg, compressor, args.table_gib)
    if args.write_checkpoint:
        tables.write_checkpoint(args.write_checkpoint, layout, args.seed)
        print(f"wrote {args.write_checkpoint}")
        return 0
    plan = variant_plan(args, device)
    for placement in {r.placement for r in plan if r.placement is not None}:
        tables.check_fits(tables.table_bytes(layout), placement, device)  # before anything slow
    with jax.default_device(device):
        params = model.init_params(cfg, args.seed, dtype)
    setup = Setup(cfg, layout, compressor, params, prompts, device, dtype)
    records, outputs = serve_variants(plan, setup, tokenizer, args)
    report = sys.stderr if args.json == "-" else sys.stdout
    cli.show_completions(outputs, prompts, tokenizer, args.show, report)
    print("\n" + summary(records, layout, prompts, args), file=report)
    if args.json:
        results = {
            "command": shlex.join(["python", *sys.argv]),
            "machine": machine(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "records": records,
        }
        cli.write_text(args.json, json.dumps(results, indent=2))
    if args.outputs:
        cli.write_text(args.outputs, json.dumps(outputs))
    # Other tokens fail the run where they are the only check left on the rows;
    # where every row was checked against the tables, they are the programs'
    # numerics (XLA compiles each variant's model on its own), reported apart.
    other_tokens = [r for r in records if r.get("tokens_equal_reference") is False]
    failed_tokens = [r for r in other_tokens if r.get("rows_checked_against") != "tables"]
    for r in other_tokens:
        what = "FAILED tokens check" if r in failed_tokens else "tokens differ (rows all checked)"
        print(f"{what}: {r['variant']} generated other tokens than the reference", file=report)
    _common.finish_rows_checks(records, file=report)  # exits with status 1 if rows differ
    return 1 if failed_tokens else 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(run, parse_args(argv), "serve.py")


if __name__ == "__main__":
    sys.exit(main())
