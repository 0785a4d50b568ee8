"""FLOPs of one training step per token, per layer kind (1 multiply-accumulate = 2 FLOPs).

Forward, per token of a sequence of S tokens:
    softmax mixer  projections 2 (h q_dim + 2 h kv_dim + o_dim h)
                   scores + values 2 keys (H d + H dv), keys = the keys a query sees on average:
                   causal S/2, non-causal S; with a window or documents the mask's pairs / S
                   (pairs.pairs_total: causal window w (w (w+1)/2 + (S - w) w) / S, packed
                   documents sum(L (L+1) / 2) / S); each layer its own window (sliding layers:
                   the config's sliding_window)
    linear / SSD   projections 2 params; chunked scan with chunk C: 2 H_lin (2 dk dv + C (dk + dv))
    Mamba-1        projections 2 params; the selective scan runs token by token, linear in tokens: per
                   channel c and state entry, decay, input and readout, 3 multiply-adds: 6 c d_state
    MLP            2 x (gate, up, down) of the dense MLP, or of the active experts + shared + router
    LM head        2 V h
Training: backward = 2 x forward. With the long-context features the fused loss runs the head's
forward again in its backward, a checkpointed layer runs its forward again, and its tiled MLP once
more inside that recompute's backward (a test holds this to a count by hand; ``ds-seqpar bench
memory`` prices the recompute's step time with it). Elementwise work is not counted.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..masks import Mask
from .pairs import pairs_total

LINEAR_CHUNK = 64


def keys_per_query(seq: int, causal: bool = True, window: Optional[int] = None,
                   docs: Optional[Tuple[int, ...]] = None, blocks=None) -> float:
    """The keys one query sees on average (the work ratio of the mask times S). No window and one
    document: S / 2 causal (the count by hand a test holds the step's FLOPs to), S non-causal; else
    the mask's pairs counted exactly (a non-causal window's edge queries see fewer than 2 w - 1 keys;
    ``blocks``, bidirectional (start, end) pairs, add their later keys)."""
    if docs is None and not blocks and (window is None or window >= seq):
        return seq / 2 if causal else float(seq)
    return pairs_total(seq, Mask(causal, window, docs, blocks=tuple(blocks) if blocks else None)) / seq


def forward_per_token(shape, seq: int, causal: bool = True, docs: Optional[Tuple[int, ...]] = None,
                      keys: Optional[Dict[Optional[int], float]] = None) -> Dict[str, float]:
    """{"projections", "attention", "linear_scan", "mlp", "head"}: forward FLOPs per token, summed
    over the layers ("attention" = the score and value matmuls only). Each softmax layer sees its own
    window (shape.layer_windows); ``keys`` {window: keys per token} replaces the average keys of a
    window (search.py passes the busiest rank's)."""
    out = {"projections": 0.0, "attention": 0.0, "linear_scan": 0.0, "mlp": 0.0, "head": 2.0 * shape.vocab * shape.hidden}
    for kind, window in zip(shape.layer_kinds, shape.layer_windows):
        out["projections"] += 2.0 * shape.mixer_params(kind)
        if kind in ("attention", "sliding"):
            seen = keys[window] if keys is not None else keys_per_query(seq, causal, window, docs)
            out["attention"] += 2.0 * seen * shape.heads * (shape.head_dim + shape.dv)
        elif kind == "mamba" and shape.transition == "diagonal":
            out["linear_scan"] += 6.0 * shape.lin_heads * shape.lin_dk
        elif kind in ("linear", "mamba", "lasp"):
            h = shape.lin_heads
            out["linear_scan"] += 2.0 * h * (2 * shape.lin_dk * shape.lin_dv + LINEAR_CHUNK * (shape.lin_dk + shape.lin_dv))
        out["mlp"] += 2.0 * shape.mlp_params(active=True)
    return out


def step_per_token(shape, seq: int, features: bool, causal: bool = True,
                   docs: Optional[Tuple[int, ...]] = None,
                   keys: Optional[Dict[Optional[int], float]] = None) -> Dict[str, float]:
    """Training-step FLOPs per token by part: plain = 3 x forward; with the features the head 4x,
    the mixers 4x, the MLP 5x (recomputes)."""
    f = forward_per_token(shape, seq, causal, docs, keys)
    head, mixer, mlp = (4, 4, 5) if features else (3, 3, 3)
    return {"head": head * f["head"], "projections": mixer * f["projections"], "attention": mixer * f["attention"],
            "linear_scan": mixer * f["linear_scan"], "mlp": mlp * f["mlp"]}


def model_flops_per_token(shape, seq: int, causal: bool = True,
                          docs: Optional[Tuple[int, ...]] = None) -> float:
    """The "model FLOPs" of MFU: 3 x forward, no recompute, the mask's average work."""
    return 3 * sum(forward_per_token(shape, seq, causal, docs).values())


__all__ = ["LINEAR_CHUNK", "forward_per_token", "keys_per_query", "model_flops_per_token", "step_per_token"]
