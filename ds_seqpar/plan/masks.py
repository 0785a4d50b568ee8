"""The mask of a softmax layer (causal, sliding window, packed documents) as the plan counts it: the
(q, k) pairs each rank computes and the bytes each rank sends.

Work. Query i of a document [a, b) sees, causal, the keys max(a, i - w + 1) .. i (min(i - a + 1, w)
of them); non-causal, the keys of [a, b) within |i - j| < w. A window w over N tokens therefore
costs about N w pairs instead of N^2 / 2, documents sum(L^2) / 2. The pairs are counted query by
query on the global positions a rank holds (its layout's ``indices``), so the busiest rank's share
is exact for every layout: the contiguous ring's last rank with no window, but nobody's with a
window shorter than a block. Ulysses ranks hold 1/P of the heads of every query: total / P each.
The 2D hybrid: ring position r holds U x n queries of H / U heads, so pairs(r) / U per rank.

Bytes. strategies/closed_form.py is the oracle; with a window or documents it finds, key by key, the
span of each block another ring position can see (``ring_key_ranges``, O(R N)) and turns the spans
into bytes (``ring_masked_bytes``). ``closed_form_by_kind`` redoes the spans for every rank, which at
a million tokens and 32 positions costs a second per call; here the spans are found once per
(layout, length, mask) and every rank's bytes read off them. A test holds the result equal to
``closed_form_by_kind`` rank by rank.
"""
from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Dict, List, Optional, Tuple

from ..masks import Mask, cut_documents, seen_keys
from ..sharding.layouts import make_layout
from ..strategies import RING_STRATEGIES, get_strategy
from ..strategies.closed_form import Shapes, closed_form_by_kind, kv_replication, ring_key_ranges, ring_masked_bytes


def equal_documents(seq: int, doc_len: Optional[int]) -> Optional[Tuple[int, ...]]:
    """``--doc-len``: documents of doc_len tokens packed into seq (the last one shorter)."""
    if not doc_len or doc_len >= seq:
        return None
    full, rest = divmod(seq, doc_len)
    return (doc_len,) * full + ((rest,) if rest else ())


def pairs_total(seq: int, mask: Mask) -> int:
    """Visible (q, k) pairs of the whole sequence (one head)."""
    return _pairs_total(seq, mask.for_length(seq))


def _pairs_total(seq: int, mask: Mask) -> int:
    """Per document of L tokens (a window w < L): causal w (w + 1) / 2 + (L - w) w (the first w queries
    see their prefix, the rest w keys), non-causal L^2 - (L - w)(L - w + 1) (all pairs less those
    |i - j| >= w); no window: L (L + 1) / 2 and L^2. Equal documents are counted once."""
    total = 0
    for length, count in Counter(mask.docs or (seq,)).items():
        w = mask.window if mask.window is not None and mask.window < length else length
        if mask.causal:
            one = w * (w + 1) // 2 + (length - w) * w
        else:
            one = length * length - (length - w) * (length - w + 1)
        total += count * one
    return total


def _ring_of(strategy: str, size: int, ulysses: int) -> int:
    return size // ulysses if strategy in RING_STRATEGIES else 1


def padded_length(strategy: str, size: int, ulysses: int, seq: int) -> int:
    """The length a layout shards: a multiple of 2 x its ring size x U (zigzag's chunks), and of size."""
    step = 2 * size
    return step * math.ceil(seq / step)


def plain_position_pairs(layout_name: str, r: int, seq: int, causal: bool) -> List[int]:
    """Pairs per ring position with no window and one document, by arithmetic (the plan asks for
    thousands of (layout, length) pairs; counting tokens each time would take seconds): position p's
    queries q see q + 1 keys. contiguous: queries p n .. (p+1) n - 1; zigzag: two chunks of n / 2
    mirrored, so every position holds the same (N (N + 1) / 2) / R; striped: q = j R + p."""
    n = seq // r
    if not causal:
        return [seq * n] * r
    if layout_name == "contiguous":
        return [n * p * n + n * (n + 1) // 2 for p in range(r)]
    if layout_name == "zigzag":
        return [seq * (seq + 1) // 2 // r] * r
    if layout_name == "striped":
        return [r * n * (n - 1) // 2 + n * (p + 1) for p in range(r)]
    seen = seen_keys(seq, seq, Mask(causal))
    layout = make_layout(layout_name, r)
    return [int(seen[layout.indices(seq, pos)].sum()) for pos in range(r)]


@functools.lru_cache(maxsize=256)
def _position_pairs(layout_name: str, r: int, seq: int, padded: int, mask: Mask) -> Tuple[int, ...]:
    seen = seen_keys(seq, padded, mask)
    layout = make_layout(layout_name, r)
    return tuple(int(seen[layout.indices(padded, pos)].sum()) for pos in range(r))


def pairs_per_rank(strategy: str, size: int, ulysses: int, seq: int, mask: Mask) -> List[float]:
    """(q, k) pairs per head-rank unit each rank computes: ring positions' pairs / U for the ring
    family (U ranks share a position's heads), total / P for Ulysses and size 1."""
    mask = mask.for_length(seq)
    r = _ring_of(strategy, size, ulysses)
    if r <= 1:
        return [pairs_total(seq, mask) / size] * size
    padded = padded_length(strategy, size, ulysses, seq)
    if mask.window is None and mask.docs is None:        # (the < 2P padding tokens counted as real)
        return [p / ulysses for p in plain_position_pairs(get_strategy(strategy).layout_name, r, padded, mask.causal)
                for _ in range(ulysses)]
    per_pos = _position_pairs(get_strategy(strategy).layout_name, r, seq, padded, mask)
    return [per_pos[rank // ulysses] / ulysses for rank in range(size)]


def busiest_keys_per_token(strategy: str, size: int, ulysses: int, seq: int, mask: Mask) -> float:
    """The busiest rank's pairs per local token: what ``flops`` multiplies by 2 H (d + dv) per token
    (seq / 2 for a causal mask on one rank; (2P - 1) / P of the average on the contiguous ring)."""
    return max(pairs_per_rank(strategy, size, ulysses, seq, mask)) / (seq / size)


# The spans cost O(R N) searches: ~0.2-2 s at 1M tokens x 32 positions on a quiet core, ten times
# that on a loaded one, for each (layout, size) a plan visits. Past this many positions x tokens the
# masked layers' ring bytes fall back to the no-mask closed form (an upper bound) and the layout is
# recorded in BOUNDED so the command can say so; ``--exact-bytes`` lifts the limit.
EXACT_SPAN_BUDGET = [1 << 23]
BOUNDED: set = set()


@functools.lru_cache(maxsize=64)
def _ranges(layout_name: str, r: int, bounds: Tuple[int, ...], padded: int, causal: bool, window: Optional[int]):
    return ring_key_ranges(list(bounds), make_layout(layout_name, r), padded, causal, window)


def rank_bytes(strategy: str, size: int, ulysses: int, shapes: Shapes, mask: Mask) -> List[Dict[str, int]]:
    """{CommStats kind: bytes} each rank sends for one fwd + bwd of one layer with this mask
    (``shapes.seq`` = the padded length the layout shards): closed_form_by_kind's numbers."""
    real = mask.bounds(shapes.seq)[-1] if mask.docs else shapes.seq
    mask = mask.for_length(real)
    plain = closed_form_by_kind(strategy, size, shapes, 0, ulysses, causal=mask.causal)
    r = _ring_of(strategy, size, ulysses)
    if strategy == "ulysses" or r <= 1 or (mask.window is None and mask.docs is None and real == shapes.seq):
        return [dict(plain)] * size
    if r * shapes.seq > EXACT_SPAN_BUDGET[0]:
        BOUNDED.add((strategy, r, shapes.seq))
        return [dict(plain)] * size
    ranges = _ranges(get_strategy(strategy).layout_name, r, tuple(mask.bounds(real)), shapes.seq, mask.causal,
                     mask.window)
    f = kv_replication(shapes.heads, shapes.kv_heads, ulysses) if ulysses > 1 else 1
    # one ring-position token of k and v: after the Ulysses all-to-all a position holds U x n tokens of
    # H_kv / U (f-replicated) heads, so f x the local k/v elements over the position's tokens
    local = shapes.local(size)
    token_elems = f * local.elements(shapes.kv_heads, shapes.head_dim + shapes.dv) // (shapes.seq // r)
    out = []
    for rank in range(size):
        by_kind = {"all_to_all": plain["all_to_all"]} if "all_to_all" in plain else {}
        by_kind.update(ring_masked_bytes(ranges, rank // ulysses, token_elems, shapes.elem))
        out.append({k: v for k, v in by_kind.items() if v})
    return out


def busiest_bytes(strategy: str, size: int, ulysses: int, shapes: Shapes, mask: Mask) -> Tuple[Dict[str, int], int]:
    """(the bytes of the rank that sends most, the ring peers it exchanges blocks with)."""
    per_rank = rank_bytes(strategy, size, ulysses, shapes, mask)
    rank = max(range(size), key=lambda i: sum(per_rank[i].values()))
    r = _ring_of(strategy, size, ulysses)
    peers = r - 1
    if r > 1 and (mask.window is not None or mask.docs is not None):
        real = mask.bounds(shapes.seq)[-1] if mask.docs else shapes.seq
        m = mask.for_length(real)
        if (m.window is not None or m.docs is not None) and r * shapes.seq <= EXACT_SPAN_BUDGET[0]:
            ranges = _ranges(get_strategy(strategy).layout_name, r, tuple(m.bounds(real)), shapes.seq, m.causal,
                             m.window)
            me = rank // ulysses
            peers = sum(1 for o in range(r) if o != me and (ranges[me][o] is not None or ranges[o][me] is not None))
    return per_rank[rank], peers


__all__ = ["BOUNDED", "EXACT_SPAN_BUDGET", "Mask", "busiest_bytes", "busiest_keys_per_token", "cut_documents",
           "equal_documents", "padded_length", "pairs_per_rank", "pairs_total", "plain_position_pairs", "rank_bytes",
           "seen_keys"]
