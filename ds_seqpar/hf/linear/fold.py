"""The last step every stateful family shares: each fragment's map (o0, Q~, A, B) from the family's
op, the states entering the fragments from the exchange, then o = o0 + Q~ . S_in. In generate's prefill
also the state the prompt leaves: A . S_in + B of the fragment its last token ends, on every rank."""
from __future__ import annotations

import torch

from ...strategies.decode import from_owner


def fold(exchange, pieces, frags, resets, state_rows_are_values: bool = False, decay_h=None, end=None):
    """pieces: per local fragment (o0, effective queries, A or None, B); A None: the fixed decay_h
    (lambda^n per head). Returns the fragments' outputs in local order. ``state_rows_are_values``:
    Mamba2 keeps the state as [headdim (values), N (keys)]. ``end`` (generate's prefill: the prompt
    length, where a fragment ends): returns (outputs, the state after token end - 1 on every rank, fp32,
    in B's layout)."""
    a_f = None if decay_h is not None else torch.stack([p[2] for p in pieces])
    s_in = exchange.states_in(torch.stack([p[3] for p in pieces]), frags, resets, a_f, decay_h)
    outs = [with_state_in(o0, q_eff, s.transpose(-1, -2) if state_rows_are_values else s)
            for (o0, q_eff, _, _), s in zip(pieces, s_in)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    if end is None:
        return out
    if decay_h is not None:
        raise NotImplementedError("the state a fixed-decay fragment leaves (lightning attention) is not built")
    return out, state_after(exchange, pieces, s_in, frags, end)


def state_after(exchange, pieces, s_in, frags, end: int):
    """The state after global token end - 1: S_out = A . S_in + B of the fragment ending there, on the rank
    holding it (A a matrix [.., K, K] or elementwise [.., 1, 1] / [.., K, 1]; a fragment entering with the zero
    state has S_in = 0), then on every rank through one all-reduce (strategies/decode.py: from_owner)."""
    here = None
    for (start, n, _), (_, _, a, b), s in zip(frags[exchange.rank], pieces, s_in):
        if start + n == end:
            a, s = a.float(), s.float()
            here = (a * s if a.shape[-1] == 1 else a @ s) + b.float()
    return from_owner(here, pieces[0][3].float(), exchange.group, exchange.stats)


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


__all__ = ["fold", "state_after", "with_state_in", "unused_map"]
