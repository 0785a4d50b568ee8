"""Models used by the main job and the end-to-end tests."""
from .lm import CausalLM, ModelConfig

__all__ = ["CausalLM", "ModelConfig"]
