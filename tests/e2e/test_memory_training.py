"""End to end: training with every memory feature on (fused tiled loss, tiled MLP, checkpointing
of every layer with host offload) under every strategy at dp 2 x sp 2, ZeRO-2 and ZeRO-3, gives
the losses and gradient norms of plain data-parallel training, for the project's LM and for a
transformers Llama (--model); the shipped long_context.json trains; an unsupported
activation_checkpointing key stops every rank with one message.

Derived tolerance: a run's error against the float64 plain reference may be at most K times the
error of the float32 plain reference (plus a floor of 1e-7 relative, far below what a lost chunk,
a skipped recompute or a wrong gradient share would move: those change losses at 1e-3 or more).
"""
import functools
import json
import math
import os

import pytest
import torch

from ..reference import K
from ..train_reference import reference_losses
from .test_train_e2e import CONFIGS, SHIPPED, TINY, assert_refused_before_training, config_error_of, shipped_config

FLOOR = 1e-7
MEMORY = {"tiled_loss_tokens": 8, "tiled_mlp_tokens": 8}     # 64 local tokens per rank: 8 chunks


def _train(args):
    from ds_seqpar.train import run_training
    return run_training(args)


def with_memory_features(ds):
    ds = json.loads(json.dumps(ds))
    ds["sequence_parallel"].update(MEMORY)
    ds["activation_checkpointing"] = {"cpu_checkpointing": True}
    return ds


@functools.lru_cache(maxsize=None)
def _references(name, dp_size):
    """(float64 reference, float32 reference): losses per replica per step, gradient norms."""
    args = dict(TINY, deepspeed_config=shipped_config(name))
    return reference_losses(args, dp_size, torch.float64), reference_losses(args, dp_size, torch.float32)


def _rel(a, b):
    return abs(a - b) / abs(b)


def assert_derived(got, ref64, ref32, what, quantity):
    plain = max(_rel(p, r) for p, r in zip(ref32, ref64))
    bound = K * plain + FLOOR
    for i, (g, r) in enumerate(zip(got, ref64)):
        assert math.isfinite(g) and _rel(g, r) <= bound, \
            (f"{what}: step {i + 1} {quantity} {g!r} vs float64 plain data parallel {r!r}: rel {_rel(g, r):.2e} > "
             f"derived bound {bound:.2e} (float32 plain error {plain:.2e}, K={K})")


def check_against_reference(results, name, sp_size, what):
    dp_size = len(results) // sp_size
    (loss64, norm64), (loss32, norm32) = _references(name, dp_size)
    for r in results:
        who = f"{what} rank {r['rank']} (dp_rank {r['dp_rank']}, sp_rank {r['sp_rank']})"
        d = r["dp_rank"]
        assert len(r["losses"]) == len(loss64[d]), (who, r["losses"])
        assert_derived(r["losses"], loss64[d], loss32[d], who, "loss")
        assert_derived(r["grad_norms"], norm64, norm32, who, "gradient norm")


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", SHIPPED)
def test_memory_features_train_like_plain_data_parallel(pool, tmp_path, name, stage):
    ds = with_memory_features(shipped_config(name))
    ds["zero_optimization"]["stage"] = stage
    results = pool.run(_train, dict(TINY, deepspeed_config=ds, run_dir=str(tmp_path)))
    check_against_reference(results, name, ds["sequence_parallel"]["size"], f"{name} ZeRO-{stage} + memory")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from ..hf_models import save_tiny
    return save_tiny(tmp_path_factory.mktemp("hf_models") / "llama", "llama", seed=5, vocab_size=256)


@functools.lru_cache(maxsize=None)
def _hf_references(model_dir, name, dp_size):
    args = dict(TINY, model=model_dir, deepspeed_config=shipped_config(name))
    return reference_losses(args, dp_size, torch.float64), reference_losses(args, dp_size, torch.float32)


@pytest.mark.parametrize("name,stage", [("ulysses", 2), ("ring", 3), ("zigzag", 2), ("zigzag", 3), ("striped", 2),
                                        ("hybrid", 3)])
def test_hf_llama_with_memory_features_trains_like_plain_data_parallel(pool, tmp_path, llama_dir, name, stage):
    """--model: a transformers Llama with ds_seqpar attention, its MLPs tiled, its layers checkpointed
    through activation_checkpointing_enable, the fused tiled loss; every strategy, ZeRO-2 and ZeRO-3."""
    from .test_hf_train import HF_TINY
    ds = with_memory_features(shipped_config(name))
    ds["zero_optimization"]["stage"] = stage
    results = pool.run(_train, dict(HF_TINY, model=llama_dir, deepspeed_config=ds, run_dir=str(tmp_path)))
    dp_size = len(results) // ds["sequence_parallel"]["size"]
    (loss64, norm64), (loss32, norm32) = _hf_references(llama_dir, name, dp_size)
    for r in results:
        who = f"--model llama {name} ZeRO-{stage} + memory rank {r['rank']} (dp_rank {r['dp_rank']})"
        assert_derived(r["losses"], loss64[r["dp_rank"]], loss32[r["dp_rank"]], who, "loss")
        assert_derived(r["grad_norms"], norm64, norm32, who, "gradient norm")


def test_shipped_long_context_config_trains(pool, tmp_path):
    with open(os.path.join(CONFIGS, "long_context.json")) as f:
        ds = json.load(f)
    assert ds["sequence_parallel"]["strategy"] == "zigzag" and ds["activation_checkpointing"]["cpu_checkpointing"]
    assert ds["sequence_parallel"]["tiled_loss_tokens"] > 0 and ds["sequence_parallel"]["tiled_mlp_tokens"] > 0
    # the shipped chunk sizes, brought down to the tiny run so that every feature cuts several chunks
    ds["sequence_parallel"].update(MEMORY)
    ds["train_micro_batch_size_per_gpu"] = shipped_config("zigzag")["train_micro_batch_size_per_gpu"]
    results = pool.run(_train, dict(TINY, deepspeed_config=ds, run_dir=str(tmp_path)))
    check_against_reference(results, "zigzag", 2, "long_context.json")


def test_unsupported_checkpointing_key_stops_every_rank(pool, tmp_path):
    ds = shipped_config("zigzag")
    ds["activation_checkpointing"] = {"partition_activations": True}
    messages = pool.run(config_error_of, dict(TINY, deepspeed_config=ds, run_dir=str(tmp_path)))
    assert_refused_before_training(messages, "activation_checkpointing.partition_activations=True is not supported",
                                   tmp_path)
