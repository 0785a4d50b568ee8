"""The DeepSpeed config a Trainer will hand DeepSpeed, wherever the user put it:

  * ``TrainingArguments(deepspeed="ds.json")`` (or ``--deepspeed ds.json``): transformers reads it when
    the arguments are built and fills its "auto" values from them (``args.hf_deepspeed_config``);
  * ``accelerate launch --config_file acc.yaml`` with ``deepspeed_config_file: ds.json`` in the YAML's
    ``deepspeed_config``: accelerate's DeepSpeed plugin holds the file (``args.deepspeed_plugin``) and
    the Trainer fills its "auto" values only inside ``Trainer.__init__``. The sequence-parallel mixin
    needs the filled config before that (the mesh, the batch size), so it fills it here, as the Trainer
    would, and keeps it on the arguments, where the Trainer then finds it and fills nothing twice.
"""
from __future__ import annotations

from ..config import ConfigError


def trainer_deepspeed_config(targs) -> dict:
    """The filled DeepSpeed config of these TrainingArguments (the object the Trainer passes on)."""
    if targs is not None and getattr(targs, "deepspeed", None):
        return targs.hf_deepspeed_config.config
    plugin = getattr(targs, "deepspeed_plugin", None)
    if plugin is None:
        raise ConfigError("ds_seqpar.hf: SequenceParallelTrainer reads the strategy from the DeepSpeed config: pass "
                          "TrainingArguments(..., deepspeed='ds.json') (or --deepspeed ds.json), or launch with "
                          "`accelerate launch --config_file acc.yaml` whose deepspeed_config names "
                          "deepspeed_config_file: ds.json")
    if getattr(targs, "hf_deepspeed_config", None) is None:
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
        filled = HfTrainerDeepSpeedConfig(plugin.hf_ds_config.config)
        filled.trainer_config_process(targs)
        plugin.hf_ds_config, plugin.deepspeed_config = filled, filled.config
        targs.hf_deepspeed_config = filled
    return targs.hf_deepspeed_config.config


__all__ = ["trainer_deepspeed_config"]
