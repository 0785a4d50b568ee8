"""Sequence-tiled MLP: an MLP runs over chunks of the local tokens, forward and backward.

An MLP maps every token on its own ([b, s, h] -> [b, s, h], pointwise over tokens), so its
intermediates (several times the hidden size per token: gate, up, activation, product) need not
exist for all tokens at once. The forward runs chunk by chunk without saving anything but the
input; the backward recomputes one chunk at a time and back-propagates through it.

``tile_mlp(module, chunk_tokens)`` keeps the module object, its parameters and its state_dict
keys: it places ``TiledMLP`` in front of the module's class (the pattern torch's fully_shard uses),
so isinstance checks, hooks (ZeRO-3's gather/release) and optimizers holding its parameters are
unaffected. ``untile_mlp`` restores the class.

Parameter gradients: each chunk's backward accumulates into ``param.grad`` (a nested backward, as
checkpointing does). DeepSpeed's ZeRO hooks would reduce a parameter at its first accumulation, so
every chunk but the last marks the parameters ``ds_grad_is_ready = False``, DeepSpeed's own flag
for tiled computations (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py): the gradient is
reduced once, after its last chunk. The outer backward must therefore be ``.backward()`` (what
DeepSpeed and trainers run), not ``torch.autograd.grad`` with respect to the MLP's parameters.

Legend: N = local tokens (batch x local sequence, flattened), C = rows in one chunk, H = hidden.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn as nn

_TILED_CLASSES: Dict[type, type] = {}       # MLP class -> its Tiled<Class>, built once per class


def _chunks(n: int, chunk: int):
    return [slice(start, min(start + chunk, n)) for start in range(0, n, chunk)]


class _TiledApply(torch.autograd.Function):
    """y = mlp(x) over row chunks; saves only x. ``dummy`` requires grad whenever a parameter does,
    so the result needs a backward even when x does not (frozen layers below)."""

    @staticmethod
    def forward(ctx, mlp, chunk, x_nh, dummy):
        ctx.mlp, ctx.chunk = mlp, chunk
        ctx.save_for_backward(x_nh)
        y_nh = None
        with torch.no_grad():
            for rows in _chunks(x_nh.shape[0], chunk):
                y_ch = mlp.untiled_forward(x_nh[rows][None])[0]                  # [C, H_out]
                if y_ch.shape[0] != rows.stop - rows.start:
                    raise ValueError(f"tiled {type(mlp).__name__}: {rows.stop - rows.start} tokens in, "
                                     f"{y_ch.shape[0]} out; only token-wise modules can be tiled")
                if y_nh is None:
                    y_nh = y_ch.new_empty((x_nh.shape[0],) + tuple(y_ch.shape[1:]))
                y_nh[rows] = y_ch
        return y_nh

    @staticmethod
    def backward(ctx, grad_nh):
        (x_nh,) = ctx.saved_tensors
        mlp, needs_x = ctx.mlp, ctx.needs_input_grad[2]
        params = [p for p in mlp.parameters() if p.requires_grad]
        d_x = torch.empty_like(x_nh) if needs_x else None
        pieces = _chunks(x_nh.shape[0], ctx.chunk)
        try:
            for i, rows in enumerate(pieces):
                for p in params:                                   # reduce after the last chunk only
                    p.ds_grad_is_ready = i == len(pieces) - 1
                x_ch = x_nh[rows].detach().requires_grad_(needs_x)
                with torch.enable_grad():
                    y_ch = mlp.untiled_forward(x_ch[None])[0]
                torch.autograd.backward(y_ch, grad_nh[rows])
                if needs_x:
                    d_x[rows] = x_ch.grad
        finally:
            for p in params:
                p.__dict__.pop("ds_grad_is_ready", None)
        return None, None, d_x, None


class TiledMLP(nn.Module):
    """Mixin put in front of an MLP's class by tile_mlp; ``tiled_mlp_tokens`` rows per chunk."""

    tiled_mlp_tokens: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise ValueError(f"tiled {type(self).__name__}: expects one tensor [..., tokens, hidden], got "
                             f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
        _refuse_direct_zero3_params(self)
        x_nh = x.reshape(-1, x.shape[-1])
        params = [p for p in self.parameters() if p.requires_grad]
        dummy = torch.empty(0, device=x.device, requires_grad=bool(params) and torch.is_grad_enabled())
        y_nh = _TiledApply.apply(self, self.tiled_mlp_tokens, x_nh, dummy)
        return y_nh.view(*x.shape[:-1], y_nh.shape[-1])

    def untiled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The module's own forward (the class behind TiledMLP in the MRO)."""
        return super().forward(x)


def _refuse_direct_zero3_params(mlp: nn.Module) -> None:
    """Children's parameters are gathered by their own ZeRO-3 hooks when the recompute calls them;
    parameters held by the MLP module itself would be released by then."""
    direct = [name for name, p in mlp.named_parameters(recurse=False) if hasattr(p, "ds_id")]
    if direct:
        raise ValueError(f"tiled {type(mlp).__name__}: parameters {direct} belong to the MLP module itself and are "
                         f"partitioned by ZeRO-3; tiling needs them in child modules (nn.Linear) or ZeRO stage <= 2; "
                         f"set sequence_parallel.tiled_mlp_tokens=0 to turn tiling off")


def tile_mlp(module: nn.Module, chunk_tokens: int) -> nn.Module:
    """Make ``module`` (any token-wise [b, s, h] -> [b, s, h] module) run in chunks of ``chunk_tokens``
    tokens; returns the same object. Calling it again changes the chunk size."""
    if chunk_tokens < 1:
        raise ValueError(f"tile_mlp: chunk_tokens={chunk_tokens} must be >= 1")
    cls = type(module)
    if not isinstance(module, TiledMLP):
        if cls not in _TILED_CLASSES:
            _TILED_CLASSES[cls] = type(f"Tiled{cls.__name__}", (TiledMLP, cls), {"__module__": cls.__module__})
        module.__class__ = _TILED_CLASSES[cls]
    module.tiled_mlp_tokens = int(chunk_tokens)
    return module


def untile_mlp(module: nn.Module) -> nn.Module:
    """Undo tile_mlp: the module's own class and forward again."""
    if isinstance(module, TiledMLP):
        module.__class__ = type(module).__mro__[2]
        module.__dict__.pop("tiled_mlp_tokens", None)
    return module


def tile_mlps(model: nn.Module, chunk_tokens: int, attr: str = "mlp") -> List[str]:
    """Tile every child module named ``attr`` (each decoder layer's MLP: the project's LM and Hugging
    Face Llama-family layers alike); returns their qualified names."""
    names = [f"{parent_name}.{attr}".lstrip(".") for parent_name, parent in model.named_modules()
             if isinstance(getattr(parent, attr, None), nn.Module)]
    for name in names:
        tile_mlp(model.get_submodule(name), chunk_tokens)
    if not names:
        raise ValueError(f"tile_mlps: {type(model).__name__} has no submodule named {attr!r} to tile; pass the "
                         f"attribute name of its decoder layers' MLP")
    return names


__all__ = ["TiledMLP", "tile_mlp", "untile_mlp", "tile_mlps"]
