"""The Trainer's wandb run as the dashboard reads it (docs/dashboards.md): one run per job, named and
grouped by model, strategy and size as the main job's runs are, with the same config keys
(strategy, sp_size, dp_size, world_size, model_name) beside the sequence_parallel section."""
from __future__ import annotations

import os
import sys
import time
from typing import Optional


def model_name(model) -> str:
    """The model's name for run names and groups: its directory or hub id, else its model_type."""
    config = getattr(model, "config", None)
    path = str(getattr(config, "name_or_path", "") or "").rstrip("/")
    return os.path.basename(path) or str(getattr(config, "model_type", None) or type(model).__name__)


def one_wandb_run(targs, sp=None, model=None) -> Optional[str]:
    """One wandb run per job: the Trainer's (its metrics, plus ours from ``log``). DeepSpeed's own "wandb"
    block would start a second run from DeepSpeed's monitor, logging the loss as each rank's engine sees
    it (scaled by the world size for the Trainer's token-count normalisation); it is switched off and
    the Trainer reports to wandb instead, under the block's project, team and group (WANDB_PROJECT,
    WANDB_ENTITY, WANDB_RUN_GROUP, unless already set). With sequence parallelism, a run reporting to wandb
    without a group or a run_name of its own is grouped and named by model, strategy and size; the group
    set here is returned, for run_config_callback to unset once the run has started (a process that
    trains several configurations, a test or benchmark pool, must not reuse it)."""
    from .ds_config import trainer_deepspeed_config
    ds = trainer_deepspeed_config(targs)
    block = ds.get("wandb") or {}
    if block.get("enabled"):
        block["enabled"] = False
        for key, env in (("project", "WANDB_PROJECT"), ("team", "WANDB_ENTITY"), ("group", "WANDB_RUN_GROUP")):
            if block.get(key):
                os.environ.setdefault(env, str(block[key]))
        report = [r for r in (targs.report_to or []) if r != "none"]
        targs.report_to = report + ([] if "wandb" in report or "all" in report else ["wandb"])
    if sp is None or not {"wandb", "all"} & set(targs.report_to or []):
        return None
    group = f"{model_name(model)}-{sp.config.strategy}-sp{sp.size}"
    if targs.run_name is None:
        targs.run_name = f"{group}-dp{sp.dp_size}-{time.strftime('%Y%m%d-%H%M%S')}"
    if "WANDB_RUN_GROUP" in os.environ:
        return None
    os.environ["WANDB_RUN_GROUP"] = group
    return group


def run_config_callback(sp, model, group_set: Optional[str] = None):
    """A callback that puts the sequence_parallel section and the main job's config keys in the wandb
    run's config (the run the Trainer's WandbCallback starts, or one the user started), and unsets the
    group one_wandb_run set (WandbCallback, before it, has started the run by then)."""
    from transformers import TrainerCallback
    from .. import comm
    config = {"sequence_parallel": sp.config.model_dump(), "strategy": sp.config.strategy, "sp_size": sp.size,
              "dp_size": sp.dp_size, "world_size": comm.world_size(), "model_name": model_name(model)}

    class RunConfig(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if group_set is not None and os.environ.get("WANDB_RUN_GROUP") == group_set:
                del os.environ["WANDB_RUN_GROUP"]
            wandb = sys.modules.get("wandb")
            if state.is_world_process_zero and getattr(wandb, "run", None) is not None:
                wandb.config.update(config, allow_val_change=True)
    return RunConfig()


__all__ = ["model_name", "one_wandb_run", "run_config_callback"]
