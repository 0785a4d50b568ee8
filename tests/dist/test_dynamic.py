"""The dynamic data-sequence hybrid on 4 ranks through a real DeepSpeed engine: one step over a
global batch of documents that uses groups of 1, 2 and 4 ranks gives the loss (token-level mean
of the batch) and every parameter gradient of a single process over the same documents, for
zigzag, ulysses and lasp without ZeRO and under ZeRO-3, ring and striped without ZeRO; the groups
built are the family (schedule.family_groups), nothing more. SGD with
lr = 1 and no clipping, so the parameters' change is exactly minus the gradient."""
import pytest
import torch
import torch.nn.functional as F

T, VOCAB = 16, 64
# at 4 ranks and T = 16: 50 tokens need 4 ranks, 17-30 need 2, the rest fit on one
LENGTHS = [50, 30, 17, 10, 13, 2, 2, 14]      # packed on groups of 1, 2 and 4, an empty micro-batch
REL = 1e-5


def _documents():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _model(sp, strategy):
    from ds_seqpar.models import CausalLM, ModelConfig
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, mlp_hidden=48,
                                attention="linear" if strategy == "lasp" else "softmax"), sp)


def _reference(strategy):
    """One process: sum of every document's token losses over the batch's target tokens."""
    model = _model(None, strategy)
    total = sum(n - 1 for n in LENGTHS)
    loss = 0.0
    for ids in _documents():
        logits = model(ids[None], torch.arange(ids.numel())[None])
        loss = loss + F.cross_entropy(logits[0, :-1], ids[1:], reduction="sum")
    loss = loss / total
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _dynamic_step(strategy, stages):
    import deepspeed
    from ds_seqpar.dynamic import DynamicSequenceParallel, train_step
    from ds_seqpar import comm
    from ds_seqpar.schedule import family_groups
    deepspeed.init_distributed(dist_backend="gloo")
    asked, new_group = [], comm.new_group
    comm.new_group = lambda ranks, timeout_s: asked.append(tuple(ranks)) or new_group(ranks, timeout_s)
    try:
        dsp = DynamicSequenceParallel({"strategy": strategy, "size": "dynamic", "max_tokens_per_rank": T}, heads=4)
    finally:
        comm.new_group = new_group
    out = {"groups": (sorted(set(asked)), sorted(family_groups(4, dsp.sizes)))}
    for stage in stages:
        model = _model(dsp, strategy)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                          config=config, mpu=dsp.mpu)
        step = train_step(dsp, engine, _documents())
        params = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
            grads = {n: before[n] - p.detach() for n, p in params.items()}
        engine.destroy()
        plan = step["schedule"]
        out[stage] = {"loss": step["loss"], "grads": grads, "sizes": plan.group_sizes, "rounds": step["rounds"],
                      "empty": sum(mb.empty for mb in plan.for_rank(dsp.global_rank))}
    return out


@pytest.mark.parametrize("strategy, stages", [("zigzag", (0, 3)), ("ulysses", (0, 3)), ("lasp", (0, 3)),
                                              ("ring", (0,)), ("striped", (0,))])
def test_dynamic_step_equals_plain_data_parallelism_on_the_same_documents(pool, strategy, stages):
    ref_loss, ref_grads = _reference(strategy)
    results = pool.run(_dynamic_step, strategy, stages)
    assert any(r[stages[-1]]["empty"] for r in results), "some rank should run an empty micro-batch"
    for rank, per_stage in enumerate(results):
        built, family = per_stage.pop("groups")
        assert built == family, f"{strategy} rank {rank}: built groups {built}, the family is {family}"
        for stage, r in per_stage.items():
            what = f"{strategy} ZeRO-{stage} rank {rank}"
            assert r["sizes"] == [1, 2, 4], f"{what}: the batch should use groups of 1, 2 and 4, used {r['sizes']}"
            assert r["rounds"] == results[0][stage]["rounds"], f"{what}: ranks ran different numbers of passes"
            assert abs(r["loss"] - ref_loss) <= REL * ref_loss, f"{what}: loss {r['loss']} != plain {ref_loss}"
            for name, want in ref_grads.items():
                torch.testing.assert_close(r["grads"][name], want, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{what}: gradient of {name}: {m}")
