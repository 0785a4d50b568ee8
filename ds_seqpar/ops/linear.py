"""sp.linear_attention as one opaque, differentiable node: ``ds_seqpar::linear_attention`` (the LASP
forward with its state exchange inside) and ``ds_seqpar::linear_attention_backward``, with fakes and the
autograd formula (attention.py says why and how; the same rules hold here). The fixed decay gets no
gradient, as in eager."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ..sharding.documents import as_boundaries
from .attention import UNSAFE_FOR_CUDA_GRAPHS, _outputs
from .registry import resolve


def _documents(owner, q, cu_seqlens, cu_list):
    cu = cu_seqlens if cu_seqlens is not None else cu_list
    return None if cu is None else owner.masks.linear_documents(cu, q)     # sharding/batch_masks.py


@torch.library.custom_op("ds_seqpar::linear_attention", mutates_args=(), tags=UNSAFE_FOR_CUDA_GRAPHS)
def linear_attention_op(q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], cu_seqlens: Optional[Tensor],
                        cu_list: Optional[List[int]], sp: str) -> List[Tensor]:
    """[o, state_in]: this rank's output and the state entering its block (zeros where none does)."""
    owner = resolve(sp)
    o, saved = owner.strategy.linear_forward(q, k, v, decay, _documents(owner, q, cu_seqlens, cu_list))
    return _outputs([o, *saved], (q, k, v, decay))


@linear_attention_op.register_fake
def _linear_attention_fake(q, k, v, decay, cu_seqlens, cu_list, sp):
    o, saved = resolve(sp).strategy.linear_fake(q, k, v)
    return [o, *saved]


@torch.library.custom_op("ds_seqpar::linear_attention_backward", mutates_args=(), tags=UNSAFE_FOR_CUDA_GRAPHS)
def linear_attention_backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, saved: List[Tensor],
                                 decay: Optional[Tensor], cu_seqlens: Optional[Tensor],
                                 cu_list: Optional[List[int]], sp: str) -> List[Tensor]:
    """[dq, dk, dv]."""
    owner = resolve(sp)
    grads = owner.strategy.linear_backward(do, q, k, v, saved, decay, _documents(owner, q, cu_seqlens, cu_list))
    return _outputs([g.to(t.dtype) for g, t in zip(grads, (q, k, v))], (do, q, k, v, decay, *saved))


@linear_attention_backward_op.register_fake
def _linear_attention_backward_fake(do, q, k, v, saved, *args):
    return [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)]


def _setup(ctx, inputs, output):
    q, k, v, decay, cu_seqlens, cu_list, sp = inputs
    ctx.save_for_backward(q, k, v, decay, cu_seqlens, *output[1:])
    ctx.options = (cu_list, sp)


def _backward(ctx, grads):
    q, k, v, decay, cu_seqlens, *saved = ctx.saved_tensors
    cu_list, sp = ctx.options
    dq, dk, dv = linear_attention_backward_op(grads[0], q, k, v, saved, decay, cu_seqlens, cu_list, sp)
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd("ds_seqpar::linear_attention", _backward, setup_context=_setup)


def linear_attention(sp_handle: str, q: Tensor, k: Tensor, v: Tensor, decay: Optional[Tensor], cu_seqlens) -> Tensor:
    """The op's output; ``cu_seqlens`` as for attention."""
    cu_tensor = cu_seqlens if isinstance(cu_seqlens, Tensor) else None
    cu_list = None if cu_seqlens is None or cu_tensor is not None else list(as_boundaries(cu_seqlens))
    return linear_attention_op(q, k, v, decay, cu_tensor, cu_list, sp_handle)[0]


__all__ = ["linear_attention", "linear_attention_op", "linear_attention_backward_op"]
