"""sp.token_logprobs / sp.token_logprobs_from_hidden and the sequence reductions on the 4-rank pool: a small
causal LM under every strategy (P = 2 and 4, the 2D hybrid, LASP; rows and packed documents, dynamic groups)
gives the unsharded model's per-token log-probs and entropies in global order (sp.unshard), and a DPO-shaped
loss built from sp.sequence_sum / sp.sequence_mean / sp.token_mean gives the unsharded loss and, summed over
the group, its parameter gradients. Tolerances derived against float64 (tests/reference.py)."""
import pytest
import torch
import torch.nn.functional as F

from ds_seqpar import SequenceParallel
from ds_seqpar.models.lm import CausalLM, ModelConfig
from ds_seqpar.sharding.batch import shift_labels

from ..reference import assert_derived_close

V, N, B = 64, 40, 2
TEMPERATURE = 0.8


def model_of(sp, attention="softmax"):
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=48,
                                attention=attention), sp)


def global_batch(packed):
    g = torch.Generator().manual_seed(3)
    rows = 1 if packed else B
    ids = torch.randint(0, V, (rows, N), generator=g)
    labels = ids.clone()
    labels[:, :7] = -100                            # a prompt: no targets
    labels[torch.rand(rows, N, generator=g) < 0.15] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:                                      # documents of 13, 19 and 8 tokens
        batch["position_ids"] = torch.cat([torch.arange(n) for n in (13, 19, 8)])[None]
    return batch


def dpo_shaped_loss(sums, means, token):
    """A loss that is nonlinear in per-row sums (as DPO's), plus a row mean and a token mean."""
    return -F.logsigmoid(sums[0] - sums[-1] + 0.1) + 0.3 * means.square().sum() + 0.2 * token


def plain_logprobs(logits, target, temperature):
    """The independent reference: log_softmax, gather, -sum p log p; 0 where the target is ignored."""
    logp_all = F.log_softmax(logits / temperature, dim=-1)
    valid = target != -100
    logp = torch.where(valid, logp_all.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1), 0.0)
    return logp, torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)


def reference(batch, dtype, attention):
    """(logp, entropy, loss, grads) of the unsharded model (the same seeded weights) in ``dtype``."""
    model = model_of(None, attention).to(dtype)
    target = shift_labels(batch["labels"])
    cu = None
    if "position_ids" in batch:                 # no target across a document boundary
        pos = batch["position_ids"][0]
        starts = [i for i in range(N) if pos[i] == 0]
        target[:, [s - 1 for s in starts if s > 0]] = -100
        cu = torch.tensor(starts + [N])
    logits = model(batch["input_ids"], batch.get("position_ids", torch.arange(N).expand(len(target), -1)),
                   cu_seqlens=cu)
    logp, ent = plain_logprobs(logits, target, TEMPERATURE)
    mask = target != -100
    sums = logp.sum(-1)
    means = (ent * mask).sum(-1) / mask.sum(-1)
    token = (logp * mask).sum() / mask.sum()
    loss = dpo_shaped_loss(sums, means, token)
    loss.backward()
    return logp.detach(), ent.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _case(section, packed, fused, attention="softmax"):
    sp = SequenceParallel(section)
    model = model_of(sp, attention)
    batch = global_batch(packed)
    local = sp.shard_batch(batch)
    hidden = {}
    model.norm.register_forward_hook(lambda m, a, out: hidden.setdefault("h", out))
    logits = model(local["input_ids"], local["position_ids"], cu_seqlens=local.get("cu_seqlens"))
    if fused:
        logp, ent = sp.token_logprobs_from_hidden(hidden["h"], model.lm_head, local["labels"],
                                                  temperature=TEMPERATURE, entropy=True, chunk_tokens=5)
    else:
        logp, ent = sp.token_logprobs(logits, local["labels"], temperature=TEMPERATURE, entropy=True, chunk_tokens=7)
    mask = local["labels"] != -100
    sums = sp.sequence_sum(logp, grad_scale=1.0)
    means = sp.sequence_mean(ent, mask, grad_scale=1.0)
    token = sp.token_mean(logp, mask, grad_scale=1.0)
    loss = dpo_shaped_loss(sums, means, token)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():                     # the group's gradient: the sum of its ranks' shares
        torch.distributed.all_reduce(g, group=sp.group)
    case = f"{section} packed={packed} fused={fused} rank={sp.rank}"
    want64, plain = reference(batch, torch.float64, attention), reference(batch, torch.float32, attention)
    got = (sp.unshard(logp.detach(), seq_len=N), sp.unshard(ent.detach(), seq_len=N), loss.detach())
    for name, g, r, p in zip(("logp", "entropy", "loss"), got, want64, plain):
        assert_derived_close(f"{case} {name}", g, r, p)
    for name in grads:
        assert_derived_close(f"{case} d {name}", grads[name], want64[3][name], plain[3][name])
    return sp.dp_rank, loss.item()


CASES = [({"strategy": s, "size": p}, False, False) for s in ("ulysses", "ring", "zigzag", "striped") for p in (2, 4)]
CASES += [({"strategy": "zigzag", "size": 4, "ulysses_size": 2}, False, True),
          ({"strategy": "zigzag", "size": 2}, True, True), ({"strategy": "striped", "size": 4}, True, False),
          ({"strategy": "ulysses", "size": 2}, True, False)]


@pytest.mark.parametrize("section,packed,fused", CASES, ids=lambda x: str(x))
def test_token_logprobs_of_a_model_equal_the_unsharded_model(pool, section, packed, fused):
    results = pool.run(_case, section, packed, fused)
    by_group = {}
    for dp_rank, value in results:
        by_group.setdefault(dp_rank, set()).add(value)
    assert all(len(v) == 1 for v in by_group.values()), f"ranks of a group disagree: {by_group}"


@pytest.mark.parametrize("size,packed", [(2, False), (4, True)])
def test_token_logprobs_of_a_linear_attention_model_under_lasp(pool, size, packed):
    pool.run(_case, {"strategy": "lasp", "size": size}, packed, size == 2, "linear")


def _dynamic_case():
    """size 'dynamic': a micro-batch on a group of 2 (two documents) and one on a group of 1, each group's
    log-probs and per-document sums equal the unsharded model's."""
    from ds_seqpar.dynamic import DynamicSequenceParallel
    dsp = DynamicSequenceParallel({"strategy": "zigzag", "size": "dynamic", "max_tokens_per_rank": 24})
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, V, (n,), generator=g) for n in (36, 10, 12, 9)]
    schedule = dsp.schedule([d.numel() for d in docs])
    model, plain = model_of(dsp), model_of(None)
    checked = 0
    for mb in schedule.for_rank(dsp.global_rank):
        with dsp.running(mb) as sp:
            batch = dsp.batch(mb, [docs[i] for i in mb.documents])
            logits = model(batch["input_ids"], batch["position_ids"], cu_seqlens=batch.get("cu_seqlens"))
            logp = dsp.token_logprobs(logits, batch["labels"])
            full = sp.unshard(logp.detach(), seq_len=sum(mb.lengths))[0]
            start = 0
            for i, n in zip(mb.documents, mb.lengths):
                ids = docs[i][None]
                ref = plain_logprobs(plain(ids, torch.arange(n)[None]), shift_labels(ids), 1.0)[0].detach()[0]
                torch.testing.assert_close(full[start:start + n], ref, rtol=1e-4, atol=1e-5)
                start += n
                checked += 1
            total = dsp.sequence_sum(logp.detach(), grad_scale=1.0)
            torch.testing.assert_close(total, full.sum()[None], rtol=1e-5, atol=1e-5)
    return checked


def test_token_logprobs_under_dynamic_groups(pool):
    assert sum(pool.run(_dynamic_case)) >= 4


def _compiled_case(size):
    """token_logprobs (entropy too) and the three reductions compiled with fullgraph=True equal eager:
    value, gradients, sp.stats."""
    sp = SequenceParallel({"strategy": "zigzag", "size": size})
    g = torch.Generator().manual_seed(2)
    logits = sp.shard(torch.randn(B, N, V, generator=g))
    labels = sp.shard(torch.randint(0, V, (B, N), generator=g))
    labels[:, ::3] = -100
    mask = labels != -100

    def fn(z):
        logp, ent = sp.token_logprobs(z, labels, entropy=True, temperature=0.9, chunk_tokens=6)
        return (sp.sequence_sum(logp, grad_scale=1.0).square().sum() + sp.sequence_mean(ent, mask, grad_scale=1.0).sum()
                + sp.token_mean(logp, mask, grad_scale=2.0))

    runs = []
    for backend in (None, "aot_eager"):
        torch._dynamo.reset()
        run = fn if backend is None else torch.compile(fn, backend=backend, fullgraph=True)
        z = logits.clone().requires_grad_()
        sp.stats.reset()
        value = run(z)
        value.backward()
        runs.append((value.detach(), z.grad, dict(sp.stats.calls)))
    (v0, g0, s0), (v1, g1, s1) = runs
    assert s0 == s1 and s0, (s0, s1)
    torch.testing.assert_close(v1, v0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)
    return sorted(s0)


def test_token_logprobs_and_reductions_compile_fullgraph_as_eager(pool):
    assert pool.run(_compiled_case, 2)[0] == ["seq_mean", "seq_sum", "token_mean"]
