"""torch.compile over applied Hugging Face hybrids (docs/compile.md, "Hugging Face hybrids"): a gated DeltaNet
model (Qwen3.5: short convolution + delta rule) and a Mamba2 one (Bamba: short convolution + SSD scan) compile
with fullgraph=True under aot_eager (so no graph break; the plain models have none under
torch._dynamo.explain), and give the eager run's logits, loss and every parameter's
gradient. Tolerance: the compiled graph runs the same operations (the linear layers' op bodies are the eager
path, their backward reruns it), so only the order of a few sums may differ: the trainer tests' bound for
fp32 runs that differ only in the order of sums, REL x the tensor's largest entry."""
import torch

from ..hf_hybrids import batch, build, hybrid_config

REL = 1e-5
SEQ = 64
# each exchange once: lasp allgather (gated DeltaNet, P=2), linear_strategy ulysses (SSD, P=2), lasp_comm ring
# (SSD, P=4); at P=2 the world's two sequence groups run one family each (compiling is the cost: one per round)
ROUNDS = [[("qwen3_5_text", dict(size=2, strategy="ring")),
           ("bamba", dict(size=2, strategy="zigzag", linear_strategy="ulysses"))],
          [("bamba", dict(size=4, strategy="ulysses", lasp_comm="ring"))]]


def _step(model_type, setting, state, compiled):
    from ds_seqpar import SequenceParallel
    from ds_seqpar.hf import apply_sequence_parallel
    cfg = hybrid_config(model_type)
    sp = SequenceParallel(setting)
    model = apply_sequence_parallel(build(cfg, torch.float32, state), sp)
    ids, labels = batch(cfg.vocab_size, rows=1, seq=SEQ)
    run = model
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(model, backend="aot_eager", fullgraph=True)
    batch_ = sp.shard_batch({"input_ids": ids, "labels": labels})
    sp.stats.reset()
    out = run(**batch_)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads, dict(sp.stats.calls)


def _worst(got, want):
    """Largest |compiled - eager| / (REL x the eager tensor's largest entry); <= 1 passes."""
    bound = REL * want.abs().max().item()
    err = (got - want).abs().max().item()
    return err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))


def compiled_vs_eager(rounds):
    """[(model type, setting, worst ratio, what, linear-layer gradients that are nonzero, eager calls per
    kind, compiled calls per kind)] on this rank: of each round, its sequence group's case."""
    from ds_seqpar import comm
    out = []
    for cases in rounds:
        model_type, setting = cases[comm.global_rank() // setting_size(cases) % len(cases)]
        state = build(hybrid_config(model_type), torch.float32).state_dict()
        eager = _step(model_type, setting, state, False)
        got = _step(model_type, setting, state, True)
        assert set(got[2]) == set(eager[2]), set(got[2]) ^ set(eager[2])
        ratios = {"logits": _worst(got[0], eager[0]), "loss": _worst(got[1], eager[1])}
        ratios.update({f"grad {n}": _worst(g, eager[2][n]) for n, g in got[2].items()})
        worst = max(ratios, key=ratios.get)
        # the linear layers' own parameters (conv, decays, dt bias) get their gradient through the op's backward
        linear = [n for n, g in got[2].items() if ("linear_attn" in n or "mamba" in n) and g.abs().max() > 0]
        out.append((model_type, setting, ratios[worst], worst, len(linear), eager[3], got[3]))
    return out


def setting_size(cases):
    return cases[0][1]["size"]


def test_applied_hybrids_compile_fullgraph_and_train_as_eager(pool):
    results = pool.run(compiled_vs_eager, ROUNDS, timeout=600)
    for rank, rows in enumerate(results):
        for model_type, setting, ratio, what, linear, eager_calls, compiled_calls in rows:
            assert ratio <= 1.0, f"rank {rank} {model_type} {setting}: {what} is {ratio:.3g}x the bound"
            assert linear >= 3, f"rank {rank} {model_type} {setting}: {linear} linear-layer gradients are nonzero"
            # the op's backward reruns the forward exchange: its kinds count their forward calls again
            # (lasp_state is forward only; conv_halo and linear_all_to_all count forward and backward alike)
            want = dict(eager_calls, **{k: eager_calls[k] * 2 for k in ("lasp_state",) if k in eager_calls},
                        **{k: eager_calls[k] * 3 // 2 for k in ("conv_halo", "linear_all_to_all") if k in eager_calls})
            assert compiled_calls == want, (rank, model_type, setting, eager_calls, compiled_calls)
