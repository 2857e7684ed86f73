"""The shipped public-domain corpus (models/corpus/*.txt), a byte-level tokenizer and the train/eval split.

Token ids: 0..255 are the UTF-8 bytes; specials PAD=256, BOS=257, EOS=258, SEP=259 (vocab 260). Each document
is BOS + bytes + EOS; the first 90% of every document's tokens go to train, the rest to eval.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np

CORPUS_DIR = pathlib.Path(__file__).parent / "corpus"
PAD, BOS, EOS, SEP = 256, 257, 258, 259
VOCAB_SIZE = 260
EVAL_FRACTION = 0.1


def encode(text: str) -> np.ndarray:
  """text -> [n] int32 byte ids."""
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(ids) -> str:
  """Byte ids -> text; specials are dropped, invalid UTF-8 replaced."""
  return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def load_documents(corpus_dir: pathlib.Path = CORPUS_DIR) -> list[str]:
  """The corpus's .txt files, sorted by name."""
  paths = sorted(corpus_dir.glob("*.txt"))
  if not paths:
    raise FileNotFoundError(f"no .txt files in {corpus_dir}")
  return [path.read_text(encoding="utf-8") for path in paths]


def train_eval_split(documents: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """-> (train [n_train], eval [n_eval]) int32 token streams (BOS + bytes + EOS per document, split 90 / 10)."""
  train, evaluation = [], []
  for text in documents:
    tokens = np.concatenate([[BOS], encode(text), [EOS]]).astype(np.int32)
    cut = int(len(tokens) * (1 - EVAL_FRACTION))
    train.append(tokens[:cut])
    evaluation.append(tokens[cut:])
  return np.concatenate(train), np.concatenate(evaluation)


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy in nats per token of the tokens' empirical unigram distribution (the loss of a model that ignores
  context)."""
  counts = np.bincount(tokens, minlength=VOCAB_SIZE).astype(np.float64)
  probs = counts[counts > 0] / counts.sum()
  return float(-(probs * np.log(probs)).sum())


def nats_to_bits(nats: float) -> float:
  return nats / math.log(2)


class Batches:
  """Random windows of a token stream: each call gives [batch, seq_len + 1] int32 (inputs = [:, :-1], targets
  = [:, 1:]). Deterministic per (seed, step), so a resumed run sees the batches it would have seen."""

  def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
    if len(tokens) < seq_len + 2:
      raise ValueError(f"seq_len={seq_len} needs a stream of at least {seq_len + 2} tokens, got {len(tokens)}")
    self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed

  def at(self, step: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
    return np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])

  def fixed(self, num_batches: int) -> list[np.ndarray]:
    """Evenly spaced windows covering the stream, for eval: num_batches x [batch, seq_len + 1]."""
    count = num_batches * self.batch_size
    starts = np.linspace(0, len(self.tokens) - self.seq_len - 1, count).astype(np.int64)
    windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts])
    return list(windows.reshape(num_batches, self.batch_size, self.seq_len + 1))
