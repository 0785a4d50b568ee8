"""``--calibrate``'s measurements on this machine and the least-squares fits over them: gloo's alpha
and beta between 2 local ranks (16 KiB .. 16 MiB), one thread's matmul and causal SDPA rates, and the
project's CPU kernel timed on full and causal blocks, t(call) = c_call + t_pair x computed pairs
(cost.pairs.computed_pairs: the CPU flash kernel skips masked work in whole key tiles only). A window's
pieces (a tall causal block per 128 keys, a 128 x 128 anti square) are timed, not fitted: their cost
over the fitted line is a factor each.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Dict, List, Sequence, Tuple

from ..cost.memory import fit_line
from ..cost.pairs import computed_pairs
from .hardware import Gpu, from_dict

SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
BLOCKS = ((256, 256, False), (1024, 1024, False), (2048, 1024, False), (512, 512, True), (2048, 2048, True),
          (128, 128, True))
WINDOW_BLOCKS = ((1152, 128, "tall"), (2176, 128, "tall"), (128, 128, "anti"))   # at w = 1024, 2048


def lstsq2(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> List[float]:
    """Least squares y = a x0 + b x1 (no intercept), by the 2 x 2 normal equations."""
    s00, s01, s11 = (sum(x[i] * x[j] for x in xs) for i, j in ((0, 0), (0, 1), (1, 1)))
    t0, t1 = (sum(x[i] * y for x, y in zip(xs, ys)) for i in (0, 1))
    det = s00 * s11 - s01 * s01
    return [(t0 * s11 - t1 * s01) / det, (s00 * t1 - s01 * t0) / det]


def fit_alpha_beta(points: Sequence[Tuple[int, float]]) -> Dict[str, float]:
    """Least squares t = alpha + bytes / beta (cost.memory.fit_line); alpha clipped at 0."""
    line = fit_line([float(b) for b, _ in points], [t for _, t in points])
    alpha, slope = max(0.0, line["a"]), line["b"]
    return {"alpha_s": alpha, "beta_bytes_s": 1.0 / slope if slope > 0 else float("inf"),
            "max_rel_residual": max(abs(alpha + b * slope - t) / t for b, t in points)}


def fit_call_cost(points: Sequence[Tuple[float, float]]) -> Dict[str, float]:
    """Least squares t = c_call + t_pair x pairs over (pairs, seconds), in relative error (each equation
    over its t: the small blocks, which carry c_call, count as much as the big ones); c_call >= 0."""
    rows = [(1.0 / t, p / t) for p, t in points]             # c_call / t + t_pair p / t = 1
    c_call, slope = lstsq2(rows, [1.0] * len(rows))
    if c_call < 0:
        c_call, slope = 0.0, sum(b for _, b in rows) / sum(b * b for _, b in rows)
    return {"c_call_s": c_call, "t_pair_s": slope,
            "max_rel_residual": max(abs(c_call + slope * p - t) / t for p, t in points)}


def _timed(fn, repeats: int, before=lambda: None) -> List[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after one untimed (the first call warms up);
    ``before`` runs untimed ahead of each (a barrier)."""
    times = []
    for _ in range(repeats + 1):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _comm_worker(sizes, repeats: int) -> Dict[str, List[Tuple[int, float]]]:
    """On every rank: (bytes this rank sends, median seconds) per size, all-to-all and ring."""
    import torch
    from .. import comm
    p = comm.world_size()
    group = comm.new_group(list(range(p)), 120.0)
    out: Dict[str, List[Tuple[int, float]]] = {"all_to_all": [], "ring": []}
    for nbytes in sizes:
        x_pm = torch.ones(p, nbytes // 4 // p)                  # [P, m]: chunk j goes to rank j
        calls = {"all_to_all": lambda: comm.all_to_all(x_pm, 0, 1, group),
                 "ring": lambda: comm.ring_send_recv([x_pm], group).wait()}
        for kind, call in calls.items():
            sent = x_pm.numel() * 4 * (p - 1) // p if kind == "all_to_all" else x_pm.numel() * 4
            out[kind].append((sent, statistics.median(_timed(call, repeats, lambda: comm.barrier(group)))))
    return out


def measure_comm(world: int = 2, repeats: int = 7) -> Dict[str, Any]:
    """{"all_to_all" | "ring": fit_alpha_beta of the slowest rank's times, with its points}."""
    from ..launch.rankpool import RankPool
    pool = RankPool(world, timeout_s=600.0).start()
    try:
        per_rank = pool.run(_comm_worker, SIZES, repeats, timeout=600)
    finally:
        pool.close()
    out = {}
    for kind in ("all_to_all", "ring"):
        points = [(b, max(r[kind][i][1] for r in per_rank)) for i, (b, _) in enumerate(per_rank[0][kind])]
        out[kind] = dict(fit_alpha_beta(points), points=points)
    return out


def _one_thread(fn):
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def measure_kernels(repeats: int = 5) -> Dict[str, float]:
    """FLOP/s of a matmul and of causal attention forward + backward, one thread."""
    import torch
    import torch.nn.functional as F

    def run():
        a = torch.randn(1024, 1024)
        mm = 2 * 1024 ** 3 * repeats / sum(_timed(lambda: torch.mm(a, a), repeats))
        n, h, d = 2048, 8, 64
        q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for _ in range(3))
        sdpa = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), repeats)
        return {"matmul_flops_s": mm, "attention_flops_s": 3 * 2 * (n / 2) * h * (d + d) * n / statistics.median(sdpa)}
    return _one_thread(run)


def _time_block(kernel, scale, nq, nk, heads, head_dim, causal, anti, repeats) -> float:
    """The fastest of ``repeats`` fwd+bwd of one block (the slower ones measure the neighbours on a
    shared machine)."""
    import torch
    q, dout = torch.randn(1, nq, heads, head_dim), torch.randn(1, nq, heads, head_dim)
    k, v = torch.randn(1, nk, heads, head_dim), torch.randn(1, nk, heads, head_dim)

    def call():
        out, lse = kernel.forward_block(q, k, v, causal, anti, scale)
        kernel.backward_block(dout, q, k, v, out, lse, causal, anti, scale)
    return min(_timed(call, repeats))


def measure_blocks(heads: int = 8, head_dim: int = 64, repeats: int = 3) -> Dict[str, Any]:
    """The timed BLOCKS (points: (computed pairs x heads, seconds)) and their fit; WINDOW_BLOCKS
    (window_points) and their factor over the fitted line (tall_factor, anti_factor)."""
    from ..kernels import get_kernel
    kernel, scale = get_kernel("torch", "cpu"), head_dim ** -0.5
    timed = lambda nq, nk, c, a: _time_block(kernel, scale, nq, nk, heads, head_dim, c, a, repeats)  # noqa: E731
    points, window = _one_thread(lambda: (
        [(computed_pairs(nq, nk, m) * heads, timed(nq, nk, m, False)) for nq, nk, m in BLOCKS],
        [(nq, nk, kind, timed(nq, nk, kind == "tall", kind == "anti")) for nq, nk, kind in WINDOW_BLOCKS]))
    fit = fit_call_cost(points)
    line = lambda nq, nk: fit["c_call_s"] + fit["t_pair_s"] * computed_pairs(nq, nk, True) * heads  # noqa: E731
    factor = {kind: sum(t for _, _, k, t in window if k == kind) / sum(line(nq, nk) for nq, nk, k, _ in window
                                                                        if k == kind) for kind in ("tall", "anti")}
    return dict(fit, points=points, heads=heads, head_dim=head_dim, window_points=window,
                tall_factor=factor["tall"], anti_factor=factor["anti"])


def cpu_profile(comm: Dict[str, Any], kernels: Dict[str, float]) -> Gpu:
    """A profile (usable as --gpu) whose "peaks" are the measured rates and whose efficiencies are 1."""
    a2a, mem_gb = comm["all_to_all"], os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    tflops, link, alpha_us = kernels["matmul_flops_s"] / 1e12, a2a["beta_bytes_s"] / 1e9, a2a["alpha_s"] * 1e6
    peaks = dict(memory_gb=mem_gb, bf16_tflops=tflops, tf32_tflops=tflops, hbm_tb_s=0.0, nvlink_gb_s_per_direction=link,
                 inter_node_gb_s_per_gpu=link, pcie_gb_s_per_direction=link, host_memory_gb_per_node=mem_gb)
    assumed = dict(usable_memory_fraction=1.0, runtime_reserve_gb=0.0, matmul_efficiency=1.0, nvlink_efficiency=1.0,
                   attention_efficiency=kernels["attention_flops_s"] / kernels["matmul_flops_s"],
                   alpha_intra_us=alpha_us, inter_node_efficiency=1.0, alpha_inter_us=alpha_us,
                   cpu_adam_params_per_s=1e8, comm_overlap=0.0)     # gloo's copies run on the compute's cores
    return from_dict({"name": "cpu-calibrated", "datasheet_peaks": peaks, "assumed": assumed,
                      "description": f"this machine ({platform.processor() or platform.machine()}), gloo",
                      "sources": {"measured": "ds-seqpar plan --calibrate (all-to-all alpha/beta, matmul and SDPA "
                                              "throughput)"}}, "calibrated")


__all__ = ["BLOCKS", "WINDOW_BLOCKS", "cpu_profile", "fit_alpha_beta", "fit_call_cost", "lstsq2", "measure_blocks",
           "measure_comm", "measure_kernels"]
