"""Work: the (query, key) pairs each rank computes under a mask (causal, sliding window, packed
documents), on the global positions its layout gives it.

Query i of a document [a, b) sees, causal, the keys max(a, i - w + 1) .. i (min(i - a + 1, w) of
them); non-causal, the keys of [a, b) within |i - j| < w. A window w over N tokens therefore costs
about N w pairs instead of N^2 / 2, documents sum(L^2) / 2. The pairs are counted query by query on
the positions a ring position holds (its layout's ``indices``), so the busiest rank's share is exact
for every layout: the contiguous ring's last rank with no window, but nobody's with a window shorter
than a block. Ulysses ranks hold 1/P of the heads of every query: total / P each. The 2D hybrid: ring
position r holds U x n queries of H / U heads, so pairs(r) / U per rank. tests/reference.py counts
the same pair by pair on the dense mask. The mask itself is ds_seqpar/masks.py's.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import List, Sequence, Tuple

from ..kernels.torch_kernel import CPU_KEY_TILE
from ..masks import Mask, seen_keys
from ..sharding.layouts import make_layout
from ..sharding.padding import padded_len
from ..strategies import RING_STRATEGIES, get_strategy

KEY_TILE = CPU_KEY_TILE   # keys per tile of torch's CPU flash kernel: the kernel's own constant


def pairs_total(seq: int, mask: Mask) -> int:
    """Visible (q, k) pairs of the whole sequence (one head). Per document of L tokens (a window
    w < L): causal w (w + 1) / 2 + (L - w) w (the first w queries see their prefix, the rest w keys),
    non-causal L^2 - (L - w)(L - w + 1) (all pairs less those |i - j| >= w); no window: L (L + 1) / 2
    and L^2. Equal documents are counted once; end padding (the mask's real length) sees nothing. A
    bidirectional block of B tokens adds its B (B - 1) / 2 later keys (the window bounds earlier keys only)."""
    real = mask.real(seq)
    mask = mask.for_length(real)
    total = 0
    for length, count in Counter(mask.docs or (real,)).items():
        w = mask.window if mask.window is not None and mask.window < length else length
        if mask.causal:
            one = w * (w + 1) // 2 + (length - w) * w
        else:
            one = length * length - (length - w) * (length - w + 1)
        total += count * one
    return total + sum((e - s) * (e - s - 1) // 2 for s, e in mask.blocks or ())


def ring_of(strategy: str, size: int, ulysses: int) -> int:
    """Ring positions of a layout: size / U for the ring family, 1 for Ulysses."""
    return size // ulysses if strategy in RING_STRATEGIES else 1


def layout_of(strategy: str, size: int, ulysses: int = 1):
    """The layout ``strategy`` shards with on ``size`` ranks, as SequenceParallel builds it: the ring
    family's over size / U ring positions, each cut into U pieces for the 2D hybrid; Ulysses and LASP
    contiguous over every rank."""
    u = ulysses if strategy in RING_STRATEGIES else 1
    return make_layout(get_strategy(strategy).layout_name, size // u, u)


def sharded_length(strategy: str, size: int, ulysses: int, seq: int) -> int:
    """The length that layout shards: ``seq`` padded at the end as the runtime pads it
    (sharding/padding.padded_len: zigzag 2 x size, contiguous and striped size, the hybrid their lcm)."""
    return padded_len(layout_of(strategy, size, ulysses), seq)


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
    return [r * n * (n - 1) // 2 + n * (p + 1) for p in range(r)]          # striped


def layout_pairs(layout, seq: int, padded: int, mask: Mask) -> Tuple[int, ...]:
    """Pairs per rank of any layout (sharding/layouts.py) over ``padded`` tokens, ``seq`` of them real:
    the keys each of its queries sees (masks.seen_keys), summed over the rank's tokens."""
    seen = seen_keys(seq, padded, mask)
    return tuple(int(seen[layout.indices(padded, rank)].sum()) for rank in range(layout.size))


@functools.lru_cache(maxsize=256)
def position_pairs(layout_name: str, r: int, seq: int, padded: int, mask: Mask) -> Tuple[int, ...]:
    """Pairs per ring position of ``layout_name`` over ``padded`` tokens, ``seq`` of them real."""
    return layout_pairs(make_layout(layout_name, r), seq, padded, mask)


def pairs_per_rank(strategy: str, size: int, ulysses: int, seq: int, mask: Mask) -> List[float]:
    """(q, k) pairs per head-rank unit each rank computes: ring positions' pairs / U for the ring
    family (U ranks share a position's heads), total / P for Ulysses and size 1."""
    real = mask.real(seq)
    mask = mask.for_length(real)
    r = ring_of(strategy, size, ulysses)
    if r <= 1:
        return [pairs_total(real, mask) / size] * size
    padded = sharded_length(strategy, size, ulysses, seq)
    name = get_strategy(strategy).layout_name
    if mask.is_plain(real) and real == seq:              # (the end padding counted as real)
        per_pos = plain_position_pairs(name, r, padded, mask.causal)
    else:
        per_pos = position_pairs(name, r, real, padded, mask)
    return [per_pos[rank // ulysses] / ulysses for rank in range(size)]


def busiest_keys_per_token(strategy: str, size: int, ulysses: int, seq: int, mask: Mask) -> float:
    """The busiest rank's pairs per local token: what the FLOPs multiply by 2 H (d + dv) per token
    (seq / 2 for a causal mask on one rank; (2P - 1) / P of the average on the contiguous ring)."""
    return max(pairs_per_rank(strategy, size, ulysses, seq, mask)) / (seq / size)


def imbalance(work: Sequence[float]) -> float:
    """max / mean of per-rank work."""
    return max(work) / (sum(work) / len(work))


def speedup_bound(strategy: str, p: int, causal: bool) -> float:
    """Ideal speedup on P ranks, P / imbalance at long sequence: P, except the contiguous ring under a
    causal mask, whose busiest rank does P - 1/2 of the P^2/2 blocks."""
    return p * p / (2 * p - 1) if strategy == "ring" and causal else float(p)


def expected_imbalance(strategy: str, p: int, causal: bool) -> float:
    """max/mean of per-rank work at long sequence: contiguous causal ring (P - 1/2) / (P/2), the others 1."""
    return (2 * p - 1) / p if strategy == "ring" and causal else 1.0


def computed_pairs(nq: int, nk: int, masked: bool) -> float:
    """Pairs the CPU flash kernel computes for one block: every pair of a full block; a masked square's
    visible pairs plus the masked parts of its diagonal key tiles (KEY_TILE keys; never more than the
    full block)."""
    if not masked:
        return float(nq * nk)
    s = min(nq, nk)
    return float(min(nq * nk, s * (s + 1) / 2 + (nq - s) * nk + s * min(KEY_TILE, s) / 2))


__all__ = ["KEY_TILE", "busiest_keys_per_token", "computed_pairs", "expected_imbalance", "imbalance", "layout_pairs",
           "layout_of", "pairs_per_rank", "pairs_total", "plain_position_pairs", "position_pairs", "ring_of",
           "sharded_length",
           "speedup_bound"]
