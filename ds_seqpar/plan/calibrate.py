"""``ds-seqpar plan --calibrate``: this machine's alpha/beta (gloo, local ranks) and kernel
throughput, a profile made of them, and the plan's predictions against the measured reports.

    alpha, beta   all-to-all and ring send/recv between P local ranks (launch.rankpool.RankPool),
                  message sizes 16 KiB .. 16 MiB, median of repeats, least squares t = alpha + bytes / beta
    throughput    one thread: a 1024^3 fp32 matmul, and causal SDPA forward + backward at N = 2048
                  (8 heads x 64), FLOPs counted as cost/flops.py counts them
Then, with these numbers in place of a GPU profile, the attention fwd+bwd speedups of
reports/cpu_full.json (P = 2, fp32, causal, 8 heads x 64) are predicted strategy by strategy and
written beside the measured ones, with the memory-per-token rows of reports/memory_cpu.json, to
reports/plan_cpu.{md,json}.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Dict, List, Tuple

from ..strategies.closed_form import Shapes, closed_form_by_kind
from .cost import times
from .hardware import Gpu, from_dict

SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
STRATEGIES = ("ulysses", "ring", "zigzag", "striped")


def _comm_worker(sizes, repeats: int) -> Dict[str, List[Tuple[int, float]]]:
    """On every rank: (bytes this rank sends, median seconds) per size, all-to-all and ring."""
    import torch
    from .. import comm
    p = comm.world_size()
    group = comm.new_group(list(range(p)), 120.0)
    out: Dict[str, List[Tuple[int, float]]] = {"all_to_all": [], "ring": []}
    for nbytes in sizes:
        x_pm = torch.ones(p, nbytes // 4 // p)                  # [P, m]: chunk j goes to rank j
        for kind in out:
            times = []
            for i in range(repeats + 1):
                comm.barrier(group)
                t0 = time.perf_counter()
                if kind == "all_to_all":
                    comm.all_to_all(x_pm, 0, 1, group)
                else:
                    comm.ring_send_recv([x_pm], group).wait()
                if i:                                           # the first call warms up
                    times.append(time.perf_counter() - t0)
            sent = x_pm.numel() * 4 * (p - 1) // p if kind == "all_to_all" else x_pm.numel() * 4
            out[kind].append((sent, statistics.median(times)))
    return out


def fit_alpha_beta(points: List[Tuple[int, float]]) -> Dict[str, float]:
    """Least squares t = alpha + bytes / beta; alpha clipped at 0."""
    xs, ys = [float(b) for b, _ in points], [t for _, t in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(0.0, my - slope * mx)
    return {"alpha_s": alpha, "beta_bytes_s": 1.0 / slope if slope > 0 else float("inf"),
            "max_rel_residual": max(abs(alpha + x * slope - y) / y for x, y in zip(xs, ys))}


def measure_comm(world: int = 2, repeats: int = 5) -> Dict[str, Any]:
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


def measure_kernels(repeats: int = 5) -> Dict[str, float]:
    """FLOP/s of a matmul and of causal attention forward + backward, one thread."""
    import torch
    import torch.nn.functional as F
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(1024, 1024)
        torch.mm(a, a)
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, a)
        mm = 2 * 1024 ** 3 * repeats / (time.perf_counter() - t0)
        n, h, d = 2048, 8, 64
        q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for _ in range(3))
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            if i:
                times.append(time.perf_counter() - t0)
        attn = 3 * 2 * (n / 2) * h * (d + d) * n / statistics.median(times)
    finally:
        torch.set_num_threads(threads)
    return {"matmul_flops_s": mm, "attention_flops_s": attn}


def cpu_profile(comm: Dict[str, Any], kernels: Dict[str, float]) -> Gpu:
    """A profile whose "peaks" are the measured rates and whose efficiencies are 1."""
    a2a = comm["all_to_all"]
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    tflops = kernels["matmul_flops_s"] / 1e12
    link_gb_s = a2a["beta_bytes_s"] / 1e9
    raw = {"name": "cpu-calibrated", "description": f"this machine ({platform.processor() or platform.machine()}), gloo",
           "sources": {"measured": "ds-seqpar plan --calibrate (all-to-all alpha/beta, matmul and SDPA throughput)"},
           "datasheet_peaks": {"memory_gb": mem_gb, "bf16_tflops": tflops, "tf32_tflops": tflops, "hbm_tb_s": 0.0,
                               "nvlink_gb_s_per_direction": link_gb_s, "inter_node_gb_s_per_gpu": link_gb_s,
                               "pcie_gb_s_per_direction": link_gb_s, "host_memory_gb_per_node": mem_gb},
           "assumed": {"usable_memory_fraction": 1.0, "runtime_reserve_gb": 0.0, "matmul_efficiency": 1.0,
                       "attention_efficiency": kernels["attention_flops_s"] / kernels["matmul_flops_s"],
                       "nvlink_efficiency": 1.0, "inter_node_efficiency": 1.0, "alpha_intra_us": a2a["alpha_s"] * 1e6,
                       "alpha_inter_us": a2a["alpha_s"] * 1e6, "cpu_adam_params_per_s": 1e8}}
    return from_dict(raw, "calibrated")


def predict_speedups(comm: Dict[str, Any], kernels: Dict[str, float], meta: Dict[str, Any], n: int,
                     overlap: bool = True) -> Dict[str, float]:
    """Attention fwd+bwd speedup over one process at P ranks, per strategy: the single-process time
    from the attention FLOP rate, the busiest rank's share of it (the contiguous ring does
    (2P-1)/P of the average), plus the all-to-alls (not overlapped) or the ring's exposed excess."""
    from .hardware import Link
    p, e = meta["world"], 4 if meta["dtype"] == "fp32" else 2
    h, kv, d = meta["heads"], meta["kv_heads"], meta["head_dim"]
    single = 3 * 2 * (n / 2) * h * (d + d) * n / kernels["attention_flops_s"]
    sh = Shapes(meta["batch"], n, h, kv, d, e)
    out = {}
    for strategy in STRATEGIES:
        by_kind = closed_form_by_kind(strategy, p, sh)
        compute = single / p * ((2 * p - 1) / p if strategy == "ring" else 1.0)
        if strategy == "ulysses":
            link = Link(comm["all_to_all"]["alpha_s"], comm["all_to_all"]["beta_bytes_s"])
            comm_s = link.time(by_kind["all_to_all"], 8)
        else:
            link = Link(comm["ring"]["alpha_s"], comm["ring"]["beta_bytes_s"])
            comm_s = times.ring_time(link, by_kind["ring"] + by_kind["ring_grad"], p, compute, overlap)
        out[strategy] = single / (compute + comm_s)
    return out


__all__ = ["cpu_profile", "fit_alpha_beta", "measure_comm", "measure_kernels", "predict_speedups"]
