"""The hybrid suite's case vocabulary: the families (one linear layer of a Hugging Face hybrid each,
built from the model type's own config class) and the sequence-parallel cases a layer runs under."""
from __future__ import annotations

from typing import List

SP_CASES = {"lasp_allgather": dict(linear_strategy="lasp", lasp_comm="allgather"),
            "lasp_ring": dict(linear_strategy="lasp", lasp_comm="ring"),
            "ulysses": dict(linear_strategy="ulysses")}
# family -> (as in, model type, config keys): one linear layer of the model's own classes; head sizes as
# the named models', fewer heads (one CPU thread per rank)
FAMILIES = {
    "gdn": ("Qwen3.5 gated DeltaNet", "qwen3_5_text", dict(
        layer_types=["linear_attention"], linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4)),
    "kda": ("Kimi-Linear delta attention", "kimi_linear", dict(
        layer_types=["linear_attention"], linear_num_heads=2, linear_head_dim=32, linear_conv_kernel_dim=4)),
    "ssd": ("Bamba / Nemotron-H Mamba2 SSD", "bamba", dict(
        attn_layer_indices=[], mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=2, mamba_d_state=128,
        mamba_chunk_size=128, mamba_expand=1, mamba_d_conv=4)),
    "lightning": ("MiniMax lightning attention", "minimax", dict(
        layer_types=["linear_attention"], num_attention_heads=4, head_dim=128, block_size=256)),
    "conv": ("LFM2 gated short convolution", "lfm2", dict(layer_types=["conv"], conv_L_cache=3)),
}
_BASE = dict(num_hidden_layers=1, intermediate_size=256, num_key_value_heads=4, vocab_size=256, use_cache=False,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_local_experts=2,
             num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64)


def family_config(name: str, hidden: int):
    """The family's model type's own config class with one linear layer at width ``hidden``."""
    from transformers import CONFIG_MAPPING
    _, model_type, keys = FAMILIES[name]
    cls = CONFIG_MAPPING[model_type]
    known = cls().to_dict()
    kw = {k: v for k, v in _BASE.items() if k in known}
    return cls(**dict(kw, hidden_size=hidden, **keys))


def family_cases(name: str) -> List[str]:
    """A short conv has no state: lasp ring and ulysses run the same halo as allgather."""
    return ["single", "halves"] + (["lasp_allgather"] if name == "conv" else list(SP_CASES))


def family_sizes(fam: str, hidden: int) -> str:
    c = family_config(fam, hidden)
    keys = {"gdn": ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                    "linear_conv_kernel_dim"),
            "kda": ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"),
            "ssd": ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_chunk_size", "mamba_d_conv"),
            "lightning": ("num_attention_heads", "head_dim", "block_size"), "conv": ("conv_L_cache",)}[fam]
    return ", ".join(f"{k}={getattr(c, k)}" for k in keys)


__all__ = ["FAMILIES", "SP_CASES", "family_config", "family_cases", "family_sizes"]
