"""What every entry point (the main job, SequenceParallelTrainer) measures per step and how ranks are
reduced, so that both log the same numbers under the same names (docs/dashboards.md)."""
from __future__ import annotations

import time
from typing import Dict, Mapping

import torch

from . import comm


def compute_clock(device: torch.device) -> float:
    """CPU: this process's CPU time, so waiting on a slower peer does not count as compute.
    CUDA: wall time after a sync (kernels are asynchronous; CPU time says nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def gather_ranks(sp, values: Mapping[str, float]) -> Dict[str, torch.Tensor]:
    """Every rank's ``values`` over the sequence x data ranks, one small all-gather (a collective:
    every rank calls it): {key: float64 [world]}."""
    keys = list(values)
    mine = torch.tensor([[float(values[k]) for k in keys]], dtype=torch.float64, device=sp.device)
    every = comm.all_gather_nograd(mine, 0, sp.groups.seq_data_group).cpu()
    return {k: every[:, i] for i, k in enumerate(keys)}


def compute_imbalance(sp, compute_s: torch.Tensor) -> float:
    """max / mean of the ranks' compute time inside each sequence group, the worst group's."""
    per_group = compute_s.view(sp.dp_size, sp.size)
    return (per_group.max(1).values / per_group.mean(1).clamp(min=1e-12)).max().item()


__all__ = ["compute_clock", "gather_ranks", "compute_imbalance"]
