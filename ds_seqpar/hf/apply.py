"""apply_sequence_parallel / remove_sequence_parallel: a transformers model onto ``sp.attention``
through the public AttentionInterface, and back.

Order of apply (everything that can fail does so before the model is touched, on every rank alike):
  1. refuse what cannot be exact (checks.py: config, module tree, heads against the strategy)
  2. register a new attention key bound to (sp, this model): several coexist in one process and
     no built-in key (sdpa, flash_attention_*) is overwritten
  3. set_attn_implementation(key), then verify it took: transformers only warns for models whose
     attention ignores the registry; a forward hook later checks every attention layer called it
  4. route the model's loss to sp.loss (loss.py) and install the forward hooks (hooks.py)
  5. hybrids: the linear layers' ops get their seams and each layer a pair of hooks (hf/linear/)
  6. DeepSeek sparse attention: each indexed layer a pre-hook giving it the global keys and mask (indexed.py)
  7. model.generate: transformers' loop over a sequence-sharded KV cache (generate.py, kv_cache.py)
Multimodal models (vision.py): steps 1-4 concern the decoder alone (the submodule built from the text
config); the towers keep their attention and run whole on every rank.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Dict, List, Optional

import torch.nn as nn

from ..dynamic import DynamicSequenceParallel
from . import batch_check, hooks
from . import generate as generation
from .attention import chunked_documents, is_chunked, make_attention_function
from .checks import UnsupportedModelError, check_config, check_heads, check_hybrid, check_modules
from .indexed import IndexedState, indexed_layers
from .indexed import install as install_indexed
from .linear.families import linear_modules
from .linear.mixers import LinearMixers
from .linear.seams import install_seams
from .loss import make_loss_function
from .versions import check_tested, check_upstream
from .vision import VisionLanguage

STATE_ATTR = "_ds_seqpar_hf"       # on the model: the SequenceParallelState while applied
_KEYS = itertools.count()


class SequenceParallelState:
    """What one applied (sp, model) pair shares between its attention function, loss and hooks.

    transformers keeps every registered function for the life of the process (there is no public
    unregister), and the function holds this state: so the layers are held by weak reference, and
    a finished model (with its optimizer's flat buffers behind its parameters) can be freed."""

    def __init__(self, sp, key: str, layers, previous_attn, previous_loss, linear_layers=(), vision=None,
                 indexed_layers=()):
        self.runner = sp                  # what was applied: a SequenceParallel or a DynamicSequenceParallel
        self.vision = vision              # a multimodal model's decoder and its whole-row inputs, or None
        self.indexed = IndexedState(indexed_layers) if indexed_layers else None     # DeepSeek sparse attention
        # hybrids' other layers, over the linear exchange sp resolved
        self.linear = LinearMixers(lambda: self.sp.linear_exchange, linear_layers,
                                   sp.sizes if self.dynamic else None) if linear_layers else None
        self.key = key
        self.names: Dict[int, str] = {id(m): f"{n} ({type(m).__name__})" for n, m in layers}
        self._layers = [(n, weakref.ref(m)) for n, m in layers]
        self.previous_attn = previous_attn
        self.previous_loss = previous_loss
        self.calls: set = set()           # attention layers that called the function in this forward
        self.chunked: dict = {}           # this forward's chunked documents (chunks), shared by its layers
        self.labels_given = False
        self.shift_labels_given = False
        self.loss_routed = False
        self.handles: List = []
        self.generation = None            # hf/generate.py's GenerationRun while model.generate runs

    @property
    def sp(self):
        """The SequenceParallel this forward runs on: the applied one, or with dynamic groups the one of
        the micro-batch running now (DynamicSequenceParallel.running: a handle on the runner, so two
        models or two steps never see each other's group); None once removed."""
        return self.runner.current if isinstance(self.runner, DynamicSequenceParallel) else self.runner

    @property
    def dynamic(self) -> bool:
        return isinstance(self.runner, DynamicSequenceParallel)

    @property
    def layers(self):
        """(name, module) of the attention layers that are still alive."""
        return [(n, ref()) for n, ref in self._layers if ref() is not None]

    def layer_name(self, module) -> str:
        return self.names.get(id(module), type(module).__name__)

    def chunks(self, module, cu_seqlens, real_len: int):
        """The documents ``module`` attends within: its chunks (Llama 4's chunked layers) built once per
        forward, so that every chunked layer passes the same object and sp finds their mask; else
        ``cu_seqlens``."""
        if not is_chunked(module):
            return cu_seqlens
        key = (id(cu_seqlens), real_len)
        if key not in self.chunked:
            self.chunked[key] = chunked_documents(module, cu_seqlens, real_len)
        return self.chunked[key]


def apply_sequence_parallel(model: nn.Module, sp) -> nn.Module:
    """Make every attention layer of ``model`` (a transformers PreTrainedModel) call ``sp.attention``;
    returns the same object. Use ``sp.shard_batch`` batches and pass their ``position_ids``."""
    from transformers import AttentionInterface
    check_tested(("transformers", "trl", "accelerate"))
    check_upstream(model)
    if getattr(model, STATE_ATTR, None) is not None:
        raise UnsupportedModelError(f"ds_seqpar.hf: {type(model).__name__} already has sequence parallelism "
                                    f"applied; call remove_sequence_parallel(model) first")
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise UnsupportedModelError(f"ds_seqpar.hf: {type(model).__name__} is not a transformers PreTrainedModel")
    # 1. refusals (pure, identical on every rank); a multimodal model's decoder alone
    vision = VisionLanguage.of(model)
    decoder = vision.decoder if vision is not None else model
    linear = linear_modules(decoder)
    check_config(model.config, linear_ok=bool(linear), vision_ok=vision is not None)
    layers = check_modules(decoder)
    indexed = indexed_layers(decoder, layers)
    check_hybrid(model, sp.config, linear)
    for member in _static_configs(sp):
        check_heads(model.config, member)
    # 2. a key of our own; no "flash" (transformers would load a flash kernel) and no "/" (a hub kernel)
    key = f"ds_seqpar_sp{next(_KEYS)}"
    state = SequenceParallelState(sp, key, layers, _implementations(model, vision), model.loss_function, linear,
                                  vision, indexed)
    AttentionInterface.register(key, make_attention_function(state))
    # 3. switch (the decoder only: the towers keep theirs) and verify
    model.set_attn_implementation(key if vision is None else {"": key, vision.text_sub_config(): key})
    _verify_switch(model, decoder, key, state)
    # 4. loss and hooks
    model.loss_function = make_loss_function(state)
    state.handles = hooks.install(model, state)
    batch_check.register(state)
    if linear:
        install_seams(linear)
        state.handles += state.linear.hooks(linear)
    state.handles += install_indexed(indexed, state)
    generation.install(model, state)
    setattr(model, STATE_ATTR, state)
    return model


def remove_sequence_parallel(model: nn.Module) -> nn.Module:
    """The original attention and loss back (for eval on one process, generate); same object."""
    state: Optional[SequenceParallelState] = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"ds_seqpar.hf: {type(model).__name__} has no sequence parallelism applied")
    for h in state.handles:
        h.remove()
    model.set_attn_implementation(state.previous_attn)
    model.loss_function = state.previous_loss
    state.runner = None         # the registered function now refuses to run (transformers has no unregister)
    state.previous_loss = None
    generation.restore(model)
    setattr(model, STATE_ATTR, None)
    return model


def _static_configs(sp):
    """The fixed-size configs ``sp`` runs with: its own, or every group size's of a dynamic runner."""
    if isinstance(sp, DynamicSequenceParallel):
        return [member.config for member in sp.by_size.values()]
    return [sp.config]


def _implementations(model, vision):
    """What set_attn_implementation restores: one key, or the top's and the decoder's (multimodal)."""
    if vision is None:
        return model.config._attn_implementation
    sub = vision.text_sub_config()
    if sub is None:
        raise UnsupportedModelError(f"ds_seqpar.hf: {type(model).__name__}'s decoder config is not one of its "
                                    f"sub-configs {list(getattr(model.config, 'sub_configs', {}))}, so its attention "
                                    f"cannot be switched alone; apply to the text model alone")
    return {"": model.config._attn_implementation, sub: vision.decoder.config._attn_implementation}


def _verify_switch(model, decoder, key: str, state: SequenceParallelState) -> None:
    """Every (sub)model config of the decoder must now name the key; otherwise undo and refuse."""
    stale = [type(m).__name__ for m in [model, *decoder.modules()]
             if hasattr(m, "config") and hasattr(m, "set_attn_implementation")
             and getattr(m.config, "_attn_implementation", key) != key]
    if stale:
        if model.config._attn_implementation == key:
            model.set_attn_implementation(state.previous_attn)
        state.runner = None
        raise UnsupportedModelError(f"ds_seqpar.hf: {', '.join(sorted(set(stale)))} kept attention "
                                    f"implementation {state.previous_attn!r}: its attention does not go through "
                                    f"transformers' AttentionInterface, so sequence parallelism cannot be applied")


__all__ = ["apply_sequence_parallel", "remove_sequence_parallel", "SequenceParallelState"]
