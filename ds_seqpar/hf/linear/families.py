"""Which layer classes of transformers' hybrids are adapted, and the module-level ops each one's training
forward calls (exactly once each). A leaf: checks.py reads these tables, the adapters import checks.py."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch.nn as nn

CONV = "causal_conv1d_fn"
SSD = "mamba2_chunk_scan"
FUSED = "mamba2_split_conv1d_scan_combined"     # mamba_ssm's whole-layer kernel: no state input, switched off
OPTIONAL = frozenset({FUSED})                   # called in training only
_GDN = (CONV, "torch_chunk_gated_delta_rule")
_KDA = (CONV, "chunk_kimi_delta_attention")
_MAMBA2 = (FUSED, CONV, SSD)
LIGHTNING = "lightning"                         # MiniMax: an inline loop, no op to hook: the forward is replaced
# layer class -> the module-level ops its training forward calls, each exactly once
LAYER_OPS: Dict[str, Tuple[str, ...]] = {
    "Qwen3NextGatedDeltaNet": _GDN, "Qwen3_5GatedDeltaNet": _GDN, "Qwen3_5MoeGatedDeltaNet": _GDN,
    "OlmoHybridGatedDeltaNet": _GDN,
    "KimiLinearDeltaAttention": _KDA, "BailingHybridDeltaAttention": _KDA,
    "Lfm2ShortConv": (CONV,), "Lfm2MoeShortConv": (CONV,), "Lfm3ShortConv": (CONV,),
    "Mamba2Mixer": _MAMBA2, "BambaMixer": _MAMBA2, "GraniteMoeHybridMambaLayer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2, "FalconH1Mixer": _MAMBA2, "Zamba2MambaMixer": _MAMBA2,
    "MiniMaxLightningAttention": (LIGHTNING,),
}
# model types whose every linear layer type is one of the adapted classes above (tests/dist/test_hf_zoo.py
# sweeps them): config-only checks (the main job's, before any process starts) let their linear
# layer types through; apply_sequence_parallel still verifies the modules (checks.check_modules)
HYBRID_MODEL_TYPES = frozenset({
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear",
    "bailing_hybrid", "lfm2", "lfm2_moe", "lfm3", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2",
    "mamba2", "minimax"})
# layer types that hold an adapted mixer (checks.check_modules verifies each does); "hybrid":
# Falcon-H1's attention and Mamba2 side by side
LINEAR_LAYER_TYPES = ("linear_attention", "conv", "mamba", "hybrid")


def linear_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in LAYER_OPS]


__all__ = ["LAYER_OPS", "HYBRID_MODEL_TYPES", "LINEAR_LAYER_TYPES", "CONV", "SSD", "FUSED", "OPTIONAL", "LIGHTNING",
           "linear_modules"]
