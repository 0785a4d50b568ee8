"""Sliding windows, softcapping and sinks (sp.attention's window / softcap / sinks) on the 4-rank pool:
every softmax strategy at 2 and 4 ranks and the 2D hybrid, causal and not, MHA and GQA, with and
without packed documents and end padding, against a float64 dense reference with the derived
tolerance; work only inside the mask; bytes equal to the window-aware closed forms; bad arguments
refused before any communication.
"""
import pytest
import torch

from ds_seqpar import SequenceParallel
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind

from ..dist_checks import assert_each_config_checked, global_inputs, group_shares
from ..reference import assert_derived_close, assert_shards_close, masked_attention_with_grads, pairs_per_query_set
from .test_ring import counted_fwd_bwd

HEAD_DIM = 8
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
# (global length, real length or None, window, softcap, sinks?, cu_seqlens): windows inside one shard
# and across several, a window with documents, softcap alone and with a window, sinks with every mask,
# end padding (61 tokens: no multiple of any layout's P or 2P; shard() pads, pads see nothing)
MASK_CASES = [(64, None, 5, None, False, None), (64, None, 40, None, False, None),
              (64, None, None, 3.0, False, None), (64, None, None, None, True, None),
              (64, None, 7, 2.0, True, None), (64, None, 6, None, False, [0, 11, 40, 64]),
              (64, None, 3, None, True, [0, 30, 64]), (61, 61, 9, None, True, None)]
HEADS = ((4, 4), (4, 2))
# windows of >= 256 diagonals, which the CPU kernel cuts into key columns of tall blocks (bands.py):
# with sinks, and softcapped inside documents (the written-out path on tall blocks)
LONG_CASES = [(640, None, 260, None, True, None), (640, None, 270, 2.0, False, [0, 300, 640])]


def _check_masks(cfgs, cases=MASK_CASES):
    """{config index: cases checked} of this rank's group_shares; each case's references are computed once
    and checked against every config."""
    shares = group_shares(cfgs)
    counts = {i: 0 for i, _, _ in shares}
    for seq, real, window, softcap, use_sinks, bounds in cases:
        for causal in (True, False):
            for heads, kv_heads in HEADS:
                q, k, v, dout = global_inputs(seq + heads + kv_heads, 1, seq, heads, kv_heads, HEAD_DIM)
                sinks = SINKS[:heads].clone() if use_sinks else None
                scale = HEAD_DIM ** -0.5
                kw = dict(window=window, softcap=softcap, sinks=sinks, bounds=bounds)
                ref64 = masked_attention_with_grads(q, k, v, dout, causal, scale, torch.float64, **kw)
                plain = masked_attention_with_grads(q, k, v, dout, causal, scale, torch.float32, **kw)
                for i, cfg, sp in shares:
                    q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
                    s_l = None if sinks is None else sinks.clone().requires_grad_()
                    out_l = sp.attention(q_l, k_l, v_l, causal=causal, softmax_scale=scale, seq_len=real,
                                         cu_seqlens=bounds, window=window, softcap=softcap, sinks=s_l)
                    out_l.backward(sp.shard(dout))
                    case = (f"{cfg} seq={seq}/{real} window={window} softcap={softcap} sinks={use_sinks} "
                            f"cu={bounds} causal={causal} heads={heads}/{kv_heads} sp_rank={sp.rank}")
                    assert_shards_close(case, sp, out_l, (q_l, k_l, v_l), ref64, plain)
                    if s_l is not None:
                        total = s_l.grad.clone()          # each rank holds its share (its rows / heads)
                        torch.distributed.all_reduce(total, group=sp.group)
                        assert_derived_close(f"{case} dsinks", total, ref64[4], plain[4])
                    counts[i] += 1
    return counts


@pytest.mark.parametrize("size", [2, 4])
def test_masks_and_score_modifiers_match_dense_reference(pool, size):
    cfgs = [{"strategy": s, "size": size} for s in ("ulysses", "ring", "zigzag", "striped")]
    if size == 4:
        cfgs += [{"strategy": "zigzag", "size": 4, "ulysses_size": 2},
                 {"strategy": "ring", "size": 4, "overlap": False}]
    assert_each_config_checked(pool.run(_check_masks, cfgs), cfgs, len(MASK_CASES) * 2 * len(HEADS))


@pytest.mark.parametrize("size", [2, 4])
def test_long_windows_cut_into_key_columns_match_dense_reference(pool, size):
    cfgs = [{"strategy": s, "size": size} for s in ("ulysses", "ring", "zigzag")]
    if size == 4:
        cfgs.append({"strategy": "zigzag", "size": 4, "ulysses_size": 2})
    assert_each_config_checked(pool.run(_check_masks, cfgs, LONG_CASES), cfgs, len(LONG_CASES) * 2 * len(HEADS))


# -- work and bytes follow the window -------------------------------------------------------------


def _window_work_and_bytes(cfgs, seq, window, causal):
    out = []
    for cfg in cfgs:
        sp, calls, got = counted_fwd_bwd(cfg, 11, seq, causal, HEAD_DIM, window=window)
        want = closed_form_by_kind(cfg["strategy"], sp.size, Shapes(1, seq, 4, 2, HEAD_DIM), sp.rank,
                                   cfg.get("ulysses_size", 1), causal=causal, window=window)
        mine = sp.layout.indices(seq, sp.rank)
        visible = pairs_per_query_set(seq, causal, window, None, [mine])[0]
        out.append((cfg, sp.rank, calls, visible, got, want))
    return out


@pytest.mark.parametrize("seq,window,causal", [(64, 5, True), (64, 20, True), (64, 9, False), (2048, 300, True)])
def test_window_work_is_the_band_and_bytes_match_closed_form(pool, seq, window, causal):
    cfgs = [{"strategy": s, "size": 4} for s in ("ring", "zigzag", "striped")]
    cfgs.append({"strategy": "zigzag", "size": 4, "ulysses_size": 2})
    for per_cfg in pool.run(_window_work_and_bytes, cfgs, seq, window, causal):
        for cfg, rank, calls, visible, got, want in per_cfg:
            what = f"{cfg} window={window} causal={causal} rank {rank}"
            if cfg.get("ulysses_size", 1) == 1:          # the hybrid computes on its heads' whole shard
                for phase in ("forward", "backward"):
                    assert sum(calls[phase]) == visible, \
                        f"{what} {phase}: computed {sum(calls[phase])} (q, k) pairs, {visible} inside the window"
            assert got == want, f"{what}: sent {got}, closed form {want}"
            if window >= 256 and cfg["strategy"] == "ring":
                # the CPU kernel's key columns (bands.py): most of the band in tall causal / anti blocks
                # (zigzag's 128-token chunks here are shorter than a column; striped's band is w / P wide)
                assert sum(calls["tall"]) > visible // 2, f"{what}: {sum(calls['tall'])} of {visible} pairs tall"
            if cfg["strategy"] == "ring" and causal and window <= seq // 4:
                # the contiguous ring moves the last w-1 tokens of one neighbour: k and v (2 kv heads x 8)
                # forward and backward, and an fp32 dK/dV share back
                token = 2 * HEAD_DIM * 2
                assert got.get("ring", 0) == (window - 1) * token * 4 * 2 * (rank < 3), what
                assert got.get("ring_grad", 0) == (window - 1) * token * 4 * (rank > 0), what


# -- bad arguments -----------------------------------------------------------------------------------


def _bad_arguments(cfg):
    sp = SequenceParallel(cfg)
    q, k, v, _ = global_inputs(0, 1, 16, 4, 2, HEAD_DIM)
    q_l, k_l, v_l = (sp.shard(t) for t in (q, k, v))
    messages = []
    for kw in ({"window": 0}, {"window": 2.5}, {"window": True}, {"softcap": 0.0}, {"softcap": float("inf")},
               {"sinks": torch.zeros(3)}, {"sinks": torch.zeros(4, dtype=torch.int64)}, {"sinks": [0.0] * 4}):
        sp.stats.reset()
        try:
            sp.attention(q_l, k_l, v_l, **kw)
        except ValueError as err:
            messages.append(str(err))
        else:
            messages.append(None)
        assert sp.stats.total_bytes == 0, f"{kw}: communicated before refusing"
    return messages


def test_bad_window_softcap_and_sinks_are_refused_before_communication(pool):
    per_rank = pool.run(_bad_arguments, {"strategy": "zigzag", "size": 4})
    assert all(m == per_rank[0] for m in per_rank), "ranks disagree on the messages"
    names = ["window=0", "window=2.5", "window=True", "softcap=0.0", "softcap=inf", "sinks", "sinks", "sinks"]
    for name, msg in zip(names, per_rank[0]):
        assert msg is not None and name in msg, (name, msg)


# -- one plan per mask, not one per layer --------------------------------------------------------------


def _plans_built(cfg, layers):
    """MaskPlans built (strategies/mask_plan.py) by forward + backward of L-layer models on one packed
    batch: the own LM twice (the second step finds the first one's plan), then a Hugging Face Qwen2
    whose first half of layers is full attention and second half a sliding window of 8."""
    import transformers as T

    from ds_seqpar.hf import apply_sequence_parallel
    from ds_seqpar.models.lm import CausalLM, ModelConfig
    from ds_seqpar.strategies import mask_plan
    built, init = [], mask_plan.MaskPlan.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)
    mask_plan.MaskPlan.__init__ = counting
    try:
        pos = torch.cat([torch.arange(n) for n in (7, 12, 3, 10)])[None]
        ids = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(0))
        counts = []
        sp = SequenceParallel(cfg)
        own = CausalLM(ModelConfig(vocab_size=96, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2), sp)
        for _ in range(2):
            batch = sp.shard_batch({"input_ids": ids, "position_ids": pos})
            own(batch["input_ids"], batch["position_ids"], batch["labels"], batch["cu_seqlens"]).backward()
            counts.append(len(built) - sum(counts))
        sp = SequenceParallel(cfg)
        hf_cfg = T.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=96, attention_dropout=0.0, use_cache=False,
                               use_sliding_window=True, sliding_window=8, max_window_layers=layers // 2)
        model = apply_sequence_parallel(T.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa"), sp)
        batch = sp.shard_batch({"input_ids": ids, "labels": ids, "position_ids": pos})
        labels = batch.pop("labels")
        sp.loss(model(**batch).logits, labels).backward()
        counts.append(len(built) - sum(counts))
    finally:
        mask_plan.MaskPlan.__init__ = init
    return counts


@pytest.mark.parametrize("cfg", [{"strategy": "zigzag", "size": 2}, {"strategy": "ulysses", "size": 2}],
                         ids=["zigzag", "ulysses"])
def test_a_model_of_l_layers_plans_each_mask_once(pool, cfg):
    """Before, every layer's attention call rebuilt the document / window plan (L per forward)."""
    for counts in pool.run(_plans_built, cfg, 6):
        assert counts == [1, 0, 2], f"{cfg}: plans built per forward (own LM, again, HF full + sliding): {counts}"
