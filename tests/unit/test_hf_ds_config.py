"""Where SequenceParallelTrainer finds the DeepSpeed config (hf/ds_config.py): TrainingArguments'
deepspeed=, or accelerate's DeepSpeed plugin when ``accelerate launch`` named the file in its YAML."""
import json
import os

import pytest

from ds_seqpar.config import ConfigError
from ds_seqpar.hf.ds_config import trainer_deepspeed_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
DS_JSON = os.path.join(ROOT, "configs", "trainer", "zigzag_zero2.json")


def arguments(tmp_path, **options):
    import transformers as T
    return T.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=2,
                               learning_rate=1e-3, use_cpu=True, report_to="none", **options)


def test_accelerates_plugin_config_is_filled_as_the_trainer_would(tmp_path, monkeypatch):
    # what `accelerate launch` with deepspeed_config_file in its YAML puts in each rank's environment
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", DS_JSON)
    targs = arguments(tmp_path)
    assert not targs.deepspeed and targs.deepspeed_plugin is not None
    ds = trainer_deepspeed_config(targs)
    assert ds["sequence_parallel"] == {"strategy": "zigzag", "size": 2}
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (3, 2)   # "auto" filled
    assert ds["optimizer"]["params"]["lr"] == 1e-3
    # the Trainer finds it filled on the arguments (and fills nothing twice); the plugin holds the same one
    assert targs.hf_deepspeed_config.config is ds and targs.deepspeed_plugin.deepspeed_config is ds
    assert trainer_deepspeed_config(targs) is ds


def test_deepspeed_argument_is_read_as_before(tmp_path):
    targs = arguments(tmp_path, deepspeed=DS_JSON)
    assert trainer_deepspeed_config(targs) is targs.hf_deepspeed_config.config
    with open(DS_JSON) as f:
        assert trainer_deepspeed_config(targs)["sequence_parallel"] == json.load(f)["sequence_parallel"]


def test_no_deepspeed_config_names_both_ways(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    with pytest.raises(ConfigError, match=r"deepspeed='ds.json'.*accelerate launch --config_file"):
        trainer_deepspeed_config(arguments(tmp_path))
