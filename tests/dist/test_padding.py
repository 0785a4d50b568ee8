"""Any sequence length: end padding is exact for every strategy, causal and not."""
import pytest
import torch

from ds_seqpar import SequenceParallel
from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.sharding.padding import pad_to, padded_len, suffix_is_padding, valid_prefix

from ..dist_checks import global_inputs
from ..reference import assert_derived_close, attention_with_grads


@pytest.mark.parametrize("name,ring,ulysses", [("contiguous", 4, 1), ("zigzag", 4, 1), ("striped", 4, 1),
                                               ("zigzag", 2, 2), ("striped", 3, 2), ("zigzag", 3, 1)])
@pytest.mark.parametrize("seq_len", [1, 5, 23, 24, 25, 47])
def test_pads_are_a_suffix_of_every_local_order(name, ring, ulysses, seq_len):
    layout = make_layout(name, ring, ulysses)
    n = padded_len(layout, seq_len)
    assert n % layout.required_multiple == 0 and n - layout.required_multiple < seq_len <= n
    assert suffix_is_padding(layout, n, seq_len), (name, ring, ulysses, seq_len)
    valid = valid_prefix(layout.ring_layout, n, seq_len)
    assert sum(valid) == seq_len and all(0 <= v <= n // ring for v in valid), valid


def test_pad_to_values_and_bool():
    x = torch.arange(6).reshape(2, 3)
    assert pad_to(x, 1, 5, -100).tolist() == [[0, 1, 2, -100, -100], [3, 4, 5, -100, -100]]
    assert pad_to(torch.ones(1, 2, dtype=torch.bool), 1, 3).tolist() == [[True, True, False]]
    assert pad_to(x, 1, 3) is x


CASES = [({"strategy": s, "size": 4}, c) for s in ("ulysses", "ring", "zigzag", "striped") for c in (True, False)]
CASES += [({"strategy": "zigzag", "size": 4, "ulysses_size": 2}, c) for c in (True, False)]
CASES += [({"strategy": "ring", "size": 2}, False), ({"strategy": "striped", "size": 2}, True)]


def _padded_attention_exact(cfg, causal, seq_len=61):
    sp = SequenceParallel(cfg)
    q, k, v, dout = global_inputs(5, 2, seq_len, 4, 2, 16)
    scale = 0.25
    ref64 = attention_with_grads(q, k, v, dout, causal, scale, torch.float64)
    plain = attention_with_grads(q, k, v, dout, causal, scale, torch.float32)
    q_l, k_l, v_l = (sp.shard(t).requires_grad_() for t in (q, k, v))
    assert q_l.shape[1] * sp.size == sp.padded_len(seq_len) > seq_len
    out_l = sp.attention(q_l, k_l, v_l, causal=causal, softmax_scale=scale, seq_len=seq_len)
    out_l.backward(sp.shard(dout))          # zero gradient on the pad rows, as a loss gives them
    got = [sp.unshard(t, seq_len=seq_len) for t in (out_l.detach(), q_l.grad, k_l.grad, v_l.grad)]
    for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref64, plain):
        assert g.shape == r.shape, (name, g.shape, r.shape)
        assert_derived_close(f"{cfg} causal={causal} {name}", g, r, p)
    return True


@pytest.mark.parametrize("cfg,causal", CASES, ids=[f"{c['strategy']}-{c['size']}-u{c.get('ulysses_size', 1)}-"
                                                   f"{'causal' if k else 'full'}" for c, k in CASES])
def test_padded_sequence_equals_unpadded_reference(pool, cfg, causal):
    assert all(pool.run(_padded_attention_exact, cfg, causal))


def _bad_seq_len():
    sp = SequenceParallel({"strategy": "zigzag", "size": 4})
    q = torch.zeros(1, 16, 4, 8)
    try:
        sp.attention(q, q, q, causal=False, seq_len=40)
    except ValueError as err:
        return str(err)
    return "no error"


def test_seq_len_that_does_not_match_the_shards_is_an_error(pool):
    msgs = pool.run(_bad_seq_len)
    assert len(set(msgs)) == 1 and "seq_len=40 does not match the local shards: 64 tokens" in msgs[0], msgs
