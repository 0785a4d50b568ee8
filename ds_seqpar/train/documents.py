"""The main job with --lengths: every step trains on a global batch of documents drawn from a
real length distribution (data.documents_for_step), scheduled on groups (ds_seqpar.dynamic):
size "dynamic" gives each document the group its length needs; an integer size runs the same
documents packed into rows of that many ranks. The loss is the token-level mean of the step's
documents in every mode, so static, dynamic and plain data parallelism print the same losses."""
from __future__ import annotations

import time
from typing import Any, Dict

import torch

from .. import comm
from ..dynamic import DynamicSequenceParallel, train_step
from ..cost.model_shape import ModelShape, from_hf_config
from . import data
from .args import TrainConfigError
from .trainer import Trainer


def check_options(opts, sp_cfg, hf_config):
    """--lengths read and checked (None without it), and the options that do not go with it
    refused: from the options alone, so every rank says it before joining the world."""
    if sp_cfg.is_dynamic and not opts.lengths:
        raise TrainConfigError("sequence_parallel.size='dynamic' trains on documents: pass --lengths FILE (one "
                               "document length per line); fixed-length sequences need an integer size")
    if not opts.lengths:
        if opts.tokens_per_step is not None:
            raise TrainConfigError(f"--tokens_per_step={opts.tokens_per_step} goes with --lengths FILE only")
        return None
    if opts.images:
        raise TrainConfigError(f"--images={opts.images} with --lengths: packed documents with images (and their "
                               f"3-D positions) are not built; train vision-language rows without --lengths")
    if opts.ignore_frac:
        raise TrainConfigError(f"--ignore_frac={opts.ignore_frac} with --lengths: every target token of a "
                               f"document counts there; use --ignore_frac 0")
    if opts.tokens_per_step is not None and opts.tokens_per_step < 1:
        raise TrainConfigError(f"--tokens_per_step={opts.tokens_per_step} must be >= 1")
    if not sp_cfg.is_dynamic and opts.seq_len < sp_cfg.size:
        raise TrainConfigError(f"--seq_len={opts.seq_len} with --lengths is the row the {sp_cfg.size} ranks of a "
                               f"group hold; it must be >= sequence_parallel.size={sp_cfg.size}")
    try:
        return data.read_lengths(opts.lengths)
    except ValueError as err:
        raise TrainConfigError(str(err)) from None


def build_runner(ds_config, heads, kv_heads) -> DynamicSequenceParallel:
    """size "dynamic": every group size's SequenceParallel, built once (collective)."""
    return DynamicSequenceParallel.from_ds_config(ds_config, heads=heads, kv_heads=kv_heads)


def model_shape(model) -> ModelShape:
    """What the scheduler prices a token and an attention pair with: the own LM's sizes, or a
    Hugging Face model's from its config, read by the cost model's one reader (cost/model_shape.py)."""
    if hasattr(model.cfg, "n_heads"):
        return ModelShape.of_lm(model.cfg)
    return from_hf_config(model.cfg.config)


def runner_of(sp, opts) -> DynamicSequenceParallel:
    """What executes the schedule: the dynamic runner, or a fixed size's SequenceParallel with rows
    of --seq_len tokens (sp.size x seq_len // sp.size)."""
    if isinstance(sp, DynamicSequenceParallel):
        return sp
    return DynamicSequenceParallel.fixed(sp, opts.seq_len // sp.size)


class DocumentTrainer(Trainer):
    def __init__(self, opts, ds_config: dict, sp, model, tokens, lengths, runner: DynamicSequenceParallel):
        super().__init__(opts, ds_config, sp, model, tokens)
        self.lengths, self.runner = lengths, runner
        self.tokens_per_step = opts.tokens_per_step or runner.world_size * opts.seq_len
        self.shape = model_shape(model)
        self._say(f"documents: lengths from {opts.lengths} ({lengths.size} lengths), {self.tokens_per_step} tokens "
                  f"per step, cut at {runner.capacity} tokens; group sizes {list(runner.sizes)}, "
                  f"max_tokens_per_rank={runner.max_tokens_per_rank}")

    def step(self, step: int) -> Dict[str, float]:
        """Schedule the step's documents, run every round, one optimizer step; this rank's numbers."""
        t0, bytes0 = time.perf_counter(), self.metrics.attn_bytes()
        docs, cut = data.documents_for_step(self.tokens, self.lengths, step, self.tokens_per_step,
                                            self.runner.capacity, self.opts.seed)
        schedule = self.runner.schedule([int(d.numel()) for d in docs], shape=self.shape)
        out = train_step(self.runner, self.engine, docs, clock=self.metrics.clock, schedule=schedule)
        norm = self.engine.get_global_grad_norm()
        return {"loss": out["loss"], "grad_norm": float("nan" if norm is None else norm),
                "compute_s": out["compute_s"], "step_s": time.perf_counter() - t0,
                "attn_comm_bytes": self.metrics.attn_bytes() - bytes0, "rank_tokens": out["tokens"],
                "tokens": sum(int(d.numel()) for d in docs),
                "documents": len(docs), "cut": cut, "rounds": out["rounds"],
                "group_sizes": schedule.group_sizes, "priced_imbalance": schedule.imbalance}

    def reduce(self, step: int, local: Dict[str, Any]) -> Dict[str, Any]:
        """Per-rank compute seconds, tokens and bytes gathered; the busiest rank sets the step."""
        keys = ("compute_s", "step_s", "attn_comm_bytes", "rank_tokens")
        mine = torch.tensor([[float(local[k]) for k in keys]], dtype=torch.float64)
        every = comm.all_gather_nograd(mine, 0, self.runner.groups.seq_data_group)          # [world, keys]
        compute = every[:, 0]
        step_s = every[:, 1].max().item()
        return {"step": step + 1, "loss": local["loss"], "grad_norm": local["grad_norm"],
                "tokens": local["tokens"], "documents": local["documents"], "cut_documents": local["cut"],
                "group_sizes": local["group_sizes"], "rounds": local["rounds"],
                "compute_s": [round(c, 6) for c in compute.tolist()], "compute_s_max": compute.max().item(),
                "compute_imbalance": (compute.max() / compute.mean().clamp(min=1e-12)).item(),
                "priced_imbalance": local["priced_imbalance"], "rank_tokens": [int(t) for t in every[:, 3].tolist()],
                "attn_comm_bytes": int(every[:, 2].max().item()), "step_s": step_s,
                "tokens_per_s": local["tokens"] / step_s, "lr": self.engine.get_lr()[0],
                "samples": self.engine.global_samples, "time": time.time()}


__all__ = ["DocumentTrainer"]
