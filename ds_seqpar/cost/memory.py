"""Memory of one training step per GPU: a static part (by ZeRO stage) plus bytes per token per
phase, in the phase form of the measured-memory benchmark (``ds-seqpar bench memory``):

    peak(n) = max over phases (a_phase + b_phase n)          n = tokens per rank

Static (Psi parameters, G ranks that ZeRO shards over = data x sequence ranks):
    fp32:            weights 4 Psi, gradients 4 Psi, Adam moments 8 Psi
    bf16 (mixed):    weights 2 Psi, gradients 2 Psi, fp32 master weights + moments 12 Psi
    ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the weights (plus two
    layers' gathered weights in flight); optimizer offload moves the optimizer state to host memory.

Per token, counted tensor by tensor from a Llama-style decoder layer (e = activation bytes; the
RMSNorm upcasts to fp32, so each norm keeps its fp32 input and normalised value, 8h, and its
output, e h):
    plain layer    2 (8h + e h) + e (q + 2 kv + o) + 4 H (lse) + 4 e I (gate, up, act, product)
    plain head     forward: logits and log-probabilities (+ the fp32 copy of bf16 logits);
                   loss backward: log-probabilities, their gradient and the logits' gradient (fp32)
    features       the checkpoints (L h e: on the device unless cpu_checkpointing moves them to host)
                   + one layer's recompute and backward working set (the tiled MLP and the tiled loss
                   hold fixed-size chunks only):
                   norm (4h if e != 4) + 4h + e h + e (q + 2 kv + o) + 4 H + e (2h + o + q + 2 kv) (grads)
    communication  closed_form.transient_bytes per local token (the strategy's buffers; an upper
                   bound: the measured steps show they overlap the kernel's own temporaries)
Linear-attention / SSD layers are approximated by their projections' output widths (not measured).
"""
from __future__ import annotations

from typing import Dict, Optional

from ..strategies.closed_form import Shapes, transient_bytes
from .candidate import SOFTMAX_KINDS, Features

PHASES = ("forward", "loss_backward", "layers_backward", "optimizer")
REDUCE_BUCKET_ELEMS = 50_000_000          # the project's configs' zero_optimization.reduce_bucket_size


def static_bytes(shape, ranks: int, zero: int, dtype: str, offload_optimizer: bool = False) -> Dict[str, float]:
    """{"weights", "gradients", "optimizer", "buffers"} per GPU (optimizer 0 on the device when offloaded)."""
    psi = shape.params()
    w, g, o = (4, 4, 8) if dtype == "fp32" else (2, 2, 12)
    weights = w * psi / (ranks if zero >= 3 else 1)
    grads = g * psi / (ranks if zero >= 2 else 1)
    optim = 0.0 if offload_optimizer else o * psi / ranks
    layer = max(shape.mixer_params(k) + shape.mlp_params() for k in shape.layer_kinds)
    buffers = g * REDUCE_BUCKET_ELEMS * (1 if zero >= 2 else 0) + (2 * w * layer if zero >= 3 else 0)
    return {"weights": weights, "gradients": grads, "optimizer": optim, "buffers": float(buffers)}


def _norm(h: int, e: int) -> int:
    return 8 * h + e * h


def _mlp_saved(shape, e: int) -> float:
    if not shape.experts:
        return 4 * e * shape.intermediate
    return 4 * e * (shape.expert_intermediate * shape.active_experts + shape.shared_intermediate) + 4 * shape.experts


def _mixer_widths(shape, kind: str) -> Dict[str, int]:
    if kind in SOFTMAX_KINDS or kind == "lasp":          # lasp (own LM): the same projections, no lse
        return {"q": shape.q_dim, "kv": shape.kv_dim, "o": shape.heads * shape.dv,
                "lse": shape.heads if kind in SOFTMAX_KINDS else 0}
    width = shape.mixer_params(kind) // max(shape.hidden, 1)        # projection outputs (approximate)
    return {"q": width // 2, "kv": width // 4, "o": width // 4, "lse": 0}


def per_token(shape, e: int, features: Features, checkpoints_on_device: bool) -> Dict[str, float]:
    """Bytes per local token by phase, without the communication buffers."""
    h, v = shape.hidden, shape.vocab
    fp32_copy = 0 if e == 4 else 1
    if not features.on:
        layers = 0.0
        for kind in shape.layer_kinds:
            m = _mixer_widths(shape, kind)
            layers += 2 * _norm(h, e) + e * (m["q"] + 2 * m["kv"] + m["o"]) + 4 * m["lse"] + _mlp_saved(shape, e)
        m = _mixer_widths(shape, "attention")
        grads = e * (2 * h + m["o"] + m["q"] + 2 * m["kv"])
        return {"forward": layers + _norm(h, e) + v * (e + 4 + 4 * fp32_copy),
                "loss_backward": layers + _norm(h, e) + v * (12 + e * fp32_copy),
                "layers_backward": layers + grads, "optimizer": 0.0}
    floor = shape.layers * h * e if checkpoints_on_device else 0
    work = 0.0
    for kind in set(shape.layer_kinds):
        m = _mixer_widths(shape, kind)
        saved = 4 * h * fp32_copy + 4 * h + e * h + e * (m["q"] + 2 * m["kv"] + m["o"]) + 4 * m["lse"]
        grads = e * (2 * h + m["o"] + m["q"] + 2 * m["kv"])
        work = max(work, saved + grads)
    return {"forward": floor + _norm(h, e) + e * h * 4, "loss_backward": floor + _norm(h, e) + 4 * h,
            "layers_backward": floor + work, "optimizer": 0.0}


def comm_per_token(strategy: str, size: int, ulysses: int, shape, e: int) -> Dict[str, float]:
    """closed_form.transient_bytes per local token (it is linear in the local length)."""
    if size == 1 or not shape.count("attention") + shape.count("sliding"):
        return {"forward": 0.0, "backward": 0.0}
    n = 64
    sh = Shapes(1, size * n, shape.heads, shape.kv_heads, shape.head_dim, e, shape.v_head_dim)
    t = transient_bytes(strategy, size, sh, ulysses)
    return {k: val / n for k, val in t.items()}


def fixed_per_phase(shape, e: int, features: Features) -> Dict[str, float]:
    """Fixed-size working buffers: the tiled loss's chunk of logits (logits, log-probabilities and
    gradient in fp32) and the tiled MLP's chunk."""
    if not features.on:
        return {p: 0.0 for p in PHASES}
    loss = features.tiled_loss_tokens * shape.vocab * 12
    mlp = features.tiled_mlp_tokens * _mlp_saved(shape, e)
    return {"forward": loss, "loss_backward": loss, "layers_backward": mlp, "optimizer": 0.0}


def phase_lines(shape, strategy: str, size: int, ulysses: int, ranks: int, zero: int, dtype: str,
                features: Features, checkpoints_on_device: bool) -> Dict[str, Dict[str, float]]:
    """{phase: {"a": bytes, "b": bytes per token}}: the measured benchmark's phase-model form."""
    e = 4 if dtype == "fp32" else 2
    static = sum(static_bytes(shape, ranks, zero, dtype, features.offload_optimizer).values())
    tok = per_token(shape, e, features, checkpoints_on_device)
    comm = comm_per_token(strategy, size, ulysses, shape, e)
    fixed = fixed_per_phase(shape, e, features)
    extra = {"forward": comm["forward"], "loss_backward": 0.0, "layers_backward": comm["backward"], "optimizer": 0.0}
    return {p: {"a": static + fixed[p], "b": tok[p] + extra[p]} for p in PHASES}


def fit_line(xs, ys) -> Dict[str, float]:
    """Least-squares y = a + b x (b = 0 with one point), and the largest residual: a measured phase's
    line, in the form ``phase_lines`` predicts."""
    n = len(xs)
    if n == 1:
        return {"a": ys[0], "b": 0.0, "max_residual": 0.0}
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return {"a": a, "b": b, "max_residual": max(abs(a + b * x - y) for x, y in zip(xs, ys))}


def phase_model(points) -> Dict[str, Dict[str, float]]:
    """phase -> the fitted line of its measured peak (bytes) against tokens per rank."""
    phases = points[0]["phase_peak_bytes"]
    return {p: fit_line([pt["tokens_per_rank"] for pt in points], [pt["phase_peak_bytes"][p] for pt in points])
            for p in phases}


def peak(lines: Dict[str, Dict[str, float]], n: float) -> float:
    """A step's peak at ``n`` tokens per rank: the largest of its phases' a + b n."""
    return max(line["a"] + line["b"] * n for line in lines.values())


def max_tokens(lines: Dict[str, Dict[str, float]], budget: float, unbounded: Optional[int] = None) -> Optional[int]:
    """The most tokens per rank whose peak stays within ``budget`` (0: not even the fixed part);
    ``unbounded`` when no phase grows with the tokens."""
    limit = float("inf")
    for line in lines.values():
        if line["a"] > budget:
            return 0
        if line["b"] > 0:
            limit = min(limit, (budget - line["a"]) / line["b"])
    return int(limit) if limit != float("inf") else unbounded


def host_bytes_per_node(shape, tokens_per_rank: int, gpus_per_node: int, ranks: int, dtype: str,
                        features: Features) -> float:
    """Host memory a node needs beyond the runtime: offloaded checkpoints and optimizer state."""
    e = 4 if dtype == "fp32" else 2
    ckpt = shape.layers * shape.hidden * e * tokens_per_rank if features.on and features.cpu_checkpointing else 0
    optim = (8 if dtype == "fp32" else 12) * shape.params() / ranks if features.offload_optimizer else 0
    return gpus_per_node * (ckpt + optim)


__all__ = ["PHASES", "comm_per_token", "fit_line", "fixed_per_phase", "host_bytes_per_node", "max_tokens", "peak",
           "per_token", "phase_lines", "phase_model", "static_bytes"]
