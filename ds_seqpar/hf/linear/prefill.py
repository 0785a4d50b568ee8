"""model.generate of an applied hybrid: what its linear layers' ops do in the prefill and the decode steps.

Prefill (the prompt, sharded as in training): a layer given a cache asks its op for the final state
(``output_final_state`` / ``return_final_states`` / ``return_last_state``). The op runs through the layer's
configured linear exchange as in training, and the state it returns is the state after the last prompt
token, the same on every rank: under lasp the fragment ending at the prompt's end holds it (A . S_in + B,
fold.state_after) and one all-reduce gives it to every rank; under linear_strategy ulysses each rank ran
its heads over the whole prompt and one all-gather along the heads joins them. The layout's end padding
(a prompt length the layout does not split) is cut off as a document of its own, so no state runs over it.
The conv state (the prompt's last K inputs) is the cache's (hf/kv_cache.py: ReplicatedStateLayer).

Decode (one token, whole on every rank): the layer runs transformers' own recurrent step
(``causal_conv1d_update``, the op's recurrent form) on the replicated states, identically on every rank;
its hooks neither mark it running nor count its ops (seams.py), so no seam takes a sequence-parallel path.
"""
from __future__ import annotations

from typing import Optional

from ...errors import UnsupportedModelError
from .families import DECODES, family


class PromptEnd:
    """Set on the mixers for generate's prefill forward: the prompt's length (global tokens) and, where the
    layout pads it, the documents that cut the padding off: [0, prompt_len, padded_len]."""

    def __init__(self, prompt_len: int, padded_len: int):
        self.end = prompt_len
        self.documents = [0, prompt_len, padded_len] if padded_len > prompt_len else None


def wants_state(mixers, initial_state, asks_final, where: str, family: str = "") -> bool:
    """Whether this op call must also return the state the prompt leaves: generate's prefill asks for it (no
    initial state, a final state wanted). A state given in or asked for anywhere else (a cache in training)
    is refused, as before."""
    if initial_state is None and not asks_final:
        return False
    if mixers.prefill is not None and initial_state is None:
        return True
    raise UnsupportedModelError(f"ds_seqpar.hf: a recurrent state cache in {where}{family} cannot be exact under "
                                f"sequence parallelism; train with use_cache=False (model.generate of the applied "
                                f"model builds its own)")


def check_decodes(mixers, refuse) -> None:
    """generate decodes a hybrid's linear layers where their family's decode is verified exact (families.DECODES)
    and each has a cache slot (a layer_idx); ``refuse(feature, fix)`` raises (hf/generate.py: check_model)."""
    for where, cls, idx in mixers.layer_info:
        if cls not in DECODES:
            refuse(f"{family(cls)} layers ({where}; decoding them from the prefill's states is not verified)",
                   "remove_sequence_parallel(model) and generate on one process")
        if not isinstance(idx, int):
            refuse(f"a linear layer without a layer_idx ({where})", "generate on one process")


def prefill_end(mixers, final: bool) -> Optional[int]:
    """The prompt's end when the op call returns the final state (fold's ``end``), else None."""
    return mixers.prefill.end if final else None


__all__ = ["PromptEnd", "wants_state", "check_decodes", "prefill_end"]
