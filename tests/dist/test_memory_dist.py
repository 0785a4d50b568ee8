"""Memory features across ranks: sp.loss_from_hidden keeps sp.loss's contract (global mean on every
rank, each rank's backward its share), and checkpointing repeats exactly the forward collectives
of every strategy in the backward (counted with sp.stats) while the gradients stay the same."""
import pytest
import torch
import torch.nn.functional as F

from ds_seqpar import SequenceParallel
from ds_seqpar.models import CausalLM, ModelConfig

from ..e2e.test_train_e2e import SHIPPED, shipped_config
from ..reference import assert_derived_close

B, N, H, V = 2, 48, 16, 23


def _head_case(size, chunk, grad_scale):
    sp = SequenceParallel({"strategy": "zigzag", "size": size})
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, N), generator=g)
    labels[torch.rand(B, N, generator=g) < 0.3] = -100

    def full(dtype):
        h, w = (t.to(dtype, copy=True).requires_grad_() for t in (hidden, weight))
        loss = F.cross_entropy(F.linear(h, w).view(-1, V), labels.view(-1))
        loss.backward()
        return loss.detach(), h.grad, w.grad

    ref64, plain = full(torch.float64), full(torch.float32)
    h_local = sp.shard(hidden.float()).detach().requires_grad_()
    w = weight.float().requires_grad_()
    loss = sp.loss_from_hidden(h_local, w, sp.shard(labels), chunk_tokens=chunk, grad_scale=grad_scale)
    loss.backward()
    case = f"size={size} chunk={chunk} grad_scale={grad_scale} sp_rank={sp.rank}"
    assert_derived_close(f"{case} value", loss.detach(), ref64[0], plain[0])
    assert_derived_close(f"{case} local d_hidden (this rank's share)", h_local.grad / grad_scale,
                         sp.shard(ref64[1]), sp.shard(plain[1]))
    # the contract: the sum over the sequence group of each rank's weight gradient is the full one
    from ds_seqpar import comm
    w_sum = comm.all_reduce_sum(w.grad / grad_scale, sp.group)
    assert_derived_close(f"{case} summed d_weight", w_sum, ref64[2], plain[2])
    return sp.dp_rank, loss.item()


@pytest.mark.parametrize("size,chunk,grad_scale", [(2, 5, 1.0), (4, 0, 2.0)])
def test_loss_from_hidden_keeps_the_loss_contract(pool, size, chunk, grad_scale):
    results = pool.run(_head_case, size, chunk, grad_scale)
    by_group = {}
    for dp_rank, value in results:
        by_group.setdefault(dp_rank, set()).add(value)
    assert all(len(v) == 1 for v in by_group.values()), f"ranks of one sequence group disagree: {by_group}"


def _counted_step(sp, model, batch, checkpointing):
    """Per-kind (calls, bytes) of the forward and of the backward, and the parameter gradients."""
    from ds_seqpar.memory import enable_checkpointing
    model.zero_grad()
    if checkpointing:
        enable_checkpointing(model)         # the project's LM and transformers models alike
    else:
        model.activation_checkpointing_disable()
    sp.stats.reset()
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    logits = getattr(out, "logits", out)
    fwd = {k: (sp.stats.calls[k], sp.stats.bytes[k]) for k in sp.stats.calls}
    sp.stats.reset()
    logits.square().mean().backward()           # no loss collective: only the layers communicate
    bwd = {k: (sp.stats.calls[k], sp.stats.bytes[k]) for k in sp.stats.calls}
    return fwd, bwd, [p.grad.clone() for p in model.parameters()]


def _model(kind, section, sp):
    torch.manual_seed(0)
    if kind == "llama":                     # a transformers model on ds_seqpar attention
        from ds_seqpar.hf import apply_sequence_parallel
        from ..hf_models import tiny_model
        return apply_sequence_parallel(tiny_model("llama", vocab_size=V), sp)
    attention = "linear" if section["strategy"] == "lasp" else "softmax"
    return CausalLM(ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, attention=attention),
                    sp).train()


CASES = [("lm", name) for name in SHIPPED] + [("llama", "zigzag"), ("llama", "ulysses")]


def _checkpoint_stats_case():
    checked = []
    for kind, name in CASES:
        section = shipped_config(name)["sequence_parallel"]
        sp = SequenceParallel(section)
        model = _model(kind, section, sp)
        ids = torch.randint(0, V, (1, 32), generator=torch.Generator().manual_seed(5))
        batch = sp.shard_batch({"input_ids": ids})
        fwd0, bwd0, grads0 = _counted_step(sp, model, batch, checkpointing=False)
        fwd1, bwd1, grads1 = _counted_step(sp, model, batch, checkpointing=True)
        case = f"{kind} {name} sp_rank={sp.rank}"
        assert fwd0 and fwd1 == fwd0, f"{case}: checkpointing changed the forward's collectives {fwd0} -> {fwd1}"
        want = {k: (bwd0.get(k, (0, 0))[0] + fwd0.get(k, (0, 0))[0], bwd0.get(k, (0, 0))[1] + fwd0.get(k, (0, 0))[1])
                for k in set(bwd0) | set(fwd0)}
        assert bwd1 == want, (f"{case}: the backward should run its own collectives plus the forward's once more "
                              f"(recompute); got {bwd1}, want {want}")
        for i, (a, b) in enumerate(zip(grads1, grads0)):
            # the recompute sees the same inputs and runs the same kernels: the same gradients
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=lambda m: f"{case} parameter {i}: {m}")
        checked.append((kind, name))
    return checked


def test_checkpointing_repeats_the_forward_collectives_once(pool):
    """Every strategy on the project's LM, and a transformers Llama on ds_seqpar attention."""
    results = pool.run(_checkpoint_stats_case)
    assert all(r == CASES for r in results), results
