"""benchmarks/speculate.py on the CPU: its --smoke run whole (a plain run and
speculative runs with prompt-lookup and oracle drafts, every step's rows checked
against the tables, float32 at the highest precision so the tokens must be the
plain run's), bad input refused in one line, and its tokens comparison. Marked
gpu: the tiny model on pinned tables in float32 at highest precision, where the
speculative runs must give greedy's tokens on the GPU too.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import speculate

from ._helpers import scaled_timeout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from serving import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "speculate.py"
FIELDS = (
    "slots",
    "drafter",
    "acceptance_target",
    "accepted_share",
    "tokens_per_step",
    "rows_per_token",
    "vs_plain",
    "same_tokens",
    "first_divergence",
    "precision",
    "tokens_per_s",
    "step_ms",
    "wide_steps",
    "rows_checked",
    "rows_checksums",
    "rows_mismatched",
)


def test_smoke_run_checks_rows_and_keeps_greedy_tokens(tmp_path):
    result = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--precision", "highest", "--no-progress"]
        + ["--show", "0", "--name", tmp_path / "speculate"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "speculate_smoke.json").read_text())
    assert results["tokens_strict"] is True and results["dtype"] == "float32"
    assert {"machine", "command"} <= set(results)
    # In exact arithmetic the verifying run's tokens, the oracle's references, are plain's.
    assert results["oracle_references"] == "verify"
    assert "oracle references from a verifying run, 8 requests as plain's" in result.stderr
    records = {r["variant"]: r for r in results["records"]}
    assert set(records) == {"plain@4", "prompt_lookup@4", "oracle_0@4", "oracle_70@4"}
    for r in records.values():
        assert set(FIELDS) <= set(r), set(FIELDS) - set(r)
        assert r["slots"] == 4 and r["precision"] == "highest"
        assert r["rows_checked"] is True and r["rows_checksums"] > 0
        assert r["same_tokens"] == 1.0 and r["first_divergence"] is None
        assert r["generated_tokens"] == results["requests"] * results["max_new_tokens"]
    plain, oracle_0, oracle_70 = records["plain@4"], records["oracle_0@4"], records["oracle_70@4"]
    assert plain["drafter"] is None and plain["vs_plain"] == 1.0 and plain["drafted_tokens"] == 0
    assert (oracle_0["acceptance_target"], oracle_70["acceptance_target"]) == (0.0, 0.7)
    assert records["prompt_lookup@4"]["acceptance_target"] is None
    # Every oracle draft at 0 % is wrong; at 70 %, sequences move more than a token a step.
    assert oracle_0["drafted_tokens"] > 0 and oracle_0["accepted_tokens"] == 0
    assert oracle_0["tokens_per_step"] == 1.0
    assert 0 < oracle_70["accepted_share"] < 1 and oracle_70["tokens_per_step"] > 1.2
    assert oracle_70["steps"] < plain["steps"]
    assert "each equal to its reference" in result.stdout
    assert "FAILED" not in result.stdout + result.stderr


@pytest.mark.gpu
def test_gpu_float32_highest_speculation_keeps_greedy_tokens(tmp_path):
    result = subprocess.run(
        [sys.executable, SCRIPT, "--model", "tiny", "--slots", "16", "--placement", "pinned"]
        + ["--dtype", "float32", "--precision", "highest", "--table-gib", "0.05"]
        + ["--num-prompts", "32", "--max-new-tokens", "12", "--acceptance", "0,0.7"]
        + ["--no-progress", "--show", "0", "--name", tmp_path / "speculate"],
        capture_output=True,
        text=True,
        timeout=scaled_timeout(600),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "speculate.json").read_text())
    assert results["tokens_strict"] is True and results["placement"] == "pinned"
    records = {r["variant"]: r for r in results["records"]}
    assert set(records) == {"plain@16", "prompt_lookup@16", "oracle_0@16", "oracle_70@16"}
    assert all(r["rows_checked"] is True and r["same_tokens"] == 1.0 for r in records.values())
    assert records["oracle_70@16"]["accepted_tokens"] > 0


def test_bad_input_is_one_line_and_a_failing_status():
    cases = [
        (["--placement", "device"], "host tables"),
        (["--acceptance", "0.5,1.5"], "[0, 1]"),
        (["--drafters", "medusa"], "unknown drafters"),
        (["--speculate", "0"], "--speculate must be >= 1"),
    ]

    def run(flags):
        return subprocess.run(
            [sys.executable, SCRIPT, "--smoke", *flags],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )

    # Each case is a process of its own, mostly imports on one core: two at once.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for (flags, words), result in zip(cases, pool.map(run, [c[0] for c in cases]), strict=True):
            assert result.returncode != 0, flags
            assert words in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_tokens_fields_and_verdict():
    reference = [[5, 6, 7, 8], [1, 2, 3], [9, 9]]
    margins = [np.array([0.5, 0.25, 0.125, 2.0]), np.array([1.0, 1.0, 1.0]), np.array([3.0, 3.0])]
    plain = SimpleNamespace(margins=margins)
    same = speculate.agreement_fields(
        cli.token_agreement(reference, plain, [list(r) for r in reference], plain)
    )
    assert same["same_tokens"] == 1.0 and same["requests_differing"] == 0
    assert same["first_divergence"] is None and same["gap_at_divergence"] is None
    other_out = [[5, 6, 0, 8], [1, 2, 3], [9]]
    other = SimpleNamespace(margins=[np.array([0.5, 0.25, 0.0625, 2.0]), margins[1], margins[2]])
    fields = speculate.agreement_fields(cli.token_agreement(reference, plain, other_out, other))
    # The first request differs at index 2, the third ends early at index 1.
    assert fields["same_tokens"] == 1 / 3 and fields["requests_differing"] == 2
    assert fields["first_divergence"] == 1.5
    assert (fields["gap_at_divergence_plain"], fields["gap_at_divergence"]) == (0.125, 0.0625)
    records = [dict(variant="oracle_70@4", **fields), dict(variant="plain@4", **same)]
    lines, failed = speculate.token_lines(records, strict=False)
    assert not failed and lines == [
        f"tokens differ (numerics, not checked): oracle_70@4: {fields['token_agreement']}"
    ]
    lines, failed = speculate.token_lines(records, strict=True)
    assert failed and lines[0].startswith("FAILED tokens check: oracle_70@4: 1 of 3 requests")
    lines, failed = speculate.token_lines(records[1:], strict=True)
    assert not failed and lines == ["tokens: every run generated the plain run's tokens"]
