"""The main job: train a small causal LM with any sequence-parallel strategy and ZeRO.

    python -m ds_seqpar.train                       # 4 local CPU ranks: 2 data x 2 sequence, ZeRO-2
    deepspeed --num_gpus 4 --module ds_seqpar.train --deepspeed_config configs/zigzag_zero2.json
    mpirun -np 4 python -m ds_seqpar.train ...      # MPI discovery through mpi4py
    torchrun --nproc_per_node 4 -m ds_seqpar.train ...

The same code runs gloo on CPU and nccl on GPU. ``run_training(dict)`` is what the command line
and the tests call. Order of work (every check that can fail runs before training starts and
fails on every rank with the same message):

  1. join torch.distributed (launcher env, or MPI discovery)
  2. read the DeepSpeed config, apply command-line overrides, validate model x strategy
  3. SequenceParallel: world check, groups, layout; then sequence length and head checks
  4. data (all ranks must hold the same corpus), model, deepspeed.initialize(mpu=sp.mpu)
  5. resume, then train: the batch of step k is a function of k, so a resumed run continues the
     uninterrupted run's trajectory exactly
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from typing import Any, Dict, Mapping, Optional

import torch

from . import comm, data, faults
from .config import ConfigError, SequenceParallelConfig
from .models import CausalLM, ModelConfig
from .parallel import SequenceParallel
from .trainargs import DEFAULT_DS_CONFIG, TrainConfigError, build_parser, resolve_args
from .zero import partition_for_zero3


def run_training(args: Mapping[str, Any]) -> Dict[str, Any]:
    """Train as the command line would with these options; return this rank's summary:
    ``losses`` (this replica's loss per step run), ``mean_losses`` (over replicas), ranks, paths."""
    opts = resolve_args(args)
    ds_config = load_ds_config(opts)
    sp_cfg = SequenceParallelConfig.from_ds_config(ds_config)
    _join_world(opts, sp_cfg.timeout_s)
    model_cfg = model_config(opts, sp_cfg)
    # checks size | world before building groups; takes the loss's ZeRO factor from the config
    sp = SequenceParallel.from_ds_config(ds_config)
    check_run(sp, opts, model_cfg)
    tokens = load_tokens(opts)
    model_cfg.vocab_size = data.vocab_size_of(tokens, opts.vocab_size)
    _check_same_data(tokens, sp.mpu.get_sequence_data_parallel_group())
    torch.manual_seed(opts.seed)                       # same init everywhere; DeepSpeed broadcasts anyway
    model = partition_for_zero3(CausalLM(model_cfg, sp).to(sp.device), ds_config, sp)
    trainer = Trainer(opts, ds_config, sp, model, tokens)
    try:
        return trainer.train()
    finally:
        trainer.close()


# ---------------------------------------------------------------------------------------------
# setup


def _join_world(opts, timeout_s: float) -> None:
    import datetime
    import deepspeed
    if not comm.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # the world group's collectives (DeepSpeed's own) get the same timeout as ours
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=True,
                                   distributed_port=opts.master_port,
                                   timeout=datetime.timedelta(seconds=timeout_s))
    else:
        deepspeed.init_distributed(dist_backend=comm.backend_name())   # adopt the existing world
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif "OMP_NUM_THREADS" not in os.environ:
        # ranks share the machine's cores; oversubscribed intra-op threads only thrash
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def load_ds_config(opts) -> dict:
    """The DeepSpeed config (file, dict, or the built-in default) with command-line overrides."""
    src = opts.deepspeed_config
    if src is None:
        ds = copy.deepcopy(DEFAULT_DS_CONFIG)
    elif isinstance(src, Mapping):
        ds = copy.deepcopy(dict(src))
    else:
        if not os.path.exists(src):
            raise TrainConfigError(f"--deepspeed_config {src!r} does not exist")
        with open(src) as f:
            ds = json.load(f)
    section = dict(ds.get("sequence_parallel", {}))
    overrides = {"strategy": opts.strategy, "size": opts.sp_size, "ulysses_size": opts.ulysses_size}
    for key, value in overrides.items():
        if value is not None:
            section[key] = value
    ds["sequence_parallel"] = section
    if opts.zero_stage is not None:
        ds.setdefault("zero_optimization", {})["stage"] = opts.zero_stage
    if opts.micro_batch is not None:
        ds["train_micro_batch_size_per_gpu"] = opts.micro_batch
    if opts.lr is not None:
        ds.setdefault("optimizer", {}).setdefault("params", {})["lr"] = opts.lr
    if opts.no_wandb:
        ds.pop("wandb", None)
    return ds


def model_config(opts, sp_cfg: SequenceParallelConfig) -> ModelConfig:
    """Model sizes from the command line; attention kind follows the strategy unless forced."""
    kind = opts.attention
    if kind == "auto":
        kind = "linear" if sp_cfg.strategy == "lasp" else "softmax"
    if (kind == "linear") != (sp_cfg.strategy == "lasp"):
        raise TrainConfigError(f"--attention={kind} does not go with sequence_parallel.strategy="
                               f"{sp_cfg.strategy!r}: linear attention needs 'lasp', softmax attention any of "
                               f"ulysses, ring, zigzag, striped (or --attention auto)")
    try:
        return ModelConfig(dim=opts.dim, n_layers=opts.n_layers, n_heads=opts.n_heads,
                           n_kv_heads=opts.n_kv_heads, mlp_hidden=opts.mlp_hidden, attention=kind,
                           tie_embeddings=not opts.untied)
    except ValueError as err:
        raise TrainConfigError(str(err)) from None


def check_run(sp, opts, model_cfg: ModelConfig) -> None:
    """Heads against the strategy: same message on every rank. Any sequence length works (the
    layout pads at the end, padding.py)."""
    if opts.steps < 0 or opts.seq_len < 2:
        raise TrainConfigError(f"--steps={opts.steps} must be >= 0 and --seq_len={opts.seq_len} >= 2")
    try:
        if model_cfg.attention == "softmax":
            sp.strategy.check_heads(model_cfg.n_heads, model_cfg.n_kv_heads)
    except ValueError as err:
        raise TrainConfigError(f"{err} (--seq_len={opts.seq_len}, --n_heads={model_cfg.n_heads}, "
                               f"--n_kv_heads={model_cfg.n_kv_heads}, strategy={sp.strategy_name!r}, "
                               f"size={sp.size})") from None


def load_tokens(opts):
    try:
        if opts.data:
            tokens = data.token_file(opts.data, opts.data_dtype)
        else:
            tokens = data.stdlib_corpus(opts.corpus_bytes)
    except (OSError, ValueError) as err:
        raise TrainConfigError(str(err)) from None
    if tokens.size < opts.seq_len + 1:
        raise TrainConfigError(f"the training data has {tokens.size} tokens, not more than --seq_len="
                               f"{opts.seq_len}; pass a larger --data file or a shorter --seq_len")
    return tokens


def _check_same_data(tokens, world_group) -> None:
    """Ranks on different machines may hold different files: training on them would silently
    diverge from data parallelism, so stop here instead."""
    prints = comm.gather_object(data.fingerprint(tokens), world_group)
    if len(set(prints)) != 1:
        raise TrainConfigError(f"ranks disagree on the training data (size:sha1 per rank: {prints}); use the "
                               f"same Python installation or pass the same --data file on every machine")


# ---------------------------------------------------------------------------------------------
# the loop


class Trainer:
    def __init__(self, opts, ds_config: dict, sp, model: CausalLM, tokens):
        import deepspeed
        from . import runlog
        self.opts, self.sp, self.tokens, self.runlog = opts, sp, tokens, runlog
        self.rank = comm.global_rank()
        self.is_writer = self.rank == 0
        name = runlog.run_name(sp.strategy_name, sp.size, sp.dp_size, opts.seq_len, opts.run_name)
        self.run_dir = runlog.unique_dir(opts.run_dir, name) if self.is_writer and opts.run_dir else None
        self.name = os.path.basename(self.run_dir) if self.run_dir else name
        wandb_on = bool(ds_config.get("wandb", {}).get("enabled")) and self.is_writer
        tags = [sp.strategy_name, f"sp{sp.size}", f"dp{sp.dp_size}", f"n{opts.seq_len}"]
        with runlog.wandb_env(wandb_on, self.name, runlog.run_group(sp.strategy_name, sp.size, opts.seq_len),
                              tags, self.run_dir):
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=ds_config, mpu=sp.mpu)
        self.micro_batch = self.engine.train_micro_batch_size_per_gpu()
        self.grad_accum = self.engine.gradient_accumulation_steps()
        self.config = self._run_config(ds_config, model)
        self.log = runlog.RunLog(self.run_dir)
        self.log.write_config(self.config)
        self.wandb_dir = runlog.attach_wandb(self.config) if self.is_writer else None
        self._say(f"run {self.name}: {sp!r}, {model.num_params():,} parameters, "
                  f"ZeRO-{self.config['zero_stage']}; {self._where()}")

    def _run_config(self, ds_config, model) -> dict:
        o, sp = self.opts, self.sp
        return {"name": self.name, "strategy": sp.strategy_name, "sp_size": sp.size, "dp_size": sp.dp_size,
                "world_size": comm.world_size(), "seq_len": o.seq_len, "micro_batch": self.micro_batch,
                "grad_accum": self.grad_accum, "zero_stage": self.engine.zero_optimization_stage(),
                "model": model.cfg.as_dict(), "num_params": model.num_params(), "steps": o.steps,
                "backend": comm.backend_name(), "kernel": sp.kernel.name, "device": str(sp.device),
                "data": o.data or f"python stdlib sources ({self.tokens.size} bytes)",
                "args": {k: v for k, v in vars(o).items() if k != "deepspeed_config"},
                "ds_config": ds_config, "torch": torch.__version__}

    def _where(self) -> str:
        if not self.wandb_dir:
            return f"metrics -> {self.log.metrics_path}, wandb off"
        later = " (offline: upload with `wandb sync <that dir>`)" if self.runlog.wandb_offline() else ""
        return f"metrics -> {self.log.metrics_path}, wandb run -> {self.wandb_dir}{later}"

    def _say(self, msg: str) -> None:
        if self.is_writer and not self.opts.quiet:
            print(f"ds_seqpar.train: {msg}", flush=True)

    # -- checkpoints -------------------------------------------------------------------------
    def resume(self) -> int:
        o = self.opts
        if not (o.resume or o.resume_tag):
            return 0
        if not o.save_dir:
            raise TrainConfigError("--resume needs --save_dir (where the checkpoints are)")
        path, client = self.engine.load_checkpoint(o.save_dir, tag=o.resume_tag)
        if path is None:
            raise TrainConfigError(f"no checkpoint to resume in --save_dir {o.save_dir!r} "
                                   f"(tag {o.resume_tag or 'latest'!r})")
        self._say(f"resumed from {path} at step {client['step']}")
        return int(client["step"])

    def maybe_save(self, step_done: int) -> None:
        o = self.opts
        if o.save_dir and o.save_interval and (step_done % o.save_interval == 0 or step_done == o.steps):
            self.engine.save_checkpoint(o.save_dir, tag=f"step{step_done}",
                                        client_state={"step": step_done, "seq_len": o.seq_len, "seed": o.seed})

    # -- steps -------------------------------------------------------------------------------
    def train(self) -> Dict[str, Any]:
        from tqdm import tqdm
        start = self.resume()
        losses, mean_losses, grad_norms = [], [], []
        bar = tqdm(total=self.opts.steps, initial=start, disable=not self.is_writer or not self.opts.progress,
                   desc=f"{self.sp.strategy_name} sp{self.sp.size} x dp{self.sp.dp_size}", unit="step")
        for step in range(start, self.opts.steps):
            faults.maybe_inject(self.rank, step)
            local = self.step(step)
            metrics = self.reduce_metrics(step, local)
            losses.append(local["loss"])
            grad_norms.append(local["grad_norm"])
            mean_losses.append(metrics["loss"])
            if self.is_writer:
                self.log.log(metrics)
                if self.wandb_dir:
                    self.runlog.wandb_log(metrics, step=self.engine.global_samples)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                bar.update(1)
            self.maybe_save(step + 1)
        bar.close()
        if mean_losses:
            self._say(f"done: {len(mean_losses)} steps, last loss {mean_losses[-1]:.4f}; {self._where()}")
        return {"losses": losses, "mean_losses": mean_losses, "grad_norms": grad_norms, "start_step": start,
                "rank": self.rank, "sp_rank": self.sp.rank, "dp_rank": self.sp.dp_rank, "run_dir": self.run_dir,
                "metrics_path": self.log.metrics_path, "wandb_dir": self.wandb_dir}

    def step(self, step: int) -> Dict[str, float]:
        """One optimizer step over grad_accum micro-batches; this rank's raw measurements."""
        o, sp, eng = self.opts, self.sp, self.engine
        t0, bytes0, comm_s0 = time.perf_counter(), self._attn_bytes(), self._attn_seconds()
        loss_sum, compute_s = 0.0, 0.0
        for micro in range(self.grad_accum):
            batch = data.batch_for_step(self.tokens, step, micro, sp.dp_rank, sp.dp_size, self.micro_batch,
                                        o.seq_len, o.seed, o.ignore_frac)
            local = {k: v.to(eng.device) for k, v in sp.shard_batch(batch).items()}
            c0 = self._clock()
            logits = eng(local["input_ids"], local["position_ids"])
            loss = sp.loss(logits, local["labels"])
            eng.backward(loss)
            compute_s += self._clock() - c0
            loss_sum += loss.item()
            eng.step()      # DeepSpeed counts micro-steps here; the optimizer runs at the boundary only
        grad_norm = eng.get_global_grad_norm()          # of the reduced gradient, before clipping
        grad_norm = float("nan" if grad_norm is None else grad_norm)
        return {"loss": loss_sum / self.grad_accum, "grad_norm": grad_norm,
                "compute_s": compute_s, "step_s": time.perf_counter() - t0,
                "attn_comm_bytes": self._attn_bytes() - bytes0, "attn_comm_s": self._attn_seconds() - comm_s0,
                "peak_mem_mb": self.runlog.peak_memory_mb(sp.device)}

    def _clock(self) -> float:
        # CPU: this process's CPU time, so waiting on a slower peer does not count as compute.
        # CUDA: wall time after a sync (kernels are asynchronous; CPU time says nothing).
        if self.sp.device.type == "cuda":
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    def _attn_bytes(self) -> int:
        return sum(b for k, b in self.sp.stats.bytes.items() if k != "loss")

    def _attn_seconds(self) -> float:
        return sum(s for k, s in self.sp.stats.seconds.items() if k != "loss")

    def reduce_metrics(self, step: int, local: Dict[str, float]) -> Dict[str, Any]:
        """Gather every rank's numbers (one small all-gather) into the step's record."""
        keys = list(local)
        mine = torch.tensor([[local[k] for k in keys]], dtype=torch.float64)
        every = comm.all_gather_nograd(mine, 0, self.sp.mpu.get_sequence_data_parallel_group())  # [world, keys]
        col = {k: every[:, i] for i, k in enumerate(keys)}
        compute_gp = col["compute_s"].view(self.sp.dp_size, self.sp.size)     # [dp groups, sp ranks]
        imbalance = (compute_gp.max(1).values / compute_gp.mean(1).clamp(min=1e-12)).max().item()
        # the slowest or largest rank is what limits a step
        worst = {k: col[k].max().item()
                 for k in ("step_s", "compute_s", "attn_comm_bytes", "attn_comm_s", "peak_mem_mb")}
        tokens = self.sp.dp_size * self.micro_batch * self.grad_accum * self.opts.seq_len
        return {"step": step + 1, "loss": col["loss"].mean().item(), "grad_norm": local["grad_norm"],
                "tokens_per_s": tokens / worst["step_s"], "step_s": worst["step_s"],
                "compute_s_max": worst["compute_s"], "compute_imbalance": imbalance,
                "attn_comm_bytes": int(worst["attn_comm_bytes"]), "attn_comm_s": worst["attn_comm_s"],
                "peak_mem_mb": worst["peak_mem_mb"], "lr": self.engine.get_lr()[0],
                "samples": self.engine.global_samples, "time": time.time()}

    def close(self) -> None:
        if self.is_writer:
            self.runlog.wandb_finish()


# ---------------------------------------------------------------------------------------------
# command line


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = build_parser().parse_args(argv)
    from .launch import spawn_local, under_launcher
    if not under_launcher() and opts.nprocs > 1:
        return spawn_local("ds_seqpar.train", argv, opts.nprocs)
    if not under_launcher():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(opts.master_port))
    if opts.quiet or not opts.verbose:
        _quiet_deepspeed()
    try:
        run_training(vars(opts))
    except (TrainConfigError, ConfigError) as err:
        # every rank raises the same message before training; each says it, as one write so the
        # ranks' lines do not interleave, without a traceback
        sys.stderr.flush()
        os.write(2, f"ds_seqpar.train: error: {err}\n".encode())
        return 2
    except Exception as err:  # noqa: BLE001 - say which rank failed, then fail the launcher
        rank = os.environ.get("RANK", "?")
        hint = _comm_failure_hint() if _is_comm_error(err) else ""
        sys.stderr.flush()
        os.write(2, f"ds_seqpar.train: rank {rank} failed: {type(err).__name__}: {err}{hint}\n".encode())
        return 1
    return 0


def _comm_failure_hint() -> str:
    missing = comm.unresponsive_ranks()
    who = (f"rank(s) {', '.join(map(str, missing))} stopped responding" if missing else
           "another rank died or stopped responding; its own error is above")
    return f" (a collective failed or timed out: {who}; sequence_parallel.timeout_s bounds the wait)"


def _is_comm_error(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return any(w in text for w in ("gloo", "nccl", "timed out", "timeout", "connection", "distbackend", "peer"))


def _quiet_deepspeed() -> None:
    """DeepSpeed's per-rank INFO/WARNING chatter (and torch's deprecation notices about calls inside
    DeepSpeed) buries the progress bar; --verbose keeps it."""
    import logging
    import warnings
    from deepspeed.utils import logger
    logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


if __name__ == "__main__":
    sys.exit(main())
