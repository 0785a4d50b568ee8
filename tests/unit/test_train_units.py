"""Pieces of the main job that need no processes: configs, options, data, ZeRO config checks, model, cli."""
import glob
import json
import os

import numpy as np
import pytest
import torch

from ds_seqpar import ConfigError, SequenceParallelConfig
from ds_seqpar import cli
from ds_seqpar.train import data
from ds_seqpar.models import CausalLM, ModelConfig
from ds_seqpar.train.args import DEFAULT_DS_CONFIG, TrainConfigError, resolve_args
from ds_seqpar.zero import check_ds_config

CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "configs")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS, "*.json"))), ids=os.path.basename)
def test_shipped_configs_are_valid_fp32_zero_configs(path):
    with open(path) as f:
        ds = json.load(f)
    cfg = SequenceParallelConfig.from_ds_config(ds)
    assert ds["zero_optimization"]["stage"] in (1, 2, 3)
    assert "fp16" not in ds and "bf16" not in ds, "CPU default is fp32"
    name = os.path.basename(path).split("_")[0]
    assert name == ("hybrid" if cfg.is_hybrid else cfg.strategy), (name, cfg)


def test_default_config_is_the_readme_config():
    with open(os.path.join(CONFIGS, "zigzag_zero2.json")) as f:
        assert json.load(f) == DEFAULT_DS_CONFIG


def test_unknown_training_option_is_an_error():
    with pytest.raises(TrainConfigError, match="unknown training options \\['stpes'\\]"):
        resolve_args({"stpes": 3})


@pytest.mark.parametrize("batch,want", [({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                          "gradient_accumulation_steps": 1}, 8),
                                        ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2}, 8),
                                        ({"train_batch_size": 6}, 4)], ids=["all-three", "micro", "batch-only"])
def test_train_batch_size_that_counts_ranks_is_refused_with_the_replica_count(batch, want):
    """world 8 = dp 4 x sp 2: the batch counts the 4 replicas (the 2 ranks of a sequence share it)."""
    refused = rf"train_batch_size=\d+ does not fit 4 data-parallel replicas.*e\.g\. {want}\)"
    with pytest.raises(ConfigError, match=refused):
        check_ds_config(batch, sp_size=2, dp_size=4)
    check_ds_config(dict(batch, train_batch_size=want), sp_size=2, dp_size=4)
    check_ds_config(dict(batch, train_batch_size="auto"), sp_size=2, dp_size=4)


def test_deepspeed_device_mesh_is_refused():
    with pytest.raises(ConfigError, match="remove data_parallel_size"):
        check_ds_config({"sequence_parallel_size": 2, "data_parallel_size": 2}, sp_size=2, dp_size=2)


def test_batches_depend_only_on_step_and_replicas_differ():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = data.batch_for_step(tokens, 7, 0, 0, 2, 3, 32, ignore_frac=0.3)
    b = data.batch_for_step(tokens, 7, 0, 0, 2, 3, 32, ignore_frac=0.3)
    other = data.batch_for_step(tokens, 7, 0, 1, 2, 3, 32)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert not set(a["input_ids"][:, 0].tolist()) & set(other["input_ids"][:, 0].tolist())
    assert (a["labels"] == data.IGNORE_INDEX).any() and a["input_ids"].dtype == torch.int64


def test_stdlib_corpus_is_deterministic_bytes():
    a, b = data.stdlib_corpus(1 << 16), data.stdlib_corpus(1 << 16)
    assert a.size == 1 << 16 and np.array_equal(a, b) and data.fingerprint(a) == data.fingerprint(b)
    assert data.vocab_size_of(a, None) == 256


def test_token_file_is_memory_mapped(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(300, dtype=np.uint32).tofile(path)
    tokens = data.token_file(str(path), "uint32")
    assert isinstance(tokens, np.memmap) and tokens[299] == 299 and data.vocab_size_of(tokens, None) == 300
    with pytest.raises(ValueError, match="choose one of: uint16, uint32"):
        data.token_file(str(path), "int8")


@pytest.mark.parametrize("attention,kv,tied", [("softmax", 2, True), ("linear", 4, False)])
def test_model_runs_on_one_process_and_is_causal(attention, kv, tied):
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=kv,
                                 attention=attention, tie_embeddings=tied))
    ids = torch.randint(0, 50, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    logits = model(ids, pos)
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 50
    assert logits.shape == (2, 16, 50)
    torch.testing.assert_close(model(changed, pos)[:, :10], logits[:, :10], msg="a future token leaked")
    assert (model.lm_head.weight is model.embed.weight) == tied


def test_model_config_errors_name_the_option():
    with pytest.raises(ValueError, match="--dim=30 must be divisible by --n_heads=4"):
        ModelConfig(dim=30, n_heads=4)


def test_cli_lists_commands_and_rejects_unknown(capsys):
    assert cli.main([]) == 0 and "train" in capsys.readouterr().out
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err


def test_linear_attention_decay_survives_bf16_cast():
    model = CausalLM(ModelConfig(dim=32, n_layers=1, n_heads=8, n_kv_heads=8, mlp_hidden=64, attention="linear"),
                     sp=None).bfloat16()
    decay = model.blocks[0].attn.decay_h()
    assert decay.dtype == torch.float32 and bool((decay < 1).all()), decay
