"""State passing for hybrids without processes: fragments of every layout, and the delta rule's
affine maps (one widened call of transformers' own op per fragment) folded in global order equal
the op on the whole sequence, for gated DeltaNet (dk != dv) and Kimi delta attention, with the
fragments of the contiguous and zigzag layouts at P = 2 and 4 (simulated ranks)."""
import pytest
import torch

from ds_seqpar.config import ConfigError, SequenceParallelConfig
from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.strategies.lasp_chain import cut_at_documents, fragments, global_order
from ds_seqpar.strategies.lasp_comm.common import Transition
from ds_seqpar.strategies.linear_exchange import check_fragments


def test_fragments_are_the_runs_of_consecutive_positions():
    assert fragments(make_layout("contiguous", 2), 8) == [[(0, 4, 0)], [(4, 4, 0)]]
    # zigzag P=2: rank 1 holds chunks 1 and 2, which touch: one run
    assert fragments(make_layout("zigzag", 2), 8) == [[(0, 2, 0), (6, 2, 2)], [(2, 4, 0)]]
    assert fragments(make_layout("zigzag", 4), 16)[1] == [(2, 2, 0), (12, 2, 2)]
    frags = fragments(make_layout("zigzag", 4), 16)
    # rank 3's chunks 3 and 4 touch too: seven runs in global order
    assert [frags[r][j][0] for r, j in global_order(frags)] == [0, 2, 4, 6, 10, 12, 14]
    striped = fragments(make_layout("striped", 2), 8)
    assert all(n == 1 for fr in striped for _, n, _ in fr)
    with pytest.raises(ConfigError, match="at least 3 long"):
        check_fragments(striped, 3, "a conv")
    check_fragments(fragments(make_layout("contiguous", 4), 16), 3, "a conv")


def test_a_short_run_is_refused_only_where_a_halo_reads_it():
    """A run shorter than the halo is fine where a document starts it (the halo's zeros lie before it)
    or one starts after it (nothing reads its tail): dynamic groups pack documents of any length."""
    one_rank = fragments(make_layout("contiguous", 1), 2)
    check_fragments(one_rank, 3, "a conv")                                   # a 2-token sequence alone
    ring = cut_at_documents(fragments(make_layout("contiguous", 2), 16), [0, 2, 9, 16])
    check_fragments(ring, 3, "a conv", frozenset({2, 9}))                   # [0, 2) and [8, 9): a document follows
    zigzag = fragments(make_layout("zigzag", 4), 16)                        # runs of 2 tokens
    check_fragments(cut_at_documents(zigzag, [0, 2, 4, 6, 8, 10, 12, 14, 16]), 3, "a conv",
                    frozenset(range(2, 16, 2)))
    with pytest.raises(ConfigError, match="runs of 2 token"):               # [6, 8) feeds [8, 10) of its document
        check_fragments(cut_at_documents(zigzag, [0, 4, 16]), 3, "a conv", frozenset({4}))


def test_linear_strategy_is_a_validated_key():
    assert SequenceParallelConfig.parse({}).linear_strategy == "lasp"
    assert SequenceParallelConfig.parse({"linear_strategy": "ulysses"}).linear_strategy == "ulysses"
    with pytest.raises(ConfigError, match="linear_strategy='mamba' is not valid; choose one of: lasp, ulysses"):
        SequenceParallelConfig.parse({"linear_strategy": "mamba"})


def test_apply_map_matrix_and_scalar():
    s = torch.randn(2, 3, 4, 5)
    a = torch.randn(2, 3, 4, 4)
    assert torch.allclose(Transition(a).apply(s), a @ s)
    d = torch.rand(2, 3, 1, 1)
    assert torch.allclose(Transition(d).apply(s), d * s)


def _gdn_inputs(seed, n, hk=2, hv=4, dk=8, dv=16, kda=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, hk, dk, generator=g, dtype=torch.float64)
    k = torch.randn(2, n, hk, dk, generator=g, dtype=torch.float64)
    v = torch.randn(2, n, hv, dv, generator=g, dtype=torch.float64)
    gate = -torch.rand(2, n, hv, *((dk,) if kda else ()), generator=g, dtype=torch.float64)
    beta = 2 * torch.rand(2, n, hv, generator=g, dtype=torch.float64)         # OLMo-Hybrid: beta in [0, 2]
    return q, k, v, gate, beta


def _ops():
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid as olmo
    return {"gated_delta_rule": (olmo.torch_chunk_gated_delta_rule, False),
            "kimi_delta_attention": (kimi.chunk_kimi_delta_attention, True)}


@pytest.mark.parametrize("op_name", ["gated_delta_rule", "kimi_delta_attention"])
@pytest.mark.parametrize("layout,p", [("contiguous", 2), ("zigzag", 2), ("contiguous", 4), ("zigzag", 4)])
def test_widened_maps_folded_in_global_order_equal_the_whole_sequence(op_name, layout, p):
    from ds_seqpar.hf.linear.delta_rule import delta_rule_map
    from ds_seqpar.hf.linear.fold import with_state_in
    op, kda = _ops()[op_name]
    n = 8 * 19                                    # fragments of 19..76 tokens: partial 64-token chunks
    q, k, v, gate, beta = _gdn_inputs(0, n, hk=4 if kda else 2, kda=kda, dk=16 if kda else 8)
    if kda:
        v = v[..., :16]
    call = dict(use_qk_l2norm_in_kernel=True)
    whole, _ = op(q, k, v, g=gate, beta=beta, use_qk_l2norm_in_kernel=True)
    lay = make_layout(layout, p)
    frags = fragments(lay, n)
    maps = {}
    for r, fr in enumerate(frags):
        idx = lay.indices(n, r)
        for j, (_, length, off) in enumerate(fr):
            sl = idx[off:off + length]
            maps[r, j] = delta_rule_map(op, q[:, sl], k[:, sl], v[:, sl], gate[:, sl], beta[:, sl], call)
    s = torch.zeros_like(maps[0, 0][3])
    out = torch.empty_like(whole)
    for r, j in global_order(frags):
        start, length, _ = frags[r][j]
        o0, q_eff, a, b = maps[r, j]
        out[:, start:start + length] = with_state_in(o0, q_eff, s)
        s = Transition(a).apply(s) + b
    # transformers' op computes in fp32 whatever the input: compare at fp32 rounding of the output scale
    err = (out - whole).abs().max().item()
    assert err <= 2e-5 * whole.abs().max().item(), err
    # the test can fail: dropping the entering state is far outside that
    start, length, _ = frags[1][0]
    assert (maps[1, 0][0] - whole[:, start:start + length]).abs().max() > 1e-2


def test_seams_delegate_when_no_applied_layer_runs():
    """The replaced globals run transformers' op untouched for models without sequence parallelism."""
    import torch.nn as nn
    from ds_seqpar.hf.linear import seams
    from transformers.models.lfm2 import modeling_lfm2 as lfm2
    original = lfm2.causal_conv1d_fn

    class Lfm2ShortConv(nn.Module):
        pass

    Lfm2ShortConv.__module__ = lfm2.__name__
    try:
        seams.install_seams([("conv", Lfm2ShortConv())])
        seam = lfm2.causal_conv1d_fn
        assert seam is not original and seam._ds_seqpar_original is original
        seams.install_seams([("conv", Lfm2ShortConv())])           # once per process
        assert lfm2.causal_conv1d_fn is seam
        x, w = torch.randn(1, 6, 10), torch.randn(6, 3)
        assert torch.equal(seam(x, w, None), original(x, w, None))
    finally:
        lfm2.causal_conv1d_fn = original


def test_runs_are_cut_at_document_starts_with_local_offsets():
    from ds_seqpar.strategies.lasp_chain import cut_at_documents
    frags = fragments(make_layout("zigzag", 2), 16)           # rank 0: [0,4) and [12,16); rank 1: [4,12)
    cut = cut_at_documents(frags, [0, 2, 5, 13, 16])
    assert cut[0] == [(0, 2, 0), (2, 2, 2), (12, 1, 4), (13, 3, 5)]
    assert cut[1] == [(4, 1, 0), (5, 7, 1)]
