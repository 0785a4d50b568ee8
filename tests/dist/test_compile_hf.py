"""torch.compile over the applied Hugging Face integration and the training jobs (docs/hf.md, "torch.compile").

* graph breaks: a tiny applied Llama has no more graph breaks under torch._dynamo.explain than the same
  model without sequence parallelism (the pre-hook's group checks, the loss's reduction and the
  attention are opaque ops; backend-free: explain only traces);
* exact training: the main job with --compile (the own LM, and a Hugging Face hybrid: gated DeltaNet next
  to attention) and SequenceParallelTrainer with torch_compile=True give the eager run's loss per step (aot_eager: the compiled graph, no C++ build on 2 cores). Tolerance: the
  trainer tests' bound for fp32 runs that differ only in the order of sums;
* recompiles: 40 steps of packed documents (reports/compile_cpu.md: 100) with new lengths and packings compile a bounded number
  of graphs (automatic dynamic shapes; cu_seqlens is read inside the attention op)."""
import os

import torch

from ds_seqpar import SequenceParallel

from ..dist_checks import first_group_results, first_group_runs
from ..hf_models import tiny_model
from .test_hf_trainer import ROOT, ds_config, run_trainer

REL = 1e-5


def _breaks(model, **batch):
    torch._dynamo.reset()
    return torch._dynamo.explain(model)(**batch).graph_break_count


def applied_llama_breaks(strategy):
    """(plain model's graph breaks or None off rank 0, applied model's) on this rank: one layer is enough."""
    from ds_seqpar import comm
    from ds_seqpar.hf import apply_sequence_parallel
    ids = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(0))
    sp = SequenceParallel({"strategy": strategy, "size": 2})
    if not first_group_runs(sp):
        return None
    plain = None
    if comm.global_rank() == 0:
        plain = _breaks(tiny_model("llama", num_hidden_layers=1), input_ids=ids, position_ids=torch.arange(32)[None],
                        labels=ids)
    model = apply_sequence_parallel(tiny_model("llama", num_hidden_layers=1), sp)
    return plain, _breaks(model, **sp.shard_batch({"input_ids": ids, "labels": ids}))


def test_applied_llama_has_no_more_graph_breaks_than_plain(pool):
    results = first_group_results(pool.run(applied_llama_breaks, "zigzag"), 2)
    plain = results[0][0]
    assert all(applied <= plain for _, applied in results), f"graph breaks: plain {plain}, applied {results}"


def _main_job(args):
    from ds_seqpar.train import run_training
    torch._dynamo.reset()
    return run_training(args)["losses"]


def test_main_job_compiled_trains_as_eager(pool, tmp_path):
    args = {"dim": 32, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64, "steps": 3, "ignore_frac": 0.25,
            "corpus_bytes": 1 << 18, "quiet": True, "no_wandb": True, "run_dir": str(tmp_path),
            "deepspeed_config": os.path.join(ROOT, "configs", "zigzag_zero2.json"), "sp_size": 2}
    eager = pool.run(_main_job, args)
    compiled = pool.run(_main_job, dict(args, compile="aot_eager"))
    for rank, (got, want) in enumerate(zip(compiled, eager)):
        assert len(got) == len(want) == 3, (got, want)
        assert all(abs(g - w) <= REL * abs(w) for g, w in zip(got, want)), f"rank {rank}: {got} != {want}"


def _tiny_hybrid_config(path):
    """The shipped Qwen3.5 config (a gated DeltaNet layer next to a full-attention one) shrunk for the test."""
    import json
    with open(os.path.join(ROOT, "configs", "models", "qwen3_5_small.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, vocab_size=256,
               layer_types=["linear_attention", "full_attention"])
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(path)


def test_main_job_compiles_a_hybrid_model_as_eager(pool, tmp_path):
    """A Hugging Face hybrid trained by the main job with --compile: the linear layer's seam calls are opaque
    ops (ds_seqpar::linear_layer) next to the attention op; the losses of three optimizer steps equal eager's."""
    # lr 1e-2: large enough steps that a gradient missing from the linear layer moves the next losses well
    # past the bound (Adam's steps do not scale with the gradient, so only a missing or wrong-signed one shows)
    args = {"model": _tiny_hybrid_config(tmp_path / "qwen3_5.json"), "seq_len": 64, "steps": 3, "quiet": True,
            "lr": 1e-2,
            "corpus_bytes": 1 << 18, "no_wandb": True, "run_dir": str(tmp_path),
            "deepspeed_config": os.path.join(ROOT, "configs", "zigzag_zero2.json"), "sp_size": 2}
    eager = pool.run(_main_job, args)
    compiled = pool.run(_main_job, dict(args, compile="aot_eager"))
    for rank, (got, want) in enumerate(zip(compiled, eager)):
        assert len(got) == len(want) == 3, (got, want)
        assert all(abs(g - w) <= REL * abs(w) for g, w in zip(got, want)), f"rank {rank}: {got} != {want}"


def test_trainer_torch_compile_trains_as_eager(pool):
    cfg = ds_config(2, strategy="zigzag", size=2)
    eager = pool.run(run_trainer, cfg, 2, 2, 0, gradient_accumulation_steps=1)[0]
    compiled = pool.run(run_trainer, cfg, 2, 2, 0, gradient_accumulation_steps=1, torch_compile=True,
                        torch_compile_backend="aot_eager")[0]
    for g, w in zip(compiled[0], eager[0]):
        assert abs(g["loss"] - w["loss"]) <= REL * abs(w["loss"]), (g, w)
    assert len(compiled[0]) == len(eager[0]) == 2


def packed_recompiles(steps):
    """Graphs compiled over ``steps`` training steps of packed documents: every step a new global length
    (32, 48 or 64 tokens) and a new packing (1 to 4 documents), as a data loader of packed rows gives."""
    from ds_seqpar.hf import apply_sequence_parallel
    sp = SequenceParallel({"strategy": "zigzag", "size": 2})
    if not first_group_runs(sp):
        return None
    model = apply_sequence_parallel(tiny_model("llama", num_hidden_layers=1), sp)
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, _: graphs.append(gm) or gm.forward)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        n = int(torch.randint(2, 5, (1,), generator=g)) * 16
        cuts = sorted(torch.randperm(n - 1, generator=g)[:int(torch.randint(0, 4, (1,), generator=g))] + 1)
        pos = torch.cat([torch.arange(b - a) for a, b in zip([0] + cuts, cuts + [n])])[None]
        ids = torch.randint(0, 96, (1, n), generator=g)
        compiled(**sp.shard_batch({"input_ids": ids, "labels": ids, "position_ids": pos})).loss.backward()
    return len(graphs)


def test_new_lengths_and_packings_do_not_recompile_every_step(pool):
    counts = first_group_results(pool.run(packed_recompiles, 40), 2)
    assert max(counts) <= 4, f"graphs compiled in 40 packed steps, per rank: {counts}"
