"""The collectives outside attention as opaque, differentiable nodes: ``ds_seqpar::all_reduce_sum`` (the
training loss's reduction; out of place, identity backward: comm.all_reduce_sum's contract) and
``ds_seqpar::all_gather`` (``sp.unshard``'s gather; its backward is ``ds_seqpar::reduce_scatter``, the
dual). Their bodies run eagerly, so CommStats count their bytes and calls under torch.compile as in
eager runs, and the compiler keeps no guard on the counters (a traced ``stats.record`` would guard on
their values and recompile every step); dynamo cannot trace the async collectives themselves. The
process group and the CommStats enter by handle (registry.py)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import comm
from .registry import handle, key_of, resolve

_NO_STATS = ""


@torch.library.custom_op("ds_seqpar::all_reduce_sum", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def all_reduce_sum_op(x: Tensor, group: str, stats: str, kind: str) -> Tensor:
    return comm.all_reduce(x.clone(), resolve(group), _stats(stats), "sum", kind)


@all_reduce_sum_op.register_fake
def _fake(x, group, stats, kind):
    return torch.empty_like(x)


def _backward(ctx, grad):
    # every rank back-propagates the same upstream gradient of the replicated sum: identity (loss.py)
    return grad, None, None, None


all_reduce_sum_op.register_autograd(_backward)


def all_reduce_sum(x: Tensor, group, stats: Optional[comm.CommStats] = None, kind: str = "all_reduce") -> Tensor:
    """comm.all_reduce_sum as the op above."""
    return all_reduce_sum_op(x, *_handles(group, stats), kind)


@torch.library.custom_op("ds_seqpar::all_gather", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def all_gather_op(x: Tensor, dim: int, group: str, stats: str, kind: str) -> Tensor:
    return _own(comm.all_gather_nograd(x, dim, resolve(group), _stats(stats), kind), x)


@all_gather_op.register_fake
def _gather_fake(x, dim, group, stats, kind):
    shape = list(x.shape)
    shape[dim] *= comm.group_size(resolve(group))
    return x.new_empty(shape)


@torch.library.custom_op("ds_seqpar::reduce_scatter", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def reduce_scatter_op(x: Tensor, dim: int, group: str, stats: str, kind: str) -> Tensor:
    return _own(comm.reduce_scatter(x.contiguous(), dim, resolve(group), _stats(stats), kind), x)


def _own(out: Tensor, x: Tensor) -> Tensor:
    """``out`` contiguous and not aliasing ``x`` (a custom op's output may not alias its input; at size 1 the
    collectives hand their input back): copied only then, not the gathered logits of every call."""
    out = out.contiguous()
    return out.clone() if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else out


@reduce_scatter_op.register_fake
def _scatter_fake(x, dim, group, stats, kind):
    shape = list(x.shape)
    shape[dim] //= comm.group_size(resolve(group))
    return x.new_empty(shape)


def _setup_gather(ctx, inputs, output):
    _, ctx.dim, ctx.group, ctx.stats, ctx.kind = inputs


def _gather_backward(ctx, grad):
    # every rank's copy of the gathered tensor contributed: sum them and keep this rank's slice
    return reduce_scatter_op(grad, ctx.dim, ctx.group, ctx.stats, ctx.kind), None, None, None, None


all_gather_op.register_autograd(_gather_backward, setup_context=_setup_gather)


def all_gather(x: Tensor, dim: int, group, stats: Optional[comm.CommStats] = None, kind: str = "all_gather") -> Tensor:
    """comm.all_gather (differentiable) as the op above."""
    return all_gather_op(x, dim, *_handles(group, stats), kind)


def _handles(group, stats) -> tuple:
    if torch.compiler.is_compiling():
        # handle() writes a weak dictionary, which tracing cannot follow; the key is registered by
        # SequenceParallel (its group and stats) or by an earlier eager call
        return key_of(group), _NO_STATS if stats is None else key_of(stats)
    return handle(group), _NO_STATS if stats is None else handle(stats)


def _stats(key: str) -> Optional[comm.CommStats]:
    return resolve(key) if key != _NO_STATS else None


__all__ = ["all_reduce_sum", "all_gather"]
