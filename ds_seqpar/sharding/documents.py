"""Packed documents (varlen): validating ``cu_seqlens`` and cutting a rank's tokens into document runs.

A packed sequence concatenates documents; ``cu_seqlens = [0, l1, l1+l2, ..., N]`` holds their global
boundaries (flash-attn's varlen convention, batch size 1). Attention never crosses a boundary.

End padding (padding.py) adds tokens N .. N'-1 that belong to no document: every strategy leaves
them out (a pad query sees no key, no real query sees a pad key), so they attend nothing real.

Legend: N = real length (cu_seqlens[-1]), N' = padded length, g = global positions of a rank's
tokens in its local order (layout.indices), s = the layout's stride (1 contiguous / zigzag,
P striped).

A *segment* is a maximal run of a rank's local order that lies in one document and advances by
the stride s in global order: local slots [start, start+length) hold global tokens
first, first+s, ..., first+(length-1)*s. Every layout keeps a document contiguous in each local
run (striped: the tokens of [a, b) with residue r are the local slots ceil((a-r)/P) ..), so a
rank's tokens are a few segments per document. Pure arithmetic; unit-tested without processes.
"""
from __future__ import annotations

import operator
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

PAD_DOC = -1             # the document id of end padding


class Segment(NamedTuple):
    start: int           # local slot of the first token
    length: int
    doc: int             # index into the documents; PAD_DOC for end padding
    first: int           # global position of the first token
    stride: int          # global distance between consecutive tokens of the segment


def as_boundaries(cu_seqlens, name: str = "cu_seqlens") -> Tuple[int, ...]:
    """A 1-D integer tensor or sequence of ints -> a tuple of Python ints (ValueError otherwise)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
                or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor [0, l1, l1+l2, ..., N] (batch size 1), got "
                             f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        return tuple(int(x) for x in cu_seqlens.tolist())
    try:
        values = tuple(operator.index(x) for x in cu_seqlens)
        if any(isinstance(x, bool) for x in cu_seqlens):
            raise TypeError
    except TypeError:
        raise ValueError(f"{name} must be a 1-D integer tensor or a list of ints [0, l1, l1+l2, ..., N], got "
                         f"{cu_seqlens!r}") from None
    return values


def check_boundaries(bounds: Sequence[int], real_len: Optional[int] = None, name: str = "cu_seqlens",
                     what_len: str = "the real sequence length") -> None:
    """[0, ..., N] strictly increasing and ending at ``real_len``; ValueError naming ``name``."""
    shown = _short(bounds)
    if len(bounds) < 2:
        raise ValueError(f"{name}={shown} needs at least two entries [0, ..., N] (one document)")
    if bounds[0] != 0:
        raise ValueError(f"{name}={shown} must start at 0 (the first document's start), got {bounds[0]}")
    bad = next((i for i in range(1, len(bounds)) if bounds[i] <= bounds[i - 1]), None)
    if bad is not None:
        raise ValueError(f"{name}={shown} must be strictly increasing (every document at least one token); "
                         f"entry {bad} is {bounds[bad]} after {bounds[bad - 1]}")
    if real_len is not None and bounds[-1] != real_len:
        raise ValueError(f"{name}={shown} must end at {what_len} {real_len}, got {bounds[-1]}")


def check_documents(bounds: Sequence[int], batch: int, padded: int, multiple: int,
                    seq_len: Optional[int] = None) -> None:
    """cu_seqlens against shards of ``padded`` tokens in all (a multiple of ``multiple``): batch size 1,
    [0, ..., N] strictly increasing, N the real length (padded - multiple < N <= padded, and
    N == seq_len when that is given)."""
    if batch != 1:
        raise ValueError(f"cu_seqlens (packed documents) needs batch size 1, as flash-attn's varlen API: got "
                         f"batch {batch}; concatenate the rows into one packed sequence")
    check_boundaries(bounds)
    n = bounds[-1]
    if seq_len is not None and n != seq_len:
        raise ValueError(f"cu_seqlens={_short(bounds)} must end at the real sequence length seq_len={seq_len}, "
                         f"got {n}")
    if not padded - multiple < n <= padded:
        raise ValueError(f"cu_seqlens={_short(bounds)} must end at the real sequence length: the shards hold "
                         f"{padded} tokens in all (padded to a multiple of {multiple}), so the real length is in "
                         f"({padded - multiple}, {padded}]; got {n}")


def _short(bounds: Sequence[int], limit: int = 12) -> str:
    if len(bounds) <= limit:
        return str(list(bounds))
    return "[" + ", ".join(map(str, bounds[:limit // 2])) + ", ..., " + ", ".join(map(str, bounds[-3:])) + "]"


def fingerprint(bounds: Sequence[int]) -> int:
    """A polynomial hash of the boundaries below 2^61 (its negation fits in int64): ranks compare it
    in one all-reduce (max of h and of -h) to learn whether they all passed the same cu_seqlens."""
    mod, h = (1 << 61) - 1, len(bounds)
    for x in bounds:
        h = (h * 1_000_003 + x + 1) % mod
    return h


def boundaries_from_positions(pos_n: torch.Tensor, name: str = "position_ids") -> Tuple[int, ...]:
    """Document boundaries of one row of within-document positions (0, 1, .., l1-1, 0, 1, ..): a new
    document starts wherever the position is 0. ValueError unless each document counts 0, 1, 2, ..."""
    pos = pos_n.to(torch.int64).cpu()
    n = pos.numel()
    starts = torch.nonzero(pos == 0).flatten()
    if n == 0 or int(pos[0]) != 0:
        raise ValueError(f"{name} must start at 0 (packed documents restart their positions at 0); "
                         f"got {pos[:8].tolist()}...")
    expected = torch.arange(n) - torch.repeat_interleave(starts, torch.diff(torch.cat([starts, torch.tensor([n])])))
    wrong = torch.nonzero(pos != expected).flatten()
    if wrong.numel():
        t = int(wrong[0])
        raise ValueError(f"{name}: position {t} is {int(pos[t])}, but packed documents count 0, 1, 2, ... from "
                         f"their start (a new document restarts at 0); expected {int(expected[t])}")
    return tuple(starts.tolist()) + (n,)


def positions_from_boundaries(bounds: Sequence[int], device=None) -> torch.Tensor:
    """Within-document positions [N] (int64) of documents with these boundaries."""
    lengths = torch.diff(torch.tensor(bounds, dtype=torch.int64))
    starts = torch.repeat_interleave(torch.tensor(bounds[:-1], dtype=torch.int64), lengths)
    return (torch.arange(bounds[-1]) - starts).to(device)


class Documents:
    """Validated global document boundaries of one packed sequence of ``padded_len`` tokens.

    ``bounds`` are cu_seqlens (real tokens [0, N)); [N, padded_len) is end padding (PAD_DOC)."""

    def __init__(self, bounds: Sequence[int], padded_len: int):
        self.bounds = tuple(bounds)
        self.real_len, self.padded_len = self.bounds[-1], padded_len
        self._bounds_t = torch.tensor(self.bounds, dtype=torch.int64)

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def lengths(self) -> List[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def doc_of(self, g: torch.Tensor) -> torch.Tensor:
        """Document id of each global position (PAD_DOC past the real length)."""
        doc = torch.searchsorted(self._bounds_t, g.to(torch.int64), right=True) - 1
        return torch.where(g >= self.real_len, torch.full_like(doc, PAD_DOC), doc)

    def starts_in(self, lo: int, hi: int) -> List[int]:
        """Document starts t with lo <= t < hi (end padding counts as one more document)."""
        starts = list(self.bounds[:-1]) + ([self.real_len] if self.real_len < self.padded_len else [])
        return [t for t in starts if lo <= t < hi]

    def segments(self, g: torch.Tensor, stride: int) -> List[Segment]:
        """The segments of a local order with global positions ``g`` (module doc): a new one starts
        wherever the document changes or the global step is not ``stride``."""
        g = g.to(torch.int64).cpu()
        if g.numel() == 0:
            return []
        doc = self.doc_of(g)
        cut = torch.ones(g.numel(), dtype=torch.bool)
        cut[1:] = (doc[1:] != doc[:-1]) | (g[1:] - g[:-1] != stride)
        starts = torch.nonzero(cut).flatten().tolist() + [g.numel()]
        return [Segment(a, b - a, int(doc[a]), int(g[a]), stride) for a, b in zip(starts, starts[1:])]


def layout_stride(local_indices: Sequence[torch.Tensor]) -> int:
    """The smallest global step between consecutive local tokens over all ranks (1 when no rank
    holds two tokens): the stride every rank's segments share, so that any two can be compared."""
    steps = [int((g[1:] - g[:-1]).min()) for g in local_indices if g.numel() > 1]
    return min(steps) if steps else 1


__all__ = ["PAD_DOC", "Segment", "Documents", "as_boundaries", "check_boundaries", "check_documents", "fingerprint",
           "boundaries_from_positions", "positions_from_boundaries", "layout_stride"]
