"""A small causal LM for the main job and the end-to-end tests.

Pre-norm decoder: token embedding -> n_layers x [RMSNorm, attention, RMSNorm, SwiGLU MLP] ->
RMSNorm -> lm head (tied to the embedding or not). Attention is either

* softmax: RoPE on q, k with the tokens' GLOBAL positions, then ``sp.attention`` (causal), or
* linear (strategy 'lasp'): q, k through the positive feature map elu+1, a fixed per-head decay
  lambda_h = 1 - 2^-(5+h) (RetNet's choice: heads see different horizons), ``sp.linear_attention``
  and a per-head RMSNorm of the output (TransNormer/LASP: keeps the un-normalised sums bounded).

With ``sp=None`` the same modules run on one process over the whole sequence (the plain
data-parallel reference): torch SDPA for softmax, the chunked single-process kernel for linear.
GQA: ``n_kv_heads`` < ``n_heads``; k/v are never repeated before ``sp`` (it handles groups).

Legend: B = batch, L = local tokens, H = q heads, Hkv = k/v heads, D = head dim, V = vocab.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.linear import linear_attention as local_linear_attention
from ..loss import sequence_loss
from ..memory.checkpointing import CHECKPOINT_KWARGS, checkpoint_layer


@dataclass
class ModelConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None      # None: = n_heads (MHA)
    mlp_hidden: Optional[int] = None      # None: 8/3 * dim rounded up to a multiple of 16
    attention: str = "softmax"            # softmax | linear
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.attention not in ("softmax", "linear"):
            raise ValueError(f"--attention={self.attention!r} is not valid; choose softmax or linear")
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"--dim={self.dim} must be divisible by --n_heads={self.n_heads}, and n_heads by "
                             f"--n_kv_heads={self.n_kv_heads}")
        if self.attention == "softmax" and (self.dim // self.n_heads) % 2:
            raise ValueError(f"RoPE needs an even head dim; --dim/--n_heads = {self.dim // self.n_heads}")
        self.mlp_hidden = self.mlp_hidden or 16 * math.ceil(8 * self.dim / 3 / 16)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def as_dict(self) -> dict:
        return asdict(self)


def rope(x_blhd: torch.Tensor, pos_bl: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding at the given global positions (rotate-half form), computed in fp32."""
    d = x_blhd.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x_blhd.device, dtype=torch.float32) / d)  # [D/2]
    angle_bld = pos_bl.to(torch.float32)[..., None] * inv_freq                                   # [B, L, D/2]
    cos, sin = angle_bld.cos()[:, :, None, :], angle_bld.sin()[:, :, None, :]        # [B, L, 1, D/2]
    x1, x2 = x_blhd.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_blhd.dtype)


def head_decay(n_heads: int, device=None) -> torch.Tensor:
    """The linear-attention decay per head, lambda_h = 1 - 2^-(5+h), fp32 [n_heads] (the benchmark
    times LASP with it too)."""
    return 1 - 2.0 ** (-5 - torch.arange(n_heads, dtype=torch.float32, device=device))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sp=None):
        super().__init__()
        self.cfg, self.sp = cfg, sp
        h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, h * d, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * hkv * d, bias=False)
        self.wo = nn.Linear(h * d, cfg.dim, bias=False)
        if cfg.attention == "linear":
            self.out_norm = nn.RMSNorm(d, eps=cfg.norm_eps)

    def decay_h(self) -> torch.Tensor:
        """Fixed, not learned (part of the architecture, like RetNet's gammas), and built in fp32 at
        each call rather than held as a buffer: module.bfloat16() would round 1 - 2^-9 and closer
        decays to exactly 1.0."""
        return head_decay(self.cfg.n_heads, self.wq.weight.device)

    def forward(self, x_bld: torch.Tensor, pos_bl: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """``cu_seqlens``: packed documents (global boundaries, batch 1); pos_bl then counts within each."""
        b, l, _ = x_bld.shape
        h, hkv, d = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        q_blhd = self.wq(x_bld).view(b, l, h, d)
        k_blhd, v_blhd = self.wkv(x_bld).view(b, l, 2 * hkv, d).split(hkv, dim=2)
        if self.cfg.attention == "linear":
            out_blhd = self._linear(F.elu(q_blhd) + 1, F.elu(k_blhd) + 1, v_blhd.contiguous(), cu_seqlens)
        else:
            q_blhd = rope(q_blhd, pos_bl, self.cfg.rope_theta)
            k_blhd = rope(k_blhd, pos_bl, self.cfg.rope_theta)
            out_blhd = self._softmax(q_blhd, k_blhd, v_blhd.contiguous(), cu_seqlens)
        return self.wo(out_blhd.reshape(b, l, h * d))

    def _softmax(self, q, k, v, cu_seqlens=None):
        if self.sp is not None:
            packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
            return self.sp.attention(q, k, v, causal=True, **packed)
        # one process, whole sequence in global order: plain causal SDPA over [B, H, L, D]
        mask = None if cu_seqlens is None else _same_document_causal(cu_seqlens, q.shape[1], q.device)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    def _linear(self, q, k, v, cu_seqlens=None):
        decay_h = self.decay_h()
        if self.sp is not None:
            packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
            out = self.sp.linear_attention(q, k, v, decay=decay_h, **packed)
        elif cu_seqlens is None:
            out = local_linear_attention(q, k, v, decay_h)
        else:                                   # one process: each document on its own
            bounds = [int(t) for t in cu_seqlens]
            out = torch.cat([local_linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], decay_h)
                             for a, b in zip(bounds, bounds[1:])], dim=1)
        return self.out_norm(out)


def _same_document_causal(cu_seqlens, length: int, device) -> torch.Tensor:
    """[L, L] bool: query t may see key s iff s <= t in the same document (one-process path)."""
    bounds = torch.as_tensor(cu_seqlens, device=device).long()
    doc = torch.searchsorted(bounds, torch.arange(length, device=device), right=True)
    return (doc[:, None] == doc[None, :]) & torch.ones(length, length, dtype=torch.bool, device=device).tril()


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.dim, 2 * cfg.mlp_hidden, bias=False)
        self.w_down = nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False)

    def forward(self, x):
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, sp=None):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg, sp)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, pos_bl, cu_seqlens=None):
        x = x + self.attn(self.attn_norm(x), pos_bl, cu_seqlens)
        return x + self.mlp(self.mlp_norm(x))


class CausalLM(nn.Module):
    """``forward(input_ids [B, L], position_ids [B, L], cu_seqlens=None) -> logits [B, L, V]`` on this
    rank's tokens; with packed documents (cu_seqlens) attention stays inside each document."""

    def __init__(self, cfg: ModelConfig, sp=None):
        super().__init__()
        self.cfg, self.sp = cfg, sp
        self.checkpoint_kwargs = None       # activation_checkpointing_enable sets them
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, sp) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_embeddings:
            # shared Parameter (the Hugging Face way): ZeRO-3 gathers it for whichever module runs
            self.lm_head.weight = self.embed.weight
        # GPT-2: scale residual projections by depth so the residual stream does not grow with it
        for name, p in self.named_parameters():
            if name.endswith(("wo.weight", "w_down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                labels: Optional[torch.Tensor] = None, cu_seqlens=None) -> torch.Tensor:
        """Logits [B, L, V]; with ``labels`` (from sp.shard_batch) the loss instead: sp.loss, or the
        fused tiled head + loss when sequence_parallel.tiled_loss_tokens > 0 (no [B, L, V] tensor).
        ``cu_seqlens``: packed documents (sp.shard_batch's), passed to every attention layer."""
        x = self.embed(input_ids)                                           # [B, L, dim]
        checkpointing = self.checkpoint_kwargs is not None and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint_layer(block, x, position_ids, cu_seqlens, **self.checkpoint_kwargs) if checkpointing \
                else block(x, position_ids, cu_seqlens)
        x = self.norm(x)
        if labels is None:
            return self.lm_head(x)                                          # [B, L, V]
        if self.sp is None:
            return sequence_loss(self.lm_head(x), labels)
        if self.sp.config.tiled_loss_tokens:
            return self.sp.loss_from_hidden(x, self.lm_head, labels)
        return self.sp.loss(self.lm_head(x), labels)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: Optional[dict] = None) -> None:
        """Checkpoint every block in training (the Hugging Face switch's name and argument): the
        forward keeps each block's input only, the backward recomputes the block."""
        self.checkpoint_kwargs = dict(activation_checkpointing_kwargs or CHECKPOINT_KWARGS)

    def activation_checkpointing_disable(self) -> None:
        self.checkpoint_kwargs = None

    def num_params(self) -> int:
        # ZeRO-3 leaves each rank a slice; ds_numel is the full size
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.parameters())
