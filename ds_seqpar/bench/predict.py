"""The seam between bench and the cost model: every prediction a suite writes beside its measurement
(bounds, closed-form bytes, work per rank) comes through this module; the memory suite's phase model
is cost/'s too, read by memory_rows.py.

Bounds, imbalances and pairs per rank are cost/'s (the one cost model, also the planner's);
bytes are strategies/closed_form.py's (the oracle the cost model's bytes are held to).
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from ..masks import Mask
from ..cost import expected_imbalance, imbalance, pairs_per_rank, position_pairs, speedup_bound  # noqa: F401
from .harness import LINEAR, strategy_config


def attention_closed_form(cfg: dict, meta: dict, seq: int) -> List[int]:
    """Bytes per rank of one fwd+bwd of an attention case (its sequence_parallel keys), strategies/closed_form.py."""
    from ..strategies.closed_form import Shapes, closed_form_bytes
    from .cases import DTYPES
    p = meta["world"]
    shapes = Shapes(meta["batch"], seq, meta["heads"], meta["kv_heads"], meta["head_dim"], DTYPES[meta["dtype"]].itemsize)
    return [closed_form_bytes(cfg.get("strategy", "ulysses"), p, shapes, rank=r, ulysses_size=cfg.get("ulysses_size", 1),
                              lasp_comm=cfg.get("lasp_comm", "allgather")) for r in range(p)]


def work_per_rank(name: str, args, bounds) -> List[int]:
    """(q, k) pairs each rank computes for these documents (causal); linear attention: tokens."""
    if name in LINEAR:                               # linear attention: work follows tokens, L per rank
        return [args.seq // args.P] * args.P
    cfg = strategy_config(name, args.P)
    return [int(x) for x in pairs_per_rank(cfg["strategy"], args.P, cfg.get("ulysses_size", 1), args.seq,
                                           Mask.from_boundaries(bounds))]


def packed_closed_form(name: str, args, bounds) -> List[int]:
    """Bytes per rank for one fwd+bwd of these documents (strategies/closed_form.py)."""
    from ..strategies.closed_form import Shapes, closed_form_bytes
    cfg, sh = strategy_config(name, args.P), Shapes(1, args.seq, args.heads, args.heads, args.head_dim)
    return [closed_form_bytes(cfg["strategy"], args.P, sh, r, cfg.get("ulysses_size", 1),
                              cfg.get("lasp_comm", "allgather"), bounds) for r in range(args.P)]


def imbalance_sweep(seq: int, ps=(2, 4, 8), trials: int = 200, seed: int = 0) -> Dict[str, Dict[int, tuple]]:
    """Causal work imbalance (max/mean over ranks) of random packings, per ring layout and P: (mean,
    worst) over ``trials`` packings of documents with log-normal lengths (median 400 tokens, long tail)
    cut to ``seq``. A rank's work is the sum over its queries of the keys they see in their document."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = {name: {p: [] for p in ps} for name in ("contiguous", "zigzag", "striped")}
    for _ in range(trials):
        lengths = (torch.randn(64, generator=g) * 1.2 + 6.0).exp().clamp(1, seq).long().tolist()
        bounds = [0]
        for n in lengths:
            bounds.append(min(bounds[-1] + n, seq))
            if bounds[-1] == seq:
                break
        bounds[-1] = seq
        mask = Mask.from_boundaries(bounds)
        for name, per_p in out.items():
            for p in ps:
                per_p[p].append(imbalance(position_pairs(name, p, seq, seq, mask)))
    return {name: {p: (statistics.mean(v), max(v)) for p, v in per_p.items()} for name, per_p in out.items()}


def window_work(name: str, p: int, seq: int, window: Optional[int]) -> List[int]:
    """Visible causal (q, k) pairs per rank (Ulysses: all queries, 1/P of the heads)."""
    return [int(x) for x in pairs_per_rank(name, p, p if name == "ulysses" else 1, seq, Mask(True, window))]


def window_closed_form(name: str, args, window: Optional[int]) -> List[int]:
    """Bytes per rank for one fwd+bwd (strategies/closed_form.py), with the window when given."""
    from ..strategies.closed_form import Shapes, closed_form_by_kind
    sh = Shapes(1, args.seq, args.heads, args.heads, args.head_dim)
    return [sum(closed_form_by_kind(name, args.P, sh, r, causal=True, window=window).values())
            for r in range(args.P)]


def hybrid_closed_form(fam: str, case: str, args, family_config, sp_cases) -> List[int]:
    """Bytes per rank of one fwd+bwd of the family's layer (batch 1), strategies/closed_form.py."""
    from ..sharding.layouts import make_layout
    from ..strategies.closed_form import conv_halo_bytes, linear_state_bytes, linear_ulysses_bytes
    from ..strategies.state_passing import fragments
    c, p, t = family_config(fam, args.hidden), args.P, args.seq // args.P
    frags = fragments(make_layout("contiguous", p), args.seq)
    if fam == "gdn":
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        state, kind, elems = (hv, dk, dv), "matrix", [t * hk * dk] * 2 + [t * hv * dv] * 2 + [t * hv] * 2
        halo = (2 * hk * dk + hv * dv, c.linear_conv_kernel_dim - 1)
    elif fam == "kda":
        h, d = c.linear_num_heads, c.linear_head_dim
        state, kind, elems = (h, d, d), "matrix", [t * h * d] * 5 + [t * h]          # q, k, v, g, out; beta
        halo = (3 * h * d, c.linear_conv_kernel_dim - 1)
    elif fam == "ssd":
        h, pd, n, g = c.mamba_n_heads, c.mamba_d_head, c.mamba_d_state, c.mamba_n_groups
        state, kind, elems = (h, pd, n), "scalar", [t * h * pd] * 2 + [t * h] + [t * g * n] * 2   # x, out; dt; B, C
        halo = (int(c.mamba_expand * c.hidden_size) + 2 * g * n, c.mamba_d_conv - 1)
    elif fam == "lightning":
        h, d = c.num_attention_heads, c.head_dim
        state, kind, elems, halo = (h, d, d), "fixed", [t * h * d] * 4, None
    else:
        state, halo = None, (c.hidden_size, c.conv_L_cache - 1)
    out = []
    for r in range(p):
        total = conv_halo_bytes(frags, 1, halo[0], halo[1], 4)["conv_halo"] if halo else 0
        if state and sp_cases[case]["linear_strategy"] == "ulysses":
            total += linear_ulysses_bytes(p, elems, 4)["linear_all_to_all"]
        elif state:
            total += sum(linear_state_bytes(frags, r, 1, *state, sp_cases[case]["lasp_comm"], kind).values())
        out.append(total)
    return out
