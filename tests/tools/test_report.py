"""``ds-seqpar report`` over real (tiny) training runs made on the session pool: the summary rows,
the plots, and a clear error for a directory that is not a run."""


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
