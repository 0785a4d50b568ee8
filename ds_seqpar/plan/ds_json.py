"""The DeepSpeed JSON of a chosen configuration, in the shape of configs/long_context.json, so the
main job (``python -m ds_seqpar.train --deepspeed_config ds.json``) takes it as is."""
from __future__ import annotations

from typing import Any, Dict

from ..cost.candidate import Candidate


def ds_config(c: Candidate, dtype: str, hybrid: bool) -> Dict[str, Any]:
    section: Dict[str, Any] = {"strategy": c.strategy, "size": c.size}
    if c.ulysses_size > 1 and c.strategy != "ulysses":
        section["ulysses_size"] = c.ulysses_size
    if hybrid:
        section["linear_strategy"] = c.linear_strategy
    if c.strategy == "lasp":
        section["lasp_comm"] = c.lasp_comm
    zero: Dict[str, Any] = {"stage": c.zero, "overlap_comm": False, "contiguous_gradients": True,
                            "reduce_bucket_size": 50_000_000}
    adam = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01, "torch_adam": True}
    if c.features.on:
        section["tiled_loss_tokens"] = c.features.tiled_loss_tokens
        section["tiled_mlp_tokens"] = c.features.tiled_mlp_tokens
    if c.features.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        adam.pop("torch_adam")                   # DeepSpeed's CPU Adam runs the offloaded step
    out: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000000,
        "optimizer": {"type": "AdamW", "params": adam},
        "zero_optimization": zero,
        "sequence_parallel": section,
    }
    if dtype != "fp32":
        out[dtype] = {"enabled": True}
    if c.features.on:
        out["activation_checkpointing"] = {"cpu_checkpointing": bool(c.features.cpu_checkpointing)}
    return out


__all__ = ["ds_config"]
