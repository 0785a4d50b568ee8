"""Packed documents (cu_seqlens) on the 4-rank pool: every softmax strategy at 2 and 4 ranks and the
2D hybrid, causal and not, MHA and GQA, against a float64 per-document reference; work only inside
documents; bytes against the closed forms; clear errors before any other communication.

Size 2 on the 4-rank pool is two sequence groups of 2 ranks (dp=2), both checking their results.
"""
import pytest
import torch

from ds_seqpar import SequenceParallel
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind

from ..dist_checks import assert_each_config_checked, global_inputs, group_shares
from ..reference import assert_shards_close, packed_attention_with_grads, pairs_per_query_set
from .test_ring import counted_fwd_bwd

HEAD_DIM = 16
# (global length, cu_seqlens): odd lengths, a 1-token document, documents shorter than a shard, end
# padding (61 is no multiple of any layout's P or 2P); one document over every rank; documents
# crossing shard boundaries of every layout
DOC_CASES = [(61, [0, 5, 6, 30, 61]), (64, [0, 64]), (64, [0, 3, 17, 40, 41, 64])]
HEAD_CASES = [(c, h, hkv) for c in (True, False) for (h, hkv) in ((4, 4), (4, 2))]
SOFTMAX = ("ulysses", "ring", "zigzag", "striped")


def _check_packed(cfgs, doc_cases=DOC_CASES, head_cases=HEAD_CASES):
    """Every (config, documents, causal, heads) case: out, dq, dk, dv vs the float64 per-document
    reference with the derived tolerance. Returns {config index: cases checked} of this rank's
    group_shares; each case's references are computed once."""
    shares = group_shares(cfgs)
    counts = {i: 0 for i, _, _ in shares}
    n = 0
    for seq, bounds in doc_cases:
        for causal, heads, kv_heads in head_cases:
            q, k, v, dout = global_inputs(seq + heads + kv_heads, 1, seq, heads, kv_heads, HEAD_DIM)
            scale = HEAD_DIM ** -0.5
            ref64 = packed_attention_with_grads(q, k, v, dout, bounds, causal, scale, torch.float64)
            plain = packed_attention_with_grads(q, k, v, dout, bounds, causal, scale, torch.float32)
            cu = torch.tensor(bounds, dtype=torch.int32) if n % 2 else bounds     # tensor or list
            for i, cfg, sp in shares:
                q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
                out_l = sp.attention(q_l, k_l, v_l, causal=causal, softmax_scale=scale, cu_seqlens=cu)
                out_l.backward(sp.shard(dout))
                case = f"{cfg} cu_seqlens={bounds} causal={causal} heads={heads}/{kv_heads} sp_rank={sp.rank}"
                assert_shards_close(case, sp, out_l, (q_l, k_l, v_l), ref64, plain)
                counts[i] += 1
            n += 1
    return counts


@pytest.mark.parametrize("size", [2, 4])
def test_packed_documents_match_per_document_reference(pool, size):
    cfgs = [{"strategy": s, "size": size} for s in SOFTMAX]
    if size == 4:
        cfgs.append({"strategy": "striped", "size": 4, "overlap": False})
    assert_each_config_checked(pool.run(_check_packed, cfgs), cfgs, len(DOC_CASES) * len(HEAD_CASES))


def test_packed_documents_hybrid_match_per_document_reference(pool):
    cfgs = [{"strategy": s, "size": 4, "ulysses_size": 2} for s in ("ring", "zigzag", "striped")]
    assert_each_config_checked(pool.run(_check_packed, cfgs), cfgs, len(DOC_CASES) * len(HEAD_CASES))


def test_long_documents_cut_into_kernel_tiles_stay_exact(pool):
    """Documents of > 256 tokens per rank: the CPU kernel's causal squares are cut into 128-token
    tiles (kernels/torch_kernel.py causal_tile), merged like any sub-blocks."""
    cfgs = [{"strategy": s, "size": 2} for s in ("ulysses", "ring", "striped")]
    docs, heads = [(700, [0, 37, 700])], [(True, 2, 1)]
    assert_each_config_checked(pool.run(_check_packed, cfgs, docs, heads), cfgs, 1)


# -- work and bytes --------------------------------------------------------------------------


def _visible_pairs(sp, seq, bounds, causal):
    """(q, k) pairs inside documents whose query this rank holds (end padding: none), the oracle's count."""
    n = sp.padded_len(seq)
    return pairs_per_query_set(n, causal, None, bounds, [sp.layout.indices(n, sp.rank)])[0]


def _work_and_bytes(cfgs, seq, bounds, causal):
    out = []
    for cfg in cfgs:
        sp, calls, got = counted_fwd_bwd(cfg, 9, seq, causal, HEAD_DIM, cu_seqlens=bounds)
        want = closed_form_by_kind(cfg["strategy"], sp.size, Shapes(1, sp.padded_len(seq), 4, 2, HEAD_DIM),
                                   sp.rank, cu_seqlens=bounds, causal=causal)
        out.append((cfg, sp.rank, calls, _visible_pairs(sp, seq, bounds, causal), got, want))
    return out


# documents inside shards for the contiguous ring at P=4 (16 tokens each): nothing travels
BYTES_CASES = [(64, [0, 16, 20, 32, 48, 64], True), (64, [0, 7, 16, 45, 64], True),
               (64, [0, 7, 16, 45, 64], False), (60, [0, 2, 9, 60], True)]


@pytest.mark.parametrize("seq,bounds,causal", BYTES_CASES)
def test_packed_work_is_inside_documents_and_bytes_match_closed_form(pool, seq, bounds, causal):
    cfgs = [{"strategy": s, "size": 4} for s in ("ring", "zigzag", "striped")]
    for per_cfg in pool.run(_work_and_bytes, cfgs, seq, bounds, causal):
        for cfg, rank, calls, visible, got, want in per_cfg:
            what = f"{cfg} cu_seqlens={bounds} causal={causal} rank {rank}"
            for phase in ("forward", "backward"):
                assert sum(calls[phase]) == visible, \
                    f"{what} {phase}: computed {sum(calls[phase])} (q, k) pairs, {visible} inside documents"
            assert got == want, f"{what}: sent {got}, closed form {want}"
            if cfg["strategy"] == "ring" and bounds == [0, 16, 20, 32, 48, 64]:
                assert not got, f"{what}: documents inside shards, yet {got} bytes travelled"


def _single_document_bytes(cfg):
    """A single non-causal document: every rank needs every block, so the general closed form."""
    sp = SequenceParallel(cfg)
    q, k, v, dout = global_inputs(4, 1, 64, 4, 2, HEAD_DIM)
    q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
    sp.stats.reset()
    sp.attention(q_l, k_l, v_l, causal=False, cu_seqlens=[0, 64]).backward(sp.shard(dout))
    general = closed_form_by_kind(cfg["strategy"], sp.size, Shapes(1, 64, 4, 2, HEAD_DIM), sp.rank,
                                  cfg.get("ulysses_size", 1))
    return {kind: b for kind, b in sp.stats.bytes.items() if b and kind != "cu_seqlens_check"}, general


@pytest.mark.parametrize("cfg", [{"strategy": "zigzag", "size": 4}, {"strategy": "striped", "size": 4,
                                                                       "ulysses_size": 2}])
def test_every_block_needed_costs_the_general_closed_form(pool, cfg):
    for got, general in pool.run(_single_document_bytes, cfg):
        assert got == general, (got, general)


# -- errors before communication ---------------------------------------------------------------


def _cu_error(cfg, cu_by_rank, batch=1, local_len=16, linear=False):
    sp = SequenceParallel(cfg)
    q = torch.randn(batch, local_len, 4, HEAD_DIM)
    cu = cu_by_rank[sp.rank % len(cu_by_rank)]
    sp.stats.reset()
    try:
        if linear:
            sp.linear_attention(q, q, q, cu_seqlens=cu)
        else:
            sp.attention(q, q, q, cu_seqlens=cu)
    except ValueError as err:
        return str(err), {k: b for k, b in sp.stats.bytes.items() if k != "cu_seqlens_check"}
    return "no error", {}


@pytest.mark.parametrize("cfg,cu_by_rank,batch,needles", [
    ({"strategy": "ring", "size": 2}, [[1, 32]], 1, ["cu_seqlens=[1, 32]", "must start at 0"]),
    ({"strategy": "zigzag", "size": 2}, [[0, 20, 20, 32]], 1, ["strictly increasing", "entry 2"]),
    ({"strategy": "striped", "size": 4}, [[0, 20, 40]], 1, ["must end at the real sequence length", "(60, 64]"]),
    ({"strategy": "ulysses", "size": 2}, [[0, 32]], 2, ["cu_seqlens", "batch size 1", "got batch 2"]),
    ({"strategy": "ring", "size": 4}, [[0, 10, 64], [0, 10, 64], [0, 11, 64], [0, 10, 64]], 1,
     ["cu_seqlens differs across the ranks", "GLOBAL document boundaries"]),
    ({"strategy": "lasp", "size": 2}, [[0, 31.5, 32]], 1, ["cu_seqlens must be a 1-D integer"]),
])
def test_bad_cu_seqlens_is_a_clear_error_before_communication(pool, cfg, cu_by_rank, batch, needles):
    results = pool.run(_cu_error, cfg, cu_by_rank, batch, 16, cfg["strategy"] == "lasp")
    for msg, sent in results:
        assert all(n in msg for n in needles), msg
        assert not any(sent.values()), f"communication before the error: {sent}"
    if len(cu_by_rank) == 1:
        assert len({m for m, _ in results}) == 1, results


def _one_rank_invalid():
    sp = SequenceParallel({"strategy": "ring", "size": 2})
    q = torch.randn(1, 16, 4, HEAD_DIM)
    try:
        sp.attention(q, q, q, cu_seqlens=[0, 32] if sp.rank == 0 else [0, 33])
    except ValueError as err:
        return str(err)
    return "no error"


def test_invalid_on_one_rank_stops_every_rank(pool):
    msgs = pool.run(_one_rank_invalid)
    assert all("must end at the real sequence length" in m for m in msgs[1::2]), msgs
    assert all("invalid on another rank" in m for m in msgs[0::2]), msgs
