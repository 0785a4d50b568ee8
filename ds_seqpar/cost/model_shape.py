"""The numbers of a model the cost model needs: the one reader of model sizes. Every price reads
its model here: the dynamic scheduler's (cost/documents.py), the planner's and the benchmarks'.

    ModelShape.of_lm(cfg)      the project's own LM (models/lm.py's ModelConfig, read by attribute)
    from_hf_config(config)     a Hugging Face config (any object with the config's attributes; nothing
                               is built, no weights are read)
    ModelShape()               the own LM at its default sizes, its LM head left out (vocab 0): what
                               the scheduler prices when it is told nothing of the model

Legend: h hidden size, L layers, H / H_kv query / key-value heads, d head dim, I MLP width,
V vocabulary. Layer kinds: "attention" (softmax over the whole sequence), "sliding" (softmax in a
window), "linear" (a linear-attention / delta-rule layer: a [H_lin, dk, dv] state), "mamba"
(Mamba2 SSD: a [heads, d_head, d_state] state, transition "scalar"; Mamba-1's selective scan: a
[channels, d_state] state, transition "diagonal", heads = channels, dv = 1), "indexed" (DeepSeek
sparse attention: MLA whose latents and indexer keys travel, hf/indexed.py; "indexed_shared" reuses an
earlier layer's selection: no indexer keys), "lasp" (the project's own LM with --attention linear: q,
k, v, o projections like softmax, a [H, d, d] state per head, sp.linear_attention), "mlp" (a layer
without a token mixer).
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .candidate import LINEAR_KINDS, SOFTMAX_KINDS

_KIND_OF = {"full_attention": "attention", "attention": "attention", "sliding_attention": "sliding",
            "chunked_attention": "sliding", "indexed_attention": "indexed", "linear_attention": "linear",
            "reference_sliding_attention": "attention",     # causal in training (hf/checks.py)
            "mamba": "mamba", "hybrid": "mamba",
            "conv": "linear", "mlp": "mlp", "moe": "mlp"}


OWN_LM = "ds_seqpar_lm"                 # the own LM's model_type (configs/plan/own_lm_linear.json)


@dataclass(frozen=True)
class ModelShape:
    name: str = "lm"                         # (defaults: the own LM's default sizes, no head: module doc)
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 32
    intermediate: int = 352
    vocab: int = 0
    tied: bool = False
    kinds: Tuple[str, ...] = ()              # one per layer; () = every layer "attention"
    window: Optional[int] = None
    v_head_dim: Optional[int] = None
    experts: int = 0                         # MoE: routed experts (0: dense MLP)
    active_experts: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    lin_heads: int = 0                       # linear / SSD layers: heads, key (state) and value dims
    lin_dk: int = 0
    lin_dv: int = 0
    lin_key_heads: int = 0                   # gated DeltaNet: q / k heads (0: lin_heads)
    lin_groups: int = 1                      # SSD: the B / C groups
    conv_channels: int = 0                   # the short conv before the op: its channels (the halo's width)
    conv_width: int = 0
    linear_op: str = ""                      # the op: delta_rule | kda | ssd | selective_scan | lightning | conv
    #                                          (its inputs and output are what linear_strategy ulysses sends)
    transition: str = "matrix"               # linear layers' state map: matrix (delta rule) | scalar (SSD)
    #                                          | diagonal (Mamba-1)
    dt_rank: int = 0                         # Mamba-1: the rank of the step's projection
    latent_dim: int = 0                      # indexed layers: MLA latents per token (kv_lora_rank + rope dim)
    index_dim: int = 0                       # indexed layers: the indexer key per token (0: a shared selection)
    model_type: str = ""
    hybrid: bool = False                     # transformers hybrid (linear layers through hf/linear/)

    @classmethod
    def of_lm(cls, cfg, name: str = "lm") -> "ModelShape":
        """The project's own LM from its ModelConfig (models/lm.py; read by attribute, validated there):
        softmax, a Llama-style shape; linear attention, every layer "lasp" (one [d, d] state per q head,
        the decay fixed: transition "fixed")."""
        linear = cfg.attention == "linear"
        return cls(name, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden,
                   cfg.vocab_size, tied=cfg.tie_embeddings, kinds=("lasp",) * cfg.n_layers if linear else (),
                   lin_heads=cfg.n_heads if linear else 0, lin_dk=cfg.head_dim if linear else 0,
                   lin_dv=cfg.head_dim if linear else 0, transition="fixed", model_type=OWN_LM)

    @property
    def dv(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def layer_kinds(self) -> Tuple[str, ...]:
        return self.kinds or ("attention",) * self.layers

    @property
    def layer_windows(self) -> Tuple[Optional[int], ...]:
        """Each layer's sliding window (None: none). transformers gives the window to the layers that
        layer_types marks sliding (every layer of a Mistral-style config without layer_types)."""
        return tuple(self.window if k == "sliding" else None for k in self.layer_kinds)

    def softmax_windows(self) -> Dict[Optional[int], int]:
        """{window: softmax layers with it} (None: full attention)."""
        return Counter(w for k, w in zip(self.layer_kinds, self.layer_windows) if k in SOFTMAX_KINDS)

    def count(self, kind: str) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    # -- parameters ------------------------------------------------------------------------------

    def mixer_params(self, kind: str) -> int:
        h = self.hidden
        if kind in SOFTMAX_KINDS or kind == "lasp":
            return h * self.q_dim + 2 * h * self.kv_dim + self.heads * self.dv * h
        if kind == "linear":                 # q, k (dk), v (dv), gates ~ z (dv), out
            return h * self.lin_heads * (2 * self.lin_dk + 2 * self.lin_dv) + self.lin_heads * self.lin_dv * h
        if kind == "mamba" and self.transition == "diagonal":    # in_proj (x, z), x_proj (dt, B, C), dt_proj, out_proj
            c, r = self.lin_heads, self.dt_rank
            return 2 * h * c + c * (r + 2 * self.lin_dk) + r * c + c * h
        if kind == "mamba":                  # in_proj (x, z, B, C, dt) and out_proj
            inner = self.lin_heads * self.lin_dv
            return h * (2 * inner + 2 * self.lin_groups * self.lin_dk + self.lin_heads) + inner * h
        return 0

    def mlp_params(self, active: bool = False) -> int:
        """Dense MLP (gate, up, down), or MoE: routed experts (all of them, or the active ones) +
        shared experts + router."""
        h = self.hidden
        if not self.experts:
            return 3 * h * self.intermediate
        n = self.active_experts if active else self.experts
        return 3 * h * self.expert_intermediate * n + 3 * h * self.shared_intermediate + h * self.experts

    @functools.cached_property
    def matmul_params(self) -> int:
        """Multiply-adds per token of the linear layers a token passes: every layer's mixer projections
        and its MLP (the active experts), and the LM head (vocab x hidden; none when vocab is 0).
        Cached: the scheduler asks for it once per document (a frozen dataclass keeps it in __dict__)."""
        per_layer = sum(self.mixer_params(k) + self.mlp_params(active=True) for k in self.layer_kinds)
        return per_layer + self.vocab * self.hidden

    def ulysses_tensors(self, n: int, size: int) -> Tuple[int, ...]:
        """Elements on one rank of each tensor a linear layer's op all-to-alls under linear_strategy
        ulysses (its inputs and its output; each also back in backward), ``n`` tokens per rank of
        ``size``: gated DeltaNet q, k, v, out, beta, g; Kimi delta attention q, k, v, g, out, beta; SSD
        x, out, dt, B, C; Mamba-1 x, dt, z, out per channel, B and C whole; lightning q, k, v, out;
        a short conv alone none (its halo is all it sends)."""
        hv, hk, dk, dv = self.lin_heads, self.lin_key_heads or self.lin_heads, self.lin_dk, self.lin_dv
        by_op = {"delta_rule": (n * hk * dk,) * 2 + (n * hv * dv,) * 2 + (n * hv,) * 2,
                 "kda": (n * hv * dk,) * 5 + (n * hv,),
                 "ssd": (n * hv * dv,) * 2 + (n * hv,) + (n * self.lin_groups * dk,) * 2,
                 "selective_scan": (n * hv,) * 4 + (n * size * dk,) * 2,
                 "lightning": (n * hv * dk,) * 4, "conv": ()}
        return by_op.get(self.linear_op, (n * hv * (2 * dk + 2 * dv),))

    def params(self) -> int:
        """All parameters (norm weights left out: h per norm, negligible)."""
        per_layer = sum(self.mixer_params(k) + self.mlp_params() for k in self.layer_kinds)
        return per_layer + self.vocab * self.hidden * (1 if self.tied else 2)


def _get(tc, *names, default=None):
    for n in names:
        v = getattr(tc, n, None)
        if v is not None:
            return v
    return default


def _layer_kinds(tc, layers: int) -> Tuple[str, ...]:
    types = _get(tc, "layer_types") or _get(tc, "layers_block_type")
    if types:
        return tuple(_KIND_OF.get(t, t) for t in types)
    attn = _get(tc, "attn_layer_indices")
    if attn is not None:
        return tuple("attention" if i in attn else "mamba" for i in range(layers))
    return ()


def _mamba1(tc, h: int, kinds: Tuple[str, ...], layers: int) -> Optional[dict]:
    """ModelShape fields of Mamba-1 selective-scan layers (Mamba and Falcon-Mamba: every layer; Jamba:
    its mamba layers, which its layer_types call linear_attention), None for any other config: channels,
    d_state, the conv over the channels, the step's rank ("auto": ceil(h / 16), as transformers reads it)."""
    pure = getattr(tc, "model_type", "") in ("mamba", "falcon_mamba")      # (Mamba2's config has state_size too)
    if not pure and (_get(tc, "mamba_d_state") is None or _get(tc, "mamba_n_heads") is not None
                     or _get(tc, "mamba_dt_rank") is None):
        return None
    channels = int(tc.intermediate_size) if pure else int(_get(tc, "mamba_expand")) * h
    rank = _get(tc, "time_step_rank", "mamba_dt_rank")
    out = dict(lin_heads=channels, lin_dk=int(_get(tc, "state_size", "mamba_d_state")), lin_dv=1,
               conv_channels=channels, conv_width=int(_get(tc, "conv_kernel", "mamba_d_conv", default=4)),
               transition="diagonal", dt_rank=-(-h // 16) if rank == "auto" else int(rank), linear_op="selective_scan")
    if pure:                            # mixer-only blocks: no MLP, no attention
        out.update(kinds=("mamba",) * layers, intermediate=0)
    else:
        out.update(kinds=tuple("mamba" if k == "linear" else k for k in kinds))
    return out


def _linear_layers(tc, heads: int, head_dim: int) -> dict:
    """ModelShape fields of the linear layers of a hybrid other than Mamba-1 (_mamba1), {} for none:
    Mamba2 SSD (a conv over x, B and C), gated DeltaNet (a conv over q, k, v), Kimi delta attention (q,
    k, v), MiniMax's lightning attention (the softmax heads' sizes, a fixed decay, no conv), LFM2's gated
    short convolution (a conv over the hidden width, no state)."""
    if _get(tc, "mamba_n_heads"):
        h, state, d = (int(_get(tc, k)) for k in ("mamba_n_heads", "mamba_d_state", "mamba_d_head"))
        groups = int(_get(tc, "mamba_n_groups", default=1))
        return dict(lin_heads=h, lin_dk=state, lin_dv=d, lin_groups=groups, conv_channels=h * d + 2 * groups * state,
                    conv_width=int(_get(tc, "mamba_d_conv", default=4)), transition="scalar", linear_op="ssd")
    if _get(tc, "linear_num_value_heads"):
        hk, hv = int(tc.linear_num_key_heads), int(tc.linear_num_value_heads)
        dk, dv = int(tc.linear_key_head_dim), int(tc.linear_value_head_dim)
        return dict(lin_heads=hv, lin_key_heads=hk, lin_dk=dk, lin_dv=dv, conv_channels=2 * hk * dk + hv * dv,
                    conv_width=int(_get(tc, "linear_conv_kernel_dim", default=4)), transition="matrix",
                    linear_op="delta_rule")
    if _get(tc, "linear_num_heads"):
        h, d = int(tc.linear_num_heads), int(tc.linear_head_dim)
        return dict(lin_heads=h, lin_dk=d, lin_dv=d, conv_channels=3 * h * d,
                    conv_width=int(_get(tc, "linear_conv_kernel_dim", default=4)), transition="matrix", linear_op="kda")
    if getattr(tc, "model_type", "") == "minimax":
        return dict(lin_heads=heads, lin_dk=head_dim, lin_dv=head_dim, transition="fixed", linear_op="lightning")
    if _get(tc, "conv_L_cache"):
        return dict(conv_channels=int(tc.hidden_size), conv_width=int(tc.conv_L_cache), linear_op="conv")
    return {}


def from_hf_config(config, name: str = "model", hybrid_types=()) -> ModelShape:
    """ModelShape of a transformers config (its text config for a multimodal one)."""
    getter = getattr(config, "get_text_config", None)
    tc = getter(decoder=True) if getter else config
    h, layers = int(tc.hidden_size), int(tc.num_hidden_layers)
    heads = int(_get(tc, "num_attention_heads", default=1))      # (Mamba: none; no softmax layer reads it)
    kv = int(_get(tc, "num_key_value_heads", default=heads))
    head_dim = int(_get(tc, "head_dim", default=h // heads))
    kinds = _layer_kinds(tc, layers)
    window = _get(tc, "sliding_window")
    if window is not None and (getattr(tc, "use_sliding_window", True) is False or
                               (kinds and "sliding" not in kinds and _get(tc, "layer_types"))):
        window = None
    if window is not None and not _get(tc, "layer_types"):
        kinds = ("sliding",) * layers                    # Mistral-style: every layer windowed
    experts = int(_get(tc, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    lin = _mamba1(tc, h, kinds, layers) or _linear_layers(tc, heads, head_dim)   # {}: no linear layers
    shared = [i for i, t in enumerate(_get(tc, "indexer_types") or ()) if t == "shared"]
    kinds = tuple("indexed_shared" if k == "indexed" and i in shared else k for i, k in enumerate(kinds))
    if "indexed" in kinds:
        lin.update(latent_dim=int(tc.kv_lora_rank) + int(tc.qk_rope_head_dim), index_dim=int(tc.index_head_dim))
    lin = dict(dict(intermediate=int(_get(tc, "intermediate_size", default=4 * h)), kinds=kinds), **lin)
    return ModelShape(
        name=name, hidden=h, layers=layers, heads=heads, kv_heads=kv, head_dim=head_dim, vocab=int(tc.vocab_size),
        tied=bool(_get(tc, "tie_word_embeddings", default=False)),
        window=None if window is None else int(window), v_head_dim=_get(tc, "v_head_dim"),
        experts=experts, active_experts=int(_get(tc, "num_experts_per_tok", default=0) or 0),
        expert_intermediate=int(_get(tc, "moe_intermediate_size", default=_get(tc, "intermediate_size")) or 0),
        shared_intermediate=int(_get(tc, "shared_expert_intermediate_size", default=0) or 0),
        model_type=str(getattr(tc, "model_type", "")), hybrid=str(getattr(tc, "model_type", "")) in hybrid_types,
        **lin)


__all__ = ["LINEAR_KINDS", "ModelShape", "OWN_LM", "SOFTMAX_KINDS", "from_hf_config"]
