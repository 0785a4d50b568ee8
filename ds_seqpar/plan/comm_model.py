"""Alpha-beta times of the collectives the strategies and ZeRO use, per link class.

A group of ranks placed on consecutive ranks (Ulysses groups are: topology.py) stays inside a node
when it has at most gpus_per_node ranks; otherwise part of its traffic crosses the inter-node
fabric, whose per-GPU bandwidth is the bottleneck. Bytes are the bytes one rank SENDS (the closed
forms' unit), so each formula below divides them by one link's bandwidth:

    all-to-all       alpha x calls + B_intra / beta_nvlink, B_inter / beta_ib in parallel
                     (B_inter = the share of its peers off the node: (p - g) / (p - 1) of B)
    ring send/recv   per hop alpha + b / beta of the slowest hop (inter-node if the ring leaves
                     the node); with overlap only what exceeds the compute of the same step shows
    all-gather, reduce-scatter, all-reduce (ring algorithms): (p - 1) alpha + B / beta
"""
from __future__ import annotations

from typing import Optional

from .hardware import Gpu, Link


def spans_nodes(group_ranks: int, stride: int, gpus_per_node: int) -> bool:
    """A group of ``group_ranks`` ranks ``stride`` apart covers group_ranks x stride consecutive ranks."""
    return group_ranks * stride > gpus_per_node


def all_to_all_time(gpu: Gpu, nbytes: float, p: int, gpus_per_node: int, calls: int) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    if p <= gpus_per_node:
        return gpu.intra.time(nbytes, calls)
    off = (p - gpus_per_node) / (p - 1)
    return calls * gpu.inter.alpha_s + max(nbytes * (1 - off) / gpu.intra.beta_bytes_s,
                                           nbytes * off / gpu.inter.beta_bytes_s)


def ring_link(gpu: Gpu, r: int, stride: int, gpus_per_node: int) -> Link:
    return gpu.inter if spans_nodes(r, stride, gpus_per_node) else gpu.intra


def ring_time(gpu: Gpu, nbytes: float, r: int, stride: int, gpus_per_node: int, compute_s: float,
              overlap: bool = True, hops: Optional[int] = None) -> float:
    """Exposed time of ``nbytes`` sent over r - 1 hops (forward and backward passes together: 2 (r-1)
    hops; ``hops`` fewer where a mask leaves peers with nothing to send) beside ``compute_s`` seconds
    of attention compute spread evenly over the r steps."""
    if r <= 1 or nbytes <= 0:
        return 0.0
    hops = 2 * (r - 1) if hops is None else max(hops, 1)
    link = ring_link(gpu, r, stride, gpus_per_node)
    per_hop = link.alpha_s + nbytes / hops / link.beta_bytes_s
    if not overlap:
        return hops * per_hop
    per_step_compute = compute_s / (2 * r)
    return hops * max(0.0, per_hop - per_step_compute)


def collective_time(gpu: Gpu, nbytes: float, p: int, gpus_per_node: int) -> float:
    """All-gather / reduce-scatter / all-reduce by ring: ``nbytes`` sent per rank in p - 1 steps."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    link = gpu.inter if p > gpus_per_node else gpu.intra
    return link.time(nbytes, p - 1)


def zero_bytes(params: int, ranks: int, zero: int, grad_bytes: int, weight_bytes: int) -> float:
    """Bytes per rank per step of ZeRO's collectives over ``ranks``: gradients reduce-scattered
    (stage 1 all-reduces: twice) and the updated weights all-gathered; stage 3 gathers the weights
    once more for the backward."""
    if ranks <= 1:
        return 0.0
    frac = (ranks - 1) / ranks
    grads = grad_bytes * params * frac * (2 if zero == 1 else 1)
    weights = weight_bytes * params * frac * (2 if zero >= 3 else 1)
    return grads + weights


__all__ = ["all_to_all_time", "collective_time", "ring_link", "ring_time", "spans_nodes", "zero_bytes"]
