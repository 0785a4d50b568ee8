"""What a strategy is given and what it offers.

A strategy sees only tensors, process groups, a local kernel and the comm helpers; it never reads
the config or the environment (``SequenceParallel`` resolves those and hands them over).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..comm import CommStats
from ..kernels import AttentionKernel
from ..sharding.layouts import Layout


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


class Strategy:
    """Base: one documented entry point per attention kind; unsupported kinds say what to use."""

    name = "base"
    layout_name = "contiguous"      # token layout across the ring dimension

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx

    def attention(self, q_bshd: torch.Tensor, k_bshd: torch.Tensor, v_bshd: torch.Tensor, mask,
                  scale: float, softcap: Optional[float] = None,
                  sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``mask``: the layer's masks.Mask over the global sequence (causal, window, packed documents,
        real length), validated; ``softcap``, ``sinks``: as sp.attention documents them, validated."""
        raise ValueError(f"sequence_parallel.strategy={self.name!r} computes linear attention; call "
                         f"sp.linear_attention(q, k, v, decay) or pick a softmax strategy "
                         f"(ulysses, ring, zigzag, striped)")

    def linear_attention(self, q_bshd, k_bshd, v_bshd, decay: Optional[torch.Tensor], docs=None) -> torch.Tensor:
        raise ValueError(f"sequence_parallel.strategy={self.name!r} computes softmax attention; "
                         f"sp.linear_attention needs sequence_parallel.strategy='lasp'")
