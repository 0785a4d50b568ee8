"""Bytes: what each rank sends per layer, forward + backward, for a layout and a mask.

strategies/closed_form.py is the oracle the distributed tests hold the strategies to; with a window
or documents a ring position sends another the span of its keys that position computes on, read from
the mask's plan (``masked_key_ranges``: MaskPlan.key_range, the spans the runtime sends; tests/reference.py
derives them key by key, the oracle) and turned into bytes (``masked_ring_by_kind``). Here the spans
are found once per (layout, length, mask) and every rank's bytes read off them: 0.2-0.5 s at 1M tokens
and 8-32 positions on a loaded 2-core machine (reports/cost_one_room_cpu.md). Past ``span_budget``
positions x tokens the masked layers' ring bytes are the no-mask closed form (an upper bound), and
``exact_spans`` says so.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Tuple

from ..masks import Mask
from ..sharding.layouts import make_layout
from ..strategies import get_strategy
from ..strategies.closed_form import (Shapes, closed_form_by_kind, conv_halo_bytes, indexed_attention_bytes,
                                       linear_state_bytes, linear_ulysses_bytes, masked_key_ranges,
                                       masked_ring_by_kind)
from ..strategies.lasp_chain import fragments
from .candidate import SOFTMAX_KINDS
from .pairs import ring_of

SPAN_BUDGET = 1 << 23                    # ring positions x tokens whose exact spans are found by default


def _masked_ring(strategy: str, size: int, ulysses: int, shapes: Shapes, mask: Mask):
    """(ring positions, real tokens, the mask cut to them) of a ring layer whose mask changes its bytes,
    else None (``shapes.seq`` is the padded length the layout shards)."""
    real = mask.real(shapes.seq)
    mask, r = mask.for_length(real), ring_of(strategy, size, ulysses)
    if strategy == "ulysses" or r <= 1 or (mask.is_plain(real) and real == shapes.seq):
        return None
    return r, real, mask


def exact_spans(strategy: str, size: int, ulysses: int, shapes: Shapes, mask: Mask,
                span_budget: float = SPAN_BUDGET) -> bool:
    """False when ``rank_bytes`` gives the no-mask upper bound because the spans are past the budget."""
    masked = _masked_ring(strategy, size, ulysses, shapes, mask)
    return masked is None or masked[0] * shapes.seq <= span_budget


@functools.lru_cache(maxsize=64)
def _ranges(layout_name: str, r: int, mask: Mask, padded: int):
    return masked_key_ranges(mask, make_layout(layout_name, r), padded)


def _spans(strategy: str, size: int, ulysses: int, shapes: Shapes, mask: Mask, span_budget: float):
    """The ring positions' key spans of a masked layer, or None (no mask, no ring, or past the budget)."""
    masked = _masked_ring(strategy, size, ulysses, shapes, mask)
    if masked is None or masked[0] * shapes.seq > span_budget:
        return None
    r, real, mask = masked
    return _ranges(get_strategy(strategy).layout_name, r, Mask.from_boundaries(mask.bounds(real), mask.causal,
                                                                                mask.window, blocks=mask.blocks),
                   shapes.seq)


def rank_bytes(strategy: str, size: int, ulysses: int, shapes: Shapes, mask: Mask,
               span_budget: float = SPAN_BUDGET) -> List[Dict[str, int]]:
    """{CommStats kind: bytes} each rank sends for one fwd + bwd of one layer with this mask
    (``shapes.seq`` = the padded length the layout shards): closed_form_by_kind's numbers."""
    ranges = _spans(strategy, size, ulysses, shapes, mask, span_budget)
    if ranges is None:
        return [dict(closed_form_by_kind(strategy, size, shapes, 0, ulysses, causal=mask.causal))] * size
    out = []
    for rank in range(size):
        by_kind = masked_ring_by_kind(ranges, size, shapes, rank, ulysses)
        out.append({k: v for k, v in by_kind.items() if v})
    return out


def busiest_bytes(strategy: str, size: int, ulysses: int, shapes: Shapes, mask: Mask,
                  span_budget: float = SPAN_BUDGET) -> Tuple[Dict[str, int], int]:
    """(the bytes of the rank that sends most, the ring peers it exchanges blocks with)."""
    per_rank = rank_bytes(strategy, size, ulysses, shapes, mask, span_budget)
    rank = max(range(size), key=lambda i: sum(per_rank[i].values()))
    ranges = _spans(strategy, size, ulysses, shapes, mask, span_budget)
    r = ring_of(strategy, size, ulysses)
    if ranges is None:
        return per_rank[rank], r - 1
    me = rank // ulysses
    return per_rank[rank], sum(1 for o in range(r) if o != me and (ranges[me][o] is not None or ranges[o][me] is not None))


def _runs(strategy: str, size: int) -> list:
    """The runs per rank (lasp_chain.fragments, what the state exchange and the conv halo run on) of the
    strategy's layout over 2 x size tokens, one per zigzag chunk: the same runs at every length (zigzag's
    rank 0 holds two, its middle rank's two chunks are adjacent, one run; Ulysses: contiguous)."""
    return fragments(make_layout(get_strategy(strategy).layout_name, size), 2 * size)


def layer_mask(shape, kind: str, causal: bool, docs) -> Mask:
    """The mask of a softmax layer kind of ``shape``: sliding layers have the model's window."""
    return Mask(causal, shape.window if kind == "sliding" else None, docs)


def linear_layer_bytes(c, shape, kind: str, n: int, e: int, rank: int = 0, lasp_comm: str = "allgather"
                       ) -> Dict[str, int]:
    """{CommStats kind: bytes} rank ``rank`` sends for one "linear" / "mamba" layer of ``shape``, forward +
    backward, under candidate ``c`` at ``n`` tokens per rank (batch 1): the conv halo, then under
    linear_strategy ulysses the op's inputs and output all-to-all (ModelShape.ulysses_tensors), under lasp
    the states by ``lasp_comm`` (LASP-2 by default: what the planner prices). The transition is the
    shape's (Mamba2: scalar). ``ds-seqpar bench hybrid`` holds its layers' measured bytes to this."""
    runs = _runs(c.strategy, c.size)
    out = dict(conv_halo_bytes(runs, 1, shape.conv_channels, max(shape.conv_width - 1, 0), e))
    if c.linear_strategy == "ulysses":
        out.update(linear_ulysses_bytes(c.size, list(shape.ulysses_tensors(n, c.size)), e))
    else:
        transition = "scalar" if kind == "mamba" and shape.transition != "diagonal" else shape.transition
        out.update(linear_state_bytes(runs, rank, 1, shape.lin_heads, shape.lin_dk, shape.lin_dv, lasp_comm,
                                      transition))
    return {k: v for k, v in out.items() if v}


def comm_per_layer(c, shape, n: int, e: int, causal: bool = True, docs: Optional[Tuple[int, ...]] = None,
                   peers: Optional[Dict[str, int]] = None, span_budget: float = SPAN_BUDGET
                   ) -> Dict[str, Dict[str, float]]:
    """{layer kind: {CommStats kind: bytes}} the busiest rank sends per layer, forward + backward, for
    candidate ``c`` on ``shape`` (model_shape.ModelShape) at ``n`` tokens per
    rank of ``e`` bytes: softmax layers from the closed forms with each kind's mask (busiest_bytes: the
    window's and the documents' exact spans); ``peers`` (filled if given) the ring peers a softmax kind
    talks to."""
    out: Dict[str, Dict[str, float]] = {}
    if c.size == 1:
        return out
    sh = Shapes(1, c.size * n, shape.heads, shape.kv_heads, shape.head_dim, e, shape.v_head_dim)
    for kind in SOFTMAX_KINDS:
        if shape.count(kind):
            by_kind, talks_to = busiest_bytes(c.strategy, c.size, c.ulysses_size, sh,
                                              layer_mask(shape, kind, causal, docs), span_budget)
            out[kind] = dict(by_kind)
            if peers is not None:
                peers[kind] = talks_to
    for kind in ("linear", "mamba"):
        if shape.count(kind):
            out[kind] = linear_layer_bytes(c, shape, kind, n, e)
    for kind in ("indexed", "indexed_shared"):
        if shape.count(kind):
            out[kind] = dict(indexed_attention_bytes(c.size, 1, c.size * n, shape.latent_dim,
                                                     shape.index_dim if kind == "indexed" else 0, e))
    if shape.count("lasp"):
        state = Shapes(1, c.size * n, shape.heads, shape.kv_heads, shape.head_dim, e)
        out["lasp"] = dict(closed_form_by_kind("lasp", c.size, state, 0, lasp_comm=c.lasp_comm))
    return out


__all__ = ["SPAN_BUDGET", "busiest_bytes", "comm_per_layer", "exact_spans", "layer_mask", "linear_layer_bytes",
           "rank_bytes"]
