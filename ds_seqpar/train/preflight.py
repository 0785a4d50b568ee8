"""The main job's front door: what the command line and the DeepSpeed config alone can show wrong,
found before torch and DeepSpeed load (seconds on every rank) and said once per job.

``python -m ds_seqpar.train`` runs ``check`` here before it imports the job (main.py, which checks
again: ``ds-seqpar train`` enters there, after torch). This module imports only the
standard library, pydantic and the config schema (config.py imports no torch), so under a launcher
each rank finds a bad ``sequence_parallel`` section, a JSON syntax error or a bad option in well
under a second; rank 0 says it and the others leave with the same exit code, quietly (every rank
reads the same argv and file, so they all find it). Without a launcher the checks run once, before
any rank is started. What needs the model (heads against the strategy, a --model directory) is
checked by every rank before it joins the world (main.run_training), under the same rule.
"""
from __future__ import annotations

import copy
import math
import os
import sys
import time
from typing import Mapping, Optional, Tuple

from ..config import ConfigError, SequenceParallelConfig, load_ds_config
from ..launch import env as launch_env
from ..launch.spawn import CONFIG_ERROR
from .args import DEFAULT_DS_CONFIG, TrainConfigError, parse_grid


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
        ds = dict(load_ds_config(src))
    fill_auto(ds)
    section = dict(ds.get("sequence_parallel", {}))
    overrides = {"strategy": opts.strategy, "size": opts.sp_size, "ulysses_size": opts.ulysses_size,
                 "max_tokens_per_rank": opts.max_tokens_per_rank}
    for key, value in overrides.items():
        if value is not None:
            section[key] = value
    if isinstance(opts.sp_size, int) and opts.max_tokens_per_rank is None:
        section.pop("max_tokens_per_rank", None)       # a fixed size asked for: the dynamic budget goes
    ds["sequence_parallel"] = section
    if opts.zero_stage is not None:
        ds.setdefault("zero_optimization", {})["stage"] = opts.zero_stage
    if opts.micro_batch is not None:
        ds["train_micro_batch_size_per_gpu"] = opts.micro_batch
    if opts.lr is not None:
        ds.setdefault("optimizer", {}).setdefault("params", {})["lr"] = opts.lr
        _scale_scheduler(ds.get("scheduler"), opts.lr)
    if opts.no_wandb:
        ds.pop("wandb", None)
    if opts.resume_universal:
        ds["checkpoint"] = dict(ds.get("checkpoint", {}), load_universal=True)
    batch_keys(ds, documents=bool(getattr(opts, "lengths", None)))
    return ds


def batch_keys(ds: dict, documents: bool) -> None:
    """DeepSpeed's batch keys, filled or refused by name here (DeepSpeed would stop every rank with a bare
    assertion). With --lengths the job builds every micro-batch from documents and marks the accumulation
    boundary itself (the tokens per step set the batch), so a missing micro batch is filled with 1 and a
    train_batch_size, which would fix a number of rows per step, is refused. Without it rows of --seq_len
    tokens need a micro batch: given, or derived by DeepSpeed from train_batch_size."""
    micro, total = ds.get("train_micro_batch_size_per_gpu"), ds.get("train_batch_size")
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("train_batch_size", total),
                       ("gradient_accumulation_steps", ds.get("gradient_accumulation_steps"))):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise TrainConfigError(f'DeepSpeed config "{key}": {value!r} is not a whole number >= 1')
    if documents:
        if total is not None:
            raise TrainConfigError(f'DeepSpeed config "train_batch_size": {total} with --lengths: the job draws '
                                   f"documents up to --tokens_per_step tokens per step and packs them itself, so a "
                                   f"number of rows per step means nothing there; remove train_batch_size (and set "
                                   f"the tokens per step with --tokens_per_step)")
        ds.setdefault("train_micro_batch_size_per_gpu", 1)
        return
    if micro is None and total is None:
        raise TrainConfigError('DeepSpeed config: neither "train_micro_batch_size_per_gpu" nor "train_batch_size" is '
                               'given; the main job trains rows of --seq_len tokens, so say how many per rank: add '
                               '"train_micro_batch_size_per_gpu": 2 (or pass --micro_batch 2)')


# DeepSpeed's schedulers that set the lr themselves, from these bounds (WarmupCosineLR scales the optimizer's
# own lr, so it follows --lr as it is); the first is the peak
SCHEDULER_BOUNDS = {"WarmupLR": ("warmup_max_lr", "warmup_min_lr"),
                    "WarmupDecayLR": ("warmup_max_lr", "warmup_min_lr"),
                    "OneCycle": ("cycle_max_lr", "cycle_min_lr"),
                    "LRRangeTest": ("lr_range_test_min_lr",)}


def _scale_scheduler(scheduler, lr: float) -> None:
    """--lr moves the scheduler's lr bounds with it (the peak becomes lr, the others keep their ratio to it):
    under a warmup scheduler the optimizer's lr alone is overwritten at the first step, so --lr would
    otherwise change nothing."""
    if not scheduler:
        return
    params = scheduler.get("params", {})
    names = [n for n in SCHEDULER_BOUNDS.get(scheduler.get("type"), ()) if n in params]
    if not names or not params[names[0]]:
        return
    peak = params[names[0]]
    for name in names:
        params[name] = params[name] * lr / peak


# The values transformers' Trainer fills where a config says "auto" (from its TrainingArguments), so one
# JSON serves both entry points (`ds-seqpar plan --out` writes these as "auto"): the main job fills them
# with its own defaults; --micro_batch and --lr still override.
AUTO_FILLED = {"train_micro_batch_size_per_gpu": DEFAULT_DS_CONFIG["train_micro_batch_size_per_gpu"],
               "gradient_accumulation_steps": DEFAULT_DS_CONFIG["gradient_accumulation_steps"],
               "gradient_clipping": DEFAULT_DS_CONFIG["gradient_clipping"],
               **{f"optimizer.params.{k}": DEFAULT_DS_CONFIG["optimizer"]["params"][k]
                  for k in ("lr", "betas", "eps", "weight_decay")}}


def fill_auto(ds: dict, where: str = "") -> None:
    """Replace the Trainer's "auto" values in place; any other "auto" is refused by its key."""
    for key, value in list(ds.items()):
        path = f"{where}{key}"
        if isinstance(value, dict):
            fill_auto(value, path + ".")
        elif value == "auto" and path in AUTO_FILLED:
            ds[key] = copy.deepcopy(AUTO_FILLED[path])
        elif value == "auto" and path == "train_batch_size":
            del ds[key]                     # DeepSpeed derives it: micro batch x accumulation x replicas
        elif value == "auto":
            raise TrainConfigError(f'DeepSpeed config "{path}": "auto" is filled by transformers\' Trainer; the '
                                   f"main job fills only {', '.join(sorted(AUTO_FILLED))}: give {path} a value")


# option -> (lowest valid, highest valid or None, what it is); None values are the options' "not given"
OPTION_RANGES = {"micro_batch": (1, None, "rows per rank per micro-batch"), "dim": (1, None, "the model width"),
                 "n_layers": (1, None, "layers"), "n_heads": (1, None, "attention heads"),
                 "n_kv_heads": (1, None, "key/value heads"), "mlp_hidden": (1, None, "the MLP width"),
                 "vocab_size": (2, None, "the vocabulary"), "corpus_bytes": (1, None, "bytes of the default corpus"),
                 "tokens_per_step": (1, None, "tokens per optimizer step"), "images": (0, None, "images per row"),
                 "save_interval": (0, None, "steps between checkpoints (0: none)"),
                 "master_port": (1, 65535, "a TCP port")}


def check_options(opts) -> None:
    """The options with a range of their own; each message names its option alone."""
    for name, (low, high, what) in OPTION_RANGES.items():
        value = getattr(opts, name, None)
        if value is not None and (value < low or (high is not None and value > high)):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise TrainConfigError(f"--{name}={value}: {what}, must be {span}")
    if opts.lr is not None and not (math.isfinite(opts.lr) and opts.lr > 0):
        raise TrainConfigError(f"--lr={opts.lr}: the learning rate must be a finite number > 0")
    if not 0.0 <= opts.ignore_frac < 1.0:
        raise TrainConfigError(f"--ignore_frac={opts.ignore_frac}: the fraction of ignored targets must be in [0, 1)")
    if getattr(opts, "images", 0):
        parse_grid(opts.image_grid)
    if opts.seq_len < 2:
        raise TrainConfigError(f"--seq_len={opts.seq_len} >= 2 does not hold: the global sequence length "
                               f"must be at least 2 tokens (the labels are the inputs shifted by one)")
    if opts.steps < 0:
        raise TrainConfigError(f"--steps={opts.steps} must be >= 0")
    if opts.nprocs < 1:
        raise TrainConfigError(f"--nprocs={opts.nprocs} must be >= 1")


def _number(value, low: float, integer: bool = False) -> bool:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    return ok_type and not isinstance(value, bool) and math.isfinite(value) and value >= low


def check_ds_keys(ds: dict) -> None:
    """The DeepSpeed keys the main job relies on, by type and range, so that a typo ends here with the key
    named and not in DeepSpeed's pydantic error or an assertion on every rank."""
    def refuse(key, value, want):
        raise TrainConfigError(f'DeepSpeed config "{key}": {value!r} is not valid; {want}')

    for key in ("zero_optimization", "optimizer", "scheduler", "bf16", "fp16", "wandb", "checkpoint"):
        if key in ds and not isinstance(ds[key], dict):
            refuse(key, ds[key], "it is a JSON object ({...})")
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if not _number(stage, 0, integer=True) or stage > 3:
        refuse("zero_optimization.stage", stage, "a ZeRO stage is 0, 1, 2 or 3")
    if "gradient_clipping" in ds and not _number(ds["gradient_clipping"], 0):
        refuse("gradient_clipping", ds["gradient_clipping"], "a number >= 0 (0: no clipping)")
    if "steps_per_print" in ds and not _number(ds["steps_per_print"], 1, integer=True):
        refuse("steps_per_print", ds["steps_per_print"], "a whole number >= 1")
    optimizer = ds.get("optimizer", {})
    if "type" in optimizer and not isinstance(optimizer["type"], str):
        refuse("optimizer.type", optimizer["type"], "a DeepSpeed optimizer name such as \"AdamW\"")
    lr = optimizer.get("params", {}).get("lr")
    if lr is not None and not (_number(lr, 0) and lr > 0):
        refuse("optimizer.params.lr", lr, "a finite number > 0")
    for key in ("bf16", "fp16", "wandb"):
        enabled = ds.get(key, {}).get("enabled")
        if enabled is not None and not isinstance(enabled, bool):
            refuse(f"{key}.enabled", enabled, "true or false")
    scheduler = ds.get("scheduler", {})
    for name in SCHEDULER_BOUNDS.get(scheduler.get("type"), ()):
        value = scheduler.get("params", {}).get(name)
        if value is not None and not _number(value, 0):
            refuse(f"scheduler.params.{name}", value, "a learning rate, a finite number >= 0")


def check_config(opts, world_size: Optional[int]) -> Tuple[dict, SequenceParallelConfig]:
    """The DeepSpeed config with overrides and its validated section, after the options' own checks;
    ``world_size`` (None: not known) against sequence_parallel.size."""
    check_options(opts)            # the options first: a bad --lr is named as --lr, not as the key it fills
    ds = build_ds_config(opts)
    check_ds_keys(ds)
    sp_cfg = SequenceParallelConfig.from_ds_config(ds)
    if world_size is not None and not sp_cfg.is_dynamic:     # dynamic groups: any world (schedule.group_sizes)
        sp_cfg.check_world(world_size)
    return ds, sp_cfg


def reports_errors(env: Mapping[str, str]) -> bool:
    """Whether this process says a configuration error that every rank finds alike: rank 0 of the
    job (local rank 0 of node 0), or a process no launcher started."""
    try:
        launch = launch_env.detect(env)
    except ConfigError:
        return True             # a launcher we cannot read: no rank is known, every process says it
    return launch is None or launch.rank == 0


# A quiet rank leaving at once could have its launcher (torchrun, deepspeed) stop rank 0 before rank 0,
# slower to start on a loaded machine, has said the error; it waits instead. The job still ends when
# rank 0 leaves: the launcher then stops the ranks still waiting.
QUIET_LINGER_S = 5.0


def say_config_error(err: Exception, env: Mapping[str, str]) -> int:
    """Rank 0 writes the error as one line (no traceback); every rank returns the same exit code."""
    if reports_errors(env):
        sys.stdout.flush()
        sys.stderr.write(f"ds_seqpar.train: error: {err}\n")
        sys.stderr.flush()
    elif int(env.get("WORLD_SIZE", "1")) > 1:
        time.sleep(QUIET_LINGER_S)
    return CONFIG_ERROR


def check(opts) -> Optional[int]:
    """None if the options and the config pass; else the exit code, after rank 0 said why."""
    try:
        launch = launch_env.detect(os.environ)
        check_config(opts, launch.world_size if launch is not None else opts.nprocs)
    except ConfigError as err:
        return say_config_error(err, os.environ)
    return None


__all__ = ["QUIET_LINGER_S", "build_ds_config", "check_options", "check_config", "reports_errors", "say_config_error", "check"]
