"""The training loss's collective as an opaque, differentiable node: ``ds_seqpar::all_reduce_sum`` (out
of place, identity backward: comm.all_reduce_sum's contract). Its body runs eagerly, so CommStats
count the loss's bytes and calls under torch.compile as in eager runs, and the compiler keeps no
guard on the counters (a traced ``stats.record`` would guard on their values and recompile every step).
The process group and the CommStats enter by handle (registry.py)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import comm
from .registry import handle, key_of, resolve

_NO_STATS = ""


@torch.library.custom_op("ds_seqpar::all_reduce_sum", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def all_reduce_sum_op(x: Tensor, group: str, stats: str, kind: str) -> Tensor:
    return comm.all_reduce(x.clone(), resolve(group), resolve(stats) if stats != _NO_STATS else None, "sum", kind)


@all_reduce_sum_op.register_fake
def _fake(x, group, stats, kind):
    return torch.empty_like(x)


def _backward(ctx, grad):
    # every rank back-propagates the same upstream gradient of the replicated sum: identity (loss.py)
    return grad, None, None, None


all_reduce_sum_op.register_autograd(_backward)


def all_reduce_sum(x: Tensor, group, stats: Optional[comm.CommStats] = None, kind: str = "all_reduce") -> Tensor:
    """comm.all_reduce_sum as the op above."""
    if torch.compiler.is_compiling():
        # handle() writes a weak dictionary, which tracing cannot follow; the key is registered by
        # SequenceParallel (its group and stats) or by an earlier eager call
        handles = key_of(group), _NO_STATS if stats is None else key_of(stats)
    else:
        handles = handle(group), _NO_STATS if stats is None else handle(stats)
    return all_reduce_sum_op(x, *handles, kind)


__all__ = ["all_reduce_sum"]
