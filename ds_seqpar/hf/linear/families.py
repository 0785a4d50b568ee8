"""Which layer classes of transformers' hybrids are adapted, and the module-level ops each one's training
forward calls (exactly once each). A leaf: checks.py reads these tables, the adapters import checks.py."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch.nn as nn

CONV = "causal_conv1d_fn"
SSD = "mamba2_chunk_scan"
SCAN = "mamba_selective_scan"                   # Mamba-1's scan (no initial state: composed, selective_scan.py)
# mamba_ssm's whole-layer kernels (Mamba2's, Mamba-1's): no state input, switched off; called in training only
FUSED = frozenset({"mamba2_split_conv1d_scan_combined", "mamba_inner_fn"})
OPTIONAL = FUSED
_GDN = (CONV, "torch_chunk_gated_delta_rule")
_KDA = (CONV, "chunk_kimi_delta_attention")
_MAMBA2 = ("mamba2_split_conv1d_scan_combined", CONV, SSD)
_MAMBA1 = ("mamba_inner_fn", CONV, SCAN)
LIGHTNING = "lightning"                         # MiniMax: an inline loop, no op to hook: the forward is replaced
# layer class -> the module-level ops its training forward calls, each exactly once (but see calls_per_forward)
LAYER_OPS: Dict[str, Tuple[str, ...]] = {
    "Qwen3NextGatedDeltaNet": _GDN, "Qwen3_5GatedDeltaNet": _GDN, "Qwen3_5MoeGatedDeltaNet": _GDN,
    "OlmoHybridGatedDeltaNet": _GDN,
    "KimiLinearDeltaAttention": _KDA, "BailingHybridDeltaAttention": _KDA,
    "Lfm2ShortConv": (CONV,), "Lfm2MoeShortConv": (CONV,), "Lfm3ShortConv": (CONV,),
    "Mamba2Mixer": _MAMBA2, "BambaMixer": _MAMBA2, "GraniteMoeHybridMambaLayer": _MAMBA2,
    "NemotronHMamba2Mixer": _MAMBA2, "FalconH1Mixer": _MAMBA2, "Zamba2MambaMixer": _MAMBA2,
    "MiniMaxLightningAttention": (LIGHTNING,),
    "MambaMixer": _MAMBA1, "FalconMambaMixer": _MAMBA1, "JambaMambaMixer": (CONV, SCAN),
    "ZambaMambaMixer": (CONV, SCAN),
}
# layer class -> (op, the module attribute that says how often its forward calls it): Zamba scans each of its
# Mamba heads with its own call
REPEATED_OPS: Dict[str, Tuple[str, str]] = {"ZambaMambaMixer": (SCAN, "n_mamba_heads")}
# model types whose every linear layer type is one of the adapted classes above (tests/dist/test_hf_zoo.py
# sweeps them): config-only checks (the main job's, before any process starts) let their linear
# layer types through; apply_sequence_parallel still verifies the modules (checks.check_modules)
HYBRID_MODEL_TYPES = frozenset({
    "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear",
    "bailing_hybrid", "lfm2", "lfm2_moe", "lfm3", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2",
    "mamba2", "minimax", "mamba", "falcon_mamba", "jamba", "zamba"})
# layer types that hold an adapted mixer (checks.check_modules verifies each does); "hybrid":
# Falcon-H1's attention and Mamba2 side by side
LINEAR_LAYER_TYPES = ("linear_attention", "conv", "mamba", "hybrid")


# layer classes whose generate decodes from the states the sharded prefill leaves, tested exact against the
# unsharded model's generate (hf/linear/prefill.py; tests/dist/test_generate_hybrids.py); generate refuses the others
# (the others: MiniMax's lightning attention, whose replaced forward takes no cache; Zamba's and Zamba2's Mamba
# layers, whose shared attention blocks have no cache slot of their own)
DECODES = frozenset({
    "Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet",
    "KimiLinearDeltaAttention", "BailingHybridDeltaAttention",
    "Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv",
    "Mamba2Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "FalconH1Mixer",
    "MambaMixer", "FalconMambaMixer", "JambaMambaMixer"})

# the op that names a layer's family in messages: the layer's last op (its token mixer after the conv)
FAMILY_OF_OP = {CONV: "short causal convolution", _GDN[1]: "gated DeltaNet", _KDA[1]: "Kimi delta attention",
                SSD: "Mamba2 SSD scan", SCAN: "Mamba-1 selective scan", LIGHTNING: "lightning attention"}


def family(class_name: str) -> str:
    """The token mixer of an adapted layer class, in words (for messages)."""
    return FAMILY_OF_OP[LAYER_OPS[class_name][-1]]


def calls_per_forward(module: nn.Module) -> Dict[str, int]:
    """{op: how many times one training forward of ``module`` calls it} (the fused kernels: at most once)."""
    want = {op: 1 for op in LAYER_OPS[type(module).__name__]}
    op, attr = REPEATED_OPS.get(type(module).__name__, (None, None))
    if op is not None:
        want[op] = int(getattr(module, attr))
    return want


def linear_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in LAYER_OPS]


__all__ = ["LAYER_OPS", "DECODES", "HYBRID_MODEL_TYPES", "LINEAR_LAYER_TYPES", "CONV", "SSD", "SCAN",
           "FUSED", "OPTIONAL", "LIGHTNING", "calls_per_forward", "family", "linear_modules"]
