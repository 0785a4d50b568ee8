"""Long-context memory features: fused tiled LM head + loss, sequence-tiled MLP, activation
checkpointing of every decoder layer with the checkpoints optionally in host memory.

    from ds_seqpar.memory import MemoryConfig, apply_memory_features
    memory = MemoryConfig.from_ds_config(ds_config)        # before any communication
    apply_memory_features(model, memory)                   # the project's LM or a Hugging Face model
    loss = sp.loss_from_hidden(hidden, model.lm_head, labels)   # the tiled loss
"""
from __future__ import annotations

from typing import Dict, List

import torch.nn as nn

from .checkpointing import attach_offload, checkpoint_layer, enable_checkpointing, offload_saved_tensors
from .config import ActivationCheckpointingConfig, MemoryConfig
from .tiled_loss import fused_loss_sum, sequence_loss_from_hidden
from .tiled_mlp import TiledMLP, tile_mlp, tile_mlps, untile_mlp


def apply_memory_features(model: nn.Module, memory: MemoryConfig, mlp_attr: str = "mlp") -> Dict[str, List[str]]:
    """Tile every decoder layer's MLP, checkpoint every decoder layer and keep the checkpoints on the
    host, as ``memory`` says (the tiled loss is the loss call's business: sp.loss_from_hidden).
    Returns what was done, for the run's log."""
    done: Dict[str, List[str]] = {}
    if memory.tiled_mlp_tokens:
        done["tiled_mlp"] = tile_mlps(model, memory.tiled_mlp_tokens, mlp_attr)
    if memory.checkpointing:
        enable_checkpointing(model)
        done["checkpointing"] = [type(model).__name__]
    if memory.cpu_checkpointing:
        # the decoder stack: a Hugging Face model's base model (callers of the fused loss call it
        # directly for hidden states), the whole model otherwise
        stack = getattr(model, "base_model", model)
        attach_offload(stack)
        done["cpu_checkpointing"] = [type(stack).__name__]
    return done


__all__ = ["MemoryConfig", "ActivationCheckpointingConfig", "apply_memory_features", "checkpoint_layer",
           "enable_checkpointing", "attach_offload", "offload_saved_tensors", "fused_loss_sum",
           "sequence_loss_from_hidden", "TiledMLP", "tile_mlp", "tile_mlps", "untile_mlp"]
