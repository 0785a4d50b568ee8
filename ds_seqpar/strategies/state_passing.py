"""State passing for recurrent token mixers under any contiguous-run layout: the delta rule (GDN,
KDA), scalar-decay scans, and the halo of a short causal convolution.

Every such mixer runs a block of tokens as an affine map of the state that enters it:

    S_out = A . S_in + B          (B = the block's zero-init final state, A = its transition)
    o     = o0 + Q~ . S_in        (o0 = zero-init output, Q~ = effective queries)

so a rank needs, for each of its fragments (maximal runs of consecutive global positions: one per
rank in the contiguous layout, two in zigzag), the state entering it: the fold of the maps of every
fragment before it in global order. ``A`` is a [.., K, K] matrix (delta rule) or a [.., 1, 1]
scalar per (row, head) (scalar decay); ``apply_map`` hides the difference.

Two exchanges, as ``lasp_comm`` names them:
  * allgather (LASP-2): all-gather every fragment's (A, B) and fold the predecessors locally;
    autograd's dual of the all-gather (a reduce-scatter, comm.all_gather) is the backward.
  * ring (LASP-1): walk the fragments in global order, each owner receiving the state from the
    previous owner and sending A.S_in + B on; the backward walks back (_StateChain).

The convolution halo: a fragment's first K-1 outputs read the K-1 inputs before it, which the
previous fragment in global order holds. Every fragment's tail is all-gathered (autograd returns
the halo's gradient to its owner, added to its tail's gradient).

Fragments must be at least K-1 tokens long (the halo comes from one fragment); a striped layout
(one-token fragments) is refused where the mixers are set up, before any communication.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from .. import comm
from ..errors import ConfigError

Fragment = Tuple[int, int, int]          # (global start, length, offset in the local order)


def fragments(layout, seq_len: int) -> List[List[Fragment]]:
    """Per rank, its maximal runs of consecutive global positions, in local order."""
    out = []
    for r in range(layout.size):
        idx = layout.indices(seq_len, r).tolist()
        runs, offset = [], 0
        for i, pos in enumerate(idx):
            if i and pos == idx[i - 1] + 1:
                continue
            if runs:
                runs[-1] = (runs[-1][0], i - runs[-1][2], runs[-1][2])
            runs.append((pos, 0, i))
        runs[-1] = (runs[-1][0], len(idx) - runs[-1][2], runs[-1][2])
        out.append(runs)
    return out


def cut_at_documents(frags: Sequence[Sequence[Fragment]], bounds: Sequence[int]) -> List[List[Fragment]]:
    """The runs cut at every document start inside them (packed documents: ``bounds`` = the global
    cu_seqlens [0, l1, l1 + l2, ..., N]): no run then spans two documents."""
    starts = sorted(int(b) for b in bounds)
    out = []
    for fr in frags:
        pieces = []
        for start, n, off in fr:
            cuts = [start] + [b for b in starts if start < b < start + n] + [start + n]
            pieces += [(a, b - a, off + a - start) for a, b in zip(cuts[:-1], cuts[1:])]
        out.append(pieces)
    return out


def global_order(frags: Sequence[Sequence[Fragment]]) -> List[Tuple[int, int]]:
    """(rank, local fragment index) of every fragment, by global start."""
    return sorted(((r, j) for r, fr in enumerate(frags) for j in range(len(fr))), key=lambda rj: frags[rj[0]][rj[1]][0])


def apply_map(a: Tensor, s: Tensor) -> Tensor:
    """A . S for a matrix transition [.., K, K] or a scalar one [.., 1, 1]."""
    return a * s if a.shape[-1] == 1 else a @ s


def _map_transpose(a: Tensor, d: Tensor) -> Tensor:
    return a * d if a.shape[-1] == 1 else a.transpose(-1, -2) @ d


def _map_grad(a: Tensor, d_out: Tensor, s_in: Tensor) -> Tensor:
    """dA from dS_out = D and S_in: D S_in^T (matrix) or <D, S_in> per (row, head) (scalar)."""
    if a.shape[-1] == 1:
        return (d_out * s_in).sum((-1, -2), keepdim=True)
    return d_out @ s_in.transpose(-1, -2)


def states_in(a_f: Tensor, b_f: Tensor, frags, rank: int, group, stats=None, lasp_comm: str = "allgather",
              resets=frozenset()) -> Tensor:
    """The state entering each of this rank's fragments, [nf, *B's shape]; a_f [nf, .., K, K or 1],
    b_f [nf, .., K, V] (fp32). ``resets``: the global starts of packed documents (a fragment that
    starts one enters with the zero state). Differentiable in both."""
    if lasp_comm == "ring":
        return _StateChain.apply(a_f, b_f, frags, rank, group, stats, frozenset(resets))
    a_all = comm.all_gather(_padded(a_f, frags), 0, group, stats, "lasp_allgather")
    b_all = comm.all_gather(_padded(b_f, frags), 0, group, stats, "lasp_allgather")
    # every fragment's state, then this rank's: the output depends on the gathered maps on every rank
    # (also rank 0, whose own state is zero), so every rank runs the all-gather's backward collective
    s, entering = torch.zeros_like(b_f[0]), {}
    for r, j in global_order(frags):
        if frags[r][j][0] in resets:
            s = torch.zeros_like(s)
        entering[r, j] = s
        s = apply_map(a_all[r, j], s) + b_all[r, j]
    every = torch.stack([entering[key] for key in sorted(entering)])
    return _this_ranks(every, frags, rank)


def _this_ranks(every: Tensor, frags, rank: int) -> Tensor:
    """This rank's rows of a tensor with one row per fragment of every rank (rank-major)."""
    first = sum(len(fr) for fr in frags[:rank])
    return every[first:first + len(frags[rank])]


def _padded(per_fragment: Tensor, frags) -> Tensor:
    """[1, most fragments any rank holds, ...]: all-gathered pieces must have one shape (zigzag at
    P=2 gives rank 1 one run, rank 0 two)."""
    most = max(len(fr) for fr in frags)
    extra = most - per_fragment.shape[0]
    if extra:
        per_fragment = torch.cat([per_fragment, per_fragment.new_zeros((extra,) + per_fragment.shape[1:])])
    return per_fragment.unsqueeze(0).contiguous()


class _StateChain(torch.autograd.Function):
    """LASP-1 over fragments: P2P hops along the global order; the backward walks it in reverse,
    each owner sending dS_in (its own G plus A^T of what came back) to the previous owner."""

    @staticmethod
    def forward(ctx, a_f, b_f, frags, rank, group, stats, resets):
        order = global_order(frags)
        # a hop into a fragment that starts a document carries nothing: neither side posts it
        hop = [i > 0 and frags[r][j][0] not in resets for i, (r, j) in enumerate(order)]
        s_in = torch.zeros_like(b_f)
        carry = None
        for i, (r, j) in enumerate(order):
            if r != rank:
                continue
            if hop[i]:
                prev = order[i - 1][0]
                s_in[j] = carry if prev == rank else _recv(b_f[0], prev, group, stats)
            if i + 1 < len(order) and hop[i + 1]:
                s_out = apply_map(a_f[j], s_in[j]) + b_f[j]
                nxt = order[i + 1][0]
                if nxt == rank:
                    carry = s_out
                else:
                    _send(s_out, nxt, group, stats)
        ctx.save_for_backward(a_f, s_in)
        ctx.frags, ctx.rank, ctx.group, ctx.stats, ctx.hop = frags, rank, group, stats, hop
        return s_in

    @staticmethod
    def backward(ctx, g_in):
        a_f, s_in = ctx.saved_tensors
        order, rank, group, stats = global_order(ctx.frags), ctx.rank, ctx.group, ctx.stats
        da, db = torch.zeros_like(a_f), torch.zeros_like(s_in)
        g_in = g_in.contiguous()
        carry = None
        for i in range(len(order) - 1, -1, -1):
            r, j = order[i]
            if r != rank:
                continue
            d_in = g_in[j]
            if i + 1 < len(order) and ctx.hop[i + 1]:      # this fragment's S_out feeds the next one
                nxt = order[i + 1][0]
                d_out = carry if nxt == rank else _recv(s_in[0], nxt, group, stats)
                db[j] = d_out
                da[j] = _map_grad(a_f[j], d_out, s_in[j])
                d_in = d_in + _map_transpose(a_f[j], d_out)
            if ctx.hop[i]:
                prev = order[i - 1][0]
                if prev == rank:
                    carry = d_in
                else:
                    _send(d_in, prev, group, stats)
        return da, db, None, None, None, None, None


def _send(t: Tensor, peer: int, group, stats) -> None:
    comm.p2p([(t.contiguous(), peer)], [], group, stats, "lasp_ring").wait()


def _recv(like: Tensor, peer: int, group, stats) -> Tensor:
    return comm.p2p([], [(torch.empty_like(like), peer)], group, stats, "lasp_ring").wait()[0]


def halos(x_bcl: Tensor, width: int, frags, rank: int, group, stats=None, resets=frozenset()) -> List[Tensor]:
    """For each local fragment, the ``width`` inputs before it in global order ([b, c, width]);
    zeros before position 0 and before a document start (``resets``). x_bcl: this rank's conv
    input, channels first, local order. A fragment shorter than ``width`` (only one that starts a
    document, after cut_at_documents) gives its tokens left-padded with zeros. Differentiable: the
    halo's gradient reaches the tail it came from."""
    def tail(off, n):
        t = x_bcl[..., off + max(n - width, 0):off + n]
        return torch.nn.functional.pad(t, (width - t.shape[-1], 0)) if t.shape[-1] < width else t

    tails = torch.stack([tail(off, n) for _, n, off in frags[rank]])
    gathered = comm.all_gather(_padded(tails, frags), 0, group, stats, "conv_halo")
    ends = {start + n: (r, j) for r, fr in enumerate(frags) for j, (start, n, _) in enumerate(fr)}
    # every fragment's halo, then this rank's (see states_in: every rank runs the backward collective)
    every = torch.stack([gathered[ends[start]] if start and start not in resets else torch.zeros_like(tails[0])
                         for fr in frags for start, _, _ in fr])
    return list(_this_ranks(every, frags, rank))


def check_fragments(frags, width: int, where: str) -> None:
    """Every fragment must hold at least ``width`` tokens (the halo and the state come from one)."""
    short = min(n for fr in frags for _, n, _ in fr)
    if short < max(width, 1):
        raise ConfigError(f"ds_seqpar: {where} needs every rank's runs of consecutive tokens to be at least "
                          f"{max(width, 1)} long (the convolution halo and the state come from one neighbour), "
                          f"but this layout gives runs of {short} token(s); use a longer sequence, fewer ranks, "
                          f"or a contiguous / zigzag strategy")


__all__ = ["fragments", "cut_at_documents", "global_order", "apply_map", "states_in", "halos", "check_fragments"]
