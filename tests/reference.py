"""Single-process references and derived tolerances for the exactness tests.

Derived tolerance (docs/design.md, section 5): the fast path's error against a float64 reference may be at
most K times the error of a plain same-precision implementation against that reference, plus a
floor far below any real bug (a wrong mask or a lost block moves results by O(1e-2) or more).
"""

from typing import List, Optional, Sequence, Tuple

import torch

from ds_seqpar.kernels import MathKernel
from ds_seqpar.masks import block_starts

K = 5.0


def attention_with_grads(q, k, v, dout, causal, scale, dtype):
    """(out, dq, dk, dv) of plain full-sequence attention computed in ``dtype``."""
    kern = MathKernel()
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = kern.forward(q, k, v, causal, scale)
    dq, dk, dv = kern.backward(dout, q, k, v, out, lse, causal, scale)
    return out, dq, dk, dv


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def assert_derived_close(name, got, ref64, plain, k=K, floor=1e-6):
    """``got`` vs the float64 ``ref64``, with the bound set by ``plain`` (same dtype as got)."""
    scale = ref64.abs().max().item() or 1.0
    bound = k * max_err(plain, ref64) + floor * scale
    err = max_err(got, ref64)
    assert err <= bound, (f"{name}: max error {err:.3e} vs float64 exceeds derived bound {bound:.3e} "
                          f"(plain {got.dtype} error {max_err(plain, ref64):.3e}, K={k})")


def assert_shards_close(case, sp, out, inputs, ref64, plain):
    """This rank's output and q/k/v gradients against its shards of the float64 and plain references."""
    for name, g, r, p in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in inputs)), ref64, plain):
        assert g is not None, f"{case}: no gradient for {name}"
        assert_derived_close(f"{case} {name}", g.detach(), sp.shard(r), sp.shard(p))


def packed_attention_with_grads(q, k, v, dout, bounds, causal, scale, dtype):
    """(out, dq, dk, dv) of attention computed per document separately (batch 1): document d is
    tokens [bounds[d], bounds[d+1]); tokens past bounds[-1] (end padding) get zeros."""
    parts = [attention_with_grads(q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], causal, scale, dtype)
             for a, b in zip(bounds, bounds[1:])]
    pad = q.shape[1] - bounds[-1]
    out = []
    for i, like in enumerate((q, q, k, v)):
        cat = [p[i] for p in parts]
        if pad:
            width = v.shape[-1] if i == 0 else like.shape[-1]
            cat.append(like.new_zeros(like.shape[0], pad, like.shape[2], width).to(cat[0].dtype))
        out.append(torch.cat(cat, dim=1))
    return tuple(out)


def mask_of(n, causal, window=None, bounds=None, blocks=None):
    """[n, n] bool: query i may see key j (causal, sliding window, same document; keys and queries
    past bounds[-1] see nothing); ``blocks`` [(start, end), ...]: bidirectional inside each block,
    as transformers' AND(window, OR(causal, block)) (the window bounds earlier keys only)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ok = torch.ones(n, n, dtype=torch.bool)
    if causal:
        same_block = torch.zeros(n, n, dtype=torch.bool)
        for a, b in blocks or ():
            same_block |= (a <= i) & (i < b) & (a <= j) & (j < b)
        ok &= (j <= i) | same_block
    if window is not None:
        ok &= (i - j < window) & ((j - i < window) | causal)
    if bounds is not None:
        doc = torch.searchsorted(torch.tensor(bounds), torch.arange(n), right=True)
        real = torch.arange(n) < bounds[-1]
        ok &= (doc[:, None] == doc[None, :]) & real[:, None] & real[None, :]
    return ok


def dense_attention(q, k, v, causal, scale, window=None, softcap=None, sinks=None, bounds=None, blocks=None):
    """Dense attention written out (differentiable, in the inputs' dtype): GQA by repeating k/v, scores
    capped, the mask applied, sinks as an extra logit column with no value."""
    b, n, h, _ = q.shape
    group = h // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask_of(n, causal, window, bounds, blocks).to(q.device), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, n, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(group, 2))


def masked_attention_with_grads(q, k, v, dout, causal, scale, dtype, window=None, softcap=None, sinks=None,
                                bounds=None, blocks=None):
    """(out, dq, dk, dv, dsinks) of dense_attention in ``dtype`` (autograd)."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    s = None if sinks is None else sinks.detach().to(dtype).requires_grad_()
    out = dense_attention(q, k, v, causal, scale, window, softcap, s, bounds, blocks)
    out.backward(dout.to(dtype))
    return out.detach(), q.grad, k.grad, v.grad, (None if s is None else s.grad)


# -- the cost oracle: what cost/ and strategies/closed_form.py count, by enumeration ------------


def pairs_per_query_set(n, causal, window, bounds, query_sets, bidirectional=None):
    """The visible (q, k) pairs of each set of global query positions, counted pair by pair on the
    dense mask (one head; ``bidirectional``: mask_of's blocks)."""
    seen = mask_of(n, causal, window, bounds, bidirectional).sum(dim=1)
    return [int(seen[torch.as_tensor(q, dtype=torch.long)].sum()) for q in query_sets]


def key_spans(n, causal, window, bounds, blocks, bidirectional=None):
    """spans[me][src] (me != src): the local slots [a, b) of block ``src``'s keys that some query of
    block ``me`` sees, or None; ``blocks`` the global positions of each ring position in its local order;
    ``bidirectional``: mask_of's blocks. Found by enumerating every (query, key) of every pair of blocks
    on the dense mask."""
    mask = mask_of(n, causal, window, bounds, bidirectional)
    p = len(blocks)
    out = [[None] * p for _ in range(p)]
    for me in range(p):
        for src in range(p):
            if me == src:
                continue
            used = mask[blocks[me]][:, blocks[src]].any(dim=0).nonzero().flatten().tolist()
            if used:
                out[me][src] = (used[0], used[-1] + 1)
    return out


def ring_bytes_from_spans(spans, me, token_elems, elem, acc_elem=4):
    """Bytes ring position ``me`` sends for one fwd + bwd: its keys every other position sees, as k and v
    forward and again backward, and an fp32 dK/dV share of every other position's keys it saw."""
    width = lambda s: 0 if s is None else s[1] - s[0]           # noqa: E731
    sent = sum(width(spans[o][me]) for o in range(len(spans)) if o != me)
    used = sum(width(spans[me][o]) for o in range(len(spans)) if o != me)
    return {"ring": sent * token_elems * 2 * elem, "ring_grad": used * token_elems * acc_elem}


def ring_key_ranges(bounds: Sequence[int], ring_layout, padded: int, causal: bool,
                    window: Optional[int] = None, blocks=None) -> List[List[Optional[Tuple[int, int]]]]:
    """ranges[me][src] (me != src): the local slots [a, b) of src's block spanned by the keys some
    query of ring position me can see (same document; causal: key <= query, or both in one of the
    bidirectional ``blocks`` (global (start, end) pairs); window w: query - w < key, non-causal
    |query - key| < w), or None. Computed key by key from the mask on global positions (each key's
    visible queries are an interval, from the key, or its block's start, on; does me hold one?),
    independently of the bands of the plan (mask_plan.py): the oracle of
    strategies/closed_form.masked_key_ranges, which reads the spans from the runtime's MaskPlan. O(R N),
    fast enough for the long sequences key_spans' dense mask cannot hold."""
    p, real = ring_layout.size, bounds[-1]
    cu = torch.tensor(bounds)
    big = padded + (window or padded)
    queries = []
    for r in range(p):
        g = ring_layout.indices(padded, r)
        queries.append(torch.sort(g[g < real]).values)
    out: List[List[Optional[Tuple[int, int]]]] = [[None] * p for _ in range(p)]
    for src in range(p):
        gk = ring_layout.indices(padded, src)
        doc = torch.searchsorted(cu, gk.clamp(max=real - 1), right=True) - 1
        start, stop = cu[doc], cu[doc + 1] - 1                      # the key's document [start, stop]
        w = window or big
        lo = block_starts(blocks, gk) if causal else torch.maximum(start, gk - w + 1)
        hi = torch.minimum(stop, gk + w - 1)
        for me in range(p):
            if me == src:
                continue
            gq = queries[me]
            seen = (torch.searchsorted(gq, hi, right=True) - torch.searchsorted(gq, lo)) > 0
            seen &= gk < real                                        # end padding pairs with nothing
            slots = torch.nonzero(seen).flatten()
            if slots.numel():
                out[me][src] = (int(slots[0]), int(slots[-1]) + 1)
    return out


def band_visible(nq, nk, lo, hi):
    """bool [nq, nk]: query row i sees key column j iff lo <= j - i <= hi (None: unbounded), the band
    predicate kernels/bands.py cuts and kernel.band computes."""
    d = torch.arange(nk)[None, :] - torch.arange(nq)[:, None]
    ok = torch.ones(nq, nk, dtype=torch.bool)
    if lo is not None:
        ok &= d >= lo
    if hi is not None:
        ok &= d <= hi
    return ok


def block_pairs(nq, nk, causal):
    """The (q, k) pairs one kernel call on an [nq, nk] block computes: all of them, or causal from the
    top-left corner (query row i sees key columns j <= i: the band with hi = 0, so the rows of a tall
    block past nk see every key), counted on band_visible's predicate."""
    return int(band_visible(nq, nk, None, 0 if causal else None).sum())
