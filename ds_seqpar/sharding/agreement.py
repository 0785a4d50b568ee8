"""cu_seqlens must be the same on every rank of a sequence group (it is the GLOBAL document
boundaries): one small all-reduce tells every rank whether that holds, before any other transfer.

Each rank contributes [h, -h, bad] with h = fingerprint(its boundaries) (documents.py) and bad = 1 if
its own local checks failed; a MAX all-reduce then gives max(h) == -max(-h) iff every rank passed the
same boundaries, and max(bad) > 0 iff some rank's were invalid. A rank whose own check failed raises
its own message; the others raise one naming the argument, so no rank is left waiting in a later
collective. Three int64 per call (the comm kind "cu_seqlens_check" in CommStats).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .. import comm
from .documents import fingerprint

DOCUMENTS = ("the GLOBAL document boundaries [0, l1, l1+l2, ..., N] of the whole packed sequence (sp.shard_batch "
             "returns it so)")


def check_same_on_ranks(bounds: Optional[Sequence[int]], local_error: Optional[Exception], group, stats,
                        device, name: str = "cu_seqlens", holds: str = DOCUMENTS) -> None:
    """Raise ``local_error`` (every rank first joins the all-reduce), or a ValueError naming ``name``
    (what it ``holds``) when another rank's value was invalid or different from this one's."""
    h = fingerprint(bounds) if bounds is not None and local_error is None else 0
    vec = torch.tensor([h, -h, int(local_error is not None)], dtype=torch.int64, device=device)
    if comm.group_size(group) > 1:
        comm.all_reduce(vec, group, stats, op="max", kind="cu_seqlens_check")
    if local_error is not None:
        raise local_error
    top, neg_bottom, bad = (int(x) for x in vec.tolist())
    if bad:
        raise ValueError(f"{name} was invalid on another rank of the sequence group (its error is raised "
                         f"there); {name} must hold {holds}, the same on every rank")
    if top != -neg_bottom:
        raise ValueError(f"{name} differs across the ranks of the sequence group: it must hold {holds}, the "
                         f"same on every rank")


__all__ = ["check_same_on_ranks"]
