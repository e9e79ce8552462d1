"""The example scripts end to end, as a user runs them (subprocesses): the
serving example (no arguments, speculative decoding, a checkpoint round trip),
the serving benchmark's variants, outputs and JSON (rows checked against the
reference variant's), bad input to both (a message, a non-zero exit, no
traceback, no leftover /dev/shm file), their --help, and, marked gpu, the same
tokens and rows with tables in HBM and on the host. In process: the serving
loop's scheduler against a toy model, request by request, the variants' rows
check, and that the example uses engram_jax's public API only. The example and
benchmark processes start together, two at a time, beside the in-process tests.
"""

import ast
import concurrent.futures
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engram_jax as ej
from engram_jax import _native
from engram_jax.storage.shared import FILE_PREFIX, SHM_DIR

from ._helpers import Background, load_file, scaled, scaled_timeout, without_device_count

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "examples" / "serve.py"
BENCH = ROOT / "benchmarks" / "serve.py"
sys.path.insert(0, str(ROOT / "examples"))
from serving import cli, engine, model  # noqa: E402

from benchmarks import serve as serve_bench  # noqa: E402

# The smallest model, few requests, no progress bars: seconds per run.
SMALL = [
    "--model",
    "micro",
    "--num-prompts",
    "5",
    "--slots",
    "2",
    "--max-new-tokens",
    "4",
    "--prefill-chunk",
    "8",
    "--table-gib",
    "0.004",
    "--no-progress",
    "--show",
    "1",
]


# Requests and tokens enough that a bf16 rounding difference between two programs
# shows in greedy decoding (3 of these 16 requests did, on the CPU, before a fix).
ENOUGH_TO_SHOW_ROUNDING = ["--num-prompts", "16", "--max-new-tokens", "16", "--slots", "4"]


def load_example():
    return load_file("serve_example", SERVE)


HASH_MOD = 1_000_003


def fake_step(params, state, inputs, verify=False):
    """A model in numpy with the engine step's signature (no drafts): each slot folds
    its tokens into a running hash and predicts hash % 23 (token 1, EOS, about one
    time in 23); a decoding slot's token is its last prediction."""
    tokens = np.array(inputs.tokens)
    h = np.where(inputs.reset, 0, np.asarray(state))
    tokens[:, 0] = np.where(inputs.decoding, h % 23, tokens[:, 0])
    n_valid = np.where(inputs.decoding, 1, inputs.n_valid)
    for c in range(tokens.shape[1]):
        h = np.where(c < n_valid, (h * 31 + tokens[:, c] + 7) % HASH_MOD, h)
    next_tokens = jnp.asarray(h % 23, jnp.int32)
    zeros = jnp.zeros_like(next_tokens)
    out = engine.StepOutput(
        next_tokens,
        next_tokens[:, None],
        zeros,
        zeros,
        zeros,
        jnp.int32(0),
        jnp.zeros((1, 2)),
        jnp.ones((tokens.shape[0], 1)),
    )
    return jnp.asarray(h), out


def decode_alone(prompt, max_new_tokens, eos):
    h = 0
    for t in prompt:
        h = (h * 31 + t + 7) % HASH_MOD
    out = []
    while True:
        out.append(h % 23)
        if out[-1] == eos or len(out) == max_new_tokens:
            return out
        h = (h * 31 + out[-1] + 7) % HASH_MOD


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=14),
    slots=st.integers(1, 5),
    chunk=st.integers(1, 6),
    max_new_tokens=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_serve_scheduler_decodes_each_request_as_alone(lengths, slots, chunk, max_new_tokens, seed):
    """The continuous-batching loop (one step dispatched ahead, ends seen a step late,
    slots refilled) gives every request exactly what decoding it alone gives."""
    rng = np.random.default_rng(seed)
    prompts = [[0, *rng.integers(2, 50, n - 1).tolist()] for n in lengths]
    outputs, stats, _ = engine.serve(
        fake_step,
        None,
        jnp.zeros(slots, jnp.int32),
        prompts,
        slots=slots,
        prefill_chunk=chunk,
        max_new_tokens=max_new_tokens,
    )
    expected = [decode_alone(p, max_new_tokens, model.EOS_ID) for p in prompts]
    assert outputs == expected
    assert stats.generated == sum(map(len, expected))


def fake_run(name, mode, step_checks, outputs=None):
    """A served variant as rows_checks sees it: per round, per step, [layers, 2] checksums."""
    rounds = [
        engine.RunStats(checks=[np.asarray(c, np.uint32) for c in steps]) for steps in step_checks
    ]
    tables = () if mode == "none" else (None, None)
    return serve_bench.VariantRun(
        name, mode, {"order": "plain"}, tables, None, None, rounds, outputs or [[1, 2]]
    )


def test_serve_variant_with_a_grid_suffix_runs_its_prefetches_on_that_grid():
    args = serve_bench.parse_args(
        [
            "--variants",
            "host_prefetch_ctas3,host_sync,host_prefetch_cache_ctas9,host_prefetch",
            "--cache-gib",
            "1",
            "--prefetch-ctas",
            "2",
        ]
    )
    plan = serve_bench.variant_plan(args, jax.devices("cpu")[0])
    grids = [(name, mode, cached, p["prefetch_ctas"]) for name, mode, _, cached, p in plan]
    assert grids == [
        ("host_sync", "sync", False, 2),
        ("host_prefetch", "prefetch", False, 2),
        ("host_prefetch_ctas3", "prefetch", False, 3),
        ("host_prefetch_cache_ctas9", "prefetch", True, 9),
    ]
    for bad in ("host_sync_ctas2", "hbm_ctas4", "host_prefetch_ctas0", "nothing_ctas2"):
        with pytest.raises(SystemExit):
            serve_bench.parse_args(["--variants", bad])


def test_serve_rows_check_against_the_tables_holds_whatever_the_tokens():
    """With the checksums of the rows the tables hold (a third column), every step is
    checked against those: a variant whose tokens went another way is still checked
    at every step, and a row that differs from the table's fails."""
    ref_steps = [[[[5, 50, 50], [6, 60, 60]], [[7, 70, 70], [8, 80, 80]]]]
    other_ids = [[[[5, 50, 50], [6, 60, 60]], [[4, 40, 40], [3, 30, 30]]]]
    wrong_row = [[[[5, 50, 50], [6, 60, 60]], [[7, 70, 70], [8, 81, 80]]]]
    checks = serve_bench.rows_checks(
        [
            fake_run("hbm", "sync", ref_steps),
            fake_run("host_prefetch", "prefetch", other_ids, outputs=[[1, 3]]),
            fake_run("host_prefetch_cache", "prefetch", wrong_row),
        ]
    )
    assert checks["hbm"]["rows_checked"] is True and checks["hbm"]["rows_checksums"] == 4
    moved = checks["host_prefetch"]
    assert (moved["rows_checked"], moved["rows_checksums"], moved["rows_checked_against"]) == (
        True,
        4,
        "tables",
    )
    assert (moved["rows_vs_reference_compared"], moved["rows_not_compared"]) == (2, 2)
    assert moved["tokens_equal_reference"] is False
    bad = checks["host_prefetch_cache"]
    # Wrong against the table and, the ids being the same, against hbm's rows too.
    assert (bad["rows_checked"], bad["rows_mismatched"]) == (False, 2)


def test_serve_rows_check_compares_rows_of_the_same_ids_step_by_step():
    """Equal rows pass; a step's different rows of the same ids fail; steps whose ids
    differ (the tokens went another way) are counted apart and fail the check (the
    timing is then of other work); no reference, no check."""
    ref_steps = [[[[5, 50], [6, 60]], [[7, 70], [8, 80]], [[9, 90], [1, 10]]]]  # 1 round, 3 steps
    same = fake_run("host_prefetch", "prefetch", ref_steps)
    zero_rows = [[[[5, 50], [6, 60]], [[7, 70], [8, 0]], [[9, 90], [1, 10]]]]
    other_ids = [[[[5, 50], [6, 60]], [[4, 40], [8, 80]]]]  # one step short, too
    checks = serve_bench.rows_checks(
        [
            fake_run("no_engram", "none", [[]]),
            fake_run("host_sync", "sync", ref_steps),
            same,
            fake_run("host_prefetch_cache", "prefetch", zero_rows),
            fake_run("hbm_like", "prefetch", other_ids, outputs=[[1, 3]]),
        ]
    )
    assert checks["no_engram"]["rows_checked"] is None
    assert checks["host_sync"]["rows_checked"] is True  # the reference
    assert checks["host_prefetch"]["rows_checked"] is True
    assert checks["host_prefetch"]["rows_checksums"] == 6
    assert checks["host_prefetch"]["tokens_equal_reference"] is True
    bad = checks["host_prefetch_cache"]
    assert (bad["rows_checked"], bad["rows_mismatched"], bad["rows_checksums"]) == (False, 1, 6)
    moved = checks["hbm_like"]
    assert (moved["rows_checked"], moved["rows_checksums"]) == (False, 3)
    assert moved["rows_not_compared"] == 3 and moved["tokens_equal_reference"] is False
    alone = serve_bench.rows_checks([same])
    assert alone["host_prefetch"]["rows_checked"] is None


def run(*args, timeout=300):
    # One CPU device, as a user's shell has (the test session forces eight).
    env = without_device_count(dict(os.environ))
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=scaled_timeout(timeout),
        cwd=ROOT,
        env=env,
    )


def shm_files():
    """engram_jax's shared-table files in /dev/shm (other programs' files, such as a
    process pool's semaphores, come and go beside the tests)."""
    if not os.path.isdir(SHM_DIR):
        return set()
    return {name for name in os.listdir(SHM_DIR) if name.startswith(FILE_PREFIX)}


def assert_user_error(result, message, code=1):
    assert result.returncode == code, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def variants_job(out):
    return run(
        BENCH,
        *SMALL,
        "--variants",
        "no_engram,host_sync,host_prefetch,host_prefetch_cache",
        "--cache-gib",
        "0.001",
        "--prefetch-ctas",
        "2",
        "--calibration-steps",
        "2",
        "--json",
        out / "records.json",
        "--outputs",
        out / "tokens.json",
        "--profile",
        out / "profile",
    )


def bfloat16_job(out):
    return run(
        BENCH,
        *SMALL,
        "--dtype",
        "bfloat16",
        *ENOUGH_TO_SHOW_ROUNDING,
        "--calibration-steps",
        "0",
        "--variants",
        "host_sync,host_prefetch,host_prefetch_cache,host_prefetch_plain",
        "--cache-gib",
        "0.001",
        "--outputs",
        out / "tokens.json",
    )


def checkpoint_job(out):
    """The checkpoint written, served with other slot and prefill-chunk counts, and
    refused by a layout of another size: the later runs need the file."""
    path = out / "engram.safetensors"
    wrote = run(SERVE, *SMALL, "--write-checkpoint", path)
    if wrote.returncode:
        return wrote, None, None
    served = run(
        SERVE,
        *SMALL,
        "--checkpoint",
        path,
        "--no-prefetch",
        "--slots",
        "3",
        "--prefill-chunk",
        "3",
        "--outputs",
        out / "tokens.json",
    )
    other = [a if a != "0.004" else "0.008" for a in SMALL]
    return wrote, served, run(SERVE, *other, "--checkpoint", path)


def serve_speculate_job(out):
    return run(
        SERVE,
        *SMALL,
        "--max-new-tokens",
        "8",
        "--speculate",
        "3",
        "--outputs",
        out / "tokens.json",
    )


def bench_speculate_job(out):
    return run(
        BENCH,
        *SMALL,
        "--variants",
        "host_sync,host_prefetch",
        "--speculate",
        "1",
        "--calibration-steps",
        "0",
        "--json",
        out / "records.json",
        "--outputs",
        out / "tokens.json",
    )


# The tests that read the variants run's results.
VARIANTS_TESTS = {
    "test_serve_records",
    "test_serve_prefetch_matches_sync_and_engram_matters",
    "test_serve_checkpoint_round_trip_and_batching",
    "test_bench_speculate_records",
}


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The file's example and benchmark processes, started together before its first
    test that needs one (see _helpers.Background); its other tests run meanwhile."""
    background = Background(request)
    background.shm_before = shm_files()
    background.out = {}

    def start(name, tests, fn, *args):
        background.start(name, set(tests), fn, *args)

    def out(name):
        background.out[name] = tmp_path_factory.mktemp(name)
        return background.out[name]

    start("variants", VARIANTS_TESTS, variants_job, out("variants"))
    start("bfloat16", ["test_serve_prefetch_same_tokens_in_bfloat16"], bfloat16_job,
          out("bfloat16"))  # fmt: skip
    start("lookup_in_model", ["test_lookup_in_model"], run,
          ROOT / "examples" / "lookup_in_model.py")  # fmt: skip
    start("bench_speculate", ["test_bench_speculate_records"], bench_speculate_job,
          out("bench_speculate"))  # fmt: skip
    start("checkpoint", ["test_serve_checkpoint_round_trip_and_batching"], checkpoint_job,
          out("checkpoint"))  # fmt: skip
    start("serve_speculate", ["test_serve_speculate_equals_greedy"], serve_speculate_job,
          out("serve_speculate"))  # fmt: skip
    start("no_arguments", ["test_serve_no_arguments"], functools.partial(run, timeout=600), SERVE)
    for script, name in ((SERVE, "example"), (BENCH, "benchmark")):
        start(f"help_{name}", ["test_serve_help"], run, script, "--help")
    yield background
    background.close()


@pytest.fixture(scope="module")
def variants_run(jobs):
    result, out = jobs.result("variants"), jobs.out["variants"]
    assert result.returncode == 0, result.stderr
    # Nothing of ours left behind (the runs beside it hold no shared tables either).
    assert not shm_files() - jobs.shm_before
    for variant in ("no_engram", "host_sync", "host_prefetch", "host_prefetch_cache"):
        assert list((out / "profile" / variant).rglob("*.xplane.pb")), variant
    results = json.loads((out / "records.json").read_text())
    assert results["command"].startswith("python ") and results["machine"]["jax"]
    records = results["records"]
    tokens = json.loads((out / "tokens.json").read_text())
    return result, records, tokens


def test_lookup_in_model(jobs):
    result = jobs.result("lookup_in_model")
    assert result.returncode == 0, result.stderr
    assert "match the reference" in result.stdout


def test_serve_records(variants_run):
    result, records, _ = variants_run
    assert [r["variant"] for r in records] == [
        "no_engram",
        "host_sync",
        "host_prefetch",
        "host_prefetch_cache",
    ]
    for r in records:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
        assert r["prefetch_ctas"] == (2 if r["prefetch"] else None)
        assert r["prefetch_order"] == (ej.PREFETCH_ORDER if r["prefetch"] else None)
        assert r["generated_tokens"] == 5 * 4 and r["requests"] == 5
    plain, *engram = records
    assert plain["rows_per_token"] == 0 and plain["engram_wait_share"] is None
    assert plain["rows_checked"] is None
    # Every step's Engram rows of each variant equal what the tables hold for its ids,
    # and host_sync's (the reference here) for the same ids.
    reference, *checked = engram
    assert reference["rows_checked"] is True and reference["rows_checked_against"] == "tables"
    for r in checked:
        assert r["table_rows"] == "distinct"
        assert r["rows_checked"] is True and r["tokens_equal_reference"] is True
        assert r["rows_checked_against"] == "tables" and "host_sync" in r["rows_check"]
        assert r["rows_mismatched"] == r["rows_not_compared"] == 0
        assert r["rows_checksums"] == r["rows_vs_reference_compared"]
        assert r["rows_checksums"] == reference["rows_checksums"] > 0
    assert "rows checked: 3 records" in result.stdout
    for r in engram:
        # micro: 2 Engram layers x (orders 2-3 x 2 heads); every real token fetches all its rows.
        assert r["rows_per_token"] == 8.0
        assert 0.0 <= r["engram_wait_share"] < 1.0
        # auto placement: plain memory on the CPU backend, page-locked host memory with a GPU.
        if not _native.gpu_available():
            assert r["placement"] == "cpu"
        assert r["placement"] != "device" and r["table_gib"] > 0
    assert [r["prefetch"] for r in engram] == [False, True, True]
    assert [r["cache_gib"] > 0 for r in engram] == [False, False, True]
    assert "tokens/s" in result.stdout and "host_prefetch" in result.stdout


def test_serve_prefetch_matches_sync_and_engram_matters(variants_run):
    _, _, tokens = variants_run
    assert tokens["host_sync"] == tokens["host_prefetch"] == tokens["host_prefetch_cache"]
    assert tokens["host_sync"] != tokens["no_engram"]
    assert all(len(seq) == 4 for seq in tokens["host_sync"])


def test_serve_prefetch_same_tokens_in_bfloat16(jobs):
    """bf16 is where tying lookup_done to the layer carelessly changes the numbers
    (x routed through an optimization_barrier is rounded there; the plain lookup's
    program may keep it in excess precision): with it, 3 of these 16 requests decoded
    differently on the CPU."""
    result = jobs.result("bfloat16")
    assert result.returncode == 0, result.stderr
    tokens = json.loads((jobs.out["bfloat16"] / "tokens.json").read_text())
    assert tokens["host_sync"] == tokens["host_prefetch"] == tokens["host_prefetch_cache"]
    assert tokens["host_sync"] == tokens["host_prefetch_plain"]
    assert sum(map(len, tokens["host_sync"])) > 100


def test_serve_checkpoint_round_trip_and_batching(variants_run, jobs):
    """Tables written as a safetensors checkpoint and loaded back, served with other slot
    and prefill-chunk counts, give the same tokens: each sequence's KV cache, positions and
    hash lookback state are its own."""
    _, _, tokens = variants_run
    wrote, result, refused = jobs.result("checkpoint")
    assert wrote.returncode == 0, wrote.stderr
    assert result.returncode == 0, result.stderr
    served = json.loads((jobs.out["checkpoint"] / "tokens.json").read_text())
    assert served["host_sync"] == tokens["host_sync"]
    # A checkpoint of another layout is refused before anything runs.
    assert_user_error(refused, "must match the checkpoint")


def test_serve_speculate_equals_greedy(jobs):
    """--speculate: the prompts served plainly and speculatively, the same tokens, the
    share of drafts accepted reported beside the plain run."""
    result = jobs.result("serve_speculate")
    assert result.returncode == 0, result.stderr
    assert "speculative vs greedy decoding: all 5 requests generated the same tokens" in (
        result.stdout
    )
    assert "accepted drafts" in result.stdout and "host_prefetch_speculate3" in result.stdout
    assert "host_prefetch, host_prefetch_speculate3 (same tokens):" in result.stdout
    tokens = json.loads((jobs.out["serve_speculate"] / "tokens.json").read_text())
    assert tokens["host_prefetch"] == tokens["host_prefetch_speculate3"]
    assert sum(map(len, tokens["host_prefetch"])) == 5 * 8


def test_token_agreement_reports_where_runs_part():
    """Two runs' tokens compared: identical requests, the first differing token of the
    others and both runs' top-2 logit gaps there."""
    plain = [[1, 2, 3], [4, 5, 6], [7, 8]]
    other = [[1, 2, 3], [4, 9, 6], [7, 8, 2]]
    margins = engine.RunStats(margins=[np.array(m) for m in ([1, 1, 1], [1, 0.01, 1], [1, 2])])
    other_margins = engine.RunStats(
        margins=[np.array(m) for m in ([1, 1, 1], [1, 0.02, 1], [1, 2, 3])]
    )
    agreement = cli.token_agreement(plain, margins, other, other_margins)
    assert agreement["identical"] == 1 and agreement["first_divergence"] == [1, 2]
    assert agreement["gaps_at_divergence"] == [(0.01, 0.02)] and agreement["median_gap"] == 1
    text = cli.describe_agreement(agreement)
    assert text.startswith("1 of 3 requests generated the same tokens") and "0.01 / 0.02" in text
    assert cli.describe_agreement(cli.token_agreement(plain, margins, plain, margins)) == (
        "all 3 requests generated the same tokens"
    )


def test_bench_speculate_records(variants_run, jobs):
    """The benchmark with --speculate 1: every variant speculates, its records say how
    many drafts were accepted, and its tokens are greedy decoding's."""
    _, _, greedy = variants_run
    result = jobs.result("bench_speculate")
    assert result.returncode == 0, result.stderr
    assert "accepted drafts" in result.stdout and "rows checked: 2 records" in result.stdout
    out = jobs.out["bench_speculate"]
    records = json.loads((out / "records.json").read_text())["records"]
    for r in records:
        assert r["speculate"] == 1 and 0 <= r["accepted_tokens"] <= r["drafted_tokens"]
        rate = r["acceptance_rate"]
        assert rate == (r["accepted_tokens"] / r["drafted_tokens"] if r["drafted_tokens"] else None)
        assert r["rows_checked"] is True
    assert records[1]["tokens_equal_reference"] is True
    tokens = json.loads((out / "tokens.json").read_text())
    assert tokens["host_sync"] == tokens["host_prefetch"] == greedy["host_sync"]


@pytest.mark.parametrize("script", [SERVE, BENCH], ids=["example", "benchmark"])
def test_serve_help(script, jobs):
    """Every flag says what it does, and a default is given once, where there is one."""
    parser = (load_example() if script == SERVE else serve_bench).build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    text = parser.format_help()
    assert "(default: None)" not in text
    # Each flag's help, joined across its wrapped lines.
    entries = [" ".join(e.split()) for e in text.split("\n  -")[1:]]
    assert all(e.count("default") <= 1 for e in entries), entries
    name = "example" if script == SERVE else "benchmark"
    result = jobs.result(f"help_{name}")  # as a user runs it
    assert result.returncode == 0 and "--speculate K" in result.stdout, result.stderr


def test_example_uses_public_api_only():
    """examples/serve.py and examples/serving use engram_jax as ``ej`` and only the
    names in ``engram_jax.__all__``."""
    files = [SERVE, *sorted((ROOT / "examples" / "serving").glob("*.py"))]
    used = set()
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in ("engram_jax", "benchmarks"):
                        assert (alias.name, alias.asname) == ("engram_jax", "ej"), path
            elif isinstance(node, ast.ImportFrom) and not node.level:
                assert (node.module or "").split(".")[0] not in ("engram_jax", "benchmarks"), (
                    f"{path.name}:{node.lineno} imports from {node.module}"
                )
            elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "ej":
                used.add(node.attr)
    assert used and used <= set(ej.__all__), used - set(ej.__all__)


def _host_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    raise AssertionError("no MemAvailable in /proc/meminfo")


def bad_cases(tmp: Path):
    corrupt = tmp / "corrupt.safetensors"
    corrupt.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    long_prompt = tmp / "long.txt"
    long_prompt.write_text("short prompt\n" + "word " * 100 + "\n")
    too_big = f"{min(300.0, 2 * _host_available_gib()):.1f}"
    # Flags the parser refuses (status 2) are checked in this process (flag_cases);
    # one of them here, through a process of its own.
    yield SERVE, ["--bogus-flag"], "unrecognized arguments", 2
    yield SERVE, ["--checkpoint", tmp / "missing.safetensors"], "cannot use checkpoint", 1
    yield SERVE, ["--checkpoint", corrupt], "cannot use checkpoint", 1
    yield SERVE, ["--prompts", long_prompt], "prompt 2 has", 1
    yield SERVE, ["--prompts", tmp / "none.txt"], "cannot read prompts", 1
    yield (
        SERVE,
        ["--cache-gib", "0.01", "--cache-profile", tmp / "none.txt"],
        "cannot read profile",
        1,
    )
    yield SERVE, ["--model", "tiny", "--table-gib", too_big], "do not fit", 1
    if not _native.gpu_available():
        # Named with what can run here: the README's GPU command, tried on a CPU.
        yield BENCH, ["--variants", "hbm"], "no GPU is in use", 1
        yield BENCH, ["--variants", "no_engram,hbm,host_sync"], "these variants run: no_engram", 1
        yield SERVE, ["--placement", "device"], "no GPU is in use", 1


def flag_cases():
    yield SERVE, ["--slots", "0"], "--slots must be >= 1"
    yield BENCH, ["--slots", "0"], "--slots must be >= 1"
    yield SERVE, ["--speculate", "-1"], "--speculate must be >= 0"
    yield BENCH, ["--variants", "host_sync,fast"], "unknown ['fast']"
    yield BENCH, ["--variants", "host_prefetch_cache"], "needs --cache-gib > 0"
    yield SERVE, ["--cache-gib", "-1"], "--cache-gib must be >= 0"
    yield SERVE, ["--prefetch-ctas", "0"], "--prefetch-ctas must be >= 1"


def test_bad_flags_are_one_line(capsys):
    """What the parsers refuse: status 2 and one line, before anything is built."""
    parse = {SERVE: load_example().parse_args, BENCH: serve_bench.parse_args}
    for script, flags, message in flag_cases():
        with pytest.raises(SystemExit) as exc:
            parse[script](["--no-progress", *flags])
        err = capsys.readouterr().err
        assert exc.value.code == 2, (flags, err)
        assert message in err and "Traceback" not in err, (flags, err)


def test_serve_bad_input(tmp_path, jobs):
    jobs.wait()  # alone: no other child's files in /dev/shm meanwhile
    before = shm_files()
    cases = list(bad_cases(tmp_path))
    # Each case is a process of its own, mostly jax's import: a few at once.
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = pool.map(lambda case: run(case[0], "--no-progress", *case[1], timeout=120), cases)
        for (_, _, message, code), result in zip(cases, results, strict=True):
            assert_user_error(result, message, code)
    assert not shm_files() - before  # nothing of ours left behind


def test_serve_sigterm_frees_tables_cleanly(jobs):
    """SIGTERM mid-run: the step in flight finishes, the tables are freed, exit 143."""
    jobs.wait()  # alone, as test_serve_bad_input
    before = shm_files()
    env = without_device_count(dict(os.environ))
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SERVE),
            *(a for a in SMALL if a != "--no-progress"),
            "--num-prompts",
            "100000",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        seen = ""
        while "engram table" not in seen:  # the handler is installed before tables are built
            line = proc.stderr.readline()
            assert line, f"serve.py ended early: {seen}"
            seen += line
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, seen + rest
    assert "stopped by SIGTERM" in rest and "Traceback" not in seen + rest
    assert not shm_files() - before  # nothing of ours left behind


def test_serve_no_arguments(jobs):
    """The README's first command: no arguments, CPU, built-in prompts."""
    result = jobs.result("no_arguments")
    assert result.returncode == 0, result.stderr
    assert "host_prefetch" in result.stdout and "tokens/s" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.gpu
def test_serve_same_tokens_hbm_and_host(tmp_path):
    """Tables in HBM, on the host read at the layer, on the host prefetched: same tokens
    (bf16 on the GPU; enough requests and tokens that a rounding difference shows)."""
    result = run(
        BENCH,
        *SMALL,
        *ENOUGH_TO_SHOW_ROUNDING,
        "--variants",
        "hbm,host_sync,host_prefetch,host_prefetch_cache,host_prefetch_plain,"
        "host_prefetch_cache_plain",
        "--cache-gib",
        "0.001",
        "--calibration-steps",
        "2",
        "--outputs",
        tmp_path / "tokens.json",
        "--json",
        tmp_path / "records.json",
    )
    assert result.returncode == 0, result.stderr
    tokens = json.loads((tmp_path / "tokens.json").read_text())
    assert tokens["hbm"] == tokens["host_sync"] == tokens["host_prefetch"]
    assert tokens["hbm"] == tokens["host_prefetch_cache"]
    assert tokens["hbm"] == tokens["host_prefetch_plain"] == tokens["host_prefetch_cache_plain"]
    results = json.loads((tmp_path / "records.json").read_text())
    assert results["command"].startswith("python ") and results["machine"]["jax"]
    records = {r["variant"]: r for r in results["records"]}
    assert records["hbm"]["placement"] == "device"
    assert records["host_prefetch"]["placement"] != "device"
    # Every step's Engram rows of each host variant equal the HBM variant's.
    assert records["hbm"]["rows_checked"] is True
    assert records["host_prefetch_plain"]["prefetch_order"] == "plain"
    for name in ("host_sync", "host_prefetch", "host_prefetch_cache", "host_prefetch_plain"):
        r = records[name]
        assert "vs the hbm variant's" in r["rows_check"], r["rows_check"]
        assert r["rows_checked"] is True and r["rows_mismatched"] == r["rows_not_compared"] == 0
        assert r["rows_checksums"] == records["hbm"]["rows_checksums"] > 0


@pytest.mark.gpu
def test_serve_medium_same_tokens_hbm_and_prefetch(tmp_path):
    """The GPU-sized model (4 hyper-connection copies, d_model 4096) at 512 slots:
    prefetched lookups give the plain lookup's tokens. Where the prefetch's ordering
    barrier held the embedded copies, XLA tiled the norms otherwise: 16 of these 512
    requests decoded differently (86 of 512 real prompts at 32 tokens each); the micro
    model above could not show it. Under tools/sanitize.py's scale, a tenth of the
    requests and slots: the tool slows every GEMM's instructions, not only the library's."""
    count = scaled(512)
    words = np.random.default_rng(0).choice(
        ["engram", "table", "row", "host", "memory", "token", "layer", "cache"], (count, 12)
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{i} {' '.join(w)}\n" for i, w in enumerate(words)))
    result = run(
        BENCH,
        *("--model", "medium", "--slots", count, "--table-gib", "1", "--prompts", prompts),
        *("--max-new-tokens", "8", "--calibration-steps", "0", "--no-progress", "--show", "0"),
        *("--variants", "hbm,host_sync,host_prefetch,host_prefetch_plain"),
        *("--outputs", tmp_path / "tokens.json"),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    tokens = json.loads((tmp_path / "tokens.json").read_text())
    assert len(tokens["hbm"]) == count
    for name in ("host_sync", "host_prefetch", "host_prefetch_plain"):
        differ = sum(a != b for a, b in zip(tokens[name], tokens["hbm"], strict=True))
        assert differ == 0, f"{name}: {differ} of {count} sequences differ from hbm's"


@pytest.mark.gpu
@pytest.mark.parametrize("placement, speculate", [("pinned", "1"), ("device", "3")])
def test_serve_speculate_exact_in_float32_highest(placement, speculate):
    """On the GPU, in float32 at highest matmul precision, speculative decoding gives
    greedy decoding's tokens exactly (the medium model: its verify steps run other
    GEMM shapes than its one-token steps), host tables prefetched and HBM tables.
    Under tools/sanitize.py's scale, a tenth of the requests and slots."""
    count = scaled(64)
    result = run(
        SERVE,
        *("--model", "medium", "--table-gib", "0.25", "--placement", placement),
        *("--num-prompts", count, "--slots", count, "--max-new-tokens", "12"),
        *("--dtype", "float32", "--precision", "highest", "--speculate", speculate),
        *("--show", "0", "--no-progress"),
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"speculative vs greedy decoding: all {count} requests generated the same tokens" in (
        result.stdout
    )


@pytest.mark.gpu
def test_serve_speculate_same_tokens_hbm_and_host(tmp_path):
    """--speculate 3 on the GPU (bf16): the verify steps of every variant read the same
    rows and give the same tokens as the HBM variant's."""
    result = run(
        BENCH,
        *SMALL,
        *ENOUGH_TO_SHOW_ROUNDING,
        "--variants",
        "hbm,host_sync,host_prefetch",
        "--speculate",
        "3",
        "--calibration-steps",
        "1",
        "--outputs",
        tmp_path / "tokens.json",
        "--json",
        tmp_path / "records.json",
    )
    assert result.returncode == 0, result.stderr
    tokens = json.loads((tmp_path / "tokens.json").read_text())
    assert tokens["hbm"] == tokens["host_sync"] == tokens["host_prefetch"]
    records = {
        r["variant"]: r for r in json.loads((tmp_path / "records.json").read_text())["records"]
    }
    for name in ("host_sync", "host_prefetch"):
        r = records[name]
        assert r["speculate"] == 3 and "vs the hbm variant's" in r["rows_check"]
        assert r["rows_checked"] is True and r["rows_mismatched"] == r["rows_not_compared"] == 0
