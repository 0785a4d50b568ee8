"""Opaque, differentiable nodes for torch.compile (docs/compile.md): sp.attention and sp.linear_attention
as registered custom ops with fake implementations and autograd formulas, their communication and
CommStats counting inside. Eager calls run the same ops."""
from .attention import attention
from .linear import linear_attention
from .registry import handle, resolve

__all__ = ["attention", "handle", "linear_attention", "resolve"]
