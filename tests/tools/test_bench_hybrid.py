"""``ds-seqpar bench hybrid`` at a tiny length on the session pool (P=2: ranks 0 and 1 form the first
sequence group): every family's layer runs sharded and unsharded, the bytes each rank sends equal the
closed forms (ratio 1), the map call and the plain op are timed on the same captured inputs, and the
page is written; the Llama of the training comparison has the hybrid's sizes."""
import json
import os

from ds_seqpar.bench.hybrid import FAMILIES, SP_CASES, bench_rank, build_parser, equal_llama, family_cases, resolve, rows, write

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)


def test_hybrid_bench_runs_bytes_match_closed_forms_and_page_is_written(pool, tmp_path):
    args = resolve(build_parser().parse_args(["--P", "2", "--seq", "256", "--repeats", "1", "--warmup", "0",
                                              "--op-rounds", "1", "--train-repeats", "0", "--out", str(tmp_path)]))
    per_rank = pool.run(bench_rank, args)[:2]
    ops = per_rank[0]["ops"]
    meta = dict(vars(args), cpus=2, elapsed=1.0, load_before="0", load_after="0", load_during=0.0, command="x y")
    found = rows(per_rank, args, meta, ops, None)
    layer = [r for r in found if r.metric.startswith("One layer")]
    assert list(dict.fromkeys(r.case for r in layer)) == list(FAMILIES)
    for fam in FAMILIES:
        assert [r.variant for r in layer if r.case == fam] == family_cases(fam), fam
    paired = [(r.case, r.variant) for r in found if r.metric.startswith("All-Scan against") and r.value > 0]
    assert paired == [(f, f"lasp_allscan / {o}") for f in FAMILIES if f != "conv" for o in ("lasp_allgather", "lasp_ring")]
    sent = {(r.case, r.variant): r for r in found if r.metric.startswith("Bytes per rank")}
    assert list(sent) == [(f, c) for f in FAMILIES for c in family_cases(f) if c in SP_CASES], list(sent)
    for key, r in sent.items():
        assert r.ratios() == [1.0, 1.0] and min(r.predicted) > 0, (key, r.value, r.predicted)
    # the state maps do not grow with N: the ring sends one state per hop, less than the gathered maps
    assert sent["gdn", "lasp_ring"].value[0] < sent["gdn", "lasp_allgather"].value[0]
    assert [o["family"] for o in ops] == ["gdn", "kda", "ssd"] and all(o["plain"] > 0 and o["map"] > 0 for o in ops)
    assert write(found, meta, str(tmp_path)) == 0
    page = (tmp_path / "hybrid_cpu.md").read_text()
    assert "Command: `x y`" in page and "| gdn | lasp_ring |" in page and "| conv | lasp_allgather |" in page, page
    assert "1.000 / 1.000" in page and "`torch_chunk_gated_delta_rule`" in page, page
    assert json.loads((tmp_path / "hybrid_cpu.rows.json").read_text())["facts"]["meta"]["seq"] == 256


def test_the_llama_of_the_training_comparison_has_the_hybrids_sizes():
    path = os.path.join(ROOT, "configs", "models", "qwen3_5_small.json")
    with open(path) as f:
        hybrid = json.load(f)
    llama = equal_llama(path)
    assert llama["model_type"] == "llama" and "layer_types" not in llama
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "tie_word_embeddings"):
        assert llama[key] == hybrid[key], key


def test_the_training_comparison_reads_its_llama_config_and_leaves_no_file_behind(monkeypatch):
    # the pools and the training steps are stood in for (minutes of training): what is checked is the
    # temporary config's lifetime around them
    import contextlib

    from ds_seqpar.bench import hybrid, train_step
    seen = {}

    def measure_training(pool, solo, strategies, job, *repeats):
        with open(job["model"]) as f:
            seen[job["model"]] = json.load(f)["model_type"]
        return {"zigzag": job["model"]}

    monkeypatch.setattr(hybrid, "fresh_pool", lambda P: contextlib.nullcontext())
    monkeypatch.setattr(train_step, "measure_training", measure_training)
    path = os.path.join(ROOT, "configs", "models", "qwen3_5_small.json")
    args = resolve(build_parser().parse_args(["--train-model", path, "--train-repeats", "1"]))
    got = hybrid.measure_train(args)
    assert set(got) == {"qwen3_5_small.json", "llama (equal sizes)"} and sorted(seen.values()) == ["llama", "qwen3_5_text"]
    assert not os.path.exists(got["llama (equal sizes)"]), "the equal Llama's config was left behind"
