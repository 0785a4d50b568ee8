"""The masks of the batch being run, so that a model's layers share one: sp.attention finds a layer's
Mask (masks.py) by its documents and its call's (shape, causality, real length, window), and only the
first call of a batch with new documents checks them (shard_batch checked its own tensor already).

Documents are known by what the calls pass (cu_seqlens: the tensor shard_batch returned, or a list),
held here: a tensor by the object, the same documents while its version is unchanged (an in-place
write bumps it; its values are not read to find it); a list by its values (the opaque attention op,
ds_seqpar/ops, receives a copy of it). A few are kept, so models that alternate two (Llama 4's
chunked layers beside its full ones) find both; ``None`` (no documents) is one entry like the others.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional, Tuple

import torch

from ..masks import Mask
from .documents import as_boundaries


class BatchDocuments:
    """One documents object of the running batch: its boundaries once agreed across the ranks, and
    the masks built on them so far."""

    MASKS = 64          # distinct (shape, causal, real length, window) calls kept per documents

    def __init__(self, cu_seqlens):
        self.cu = cu_seqlens
        self.version = cu_seqlens._version if isinstance(cu_seqlens, torch.Tensor) else None
        self.bounds: Optional[Tuple[int, ...]] = None
        self.masks: Dict[tuple, Mask] = {}

    @property
    def agreed(self) -> bool:
        return self.bounds is not None

    def agree(self, bounds) -> None:
        self.bounds = tuple(bounds)

    def holds(self, cu_seqlens) -> bool:
        """Is ``cu_seqlens`` still these documents?"""
        if isinstance(cu_seqlens, torch.Tensor):
            return cu_seqlens is self.cu and cu_seqlens._version == self.version
        return True                     # None, or a list found by its values

    def remember(self, key: tuple, mask: Mask) -> Mask:
        if len(self.masks) >= self.MASKS:
            self.masks.clear()
        self.masks[key] = mask
        return mask


class BatchMasks:
    """The few documents objects the latest calls named (module doc)."""

    KEEP = 4

    def __init__(self):
        self._docs: "OrderedDict[int, BatchDocuments]" = OrderedDict()

    def documents(self, cu_seqlens) -> BatchDocuments:
        """The entry of ``cu_seqlens``, new (nothing agreed, no masks) unless it still holds it."""
        key = _key(cu_seqlens)
        docs = self._docs.get(key)
        if docs is None or not docs.holds(cu_seqlens):
            docs = self._docs[key] = BatchDocuments(cu_seqlens)
            if len(self._docs) > self.KEEP:
                self._docs.popitem(last=False)
        return docs


def _key(cu_seqlens):
    """A tensor's identity; a list's values (a malformed one by identity: its check will say why)."""
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return id(cu_seqlens)
    try:
        return as_boundaries(cu_seqlens)
    except ValueError:
        return id(cu_seqlens)


__all__ = ["BatchDocuments", "BatchMasks"]
