"""The masks of the batch being run, so that a model's layers share one: sp.attention finds a layer's
Mask (masks.py) by its documents and its call's (shape, causality, real length, window), and only the
first call of a batch with new documents checks them (shard_batch checked its own tensor already).

Documents are known by the object the calls pass (cu_seqlens: the tensor shard_batch returned, or a
list), held here: a tensor is the same documents while its version is unchanged (an in-place write
bumps it), a list while its values are. A few are kept, so models that alternate two (Llama 4's
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
        if cu_seqlens is not self.cu:
            return False
        if isinstance(cu_seqlens, torch.Tensor):
            return cu_seqlens._version == self.version
        return cu_seqlens is None or self.bounds is None or as_boundaries(cu_seqlens) == self.bounds

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
        key = id(cu_seqlens)
        docs = self._docs.get(key)
        if docs is None or not docs.holds(cu_seqlens):
            docs = self._docs[key] = BatchDocuments(cu_seqlens)
            if len(self._docs) > self.KEEP:
                self._docs.popitem(last=False)
        return docs


__all__ = ["BatchDocuments", "BatchMasks"]
