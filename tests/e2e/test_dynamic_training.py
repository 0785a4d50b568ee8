"""The main job with --lengths on the 4-rank pool: static zigzag of 2 ranks, dynamic zigzag and
dynamic zigzag under the 2D hybrid (--ulysses_size 2) train on the same documents (cut at the same 256 tokens) and print the same losses and gradient
norms (the token-level mean of each step's documents); metrics.jsonl
says what each step did. And the bad inputs that stop such a run, on every rank."""
import json
import os

from .test_train_e2e import _train, config_error_of

LENGTHS = os.path.join(os.path.dirname(__file__), "..", "data", "lengths", "wikipedia_5k.txt")
BASE = {"dim": 32, "n_layers": 2, "n_heads": 4, "seq_len": 256, "steps": 2, "corpus_bytes": 1 << 18,
        "quiet": True, "no_wandb": True, "lengths": LENGTHS, "tokens_per_step": 1024, "strategy": "zigzag",
        "ignore_frac": 0.0}
MODES = {"static zigzag x2": {"sp_size": 2},
         "dynamic zigzag": {"sp_size": "dynamic", "max_tokens_per_rank": 64},
         # the 2D hybrid: groups of 4 run 2 x 2 (the all-to-all inside neighbouring pairs), groups of 2 Ulysses
         "dynamic zigzag 2d": {"sp_size": "dynamic", "max_tokens_per_rank": 64, "ulysses_size": 2}}
REL = 1e-5


def test_static_and_dynamic_print_the_same_losses_on_the_same_documents(pool, tmp_path):
    runs = {}
    for mode, extra in MODES.items():
        runs[mode] = pool.run(_train, dict(BASE, run_dir=str(tmp_path / mode.replace(" ", "_")), **extra))
    want = runs["static zigzag x2"][0]
    for mode, results in runs.items():
        for r in results:
            for what in ("losses", "grad_norms"):
                for got, ref in zip(r[what], want[what]):
                    assert abs(got - ref) <= REL * abs(ref), f"{mode} rank {r['rank']}: {what} {r[what]} != {want[what]}"
    with open(runs["dynamic zigzag 2d"][0]["metrics_path"]) as f:
        hybrid = [json.loads(line) for line in f]
    assert all(4 in r["group_sizes"] for r in hybrid), "the 2D run should use a group of 4 every step"
    with open(runs["dynamic zigzag"][0]["metrics_path"]) as f:
        records = [json.loads(line) for line in f]
    # the same documents on the same groups, another exchange: Ulysses' all-to-all inside the groups
    assert all(h["attn_comm_bytes"] != r["attn_comm_bytes"] for h, r in zip(hybrid, records)), (hybrid, records)
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        assert rec["tokens"] == 1024 and rec["documents"] >= 1 and len(rec["compute_s"]) == 4, rec
        assert set(rec["group_sizes"]) <= {1, 2, 4} and rec["compute_imbalance"] >= 1.0, rec
        assert rec["loss"] > 0 and "cut_documents" in rec and "attn_comm_bytes" in rec, rec


def test_a_hugging_face_model_trains_dynamic_with_the_losses_of_plain_data_parallelism(pool, tmp_path):
    """--model (a tiny Llama, GQA) with --lengths: plain data parallelism (size 1: every document whole
    on one rank) and dynamic zigzag groups train on the same documents, with the same losses."""
    from ..hf_models import save_tiny
    hf = dict({k: v for k, v in BASE.items() if k not in ("dim", "n_layers", "n_heads")},
              model=save_tiny(tmp_path / "llama", "llama", vocab_size=256))
    runs = {mode: pool.run(_train, dict(hf, run_dir=str(tmp_path / mode), **extra))
            for mode, extra in {"plain": {"sp_size": 1}, "dynamic": MODES["dynamic zigzag"]}.items()}
    want = runs["plain"][0]
    for r in runs["dynamic"]:
        for what in ("losses", "grad_norms"):
            for got, ref in zip(r[what], want[what]):
                assert abs(got - ref) <= REL * abs(ref), f"--model dynamic rank {r['rank']}: {what} {r[what]} != {want[what]}"
    with open(runs["dynamic"][0]["metrics_path"]) as f:
        assert any(len(json.loads(line)["group_sizes"]) > 1 for line in f), "dynamic should use several group sizes"


def test_bad_inputs_stop_the_run_on_every_rank_with_the_same_message(pool, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n0\n")
    cases = {"dynamic without --lengths": (dict(BASE, lengths=None, sp_size="dynamic", max_tokens_per_rank=64),
                                           "pass --lengths FILE"),
             "empty lengths": (dict(BASE, lengths=str(empty)), "is empty"),
             "a zero length": (dict(BASE, lengths=str(bad)), "non-empty line 2 is 0"),
             "ulysses, 3 heads": (dict(BASE, strategy="ulysses", n_heads=3, dim=48, sp_size="dynamic",
                                       max_tokens_per_rank=64), "no group size of [1, 2, 4] but 1 divides the 3 heads")}
    for what, (args, words) in cases.items():
        messages = pool.run(config_error_of, dict(args, run_dir=str(tmp_path)))
        assert len(set(messages)) == 1 and words in messages[0], (what, messages)
