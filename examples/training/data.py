"""The text the example trains on and its batches: the repository's workload (Python
docstrings, DeepSeek-V4 tokens compressed as Engram compresses them), or any text
file tokenised and compressed here; a word-level vocabulary of its most frequent
compressed ids for the decoder, the full compressed ids for the n-gram hashes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
from serving.cli import UserError

import engram_jax as ej

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools import workload  # noqa: E402

DEFAULT_DATA = workload.DEFAULT_PATH
PAD_TOKEN_ID = workload.PAD_TOKEN_ID
HELD_OUT_FRACTION = 0.2


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Compressed token ids of the training and held-out text, with document ids."""

    train: np.ndarray  # int32 [T] compressed ids
    train_docs: np.ndarray  # int32 [T]
    held_out: np.ndarray
    held_out_docs: np.ndarray
    compressed_vocab_size: int
    pad_id: int
    source: str


def from_workload(path: Path, compressor: ej.TokenCompressor) -> Corpus:
    """The workload file's profile part to train on, its held-out part to evaluate."""
    try:
        data = workload.load(path)
    except (OSError, KeyError, ValueError) as exc:
        raise UserError(f"cannot read the token file {path}: {exc}") from None
    # The file was compressed with this same map; a mismatch would hash other n-grams.
    if data.meta["compressed_vocab_size"] != compressor.vocab_size:
        raise UserError(
            f"{path} was compressed to {data.meta['compressed_vocab_size']} ids, this "
            f"tokenizer compresses to {compressor.vocab_size}: rebuild it (tools/workload.py)"
        )
    train, train_docs = data.part("profile")
    held, held_docs = data.part("measure")
    return Corpus(
        train, train_docs, held, held_docs, compressor.vocab_size, data.meta["pad_id"], str(path)
    )


def from_text(path: Path, tokenizer, compressor: ej.TokenCompressor) -> Corpus:
    """A text file, one document per non-empty line; the last fifth of them held out."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if len(lines) < 2:
        raise UserError(f"{path} holds {len(lines)} non-empty lines; needs 2 or more")
    encoded = tokenizer.encode_batch(lines, add_special_tokens=False)
    ids = [compressor(np.asarray(e.ids, np.int64)).astype(np.int32) for e in encoded]
    cut = max(1, int(len(ids) * (1 - HELD_OUT_FRACTION)))

    def pack(docs):
        docs = [d for d in docs if d.size]
        tokens = np.concatenate(docs) if docs else np.zeros(0, np.int32)
        return tokens, np.repeat(np.arange(len(docs), dtype=np.int32), [d.size for d in docs])

    return Corpus(
        *pack(ids[:cut]),
        *pack(ids[cut:]),
        compressor.vocab_size,
        int(compressor.compress_id(PAD_TOKEN_ID)),
        str(path),
    )


class Vocabulary:
    """The decoder's tokens: the ``size - 1`` most frequent compressed ids of the
    training text, everything else one "other" token (id ``size - 1``)."""

    def __init__(self, train: np.ndarray, compressed_vocab_size: int, size: int) -> None:
        counts = np.bincount(train, minlength=compressed_vocab_size)
        keep = np.argsort(-counts, kind="stable")[: size - 1]
        self.size = size
        self.table = np.full(compressed_vocab_size, size - 1, np.int32)
        self.table[keep] = np.arange(keep.size, dtype=np.int32)
        self.coverage = float(counts[keep].sum() / max(1, counts.sum()))

    def __call__(self, compressed: np.ndarray) -> np.ndarray:
        return self.table[compressed]


class Batches:
    """Windows of ``seq + 1`` tokens at seeded random places of one part of the text:
    the decoder's inputs and targets, and the compressed ids the hashes read, with
    document ids so no n-gram reaches across two documents."""

    def __init__(
        self, tokens: np.ndarray, docs: np.ndarray, vocab: Vocabulary, batch: int, seq: int, seed
    ) -> None:
        if tokens.size < seq + 2:
            raise UserError(f"the text has {tokens.size} tokens; --seq {seq} needs {seq + 2}")
        self.tokens, self.docs, self.vocab = tokens, docs, vocab
        self.batch, self.seq = batch, seq
        self.rng = np.random.default_rng(seed)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        starts = self.rng.integers(0, self.tokens.size - self.seq - 1, self.batch)
        index = starts[:, None] + np.arange(self.seq + 1)
        window, docs = self.tokens[index], self.docs[index]
        # Each window is its own sequence (segment), split further at document boundaries.
        segments = np.cumsum(np.diff(docs, axis=1, prepend=-1) != 0, axis=1)
        segments = segments + np.arange(self.batch)[:, None] * (self.seq + 1)
        lm = self.vocab(window)
        return dict(
            compressed=window[:, :-1],
            segments=segments[:, :-1].astype(np.int32),
            inputs=lm[:, :-1],
            targets=lm[:, 1:],
        )
