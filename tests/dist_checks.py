"""Functions that run on every rank of the pool (module-level so they pickle by name)."""
import torch

from ds_seqpar import SequenceParallel

from .reference import assert_derived_close, attention_with_grads

# (causal, q heads, kv heads): MHA and GQA with kv heads 1, 2 and equal
HEAD_CASES = [(c, h, hkv) for c in (True, False) for (h, hkv) in ((4, 4), (4, 2), (4, 1), (8, 2))]


def global_inputs(seed, batch, seq_len, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, head_dim, generator=g)
    k = torch.randn(batch, seq_len, kv_heads, head_dim, generator=g)
    v = torch.randn(batch, seq_len, kv_heads, head_dim, generator=g)
    dout = torch.randn(batch, seq_len, heads, head_dim, generator=g)
    return q, k, v, dout


def sharded_attention_grads(sp, q, k, v, dout, causal):
    """Run sp.attention on this rank's shards; return local (out, dq, dk, dv)."""
    q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
    out_l = sp.attention(q_l, k_l, v_l, causal=causal)
    out_l.backward(sp.shard(dout))
    return out_l.detach(), q_l.grad, k_l.grad, v_l.grad


def check_attention_exact(cfg, cases=HEAD_CASES, seq_len=64, batch=2, head_dim=16, seed=0):
    """Output and dq, dk, dv of sp.attention equal full-sequence attention (derived tolerance).
    Returns the names of the cases checked, so the caller can assert nothing was skipped."""
    sp = SequenceParallel(cfg)
    checked = []
    for causal, heads, kv_heads in cases:
        q, k, v, dout = global_inputs(seed, batch, seq_len, heads, kv_heads, head_dim)
        scale = head_dim ** -0.5
        ref64 = attention_with_grads(q, k, v, dout, causal, scale, torch.float64)
        plain = attention_with_grads(q, k, v, dout, causal, scale, torch.float32)
        got = sharded_attention_grads(sp, q, k, v, dout, causal)
        case = f"{cfg} causal={causal} heads={heads} kv_heads={kv_heads} sp_rank={sp.rank}"
        for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref64, plain):
            assert g is not None, f"{case}: no gradient for {name}"
            assert_derived_close(f"{case} {name}", g, sp.shard(r), sp.shard(p))
        checked.append(case)
    return checked
