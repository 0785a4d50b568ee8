"""What the cost model prices: a candidate configuration (layout, sizes, ZeRO stage, memory features)
of a model whose layers are of these kinds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

SOFTMAX_KINDS = ("attention", "sliding")
LINEAR_KINDS = ("linear", "mamba", "lasp")


@dataclass(frozen=True)
class Features:
    """The long-context memory features of a candidate."""

    on: bool = False                       # tiled loss + tiled MLP + checkpointing of every layer
    cpu_checkpointing: bool = True         # checkpoints in host memory (only matters with on)
    offload_optimizer: bool = False        # ZeRO optimizer state in host memory
    tiled_loss_tokens: int = 1024
    tiled_mlp_tokens: int = 4096

    @property
    def label(self) -> str:
        if not self.on:
            return "off"
        return "on" + ("+cpu-ckpt" if self.cpu_checkpointing else "") + ("+offload" if self.offload_optimizer else "")


@dataclass(frozen=True)
class Candidate:
    strategy: str
    size: int
    ulysses_size: int
    zero: int
    features: Features
    linear_strategy: str = "lasp"
    lasp_comm: str = "allgather"           # strategy lasp (the project's LM): allgather (LASP-2) | ring (LASP-1)
    ulysses_chunks: Union[int, str] = "auto"   # Ulysses head chunks; "auto": cost/chunks.py's price picks

    def label(self) -> str:
        comm = f" lasp_comm={self.lasp_comm}" if self.strategy == "lasp" else ""
        return (f"{self.strategy} size={self.size} u={self.ulysses_size}{comm} zero={self.zero} "
                f"features={self.features.label}")


__all__ = ["Candidate", "Features", "LINEAR_KINDS", "SOFTMAX_KINDS"]
