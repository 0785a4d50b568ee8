"""The cost model (cost/) against the one brute-force oracle (tests/reference.py: pairs counted
pair by pair on the dense mask, key spans found by enumerating every pair of blocks), and the closed
forms (strategies/closed_form.py) against the same oracle. Pure Python, no ranks."""
from __future__ import annotations

import pytest

from ds_seqpar.masks import Mask
from ds_seqpar.cost import bytes as cost_bytes, flops, memory, pairs
from ds_seqpar.sharding.layouts import make_layout
from ds_seqpar.strategies import get_strategy
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind
from ..reference import key_spans, pairs_per_query_set, ring_bytes_from_spans

SEQ = 96
MASKS = [(True, None, None), (False, None, None), (True, 7, None), (False, 7, None), (True, None, (30, 50, 16)),
         (False, 5, (30, 50, 16)), (True, 200, None)]
PADDED = [(True, None, 80), (False, 9, 77)]               # (causal, window, real length): end padding


@pytest.mark.parametrize("strategy,size", [("ring", 4), ("zigzag", 4), ("striped", 4), ("ulysses", 4)])
@pytest.mark.parametrize("causal,window,real", PADDED)
def test_end_padding_computes_nothing(strategy, size, causal, window, real):
    """A mask's real length (one document, padding after it): the padding's queries and keys see nothing."""
    mask, bounds = Mask(causal, window, None, real), [0, real]
    assert pairs.pairs_total(SEQ, mask) == pairs_per_query_set(SEQ, causal, window, bounds, [range(SEQ)])[0]
    got = pairs.pairs_per_rank(strategy, size, size if strategy == "ulysses" else 1, SEQ, mask)
    if strategy == "ulysses":
        want = [pairs_per_query_set(SEQ, causal, window, bounds, [range(SEQ)])[0] / size] * size
    else:
        want = pairs_per_query_set(SEQ, causal, window, bounds, _positions(strategy, size, SEQ))
    assert got == want


def _bounds(docs, seq):
    return Mask(docs=docs).bounds(seq) if docs else None


def _positions(strategy, r, seq):
    layout = make_layout(get_strategy(strategy).layout_name, r)
    return [layout.indices(seq, pos) for pos in range(r)]


@pytest.mark.parametrize("causal,window,docs", MASKS)
def test_pairs_total_and_keys_per_query_are_the_oracles(causal, window, docs):
    want = pairs_per_query_set(SEQ, causal, window, _bounds(docs, SEQ), [range(SEQ)])[0]
    assert pairs.pairs_total(SEQ, Mask(causal, window, docs)) == want
    if window is not None and window < SEQ or docs:      # (no mask: the benchmark's S / 2 convention)
        assert flops.keys_per_query(SEQ, causal, window, docs) == want / SEQ


@pytest.mark.parametrize("strategy,size,u", [("ring", 4, 1), ("zigzag", 4, 1), ("striped", 4, 1), ("zigzag", 4, 2),
                                             ("striped", 6, 3), ("ulysses", 4, 4)])
@pytest.mark.parametrize("causal,window,docs", MASKS)
def test_pairs_per_rank_are_the_oracles(strategy, size, u, causal, window, docs):
    got = pairs.pairs_per_rank(strategy, size, u, SEQ, Mask(causal, window, docs))
    bounds = _bounds(docs, SEQ)
    if strategy == "ulysses":
        want = [pairs_per_query_set(SEQ, causal, window, bounds, [range(SEQ)])[0] / size] * size
    else:
        per_pos = pairs_per_query_set(SEQ, causal, window, bounds, _positions(strategy, size // u, SEQ))
        want = [per_pos[rank // u] / u for rank in range(size)]
    assert got == want


@pytest.mark.parametrize("strategy,u", [("ring", 1), ("zigzag", 1), ("striped", 1), ("zigzag", 2)])
@pytest.mark.parametrize("causal,window,docs", MASKS[2:-1])        # masked: the plain ring passes every block on
def test_masked_ring_bytes_are_the_oracles_spans(strategy, u, causal, window, docs):
    """Bytes per rank from the oracle's spans: the cost model's and the closed form's, rank by rank."""
    size, sh = 4, Shapes(1, SEQ, 4, 2, 8, 2)
    r = size // u
    spans = key_spans(SEQ, causal, window, _bounds(docs, SEQ), _positions(strategy, r, SEQ))
    token_elems = sh.kv_heads * (sh.head_dim + sh.dv) // u
    got = cost_bytes.rank_bytes(strategy, size, u, sh, Mask(causal, window, docs))
    for rank in range(size):
        want = {k: v for k, v in ring_bytes_from_spans(spans, rank // u, token_elems, sh.elem).items() if v}
        form = closed_form_by_kind(strategy, size, sh, rank, u, causal=causal, window=window,
                                   cu_seqlens=_bounds(docs, SEQ))
        ring = lambda d: {k: v for k, v in d.items() if k != "all_to_all"}    # noqa: E731
        assert ring(got[rank]) == want == ring(form), f"rank {rank}"


# causal masks with bidirectional blocks (Gemma 3's images: masks.Mask.blocks), (window, docs, blocks): blocks
# across every P=4 layout's boundaries, longer than the window, inside packed documents, at a document's end
BLOCKED = [(None, None, ((10, 22), (28, 37), (44, 60))), (6, None, ((12, 26), (40, 43))),
           (None, (20, 30, 46), ((3, 18), (24, 41), (52, 60))), (9, (33, 63), ((5, 12), (40, 96)))]


@pytest.mark.parametrize("window,docs,blocks", BLOCKED)
def test_bidirectional_blocks_pairs_and_bytes_are_the_oracles(window, docs, blocks):
    """Pairs (whole, per rank of every layout), keys per query and ring bytes of a blocked mask: the
    cost model's and the closed form's against the oracle's enumeration of the dense mask."""
    mask, bounds = Mask(True, window, docs, blocks=blocks), _bounds(docs, SEQ)
    whole = pairs_per_query_set(SEQ, True, window, bounds, [range(SEQ)], blocks)[0]
    assert pairs.pairs_total(SEQ, mask) == whole
    assert flops.keys_per_query(SEQ, True, window, docs, blocks) == whole / SEQ
    sh = Shapes(1, SEQ, 4, 2, 8, 2)
    for strategy, size, u in [("ring", 4, 1), ("zigzag", 4, 1), ("striped", 4, 1), ("zigzag", 4, 2), ("ulysses", 4, 4)]:
        got = pairs.pairs_per_rank(strategy, size, u, SEQ, mask)
        if strategy == "ulysses":
            assert got == [whole / size] * size
            continue
        positions = _positions(strategy, size // u, SEQ)
        per_pos = pairs_per_query_set(SEQ, True, window, bounds, positions, blocks)
        assert got == [per_pos[rank // u] / u for rank in range(size)], (strategy, u)
        spans = key_spans(SEQ, True, window, bounds, positions, blocks)
        cost = cost_bytes.rank_bytes(strategy, size, u, sh, mask)
        for rank in range(size):
            want = {k: v for k, v in ring_bytes_from_spans(spans, rank // u, sh.kv_heads * (sh.head_dim + sh.dv) // u,
                                                           sh.elem).items() if v}
            form = closed_form_by_kind(strategy, size, sh, rank, u, cu_seqlens=bounds, window=window, blocks=blocks)
            ring = lambda d: {k: v for k, v in d.items() if k != "all_to_all"}    # noqa: E731
            assert ring(cost[rank]) == want == ring(form), (strategy, u, rank)


@pytest.mark.parametrize("strategy", ["ring", "zigzag", "striped", "ulysses"])
@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_speedup_bound_is_the_counted_imbalance_at_long_sequence(strategy, p, causal):
    work = pairs.pairs_per_rank(strategy, p, p if strategy == "ulysses" else 1, 1 << 16, Mask(causal))
    assert pairs.imbalance(work) == pytest.approx(pairs.expected_imbalance(strategy, p, causal), rel=1e-3)
    assert pairs.speedup_bound(strategy, p, causal) == pytest.approx(p / pairs.imbalance(work), rel=1e-3)


def test_phase_model_inverts_and_bounds():
    lines = {"forward": {"a": 100.0, "b": 2.0}, "backward": {"a": 50.0, "b": 3.0}, "optimizer": {"a": 120.0, "b": 0.0}}
    assert memory.peak(lines, 10) == 120.0 and memory.peak(lines, 100) == 350.0
    n = memory.max_tokens(lines, 1000.0)
    assert memory.peak(lines, n) <= 1000.0 < memory.peak(lines, n + 1)
    assert memory.max_tokens(lines, 110.0) == 0                       # the optimizer's fixed part is past it
    assert memory.max_tokens({"optimizer": {"a": 1.0, "b": 0.0}}, 10.0, unbounded=-1) == -1
    fit = memory.fit_line([1, 2, 4], [12.0, 14.0, 18.0])
    assert fit["a"] == pytest.approx(10.0) and fit["b"] == pytest.approx(2.0) and fit["max_residual"] < 1e-9


def test_mamba1_layers_are_priced_as_a_diagonal_scan(tmp_path, capsys):
    """Mamba-1 (every layer) and Jamba (its mamba layers): the shape read from the config, the mixer's
    matmul parameters those of the built layer, the scan's FLOPs per token the same at every length
    (linear in tokens), the state bytes a diagonal transition's; ds-seqpar plan plans the model."""
    import transformers as T
    from ds_seqpar.cost.bytes import comm_per_layer
    from ds_seqpar.cost.candidate import Candidate, Features
    from ds_seqpar.plan.main import main as plan_main
    from ds_seqpar.cost.model_shape import from_hf_config
    from ds_seqpar.strategies.closed_form import linear_state_bytes
    cfg = T.MambaConfig(hidden_size=32, state_size=8, expand=2, conv_kernel=4, time_step_rank=8, num_hidden_layers=2,
                        vocab_size=64)
    shape = from_hf_config(cfg)
    assert shape.layer_kinds == ("mamba",) * 2 and shape.transition == "diagonal"
    assert (shape.lin_heads, shape.lin_dk, shape.lin_dv, shape.dt_rank, shape.intermediate) == (64, 8, 1, 8, 0)
    from transformers.models.mamba.modeling_mamba import MambaMixer
    mixer = MambaMixer(cfg, 0)
    assert shape.mixer_params("mamba") == sum(getattr(mixer, n).weight.numel()
                                              for n in ("in_proj", "x_proj", "dt_proj", "out_proj"))
    scan = [flops.forward_per_token(shape, seq)["linear_scan"] for seq in (1024, 1 << 20)]
    assert scan == [2 * 6.0 * 64 * 8] * 2
    sent = comm_per_layer(Candidate("ring", 4, 1, 2, Features()), shape, 256, 2)["mamba"]
    state = linear_state_bytes([[(r, r + 1)] for r in range(4)], 0, 1, 64, 8, 1, "allgather", "diagonal")
    assert sent["lasp_state"] == state["lasp_state"] == 3 * 64 * 8 * 4 * 2        # B and the diagonal A, fp32
    jamba = from_hf_config(T.JambaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4, attn_layer_period=2,
                                         attn_layer_offset=1, mamba_d_state=8, mamba_expand=2, mamba_dt_rank="auto",
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    assert jamba.layer_kinds == ("mamba", "attention") * 2 and (jamba.lin_heads, jamba.dt_rank, jamba.intermediate) == \
        (64, 2, 48)
    cfg.save_pretrained(tmp_path)
    assert plan_main(["--model", str(tmp_path), "--seq-len", str(1 << 16), "--gpus", "4", "--gpus-per-node", "4",
                      "--zero", "2"]) == 0, capsys.readouterr().err


def test_indexed_layers_bytes_are_what_travels(tmp_path, capsys):
    """DeepSeek sparse attention: the latents and, on layers with their own indexer, the indexer keys
    (GLM-5's "shared" layers reuse a selection: none); ds-seqpar plan, which has no FLOPs for them yet,
    refuses such a model by name."""
    import transformers as T
    from ds_seqpar.cost.bytes import comm_per_layer
    from ds_seqpar.cost.candidate import Candidate, Features
    from ds_seqpar.plan.main import main as plan_main
    from ds_seqpar.cost.model_shape import from_hf_config
    from ds_seqpar.strategies.closed_form import indexed_attention_bytes
    cfg = T.GlmMoeDsaConfig(num_hidden_layers=3, indexer_types=["full", "shared", "full"], kv_lora_rank=16,
                            qk_rope_head_dim=8, index_head_dim=16, hidden_size=64, vocab_size=64)
    shape = from_hf_config(cfg)
    assert shape.layer_kinds == ("indexed", "indexed_shared", "indexed")
    assert (shape.latent_dim, shape.index_dim) == (24, 16)
    sent = comm_per_layer(Candidate("zigzag", 4, 1, 2, Features()), shape, 32, 2)
    assert sent["indexed"] == indexed_attention_bytes(4, 1, 128, 24, 16, 2) == \
        {"dsa_latent": 2 * 3 * 32 * 24 * 2, "dsa_index_keys": 3 * 32 * 16 * 2}
    assert sent["indexed_shared"] == {"dsa_latent": 2 * 3 * 32 * 24 * 2}
    cfg.save_pretrained(tmp_path)
    assert plan_main(["--model", str(tmp_path), "--seq-len", "4096", "--gpus", "4"]) == 2
    assert "DeepSeek sparse attention" in capsys.readouterr().err
