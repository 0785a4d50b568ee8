"""The benchmark and the report: the closed-form oracle's edge cases, a tiny bench run end to end
(JSON fields, exact byte ratios, markdown rows, plots), bad options, and the training report over
real (tiny) training runs. Each strategy family's bytes against the oracle on real ranks are in
tests/dist (test_ulysses.py, test_ring.py, test_lasp.py)."""
import json

import pytest

from ds_seqpar.strategies.closed_form import Shapes, closed_form_bytes


def test_closed_form_bytes_edge_cases():
    sh = Shapes(batch=2, seq=1024, heads=8, kv_heads=8, head_dim=64, elem=2)
    assert closed_form_bytes("zigzag", 1, sh) == 0
    # ring family: S_kv (P-1) (4e + 2*4); bf16 halves only the k/v part, not the fp32 accumulators
    assert closed_form_bytes("ring", 2, sh) == 2 * 512 * 8 * 64 * 1 * (4 * 2 + 8)
    with pytest.raises(ValueError, match="no closed form for strategy 'nope'"):
        closed_form_bytes("nope", 2, sh)


# ---------------------------------------------------------------------------------------------
# a tiny bench run, end to end, on a 2-rank pool (the bench's world is its P)


@pytest.fixture(scope="module")
def bench_pools():
    from ds_seqpar.launch.rankpool import RankPool
    pools = (RankPool(2, timeout_s=300.0).start(), RankPool(1, timeout_s=300.0).start())
    yield pools
    for p in pools:
        p.close()


TINY = ["--P", "2", "--seq-lens", "128,256", "--heads", "4", "--head-dim", "16", "--repeats", "2", "--warmup", "1",
        "--strategies", "zigzag,lasp", "--mem-budget-n", "128", "--train-strategies", "zigzag",
        "--train-seq-len", "128", "--name", "tiny"]


def test_tiny_bench_writes_json_markdown_and_plots(bench_pools, tmp_path, capsys):
    from ds_seqpar.bench.main import build_parser, resolve, run
    argv = TINY + ["--out", str(tmp_path)]
    res = run(resolve(build_parser().parse_args(argv)), argv, pools=bench_pools)
    with open(tmp_path / "tiny.json") as f:
        saved = json.load(f)
    assert saved["meta"]["cases"] == ["single", "zigzag", "single_linear", "lasp2", "lasp1"], saved["meta"]
    for key in ("meta", "machine", "attention", "max_seq", "train", "checks", "elapsed_s", "load_by_length", "raw"):
        assert key in saved, f"results JSON lacks {key!r}"
    for n in ("128", "256"):
        for case, row in saved["attention"][n].items():
            assert row["time_s"]["min"] > 0 and row["speedup"]["median"] > 0, (n, case, row)
            assert all(c > 0 for c in row["cpu_s"]) and row["mem_ratio"] > 0, (n, case, row)
            if case in ("zigzag", "lasp2", "lasp1"):
                assert row["bytes_ratio"] == [1.0, 1.0], f"N={n} {case}: bytes vs closed form {row['bytes_ratio']}"
                assert len(row["cpu_s"]) == 2 and row["imbalance"] >= 1.0, row
    assert saved["max_seq"]["zigzag"]["ratio"] == 2.0, saved["max_seq"]      # exactly 1/P of the saved bytes
    train = saved["train"]["zigzag"]
    assert train["speedup"]["median"] > 0 and train["loss_rel_diff"] < 1e-4, train
    assert {c["result"] for c in saved["checks"]} <= {"PASS", "SHORT", "FAIL"}
    assert not [c for c in saved["checks"] if c["result"] == "FAIL"], saved["checks"]
    md = (tmp_path / "tiny.md").read_text()
    for row in ("| zigzag bytes per rank / closed form | 1.000 |", "| lasp2 |", "| lasp1 |", "| single |",
                "## Whole training step", "Machine: ", "load average before", "Command: `ds-seqpar bench "):
        assert row in md, f"{row!r} missing from the markdown:\n{md}"
    for png in ("speedup", "bytes", "memory", "imbalance"):
        path = tmp_path / "tiny" / f"{png}.png"
        assert path.exists() and path.stat().st_size > 10_000, f"{path} missing or empty"
        assert f"(tiny/{png}.png)" in md
    assert res["meta"] == saved["meta"]
    assert "PASS" in capsys.readouterr().out
    # a saved results file re-renders without measuring anything
    from ds_seqpar.bench.main import main
    (tmp_path / "tiny.md").unlink()
    assert main(["--render", str(tmp_path / "tiny.json")]) == 0
    assert (tmp_path / "tiny.md").read_text() == md


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "bf16"], "--dtype bf16 needs CUDA"),
    (["--backend", "flash_attn"], "--backend flash_attn needs CUDA"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--strategies", "zigzag,nope"], "unknown case 'nope'"),
    (["--seq-lens", "102"], "multiple of 4"),
    (["--heads", "3", "--kv-heads", "1"], "not divisible by --P 2"),
], ids=["bf16", "flash_attn", "cuda", "strategy", "seq", "heads"])
def test_bench_rejects_bad_options_before_starting_ranks(argv, message):
    import torch

    from ds_seqpar.bench.main import BenchError, build_parser, resolve
    if torch.cuda.is_available() and argv[0] in ("--dtype", "--backend", "--device"):
        pytest.skip("these options are valid on a CUDA machine")
    # resolve() is where every check runs; it starts nothing, so a check that fails to fire cannot
    # turn into a benchmark run here
    with pytest.raises(BenchError) as err:
        resolve(build_parser().parse_args(argv))
    assert message in str(err.value), str(err.value)


def test_bench_command_exits_2_with_the_message(capsys):
    from ds_seqpar.bench.main import main
    assert main(["--strategies", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-seqpar bench: error: --strategies: unknown case 'nope'"), err


def test_cli_lists_bench_and_report(capsys):
    from ds_seqpar.cli import main
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "bench" in out and "report" in out, out


# ---------------------------------------------------------------------------------------------
# the report over real training runs


def _train(args):
    from ds_seqpar.train import run_training
    return run_training(args)


def test_report_compares_real_training_runs(pool, tmp_path, capsys):
    from ds_seqpar.report.main import main
    runs = tmp_path / "runs"
    base = {"dim": 32, "n_layers": 1, "n_heads": 4, "seq_len": 64, "steps": 3, "quiet": True, "no_wandb": True,
            "corpus_bytes": 1 << 16, "run_dir": str(runs), "sp_size": 2}
    for strategy in ("zigzag", "ulysses"):
        pool.run(_train, dict(base, strategy=strategy, run_name=f"{strategy}-tiny"))
    out = tmp_path / "reports" / "cmp.md"
    out.parent.mkdir()
    assert main([str(runs / "zigzag-tiny"), str(runs / "ulysses-tiny"), "--out", str(out)]) == 0
    md = out.read_text()
    assert "| zigzag sp2xdp2 n64 | zigzag | 2 x 2 | 2 | 64 | 3 |" in md, md
    assert "| ulysses sp2xdp2 n64 | ulysses | 2 x 2 | 2 | 64 | 3 |" in md, md
    assert "Not like for like" not in md, md
    for png in ("loss", "tokens_per_s", "resources"):
        path = out.parent / "cmp" / f"{png}.png"
        assert path.exists() and path.stat().st_size > 10_000, f"{path} missing or empty"
        assert f"(cmp/{png}.png)" in md
    assert main([str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "is not a training run directory" in capsys.readouterr().err


@pytest.mark.parametrize("preset,cases,breakdown", [
    ("ring", ["single", "ulysses", "ring", "zigzag", "striped", "zigzag_no_overlap"], False),
    ("lasp", ["single_linear", "lasp2", "lasp1", "halves"], True),
])
def test_ring_and_lasp_are_presets_of_bench(preset, cases, breakdown):
    # the former python -m ds_seqpar.bench_ring / bench_lasp: one family at N=8192, no training
    from ds_seqpar.bench.main import build_parser, resolve
    args = resolve(build_parser().parse_args(["--preset", preset]))
    assert args.cases == cases, args.cases
    assert (args.seq_lens, args.P, args.train, args.mem_budget_n, args.lasp_breakdown) == ([8192], 2, [], 0, breakdown)
    assert args.name == f"cpu_{preset}"


def _ours_vs_deepspeed():
    from ds_seqpar.bench.cases import BenchSpec, RankCases
    cases = RankCases(BenchSpec(world=2, cases=("ulysses", "ds_ulysses"), heads=4, kv_heads=2, head_dim=16))
    ours, theirs = (cases.attend(n)(*cases.inputs(n, 128)[:3]) for n in ("ulysses", "ds_ulysses"))
    return (ours - theirs).abs().max().item()


def test_deepspeed_ulysses_peer_computes_the_same_attention(bench_pools):
    # the ours/theirs time ratio means something only if both compute the same thing on the same shards
    assert bench_pools[0].run(_ours_vs_deepspeed) == [0.0, 0.0]
