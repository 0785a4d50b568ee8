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
from typing import Any, Dict, Mapping, Optional

import torch

from .. import comm
from ..config import ConfigError, SequenceParallelConfig
from ..memory import MemoryConfig, apply_memory_features
from ..models import CausalLM, ModelConfig
from ..sequence_parallel import SequenceParallel
from ..zero import partition_for_zero3
from . import data
from .args import DEFAULT_DS_CONFIG, TrainConfigError, build_parser, resolve_args
from .trainer import Trainer


def run_training(args: Mapping[str, Any]) -> Dict[str, Any]:
    """Train as the command line would with these options; return this rank's summary:
    ``losses`` (this replica's loss per step run), ``mean_losses`` (over replicas), ranks, paths."""
    opts = resolve_args(args)
    ds_config = build_ds_config(opts)
    sp_cfg = SequenceParallelConfig.from_ds_config(ds_config)
    memory = MemoryConfig.from_ds_config(ds_config, sp_cfg)     # tiled loss/MLP, checkpointing
    _join_world(opts, sp_cfg.timeout_s)
    model_cfg = model_config(opts, sp_cfg)
    # checks size | world before building groups; takes the loss's ZeRO factor from the config
    sp = SequenceParallel.from_ds_config(ds_config)
    check_run(sp, opts, model_cfg)
    tokens = load_tokens(opts)
    model_cfg.vocab_size = data.vocab_size_of(tokens, opts.vocab_size)
    _check_same_data(tokens, sp.mpu.get_sequence_data_parallel_group())
    torch.manual_seed(opts.seed)                       # same init everywhere; DeepSpeed broadcasts anyway
    model = CausalLM(model_cfg, sp).to(sp.device)
    apply_memory_features(model, memory)
    model = partition_for_zero3(model, ds_config, sp)
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


def build_ds_config(opts) -> dict:
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
# command line


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = build_parser().parse_args(argv)
    from ..launch.spawn import spawn_local, under_launcher
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
