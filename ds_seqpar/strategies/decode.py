"""Decode with a sequence-sharded KV cache: one new query, whole on every rank, against keys that
each rank holds a disjoint shard of (pass-Q with the query already everywhere).

Each rank attends over its own cached keys (their global positions are known, so the causal rule is
trivially kept for the newest token, and a sliding window drops the keys it cannot see), giving a
partial (out, lse). The partials merge exactly with kernels/merge.py's log-sum-exp merge after ONE
collective per layer: an all-gather of every rank's (out, lse) packed into one fp32 buffer
[b, h * (dv + 1) (+ checks)] (fp64 for fp64 inputs). Each rank sends b * h * (dv + 1) * 4 * (P - 1)
bytes per layer (cost/bytes.py: decode_merge_bytes), independent of the context length. Every rank
folds the parts in rank order, so every rank's result is bitwise the same (the rest of the layer, the
logits and the sampling then agree across ranks without further communication). Sinks (gpt-oss) add
one logit per head to the denominator: folded once, after the merge.

Left-padded batches: every row has the same slots (one cache tensor per layer), so a pad slot of a
row is masked there by its position (negative); the partial and the merge are otherwise unchanged.

Shares: the prompt's tokens stay on the rank the layout put them on (padding excluded); each
generated token's K/V goes to the rank whose share is smallest (ties: the lowest rank), so the shares
stay within one token of balanced once the prompt's imbalance (at most one layout block) is filled.

Hybrids (gated DeltaNet, Mamba2, short convolutions): their decode steps need no cache shard at all but
the states the whole prompt leaves, the same on every rank (replicated), so that every rank runs the
layer's own recurrent step on the whole token identically. The prefill leaves them in one collective each
per layer: ``prompt_tail`` (the conv state, the last K inputs of the prompt) and ``from_owner`` (the
recurrent state after the last prompt token, which one rank's fragment holds) are all-reduces of one
owner's values and zeros (exact); ``gather_heads`` (linear_strategy ulysses: each rank holds its heads'
states) an all-gather along the heads.

Legend: b = batch, h = q heads, hkv = k/v heads, m = this rank's cached keys, d = qk head dim,
dv = v head dim, P = sequence-parallel size, c = conv channels, K = conv kernel width.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .. import comm
from ..kernels.merge import NEG_INF, acc_dtype, merge_


def next_owner(shares: Sequence[int]) -> int:
    """The rank a new token's K/V goes to: the smallest share, ties to the lowest rank."""
    return min(range(len(shares)), key=lambda r: (shares[r], r))


def prompt_shares(layout, n_real: int, n_padded: int) -> List[int]:
    """Real (non-padding) prompt tokens each rank holds under ``layout`` for a prompt of ``n_real`` tokens
    padded to ``n_padded``."""
    return [int((layout.indices(n_padded, r) < n_real).sum()) for r in range(layout.size)]


def partial_attention(q_bhd, k_bhmd, v_bhmd, key_pos, q_pos: int, scale: float, window: Optional[int] = None,
                      softcap: Optional[float] = None):
    """One query row per (batch, head) against this rank's keys, in ``acc_dtype``.

    q_bhd [b, h, d]; k_bhmd [b, hkv, m, d], v_bhmd [b, hkv, m, dv]; key_pos [m] their global positions
    (all <= q_pos). ``window``: transformers' sliding_window, keys j with q_pos - window < j are seen.
    A left-padded batch (hf/kv_cache.py): key_pos [b, m] each row's positions, negative for a pad slot
    (never seen: its score is -inf, exactly the 0 weight the unsharded model's padding mask gives it),
    and q_pos [b] each row's query position.
    Returns (out [b, h, dv], lse [b, h]); a row that sees no key here has out = 0, lse = -inf."""
    b, h, _ = q_bhd.shape
    dtype = acc_dtype(q_bhd.dtype)
    hkv, m, dv = k_bhmd.shape[1], k_bhmd.shape[2], v_bhmd.shape[-1]
    if m == 0:
        return q_bhd.new_zeros(b, h, dv, dtype=dtype), q_bhd.new_full((b, h), NEG_INF, dtype=dtype)
    groups = h // hkv
    q = q_bhd.to(dtype).view(b, hkv, groups, -1)                        # GQA: the q heads of each k/v head
    scores = torch.einsum("bkgd,bkmd->bkgm", q, k_bhmd.to(dtype)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if key_pos.dim() == 2:                                               # per row: [b, 1, 1, m] against [b, 1, 1, 1]
        rows = key_pos.to(scores.device)[:, None, None, :]
        seen = rows >= 0
        if window is not None:
            seen = seen & (rows > torch.as_tensor(q_pos, device=scores.device).view(-1, 1, 1, 1) - window)
        scores = scores.masked_fill(~seen, NEG_INF)
    elif window is not None:
        seen = key_pos.to(scores.device) > q_pos - window
        scores = scores.masked_fill(~seen, NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)                                # [b, hkv, g]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    probs = torch.where(torch.isneginf(lse).unsqueeze(-1), torch.zeros_like(probs), probs)
    out = torch.einsum("bkgm,bkmd->bkgd", probs, v_bhmd.to(dtype))
    return out.reshape(b, h, dv), lse.reshape(b, h)


def merge_partials(out_bhd, lse_bh, group, stats=None, checks: Optional[torch.Tensor] = None):
    """Exact attention over the union of every rank's keys from each rank's partial (out, lse): one
    all-gather of the packed partials, then every rank folds them in rank order (merge_). ``checks`` [b]:
    values that must agree across ranks (the step's input tokens), carried in the same buffer; a
    disagreement raises on every rank alike. Returns (out [b, h, dv], lse [b, h])."""
    b, h, dv = out_bhd.shape
    parts = [out_bhd.reshape(b, h * dv), lse_bh]
    if checks is not None:
        parts.append(checks.to(out_bhd.dtype).reshape(b, 1))
    packed = torch.cat(parts, dim=1)
    gathered = comm.all_gather_nograd(packed, 0, group, stats, kind="decode_merge").view(-1, *packed.shape)
    if checks is not None:
        seen = gathered[:, :, -1]
        if not torch.equal(seen, seen[:1].expand_as(seen)):
            raise RuntimeError(f"ds_seqpar decode: the ranks of a sequence group decode different tokens "
                               f"({seen[:, 0].tolist()} in rank order, first row): generate must run with the "
                               f"same prompt, options and random seed on every rank")
    return fold_parts(gathered[:, :, :h * (dv + 1)], h, dv)


def fold_parts(parts, h: int, dv: int):
    """parts [P, b, h * dv + h]: each rank's packed (out, lse), in rank order -> the merged (out [b, h, dv],
    lse [b, h]), folded in rank order with kernels/merge.py's merge_ (the same order on every rank)."""
    b = parts.shape[1]
    out = parts[0, :, :h * dv].reshape(b, 1, h, dv).clone()           # merge_'s layouts: [b, s, h, d], [b, h, s]
    lse = parts[0, :, h * dv:].reshape(b, h, 1).clone()
    for part in parts[1:]:
        merge_(out, lse, part[:, :h * dv].reshape(b, 1, h, dv), part[:, h * dv:].reshape(b, h, 1))
    return out.reshape(b, h, dv), lse.reshape(b, h)


def fold_sinks(out_bhd, lse_bh, sinks: Optional[torch.Tensor]):
    """gpt-oss sinks [h]: one more logit per head in the softmax denominator, no value: out scales by
    exp(lse - logaddexp(lse, sink))."""
    if sinks is None:
        return out_bhd
    with_sink = torch.logaddexp(lse_bh, sinks.to(lse_bh.dtype).view(1, -1))
    weight = torch.exp(lse_bh - with_sink)
    weight = torch.where(torch.isneginf(with_sink), torch.zeros_like(weight), weight)
    return out_bhd * weight.unsqueeze(-1)


def decode_attention(ctx, q_bhd, k_bhmd, v_bhmd, key_pos, q_pos: int, scale: float, window: Optional[int] = None,
                     softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                     checks: Optional[torch.Tensor] = None):
    """A decode step's attention over the whole sequence group's cache (strategy context ``ctx``):
    partial on this rank, one all-gather, the exact merge, the sinks. Returns out [b, h, dv] in q's dtype."""
    out, lse = partial_attention(q_bhd, k_bhmd, v_bhmd, key_pos, q_pos, scale, window, softcap)
    out, lse = merge_partials(out, lse, ctx.sp_group, ctx.stats, checks)
    return fold_sinks(out, lse, sinks).to(q_bhd.dtype)


def prompt_tail(x_bcl, local_positions, prompt_len: int, width: int, group, stats=None):
    """The inputs at global positions prompt_len - width .. prompt_len - 1 ([b, c, width], zeros before
    position 0), the same on every rank, from each rank's shard x_bcl [b, c, local] whose tokens are at
    ``local_positions`` [local] (the layout's end padding, positions >= prompt_len, is never taken): one
    all-reduce in which each slot has one owner and zeros elsewhere, so the sum is exact."""
    slot = local_positions.to(x_bcl.device) - (prompt_len - width)
    mine = (slot >= 0) & (slot < width)
    tail = x_bcl.new_zeros(x_bcl.shape[0], x_bcl.shape[1], width)
    tail[..., slot[mine]] = x_bcl[..., mine]
    return comm.all_reduce(tail, group, stats, kind="prefill_conv_state")


def from_owner(value: Optional[torch.Tensor], like: torch.Tensor, group, stats=None):
    """``value`` on the one rank that has it (the others pass None), on every rank: one all-reduce of it and
    zeros (exact). ``like``: a tensor of its shape and dtype that every rank holds."""
    buf = torch.zeros_like(like) if value is None else value.to(like.dtype).clone().contiguous()
    return comm.all_reduce(buf, group, stats, kind="prefill_state")


def gather_heads(state_bh, group, stats=None):
    """[b, heads / P, ...] this rank's block of heads -> [b, heads, ...] every rank's, in rank order (the
    heads' order: rank r holds the r-th block)."""
    return comm.all_gather_nograd(state_bh.contiguous(), 1, group, stats, kind="prefill_state")


__all__ = ["next_owner", "prompt_shares", "partial_attention", "merge_partials", "fold_parts", "fold_sinks",
           "decode_attention", "prompt_tail", "from_owner", "gather_heads"]
