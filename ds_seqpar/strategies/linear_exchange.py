"""How the hybrids' recurrent token mixers cross ranks (the delta rule of GDN and KDA, Mamba2's scalar-decay
scan, lightning attention's fixed decay, the halo of a short causal convolution): ``LinearExchange``,
which SequenceParallel resolves once from ``linear_strategy`` and ``lasp_comm``, as it resolves the
attention strategy. The layers (hf/linear/) ask it for their runs, the states entering them, the
conv halo, or the heads all-to-all; they read no config and no layout themselves.

Every such mixer runs a block of tokens as an affine map of the state that enters it:

    S_out = A . S_in + B          (B = the block's zero-init final state, A = its transition)
    o     = o0 + Q~ . S_in        (o0 = zero-init output, Q~ = effective queries)

so a rank needs, for each of its fragments (lasp_chain.py: maximal runs of consecutive global
positions, cut at document starts; one per rank in the contiguous layout, two in zigzag), the state
entering it: the fold of the maps of every fragment before it in global order. The states go through
lasp_comm/, the exchanges the own LM's LASP uses (allgather: LASP-2, ring: LASP-1, allscan: All-Scan; one
file each, looked up by name).

linear_strategy "ulysses": all-to-all to whole sequences of a P-th of the heads, the layer's own op,
all-to-all back.

The convolution halo: a fragment's first K-1 outputs read the K-1 inputs before it, which the
previous fragment in global order holds. Every fragment's tail is all-gathered (autograd returns
the halo's gradient to its owner, added to its tail's gradient).

A fragment another one takes its halo from must be at least K-1 tokens long unless a document starts it
(the halo comes from one fragment); a striped layout (one-token fragments) is refused where the mixers
are set up, before any communication.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from .. import comm
from ..errors import ConfigError
from .lasp_chain import StateChain, cut_at_documents, fragments, global_order
from .lasp_comm import exchange_for
from .lasp_comm.common import FixedDecay, TravellingMaps


class LinearExchange:
    """This rank's side of the hybrids' linear layers: ``heads_parallel`` (linear_strategy ulysses)
    or the state exchange named by lasp_comm; ``ctx``: the strategy's context (groups, layout, stats)."""

    def __init__(self, linear_strategy: str, lasp_comm: str, ctx):
        self.heads_parallel = linear_strategy == "ulysses"
        self.lasp_comm = lasp_comm
        if not self.heads_parallel:
            exchange_for(lasp_comm)              # refused at set-up, before any layer communicates
        self.layout, self.size, self.rank = ctx.layout, ctx.sp_size, ctx.sp_rank
        self.group, self.stats = ctx.sp_group, ctx.stats
        self._runs = {}

    def runs(self, local_len: int, width: int, where: str, documents=None):
        """(this forward's runs: the layout's runs of consecutive tokens, cut at packed-document starts;
        the global positions where a document starts, where state and halo restart)."""
        n = local_len * self.size
        if n not in self._runs:                  # the layout's runs, per length (documents change per batch)
            self._runs[n] = fragments(self.layout, n)
        frags, resets = self._runs[n], frozenset()
        if documents is not None:
            docs = [int(b) for b in documents]
            frags, resets = cut_at_documents(frags, docs), frozenset(b for b in docs if 0 < b < n)
        check_fragments(frags, width, where, resets)
        return frags, resets

    def states_in(self, b_f: Tensor, frags, resets, a_f: Optional[Tensor] = None,
                  decay_h: Optional[Tensor] = None) -> Tensor:
        """The state entering each of this rank's fragments, [nf, *B's shape]; b_f [nf, .., K, V]
        (fp32); the transition: a_f [nf, .., K, K or 1] (data-dependent, differentiable) or the fixed
        decay_h [heads] (lambda^n, no gradient). Differentiable in b_f and a_f."""
        maps = TravellingMaps(a_f) if a_f is not None else FixedDecay(decay_h, b_f.dtype)
        exchange = exchange_for(self.lasp_comm)(StateChain(frags, resets), self.rank, self.group, self.stats,
                                                b_f[0], maps)
        return _EnteringStates.apply(b_f, a_f, exchange)

    def halos(self, x_bcl: Tensor, width: int, frags, resets) -> List[Tensor]:
        return halos(x_bcl, width, frags, self.rank, self.group, self.stats, resets)

    def whole_heads(self, tensors, heads: int):
        """linear_strategy ulysses: each [b, n, heads or groups, ..] tensor all-to-all'd to the whole
        sequence (global order) of this rank's block (the heads and each tensor's groups divide by P:
        the layer checked and repeated); returns (tensors, this rank's heads as a slice)."""
        n = tensors[0].shape[1] * self.size
        inverse = self.layout.inverse(n, tensors[0].device)
        mine = slice(self.rank * (heads // self.size), (self.rank + 1) * (heads // self.size))
        whole = [comm.all_to_all(t.contiguous(), 2, 1, self.group, self.stats, "linear_all_to_all")
                 for t in tensors]                    # [b, N, heads / P, ..] in the layout's order
        return [t.index_select(1, inverse) for t in whole], mine

    def back_to_tokens(self, out: Tensor) -> Tensor:
        """whole_heads' inverse for the op's output [b, N, heads / P, ..]."""
        perm = self.layout.permutation(out.shape[1], out.device)
        return comm.all_to_all(out.index_select(1, perm).contiguous(), 1, 2, self.group, self.stats,
                               "linear_all_to_all")


class _EnteringStates(torch.autograd.Function):
    """Thin: the exchange's forward phases over this rank's fragments in global order, its backward
    phases in reverse (a fed fragment's dS_in = G + A^T dS_out, dA = dS_out S_in^T)."""

    @staticmethod
    def forward(ctx, b_f, a_f, exchange):
        mine = exchange.chain.local(exchange.r)
        exchange.post({j: b_f[j] for j in mine if exchange.needs_local_state(j)})
        s_in = torch.zeros_like(b_f)
        for j in mine:
            s = exchange.state_in(j)
            if s is not None:
                s_in[j] = s
                exchange.pass_on(j, exchange.transition((exchange.r, j)).apply(s) + b_f[j])
        exchange.finish()
        ctx.save_for_backward(s_in)
        ctx.exchange, ctx.has_a = exchange, a_f is not None
        return s_in

    @staticmethod
    def backward(ctx, g_in):
        s_in, = ctx.saved_tensors
        exchange = ctx.exchange
        mine = exchange.chain.local(exchange.r)
        g_in = g_in.contiguous()
        exchange.post_dstate({j: g_in[j] for j in mine if exchange.fed(j)})
        db = torch.zeros_like(s_in)
        da = torch.zeros_like(exchange.maps.a_f) if ctx.has_a else None
        for j in reversed(mine):
            d_out = exchange.dstate_out(j)
            if d_out is not None:
                db[j] = d_out
                if da is not None:
                    da[j] = exchange.dmap(j, d_out, s_in[j])
        exchange.finish()
        return db, da, None


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
    # every fragment's halo, then this rank's: the output depends on the gathered tails on every rank
    # (also rank 0, whose own halo is zero), so every rank runs the all-gather's backward collective
    every = torch.stack([gathered[ends[start]] if start and start not in resets else torch.zeros_like(tails[0])
                         for fr in frags for start, _, _ in fr])
    first = sum(len(fr) for fr in frags[:rank])
    return list(every[first:first + len(frags[rank])])


def _padded(per_fragment: Tensor, frags) -> Tensor:
    """[1, most fragments any rank holds, ...]: all-gathered pieces must have one shape (zigzag at
    P=2 gives rank 1 one run, rank 0 two)."""
    most = max(len(fr) for fr in frags)
    extra = most - per_fragment.shape[0]
    if extra:
        per_fragment = torch.cat([per_fragment, per_fragment.new_zeros((extra,) + per_fragment.shape[1:])])
    return per_fragment.unsqueeze(0).contiguous()


def check_fragments(frags, width: int, where: str, resets=frozenset()) -> None:
    """A fragment whose tail is the next fragment's halo must hold at least ``width`` tokens (the halo
    comes from one fragment), unless a document starts it (position 0 or one of ``resets``: what
    lies before is the halo's zeros, which the short tail is padded with). Fragments a document
    start follows feed no halo, so short documents pack anywhere."""
    starts = {start for fr in frags for start, _, _ in fr}
    short = [n for fr in frags for start, n, _ in fr if n < max(width, 1) and start != 0 and start not in resets
             and start + n in starts and start + n not in resets]
    if short:
        short = min(short)
        raise ConfigError(f"ds_seqpar: {where} needs every run of consecutive tokens whose tail the next run's "
                          f"halo reads to be at least {max(width, 1)} long (the convolution halo comes from one "
                          f"neighbour), "
                          f"but this layout gives runs of {short} token(s); use a longer sequence, fewer ranks, "
                          f"or a contiguous / zigzag strategy")


__all__ = ["LinearExchange", "fragments", "cut_at_documents", "global_order", "halos", "check_fragments"]
