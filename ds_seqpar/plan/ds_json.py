"""The DeepSpeed JSON of a chosen configuration, in the shape of configs/long_context.json, so the
main job (``python -m ds_seqpar.train --deepspeed_config ds.json``) and transformers'
``TrainingArguments(deepspeed="ds.json", per_device_train_batch_size=1)`` take it as is: what the plan
chose (one sequence per rank, dtype, ZeRO, strategy, memory features) is written out; what the
Trainer's arguments own (learning rate, Adam's betas, eps, weight decay, clipping, accumulation) is
"auto", which transformers fills from its arguments and the main job from its defaults."""
from __future__ import annotations

from typing import Any, Dict

from ..cost.candidate import Candidate


def ds_config(c: Candidate, dtype: str, hybrid: bool, ulysses_chunks: int = 1) -> Dict[str, Any]:
    section: Dict[str, Any] = {"strategy": c.strategy, "size": c.size}
    if c.ulysses_size > 1 and c.strategy != "ulysses":
        section["ulysses_size"] = c.ulysses_size
    if ulysses_chunks > 1:                       # the plan's head chunks (cost/chunks.py), as chosen
        section["ulysses_chunks"] = ulysses_chunks
    if hybrid:
        section["linear_strategy"] = c.linear_strategy
    if c.strategy == "lasp":
        section["lasp_comm"] = c.lasp_comm
    zero: Dict[str, Any] = {"stage": c.zero, "overlap_comm": False, "contiguous_gradients": True,
                            "reduce_bucket_size": 50_000_000}
    adam = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True}
    if c.features.on:
        section["tiled_loss_tokens"] = c.features.tiled_loss_tokens
        section["tiled_mlp_tokens"] = c.features.tiled_mlp_tokens
    if c.features.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        adam.pop("torch_adam")                   # DeepSpeed's CPU Adam runs the offloaded step
    out: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
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
