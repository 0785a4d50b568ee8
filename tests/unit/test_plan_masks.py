"""The plan's masks (cost/: pairs.py, bytes.py): sliding windows and packed documents in the attention work and
the bytes, per layer kind, held to the strategies' closed forms and to the work the window benchmark
counted (reports/window_cpu.rows.json); and the project's own LM with strategy lasp. Pure Python, no ranks."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from ds_seqpar.plan import hardware
from ds_seqpar.cost import bytes as cost_bytes, flops, pairs
from ds_seqpar.cost.bytes import comm_per_layer
from ds_seqpar.cost.candidate import Candidate, Features
from ds_seqpar.masks import Mask
from ds_seqpar.plan.main import equal_documents
from ds_seqpar.cost.model_shape import ModelShape, from_hf_config
from ds_seqpar.plan.search import Cluster, predict
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind
from ..reference import pairs_per_query_set

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WINDOW_REPORT = os.path.join(ROOT, "reports", "window_cpu.rows.json")
OWN_LINEAR = os.path.join(ROOT, "configs", "plan", "own_lm_linear_1b.json")


def _brute_pairs(seq, causal, window, docs):
    return pairs_per_query_set(seq, causal, window, Mask(causal, window, docs).bounds(seq), [range(seq)])[0]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window,docs", [(None, None), (5, None), (40, None), (None, (10, 23, 7)), (4, (10, 23, 7)),
                                         (12, (6,) * 6 + (4,))])
def test_pairs_total_is_the_mask_counted_pair_by_pair(causal, window, docs):
    seq = 40
    assert pairs.pairs_total(seq, Mask(causal, window, docs)) == _brute_pairs(seq, causal, window, docs)


@pytest.mark.parametrize("strategy", ["ring", "zigzag", "striped", "ulysses"])
def test_work_per_rank_is_the_window_benchmarks(strategy):
    """reports/window_cpu counted the visible pairs per rank of P=2 x 8192 tokens (plain, windows
    1024 and 2048) and their work ratios; the plan's busiest-rank work must be the same numbers."""
    from ds_seqpar.plan.calibrate import Run
    report = Run(WINDOW_REPORT)
    meta, rows = report.meta, report.table("Sliding window")
    plain = pairs.pairs_per_rank(strategy, meta["P"], 1, meta["seq"], Mask(True))
    want = rows[strategy, str(meta["windows"][0])].detail["work per rank (plain)"]
    assert plain == want, f"{strategy} plain: {plain} != {want}"
    for w in meta["windows"]:
        got = pairs.pairs_per_rank(strategy, meta["P"], 1, meta["seq"], Mask(True, w))
        row = rows[strategy, str(w)]
        assert got == row.detail["work per rank"], f"{strategy} window {w}: {got} != {row.detail['work per rank']}"
        assert max(got) / max(plain) == pytest.approx(row.predicted, rel=1e-12)


@pytest.mark.parametrize("strategy,p,u", [("ring", 4, 1), ("zigzag", 4, 1), ("striped", 4, 1), ("zigzag", 4, 2),
                                          ("ring", 8, 2), ("ulysses", 4, 4)])
@pytest.mark.parametrize("causal,window,docs", [(True, 20, None), (True, None, (100, 60, 96)), (False, 24, None),
                                                (True, 9, (50, 50, 50, 106))])
def test_masked_bytes_are_closed_form_rank_by_rank(strategy, p, u, causal, window, docs):
    sh = Shapes(1, 256, 8, 2, 16, 2)
    cu = None if docs is None else Mask(docs=docs).bounds(256)
    got = cost_bytes.rank_bytes(strategy, p, u, sh, Mask(causal, window, docs))
    want = [closed_form_by_kind(strategy, p, sh, r, u, causal=causal, window=window, cu_seqlens=cu) for r in range(p)]
    assert got == want


def test_ring_family_busiest_work_and_bytes_fall_with_the_window():
    seq, p = 1 << 14, 8
    plain = pairs.busiest_keys_per_token("ring", p, 1, seq, Mask(True))
    assert plain == pytest.approx((2 * p - 1) / p * seq / 2, rel=1e-3)   # the contiguous ring's last rank
    windowed = pairs.busiest_keys_per_token("zigzag", p, 1, seq, Mask(True, 1024))
    assert windowed == pytest.approx(1024, rel=0.04)                       # ~ w keys a query
    sh = Shapes(1, seq, 8, 8, 64, 2)
    full, peers_full = cost_bytes.busiest_bytes("ring", p, 1, sh, Mask(True))
    small, peers = cost_bytes.busiest_bytes("ring", p, 1, sh, Mask(True, 1024))
    assert peers_full == p - 1 and peers == 2                             # only the neighbours on each side
    assert sum(small.values()) < sum(full.values()) / 8


def _gemma_like(types):
    return SimpleNamespace(hidden_size=512, num_hidden_layers=len(types), num_attention_heads=8,
                           num_key_value_heads=2, head_dim=64, intermediate_size=1024, vocab_size=1000,
                           sliding_window=256, layer_types=types, model_type="gemma3_text")


def test_each_layer_gets_its_own_window():
    types = ["sliding_attention"] * 5 + ["full_attention"]
    shape = from_hf_config(_gemma_like(types))
    assert shape.layer_windows == (256,) * 5 + (None,)
    assert shape.softmax_windows() == {256: 5, None: 1}
    seq = 8192
    per_layer = 2 * (64 + 64) * 8
    # full layers: S / 2 keys (the measured-memory benchmark's count, which test_plan holds flops to)
    want = per_layer * (5 * pairs.pairs_total(seq, Mask(True, 256)) / seq + seq / 2)
    assert flops.forward_per_token(shape, seq)["attention"] == pytest.approx(want, rel=1e-12)
    # the plan's compute and bytes see the windows: zigzag at P=4 far below the all-full model's
    full = from_hf_config(_gemma_like(["full_attention"] * 6))
    gpu, c = hardware.load_gpu("h100"), Candidate("zigzag", 4, 1, 2, Features(on=True))
    a, b = (predict(c, s, seq, Cluster(4, 8, gpu)) for s in (shape, full))
    assert a.compute_s < b.compute_s and a.comm_bytes["sliding"] < b.comm_bytes["attention"]
    n, sh = seq // 4, Shapes(1, seq, 8, 2, 64, 2)
    want_bytes = max(sum(closed_form_by_kind("zigzag", 4, sh, r, window=256).values()) for r in range(4))
    assert sum(comm_per_layer(c, shape, n, 2)["sliding"].values()) == want_bytes


def test_packed_documents_cut_the_attention_work():
    """8 equal documents: the attention FLOPs are (about) 1/8 of one document's (sum of L^2 / 2)."""
    shape = ModelShape("m", 512, 4, 8, 8, 64, 1024, 1000)
    seq = 1 << 15
    one = flops.forward_per_token(shape, seq)["attention"]
    eight = flops.forward_per_token(shape, seq, docs=equal_documents(seq, seq // 8))["attention"]
    assert eight / one == pytest.approx(1 / 8, rel=1e-3)
    gpu = hardware.load_gpu("h100")
    c = Candidate("zigzag", 4, 1, 2, Features())
    plain, packed = (predict(c, shape, seq, Cluster(4, 8, gpu), docs=d)
                     for d in (None, equal_documents(seq, seq // 8)))
    assert packed.compute_s < plain.compute_s and packed.comm_bytes["attention"] < plain.comm_bytes["attention"]


# -- the project's own LM, strategy lasp ---------------------------------------------------------------

def test_own_linear_lm_is_planned_and_its_json_runs(tmp_path, capsys):
    from ds_seqpar.config import SequenceParallelConfig
    from ds_seqpar.plan.main import main as plan_main
    from ds_seqpar.train.args import build_parser
    from ds_seqpar.train.main import build_ds_config, model_config
    out = tmp_path / "ds.json"
    rc = plan_main(["--model", OWN_LINEAR, "--seq-len", str(1 << 22), "--gpus", "16", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "lasp" in text and "--n_layers 24" in text
    ds = json.loads(out.read_text())
    assert ds["sequence_parallel"]["strategy"] == "lasp" and ds["sequence_parallel"]["size"] > 1
    opts = build_parser().parse_args(["--deepspeed_config", str(out), "--dim", "2048", "--n_layers", "24",
                                      "--n_heads", "16", "--untied"])
    cfg = SequenceParallelConfig.from_ds_config(build_ds_config(opts))
    cfg.check_world(16)
    assert model_config(opts, cfg).attention == "linear"


def test_own_lm_lasp_bytes_are_the_closed_form():
    shape = ModelShape("own", 256, 4, 8, 8, 32, 688, 256, tied=True, kinds=("lasp",) * 4, lin_heads=8, lin_dk=32,
                       lin_dv=32, transition="fixed")
    for comm in ("allgather", "ring", "allscan"):
        c = Candidate("lasp", 4, 1, 2, Features(), "lasp", comm)
        got = comm_per_layer(c, shape, 1024, 2)["lasp"]
        assert got == closed_form_by_kind("lasp", 4, Shapes(1, 4096, 8, 8, 32, 2), 0, lasp_comm=comm)


def test_allscan_is_priced_as_p_minus_2_plus_k_block_hops():
    from ds_seqpar.cost.times import lasp_chain_time
    from ds_seqpar.strategies.lasp_comm.allscan import scan_blocks
    link, mb = hardware.Link(10e-6, 25e9), 1 << 20
    assert lasp_chain_time(link, 4 * mb, 2, "allscan", 128) == lasp_chain_time(link, 4 * mb, 2, "ring", 128)
    for p in (4, 8, 16):
        k = scan_blocks(p, 128, 4 * mb)
        assert k > 1 and lasp_chain_time(link, 4 * mb, p, "allscan", 128) == pytest.approx((p - 2 + k) * link.time(4 * mb / k))
        assert lasp_chain_time(link, 4 * mb, p, "allscan", 128) < lasp_chain_time(link, 4 * mb, p, "ring", 128)
    # the bytes do not grow with P (the all-gather's do): what the planner's table shows per size
    state = Shapes(1, 4096, 8, 8, 32, 2)
    per_rank = [sum(closed_form_by_kind("lasp", p, state, 1, lasp_comm="allscan").values()) for p in (4, 8, 16)]
    assert len(set(per_rank)) == 1


def test_the_plan_says_which_lasp_comm_and_why(capsys):
    from ds_seqpar.plan.main import main as plan_main
    assert plan_main(["--model", OWN_LINEAR, "--seq-len", str(1 << 22), "--gpus", "16", "--top", "3"]) == 0
    why = [line for line in capsys.readouterr().out.splitlines() if line.startswith("why: size")]
    assert len(why) >= 2, why
    for line in why:                      # every exchange priced, the first named is the pick
        assert all(c in line for c in ("allgather", "ring", "allscan")) and " ms, " in line and "MB/layer" in line, line
        picked = line.split("lasp_comm ")[1].split(" ")[0]
        assert line.split("rank: ")[1].startswith(picked), line


def test_bad_own_lm_config_names_the_keys(tmp_path, capsys):
    from ds_seqpar.plan.main import main as plan_main
    bad = tmp_path / "lm.json"
    bad.write_text(json.dumps({"model_type": "ds_seqpar_lm", "dim": 100, "n_heads": 3, "attention": "linear"}))
    assert plan_main(["--model", str(bad), "--seq-len", "4096", "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert "ds_seqpar_lm" in err and "n_heads" in err


def test_doc_len_reaches_the_plan(tmp_path, capsys):
    """--doc-len packs documents: the JSON's attention bytes of a ring candidate fall, and a bad length
    is refused with the flag named."""
    from ds_seqpar.plan.main import main as plan_main
    llama = os.path.join(ROOT, "configs", "models", "llama_small.json")
    got = {}
    for extra in ([], ["--doc-len", "1024"]):
        out = tmp_path / f"all{len(extra)}.json"
        assert plan_main(["--model", llama, "--seq-len", "16384", "--gpus", "4", "--zero", "2", "--json", str(out)]
                         + extra) == 0
        rows = json.loads(out.read_text())["feasible"]
        got[bool(extra)] = next(r for r in rows if r["strategy"] == "zigzag" and r["size"] == 4)
    assert got[True]["comm_bytes_per_layer"]["attention"] < got[False]["comm_bytes_per_layer"]["attention"] / 4
    assert got[True]["compute_s"] < got[False]["compute_s"]
    capsys.readouterr()
    assert plan_main(["--model", llama, "--seq-len", "4096", "--gpus", "2", "--doc-len", "0"]) == 2
    assert "--doc-len" in capsys.readouterr().err


def test_span_budget_falls_back_to_the_upper_bound_and_says_so():
    sh, mask = Shapes(1, 1024, 8, 8, 16, 2), Mask(True, 64)
    exact = cost_bytes.rank_bytes("zigzag", 4, 1, sh, mask)
    bound = cost_bytes.rank_bytes("zigzag", 4, 1, sh, mask, span_budget=1024)   # 4 positions x 1024 tokens is past it
    assert bound == [closed_form_by_kind("zigzag", 4, sh, r) for r in range(4)]
    assert all(sum(b.values()) >= sum(e.values()) for b, e in zip(bound, exact))
    assert not cost_bytes.exact_spans("zigzag", 4, 1, sh, mask, span_budget=1024)
    assert cost_bytes.exact_spans("zigzag", 4, 1, sh, mask) and cost_bytes.exact_spans("zigzag", 4, 1, sh, Mask(True),
                                                                                       span_budget=1024)


def test_a_prediction_says_when_its_bytes_are_the_upper_bound():
    shape, gpu = ModelShape("m", 256, 2, 8, 8, 32, 512, 1000), hardware.load_gpu("h100")
    c, docs = Candidate("zigzag", 4, 1, 2, Features()), equal_documents(4096, 512)
    exact, bound = (predict(c, shape, 4096, Cluster(4, 8, gpu), docs=docs, span_budget=b) for b in (1 << 23, 1024))
    assert not exact.bytes_bounded and bound.bytes_bounded
    assert bound.comm_bytes["attention"] > exact.comm_bytes["attention"]
    plain = predict(c, shape, 4096, Cluster(4, 8, gpu), span_budget=1024)
    assert not plain.bytes_bounded                                  # no mask: the closed form is exact
