"""The mask of one softmax attention layer over a whole sequence: the one value every consumer reads
(the strategies' block plans, the plan's work and bytes, the test references).

A mask is an intersection of small predicates on GLOBAL positions (gq query, gk key):

    same document   doc(gq) == doc(gk)          packed documents (cu_seqlens); chunked attention is
                                                documents too (the chunks cut the packed documents)
    real            gq < real_len, gk < real_len end padding belongs to no document
    causal          gk <= gq
    window w        gq - w < gk                 (non-causal: |gq - gk| < w)  transformers' sliding_window

so query i of a document [a, b) sees the keys [max(a, i - w + 1), i + 1) (causal) or
[max(a, i - w + 1), min(b, i + w)) (non-causal): one contiguous span per query (``key_spans``).

A window that covers the sequence masks nothing; ``effective_window`` is the one place that says so.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import List, Optional, Sequence, Tuple

import torch


def effective_window(window: Optional[int], length: int) -> Optional[int]:
    """``window`` as a mask over ``length`` tokens: None when it covers them (query i - j < length <= w
    always holds, so it hides no pair)."""
    return None if window is None or window >= length else int(window)


@dataclass(frozen=True)
class Mask:
    """One layer's mask: ``causal``; ``window`` (None: none); ``docs`` the packed documents' lengths
    in order (None: one document); ``real_len`` the real tokens before end padding (None: every token
    of the sequence it is applied to is real, or the documents' sum when ``docs`` is given)."""

    causal: bool = True
    window: Optional[int] = None
    docs: Optional[Tuple[int, ...]] = None
    real_len: Optional[int] = None

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        # strategies look their plan up by mask on every layer's call: hash thousands of documents once
        return hash((self.causal, self.window, self.docs, self.real_len))

    @classmethod
    def from_boundaries(cls, bounds: Optional[Sequence[int]], causal: bool = True, window: Optional[int] = None,
                        real_len: Optional[int] = None) -> "Mask":
        """From cu_seqlens [0, l1, l1 + l2, ..., N] (global; None: one document)."""
        if bounds is None:
            return cls(causal, window, None, real_len)
        docs = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        return cls(causal, window, docs if len(docs) > 1 else None, int(bounds[-1]))

    def with_options(self, causal: bool, window: Optional[int]) -> "Mask":
        """The same documents and real length under another causality and window."""
        return self if (causal, window) == (self.causal, self.window) else replace(self, causal=causal, window=window)

    def real(self, seq: int) -> int:
        """The real tokens of a sequence of ``seq`` (padded) tokens."""
        if self.docs is not None:
            return min(sum(self.docs), seq)
        return seq if self.real_len is None else min(self.real_len, seq)

    def is_plain(self, seq: int) -> bool:
        """No document, no window and no padding: nothing but (optionally) causality."""
        return self.docs is None and self.window is None and self.real(seq) == seq

    def chunked(self, chunk: int, seq: int) -> "Mask":
        """Chunked attention (Llama 4's chunked layers: a query sees the keys of its own chunk of ``chunk``
        global positions) over ``seq`` tokens: documents cut at every chunk boundary."""
        bounds = chunk_bounds(self.bounds(seq), chunk, self.real(seq))
        return replace(self, docs=tuple(b - a for a, b in zip(bounds, bounds[1:])), real_len=bounds[-1])

    def for_length(self, seq: int) -> "Mask":
        """The same mask over ``seq`` tokens: a window that covers them dropped (effective_window) and
        the documents cut to ``seq`` tokens."""
        return Mask(self.causal, effective_window(self.window, seq), cut_documents(self.docs, seq))

    def bounds(self, seq: int) -> List[int]:
        """cu_seqlens: [0, l1, l1 + l2, ..., N] (one document of the real tokens without ``docs``)."""
        out = [0]
        for length in self.docs or (self.real(seq),):
            out.append(out[-1] + length)
        return out

    def key_spans(self, positions: torch.Tensor, seq: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """int64 (lo, hi): the keys [lo, hi) the query at each global position sees in a sequence of
        ``seq`` (padded) tokens; hi <= lo for a query that sees none (end padding)."""
        pos = positions.to(torch.int64)
        real = self.real(seq)
        bounds = torch.tensor(self.bounds(seq), dtype=torch.int64, device=pos.device)
        doc = (torch.searchsorted(bounds, pos.clamp(max=max(real - 1, 0)), right=True) - 1).clamp(min=0)
        start, stop = bounds[doc], bounds[doc + 1]                          # the query's document [start, stop)
        w = self.window or seq + 1
        lo = torch.maximum(start, pos - w + 1)
        hi = pos + 1 if self.causal else torch.minimum(stop, pos + w)
        return lo, torch.where(pos < real, hi, lo)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor, seq: int) -> torch.Tensor:
        """bool [len(q_pos), len(k_pos)]: does each query see each key (the predicate, pair by pair)."""
        lo, hi = self.key_spans(q_pos, seq)
        k = k_pos.to(torch.int64)[None, :]
        return (lo[:, None] <= k) & (k < hi[:, None])


def seen_keys(seq: int, padded: int, mask: Mask) -> torch.Tensor:
    """int64 [padded]: how many keys each global position's query sees, in a sequence of ``padded``
    tokens whose first ``seq`` are real (0 for the end padding)."""
    pos = torch.arange(padded, dtype=torch.int64)
    lo, hi = replace(mask, real_len=seq).key_spans(pos, padded)
    return torch.where(pos < seq, (hi - lo).clamp(min=0), torch.zeros_like(pos))


def chunk_bounds(bounds: Optional[Sequence[int]], chunk: int, real_len: int) -> List[int]:
    """Document boundaries cut at every multiple of ``chunk`` below ``real_len`` (no bounds: one document)."""
    cuts = set(range(0, real_len, chunk)) | {real_len}
    if bounds is not None:
        cuts |= {int(b) for b in bounds}
    return sorted(cuts)


def cut_documents(docs: Optional[Tuple[int, ...]], seq: int) -> Optional[Tuple[int, ...]]:
    """Document lengths cut (or extended by one last document) to ``seq`` tokens; None: one document."""
    if docs is None:
        return None
    out, left = [], seq
    for length in docs:
        if left <= 0:
            break
        out.append(min(length, left))
        left -= out[-1]
    if left > 0:
        out.append(left)
    return tuple(out) if len(out) > 1 else None


__all__ = ["Mask", "chunk_bounds", "cut_documents", "effective_window", "seen_keys"]
