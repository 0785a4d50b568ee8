"""Plain data-parallel training on one process: the reference the end-to-end tests compare with
(the own LM, or a ``--model`` Hugging Face model with its own sdpa attention).

Every replica's batch is computed in turn on the whole sequence (no sharding, no sp.loss, labels
shifted the textbook way), the replicas' gradients are averaged, clipped, and the same optimizer
and scheduler as the DeepSpeed config take the step, in DeepSpeed's order.

``dtype=torch.bfloat16`` is plain mixed precision the way DeepSpeed's bf16 mode does it: the
model computes in bf16 (the loss in fp32), fp32 master weights take the optimizer step and are
copied back to the bf16 model.
"""
import copy
import math

import torch
import torch.nn.functional as F

from ds_seqpar import SequenceParallelConfig
from ds_seqpar.train import data
from ds_seqpar.train.main import build_ds_config, build_model, load_hf_config, load_tokens, model_config
from ds_seqpar.train.args import resolve_args
from ds_seqpar.train.images import RandomImages


def plain_loss(model, batch):
    """``batch``: input_ids and labels, and with --images the vision inputs, token types and 3-D positions."""
    ids = batch["input_ids"]
    pos = batch.get("position_ids", torch.arange(ids.shape[1]).expand_as(ids))
    logits = model(ids, pos, **{k: v for k, v in batch.items() if k not in ("input_ids", "labels", "position_ids")})
    logits = logits if logits.dtype == torch.float64 else logits.float()     # float64: the exact reference
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=data.IGNORE_INDEX)


def reference_losses(args, dp_size, dtype=torch.float32):
    """(losses per replica per step, gradient norm per step) of plain data-parallel training over
    ``dp_size`` replicas; the norm is the averaged gradient's, before clipping. ``dtype=float64``
    gives the reference that derived tolerances measure errors against."""
    from deepspeed.runtime.lr_schedules import WarmupLR
    opts = resolve_args(args)
    ds = build_ds_config(opts)
    sp_cfg = SequenceParallelConfig.from_ds_config(ds)
    hf_config = load_hf_config(opts, sp_cfg, ds)            # --model: a Hugging Face model (sdpa attention)
    cfg = None if hf_config is not None else model_config(opts, sp_cfg)
    tokens = load_tokens(opts)
    torch.manual_seed(opts.seed)
    vocab = data.vocab_size_of(tokens, opts.vocab_size)
    model = build_model(opts, cfg, hf_config, vocab, sp=None)  # fp32 master
    images = RandomImages.of(opts, hf_config, vocab) if hf_config is not None else None    # --images
    if dtype == torch.float64:
        model = model.to(dtype)         # the float64 reference of derived tolerances: no fp32 master
    work = copy.deepcopy(model).to(dtype) if dtype in (torch.bfloat16, torch.float16) else model
    params = copy.deepcopy(ds["optimizer"]["params"])
    params.pop("torch_adam", None)
    assert ds["optimizer"]["type"] == "AdamW", ds["optimizer"]
    opt = torch.optim.AdamW(model.parameters(), **params)
    sched = WarmupLR(opt, **ds["scheduler"]["params"]) if "scheduler" in ds else None
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds.get("gradient_accumulation_steps", 1)
    losses, norms = [[] for _ in range(dp_size)], []
    for step in range(opts.steps):
        opt.zero_grad()
        work.zero_grad()
        for d in range(dp_size):
            step_loss = 0.0
            for m in range(accum):
                batch = data.batch_for_step(tokens, step, m, d, dp_size, micro, opts.seq_len, opts.seed,
                                            opts.ignore_frac)
                if images is not None:
                    batch = images.attach(model.model).batch(batch, opts.seed, step, m, d * micro)
                loss = plain_loss(work, batch)
                (loss / (dp_size * accum)).backward()
                step_loss += loss.item() / accum
            losses[d].append(step_loss)
        if work is not model:
            for master, low in zip(model.parameters(), work.parameters()):
                master.grad = low.grad.float()
        clip = ds.get("gradient_clipping") or math.inf
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        if sched is not None:
            sched.step()
        if work is not model:
            with torch.no_grad():
                for master, low in zip(model.parameters(), work.parameters()):
                    low.copy_(master)
    return losses, norms
