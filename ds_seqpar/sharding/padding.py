"""Any sequence length: pad at the end to what the layout needs, and say which keys are real.

Padding goes after the last real token (global positions N .. N'-1). Two facts make that exact:

* causal attention (softmax or linear): a real query t < N only sees keys s <= t < N, so the
  pads are invisible to it without any mask; pad queries compute finite values nobody reads
  (their labels are ignore_index, so their gradient is zero);
* in every layout (contiguous, zigzag, striped, and the hybrid's contiguous pieces of those) the
  pad tokens a rank holds are a *suffix* of its local order, so for non-causal attention the real
  keys of any block are a prefix: masking is slicing keys [:valid], never a mask tensor.

Pure arithmetic; unit-tested without processes.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from .layouts import Layout


def padded_len(layout: Layout, seq_len: int) -> int:
    """Smallest length >= seq_len that the layout can split."""
    if seq_len < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_len}")
    m = layout.required_multiple
    return -(-seq_len // m) * m


def pad_to(x: torch.Tensor, dim: int, length: int, value=0) -> torch.Tensor:
    """``x`` with ``dim`` extended to ``length`` by ``value`` at the end (x itself if no pad)."""
    dim = dim % x.dim()
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    if missing < 0:
        raise ValueError(f"cannot pad dim {dim} of {tuple(x.shape)} down to {length}")
    pad = [0, 0] * (x.dim() - dim - 1) + [0, missing]
    if x.dtype == torch.bool:
        return F.pad(x.to(torch.uint8), pad, value=int(value)).bool()
    return F.pad(x, pad, value=value)


def continue_positions(pos_bn: torch.Tensor, length: int) -> torch.Tensor:
    """[B, N] position ids extended to ``length`` by counting on from each row's last (the pads continue the last
    document, or keep a row's offset from its global index: hf/batch_check.py reads both as they are)."""
    missing = length - pos_bn.shape[1]
    if missing <= 0:
        return pad_to(pos_bn, 1, length)
    more = pos_bn[:, -1:] + torch.arange(1, missing + 1, device=pos_bn.device, dtype=pos_bn.dtype)
    return torch.cat([pos_bn, more], dim=1)


def check_seq_len(seq_len: int, padded: int, multiple: int) -> None:
    """``seq_len`` must be what these padded shards were padded from."""
    if not padded - multiple < seq_len <= padded:
        raise ValueError(f"seq_len={seq_len} does not match the local shards: {padded} tokens in all "
                         f"(padded to a multiple of {multiple}), so seq_len must be in "
                         f"({padded - multiple}, {padded}]")


def valid_prefix(ring_layout: Layout, padded: int, seq_len: int) -> List[int]:
    """Per ring position, how many of its (ring-shard) tokens are real: a prefix, see module doc."""
    return [int((ring_layout.indices(padded, r) < seq_len).sum()) for r in range(ring_layout.size)]


def suffix_is_padding(layout: Layout, padded: int, seq_len: int) -> bool:
    """The module's claim, checkable for any layout: pads are a suffix of every local order."""
    for r in range(layout.size):
        real = layout.indices(padded, r) < seq_len
        if bool((real[1:] & ~real[:-1]).any()):       # a real token after a pad
            return False
    return True


__all__ = ["padded_len", "pad_to", "check_seq_len", "valid_prefix", "suffix_is_padding"]
