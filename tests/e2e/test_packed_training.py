"""Training on packed documents (one row, cu_seqlens) with sequence x data parallelism and ZeRO-2
gives the losses of plain single-process training of the same documents one per row, for the
project's LM and for a Hugging Face model (transformers passes model(**batch)'s cu_seqlens on to
the registered attention function).

The harness is test-only: each data-parallel replica gets, per step, a few documents of odd
lengths (some shorter than a shard, one spanning every rank, totals the layouts must pad), packs
them the way Hugging Face's DataCollatorWithFlattening does (position_ids restarting at 0), and
trains the project's LM through sp.shard_batch -> model(..., cu_seqlens) -> sp.loss. The reference
pads the same documents into rows (labels of the pads ignored) and trains one process, averaging
the replicas' gradients as DeepSpeed does.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from ds_seqpar.models import CausalLM
from ds_seqpar.models.lm import ModelConfig

from .test_train_e2e import assert_close_losses, shipped_config

STEPS, VOCAB, DP = 3, 64, 2
MODEL = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
# documents per step, per replica: lengths (packed totals 61 and 64 tokens)
LENGTHS = [[[13, 1, 30, 17], [40, 24]], [[64], [5, 7, 9, 11, 29]], [[31, 30], [2, 61]]]


def documents(step, replica):
    g = torch.Generator().manual_seed(100 * step + replica)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS[step][replica]]


def ds_config(name):
    ds = copy.deepcopy(shipped_config(name))
    ds["train_micro_batch_size_per_gpu"] = 1            # one packed row per replica
    ds.pop("wandb", None)
    return ds


def build_model(kind, sp=None):
    """The project's LM ("softmax" / "linear" attention) or a tiny Hugging Face Llama ("hf"), same init."""
    if kind == "hf":
        from ..hf_models import tiny_model
        model = tiny_model("llama", vocab_size=VOCAB)
        if sp is not None:
            from ds_seqpar.hf import apply_sequence_parallel
            apply_sequence_parallel(model, sp)
        return model
    torch.manual_seed(0)
    return CausalLM(ModelConfig(attention=kind, **MODEL), sp)


def logits_of(kind, model, ids, pos):
    return model(input_ids=ids, position_ids=pos).logits if kind == "hf" else model(ids, pos)


def _train_packed(ds, kind):
    """On every rank: ZeRO-2 over dp x sp, packed documents. Returns (dp_rank, losses)."""
    import deepspeed
    from ds_seqpar import SequenceParallel
    sp = SequenceParallel.from_ds_config(ds)
    model = build_model(kind, sp)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds, mpu=sp.mpu)
    losses = []
    for step in range(STEPS):
        docs = documents(step, sp.dp_rank)
        ids = torch.cat(docs)[None]
        pos = torch.cat([torch.arange(len(d)) for d in docs])[None]     # DataCollatorWithFlattening's
        local = sp.shard_batch({"input_ids": ids, "labels": ids, "position_ids": pos})
        if kind == "hf":
            loss = engine(**local).loss             # cu_seqlens reaches the attention as a model kwarg
        else:
            # a step whose row is one document has no restart: an ordinary batch, no cu_seqlens
            logits = engine(local["input_ids"], local["position_ids"], cu_seqlens=local.get("cu_seqlens"))
            loss = sp.loss(logits, local["labels"])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return sp.dp_rank, losses


def one_document_per_row_losses(ds, kind):
    """Plain training of the same documents, each its own row, on one process."""
    from deepspeed.runtime.lr_schedules import WarmupLR
    model = build_model(kind)
    params = {k: v for k, v in ds["optimizer"]["params"].items() if k != "torch_adam"}
    opt = torch.optim.AdamW(model.parameters(), **params)
    sched = WarmupLR(opt, **ds["scheduler"]["params"])
    losses = [[] for _ in range(DP)]
    for step in range(STEPS):
        opt.zero_grad()
        for replica in range(DP):
            docs = documents(step, replica)
            width = max(len(d) for d in docs)
            ids = torch.stack([F.pad(d, (0, width - len(d))) for d in docs])
            labels = torch.stack([F.pad(d, (0, width - len(d)), value=-100) for d in docs])
            logits = logits_of(kind, model, ids, torch.arange(width).expand_as(ids))
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
            (loss / DP).backward()
            losses[replica].append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), ds.get("gradient_clipping") or math.inf)
        opt.step()
        sched.step()
    return losses


@pytest.mark.parametrize("name,kind", [("zigzag", "softmax"), ("lasp", "linear"), ("striped", "hf")])
def test_packed_training_matches_one_document_per_row(pool, name, kind):
    ds = ds_config(name)
    assert ds["zero_optimization"]["stage"] == 2 and ds["sequence_parallel"]["size"] == 2
    ref = one_document_per_row_losses(ds, kind)
    for dp_rank, losses in pool.run(_train_packed, ds, kind):
        assert_close_losses(losses, ref[dp_rank], f"{name} {kind} packed, dp_rank {dp_rank}")
