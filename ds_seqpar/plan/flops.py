"""FLOPs of one training step per token, per layer kind (1 multiply-accumulate = 2 FLOPs).

Forward, per token of a sequence of S tokens:
    softmax mixer  projections 2 (h q_dim + 2 h kv_dim + o_dim h)
                   scores + values 2 keys (H d + H dv), keys = the keys a query sees on average:
                   causal S/2, non-causal S, causal window w: (w (w+1)/2 + (S - w) w) / S
    linear / SSD   projections 2 params; chunked scan with chunk C: 2 H_lin (2 dk dv + C (dk + dv))
    MLP            2 x (gate, up, down) of the dense MLP, or of the active experts + shared + router
    LM head        2 V h
Training: backward = 2 x forward. With the long-context features the fused loss runs the head's
forward again in its backward, a checkpointed layer runs its forward again, and its tiled MLP once
more inside that recompute's backward (the same count as the measured-memory benchmark's
step_macs_per_token, which a test holds this to). Elementwise work is not counted.
"""
from __future__ import annotations

from typing import Dict, Optional

from .model_shape import ModelShape

LINEAR_CHUNK = 64


def keys_per_query(seq: int, causal: bool = True, window: Optional[int] = None) -> float:
    """The keys one query sees on average (the work ratio of the mask times S)."""
    if window is None or window >= seq:
        return seq / 2 if causal else float(seq)
    w = window
    if not causal:
        return float(min(seq, 2 * w - 1))
    return (w * (w + 1) / 2 + (seq - w) * w) / seq


def forward_per_token(shape: ModelShape, seq: int, causal: bool = True) -> Dict[str, float]:
    """{"projections", "attention", "linear_scan", "mlp", "head"}: forward FLOPs per token, summed
    over the layers ("attention" = the score and value matmuls only)."""
    out = {"projections": 0.0, "attention": 0.0, "linear_scan": 0.0, "mlp": 0.0, "head": 2.0 * shape.vocab * shape.hidden}
    for kind in shape.layer_kinds:
        out["projections"] += 2.0 * shape.mixer_params(kind)
        if kind in ("attention", "sliding"):
            keys = keys_per_query(seq, causal, shape.window if kind == "sliding" else None)
            out["attention"] += 2.0 * keys * shape.heads * (shape.head_dim + shape.dv)
        elif kind in ("linear", "mamba"):
            h = shape.lin_heads
            out["linear_scan"] += 2.0 * h * (2 * shape.lin_dk * shape.lin_dv + LINEAR_CHUNK * (shape.lin_dk + shape.lin_dv))
        out["mlp"] += 2.0 * shape.mlp_params(active=True)
    return out


def step_per_token(shape: ModelShape, seq: int, features: bool, causal: bool = True) -> Dict[str, float]:
    """Training-step FLOPs per token by part: plain = 3 x forward; with the features the head 4x,
    the mixers 4x, the MLP 5x (recomputes)."""
    f = forward_per_token(shape, seq, causal)
    head, mixer, mlp = (4, 4, 5) if features else (3, 3, 3)
    return {"head": head * f["head"], "projections": mixer * f["projections"], "attention": mixer * f["attention"],
            "linear_scan": mixer * f["linear_scan"], "mlp": mlp * f["mlp"]}


def model_flops_per_token(shape: ModelShape, seq: int, causal: bool = True) -> float:
    """The "model FLOPs" of MFU: 3 x forward, no recompute."""
    return 3 * sum(forward_per_token(shape, seq, causal).values())


__all__ = ["LINEAR_CHUNK", "forward_per_token", "keys_per_query", "model_flops_per_token", "step_per_token"]
