"""examples/long_generate.py on the 4-rank pool: a tiny Llama trained sequence-parallel (zigzag P=2, 2 replicas,
ZeRO-2, the Trainer's JSON with its "auto" values) finds every needle through model.generate over the
sequence-sharded KV cache (each needle on a rank other than the query's), and its greedy tokens equal the
unsharded model's (one process, float32 and float64 agreeing). The trained weights then generate under two
more layouts at P=4 (ring, ulysses with fewer K/V heads than ranks): the same answers."""
from .test_hf_trainer import _example, ds_config


def train_and_generate():
    from ds_seqpar import SequenceParallel
    from ds_seqpar.hf import apply_sequence_parallel
    example = _example("long_generate")
    engine, sp, losses = example.train(ds_config(2, strategy="zigzag", size=2))
    results = [({"strategy": sp.config.strategy, "size": sp.size}, example.check(engine.module, sp))]
    state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    for cfg in ({"strategy": "ring", "size": 4}, {"strategy": "ulysses", "size": 4}):
        other = SequenceParallel(cfg)
        model = example.tiny_model()
        model.load_state_dict(state)
        results.append((cfg, example.check(apply_sequence_parallel(model, other), other)))
    return losses, results


def test_needles_come_back_through_the_sharded_cache(pool):
    for rank, (losses, results) in enumerate(pool.run(train_and_generate, timeout=400)):
        assert losses[-1] < 0.05 * losses[0], f"rank {rank}: training did not converge: {losses[0]} -> {losses[-1]}"
        for cfg, got in results:
            what = f"rank {rank} {cfg}"
            assert got["reference_agrees"], f"{what}: the unsharded float32 and float64 runs differ (test model)"
            assert got["same"], f"{what}: greedy tokens differ from the unsharded model's"
            assert got["accuracy"] == 1.0, f"{what}: needle accuracy {got['accuracy']}"
            assert got["query_rank"] not in got["needle_ranks"] and got["needle_ranks"], (what, got)
            assert max(got["shares"]) < got["prompt_tokens"], (what, got)      # no rank holds the whole prompt
