"""The mask seam: the running batch's masks, their plans and the documents agreed across the ranks, owned by
one object, ``sp.masks`` (a SequenceParallel builds one). ops/ and shard_batch call it; nothing else keeps a
mask, a plan or an agreed boundary.

When a mask is built, and how long it lives:

1. ``sp.shard_batch`` checks a packed batch's documents across the sequence group (one small all-reduce,
   agreement.py) and tells the seam (``agreed``): the cu_seqlens tensor it returns is then known as agreed.
2. The first attention call of a batch with those documents and a new call (shape, causality, real length,
   window, bidirectional blocks) builds the layer's Mask (masks.py): the documents checked against the shard
   shape (the all-reduce only if nothing agreed them yet), the blocks against the documents (one all-reduce),
   then ``Mask.from_boundaries``. Every later layer, forward and backward, finds it by one lookup (``mask``).
3. The strategy's plan of a mask (strategies/mask_plan.py: MaskPlan) is built on the mask's first run and
   found by the mask's value and the padded length (``MaskPlans``): the other layers share it, and a later
   batch packed alike (a new tensor, the same boundaries) reuses it.
4. Each lives until KEEP newer ones of its kind push it out, the oldest first (the size policy below); a mask
   also goes with its documents entry (pushed out, or replaced: an in-place write is new documents).

Why cu_seqlens' identity is the key. Under torch.compile the cu_seqlens tensor is an input of the opaque
op, not a constant (ops/attention.py): the compiler never sees its values, so a new packing is new data,
not a new graph, and the op's body must find the batch's masks at run time. Finding them by the tensor's
values would copy it to the host at every layer (a device sync per call); the tensor object is the batch's
documents instead: shard_batch returns one tensor that every layer is given and autograd saves for the
backward. An entry holds its tensor, so the id cannot be reused by another tensor while the entry lives,
and records its version counter: an in-place write is new documents (the values are never read to find
them). A list of ints is known by its values (the op receives a copy of the caller's list; a list is a
graph constant anyway); ``None`` (no documents) is one entry like the others.

The size policy: one constant, KEEP = 8, for each of the three maps: documents entries (the latest cu_seqlens
objects named), masks per documents entry, plans (by mask value and length); the oldest entry goes first.
One step uses few masks at once: a model's layer kinds (full beside sliding or chunked: Gemma 3, gpt-oss,
Llama 4) times its attention directions (a causal decoder beside a bidirectional encoder or blocked vision
tokens), the same ones forward and backward. Eight hold a step's with room for the batch before, so its later
layers find what its first layer built; more would only keep old batches' tensors alive. Oldest first, not
least recently used: a hit is then one dict lookup, which every layer's call makes (moving the entry on each
hit measured about 0.5 us more per call: reports/mask_seam_cpu.md), and what goes is never wrong, only rebuilt: a
documents entry agreed again (one all-reduce), a mask or a plan built again, identically on every rank
since every rank makes the same calls.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from ..masks import Mask, check_blocks
from .agreement import check_same_on_ranks
from .documents import Documents, as_boundaries, check_documents

KEEP = 8        # entries of each map the seam keeps (module doc: the size policy)


def _keep(entries: dict, key, value):
    """``entries[key] = value`` as the newest entry (dicts keep insertion order), the oldest out past KEEP."""
    entries.pop(key, None)                  # a replaced entry (new documents at the same key) is new
    entries[key] = value
    if len(entries) > KEEP:
        del entries[next(iter(entries))]
    return value


class BatchDocuments:
    """One documents object of the running batch: its boundaries once agreed across the ranks, and
    the masks built on them so far."""

    def __init__(self, cu_seqlens):
        self.cu = cu_seqlens
        self.version = cu_seqlens._version if isinstance(cu_seqlens, torch.Tensor) else None
        self.bounds: Optional[Tuple[int, ...]] = None
        # (batch, local tokens, causal, real length, window, blocks) -> Mask
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


class MaskPlans:
    """A strategy's plans by (mask, padded length), KEEP of them (module doc). The seam's instance goes to the
    strategy in its context (StrategyContext.plans); one SequenceParallel runs one strategy, whose layout and
    blocks make the plan, so the key needs no more."""

    def __init__(self):
        self._plans: dict = {}

    def get(self, mask: Mask, padded: int, build: Callable[[Mask, int], object]):
        """The plan of ``mask`` over ``padded`` tokens: ``build(mask, padded)`` on the first call only."""
        key = (mask, padded)
        plan = self._plans.get(key)
        return plan if plan is not None else _keep(self._plans, key, build(mask, padded))


class BatchMasks:
    """``sp.masks``: the masks of the running batch, their plans, its agreed documents (module doc).

    ``group``, ``stats``: the sequence group the checks agree over and the CommStats they count in; ``size``:
    its ranks (a shard of n tokens is n * size global ones); ``multiple``: what the layout splits a length by."""

    def __init__(self, group, stats, size: int, multiple: int):
        self.group, self.stats, self.size, self.multiple = group, stats, size, multiple
        self._docs: Dict[object, BatchDocuments] = {}
        self.plans = MaskPlans()

    # -- what ops/ and shard_batch call ---------------------------------------------------------------
    def mask(self, q: torch.Tensor, causal: bool, seq_len: Optional[int], cu_seqlens, window: Optional[int],
             blocks: Optional[tuple] = None) -> Mask:
        """The Mask of an attention call on shards shaped like ``q`` (ops/attention.py); ``blocks``: flat
        (s0, e0, s1, ...). Built and checked on the batch's first call of its kind, then found."""
        docs = self.documents(cu_seqlens)
        key = (q.shape[0], q.shape[1], bool(causal), seq_len, window, blocks)
        mask = docs.masks.get(key)
        if mask is None:
            bounds = None if cu_seqlens is None else self._check_documents(docs, cu_seqlens, q, seq_len)
            pairs = None if not blocks else self._check_blocks(blocks, bounds, bool(causal), q, seq_len)
            mask = _keep(docs.masks, key, Mask.from_boundaries(bounds, bool(causal), window, seq_len, pairs))
        return mask

    def linear_documents(self, cu_seqlens, q: torch.Tensor) -> Documents:
        """The checked documents linear attention's state restarts at, for shards shaped like ``q`` (ops/linear.py)."""
        bounds = self._check_documents(self.documents(cu_seqlens), cu_seqlens, q, None)
        return Documents(bounds, q.shape[1] * self.size)

    def agreed(self, cu_seqlens: torch.Tensor, bounds) -> None:
        """shard_batch checked ``cu_seqlens`` across the ranks: attention skips the all-reduce for it."""
        self.documents(cu_seqlens).agree(bounds)

    # -- the memo ---------------------------------------------------------------------------------------
    def documents(self, cu_seqlens) -> BatchDocuments:
        """The entry of ``cu_seqlens``, new (nothing agreed, no masks) unless it still holds it."""
        key = _key(cu_seqlens)
        docs = self._docs.get(key)
        if docs is None or not docs.holds(cu_seqlens):
            docs = _keep(self._docs, key, BatchDocuments(cu_seqlens))
        return docs

    # -- the checks -------------------------------------------------------------------------------------
    def _check_documents(self, docs: BatchDocuments, cu_seqlens, q: torch.Tensor, seq_len: Optional[int]):
        """The boundaries of ``cu_seqlens`` checked against shards shaped like ``q``: local checks, then
        one small all-reduce that every rank joins (agreement.py) unless these documents were agreed
        already (shard_batch's tensor, or an earlier layer's call). ValueError naming cu_seqlens."""
        padded = q.shape[1] * self.size
        if docs.agreed:
            check_documents(docs.bounds, q.shape[0], padded, self.multiple, seq_len)
            return docs.bounds
        bounds, error = None, None
        try:
            bounds = as_boundaries(cu_seqlens)
            check_documents(bounds, q.shape[0], padded, self.multiple, seq_len)
        except ValueError as err:
            error = err
        check_same_on_ranks(bounds, error, self.group, self.stats, q.device)
        docs.agree(bounds)
        return bounds

    def _check_blocks(self, flat, bounds, causal: bool, q: torch.Tensor, seq_len: Optional[int]):
        """Bidirectional blocks checked against the documents (masks.check_blocks), then agreed across the
        ranks by one small all-reduce, as cu_seqlens: every rank raises, none waits in a later collective."""
        real = seq_len if seq_len is not None else q.shape[1] * self.size
        pairs, error = None, None
        try:
            pairs = check_blocks(list(zip(flat[::2], flat[1::2])), bounds or (0, real), causal)
        except ValueError as err:
            error = err
        check_same_on_ranks(None if pairs is None else [x for p in pairs for x in p], error, self.group,
                            self.stats, q.device, name="blocks",
                            holds="the bidirectional blocks' global (start, end) pairs")
        return pairs


def _key(cu_seqlens):
    """A tensor's identity; a list's values (a malformed one by identity: its check will say why)."""
    if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor):
        return id(cu_seqlens)
    try:
        return as_boundaries(cu_seqlens)
    except ValueError:
        return id(cu_seqlens)


__all__ = ["KEEP", "BatchDocuments", "BatchMasks", "MaskPlans"]
