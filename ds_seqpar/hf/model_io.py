"""Loading a local Hugging Face causal LM: a model directory with weights (from_pretrained), or a
config without weights (a config JSON file, or a directory with only config.json: from_config,
random init from torch's current seed). There is no hub access: paths only.
"""
from __future__ import annotations

import json
import os

import torch

from ..config import ConfigError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class ModelLoadError(ConfigError):
    """A --model path that cannot be loaded (same message on every rank)."""


def has_weights(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in WEIGHT_FILES)


def load_config(path: str):
    """The model config at ``path`` (a JSON file with model_type, or a model directory)."""
    from transformers import AutoConfig
    if not os.path.exists(path):
        raise ModelLoadError(f"--model {path!r} does not exist: pass a local Hugging Face model directory "
                             f"(config.json + weights) or a config JSON file")
    try:
        if os.path.isdir(path):
            return AutoConfig.from_pretrained(path, local_files_only=True)
        with open(path) as f:
            raw = json.load(f)
        if "model_type" not in raw:
            raise ModelLoadError(f"--model {path!r}: the config JSON has no 'model_type' (e.g. \"llama\")")
        return AutoConfig.for_model(**raw)
    except (OSError, ValueError, json.JSONDecodeError) as err:
        if isinstance(err, ModelLoadError):
            raise
        raise ModelLoadError(f"--model {path!r}: {err}") from None


def auto_class(config):
    """The causal LM auto class, or the image-text one for a vision-language config it does not map
    (Qwen-VL, LLaVA, ...: their language model is trained with the towers, docs/hf.md)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    model_type = getattr(config, "model_type", "")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32, config=None):
    """(model, loaded_weights): from_pretrained when ``path`` holds weights, else from_config."""
    config = config if config is not None else load_config(path)
    auto = auto_class(config)
    try:
        if has_weights(path):
            return auto.from_pretrained(path, config=config, dtype=dtype, local_files_only=True,
                                        attn_implementation="sdpa"), True
        return auto.from_config(config, dtype=dtype, attn_implementation="sdpa"), False
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"--model {path!r}: transformers could not build a causal LM from it: {err}") from None


__all__ = ["ModelLoadError", "auto_class", "has_weights", "load_config", "load_causal_lm"]
