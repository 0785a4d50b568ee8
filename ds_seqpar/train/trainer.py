"""The training loop of the main job: load (engine, resume), loop (steps), save, log. The pieces
it delegates to: checkpoint.py (save/resume), metrics.py (measure, reduce across ranks, log),
data.py (the batch of each step), runlog.py (run directory and wandb)."""
from __future__ import annotations

import collections
import os
import time
from typing import Any, Dict

import torch

from .. import comm
from ..memory.usage import StepMemory
from . import checkpoint, data, faults, runlog
from .metrics import StepMetrics


class Trainer:
    def __init__(self, opts, ds_config: dict, sp, model, tokens, images=None):
        import deepspeed
        self.opts, self.sp, self.tokens, self.images = opts, sp, tokens, images
        self.rank = comm.global_rank()
        self.is_writer = self.rank == 0
        self.model_name = runlog.model_name(opts)
        name = runlog.run_name(self.model_name, sp.strategy_name, sp.size, sp.dp_size, opts.seq_len, opts.run_name)
        self.run_dir = runlog.unique_dir(opts.run_dir, name) if self.is_writer and opts.run_dir else None
        self.name = os.path.basename(self.run_dir) if self.run_dir else name
        wandb_on = bool(ds_config.get("wandb", {}).get("enabled")) and self.is_writer
        tags = [self.model_name, sp.strategy_name, f"sp{sp.size}", f"dp{sp.dp_size}", f"n{opts.seq_len}"]
        group = runlog.run_group(self.model_name, sp.strategy_name, sp.size, opts.seq_len)
        with runlog.wandb_env(wandb_on, self.name, group, tags, self.run_dir):
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config, mpu=sp.mpu)
        if opts.compile:
            self.engine.compile(backend=opts.compile, compile_kwargs={"dynamic": None})
        self.micro_batch = self.engine.train_micro_batch_size_per_gpu()
        self.grad_accum = self.engine.gradient_accumulation_steps()
        self.config = self._run_config(ds_config, model)
        self.wandb_dir = runlog.attach_wandb(self.config) if self.is_writer else None
        self.metrics = StepMetrics(sp, self.run_dir, wandb_on=bool(self.wandb_dir), is_writer=self.is_writer)
        self.memory = StepMemory(sp.device)             # each step's peak above what it started with
        # a compiled model runs no Python between its layers: its memory phases are marked at the step's calls only
        for module, phase in ([] if opts.compile else memory_watch_points(model)):
            self.memory.watch(module, phase)
        self.memory_records = collections.deque(maxlen=64)     # the latest steps' records (bench, tests)
        self.metrics.log.write_config(self.config)
        self._say(f"run {self.name}: {sp!r}, {model.num_params():,} parameters, "
                  f"ZeRO-{self.config['zero_stage']}; {self._where()}")

    def _run_config(self, ds_config, model) -> dict:
        o, sp = self.opts, self.sp
        return {"name": self.name, "strategy": sp.strategy_name, "sp_size": sp.size, "dp_size": sp.dp_size,
                "world_size": comm.world_size(), "seq_len": o.seq_len, "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum, "zero_stage": self.engine.zero_optimization_stage(),
                "model": model.cfg.as_dict(), "model_name": self.model_name, "num_params": model.num_params(),
                "steps": o.steps,
                "backend": comm.backend_name(), "kernel": sp.kernel.name, "device": str(sp.device),
                "data": o.data or f"python stdlib sources ({self.tokens.size} bytes)",
                "args": {k: v for k, v in vars(o).items() if k != "deepspeed_config"},
                "ds_config": ds_config, "torch": torch.__version__}

    def _where(self) -> str:
        metrics_path = self.metrics.log.metrics_path
        if not self.wandb_dir:
            return f"metrics -> {metrics_path}, wandb off"
        later = " (offline: upload with `wandb sync <that dir>`)" if runlog.wandb_offline() else ""
        return f"metrics -> {metrics_path}, wandb run -> {self.wandb_dir}{later}"

    def _say(self, msg: str) -> None:
        if self.is_writer and not self.opts.quiet:
            print(f"ds_seqpar.train: {msg}", flush=True)

    # -- the loop --------------------------------------------------------------------------------
    def train(self) -> Dict[str, Any]:
        from tqdm import tqdm
        start = checkpoint.resume(self.engine, self.opts, self._say)
        losses, mean_losses, grad_norms = [], [], []
        bar = tqdm(total=self.opts.steps, initial=start, disable=not self.is_writer or not self.opts.progress,
                   desc=f"{self.sp.strategy_name} sp{self.sp.size} x dp{self.sp.dp_size}", unit="step")
        for step in range(start, self.opts.steps):
            faults.maybe_inject(self.rank, step)
            local = self.step(step)
            record = self.reduce(step, local)
            losses.append(local["loss"])
            grad_norms.append(local["grad_norm"])
            mean_losses.append(record["loss"])
            self.metrics.write(record, samples=self.engine.global_samples)
            if self.is_writer:
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
            checkpoint.maybe_save(self.engine, self.opts, step + 1)
        bar.close()
        if mean_losses:
            self._say(f"done: {len(mean_losses)} steps, last loss {mean_losses[-1]:.4f}; {self._where()}")
        return {"losses": losses, "mean_losses": mean_losses, "grad_norms": grad_norms, "start_step": start,
                "rank": self.rank, "sp_rank": self.sp.rank, "dp_rank": self.sp.dp_rank, "run_dir": self.run_dir,
                "metrics_path": self.metrics.log.metrics_path, "wandb_dir": self.wandb_dir,
                "memory": list(self.memory_records)}

    def reduce(self, step: int, local: Dict[str, float]) -> Dict[str, Any]:
        """Every rank's measurements of the step -> its record (metrics.py)."""
        tokens_per_step = self.sp.dp_size * self.micro_batch * self.grad_accum * self.opts.seq_len
        return self.metrics.reduce(step, local, tokens_per_step, self.engine)

    def step(self, step: int) -> Dict[str, float]:
        """One optimizer step over grad_accum micro-batches; this rank's raw measurements."""
        o, sp, eng, m = self.opts, self.sp, self.engine, self.metrics
        t0, bytes0, comm_s0 = time.perf_counter(), m.attn_bytes(), m.attn_seconds()
        loss_sum, compute_s, mem = 0.0, 0.0, self.memory
        mem.begin()
        for micro in range(self.grad_accum):
            mem.mark("data")
            batch = data.batch_for_step(self.tokens, step, micro, sp.dp_rank, sp.dp_size, self.micro_batch,
                                        o.seq_len, o.seed, o.ignore_frac)
            if self.images is not None:         # --images: the whole rows' vision inputs and 3-D positions
                batch = self.images.batch(batch, o.seed, step, micro, sp.dp_rank * self.micro_batch)
            local = {k: v.to(eng.device) for k, v in sp.shard_batch(batch).items()}
            ids, pos, labels = local.pop("input_ids"), local.pop("position_ids"), local.pop("labels")
            c0 = m.clock()
            mem.mark("forward")
            # the model computes the loss: sp.loss, or the fused tiled head + loss (tiled_loss_tokens)
            loss = eng(ids, pos, labels=labels, **local)
            mem.mark("loss_backward")       # until the last layer's output gradient (memory_watch_points)
            eng.backward(loss)
            compute_s += m.clock() - c0
            loss_sum += loss.item()
            mem.mark("optimizer")
            eng.step()      # DeepSpeed counts micro-steps here; the optimizer runs at the boundary only
        used = mem.end()
        step_s = time.perf_counter() - t0
        self.memory_records.append(dict(used, step=step + 1, step_s=step_s))
        grad_norm = eng.get_global_grad_norm()          # of the reduced gradient, before clipping
        grad_norm = float("nan" if grad_norm is None else grad_norm)
        return {"loss": loss_sum / self.grad_accum, "grad_norm": grad_norm,
                "compute_s": compute_s, "step_s": step_s,
                "attn_comm_bytes": m.attn_bytes() - bytes0, "attn_comm_s": m.attn_seconds() - comm_s0,
                **memory_fields(used)}

    def close(self) -> None:
        self.memory.close()
        if self.is_writer:
            runlog.wandb_finish()
        # DeepSpeed's optimizer holds a hook bound to the engine that gc never frees: without this, a
        # process that trains several times (test and benchmark pools) keeps every run's model,
        # gradients and optimizer state
        self.engine.destroy()


def memory_fields(used: Dict[str, Any]) -> Dict[str, float]:
    """The step's memory in MiB for the metrics: its peak, what the process held before it (static)
    and the difference, the part that grows with the tokens per rank (NaN where not measurable)."""
    mib = lambda b: float("nan") if b is None else b / 2**20  # noqa: E731
    return {"peak_mem_mb": mib(used["peak_bytes"]), "static_mem_mb": mib(used["static_bytes"]),
            "step_mem_mb": mib(used["above_static_bytes"])}


def memory_watch_points(model: torch.nn.Module):
    """(module, phase) pairs splitting backward: the last decoder layer's output gradient starts the
    layers' backward, the embedding output's gradient its end (DeepSpeed's last reductions). The
    own LM (blocks, embed) and a wrapped transformers model (its input embeddings and its decoder
    layers: the longest ModuleList); nothing for anything else (backward stays one phase)."""
    inner = getattr(model, "model", None)
    if hasattr(model, "blocks") and hasattr(model, "embed"):
        layers, embed = model.blocks, model.embed
    elif inner is not None and hasattr(inner, "get_input_embeddings"):
        lists = [m for m in inner.modules() if isinstance(m, torch.nn.ModuleList)]
        layers, embed = (max(lists, key=len) if lists else None), inner.get_input_embeddings()
    else:
        return []
    points = [(layers[-1], "layers_backward")] if layers is not None and len(layers) else []
    return points + ([(embed, "end_of_backward")] if embed is not None else [])


__all__ = ["Trainer", "memory_fields", "memory_watch_points"]
