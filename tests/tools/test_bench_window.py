"""``ds-seqpar bench window`` at a tiny size on the session pool (P=2: ranks 0 and 1 form the first
sequence group): every strategy and variant runs, bytes equal the window-aware closed forms (ratio
1), the work the page divides by is what the masked policy computes, and the page is written."""
import json

from ds_seqpar.bench.window import window_work
from ds_seqpar.bench.window import BYTES, WINDOW, bench_rank, build_parser, resolve, rows, write


def policy_work(name: str, p: int, seq: int, window) -> list:
    """(q, k) pairs per rank the masked plan computes (strategies/mask_plan.py), ring family."""
    from ds_seqpar.masks import Mask
    from ds_seqpar.sharding.layouts import make_layout
    from ds_seqpar.strategies import get_strategy
    from ds_seqpar.strategies.mask_plan import masked_plan
    plan = masked_plan(Mask(True, window), make_layout(get_strategy(name).layout_name, p), seq)
    return [sum(plan.pairs(me, src) for src in range(p)) for me in range(p)]


def test_window_bench_runs_bytes_match_closed_forms_and_page_is_written(pool, tmp_path):
    args = resolve(build_parser().parse_args(["--P", "2", "--seq", "256", "--windows", "16,100", "--softcap", "5",
                                              "--heads", "2", "--head-dim", "16", "--repeats", "1",
                                              "--warmup", "0", "--kernel-rounds", "1", "--out", str(tmp_path)]))
    per_rank = pool.run(bench_rank, args)[:2]
    pieces = per_rank[0]["pieces"]                            # kernel calls alone: every strategy, plain + windows
    found = rows(per_rank, args, pieces)
    sent = {(r.case, r.variant): r for r in found if r.metric == BYTES}
    work_ratio = {(r.case, r.variant): r.predicted for r in found if r.metric == WINDOW}
    assert list(dict.fromkeys(name for name, _ in sent)) == ["ring", "zigzag", "striped", "ulysses"]
    for name in ("ring", "zigzag", "striped", "ulysses"):
        assert [v for n, v in sent if n == name] == ["plain", "sinks", "window=16", "window=100", "softcap=5"], name
        assert 0 < work_ratio[name, "16"] < work_ratio[name, "100"] < 1, name
    for key, r in sent.items():
        assert r.ratios() == [1.0, 1.0], (key, r.value, r.predicted)
    # a 16-token window on the contiguous ring: the last 15 keys of rank 0 go to rank 1, nothing else
    assert sent["ring", "window=16"].value[0] < sent["ring", "plain"].value[0] / 8
    for name in ("ring", "zigzag", "striped"):                 # the work is what the policy computes
        for w in (None, 16, 100):
            assert window_work(name, 2, 256, w) == policy_work(name, 2, 256, w), (name, w)
    assert window_work("ring", 2, 256, None) == [128 * 129 // 2, 128 * 129 // 2 + 128 * 128]
    meta = dict(vars(args), cpus=2, elapsed=1.0, load_before="0", load_after="0", load_during=0.0, command="x y")
    assert [(x["strategy"], x["window"]) for x in pieces] == [(s, w) for s in args.strategies for w in (None, 16, 100)]
    for x in pieces:              # the busiest position's pairs (Ulysses: every pair, for its half of the heads)
        work = window_work(x["strategy"], 2, 256, x["window"])
        assert x["pairs"] == (sum(work) if x["strategy"] == "ulysses" else max(work)), x
    assert write(found, meta, str(tmp_path)) == 0
    page = (tmp_path / "window_cpu.md").read_text()
    assert "Command: `x y`" in page and "| ring | 16 |" in page and "| zigzag | window=100 |" in page, page
    assert "| ulysses | sinks |" in page and "1.000 / 1.000" in page and "sinks overhead" in page, page
    assert "## Kernel calls alone" in page and "| ring | 16, rank 1 |" in page, page
    assert json.loads((tmp_path / "window_cpu.rows.json").read_text())["facts"]["meta"]["windows"] == [16, 100]
