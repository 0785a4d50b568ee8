"""Opaque, differentiable nodes for torch.compile (docs/compile.md): sp.attention, sp.linear_attention and the
collectives of sp.loss and sp.unshard as registered custom ops with fake implementations and autograd
formulas, their communication and CommStats counting inside. Eager calls run the same ops."""
from .attention import attention
from .linear import linear_attention
from .reduce import all_gather
from .registry import handle, resolve

__all__ = ["all_gather", "attention", "handle", "linear_attention", "resolve"]
