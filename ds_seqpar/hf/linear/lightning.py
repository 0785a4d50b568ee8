"""MiniMax's lightning attention: causal linear attention with a fixed decay per head, lambda = exp(-slope).
transformers runs it as an inline block loop, no op to hook, so the layer's forward is replaced on the
instance (keeping transformers' projections, norm and gate); its transition is the fixed lambda^n,
the one the own LM's LASP uses, so no A travels. The replaced forward calls the sequence-parallel
attention as the hooked families' seams call their ops: under torch.compile, one opaque op (opaque.py)."""
from __future__ import annotations

import torch

from ...kernels.linear import linear_attention
from ...errors import UnsupportedModelError
from .families import LIGHTNING
from .fold import fold
from .opaque import compiled_seam, run_seam
from .seams import count


def output_like(q, k, v):
    """The op's output under compile without running it (opaque.py's fake runs a seam's original op on the
    local shard; transformers has none here): a value vector per token and head, in q's dtype."""
    return q.new_empty(v.shape)


def decay(module):
    """lambda per head. Read by the op's body from the layer, not passed in: a fixed input of the kernel,
    which the op's backward would otherwise make a leaf to differentiate."""
    return torch.exp(-module.slope_rate.reshape(module.num_attention_heads))


def lightning(mixers, q, k, v, decay_h, where: str):
    """Per fragment, the single-process kernel from a zero state and B = sum_s lambda^(n-1-s) k_s v_s^T;
    the effective query of token t is lambda^(t+1) q_t."""
    if mixers.exchange.heads_parallel:
        return mixers.heads_parallel(lambda q_, k_, v_, mine: linear_attention(q_, k_, v_, decay_h[mine].to(q.dtype)),
                                     (q, k, v), where)
    frags, resets = mixers.runs(q.shape[1], 1, where)
    lam = decay_h.float()[:, None]                                                   # [h, 1]
    pieces = []
    for _, n, off in frags[mixers.exchange.rank]:
        qf, kf, vf = (t[:, off:off + n] for t in (q, k, v))
        steps = torch.arange(n, device=q.device, dtype=torch.float32)
        o0 = linear_attention(qf, kf, vf, decay_h.to(q.dtype))
        q_eff = qf.float() * (lam ** (steps + 1)).t()[None, :, :, None]              # [b, n, h, d]
        b_map = torch.einsum("bshk,bshv->bhkv", kf.float() * (lam ** (n - 1 - steps)).t()[None, :, :, None],
                             vf.float())
        pieces.append((o0, q_eff, None, b_map))
    return fold(mixers.exchange, pieces, frags, resets, decay_h=decay_h)


class InstanceForward:
    """A replaced ``forward`` on one module instance; ``remove()`` restores the class's."""

    def __init__(self, module, forward):
        self.module = module
        module.forward = forward

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def lightning_forward(mixers, module, hidden_states, position_embeddings=None, attention_mask=None,
                      past_key_values=None, **kwargs):
    """transformers' MiniMaxLightningAttention.forward (training path: no cache) with its block loop
    replaced by the sequence-parallel lightning attention; projections, norm and gate unchanged."""
    where = mixers.where(module)
    if past_key_values is not None:
        raise UnsupportedModelError(f"ds_seqpar.hf: a linear-attention cache in {where} cannot be exact under "
                                    f"sequence parallelism; train with use_cache=False")
    count(LIGHTNING)
    b, n, _ = hidden_states.shape
    heads, d = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(hidden_states)).reshape(b, n, heads, 3 * d)
    q, k, v = torch.split(qkv, d, dim=3)
    call = dict(q=q, k=k, v=v)
    seam = compiled_seam if torch.compiler.is_compiling() else run_seam
    out = seam(mixers, module, LIGHTNING, output_like, call)
    out = module.norm(out.reshape(b, n, heads * d))
    out = torch.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out), None


__all__ = ["lightning", "lightning_forward", "InstanceForward"]
