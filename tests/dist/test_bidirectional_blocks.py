"""Bidirectional blocks inside a causal mask (sp.attention's ``blocks``: Gemma 3's image tokens) on the
4-rank pool: every softmax strategy at 2 and 4 ranks and the 2D hybrid, blocks straddling the shard
boundaries of every layout, with a sliding window, packed documents and end padding, MHA and GQA, against
a float64 dense reference with the same mask and the derived tolerance, and the bytes each rank sends
against the closed form (closed_form_by_kind's blocks); bad blocks refused on every rank.
"""
import pytest
import torch

from ds_seqpar import SequenceParallel
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind

from ..dist_checks import assert_each_config_checked, global_inputs, group_shares
from ..reference import assert_shards_close, masked_attention_with_grads

HEAD_DIM = 8
# (global length, real length or None, window, cu_seqlens, blocks): the P=2 / P=4 boundaries of the
# contiguous and zigzag layouts are multiples of 8 and 16, striped cuts every block; a block longer than the
# window; blocks inside packed documents; a block running into the end padding's edge
CASES = [(64, None, None, None, [(10, 22), (28, 37), (44, 60)]),
         (64, None, 6, None, [(12, 26), (40, 43)]),
         (64, None, None, [0, 20, 50, 64], [(3, 18), (24, 41), (52, 60)]),
         (61, 61, 9, [0, 33, 61], [(5, 12), (40, 61)])]
HEADS = ((4, 4), (4, 2))


def _check_blocks(cfgs):
    """{config index: cases checked} of this rank's group_shares; each case's references computed once."""
    shares = group_shares(cfgs)
    counts = {i: 0 for i, _, _ in shares}
    for seq, real, window, bounds, blocks in CASES:
        for heads, kv_heads in HEADS:
            q, k, v, dout = global_inputs(seq + kv_heads, 1, seq, heads, kv_heads, HEAD_DIM)
            scale = HEAD_DIM ** -0.5
            kw = dict(window=window, bounds=bounds, blocks=blocks)
            ref64 = masked_attention_with_grads(q, k, v, dout, True, scale, torch.float64, **kw)
            plain = masked_attention_with_grads(q, k, v, dout, True, scale, torch.float32, **kw)
            for i, cfg, sp in shares:
                q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
                sp.stats.reset()
                out_l = sp.attention(q_l, k_l, v_l, causal=True, softmax_scale=scale, seq_len=real,
                                     cu_seqlens=bounds, window=window, blocks=blocks)
                out_l.backward(sp.shard(dout))
                case = (f"{cfg} seq={seq} window={window} cu={bounds} blocks={blocks} heads={heads}/{kv_heads} "
                        f"sp_rank={sp.rank}")
                assert_shards_close(case, sp, out_l, (q_l, k_l, v_l), ref64, plain)
                sent = {kd: b for kd, b in sp.stats.bytes.items() if b and kd != "cu_seqlens_check"}
                shapes = Shapes(1, q_l.shape[1] * sp.size, heads, kv_heads, HEAD_DIM, 4)
                want = closed_form_by_kind(sp.config.strategy, sp.size, shapes, sp.rank, sp.config.ulysses_size,
                                           cu_seqlens=bounds, window=window, blocks=blocks)
                assert sent == want, f"{case}: bytes {sent} != closed form {want}"
                counts[i] += 1
    return counts


@pytest.mark.parametrize("size", [2, 4])
def test_bidirectional_blocks_match_dense_reference(pool, size):
    cfgs = [{"strategy": s, "size": size} for s in ("ulysses", "ring", "zigzag", "striped")]
    if size == 4:
        cfgs.append({"strategy": "zigzag", "size": 4, "ulysses_size": 2})
    assert_each_config_checked(pool.run(_check_blocks, cfgs), cfgs, len(CASES) * len(HEADS))


def _bad_blocks():
    sp = SequenceParallel({"strategy": "zigzag", "size": 4})
    q, k, v, _ = global_inputs(0, 1, 32, 4, 2, HEAD_DIM)
    q_l, k_l, v_l = (sp.shard(t) for t in (q, k, v))
    cases = {"non-causal": dict(causal=False, blocks=[(2, 9)]),
             "across documents": dict(cu_seqlens=[0, 10, 32], blocks=[(4, 14)]),
             "out of order": dict(blocks=[(12, 20), (2, 9)]),
             "past the end": dict(blocks=[(20, 40)]),
             "not pairs": dict(blocks=[(1, 2, 3)]),
             "one rank differs": dict(blocks=[(2, 9 + (sp.rank == 1))])}
    out = {}
    for name, kw in cases.items():
        try:
            sp.attention(q_l, k_l, v_l, **kw)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def test_bad_blocks_stop_every_rank_with_blocks_named(pool):
    results = pool.run(_bad_blocks)
    for name, needle in (("non-causal", "with causal=False"), ("across documents", "crosses the document boundary 10"),
                         ("out of order", "(2, 9) is not a non-empty span after the previous block"),
                         ("past the end", "inside the 32 real tokens"), ("not pairs", "(start, end) pairs"),
                         ("one rank differs", "blocks differs across the ranks")):
        for rank, r in enumerate(results):
            assert r[name] is not None and needle in r[name], (name, rank, r[name])
