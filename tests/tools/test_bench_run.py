"""A tiny ``ds-seqpar bench`` run end to end on the session's 4-rank pool (the bench's world is its P,
so P=4 here): every row of every case and length, exact byte ratios against the closed form, the
longest-sequence search, the training-step comparison, the LASP halves bound and per-piece table,
the markdown rows, the plots, and re-rendering from the rows. Sizes are the smallest that still
exercise all of it; what costs time is starting ranks, so the run reuses the session pool and
starts only the 1-rank pool the training comparison needs."""
import pytest

P = 4


@pytest.fixture(scope="module")
def solo():
    from ds_seqpar.launch.rankpool import RankPool
    pool = RankPool(1, timeout_s=300.0).start()
    yield pool
    pool.close()


# two lengths (a sweep), one measured round, the budget search at the shortest length
TINY = ["--P", str(P), "--seq-lens", "64,128", "--heads", "4", "--head-dim", "16", "--repeats", "1", "--warmup", "0",
        "--strategies", "zigzag,lasp,halves", "--lasp-breakdown", "--mem-budget-n", "64",
        "--train-strategies", "zigzag", "--train-seq-len", "64", "--name", "tiny"]
# the training comparison's model: one layer, two steps (the first is the run's warm-up)
TINY_MODEL = dict(dim=32, n_layers=1, n_heads=4, seq_len=64, micro_batch=1, steps=2)


def test_tiny_bench_writes_json_markdown_and_plots(pool, solo, tmp_path, capsys, monkeypatch):
    from ds_seqpar.bench import train_step
    from ds_seqpar.report.render import result
    from ds_seqpar.report.rows import load_rows
    from ds_seqpar.bench.attention import build_parser, resolve, run
    from ds_seqpar.bench.attention_rows import BYTES, MAX_SEQ, MEMORY, SPEEDUP, TRAIN
    monkeypatch.setitem(train_step.TRAIN_PRESETS, "quick", TINY_MODEL)
    argv = TINY + ["--out", str(tmp_path)]
    res = run(resolve(build_parser().parse_args(argv)), argv, pools=(pool, solo))
    assert res["meta"]["cases"] == ["single", "zigzag", "single_linear", "lasp2", "lasp1", "allscan", "halves"], \
        res["meta"]
    rows, facts = load_rows(str(tmp_path / "tiny.rows.json"))
    table = lambda metric: {(r.case, r.variant): r for r in rows if r.metric.startswith(metric)}  # noqa: E731
    speed, sent, mem = table(SPEEDUP), table(BYTES), table(MEMORY)
    for n in ("N=64", "N=128"):
        for case in res["meta"]["cases"]:
            r = speed[case, n]
            assert r.detail["wall s"] > 0 and r.value > 0, (n, case, r)
            assert all(c > 0 for c in r.detail["CPU s per rank"]) and mem[case, n].value > 0, (n, case, r)
            if case in ("zigzag", "lasp2", "lasp1", "allscan"):
                assert sent[case, n].ratios() == [1.0] * P, f"{n} {case}: bytes vs closed form {sent[case, n]}"
                imbalance = float(r.detail["imbalance (expected)"].split()[0])
                assert len(r.detail["CPU s per rank"]) == P and imbalance >= 1.0, r
        assert ("halves", n) not in sent, "halves exchanges nothing"
    longest = table(MAX_SEQ)
    assert longest["zigzag", "budget: one process at N=64"].value == P, longest   # exactly 1/P of the saved bytes
    assert not [k for k in longest if k[0] == "halves"], longest
    train = table(TRAIN)["zigzag", "seq 64"]
    assert train.value > 0 and float(train.detail["losses, max rel diff"]) < 1e-4, train
    pieces = table(f"LASP kernel work per rank position (N/P = {128 // P}")
    assert len(pieces) == 4 and {v for _, v in pieces} == {f"N/P={128 // P}"}, pieces
    assert min(r.value for r in pieces.values()) > 0, pieces
    checks = {(r.case, r.metric): result(r) for r in rows if r.target}
    assert set(checks.values()) <= {"PASS", "SHORT", "FAIL"} and "FAIL" not in checks.values(), checks
    assert not [c for c in checks if c[0] == "halves"], "halves is a bound, not checked"
    assert checks["zigzag", "Attention fwd+bwd speedup over one process"] in ("PASS", "SHORT"), checks
    md = (tmp_path / "tiny.md").read_text()
    for row in ("| Bytes per rank against the closed form | every case |", "| lasp2 |", "| lasp1 |", "| single |",
                "| allscan |", "| halves |", "LASP-2 / halves time", "All-Scan / LASP-2 time", "| last rank (state_in in, dstate_in out) |",
                "## Whole training step", "Machine: ", "load average before", "Command: `ds-seqpar bench "):
        assert row in md, f"{row!r} missing from the markdown:\n{md}"
    for png in ("speedup", "bytes", "memory", "imbalance"):
        path = tmp_path / "tiny" / f"{png}.png"
        assert path.exists() and path.stat().st_size > 10_000, f"{path} missing or empty"
        assert f"(tiny/{png}.png)" in md
    assert facts["meta"]["seq_lens"] == [64, 128] and facts["meta"]["train_model"] == res["train_model"]
    assert "PASS" in capsys.readouterr().out
    # saved rows re-render (page and plots) without measuring anything
    from ds_seqpar.bench.main import main
    (tmp_path / "tiny.md").unlink()
    (tmp_path / "tiny" / "speedup.png").unlink()
    assert main(["--render", str(tmp_path / "tiny.rows.json")]) == 0
    assert (tmp_path / "tiny.md").read_text() == md and (tmp_path / "tiny" / "speedup.png").exists()


def _ours_vs_deepspeed():
    from ds_seqpar.bench.cases import BenchSpec, RankCases
    cases = RankCases(BenchSpec(world=P, cases=("ulysses", "ds_ulysses"), heads=8, kv_heads=4, head_dim=16))
    ours, theirs = (cases.attend(n)(*cases.inputs(n, 128)[:3]) for n in ("ulysses", "ds_ulysses"))
    return (ours - theirs).abs().max().item()


def test_deepspeed_ulysses_peer_computes_the_same_attention(pool):
    # the ours/theirs time ratio means something only if both compute the same thing on the same shards
    assert pool.run(_ours_vs_deepspeed) == [0.0] * P
