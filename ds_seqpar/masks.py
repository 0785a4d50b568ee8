"""The mask of one softmax attention layer over a whole sequence: the one value every consumer reads
(the strategies' block plans, the plan's work and bytes, the test references).

A mask is an intersection of small predicates on GLOBAL positions (gq query, gk key):

    same document   doc(gq) == doc(gk)          packed documents (cu_seqlens); chunked attention is
                                                documents too (the chunks cut the packed documents)
    real            gq < real_len, gk < real_len end padding belongs to no document
    causal          gk <= gq
    window w        gq - w < gk                 (non-causal: |gq - gk| < w)  transformers' sliding_window
    block [s, e)    causal or s <= gq, gk < e   bidirectional blocks inside a causal mask (Gemma 3's
                                                image tokens): transformers' AND(window, OR(causal, block))

so query i of a document [a, b) sees the keys [max(a, i - w + 1), i + 1) (causal; a query in a block
[s, e) sees up to e - 1 instead, the window still bounding its first key) or
[max(a, i - w + 1), min(b, i + w)) (non-causal): one contiguous span per query (``key_spans``).
Blocks lie inside one document and the real tokens, and only causal masks have them (``check_blocks``).

A window that covers the sequence masks nothing; ``effective_window`` is the one place that says so.

This file is the value only: which call builds a batch's masks and how long they are kept is the mask
seam's (sp.masks, sharding/batch_masks.py).
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
    of the sequence it is applied to is real, or the documents' sum when ``docs`` is given); ``blocks``
    the bidirectional blocks, global [start, end) in order (None: none)."""

    causal: bool = True
    window: Optional[int] = None
    docs: Optional[Tuple[int, ...]] = None
    real_len: Optional[int] = None
    blocks: Optional[Tuple[Tuple[int, int], ...]] = None

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        # strategies look their plan up by mask on every layer's call: hash thousands of documents once
        return hash((self.causal, self.window, self.docs, self.real_len, self.blocks))

    @classmethod
    def from_boundaries(cls, bounds: Optional[Sequence[int]], causal: bool = True, window: Optional[int] = None,
                        real_len: Optional[int] = None, blocks=None) -> "Mask":
        """From cu_seqlens [0, l1, l1 + l2, ..., N] (global; None: one document) and checked blocks."""
        blocks = tuple(blocks) if blocks else None
        if bounds is None:
            return cls(causal, window, None, real_len, blocks)
        docs = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        return cls(causal, window, docs if len(docs) > 1 else None, int(bounds[-1]), blocks)

    def with_options(self, causal: bool, window: Optional[int]) -> "Mask":
        """The same documents and real length under another causality and window."""
        return self if (causal, window) == (self.causal, self.window) else replace(self, causal=causal, window=window)

    def real(self, seq: int) -> int:
        """The real tokens of a sequence of ``seq`` (padded) tokens."""
        if self.docs is not None:
            return min(sum(self.docs), seq)
        return seq if self.real_len is None else min(self.real_len, seq)

    def is_plain(self, seq: int) -> bool:
        """No document, no window, no block and no padding: nothing but (optionally) causality."""
        return self.docs is None and self.window is None and self.blocks is None and self.real(seq) == seq

    def chunked(self, chunk: int, seq: int) -> "Mask":
        """Chunked attention (Llama 4's chunked layers: a query sees the keys of its own chunk of ``chunk``
        global positions) over ``seq`` tokens: documents cut at every chunk boundary."""
        bounds = chunk_bounds(self.bounds(seq), chunk, self.real(seq))
        return replace(self, docs=tuple(b - a for a, b in zip(bounds, bounds[1:])), real_len=bounds[-1])

    def for_length(self, seq: int) -> "Mask":
        """The same mask over ``seq`` tokens: a window that covers them dropped (effective_window), the
        documents cut to ``seq`` tokens and the blocks to those inside them."""
        blocks = tuple(b for b in self.blocks or () if b[1] <= seq) or None
        return Mask(self.causal, effective_window(self.window, seq), cut_documents(self.docs, seq), blocks=blocks)

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
        hi = block_ends(self.blocks, pos) if self.causal else torch.minimum(stop, pos + w)
        return lo, torch.where(pos < real, hi, lo)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor, seq: int) -> torch.Tensor:
        """bool [len(q_pos), len(k_pos)]: does each query see each key (the predicate, pair by pair)."""
        lo, hi = self.key_spans(q_pos, seq)
        k = k_pos.to(torch.int64)[None, :]
        return (lo[:, None] <= k) & (k < hi[:, None])


def block_ends(blocks, pos: torch.Tensor) -> torch.Tensor:
    """int64: one past the last key each causal query at ``pos`` sees: its block's end inside a
    bidirectional block, else pos + 1."""
    if not blocks:
        return pos + 1
    starts, ends = (torch.tensor(c, dtype=torch.int64, device=pos.device) for c in zip(*blocks))
    idx = torch.searchsorted(starts, pos, right=True) - 1
    end = ends[idx.clamp(min=0)]
    return torch.where((idx >= 0) & (pos < end), end, pos + 1)


def block_starts(blocks, pos: torch.Tensor) -> torch.Tensor:
    """int64: the first query that sees each causal key at ``pos``: its block's start inside a
    bidirectional block (every query of the block sees the block's keys), else pos."""
    if not blocks:
        return pos.clone()
    starts, ends = (torch.tensor(c, dtype=torch.int64, device=pos.device) for c in zip(*blocks))
    idx = torch.searchsorted(starts, pos, right=True) - 1
    start = starts[idx.clamp(min=0)]
    return torch.where((idx >= 0) & (pos < ends[idx.clamp(min=0)]), start, pos)


def flat_blocks(blocks) -> Optional[List[int]]:
    """Bidirectional blocks, (start, end) pairs or an integer tensor [n, 2], as a flat list of ints
    [s0, e0, s1, e1, ...] (None: no block). ValueError naming ``blocks`` when they are not pairs."""
    if blocks is None:
        return None
    if isinstance(blocks, torch.Tensor):
        if blocks.is_floating_point() or blocks.dtype == torch.bool or (blocks.numel() and blocks.dim() != 2):
            raise ValueError(f"blocks must be an integer tensor [n, 2] of global (start, end) pairs, got "
                             f"{blocks.dtype} of shape {tuple(blocks.shape)}")
        blocks = blocks.tolist()
    try:
        pairs = [(a, b) for a, b in blocks]
        flat = [int(x) for pair in pairs for x in pair]
    except (TypeError, ValueError):
        raise ValueError(f"blocks must be a sequence of global (start, end) pairs or an integer tensor [n, 2], got "
                         f"{blocks!r}") from None
    if any(isinstance(x, bool) or int(x) != x for pair in pairs for x in pair):
        raise ValueError(f"blocks must hold whole token positions, got {blocks!r}")
    return flat or None


def check_blocks(blocks, bounds: Sequence[int], causal: bool) -> Tuple[Tuple[int, int], ...]:
    """Bidirectional blocks, (start, end) int pairs (flat_blocks), checked against the documents ``bounds``
    (cu_seqlens: [0, ..., real length]): in order, disjoint, non-empty, each inside one document; causal
    masks only. ValueError naming ``blocks`` otherwise."""
    pairs = tuple((int(a), int(b)) for a, b in blocks)
    if pairs and not causal:
        raise ValueError(f"blocks {list(pairs)} with causal=False: bidirectional blocks widen a causal mask (a "
                         f"non-causal query already sees its whole document); pass causal=True or no blocks")
    prev = 0
    for a, b in pairs:
        if not prev <= a < b <= bounds[-1]:
            raise ValueError(f"blocks {list(pairs)}: ({a}, {b}) is not a non-empty span after the previous block "
                             f"inside the {bounds[-1]} real tokens; blocks are global [start, end) spans in order, "
                             f"disjoint")
        inside = [c for c in bounds[1:-1] if a < c < b]
        if inside:
            raise ValueError(f"blocks {list(pairs)}: ({a}, {b}) crosses the document boundary {inside[0]} of "
                             f"cu_seqlens; a bidirectional block lies inside one document")
        prev = b
    return pairs


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


__all__ = ["Mask", "block_ends", "block_starts", "check_blocks", "flat_blocks", "chunk_bounds", "cut_documents",
           "effective_window",
           "seen_keys"]
