"""Data for the main job: the embedded corpus, token files and the batch of each step.

Batches are a pure function of (step, dp_rank): resuming from a checkpoint at step k replays
exactly the batches an uninterrupted run would have seen, with no data-loader state to save.
Every rank of a sequence group builds the same global sequence and keeps its own shard; every
data-parallel replica draws different sequences.

Legend: B = micro batch, N = global sequence length, L = local tokens (N / sp size).
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ..schedule.lengths import read_lengths
from ..sharding.batch import IGNORE_INDEX

CORPUS_BYTES = 4 << 20        # fixed subset size: identical corpus on every rank and every run
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


# ---------------------------------------------------------------------------------------------
# token sources


def stdlib_corpus(num_bytes: int = CORPUS_BYTES) -> np.ndarray:
    """Byte-level corpus (vocab 256) from this Python's own standard-library sources.

    Deterministic: sorted file list, files concatenated until ``num_bytes``. Machines with the
    same Python version build the same corpus; train/main.py checks that all ranks agree."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test"))
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    chunks, total = [], 0
    for path in sorted(os.path.relpath(f, root) for f in files):
        with open(os.path.join(root, path), "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= num_bytes:
            break
    corpus = np.frombuffer(b"".join(chunks)[:num_bytes], dtype=np.uint8)
    if corpus.size < 1024:
        raise RuntimeError(f"found only {corpus.size} bytes of Python sources under {root}; "
                           f"pass --data with a token file instead")
    return corpus


def token_file(path: str, dtype: str = "uint16") -> np.ndarray:
    """A flat binary file of token ids (nanoGPT style), memory-mapped, never loaded whole."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"--data_dtype={dtype!r} is not valid; choose one of: {', '.join(TOKEN_DTYPES)}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"--data {path!r} does not exist")
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r")


def fingerprint(tokens: np.ndarray) -> str:
    """Cheap identity of a token source (size + strided sample), compared across ranks."""
    sample = np.ascontiguousarray(tokens[:: max(1, tokens.size // 65536)])
    return f"{tokens.size}:{hashlib.sha1(sample.tobytes()).hexdigest()[:16]}"


# ---------------------------------------------------------------------------------------------
# batches


def batch_for_step(tokens: np.ndarray, step: int, micro_step: int, dp_rank: int, dp_size: int,
                   micro_batch: int, seq_len: int, seed: int = 0, ignore_frac: float = 0.0
                   ) -> Dict[str, torch.Tensor]:
    """The global-order batch replica ``dp_rank`` trains on at (step, micro_step).

    All replicas draw the offsets of the whole global batch from one generator seeded by
    (seed, step, micro_step), and replica d takes rows [d*B, (d+1)*B): replicas never share rows,
    and the ranks of one sequence group get the same rows. ``ignore_frac`` sets that fraction of
    labels to IGNORE_INDEX (like masking prompt tokens), so masked losses are exercised.
    """
    if tokens.size < seq_len + 1:
        raise ValueError(f"the token source has {tokens.size} tokens, fewer than --seq_len={seq_len}")
    rng = np.random.default_rng([seed, step, micro_step])
    offsets = rng.integers(0, tokens.size - seq_len, size=dp_size * micro_batch)
    mine = offsets[dp_rank * micro_batch:(dp_rank + 1) * micro_batch]
    ids_bn = torch.from_numpy(np.stack([np.asarray(tokens[o:o + seq_len], dtype=np.int64) for o in mine]))
    labels_bn = ids_bn.clone()
    if ignore_frac > 0:
        drop = rng.random((dp_size * micro_batch, seq_len))[dp_rank * micro_batch:(dp_rank + 1) * micro_batch]
        labels_bn[torch.from_numpy(drop < ignore_frac)] = IGNORE_INDEX
    return {"input_ids": ids_bn, "labels": labels_bn}


def documents_for_step(tokens: np.ndarray, lengths: np.ndarray, step: int, tokens_per_step: int, cap: int,
                       seed: int = 0) -> Tuple[List[torch.Tensor], int]:
    """The global batch of step ``step`` under --lengths: (documents, how many were cut).

    Lengths are drawn from ``lengths`` and contents from ``tokens`` by one generator seeded by
    (seed, step) alone, so every rank and every parallel configuration with the same ``cap`` trains
    on the same documents. A document longer than ``cap`` (what the largest group holds) is cut to
    it; the last one is cut so that the step has exactly ``tokens_per_step`` tokens."""
    rng = np.random.default_rng([seed, step, 1 << 20])
    docs, total, cut = [], 0, 0
    while total < tokens_per_step:
        drawn = int(lengths[rng.integers(lengths.size)])
        n = min(drawn, cap, tokens_per_step - total, tokens.size)
        cut += n < min(drawn, tokens_per_step - total)
        start = int(rng.integers(0, tokens.size - n + 1))
        docs.append(torch.from_numpy(np.asarray(tokens[start:start + n], dtype=np.int64)))
        total += n
    return docs, cut


def vocab_size_of(tokens: np.ndarray, given: Optional[int]) -> int:
    """Byte corpus: 256. Token files: --vocab_size, or max id + 1 (one pass over the file)."""
    if given:
        return int(given)
    if tokens.dtype == np.uint8:
        return 256
    return int(tokens.max()) + 1


__all__ = ["stdlib_corpus", "token_file", "fingerprint",
           "batch_for_step", "read_lengths", "documents_for_step", "vocab_size_of"]
