"""DeepSpeed's own Ulysses (ALST) under ``ds-seqpar bench trainer`` on gloo ranks: the two gloo limits its
path meets (``gloo_errors``, quoted on the page) and the stand-in that lets it run anyway
(``gather_with_group_ranks``: the gradient its NCCL path computes)."""
from __future__ import annotations

import re
from typing import Dict, Optional


def gather_with_group_ranks():
    """On gloo, torch's differentiable all_gather (which transformers' ALST loss calls) goes backward
    through a scatter whose source is the group-local index passed as a global rank: every sequence
    group but the first raises (gloo_errors records it). Replaced, until trainer.run_case ends, by the same
    gradient its NCCL path computes (a reduce-scatter: all-reduce of the stacked gradients, own slice).
    Returns the original."""
    import torch
    import torch.distributed as dist
    functional = torch.distributed.nn.functional
    original = functional.all_gather

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, group, x):
            ctx.group = group
            out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
            dist.all_gather(out, x.contiguous(), group=group)
            return tuple(out)

        @staticmethod
        def backward(ctx, *grads):
            summed = torch.stack(grads).contiguous()
            dist.all_reduce(summed, group=ctx.group)
            return None, summed[dist.get_rank(ctx.group)]

    functional.all_gather = lambda tensor, group=dist.group.WORLD: Gather.apply(group, tensor)
    return original


def gloo_errors() -> Dict[str, Optional[str]]:
    """On every rank of 4: the two gloo limits DeepSpeed's path meets, by the calls it makes, in groups
    of 2 ranks: ALST's loader adapter all-gathers batches of each rank's own width (ulysses_sp.py,
    UlyssesSPDataLoaderAdapter.refill), and the ALST loss backward of torch's differentiable all_gather
    (transformers' deepspeed_sp_compute_loss). Each: None, or the error this rank raised."""
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (the differentiable collectives)
    from .. import comm
    from ..sequence_parallel import SequenceParallel
    sp = SequenceParallel({"strategy": "ulysses", "size": 2})
    out: Dict[str, Optional[str]] = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as err:                   # what the page quotes (less object addresses)
            out[key] = re.sub(r" at 0x[0-9a-f]+", "", f"{type(err).__name__}: {err}")

    widths = [32 + 2 * r for r in range(sp.size)]
    attempt("variable widths", lambda: dist.all_gather([torch.zeros(2, w, dtype=torch.long) for w in widths],
                                                       torch.zeros(2, widths[sp.rank], dtype=torch.long),
                                                       group=sp.group))
    x = torch.ones(1, requires_grad=True)
    attempt("loss backward", lambda: torch.stack(torch.distributed.nn.functional.all_gather(x, group=sp.group))
            .sum().backward())
    comm.barrier()
    return out


__all__ = ["gather_with_group_ranks", "gloo_errors"]
