"""Ulysses on 4 CPU gloo ranks: exactness, DeepSpeed parity, bytes, shard/unshard."""
import pytest
import torch

from ds_seqpar import ConfigError, SequenceParallel
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


def _bytes_one_step(size, head_cases, seq_len=64, head_dim=16, batch=2, chunks="auto"):
    """Per (heads, kv_heads): the bytes per CommStats kind and the calls of one fwd+bwd on this rank."""
    sp = SequenceParallel({"strategy": "ulysses", "size": size, "ulysses_chunks": chunks})
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


@pytest.mark.parametrize("size,chunks", [(2, 2), (2, 4), (4, 2)])
def test_head_chunks_bytes_match_closed_form(pool, size, chunks):
    heads = [(8, 8), (8, 4)] if size == 2 and chunks == 2 else [(8, 8)]   # 4 and 2 k/v heads a rank at size 2
    for per_case in pool.run(_bytes_one_step, size, heads, chunks=chunks):
        for (h, kv), (sent, calls) in zip(heads, per_case):
            want = closed_form_by_kind("ulysses", size, Shapes(2, 64, h, kv, 16, 4))
            assert sent == want, f"size {size} chunks {chunks} heads {h}/{kv}: sent {sent}, closed form {want}"
            assert calls == {"all_to_all": 8 * chunks}, calls


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


# -- head chunks (ulysses_chunks): C chunks pipelined through async all-to-alls -------------------------
# (causal, heads, kv heads, options): MHA, GQA, GQA with k/v repeated (12 q / 6 kv heads at size 4: f = 2,
# 3 kv heads a rank), with a window, softcap, sinks and packed documents
CHUNK_CASES = [(True, 8, 8, {}), (False, 8, 4, {"window": 5, "softcap": 3.0}), (True, 12, 6, {"sinks": True}),
               (True, 8, 8, {"cu_seqlens": [0, 11, 40, 64]})]


def _chunked(cfg, chunks, causal, heads, kv_heads, options, seq_len=64, head_dim=8):
    """(out, dq, dk, dv, dsinks or None) of one fwd+bwd with ``chunks`` head chunks, and the stats."""
    sp = SequenceParallel(dict(cfg, ulysses_chunks=chunks))
    q, k, v, dout = global_inputs(4, 1, seq_len, heads, kv_heads, head_dim)
    sinks = torch.linspace(-1.0, 2.0, heads).requires_grad_() if options.get("sinks") else None
    kw = {key: val for key, val in options.items() if key != "sinks"}
    if "cu_seqlens" in kw:
        kw["cu_seqlens"] = torch.tensor(kw["cu_seqlens"])
    q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
    sp.stats.reset()
    out = sp.attention(q_l, k_l, v_l, causal=causal, sinks=sinks, **kw)
    out.backward(sp.shard(dout))
    got = (out.detach(), q_l.grad, k_l.grad, v_l.grad, None if sinks is None else sinks.grad)
    # (the documents' agreement check runs once per batch, whatever the chunks: not counted here)
    return got, {kd: (n, sp.stats.calls[kd]) for kd, n in sp.stats.bytes.items() if n and kd != "cu_seqlens_check"}


def _chunks_bit_equal(cfg, bitwise=True):
    """Per case and valid chunk count > 1: outputs and every gradient torch.equal to one chunk's
    (``bitwise``); the bytes equal, in chunks times the calls."""
    from ds_seqpar.strategies.ulysses import chunk_counts
    u, checked = cfg.get("ulysses_size", cfg["size"]), []
    for causal, heads, kv_heads, options in CHUNK_CASES:
        one, one_stats = _chunked(cfg, 1, causal, heads, kv_heads, options)
        for chunks in chunk_counts(heads, kv_heads, u)[1:]:
            got, stats = _chunked(cfg, chunks, causal, heads, kv_heads, options)
            case = f"{cfg} chunks={chunks} causal={causal} heads={heads}/{kv_heads} {options}"
            for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, one if bitwise else ()):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), \
                    f"{case}: {name} differs from one chunk by {(a - b).abs().max() if a is not None else a}"
            # every exchange (the hybrid's ring too) runs once per chunk, on a chunk's share of the bytes
            assert stats == {kd: (sent, chunks * calls) for kd, (sent, calls) in one_stats.items()}, \
                (case, stats, one_stats)
            checked.append((heads, kv_heads, chunks))
    return checked


HYBRID = {"strategy": "zigzag", "size": 4, "ulysses_size": 2}


# The 2D hybrid: the same bytes and calls x chunks, but not bitwise: its ring merges several blocks per
# query (exp / log1p over [b, h, n] accumulators), and the CPU's vectorized elementwise loops round a
# tensor's tail elements on a scalar path, so a head's merge can differ in the last bit with the number
# of heads beside it; its exactness is checked against the float64 reference instead (below).
@pytest.mark.parametrize("cfg", [{"strategy": "ulysses", "size": 2}, {"strategy": "ulysses", "size": 4}, HYBRID])
def test_head_chunks_are_bit_equal_to_one_chunk(pool, cfg):
    checked = pool.run(_chunks_bit_equal, cfg, cfg is not HYBRID)
    assert len(set(map(tuple, checked))) == 1, checked
    assert {c for _, _, c in checked[0]} >= ({2, 3} if cfg["size"] == 4 and "ulysses_size" not in cfg else {2, 3, 4}), \
        checked[0]


@pytest.mark.parametrize("cfg", [{"strategy": "ulysses", "size": 2, "ulysses_chunks": 4},
                                 {"strategy": "ulysses", "size": 4, "ulysses_chunks": 2},
                                 dict(HYBRID, ulysses_chunks=2), dict(HYBRID, ulysses_chunks=4)])
def test_head_chunks_match_single_process(pool, cfg):
    # 8 q / 8 kv heads: 4, 2 and 4 k/v heads a rank
    cases = [(c, 8, 8) for c in (True, False)]
    results = pool.run(check_attention_exact, cfg, cases)
    assert all(len(r) == len(cases) for r in results), results


def _chunks_refused(chunks, heads, kv_heads):
    sp = SequenceParallel({"strategy": "ulysses", "size": 4, "ulysses_chunks": chunks})
    q, k = torch.randn(1, 8, heads, 8), torch.randn(1, 8, kv_heads, 8)
    sp.stats.reset()
    try:
        sp.attention(q, k, k)
    except ConfigError as err:
        return str(err), sp.stats.total_bytes
    return "no error", sp.stats.total_bytes


def test_head_chunks_not_dividing_kv_groups_are_refused_before_communication(pool):
    # 8 q / 4 kv heads over 4 ranks: each rank holds 1 k/v head (and its 2 q heads): 1 chunk only
    msgs = pool.run(_chunks_refused, 2, 8, 4)
    assert len(set(msgs)) == 1, msgs
    msg, sent = msgs[0]
    assert "sequence_parallel.ulysses_chunks=2" in msg and "valid: 1 or 'auto'" in msg, msg
    assert sent == 0, f"{sent} bytes sent before the refusal"
