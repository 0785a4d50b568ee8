"""``ds-seqpar bench packed`` at a tiny size on the session pool (P=2: ranks 0 and 1 form the first
sequence group): every case and variant runs, bytes equal the document closed forms, the page shows
the ratio beside the ideal."""
import argparse

from ds_seqpar.bench.packed import bench_rank, build_parser, facts, resolve, rows as page_rows, summarize
from ds_seqpar.bench.predict import imbalance_sweep
from ds_seqpar.report.render import render


def test_packed_bench_runs_and_bytes_match_closed_forms(pool):
    args = resolve(build_parser().parse_args(["--P", "2", "--seq", "256", "--docs", "8", "--mixed", "100,31,101,24",
                                              "--heads", "2", "--head-dim", "16", "--repeats", "1", "--warmup", "0"]))
    per_rank = pool.run(bench_rank, args)[:2]
    rows = summarize(per_rank, args)
    assert set(rows) == {"single", "single_linear", "ulysses", "ring", "zigzag", "striped", "lasp2", "lasp1"}
    for name, r in rows.items():
        if name.startswith("single"):
            continue
        for variant in ("one", "equal", "mixed"):
            assert r[variant]["bytes"] == r["forms"][variant], (name, variant, r[variant]["bytes"], r["forms"][variant])
    assert rows["ring"]["equal"]["bytes"] == [0, 0], "8 documents of 32 inside 128-token shards: nothing travels"
    assert rows["ulysses"]["work_imbalance"] == 1.0 and rows["ring"]["work_imbalance"] > 1.0
    sweep = imbalance_sweep(1024, ps=(2, 4), trials=4)
    assert all(mean <= worst for per in sweep.values() for mean, worst in per.values()), sweep
    assert sweep["striped"][4][1] < 1.05 <= sweep["contiguous"][4][1], sweep     # token granularity balances
    meta = dict(vars(args), cpus=2, elapsed=1.0, load_before="0", load_after="0", load_during=0.0, command="x",
                sweep=sweep, sweep_trials=4)
    page = render(page_rows(rows, per_rank[0]["masked"], meta), facts(meta))
    assert "| ring |" in page and "ideal 0.125" in page and "masked / sub-blocks" in page, page
    assert "Best balanced ring layout for packed data (smallest worst case): **striped**" in page, page
    assert isinstance(args, argparse.Namespace)
