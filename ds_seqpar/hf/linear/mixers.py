"""LinearMixers: the sequence-parallel ops of one applied (sp, model) pair. Everything about ranks
comes from ``sp.linear_exchange`` (strategies/linear_exchange.py), which SequenceParallel resolved once
from linear_strategy and lasp_comm; the families (conv, delta_rule, ssd, selective_scan, lightning) only cut
their problem into the runs it names and hand their maps to it."""
from __future__ import annotations

import functools

import torch

from ...errors import UnsupportedModelError
from ...strategies.decode import gather_heads
from ...strategies.ulysses import kv_replication
from .conv import conv
from .delta_rule import delta_rule
from .families import LAYER_OPS, LIGHTNING
from .lightning import InstanceForward, decay, lightning, lightning_forward
from .seams import layer_hooks
from .selective_scan import selective_scan
from .ssd import ssd


class LinearMixers:
    def __init__(self, exchange_of, layers, dynamic_sizes=None):
        self._exchange_of = exchange_of     # () -> the running group's exchange (one per group size when dynamic)
        # with dynamic groups, every size a micro-batch may run on: ranks of different groups must refuse
        # alike, in the same (first) linear layer of the step, so none is left waiting in a collective
        self.dynamic_sizes = dynamic_sizes
        self.names = {id(m): f"{n} ({type(m).__name__})" for n, m in layers}
        # (name, class, layer_idx) of each layer: what generate's cache and refusals read (plain data: the state
        # that holds the mixers outlives the model's modules)
        self.layer_info = [(n, type(m).__name__, getattr(m, "layer_idx", None)) for n, m in layers]
        self.documents = None        # this forward's packed-document bounds (global cu_seqlens), set by the pre-hook
        self.prefill = None          # generate's prefill forward: prefill.PromptEnd (the ops return the final state)
        self.decoding = False        # generate's decode step: the layers run their own recurrent step (prefill.py)

    @property
    def exchange(self):
        return self._exchange_of()

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

    def selective_scan(self, original, call: dict, where: str):
        return selective_scan(self, original, call, where)

    def lightning(self, module, call: dict, where: str):
        return lightning(self, decay_h=decay(module), where=where, **call)

    def heads_parallel(self, local, tensors, where: str, unit: str = "heads", with_state: bool = False):
        """linear_strategy ulysses for a mixer whose tensors all have the heads on dim 2: whole
        sequences of this rank's head block, ``local(*tensors, heads slice)``, and back. ``with_state``
        (generate's prefill): ``local`` returns (out, final state [b, heads / P, ..]); returns (out, the
        state after the prompt's last token, every head's, on every rank). A tensor with
        fewer heads (groups: k heads under GQA, Mamba2's B/C groups) serves consecutive heads, as the
        ops' repeat_interleave has it; its groups are repeated just enough to split over the ranks,
        as Ulysses does for k/v heads, and autograd sums the copies' gradients back."""
        size, heads = self.exchange.size, max(t.shape[2] for t in tensors)
        odd = [t.shape[2] for t in tensors if heads % t.shape[2]]
        bad = [s for s in self.dynamic_sizes or (size,) if heads % s]
        if bad or odd:
            raise UnsupportedModelError(f"ds_seqpar.hf: {where} has {heads} {unit}"
                                        + (f" and inputs with {odd[0]} groups that do not divide them" if odd else
                                           f", not divisible by sequence_parallel.size={size}"
                                           if self.dynamic_sizes is None else
                                           f", not divisible by the group size {bad[0]} of sequence_parallel."
                                           f"size='dynamic' (group sizes {list(self.dynamic_sizes)})")
                                        + f": linear_strategy 'ulysses' splits the {unit} over ranks; use "
                                        f"linear_strategy 'lasp'")
        tensors = [t.repeat_interleave(kv_replication(heads, t.shape[2], size), dim=2) if t.shape[2] < heads else t
                   for t in tensors]
        whole, mine = self.exchange.whole_heads(tensors, heads)
        n = whole[0].shape[1]
        docs = [0, n] if self.documents is None else [int(d) for d in self.documents]
        if docs[-1] < n:                   # the layout's end padding: a run of its own, read by no target
            docs.append(n)
        # packed: each document from the zero state, whole on this rank
        runs = [local(*(t[:, a:b] for t in whole), mine) if (a, b) != (0, n) else local(*whole, mine)
                for a, b in zip(docs[:-1], docs[1:])]
        outs = [r[0] for r in runs] if with_state else runs
        out = self.exchange.back_to_tokens(outs[0] if len(outs) == 1 else torch.cat(outs, 1))
        if not with_state:
            return out
        state = runs[docs[1:].index(self.prefill.end)][1]     # the run ending with the prompt
        return out, gather_heads(state.float(), self.exchange.group, self.exchange.stats)


__all__ = ["LinearMixers"]
