"""Document-length files (one integer per line, gzip when the name ends in .gz): the one reader of
the main job's ``--lengths`` and of ``ds-seqpar plan --lengths``, and a seeded draw of a step's
lengths for the planner (the main job draws contents too: train/data.documents_for_step)."""
from __future__ import annotations

import gzip
import os
from typing import List

import numpy as np


def read_lengths(path: str) -> np.ndarray:
    """The lengths of ``path``; an error naming the file and the line for an empty file, a word that
    is not an integer or a length below 1 (blank lines are skipped; the line as an editor counts it, and
    which non-empty line it is)."""
    if not os.path.exists(path):
        raise ValueError(f"--lengths {path!r} does not exist")
    opener = gzip.open if path.endswith(".gz") else open
    values: List[int] = []
    with opener(path, "rt") as f:
        for number, line in enumerate(f, 1):
            word = line.strip()
            if not word:
                continue
            try:
                values.append(int(word))
            except ValueError:
                raise ValueError(f"--lengths {path!r}: line {number}: {word!r} is not an integer; one document "
                                 f"length per line") from None
            if values[-1] < 1:
                raise ValueError(f"--lengths {path!r}: line {number}, non-empty line {len(values)} is {values[-1]}; "
                                 f"document lengths must be >= 1")
    if not values:
        raise ValueError(f"--lengths {path!r} is empty; it needs one document length (an integer >= 1) per line")
    return np.array(values, dtype=np.int64)


def draw_lengths(lengths: np.ndarray, tokens: int, cap: int, seed: int = 0) -> List[int]:
    """A global batch of ``tokens`` tokens: lengths drawn from ``lengths`` (seeded), each cut at ``cap``
    (what the largest group holds), the last one cut so that the batch has exactly ``tokens``."""
    rng = np.random.default_rng([seed, 1 << 21])
    out, total = [], 0
    while total < tokens:
        n = min(int(lengths[rng.integers(lengths.size)]), cap, tokens - total)
        out.append(n)
        total += n
    return out


__all__ = ["draw_lengths", "read_lengths"]
