"""Numerics: bf16 over long-ish sequences and very large logits give finite results within
derived tolerances; merges and accumulators run in fp32 (in fp64 for fp64 inputs, exact to fp64 rounding)."""
import pytest
import torch

from ds_seqpar import SequenceParallel

from ..dist_checks import global_inputs, sharded_attention_grads
from ..reference import assert_derived_close, attention_with_grads

STRATEGY_CFGS = [{"strategy": s, "size": 4} for s in ("ulysses", "ring", "zigzag", "striped")]
STRATEGY_CFGS.append({"strategy": "zigzag", "size": 4, "ulysses_size": 2})


def _plain_bf16(q, k, v, dout, causal, scale):
    """The plain same-precision implementation: autograd through bf16 SDPA math, whole sequence."""
    qb, kb, vb = (t.bfloat16().transpose(1, 2).requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        qb, kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1), is_causal=causal, scale=scale)
    out.backward(dout.bfloat16().transpose(1, 2))
    return [t.transpose(1, 2) for t in (out.detach(), qb.grad, kb.grad, vb.grad)]


def _bf16_case(cfg, seq_len=512):
    sp = SequenceParallel(cfg)
    q, k, v, dout = global_inputs(7, 1, seq_len, 4, 2, 32)
    scale = 32 ** -0.5
    ref64 = attention_with_grads(q, k, v, dout, True, scale, torch.float64)
    plain = _plain_bf16(q, k, v, dout, True, scale)
    got = sharded_attention_grads(sp, *(t.bfloat16() for t in (q, k, v, dout)), True)
    for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref64, plain):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), f"{cfg} {name}: non-finite or wrong dtype"
        assert_derived_close(f"{cfg} bf16 {name}", g, sp.shard(r), sp.shard(p), k=2.0)
    return True


@pytest.mark.parametrize("cfg", STRATEGY_CFGS, ids=[f"{c['strategy']}-u{c.get('ulysses_size', 1)}" for c in STRATEGY_CFGS])
def test_bf16_within_derived_tolerance_of_fp64(pool, cfg):
    assert all(pool.run(_bf16_case, cfg))


def _large_logits_case(cfg):
    sp = SequenceParallel(cfg)
    q, k, v, dout = global_inputs(8, 1, 64, 4, 2, 16)
    q = q * 300.0                       # scores in the thousands: exp overflows without the lse shift
    scale = 0.25
    ref64 = attention_with_grads(q, k, v, dout, True, scale, torch.float64)
    plain = attention_with_grads(q, k, v, dout, True, scale, torch.float32)
    got = sharded_attention_grads(sp, q, k, v, dout, True)
    for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref64, plain):
        assert torch.isfinite(g).all(), f"{cfg} {name}: non-finite with large logits"
        assert_derived_close(f"{cfg} large logits {name}", g, sp.shard(r), sp.shard(p), floor=1e-5)
    return True


@pytest.mark.parametrize("cfg", STRATEGY_CFGS, ids=[f"{c['strategy']}-u{c.get('ulysses_size', 1)}" for c in STRATEGY_CFGS])
def test_large_logits_stay_finite_and_exact(pool, cfg):
    assert all(pool.run(_large_logits_case, cfg))


def _comm_dtype_case(cfg):
    """fp32 inputs, comm_dtype bf16: q/k/v travel (and are attended) in bf16, the output and the
    gradients come back fp32 within the bf16 tolerance, and the payload bytes halve."""
    sent = {}
    for comm_dtype in ("auto", "bf16"):
        sp = SequenceParallel(dict(cfg, comm_dtype=comm_dtype))
        q, k, v, dout = global_inputs(9, 1, 128, 4, 2, 32)
        scale = 32 ** -0.5
        sp.stats.reset()
        got = sharded_attention_grads(sp, q, k, v, dout, True)
        sent[comm_dtype] = dict(sp.stats.bytes)
    ref64 = attention_with_grads(q, k, v, dout, True, scale, torch.float64)
    plain = _plain_bf16(q, k, v, dout, True, scale)
    for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref64, plain):
        assert g.dtype == torch.float32, f"{cfg} {name}: {g.dtype}, want the caller's fp32"
        assert_derived_close(f"{cfg} comm_dtype=bf16 {name}", g, sp.shard(r), sp.shard(p), k=2.0)
    for kind, nbytes in sent["auto"].items():
        want = nbytes if kind == "ring_grad" else nbytes // 2      # dK/dV accumulators stay fp32
        assert sent["bf16"][kind] == want, f"{cfg} {kind}: {sent['bf16'][kind]} bytes in bf16, fp32 {nbytes}"
    return True


@pytest.mark.parametrize("cfg", STRATEGY_CFGS[:2], ids=["ulysses", "ring"])
def test_comm_dtype_bf16_halves_payload_bytes_within_bf16_tolerance(pool, cfg):
    assert all(pool.run(_comm_dtype_case, cfg))


def _fp64_case(cfg):
    """float64 inputs: kernels, merges and accumulators all in float64 (kernels/merge.acc_dtype), so
    every strategy equals the float64 reference to float64 rounding: a sharding error cannot hide
    behind fp32 rounding here."""
    sp = SequenceParallel({**cfg, "backend": "torch"})
    q, k, v, dout = (t.double() for t in global_inputs(9, 1, 64, 4, 2, 16))
    ref = attention_with_grads(q, k, v, dout, True, 0.25, torch.float64)
    got = sharded_attention_grads(sp, q, k, v, dout, True)
    worst = 0.0
    for g, r in zip(got, ref):
        assert g.dtype == torch.float64
        worst = max(worst, (g - sp.shard(r)).abs().max().item() / r.abs().max().item())
    return worst


@pytest.mark.parametrize("cfg", STRATEGY_CFGS, ids=[f"{c['strategy']}-u{c.get('ulysses_size', 1)}" for c in STRATEGY_CFGS])
def test_float64_is_exact_to_float64_rounding(pool, cfg):
    # 1e-12 relative: about 5000 float64 roundings; fp32 anywhere on the path would show as >= 1e-8
    assert max(pool.run(_fp64_case, cfg)) < 1e-12
