"""``ds-seqpar bench packed`` at a tiny size on the session pool (P=2: ranks 0 and 1 form the first
sequence group): every case and variant runs, bytes equal the document closed forms, the page shows
the ratio beside the ideal."""
import argparse

from ds_seqpar.bench.packed import bench_rank, build_parser, facts, resolve, rows
from ds_seqpar.bench.packed import imbalance_sweep
from ds_seqpar.report.render import render


def test_packed_bench_runs_and_bytes_match_closed_forms(pool):
    args = resolve(build_parser().parse_args(["--P", "2", "--seq", "256", "--docs", "8", "--mixed", "100,31,101,24",
                                              "--heads", "2", "--head-dim", "16", "--repeats", "1", "--warmup", "0"]))
    per_rank = pool.run(bench_rank, args)[:2]
    sweep = imbalance_sweep(1024, ps=(2, 4), trials=4)
    meta = dict(vars(args), cpus=2, elapsed=1.0, load_before="0", load_after="0", load_during=0.0, command="x",
                sweep=sweep, sweep_trials=4)
    found = rows(per_rank, args, meta)
    ratio = [r.case for r in found if r.metric.startswith("Time of 8 equal")]
    assert ratio == ["single", "single_linear", "ulysses", "ring", "zigzag", "striped", "lasp2", "lasp1", "allscan"], ratio
    sent = {(r.case, r.variant): r for r in found if r.metric.startswith("Bytes per rank")}
    assert list(sent) == [(name, v) for name in ratio[2:] for v in ("one", "equal", "mixed")], list(sent)
    for key, r in sent.items():
        assert r.value == r.predicted, (key, r.value, r.predicted)
    assert sent["ring", "equal"].value == [0, 0], "8 documents of 32 inside 128-token shards: nothing travels"
    balance = {r.case: r.detail["work imbalance"] for r in found if r.metric.startswith("Mixed document lengths")}
    assert balance["ulysses"] == 1.0 and balance["ring"] > 1.0
    assert all(mean <= worst for per in sweep.values() for mean, worst in per.values()), sweep
    assert sweep["striped"][4][1] < 1.05 <= sweep["contiguous"][4][1], sweep     # token granularity balances
    page = render(found, facts(meta))
    assert "| ring |" in page and "ideal 0.125" in page and "masked / sub-blocks" in page, page
    assert "Best balanced ring layout for packed data (smallest worst case): **striped**" in page, page
    assert isinstance(args, argparse.Namespace)
