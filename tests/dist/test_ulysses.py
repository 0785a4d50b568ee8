"""Ulysses on 4 CPU gloo ranks: exactness, DeepSpeed parity, bytes, shard/unshard."""
import pytest
import torch

from ds_seqpar import SequenceParallel
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind

from ..dist_checks import HEAD_CASES, check_attention_exact, global_inputs, sharded_attention_grads


@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_matches_single_process(pool, size):
    results = pool.run(check_attention_exact, {"strategy": "ulysses", "size": size})
    assert all(len(r) == len(HEAD_CASES) for r in results), results


def _vs_deepspeed(size, causal):
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention
    deepspeed.init_distributed(dist_backend="gloo")
    sp = SequenceParallel({"strategy": "ulysses", "size": size})
    q, k, v, dout = global_inputs(1, 2, 64, 4, 4, 16)
    ours = sharded_attention_grads(sp, q, k, v, dout, causal)

    def sdpa_bshd(q_, k_, v_, *args, **kwargs):
        o = torch.nn.functional.scaled_dot_product_attention(
            q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=causal)
        return o.transpose(1, 2)

    ds_attn = DistributedAttention(sdpa_bshd, sp.group, scatter_idx=2, gather_idx=1)
    q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
    out = ds_attn(q_l, k_l, v_l, 0)
    out.backward(sp.shard(dout))
    theirs = (out.detach(), q_l.grad, k_l.grad, v_l.grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} vs DeepSpeed: {m}")
    return True


@pytest.mark.parametrize("size,causal", [(2, True), (4, False)])
def test_ulysses_matches_deepspeed_distributed_attention(pool, size, causal):
    assert all(pool.run(_vs_deepspeed, size, causal))


def _bytes_one_step(size, head_cases, seq_len=64, head_dim=16, batch=2):
    """Per (heads, kv_heads): the bytes per CommStats kind and the calls of one fwd+bwd on this rank."""
    sp = SequenceParallel({"strategy": "ulysses", "size": size})
    out = []
    for heads, kv_heads in head_cases:
        q, k, v, dout = global_inputs(2, batch, seq_len, heads, kv_heads, head_dim)
        sp.stats.reset()
        sharded_attention_grads(sp, q, k, v, dout, True)
        out.append(({kind: n for kind, n in sp.stats.bytes.items() if n}, dict(sp.stats.calls)))
    return out


# MHA, and GQA where the kv heads split over the ranks (size 2, kv 2) or must be repeated (f > 1)
ULYSSES_HEADS = [(4, 4), (4, 2), (4, 1)]


@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_bytes_match_closed_form(pool, size):
    for per_case in pool.run(_bytes_one_step, size, ULYSSES_HEADS):
        for (heads, kv_heads), (sent, calls) in zip(ULYSSES_HEADS, per_case):
            want = closed_form_by_kind("ulysses", size, Shapes(2, 64, heads, kv_heads, 16, 4))
            assert sent == want, f"size {size} heads {heads} kv_heads {kv_heads}: sent {sent}, closed form {want}"
            assert calls == {"all_to_all": 8}, calls
        if size == 2:       # kv heads travel as they are: GQA sends less than MHA, never repeated to H
            assert per_case[1][0]["all_to_all"] < per_case[0][0]["all_to_all"], per_case


def _roundtrip(size):
    sp = SequenceParallel({"strategy": "ulysses", "size": size})
    x = torch.randn(3, 32, 5, generator=torch.Generator().manual_seed(3))
    full = sp.unshard(sp.shard(x, dim=1), dim=1)
    assert torch.equal(full, x), "unshard(shard(x)) != x"
    pos = sp.position_ids(32)
    assert torch.equal(pos, torch.arange(32).chunk(size)[sp.rank]), pos
    return sp.shard(x, dim=1).shape[1]


@pytest.mark.parametrize("size", [2, 4])
def test_shard_unshard_roundtrip(pool, size):
    assert pool.run(_roundtrip, size) == [32 // size] * 4


def _heads_not_divisible():
    sp = SequenceParallel({"strategy": "ulysses", "size": 4})
    q = torch.randn(1, 8, 6, 16)
    try:
        sp.attention(q, q, q)
    except ValueError as err:
        return str(err)
    return "no error"


def test_ulysses_heads_not_divisible_is_a_clear_error(pool):
    msgs = pool.run(_heads_not_divisible)
    assert len(set(msgs)) == 1, msgs
    assert "sequence_parallel.size=4" in msgs[0] and "6 q heads" in msgs[0], msgs[0]
