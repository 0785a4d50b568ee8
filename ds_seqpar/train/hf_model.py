"""``--model PATH``: the main job trains a local Hugging Face causal LM instead of its own.

The trainer calls ``engine(input_ids, position_ids, labels=labels)`` for the loss, as for the own
LM; ``HFCausalLM`` is the thin adapter that makes a transformers model answer that call (its
positional signature is (input_ids, attention_mask, position_ids, ...), so the ids are passed by
name). Everything that can be refused is refused before weights are loaded, on every rank alike.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn as nn

from ..loss import sequence_loss
from .args import TrainConfigError


class HFCausalLM(nn.Module):
    """``forward(input_ids [B, L], position_ids [B, L], cu_seqlens=None) -> logits [B, L, V]``, as models.CausalLM;
    with ``labels`` the loss instead: sp.loss, or the fused tiled head + loss when
    sequence_parallel.tiled_loss_tokens > 0 (the model then computes one token's logits only)."""

    def __init__(self, model: nn.Module, path: str, loaded_weights: bool, sp=None):
        super().__init__()
        self.model, self.sp = model, sp
        self.cfg = HFModelInfo(model.config, path, loaded_weights)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                **inputs: torch.Tensor) -> torch.Tensor:
        """``inputs``: a vision-language model's vision inputs and token types (--images, images.py)."""
        if labels is None or self.sp is None or not self.sp.config.tiled_loss_tokens:
            docs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}      # packed documents (--lengths)
            logits = self.model(input_ids=input_ids, position_ids=position_ids, **docs, **inputs).logits
            return logits if labels is None else (self.sp.loss(logits, labels) if self.sp else sequence_loss(
                logits, labels))
        # the decoder's last (normed) hidden states, through the model's own call and hooks
        out = self.model(input_ids=input_ids, position_ids=position_ids, output_hidden_states=True, logits_to_keep=1,
                         **inputs)
        return self.sp.loss_from_hidden(out.hidden_states[-1], self.model.get_output_embeddings(), labels)

    def num_params(self) -> int:
        # ZeRO-3 leaves each rank a slice; ds_numel is the full size
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.parameters())


class HFModelInfo:
    """What run.json and wandb record about the model."""

    KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "tie_word_embeddings")

    def __init__(self, config, path: str, loaded_weights: bool):
        self.config, self.path, self.loaded_weights = config, path, loaded_weights

    def as_dict(self) -> dict:
        info = {k: getattr(self.config, k, None) for k in self.KEYS}
        return dict(info, hf_model=self.path, weights="pretrained" if self.loaded_weights else "random init",
                    architecture=type(self.config).__name__)


def check_options(opts, strategy: str) -> None:
    """Options that do not go with --model; checked before anything starts."""
    if strategy == "lasp":
        raise TrainConfigError(f"--model {opts.model!r} with sequence_parallel.strategy='lasp': Hugging Face models "
                               f"use softmax attention, which lasp does not compute; choose ulysses, ring, zigzag "
                               f"or striped (ulysses_size > 1 for the 2D hybrid)")
    if opts.attention == "linear":
        raise TrainConfigError(f"--attention=linear does not go with --model {opts.model!r} (softmax attention)")


def load_config(opts):
    from ..hf.model_io import load_config as load
    return load(opts.model)


def check_run(sp, opts, config, vocab_size: int) -> None:
    """Model features against the strategy and sequence (hf/checks.py), and the data's vocabulary."""
    from ..hf.checks import check_config, text_config
    from ..hf.linear.families import HYBRID_MODEL_TYPES
    hybrid = getattr(text_config(config), "model_type", None) in HYBRID_MODEL_TYPES
    vision = is_vision_language(config)       # its decoder alone turns sequence-parallel (hf/vision.py)
    check_config(config, training=True, linear_ok=hybrid, vision_ok=vision)   # heads: main.check_run
    if opts.images and not vision:
        raise TrainConfigError(f"--images={opts.images} with --model {opts.model!r}: "
                               f"{getattr(config, 'model_type', '?')} is not a vision-language model; use --images 0")
    model_vocab = getattr(text_config(config), "vocab_size", None)
    if model_vocab is None or model_vocab < vocab_size:
        raise TrainConfigError(f"--model {opts.model!r} has vocab_size={model_vocab}, smaller than the training "
                               f"data's vocabulary ({vocab_size} token ids); use a model with vocab_size >= "
                               f"{vocab_size} or a token file (--data) with ids below {model_vocab}")


def is_vision_language(config) -> bool:
    """A multimodal config whose language model is built from its text sub-config."""
    from ..hf.model_io import auto_class
    from transformers import AutoModelForImageTextToText
    return auto_class(config) is AutoModelForImageTextToText or (
        hasattr(config, "get_text_config") and config.get_text_config(decoder=True) is not config
        and bool(getattr(config, "vision_config", None)))


def build(opts, config, sp=None) -> HFCausalLM:
    """The model in training mode; with ``sp``, its attention and loss sequence-parallel.
    Random init (no weights at the path) draws from torch's current seed: the caller seeds it."""
    from ..hf import apply_sequence_parallel
    from ..hf.model_io import load_causal_lm
    model, loaded = load_causal_lm(opts.model, torch.float32, config=config)
    model.train()
    if sp is not None:
        apply_sequence_parallel(model, sp)
        if sp.config.tiled_loss_tokens and "logits_to_keep" not in inspect.signature(model.forward).parameters:
            raise TrainConfigError(f"sequence_parallel.tiled_loss_tokens={sp.config.tiled_loss_tokens} with --model "
                                   f"{opts.model!r}: {type(model).__name__}.forward takes no logits_to_keep, so it "
                                   f"would compute every token's logits anyway; set tiled_loss_tokens to 0")
    return HFCausalLM(model, opts.model, loaded, sp)


__all__ = ["HFCausalLM", "build", "check_options", "check_run", "is_vision_language", "load_config"]
