"""What ``ds-seqpar plan`` is asked: the model (a Hugging Face config checked as the main job checks it,
or the project's own LM), packed documents, and the command line's numbers."""
from __future__ import annotations

import os
from typing import Optional, Tuple

from .hardware import PlanError, read_json
from ..cost.model_shape import OWN_LM, ModelShape, from_hf_config


def own_lm_shape(raw: dict, name: str) -> ModelShape:
    """The project's own LM (models/lm.py) from a JSON of its ModelConfig fields with "model_type":
    "ds_seqpar_lm" (configs/plan/own_lm_linear.json); validated by ModelConfig itself, read by the cost
    model's one reader (ModelShape.of_lm)."""
    from ..models.lm import ModelConfig
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        cfg = ModelConfig(**fields)
    except (TypeError, ValueError) as err:
        raise PlanError(f"--model {name}: not a ds_seqpar_lm config ({err}); keys are ModelConfig's: "
                        f"{', '.join(ModelConfig.__dataclass_fields__)}") from None
    return ModelShape.of_lm(cfg, name)


def load_model(path: str) -> ModelShape:
    """The HF config through the project's loader, checked as the main job checks it; or the
    project's own LM (own_lm_shape)."""
    from ..hf.checks import check_config, text_config
    from ..hf.linear.families import HYBRID_MODEL_TYPES
    from ..hf.model_io import load_config
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        raise PlanError(f"--model {path!r} is a directory without config.json; pass a Hugging Face model directory "
                        f"or a config JSON file (e.g. configs/models/llama_small.json)")
    if path.endswith(".json") and os.path.isfile(path):
        raw = read_json(path, "model")
        if isinstance(raw, dict) and raw.get("model_type") == OWN_LM:
            return own_lm_shape(raw, os.path.basename(path))
    config = load_config(path)
    model_type = getattr(text_config(config), "model_type", None)
    check_config(config, training=True, linear_ok=model_type in HYBRID_MODEL_TYPES)
    if model_type == "zamba":
        raise PlanError(f"--model {path!r}: model_type='zamba' (multi-head Mamba-1 mixers beside a shared attention "
                        f"block) trains sequence-parallel (docs/hybrids.md) but has no cost model in ds-seqpar plan "
                        f"yet; plan a Jamba or Mamba model of the same sizes")
    shape = from_hf_config(config, os.path.basename(path.rstrip("/")), HYBRID_MODEL_TYPES)
    if shape.count("indexed") or shape.count("indexed_shared"):
        raise PlanError(f"--model {path!r}: model_type={model_type!r} has DeepSeek sparse attention "
                        f"(indexed_attention layers), which trains sequence-parallel (docs/hf.md) but whose FLOPs "
                        f"and memory ds-seqpar plan does not model yet (only its bytes, cost/bytes.py); plan a "
                        f"softmax model of the same sizes")
    return shape


def equal_documents(seq: int, doc_len: Optional[int]) -> Optional[Tuple[int, ...]]:
    """``--doc-len``: documents of doc_len tokens packed into seq (the last one shorter)."""
    if not doc_len or doc_len >= seq:
        return None
    full, rest = divmod(seq, doc_len)
    return (doc_len,) * full + ((rest,) if rest else ())


def check_args(opts) -> None:
    for name in ("model", "seq_len", "gpus"):
        if getattr(opts, name) is None:
            raise PlanError(f"--{name.replace('_', '-')} is required")
    if opts.seq_len < 2 or opts.gpus < 1 or opts.gpus_per_node < 1:
        raise PlanError(f"--seq-len={opts.seq_len} must be >= 2, --gpus={opts.gpus} and "
                        f"--gpus-per-node={opts.gpus_per_node} >= 1")
    if opts.doc_len is not None and opts.doc_len < 1:
        raise PlanError(f"--doc-len={opts.doc_len} must be >= 1 (tokens per packed document)")
    if opts.gpus > opts.gpus_per_node and opts.gpus % opts.gpus_per_node:
        raise PlanError(f"--gpus={opts.gpus} is not a whole number of nodes of --gpus-per-node={opts.gpus_per_node}")


__all__ = ["OWN_LM", "check_args", "equal_documents", "load_model", "own_lm_shape"]
