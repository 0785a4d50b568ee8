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

The flags and the right-padding check live here, shared by the eager hook and the op. Custom ops
take tensors and plain values, so the applied state is found by its attention key
(apply.py) in a registry of weak references.
"""
import weakref
from typing import Optional

import torch

from .. import comm
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

def group_flags(mask, position_ids, sp):
    """(some rank's mask has a zero, some rank's position_ids are not the global positions plus a constant per
    row): one all-reduce (max) of the mask flag and each row's largest and negated smallest offset of its
    position ids from the global token index, made on every call so the ranks' collectives always match.
    A constant offset per row (0: sp.shard_batch's positions; a left-padded row rotated to lead with its real
    tokens, as trl_rows.py does, keeps the plain model's positions) is exact as it is; anything else is packed
    documents restarting at 0 or an error (hooks.documents_from_positions)."""
    device = mask.device if mask is not None else sp.device
    rows = position_ids.shape[0] if position_ids is not None else 0
    flags = torch.zeros(1 + 2 * rows, dtype=torch.int64, device=device)
    if mask is not None and bool((mask == 0).any()):
        flags[0] = 1
    if position_ids is not None:
        index = sp.position_ids(position_ids.shape[1] * sp.size, device=position_ids.device)
        offset = position_ids.to(torch.int64) - index
        flags[1:1 + rows], flags[1 + rows:] = offset.amax(1), -offset.amin(1)
    flags = comm.all_reduce(flags, sp.group, op="max")
    restarts = bool((flags[1:1 + rows] != -flags[1 + rows:]).any()) if rows else False
    return bool(flags[0]), restarts


def check_right_padding(mask, state) -> None:
    """The gathered mask (the same on every rank) must be right padding of a causal model; refuse
    with the feature named otherwise."""
    full = state.sp.unshard(mask.to(torch.int32), dim=1)              # [b, padded] in global order
    inner = bool((full[:, 1:] > full[:, :-1]).any())                  # a one after a zero
    if inner:
        raise UnsupportedModelError("ds_seqpar.hf: an attention_mask with left or inner zeros (padding before real "
                                    "tokens) cannot be exact under sequence parallelism: transformers builds no "
                                    "mask for sequence-parallel attention; pad on the right, or pack the rows as "
                                    "documents (sp.shard_batch with position_ids restarting at 0)")
    non_causal = [n for n, m in state.layers if getattr(m, "is_causal", True) is False]
    if non_causal:
        raise UnsupportedModelError(f"ds_seqpar.hf: an attention_mask with zeros in a non-causal model (first: "
                                    f"{non_causal[0]}) cannot be exact under sequence parallelism: the pads would "
                                    f"be seen; trim the padding or pack documents")


__all__ = ["register", "checked_query", "group_flags", "check_right_padding"]
