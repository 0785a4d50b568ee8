"""The last step every stateful family shares: each fragment's map (o0, Q~, A, B) from the family's
op, the states entering the fragments from the exchange, then o = o0 + Q~ . S_in."""
from __future__ import annotations

import torch


def fold(exchange, pieces, frags, resets, state_rows_are_values: bool = False, decay_h=None):
    """pieces: per local fragment (o0, effective queries, A or None, B); A None: the fixed decay_h
    (lambda^n per head). Returns the fragments' outputs in local order. ``state_rows_are_values``:
    Mamba2 keeps the state as [headdim (values), N (keys)]."""
    a_f = None if decay_h is not None else torch.stack([p[2] for p in pieces])
    s_in = exchange.states_in(torch.stack([p[3] for p in pieces]), frags, resets, a_f, decay_h)
    outs = [with_state_in(o0, q_eff, s.transpose(-1, -2) if state_rows_are_values else s)
            for (o0, q_eff, _, _), s in zip(pieces, s_in)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def with_state_in(o0, q_eff, s_in):
    """o = o0 + Q~ . S_in, in o0's dtype. Q~ None: a fragment that enters with the zero state; its
    output still depends on S_in (times 0), so every rank runs the exchange's backward collectives."""
    if q_eff is None:
        return o0 + (s_in.reshape(-1)[:1].sum() * 0).to(o0.dtype)
    return (o0.float() + torch.einsum("blhk,bhkv->blhv", q_eff, s_in.float())).to(o0.dtype)


def unused_map(final, k: int):
    """Zeros [b, h, k, k] for a fragment that enters with the zero state: its A is never applied (it
    multiplies zero), but the exchange stacks one per fragment."""
    return (final.float()[..., :1, :1] * 0).expand(*final.shape[:-2], k, k)


__all__ = ["fold", "with_state_in", "unused_map"]
