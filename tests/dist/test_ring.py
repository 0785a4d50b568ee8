"""Ring, zigzag, striped and the 2D Ulysses x Ring hybrid on 4 CPU gloo ranks: exactness against
single-process attention, bytes against the closed forms, causal skipping, and clear errors.

Size 2 on the 4-rank pool is two sequence groups of 2 ranks (dp=2), both checking their results.
"""
import pytest
import torch

from ds_seqpar import SequenceParallel
from ds_seqpar.kernels import AttentionKernel
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind

from ..dist_checks import (HEAD_CASES, assert_each_config_checked, check_configs_exact, global_inputs,
                           sharded_attention_grads)
from ..reference import block_pairs, pairs_per_query_set

RING_STRATEGIES = ("ring", "zigzag", "striped")
SEQ, BATCH, HEAD_DIM, E = 64, 2, 16, 4




@pytest.mark.parametrize("size", [2, 4])
def test_ring_strategies_match_single_process(pool, size):
    cfgs = [{"strategy": s, "size": size} for s in RING_STRATEGIES]
    if size == 4:
        cfgs.append({"strategy": "zigzag", "size": 4, "overlap": False})   # the non-overlapped path
    assert_each_config_checked(pool.run(check_configs_exact, cfgs), cfgs, len(HEAD_CASES))


@pytest.mark.parametrize("ulysses_size", [2, 4])
def test_hybrid_matches_single_process(pool, ulysses_size):
    cfgs = [{"strategy": s, "size": 4, "ulysses_size": ulysses_size} for s in RING_STRATEGIES]
    assert_each_config_checked(pool.run(check_configs_exact, cfgs), cfgs, len(HEAD_CASES))


def _layout_of(cfg):
    sp = SequenceParallel(cfg)
    inner = getattr(sp.strategy, "ring", None)          # the hybrid wraps a ring strategy
    name = type(sp.strategy).__name__ + (f"({type(inner).__name__})" if inner is not None else "")
    return name, repr(sp.layout)


@pytest.mark.parametrize("ring", RING_STRATEGIES)
def test_hybrid_uses_the_ring_strategy_layout(pool, ring):
    name, layout = pool.run(_layout_of, {"strategy": ring, "size": 4, "ulysses_size": 2})[0]
    layout_cls = {"ring": "ContiguousLayout", "zigzag": "ZigzagLayout", "striped": "StripedLayout"}[ring]
    ring_cls = {"ring": "RingAttention", "zigzag": "ZigzagAttention", "striped": "StripedAttention"}[ring]
    assert name == f"HybridAttention({ring_cls})" and layout == f"HybridLayout({layout_cls}, ring_size=2, ulysses_size=2)", \
        (name, layout)
    name, layout = pool.run(_layout_of, {"strategy": ring, "size": 4, "ulysses_size": 1})[0]
    assert "Hybrid" not in name and layout == f"{layout_cls}(size=4)", (name, layout)


# -- bytes ------------------------------------------------------------------------------------


def _bytes_per_kind(cfgs, heads, kv_heads):
    """Per config and causal flag: the bytes per CommStats kind of one fwd+bwd on this rank."""
    out = []
    for cfg in cfgs:
        sp = SequenceParallel(cfg)
        q, k, v, dout = global_inputs(2, BATCH, SEQ, heads, kv_heads, HEAD_DIM)
        for causal in (True, False):                 # causal blocks are skipped, never their transfers
            sp.stats.reset()
            sharded_attention_grads(sp, q, k, v, dout, causal)
            out.append((cfg, causal, {kind: n for kind, n in sp.stats.bytes.items() if n}))
    return out


def _assert_bytes_match_closed_form(pool, cfgs, head_cases):
    for heads, kv_heads in head_cases:
        for rank, per_cfg in enumerate(pool.run(_bytes_per_kind, cfgs, heads, kv_heads)):
            for cfg, causal, sent in per_cfg:
                shapes = Shapes(BATCH, SEQ, heads, kv_heads, HEAD_DIM, E)
                want = closed_form_by_kind(cfg["strategy"], cfg["size"], shapes, ulysses_size=cfg.get("ulysses_size", 1))
                assert sent == want, (f"{cfg} causal={causal} heads={heads} kv_heads={kv_heads} rank {rank}: "
                                      f"sent {sent}, closed form {want}")


@pytest.mark.parametrize("size", [2, 4])
def test_ring_bytes_match_closed_form(pool, size):
    # MHA and GQA: bytes scale with the kv heads, which travel unrepeated
    _assert_bytes_match_closed_form(pool, [{"strategy": s, "size": size} for s in RING_STRATEGIES],
                                    [(4, 4), (4, 2), (4, 1)])


def test_hybrid_bytes_match_closed_form(pool):
    # kv heads 4 and 2 split over U=2; 1 is repeated f=2 times before the all-to-all and the ring
    _assert_bytes_match_closed_form(pool, [{"strategy": s, "size": 4, "ulysses_size": 2} for s in RING_STRATEGIES],
                                    [(4, 4), (4, 2), (4, 1)])


# -- causal skipping --------------------------------------------------------------------------


class CountingKernel(AttentionKernel):
    """Delegates to a real kernel and records the (q, k) pairs each call computes (the oracle's block_pairs)."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.calls = {"forward": [], "backward": [], "tall": []}     # tall: forward calls with sq > sk

    def pieces(self, nq, nk, lo, hi, device):
        return self.inner.pieces(nq, nk, lo, hi, device)       # the inner kernel's cut, counted here

    def forward(self, q, k, v, causal, scale, softcap=None):
        self.calls["forward"].append(block_pairs(q.shape[1], k.shape[1], causal))
        if causal and q.shape[1] > k.shape[1]:
            self.calls["tall"].append(self.calls["forward"][-1])
        return self.inner.forward(q, k, v, causal, scale, softcap)

    def backward(self, dout, q, k, v, out, lse, causal, scale, softcap=None):
        self.calls["backward"].append(block_pairs(q.shape[1], k.shape[1], causal))
        return self.inner.backward(dout, q, k, v, out, lse, causal, scale, softcap)


def counted_fwd_bwd(cfg, seed, seq, causal, head_dim, **options):
    """One sp.attention forward + backward on fresh global inputs (batch 1, 4 q / 2 k/v heads) with a
    counting kernel: (sp, {phase: [pairs per kernel call]}, {CommStats kind: bytes sent}) of this rank,
    without the packed-document agreement check's bytes. ``options``: cu_seqlens, window, ..."""
    sp = SequenceParallel(cfg)
    counter = CountingKernel(sp.kernel)
    sp.strategy.ctx.kernel = counter
    q, k, v, dout = global_inputs(seed, 1, seq, 4, 2, head_dim)
    q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
    sp.stats.reset()
    sp.attention(q_l, k_l, v_l, causal=causal, **options).backward(sp.shard(dout))
    sent = {kind: b for kind, b in sp.stats.bytes.items() if b and kind != "cu_seqlens_check"}
    return sp, counter.calls, sent


def _work_per_rank(cfgs, causal):
    out = []
    for cfg in cfgs:
        sp = SequenceParallel(cfg)
        counter = CountingKernel(sp.kernel)
        sp.strategy.ctx.kernel = counter
        q, k, v, dout = global_inputs(3, 1, SEQ, 2, 2, HEAD_DIM)
        sharded_attention_grads(sp, q, k, v, dout, causal)
        visible = pairs_per_query_set(SEQ, causal, None, None, [sp.layout.indices(SEQ, sp.rank)])[0]
        out.append((sp.rank, counter.calls, visible))
    return out


def test_causal_blocks_are_skipped_and_only_visible_pairs_computed(pool):
    p = 4
    cfgs = [{"strategy": s, "size": p} for s in RING_STRATEGIES]
    for per_cfg in pool.run(_work_per_rank, cfgs, True):
        for cfg, (rank, calls, visible) in zip(cfgs, per_cfg):
            # contiguous ring: blocks from higher ranks are skipped; zigzag/striped: a piece every step
            n_calls = rank + 1 if cfg["strategy"] == "ring" else p
            for phase in ("forward", "backward"):
                assert len(calls[phase]) == n_calls, f"{cfg} rank {rank} {phase}: {len(calls[phase])} kernel calls"
                assert sum(calls[phase]) == visible, \
                    f"{cfg} rank {rank} {phase}: computed {sum(calls[phase])} (q, k) pairs, visible {visible}"
    for per_cfg in pool.run(_work_per_rank, cfgs, False):
        for cfg, (rank, calls, visible) in zip(cfgs, per_cfg):
            assert len(calls["forward"]) == p and sum(calls["forward"]) == visible, (cfg, rank, calls)


# -- errors before communication ---------------------------------------------------------------


def _error_of(cfg, local_len, heads):
    sp = SequenceParallel(cfg)
    q = torch.randn(1, local_len, heads, HEAD_DIM)
    sp.stats.reset()
    try:
        sp.attention(q, q, q)
    except ValueError as err:
        return str(err), sp.stats.total_bytes
    return "no error", sp.stats.total_bytes


@pytest.mark.parametrize("cfg,local_len,heads,needles", [
    ({"strategy": "zigzag", "size": 2}, 7, 4, ["multiple of 2", "got 7 tokens per rank", "pad the sequence to 16",
                                                "truncate it to 12"]),
    ({"strategy": "zigzag", "size": 4, "ulysses_size": 2}, 3, 4, ["no error"]),   # ring shard 6 is even
    ({"strategy": "striped", "size": 4, "ulysses_size": 4}, 8, 6, ["sequence_parallel.ulysses_size=4",
                                                                   "6 q heads"]),
])
def test_bad_lengths_and_heads_are_clear_errors(pool, cfg, local_len, heads, needles):
    results = pool.run(_error_of, cfg, local_len, heads)
    msgs = {m for m, _ in results}
    assert len(msgs) == 1, msgs
    msg = msgs.pop()
    assert all(n in msg for n in needles), msg
    if needles != ["no error"]:
        assert all(sent == 0 for _, sent in results), f"communication before the error: {results}"
