"""sp.attention as one opaque, differentiable node for torch.compile: ``ds_seqpar::attention`` (forward,
with its communication inside) and ``ds_seqpar::attention_backward``, registered with a fake (shapes
and dtypes only) and the autograd formula that joins them. Eager calls run the same two ops, so eager
and compiled runs execute the same code, and CommStats count inside them either way.

What is not a tensor enters as a plain argument: the SequenceParallel by handle (registry.py), causal,
scale, real length, window, softcap and the bidirectional blocks (a flat list of ints: a new list is a new
graph) as constants of the graph. Packed documents enter as the
cu_seqlens tensor, read on the host inside the op (the compiler never sees its values, so a new
packing is not a new graph), or as a list of ints (then constants: a new list is a new graph).

Strategy contract (strategies/base.py): forward -> (out, saved), backward -> (dq, dk, dv, dsinks),
fake -> (out, saved) shaped alike. Outputs are contiguous, as the fakes promise, and never alias
an input or each other (the op's rule): a saved tensor that is an input is cloned (Ulysses at size 1).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from ..sharding.documents import as_boundaries
from ..masks import flat_blocks
from .registry import resolve

UNSAFE_FOR_CUDA_GRAPHS = (torch.Tag.cudagraph_unsafe,)   # the body talks to other ranks and counts bytes


def _mask(sp, q, causal, seq_len, cu_seqlens, cu_list, window, blocks):
    """The call's Mask from the mask seam (sp.masks, sharding/batch_masks.py): built on the batch's first call."""
    return sp.masks.mask(q, causal, seq_len, cu_seqlens if cu_seqlens is not None else cu_list, window,
                         None if blocks is None else tuple(blocks))


def _outputs(tensors: Sequence[Tensor], inputs: Sequence[Optional[Tensor]]) -> List[Tensor]:
    """Contiguous, and no output sharing storage with an input or an earlier output."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel()}
    out = []
    for t in tensors:
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in taken:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        taken.add(ptr)
        out.append(t)
    return out


@torch.library.custom_op("ds_seqpar::attention", mutates_args=(), tags=UNSAFE_FOR_CUDA_GRAPHS)
def attention_op(q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], cu_seqlens: Optional[Tensor],
                 cu_list: Optional[List[int]], sp: str, causal: bool, scale: float, seq_len: Optional[int],
                 window: Optional[int], softcap: Optional[float], blocks: Optional[List[int]]) -> List[Tensor]:
    """[out, *saved]: this rank's attention output [b, n, H, dv] and what its backward needs."""
    owner = resolve(sp)
    mask = _mask(owner, q, causal, seq_len, cu_seqlens, cu_list, window, blocks)
    out, saved = owner.strategy.forward(q, k, v, mask, scale, softcap, sinks)
    return _outputs([out, *saved], (q, k, v, sinks))


@attention_op.register_fake
def _attention_fake(q, k, v, sinks, cu_seqlens, cu_list, sp, causal, scale, seq_len, window, softcap, blocks):
    out, saved = resolve(sp).strategy.fake(q, k, v, sinks)
    return [out, *saved]


@torch.library.custom_op("ds_seqpar::attention_backward", mutates_args=(), tags=UNSAFE_FOR_CUDA_GRAPHS)
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], out: Tensor,
                          saved: List[Tensor], cu_seqlens: Optional[Tensor], cu_list: Optional[List[int]], sp: str,
                          causal: bool, scale: float, seq_len: Optional[int], window: Optional[int],
                          softcap: Optional[float], blocks: Optional[List[int]]) -> List[Tensor]:
    """[dq, dk, dv] (+ [dsinks] with sinks)."""
    owner = resolve(sp)
    mask = _mask(owner, q, causal, seq_len, cu_seqlens, cu_list, window, blocks)
    dq, dk, dv, dsinks = owner.strategy.backward(dout, q, k, v, out, saved, mask, scale, softcap, sinks)
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    if sinks is not None:
        grads.append(dsinks.to(sinks.dtype))
    return _outputs(grads, (dout, q, k, v, sinks, out, *saved))


@attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, sinks, out, saved, *args):
    grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]
    return grads + ([sinks.new_empty(sinks.shape)] if sinks is not None else [])


def _setup(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens = inputs[:5]
    ctx.save_for_backward(q, k, v, sinks, cu_seqlens, *output)
    ctx.options = inputs[5:]                 # cu_list, sp, causal, scale, seq_len, window, softcap, blocks


def _backward(ctx, grads):
    q, k, v, sinks, cu_seqlens, out, *saved = ctx.saved_tensors
    cu_list, *options = ctx.options
    got = attention_backward_op(grads[0], q, k, v, sinks, out, saved, cu_seqlens, cu_list, *options)
    dsinks = got[3] if sinks is not None else None
    return (got[0], got[1], got[2], dsinks) + (None,) * 9


torch.library.register_autograd("ds_seqpar::attention", _backward, setup_context=_setup)


def attention(sp_handle: str, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], cu_seqlens, causal: bool,
              scale: float, seq_len: Optional[int], window: Optional[int], softcap: Optional[float],
              blocks=None) -> Tensor:
    """The op's output; ``cu_seqlens``: None, a 1-D integer tensor or a list of ints (validated inside);
    ``blocks``: None or (start, end) pairs, flattened here (checked inside)."""
    cu_tensor = cu_seqlens if isinstance(cu_seqlens, Tensor) else None
    cu_list = None if cu_seqlens is None or cu_tensor is not None else list(as_boundaries(cu_seqlens))
    return attention_op(q, k, v, sinks, cu_tensor, cu_list, sp_handle, causal, scale, seq_len, window, softcap,
                        flat_blocks(blocks))[0]


__all__ = ["attention", "attention_op", "attention_backward_op"]
