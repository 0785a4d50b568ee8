"""The dynamic data-sequence hybrid on 4 ranks through a real DeepSpeed engine: one step over a
global batch of documents that uses groups of 1, 2 and 4 ranks gives the loss (token-level mean
of the batch) and every parameter gradient of a single process over the same documents, for
zigzag, ulysses and lasp without ZeRO and under ZeRO-3, ring and striped without ZeRO, zigzag under
ZeRO-1 and ZeRO-2 with gradient clipping, and the 2D hybrid (zigzag, ulysses_size 2: groups of 4
run 2 x 2, groups of 2 an all-to-all of 2) without ZeRO and in bf16 under ZeRO-2, and zigzag in bf16
under ZeRO-3; the groups built
are the family (schedule.family_groups), nothing more. SGD with lr = 1, so the parameters' change
is exactly minus the (clipped) gradient.

Clipping: the clipped update is the plain gradient times clip / (its norm + 1e-6) (DeepSpeed's
rule), and the engine's global norm must be the plain gradient's: clipping sees the token-level
global gradient, not a rank's or a group's.

bf16 (DeepSpeed's bf16 mode: the model in bf16, fp32 master weights): the loss and the master
weights' change are compared with a float64 run of the same (bf16-rounded) weights, within the
derived bound of tests/reference.py: K x the error of plain bf16 training on one process (model
in bf16, the loss in fp32, gradients accumulated in bf16 over the documents)."""
import copy
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from ..reference import assert_derived_close

T, VOCAB = 16, 64
# at 4 ranks and T = 16: 50 tokens need 4 ranks, 17-30 need 2, the rest fit on one
LENGTHS = [50, 30, 17, 10, 13, 2, 2, 14]      # packed on groups of 1, 2 and 4, an empty micro-batch
REL = 1e-5
CLIP = 0.5          # clipping at half the plain gradient's norm: the clipped update is half of it


class Run(NamedTuple):
    """One engine: ZeRO stage, gradient clipping on (at CLIP x the plain norm), bf16 mode."""
    stage: int
    clip: bool = False
    bf16: bool = False

    def __str__(self):
        return f"ZeRO-{self.stage}" + (" clipped" if self.clip else "") + (" bf16" if self.bf16 else "")


def _documents():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _model(sp, strategy):
    from ds_seqpar.models import CausalLM, ModelConfig
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, mlp_hidden=48,
                                attention="linear" if strategy == "lasp" else "softmax"), sp)


def _reference(strategy, dtype=torch.float32, weights=torch.float32):
    """One process: sum of every document's token losses over the batch's target tokens, the model
    in ``dtype`` with its weights rounded to ``weights`` first; the loss in fp32 or fp64."""
    model = _model(None, strategy).to(weights).to(dtype)
    total = sum(n - 1 for n in LENGTHS)
    loss = 0.0
    for ids in _documents():
        logits = model(ids[None], torch.arange(ids.numel())[None])
        logits = logits if dtype == torch.float64 else logits.float()
        loss = loss + F.cross_entropy(logits[0, :-1], ids[1:], reduction="sum")
    loss = loss / total
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _weights(model, run):
    """Every parameter whole, in fp32: the master weights in bf16 mode, else the model's own."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    params = dict(model.named_parameters())
    if run.bf16:
        return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in params.items()}
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=run.stage == 3):
        return {n: p.detach().clone() for n, p in params.items()}


def _dynamic_step(section, runs, clip_at):
    import deepspeed
    from ds_seqpar.dynamic import DynamicSequenceParallel, train_step
    from ds_seqpar import comm
    from ds_seqpar.schedule import family_groups
    deepspeed.init_distributed(dist_backend="gloo")
    asked, new_group = [], comm.new_group
    comm.new_group = lambda ranks, timeout_s: asked.append(tuple(ranks)) or new_group(ranks, timeout_s)
    try:
        dsp = DynamicSequenceParallel(dict(section, size="dynamic", max_tokens_per_rank=T), heads=4)
    finally:
        comm.new_group = new_group
    out = {"groups": (sorted(set(asked)), sorted(family_groups(4, dsp.sizes, dsp.config.ulysses_size))),
           "ulysses": {s: sp.dims.ulysses_size for s, sp in dsp.by_size.items()}}
    for run in runs:
        model = _model(dsp, section["strategy"])
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "gradient_clipping": clip_at if run.clip else 0.0, "bf16": {"enabled": run.bf16},
                  "zero_optimization": {"stage": run.stage, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                          config=config, mpu=dsp.mpu)
        before = _weights(model, run) if run.bf16 else before
        dsp.reset_stats()
        step = train_step(dsp, engine, _documents())
        after = _weights(model, run)
        norm = engine.get_global_grad_norm()
        engine.destroy()
        schedule = step["schedule"]
        out[run] = {"loss": step["loss"], "grads": {n: before[n] - after[n] for n in after},
                    "norm": float(norm) if norm is not None else None, "sizes": schedule.group_sizes,
                    "rounds": step["rounds"], "empty": sum(mb.empty for mb in schedule.for_rank(dsp.global_rank)),
                    "all_to_all": dsp.stats.calls.get("all_to_all", 0)}
    return out


def _check_fp32(what, r, run, ref_loss, ref_grads):
    assert abs(r["loss"] - ref_loss.item()) <= REL * ref_loss.item(), f"{what}: loss {r['loss']} != plain {ref_loss}"
    scale = 1.0
    if run.clip:
        plain = torch.stack([g.norm() for g in ref_grads.values()]).norm().item()
        assert abs(r["norm"] - plain) <= REL * plain, f"{what}: the engine's grad norm {r['norm']} != plain {plain}"
        scale = CLIP * plain / (plain + 1e-6)
    for name, want in ref_grads.items():
        torch.testing.assert_close(r["grads"][name], want * scale, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{what}: gradient of {name}: {m}")


def _check_bf16(what, r, refs):
    (loss64, grads64), (loss_bf, grads_bf) = refs
    assert_derived_close(f"{what}: loss", torch.tensor(r["loss"]), loss64, loss_bf)
    for name, want in grads64.items():
        assert_derived_close(f"{what}: gradient of {name}", r["grads"][name], want, grads_bf[name])


@pytest.mark.parametrize("section, runs", [
    (dict(strategy="zigzag"), (Run(0), Run(3), Run(1, clip=True), Run(2, clip=True), Run(3, bf16=True))),
    (dict(strategy="ulysses"), (Run(0), Run(3))), (dict(strategy="lasp"), (Run(0), Run(3))),
    (dict(strategy="ring"), (Run(0),)), (dict(strategy="striped"), (Run(0),)),
    (dict(strategy="zigzag", ulysses_size=2), (Run(0), Run(2, bf16=True)))],
    ids=["zigzag", "ulysses", "lasp", "ring", "striped", "zigzag-2d"])
def test_dynamic_step_equals_plain_data_parallelism_on_the_same_documents(pool, section, runs):
    strategy = section["strategy"]
    ref_loss, ref_grads = _reference(strategy)
    clip_at = CLIP * torch.stack([g.norm() for g in ref_grads.values()]).norm().item()
    bf16_refs = (_reference(strategy, torch.float64, torch.bfloat16), _reference(strategy, torch.bfloat16)) \
        if any(run.bf16 for run in runs) else None
    results = pool.run(_dynamic_step, section, runs, clip_at)
    assert any(r[runs[-1]]["empty"] for r in results), "some rank should run an empty micro-batch"
    hybrid = section.get("ulysses_size", 1)
    for rank, per_run in enumerate(results):
        built, family = per_run.pop("groups")
        assert built == family, f"{section} rank {rank}: built groups {built}, the family is {family}"
        ulysses = per_run.pop("ulysses")
        if hybrid > 1:
            assert ulysses == {1: 1, 2: 2, 4: 2}, f"{section} rank {rank}: groups ran ulysses degrees {ulysses}"
        for run, r in per_run.items():
            what = f"{section} {run} rank {rank}"
            assert r["sizes"] == [1, 2, 4], f"{what}: the batch should use groups of 1, 2 and 4, used {r['sizes']}"
            assert r["rounds"] == results[0][run]["rounds"], f"{what}: ranks ran different numbers of passes"
            if hybrid > 1:
                assert r["all_to_all"] > 0, f"{what}: no all-to-all ran (every rank runs a group of 4)"
            if run.bf16:
                _check_bf16(what, r, bf16_refs)
            else:
                _check_fp32(what, r, run, ref_loss, ref_grads)


def _refusals():
    """Bad dynamic families on every rank: the error, and the groups asked for before it (none)."""
    import deepspeed
    from ds_seqpar import comm
    from ds_seqpar.config import ConfigError
    from ds_seqpar.dynamic import DynamicSequenceParallel
    deepspeed.init_distributed(dist_backend="gloo")
    out, new_group = [], comm.new_group
    for section, heads in ((dict(strategy="zigzag", max_tokens_per_rank=1), 4),
                           (dict(strategy="zigzag", max_tokens_per_rank=16, ulysses_size=3), 6),
                           (dict(strategy="ulysses", max_tokens_per_rank=16), 3)):
        asked = []
        comm.new_group = lambda ranks, timeout_s: asked.append(ranks) or new_group(ranks, timeout_s)
        try:
            DynamicSequenceParallel(dict(section, size="dynamic"), heads=heads)
            out.append(("built", asked))
        except ConfigError as err:
            out.append((str(err), asked))
        finally:
            comm.new_group = new_group
    return out


def test_bad_families_stop_every_rank_before_any_group(pool):
    words = ["max_tokens_per_rank=1 with strategy='zigzag'", "ulysses_size=3 with size='dynamic' must divide "
             "the world size 4", "no group size of [1, 2, 4] but 1 divides the 3 heads"]
    for rank, result in enumerate(pool.run(_refusals)):
        for (message, asked), want in zip(result, words):
            assert want in message and not asked, f"rank {rank}: {message!r}, groups asked for {asked}"
