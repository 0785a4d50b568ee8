"""LinearMixers: the sequence-parallel ops of one applied (sp, model) pair. Everything about ranks
comes from ``sp.linear_exchange`` (strategies/state_passing.py), which SequenceParallel resolved once
from linear_strategy and lasp_comm; the families (conv, delta_rule, ssd, lightning) only cut their
problem into the runs it names and hand their maps to it."""
from __future__ import annotations

import functools

import torch

from ...errors import UnsupportedModelError
from .conv import conv
from .delta_rule import delta_rule
from .families import LAYER_OPS, LIGHTNING
from .lightning import InstanceForward, lightning_forward
from .seams import layer_hooks
from .ssd import ssd


class LinearMixers:
    def __init__(self, exchange, layers):
        self.exchange = exchange
        self.names = {id(m): f"{n} ({type(m).__name__})" for n, m in layers}
        self.documents = None        # this forward's packed-document bounds (global cu_seqlens), set by the pre-hook

    def where(self, module) -> str:
        return self.names.get(id(module), type(module).__name__)

    def hooks(self, layers) -> list:
        handles = []
        for _, m in layers:
            if LIGHTNING in LAYER_OPS[type(m).__name__]:
                handles.append(InstanceForward(m, functools.partial(lightning_forward, self, m)))
            handles += layer_hooks(self, m)
        return handles

    def runs(self, local_len: int, width: int, where: str):
        """This forward's runs and document starts (LinearExchange.runs)."""
        return self.exchange.runs(local_len, width, where, self.documents)

    # -- what the seams call ---------------------------------------------------------------------

    def conv(self, original, call: dict):
        return conv(self, original, call)

    def delta_rule(self, original, call: dict, where: str):
        return delta_rule(self, original, call, where)

    def ssd(self, original, call: dict, where: str):
        return ssd(self, original, call, where)

    def heads_parallel(self, local, tensors, where: str):
        """linear_strategy ulysses for a mixer whose tensors all have the heads on dim 2: whole
        sequences of this rank's head block, ``local(*tensors, heads slice)``, and back."""
        size = self.exchange.size
        for t in tensors:
            if t.shape[2] % size:
                raise UnsupportedModelError(f"ds_seqpar.hf: {where} has {t.shape[2]} heads (or groups) in one of its "
                                            f"inputs, not divisible by sequence_parallel.size={size}: "
                                            f"linear_strategy 'ulysses' splits them over ranks; use linear_strategy "
                                            f"'lasp'")
        whole, mine = self.exchange.whole_heads(tensors)
        if self.documents is None:
            out = local(*whole, mine)
        else:                          # packed: each document from the zero state, whole on this rank
            docs = [int(d) for d in self.documents]
            out = torch.cat([local(*(t[:, a:b] for t in whole), mine) for a, b in zip(docs[:-1], docs[1:])], 1)
        return self.exchange.back_to_tokens(out)


__all__ = ["LinearMixers"]
