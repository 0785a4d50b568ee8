"""Packed documents for LASP (the state restarts at every document start) and for shard_batch
(cu_seqlens, within-document positions, no label across a document boundary), on the 4-rank pool."""
import pytest
import torch

from ds_seqpar import SequenceParallel
from ds_seqpar.kernels.linear import linear_attention_reference
from ds_seqpar.sharding.batch import shard_batch
from ds_seqpar.sharding.documents import Documents
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind
from ds_seqpar.strategies.lasp_chain import LaspChain

from ..reference import assert_derived_close
from .test_lasp import DECAY, DK, DV, MODES, scan_blocks_of

# 320 tokens (160 / 80 per rank at size 2 / 4, chunks of 64): documents of odd lengths, shorter than
# a shard, one token long, crossing every rank boundary, ending exactly on one; 301: end padding
LASP_CASES = [(301, [0, 5, 6, 130, 301]), (320, [0, 320]), (320, [0, 3, 170, 240, 320]),
              (320, [0, 80, 160, 240, 320])]


def per_document_reference(q, k, v, do, decay, bounds, dtype):
    """(o, dq, dk, dv) of the quadratic form on each document separately, in ``dtype``."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    d = None if decay is None else decay.to(dtype)
    o = torch.cat([linear_attention_reference(*(x[:, a:b] for x in leaves), d) for a, b in zip(bounds, bounds[1:])], 1)
    return (o.detach(), *torch.autograd.grad(o, leaves, do.to(dtype)))


def _lasp_inputs(seed, seq, heads, kv_heads):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, heads, DK, generator=g) / DK ** 0.5
    k = torch.randn(1, seq, kv_heads, DK, generator=g) / DK ** 0.5
    return q, k, torch.randn(1, seq, kv_heads, DV, generator=g), torch.randn(1, seq, heads, DV, generator=g)


def _check_lasp(size):
    checked = []
    for mode in MODES:
        sp = SequenceParallel({"strategy": "lasp", "size": size, "lasp_comm": mode})
        for seq, bounds in LASP_CASES:
            for use_decay, kv_heads in ((False, 4), (True, 2)):
                decay = DECAY if use_decay else None
                q, k, v, do = _lasp_inputs(len(checked), seq, 4, kv_heads)
                ref64 = per_document_reference(q, k, v, do, decay, bounds, torch.float64)
                plain = per_document_reference(q, k, v, do, decay, bounds, torch.float32)
                q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
                sp.stats.reset()
                o_l = sp.linear_attention(q_l, k_l, v_l, decay=decay, cu_seqlens=bounds)
                o_l.backward(sp.shard(do))
                sent = {k: b for k, b in sp.stats.bytes.items() if b and k != "cu_seqlens_check"}
                case = (f"lasp {mode} size={size} cu_seqlens={bounds} decay={use_decay} kv_heads={kv_heads} "
                        f"rank {sp.rank}")
                got = [sp.unshard(t, seq_len=seq) for t in (o_l.detach(), q_l.grad, k_l.grad, v_l.grad)]
                for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref64, plain):
                    assert_derived_close(f"{case} {name}", g, r, p)
                shapes = Shapes(1, q_l.shape[1] * size, 4, kv_heads, DK, v_head_dim=DV)
                want = closed_form_by_kind("lasp", size, shapes, sp.rank, lasp_comm=mode, cu_seqlens=bounds)
                assert sent == want, f"{case}: sent {sent}, closed form {want}"
                checked.append(case)
    return checked


@pytest.mark.parametrize("size", [2, 4])
def test_lasp_packed_documents_match_per_document_reference(pool, size):
    for checked in pool.run(scan_blocks_of, _check_lasp, size):
        assert len(checked) == len(MODES) * len(LASP_CASES) * 2, checked


def test_lasp_chain_states_cross_only_document_boundaries():
    chain = LaspChain(4, 80, Documents([0, 3, 170, 240, 320], 320))
    assert chain.segments == [[(0, 3), (3, 80)], [(0, 80)], [(0, 10), (10, 80)], [(0, 80)]]
    assert chain.takes_in == [False, True, True, False] and chain.carry == [False, True, False, False]
    assert chain.sends == [True, True, False, False]
    assert [chain.chain(r) for r in range(4)] == [[], [0], [1, 0], []]
    assert not LaspChain(4, 80, Documents([0, 80, 160, 240, 320], 320)).any_state_travels
    plain = LaspChain(3, 10)
    assert plain.takes_in == [False, True, True] and plain.chain(2) == [1, 0] and plain.sends == [True, True, False]


# -- shard_batch -----------------------------------------------------------------------------


def _packed_batch(cfg, lengths):
    sp = SequenceParallel(cfg)
    n = sum(lengths)
    ids = torch.arange(100, 100 + n)[None]
    pos = torch.cat([torch.arange(length) for length in lengths])[None]
    local = sp.shard_batch({"input_ids": ids, "labels": ids, "position_ids": pos})
    from_cu = sp.shard_batch({"input_ids": ids, "labels": ids, "cu_seqlens": local["cu_seqlens"].tolist()})
    same = all(torch.equal(local[k], from_cu[k]) for k in local)
    full = {k: sp.unshard(local[k], seq_len=n) for k in ("input_ids", "labels", "position_ids")}
    return local["cu_seqlens"].tolist(), local["cu_seqlens"].dtype, {k: v.tolist() for k, v in full.items()}, same


@pytest.mark.parametrize("cfg", [{"strategy": "zigzag", "size": 4}, {"strategy": "striped", "size": 2},
                                 {"strategy": "ulysses", "size": 2}])
def test_shard_batch_gives_cu_seqlens_positions_and_labels_within_documents(pool, cfg):
    lengths = [5, 1, 12, 3]                     # 21 tokens: end padding at every size
    bounds = [0, 5, 6, 18, 21]
    ids = list(range(100, 121))
    for cu, dtype, full, same in pool.run(_packed_batch, cfg, lengths):
        assert cu == bounds and dtype == torch.int32, cu
        assert same, "cu_seqlens given directly shards differently from position_ids restarting at 0"
        assert full["input_ids"] == [ids], full["input_ids"]
        assert full["position_ids"] == [[0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2]]
        # target of t = token t+1, except the last token of each document (and of the sequence)
        want = [ids[t + 1] if t + 1 not in bounds else -100 for t in range(21)]
        assert full["labels"] == [want], full["labels"]


def _batch_error(batch):
    sp = SequenceParallel({"strategy": "ring", "size": 2})
    try:
        sp.shard_batch(batch)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("batch,needles", [
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)},
     ["batch size 1", "got batch 2"]),
    ({"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 3, 4, 5]])},
     ["position_ids: position 5 is 3", "expected 2"]),
    ({"input_ids": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": [0, 3, 9]},
     ["cu_seqlens=[0, 3, 9] must end at the sequence length of input_ids 8"]),
    ({"input_ids": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": [0, 3, 8],
      "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])}, ["position_ids disagree with cu_seqlens"]),
])
def test_bad_packed_batches_are_clear_errors(pool, batch, needles):
    msgs = pool.run(_batch_error, batch)
    assert len(set(msgs)) == 1 and all(n in msgs[0] for n in needles), msgs


def test_shard_batch_without_sp_marks_documents_too():
    out = shard_batch({"input_ids": torch.arange(6)[None], "position_ids": torch.tensor([0, 1, 0, 1, 2, 0])})
    assert out["cu_seqlens"].tolist() == [0, 2, 5, 6] and out["labels"].tolist() == [[1, -100, 3, 4, -100, -100]]


def _check_skipped_for_shard_batch_tensor():
    sp = SequenceParallel({"strategy": "ring", "size": 2})
    ids = torch.arange(32)[None]
    local = sp.shard_batch({"input_ids": ids, "position_ids": torch.cat([torch.arange(20), torch.arange(12)])[None]})
    q = torch.randn(1, 16, 4, 8)
    checks = []
    for cu in (local["cu_seqlens"], local["cu_seqlens"].tolist()):
        sp.stats.reset()
        sp.attention(q, q, q, cu_seqlens=cu)
        checks.append(sp.stats.calls.get("cu_seqlens_check", 0))
    return checks


def test_cu_seqlens_from_shard_batch_needs_no_second_check(pool):
    """shard_batch checked its cu_seqlens across ranks: attention with that tensor skips the
    all-reduce; the same boundaries as a list are checked again."""
    for checks in pool.run(_check_skipped_for_shard_batch_tensor):
        assert checks == [0, 1], checks
