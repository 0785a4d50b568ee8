"""What a strategy is given and what it offers.

A strategy sees only tensors, process groups, a local kernel and the comm helpers; it never reads
the config or the environment (``SequenceParallel`` resolves those and hands them over).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..comm import CommStats
from ..kernels import AttentionKernel
from ..sharding.batch_masks import MaskPlans
from ..sharding.layouts import Layout
from .decode import decode_attention


@dataclass
class StrategyContext:
    """Everything a strategy may use. Groups are process groups, used only through comm.py."""

    sp_group: Any                 # all ranks holding pieces of one sequence
    ulysses_group: Any            # all-to-all (head <-> sequence) partners; the sp group for Ulysses
    ring_group: Any               # ring neighbours; size 1 for Ulysses alone
    sp_size: int
    sp_rank: int
    ulysses_size: int
    ulysses_rank: int
    ring_size: int
    ring_rank: int
    kernel: AttentionKernel
    stats: CommStats
    layout: Layout                # the token layout SequenceParallel shards with (hybrid: its ring inside)
    overlap: bool = True
    lasp_comm: str = "allgather"
    # (local tokens, q heads, kv heads, head dim, element size) -> Ulysses head chunks (ulysses.py);
    # SequenceParallel gives the configured count or cost/chunks.py's "auto" price
    ulysses_chunks: Callable[[int, int, int, int, int], Any] = lambda *shape: 1
    # where the strategy keeps its MaskPlans: SequenceParallel gives its mask seam's (sp.masks.plans,
    # sharding/batch_masks.py); a strategy built alone keeps its own
    plans: MaskPlans = field(default_factory=MaskPlans)


class Strategy:
    """Base: one documented entry point per attention kind; unsupported kinds say what to use.

    Softmax attention is three plain functions, which ``ds_seqpar.ops`` registers as one opaque,
    differentiable node for torch.compile (and runs as it is in eager):

        forward(q, k, v, mask, scale, softcap, sinks)             -> (out, saved: [tensors])
        backward(dout, q, k, v, out, saved, mask, scale, softcap, sinks) -> (dq, dk, dv, dsinks or None)
        fake(q, k, v, sinks)                                      -> (out, saved) shapes and dtypes only

    ``mask``: the layer's masks.Mask over the global sequence (causal, window, packed documents,
    real length), validated; ``softcap``, ``sinks``: as sp.attention documents them, validated.
    ``saved`` never aliases q, k, v or out. Linear attention (lasp) has the same three, with the
    fixed decay and packed documents in place of the mask.
    """

    name = "base"
    layout_name = "contiguous"      # token layout across the ring dimension

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx

    def _not_softmax(self):
        return ValueError(f"sequence_parallel.strategy={self.name!r} computes linear attention; call "
                          f"sp.linear_attention(q, k, v, decay) or pick a softmax strategy "
                          f"(ulysses, ring, zigzag, striped)")

    def _not_linear(self):
        return ValueError(f"sequence_parallel.strategy={self.name!r} computes softmax attention; "
                          f"sp.linear_attention needs sequence_parallel.strategy='lasp'")

    def forward(self, q_bshd, k_bshd, v_bshd, mask, scale: float, softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None):
        raise self._not_softmax()

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, saved, mask, scale: float,
                 softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
        raise self._not_softmax()

    def fake(self, q_bshd, k_bshd, v_bshd, sinks: Optional[torch.Tensor] = None):
        raise self._not_softmax()

    def decode(self, q_bhd, k_bhmd, v_bhmd, key_pos, q_pos: int, scale: float, window: Optional[int] = None,
               softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, checks=None):
        """One decode step's attention against a sequence-sharded KV cache (decode.py): the query whole on
        every rank, this rank's cached keys at their global positions; the same for every softmax
        strategy, since the cache keeps each token on the rank its layout (or the share balance) gave it."""
        if self.name == "lasp":
            raise self._not_softmax()
        return decode_attention(self.ctx, q_bhd, k_bhmd, v_bhmd, key_pos, q_pos, scale, window, softcap, sinks,
                                checks)

    def linear_forward(self, q_bshd, k_bshd, v_bshd, decay: Optional[torch.Tensor], docs=None):
        raise self._not_linear()

    def linear_backward(self, do_bshd, q_bshd, k_bshd, v_bshd, saved, decay: Optional[torch.Tensor], docs=None):
        raise self._not_linear()

    def linear_fake(self, q_bshd, k_bshd, v_bshd):
        raise self._not_linear()
