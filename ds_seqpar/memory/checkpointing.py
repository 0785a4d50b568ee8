"""Activation checkpointing of every decoder layer, with the checkpoints optionally in host memory.

``checkpoint_layer(layer, *args)`` is torch's non-reentrant checkpoint: the forward keeps only the
layer's inputs (the residual stream, layers x hidden values per token: the floor of a step's
activation memory); the backward runs the layer's forward again, then its backward. The recompute
repeats the layer's collectives (sp.attention communicates twice per step in the forward
direction) and sees the same inputs, so its outputs are the forward's, bit for bit.

``offload_saved_tensors`` keeps everything a forward saves for backward in host memory (pinned on
CUDA, copied back when the backward needs it): with checkpointing that is the layer inputs and the
few tensors saved outside the layers. Parameters stay where they are (copying them frees nothing).
On CPU it is the identity, but the same hooks run. ``attach_offload`` wraps every forward of a
model in it (forward pre-hook enters, forward hook leaves), for any model: the project's LM or a
Hugging Face one.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

CHECKPOINT_KWARGS = {"use_reentrant": False}


def checkpoint_layer(layer, *args, **checkpoint_kwargs):
    """``layer(*args)`` keeping only its inputs for the backward, which recomputes it."""
    return checkpoint(layer, *args, **{**CHECKPOINT_KWARGS, **checkpoint_kwargs})


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)


class offload_saved_tensors(torch.autograd.graph.saved_tensors_hooks):  # noqa: N801 - a context manager
    """Tensors saved for backward under this context live in host memory until the backward."""

    def __init__(self, pin_memory: bool = True):
        pin = bool(pin_memory) and torch.cuda.is_available()      # pinned host memory needs CUDA

        def pack(t: torch.Tensor):
            if t.device.type == "cpu" or _is_parameter(t):
                return None, t
            host = torch.empty_like(t, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            return t.device, host

        def unpack(packed):
            device, t = packed
            return t if device is None else t.to(device, non_blocking=pin)

        super().__init__(pack, unpack)


def attach_offload(model: nn.Module, pin_memory: bool = True) -> List:
    """Run every forward of ``model`` under offload_saved_tensors; returns the hook handles."""
    active: List[offload_saved_tensors] = []

    def enter(module, args):
        ctx = offload_saved_tensors(pin_memory)
        ctx.__enter__()
        active.append(ctx)

    def leave(module, args, output):
        active.pop().__exit__(None, None, None)

    return [model.register_forward_pre_hook(enter),
            model.register_forward_hook(leave, always_call=True)]


def enable_checkpointing(model: nn.Module) -> None:
    """Checkpoint every decoder layer: Hugging Face models (activation_checkpointing_enable, or
    gradient_checkpointing_enable before transformers 5) and the project's LM share the switch."""
    kwargs = dict(CHECKPOINT_KWARGS)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(f"activation_checkpointing: {type(model).__name__} has no per-layer checkpointing switch "
                         f"(activation_checkpointing_enable or gradient_checkpointing_enable); remove the "
                         f"activation_checkpointing section or call checkpoint_layer in its forward")


__all__ = ["checkpoint_layer", "offload_saved_tensors", "attach_offload", "enable_checkpointing", "CHECKPOINT_KWARGS"]
