"""Functions that run on every rank of the pool (module-level so they pickle by name)."""
import torch

from ds_seqpar import SequenceParallel

from .reference import assert_derived_close, attention_with_grads

# (causal, q heads, kv heads): MHA and GQA with kv heads 1, 2 and equal
HEAD_CASES = [(c, h, hkv) for c in (True, False) for (h, hkv) in ((4, 4), (4, 2), (4, 1), (8, 2))]


def group_shares(cfgs):
    """[(index, cfg, SequenceParallel)] of the configs this rank's sequence group checks. Where the configs run
    at a size below the pool's world, the world's sequence groups (its data-parallel replicas) take every
    dp_size-th config each instead of all checking all: each case is still checked by every rank of one
    group. Every rank builds every config's SequenceParallel (process groups are made collectively); the
    configs of one call share a size. tests check the union with assert_each_config_checked."""
    sps = [SequenceParallel(cfg) for cfg in cfgs]
    first = sps[0]
    assert all(sp.size == first.size for sp in sps), cfgs
    return [(i, cfg, sp) for i, (cfg, sp) in enumerate(zip(cfgs, sps)) if i % first.dp_size == first.dp_rank]


def first_group_runs(sp):
    """Whether this rank is in the world's first sequence group: a check of one case at a size below the
    world runs there alone (the other groups would run the very same case); the others return None and
    the test reads the first group's ranks (first_group_results)."""
    return sp.dp_rank == 0


def first_group_results(results, size):
    """The results of the ranks that ran (first_group_runs): one group's, ``size`` ranks."""
    ran = [r for r in results if r is not None]
    assert len(ran) == size, f"{len(ran)} ranks ran, not one group of {size}: {results}"
    return ran


def assert_each_config_checked(results, cfgs, cases):
    """Over the ranks' {config index: cases checked}: every config checked ``cases`` times by all ranks of
    one sequence group (size ranks), none skipped."""
    seen = {}
    for per_rank in results:
        for i, n in per_rank.items():
            seen.setdefault(i, []).append(n)
    size = cfgs[0]["size"]
    assert sorted(seen) == list(range(len(cfgs))), f"configs checked: {sorted(seen)} of {len(cfgs)}"
    assert all(counts == [cases] * size for counts in seen.values()), seen


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
    return _check_exact([(0, cfg, SequenceParallel(cfg))], cases, seq_len, batch, head_dim, seed)[0]


def check_configs_exact(cfgs, cases=HEAD_CASES, seq_len=64, batch=2, head_dim=16, seed=0):
    """check_attention_exact for this rank's group_shares of ``cfgs``: {config index: cases checked}."""
    return {i: len(names) for i, names in _check_exact(group_shares(cfgs), cases, seq_len, batch, head_dim,
                                                        seed).items()}


def _check_exact(shares, cases, seq_len, batch, head_dim, seed):
    """{config index: case names} over [(index, cfg, sp)]; each case's references are computed once."""
    checked = {i: [] for i, _, _ in shares}
    for causal, heads, kv_heads in cases:
        q, k, v, dout = global_inputs(seed, batch, seq_len, heads, kv_heads, head_dim)
        scale = head_dim ** -0.5
        ref64 = attention_with_grads(q, k, v, dout, causal, scale, torch.float64)
        plain = attention_with_grads(q, k, v, dout, causal, scale, torch.float32)
        for i, cfg, sp in shares:
            got = sharded_attention_grads(sp, q, k, v, dout, causal)
            case = f"{cfg} causal={causal} heads={heads} kv_heads={kv_heads} sp_rank={sp.rank}"
            for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref64, plain):
                assert g is not None, f"{case}: no gradient for {name}"
                assert_derived_close(f"{case} {name}", g, sp.shard(r), sp.shard(p))
            checked[i].append(case)
    return checked
