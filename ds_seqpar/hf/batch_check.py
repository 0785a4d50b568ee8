"""The forward pre-hook's data-dependent checks (hooks.py) as one opaque op for torch.compile.

In eager mode the hook reads two group flags (an attention_mask zero somewhere, position_ids that are
not sp.shard_batch's global positions) and acts on them in Python. A compiled model cannot branch on
tensor values without a graph break, and a hook that computes anything becomes a graph of its own
(torch.compile(model) traces the hooks and the forward as separate frames). So under compile the hook
only hands the tensors on (the ``sp_batch_check`` keyword, which transformers passes through to the
attention function), and the first attention layer of the forward runs the same all-reduce and the
same checks inside ``ds_seqpar_hf::checked_query``: an op the compiler sees as query in -> query out
(a copy, identity gradient, so the check is never pruned), run eagerly at every call, raising exactly
where the eager hook refuses. One case the eager hook handles is refused here by name: packed rows
whose position_ids restart at 0 and come without cu_seqlens (the documents would have to become a
tensor of data-dependent length); sp.shard_batch's batch carries cu_seqlens and compiles.

Custom ops take tensors and plain values, so the applied state is found by its attention key
(apply.py) in a registry of weak references.
"""
import weakref
from typing import Optional

import torch

from .checks import UnsupportedModelError

KWARG = "sp_batch_check"
_STATES: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()   # key -> applied state


def register(state) -> None:
    _STATES[state.key] = state


def checked_query(query: torch.Tensor, check: tuple, key: str) -> torch.Tensor:
    """``query`` after the batch check (module doc); ``check`` = (position_ids, attention_mask, packed)."""
    position_ids, attention_mask, packed = check
    return torch.ops.ds_seqpar_hf.checked_query(query, position_ids, attention_mask, key, packed)


@torch.library.custom_op("ds_seqpar_hf::checked_query", mutates_args=())
def _checked_query(query: torch.Tensor, position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   key: str, packed: bool) -> torch.Tensor:
    from .hooks import check_right_padding, group_flags
    state = _STATES.get(key)
    if state is None or state.sp is None:
        raise RuntimeError(f"ds_seqpar.hf: a compiled model called attention key {key!r} after "
                           f"remove_sequence_parallel; compile the model again")
    zeros, restarts = group_flags(attention_mask, position_ids if packed else None, state.sp)
    if zeros:
        check_right_padding(attention_mask, state)
    if restarts:
        raise UnsupportedModelError("ds_seqpar.hf: packed documents given only by position_ids restarting at 0 "
                                    "(no cu_seqlens) cannot be compiled: the documents would be a tensor of "
                                    "data-dependent length; pass sp.shard_batch's batch, which carries cu_seqlens, "
                                    "or run this model without torch.compile")
    return query.clone()


@_checked_query.register_fake
def _(query, position_ids, attention_mask, key, packed):
    return torch.empty_like(query)


def _backward(ctx, grad):
    return grad, None, None, None, None


_checked_query.register_autograd(_backward)

__all__ = ["register", "checked_query"]
