"""Ulysses head chunks (strategies/ulysses.py): the exposed all-to-all time of C chunks, and the
count ``"ulysses_chunks": "auto"`` picks, for the planner and the runtime alike.

One pass of one layer (forward, or backward) exchanges B_in bytes in before its attention compute T
(forward q, k, v: 3 calls; backward dout: 1) and B_out bytes out after it (forward out: 1; backward
dq, dk, dv: 3). Cut into C head chunks, chunk c+1's exchange in and chunk c-1's exchange out travel
while chunk c computes:

    t_in  = a2a(B_in / C, calls_in)          t_out = a2a(B_out / C, calls_out)
    exposed(C) = t_in + t_out + (C - 1) * max(0, t_in + t_out - w * T / C)

Chunk 0's exchange in and chunk C-1's exchange out hide behind nothing; between them each step's
compute hides up to w of itself (w = ``comm_overlap``: 1 where transfers run on their own engines,
GPUs with NCCL; 0 on CPU gloo ranks, whose transfers run on the compute's cores, so C > 1 only adds
C times the latency and "auto" stays at 1). C = 1 is a2a(B_in) + a2a(B_out): the whole exchange, as
cost/times.py prices unchunked Ulysses. The bytes do not depend on C (strategies/closed_form.py).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Tuple

from ..strategies.ulysses import chunk_counts, kv_replication

CPU_OVERLAP = 0.0          # gloo on CPU: the transfer's copies and the kernel share the same cores
GPU_OVERLAP = 1.0          # assumed for a profile without "comm_overlap": NCCL on its own channels
MAX_CHUNKS = 8             # past this the per-call latency (8 calls per chunk) outweighs what is left to hide
PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "plan", "profiles")   # data, not code

A2A = Callable[[float, int], float]          # (bytes one rank sends, calls) -> seconds


def comm_overlap(gpu) -> float:
    """The share of a step's compute a transfer can hide behind, from the profile (``assumed``)."""
    return float(gpu.assumed.get("comm_overlap", GPU_OVERLAP))


def pass_exposed_s(t_in: float, t_out: float, compute_s: float, chunks: int, overlap: float) -> float:
    """exposed(C) of one pass (module doc); t_in, t_out: one chunk's exchange in and out."""
    return t_in + t_out + (chunks - 1) * max(0.0, t_in + t_out - overlap * compute_s / chunks)


def exchange_split(nbytes: float, q_share: float) -> Tuple[float, float, float, float]:
    """(forward in, forward out, backward in, backward out) bytes of a layer's ``nbytes`` all-to-all
    bytes, forward + backward: q, out, dout, dq each ``q_share`` / 4 of them, k, v, dk, dv the rest."""
    q, kv = nbytes * q_share / 4, nbytes * (1 - q_share) / 4
    return q + 2 * kv, q, q, q + 2 * kv


def ulysses_exposed_s(a2a: A2A, nbytes: float, q_share: float, fwd_s: float, bwd_s: float, chunks: int,
                      overlap: float) -> float:
    """Exposed all-to-all seconds of one layer, forward + backward, in ``chunks`` head chunks; ``fwd_s``,
    ``bwd_s``: the layer's attention compute in each pass."""
    if nbytes <= 0:
        return 0.0
    f_in, f_out, b_in, b_out = (b / chunks for b in exchange_split(nbytes, q_share))
    return (pass_exposed_s(a2a(f_in, 3), a2a(f_out, 1), fwd_s, chunks, overlap)
            + pass_exposed_s(a2a(b_in, 1), a2a(b_out, 3), bwd_s, chunks, overlap))


def choose(valid: List[int], price: Callable[[int], float]) -> Tuple[int, Dict[int, float]]:
    """(the count of ``valid`` with the lowest price, the smaller on a tie; {count: price})."""
    prices = {c: price(c) for c in valid if c <= MAX_CHUNKS}
    best = min(prices, key=lambda c: (round(prices[c], 12), c))
    return best, prices


def why(best: int, prices: Dict[int, float], overlap: float) -> str:
    """The planner's column: the exposed all-to-all per step at 1 chunk and at the chosen count."""
    if overlap <= 0:
        return "1: transfers share the compute's cores"
    if best == 1:
        return f"1: {prices[1] * 1e3:.1f} ms exposed, chunks do not hide more" if len(prices) > 1 else \
            "1: one k/v head per rank"
    return f"{best}: exposed a2a {prices[1] * 1e3:.1f} -> {prices[best] * 1e3:.1f} ms"


# ---------------------------------------------------------------------------------------------
# the runtime's rule: SequenceParallel gives it to the strategy context (ctx.ulysses_chunks)


def chunk_rule(setting, device_type: str, device_name: str, size: int, overlap: bool = True):
    """(n local tokens, q heads, kv heads, head dim, element size) -> the head chunks to run: the
    configured count, 1 without overlap, or "auto"'s price (``auto_chunks``) for this device."""
    if not overlap:
        return lambda *shape: 1
    if setting != "auto":
        return lambda *shape: setting
    rates = device_rates(device_type, device_name)
    return lambda n, heads, kv_heads, head_dim, elem: auto_chunks(rates, size, n, heads, kv_heads, head_dim, elem)


def device_rates(device_type: str, device_name: str) -> Optional[Dict[str, float]]:
    """{alpha_s, beta_bytes_s, attention_flops_s, overlap} of the device's profile (plan/profiles: the
    planner's numbers; a CUDA device by the profile named in its name, else h100), None on CPU (no
    overlap: nothing to price)."""
    if device_type != "cuda":
        return None
    names = sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
    name = next((g for g in names if g in device_name.lower()), "h100")
    with open(os.path.join(PROFILE_DIR, f"{name}.json")) as f:
        raw = json.load(f)
    peaks, a = raw["datasheet_peaks"], raw["assumed"]
    return {"alpha_s": a["alpha_intra_us"] * 1e-6,
            "beta_bytes_s": peaks["nvlink_gb_s_per_direction"] * 1e9 * a["nvlink_efficiency"],
            "attention_flops_s": peaks["bf16_tflops"] * 1e12 * a["attention_efficiency"],       # 16-bit inputs
            "attention_flops_s_fp32": peaks["tf32_tflops"] * 1e12 * a["attention_efficiency"],
            "overlap": float(a.get("comm_overlap", GPU_OVERLAP))}


def auto_chunks(rates: Optional[Dict[str, float]], size: int, n: int, heads: int, kv_heads: int, head_dim: int,
                elem: int) -> int:
    """The runtime's "auto": the chunk count of one layer's lowest exposed all-to-all (causal attention
    over the whole size x n tokens, the shapes alone: the compiler's fake and every rank must agree
    without the mask), 1 without a device to overlap on."""
    if rates is None or rates["overlap"] <= 0 or size == 1:
        return 1
    seq, kv = size * n, kv_heads * kv_replication(heads, kv_heads, size)
    nbytes = 4 * elem * n * (heads + kv) * head_dim * (size - 1) / size       # the 8 tensors' (P-1)/P
    rate = rates["attention_flops_s_fp32" if elem >= 4 else "attention_flops_s"]
    fwd_s = 2 * 2 * head_dim * seq * (seq + 1) / 2 * heads / size / rate       # 2 matmuls x 2 FLOPs per pair

    def a2a(b, calls):
        return calls * rates["alpha_s"] + b / rates["beta_bytes_s"]
    price = lambda c: ulysses_exposed_s(a2a, nbytes, heads / (heads + kv), fwd_s, 2 * fwd_s, c,  # noqa: E731
                                        rates["overlap"])
    return choose(chunk_counts(heads, kv_heads, size), price)[0]


__all__ = ["CPU_OVERLAP", "GPU_OVERLAP", "MAX_CHUNKS", "auto_chunks", "choose", "chunk_rule", "comm_overlap",
           "device_rates", "exchange_split", "pass_exposed_s", "ulysses_exposed_s", "why"]
