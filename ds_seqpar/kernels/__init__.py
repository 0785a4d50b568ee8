"""Local attention kernels returning (out, lse), each with a backward that takes the saved lse.

``get_kernel(backend, device)`` resolves a backend name. ``auto`` picks flash_attn on CUDA when it
is installed, else torch, and logs the choice; an explicit backend that cannot run here is an
error, never a silent substitute.
"""
import logging

import torch

from ..errors import ConfigError
from . import flash_attn_kernel
from .base import AttentionKernel, LocalAttention, local_attention
from .math_kernel import MathKernel
from .merge import acc_dtype, empty_accumulators, merge_
from .torch_kernel import TorchKernel

logger = logging.getLogger("ds_seqpar")

BACKENDS = ("auto", "flash_attn", "torch", "math")


def get_kernel(backend: str, device: torch.device) -> AttentionKernel:
    device = torch.device(device)
    if backend == "auto":
        backend = "flash_attn" if device.type == "cuda" and flash_attn_kernel.available() else "torch"
        logger.info("ds_seqpar: sequence_parallel.backend=auto picked %r on %s", backend, device.type)
    if backend == "flash_attn":
        if device.type != "cuda" or not flash_attn_kernel.available():
            raise ConfigError(
                f"sequence_parallel.backend='flash_attn' needs CUDA and the flash-attn package "
                f"(device here: {device.type}, flash-attn installed: {flash_attn_kernel.available()}); "
                f"use backend 'torch' or 'auto', or pip install 'ds_seqpar[cuda]' on a GPU machine")
        return flash_attn_kernel.FlashAttnKernel()
    if backend == "torch":
        return TorchKernel()
    if backend == "math":
        return MathKernel()
    raise ConfigError(f"sequence_parallel.backend={backend!r} is not valid; choose one of: {', '.join(BACKENDS)}")


__all__ = ["AttentionKernel", "LocalAttention", "local_attention", "get_kernel", "MathKernel", "TorchKernel",
           "merge_", "empty_accumulators", "acc_dtype"]
