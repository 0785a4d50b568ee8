"""``ds-seqpar bench trainer`` at a tiny size on the session pool: the side-by-side cases run (plain,
one ds_seqpar strategy, DeepSpeed's ALST through accelerate's ParallelismConfig), ds_seqpar's steps and
final parameters equal plain's while ALST's do not (the distinction the page reports), the overhead
part times both loops, and the page and its rows are written from the results (and re-rendered from
the rows)."""
import json
import os

from ds_seqpar.bench import trainer as bench
from ds_seqpar.bench.main import main as bench_main


def test_trainer_bench_side_by_side_overhead_and_page(pool, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "CASES", {k: bench.CASES[k] for k in ("plain", "zigzag", "deepspeed_alst")})
    with open(os.path.join(bench.ROOT, "configs", "models", "llama_small.json")) as f:
        tiny = dict(json.load(f), hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                    head_dim=16, vocab_size=512)
    (tmp_path / "tiny.json").write_text(json.dumps(tiny))
    args = bench.resolve(bench.build_parser().parse_args(
        ["--repeats", "1", "--warmup", "0", "--steps", "3", "--overhead-rounds", "1", "--overhead-steps", "3",
         "--overhead-seq", "128", "--model", str(tmp_path / "tiny.json"), "--out", str(tmp_path)]))
    res = bench.measure(args, "ds-seqpar bench --trainer x", pool=pool)
    cases = res["cases"]
    assert list(cases) == ["plain", "zigzag", "deepspeed_alst"], cases
    zigzag, alst = cases["zigzag"], cases["deepspeed_alst"]
    assert "error" not in zigzag and "error" not in alst, (zigzag.get("error"), alst.get("error"))
    assert len(zigzag["steps"]) == 3 and zigzag["lr_equal"], zigzag
    assert max(zigzag["loss_dev"] + zigzag["grad_norm_dev"]) <= 1e-5 and zigzag["param_dev"] <= 1e-5, zigzag
    assert max(alst["grad_norm_dev"]) > 1e-3 and alst["param_dev"] > 1e-5, alst       # not step-exact
    assert all(r["step_s"]["median"] > 0 for r in cases.values())
    assert [sorted(r) for r in res["gloo"]] == [["loss backward", "variable widths"]] * 4
    assert all(r["variable widths"] for r in res["gloo"]), res["gloo"]    # gloo needs equal widths
    over = res["overhead"]
    assert len(over["rounds"]) == 1 and over["rounds"][0]["own_s"] > 0 and over["rounds"][0]["trainer_s"] > 0
    assert res["meta"]["steps"] == 3
    res["meta"]["name"] = "t"
    assert bench.write(res, str(tmp_path)) == 0
    page = (tmp_path / "t.md").read_text()
    assert "Command: `ds-seqpar bench --trainer x`" in page and "| zigzag | dp2 x sp2, micro 2 |" in page, page
    alst = next(line for line in page.splitlines() if line.startswith("| deepspeed_alst | dp2 x sp2, micro 2 |"))
    assert "transformers' Trainer + ParallelismConfig" in alst and "Trainer / own" in page, page
    assert bench_main(["--trainer", "--render", str(tmp_path / "t.rows.json")]) == 0
    assert (tmp_path / "t.md").read_text() == page
