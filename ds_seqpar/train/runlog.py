"""Where a training run's numbers go: runs/<name>/run.json + metrics.jsonl (always, rank 0) and
wandb (when the DeepSpeed config's own "wandb" block enables it).

DeepSpeed's WandbMonitor calls ``wandb.init(project, group, entity)`` inside
``deepspeed.initialize`` on global rank 0 and nothing else, so the run's name, directory, tags and
default group are handed over through wandb's environment variables before that call (and put
back afterwards: a test process may train several times). ds_seqpar then adds its config and
per-step metrics to that same run, logged at ``engine.global_samples``, the step DeepSpeed's own
Train/Samples/* events use: wandb drops any row logged at a smaller step than the last one.

The JSON-lines log needs no wandb: ``report`` tools read metrics.jsonl directly.
"""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from typing import Optional

from ..launch import hosts
from ..launch.env import restored_environ


def model_name(opts) -> str:
    """The model in run names, groups and the run config: --model's file or directory name, or the
    built-in LM's depth and width."""
    if opts.model:
        return os.path.splitext(os.path.basename(os.path.normpath(opts.model)))[0]
    return f"lm-l{opts.n_layers}-d{opts.dim}"


def run_name(model: str, strategy: str, sp_size: int, dp_size: int, seq_len: int, given: Optional[str] = None) -> str:
    return given or f"{run_group(model, strategy, sp_size, seq_len)}-dp{dp_size}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_group(model: str, strategy: str, sp_size: int, seq_len: int) -> str:
    """Runs that differ only in seed/date land in one wandb group: same model, strategy, size and length."""
    return f"{model}-{strategy}-sp{sp_size}-n{seq_len}"


def machine() -> dict:
    """The writer's host as the run started: name, cores, 1-minute load (a loaded machine's timings
    are not comparable; `ds-seqpar report` warns about them)."""
    import socket
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "load_1min_start": os.getloadavg()[0]}


def unique_dir(root: str, name: str) -> str:
    path, i = os.path.join(root, name), 1
    while os.path.exists(path):
        path, i = os.path.join(root, f"{name}-{i}"), i + 1
    os.makedirs(path)
    return path


class RunLog:
    """run.json (config, once) and metrics.jsonl (one JSON object per step), on the writer rank."""

    def __init__(self, run_dir: Optional[str]):
        self.run_dir = os.path.abspath(run_dir) if run_dir else None
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl") if run_dir else None

    def write_config(self, config: dict) -> None:
        if self.run_dir:
            # every rank's host and address, as gathered at start (several hosts: where each rank ran)
            config = dict(config, hosts=hosts.known(), machine=machine())
            with open(os.path.join(self.run_dir, "run.json"), "w") as f:
                json.dump(config, f, indent=2, sort_keys=True, default=str)

    def log(self, record: dict) -> None:
        if self.metrics_path:
            # one line per step, flushed: a crashed or killed run keeps everything logged so far
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")


def wandb_mode() -> str:
    """WANDB_MODE when set; else online with credentials in the environment, offline without them
    (no credentials, or no network: log locally, `wandb sync` later). The benchmark uses it too."""
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


@contextmanager
def wandb_env(enabled: bool, name: str, group: str, tags: list, run_dir: Optional[str]):
    """Environment that names DeepSpeed's wandb.init; restored on exit."""
    with restored_environ("WANDB_NAME", "WANDB_DIR", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_MODE"):
        if enabled and run_dir:
            os.environ.update(WANDB_NAME=name, WANDB_DIR=os.path.abspath(run_dir), WANDB_TAGS=",".join(tags))
            os.environ.setdefault("WANDB_RUN_GROUP", group)   # the config's "group" wins when given
            if wandb_mode() == "offline":
                os.environ["WANDB_MODE"] = "offline"
        yield


def _started_wandb():
    """wandb if this process imported it (DeepSpeed's wandb monitor does, to start a run), else None: a run
    with wandb off does not pay its import (a second per rank)."""
    return sys.modules.get("wandb")


def attach_wandb(config: dict) -> Optional[str]:
    """Add our config to the run DeepSpeed started; return the run directory (None: no run)."""
    wandb = _started_wandb()
    if wandb is None or wandb.run is None:
        return None
    wandb.run.config.update(config, allow_val_change=True)
    wandb.define_metric("train/*", step_metric="train/step")
    return os.path.dirname(wandb.run.dir)


def wandb_log(metrics: dict, step: int) -> None:
    import wandb
    if wandb.run is not None:
        wandb.log({f"train/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)


def wandb_offline() -> bool:
    import wandb
    return wandb.run is not None and bool(wandb.run.offline)


def wandb_finish() -> None:
    wandb = _started_wandb()
    if wandb is not None and wandb.run is not None:
        wandb.finish()


__all__ = ["RunLog", "model_name", "run_name", "run_group", "unique_dir", "wandb_env", "attach_wandb", "wandb_log",
           "wandb_offline", "wandb_finish"]
