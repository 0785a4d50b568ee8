"""The hybrids' linear-attention, SSM and convolution adapters, as one import (the tools and the main job
read these names); the code is in hf/linear/, one small file per family (its __init__ lists them)."""
from .linear.delta_rule import delta_rule_map
from .linear.families import HYBRID_MODEL_TYPES, LAYER_OPS, LINEAR_LAYER_TYPES, linear_modules
from .linear.fold import with_state_in
from .linear.mixers import LinearMixers
from .linear.seams import install_seams
from .linear.ssd import ssd_map

__all__ = ["LAYER_OPS", "LINEAR_LAYER_TYPES", "HYBRID_MODEL_TYPES", "LinearMixers",
           "install_seams", "linear_modules", "delta_rule_map", "ssd_map", "with_state_in"]
