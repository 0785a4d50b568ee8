"""End to end: sequence x data parallel training with ZeRO 1/2/3 == plain data-parallel training,
for every registered strategy, on the 4-rank pool; plus checkpoint resume and bad configs.

The training job follows the plain recipe: SequenceParallel.from_ds_config, then
deepspeed.initialize(model=..., model_parameters=..., config=..., mpu=sp.mpu), nothing else."""
import functools
import json
import math
import os

import pytest

from ds_seqpar import STRATEGIES

from ..train_reference import reference_losses

CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "configs")
REL = 1e-5
NORM_REL = 1e-4      # a gradient norm sums many squares in fp32: looser than the loss, far below any bug
TINY = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "seq_len": 64, "steps": 3,
        "ignore_frac": 0.25, "corpus_bytes": 1 << 18, "quiet": True, "no_wandb": True}


# every registered strategy, and the 2D hybrid (a ring strategy with ulysses_size > 1)
SHIPPED = sorted(STRATEGIES) + ["hybrid"]


def shipped_config(name):
    """configs/<name>_zero2.json: the tests train with the configs users get."""
    path = os.path.join(CONFIGS, f"{name}_zero2.json")
    assert os.path.exists(path), f"strategy {name!r} is shipped but {path} is missing"
    with open(path) as f:
        return json.load(f)


def _train(args):
    from ds_seqpar.train import run_training
    return run_training(args)


def _zero_init_model(model_cfg, sp, ds_config):
    """As Hugging Face's from_pretrained under ZeRO-3: built under deepspeed.zero.Init over the
    world (no group, no mpu), then the initial weights loaded into the partitioned parameters."""
    import deepspeed
    from ds_seqpar.models import CausalLM
    weights = CausalLM(model_cfg, sp).state_dict()       # the seeded plain init plays the checkpoint
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = CausalLM(model_cfg, sp)
    params = dict(model.named_parameters())
    assert all(p.ds_numel > p.ds_tensor.numel() for p in params.values()), "zero.Init did not partition"
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
        for name, p in params.items():
            p.data.copy_(weights[name])
    return model


def _train_zero_init(args):
    from ds_seqpar.train import run_training
    return run_training(args, model_factory=_zero_init_model)


@functools.lru_cache(maxsize=None)
def _reference(name, dp_size):
    return reference_losses(dict(TINY, deepspeed_config=shipped_config(name)), dp_size)


def assert_close_losses(got, want, what, rel=REL, quantity="loss"):
    assert len(got) == len(want), f"{what}: {len(got)} values, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        err = abs(g - w) / abs(w)
        assert math.isfinite(g) and err <= rel, \
            f"{what}: step {i + 1} {quantity} {g!r} != plain data-parallel {w!r} (rel {err:.2e} > {rel})"


@pytest.mark.parametrize("name", ["ulysses", "zigzag"])
def test_any_sequence_length_is_padded_exactly(pool, tmp_path, name):
    """61 tokens: the layout pads to 62 / 64 at the end; losses equal plain training on 61."""
    args = dict(TINY, seq_len=61)
    ref, _ = reference_losses(dict(args, deepspeed_config=shipped_config(name)), 2)
    results = pool.run(_train, dict(args, deepspeed_config=shipped_config(name), run_dir=str(tmp_path)))
    for r in results:
        assert_close_losses(r["losses"], ref[r["dp_rank"]], f"{name} seq_len=61 rank {r['rank']}")


@pytest.mark.parametrize("stage,build", [(1, _train), (2, _train), (3, _train), (3, _train_zero_init)],
                         ids=["zero1", "zero2", "zero3", "zero3-zero.Init"])
@pytest.mark.parametrize("name", SHIPPED)
def test_sequence_x_data_parallel_matches_plain_data_parallel(pool, tmp_path, name, stage, build):
    """The plain recipe, the model built whole or (ZeRO-3) under zero.Init over the world as
    Hugging Face builds it: the losses AND the gradient norms of plain data parallelism."""
    ds = shipped_config(name)
    ds["zero_optimization"]["stage"] = stage
    if build is _train_zero_init:
        # a Hugging Face config states the batch; zero.Init (no mpu) then counts replicas only
        # through DeepSpeed's sequence_parallel_size
        ds["sequence_parallel_size"] = ds["sequence_parallel"]["size"]
        replicas = pool.world_size // ds["sequence_parallel"]["size"]
        ds["train_batch_size"] = ds["train_micro_batch_size_per_gpu"] * replicas
    results = pool.run(build, dict(TINY, deepspeed_config=ds, run_dir=str(tmp_path)))
    sp_size = ds["sequence_parallel"]["size"]
    dp_size = len(results) // sp_size
    ref, ref_norms = _reference(name, dp_size)
    for r in results:
        what = f"{name} ZeRO-{stage} rank {r['rank']} (dp_rank {r['dp_rank']}, sp_rank {r['sp_rank']})"
        assert_close_losses(r["losses"], ref[r["dp_rank"]], what)
        # Adam hides a constant gradient factor from the losses; the norm does not
        assert_close_losses(r["grad_norms"], ref_norms, what, NORM_REL, "gradient norm")
        peer = results[r["dp_rank"] * sp_size]      # sp_rank 0 of the same sequence group
        assert r["losses"] == peer["losses"], f"{what}: loss differs from its sequence group's rank 0"
    with open(results[0]["metrics_path"]) as f:
        logged = [json.loads(line) for line in f]
    assert [m["step"] for m in logged] == [1, 2, 3], logged
    mean_ref = [sum(c) / dp_size for c in zip(*ref)]
    assert_close_losses([m["loss"] for m in logged], mean_ref, f"{name} logged mean over replicas")


def test_gradient_accumulation_and_clipping_match_plain_data_parallel(pool, tmp_path):
    """Where DeepSpeed draws the line, once each under ZeRO-3: 2 accumulated micro-batches per
    step, and clipping active at every step: the clip norm is the global norm over data x sequence
    ranks, equal to plain data parallelism's (the batch arithmetic: tests/dist/test_deepspeed_mpu.py)."""
    ds = shipped_config("ulysses")
    ds["gradient_accumulation_steps"] = 2
    ds["zero_optimization"]["stage"] = 3
    results = pool.run(_train, dict(TINY, deepspeed_config=ds, run_dir=str(tmp_path)))
    ref, ref_norms = reference_losses(dict(TINY, deepspeed_config=ds), 2)
    assert min(ref_norms) > ds["gradient_clipping"], f"clipping must act at every step: norms {ref_norms}"
    for r in results:
        assert_close_losses(r["losses"], ref[r["dp_rank"]], f"accumulation rank {r['rank']}")
        assert_close_losses(r["grad_norms"], ref_norms, f"accumulation rank {r['rank']}", NORM_REL, "gradient norm")


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_resume_reproduces_losses(pool, tmp_path, stage):
    ds = shipped_config("ulysses")
    ds["zero_optimization"]["stage"] = stage
    base = dict(TINY, deepspeed_config=ds, steps=4, run_dir=str(tmp_path / "runs"))
    save = str(tmp_path / "ckpt")
    whole = pool.run(_train, base)
    first = pool.run(_train, dict(base, steps=2, save_dir=save, save_interval=2))
    resumed = pool.run(_train, dict(base, save_dir=save, resume=True))
    for w, f, r in zip(whole, first, resumed):
        assert r["start_step"] == 2, r
        assert f["losses"] == w["losses"][:2], (f["losses"], w["losses"])
        assert_close_losses(r["losses"], w["losses"][2:], f"rank {r['rank']} resumed at step 2")


def _train_with_a_slow_saver(args):
    """The main job with every rank but 0 writing its ZeRO files a second late: what ``latest`` named when rank 1
    was about to write its own files (a rank killed then leaves only what was written before)."""
    import time
    from unittest import mock

    from deepspeed.runtime.engine import DeepSpeedEngine

    from ds_seqpar import comm
    from ds_seqpar.train import run_training
    real, seen = DeepSpeedEngine._save_zero_checkpoint, []

    def slow(engine, save_dir, tag):
        if comm.global_rank() != 0:
            time.sleep(1.0)
            seen.append((tag, _read(os.path.join(save_dir, "latest"))))
        return real(engine, save_dir, tag)

    with mock.patch.object(DeepSpeedEngine, "_save_zero_checkpoint", slow):
        run_training(args)
    return seen


def _read(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


def test_latest_names_a_checkpoint_only_once_every_rank_wrote_it(pool, tmp_path):
    """A rank killed while saving must not leave ``latest`` naming a tag without its files (--resume would fail on
    the missing optimizer partition): while rank 1-3 have not written theirs, ``latest`` names the previous tag."""
    ds = shipped_config("zigzag")
    save = str(tmp_path / "ckpt")
    seen = pool.run(_train_with_a_slow_saver, dict(TINY, deepspeed_config=ds, steps=2, run_dir=str(tmp_path / "runs"),
                                                   save_dir=save, save_interval=1))
    for rank, rows in enumerate(seen[1:], start=1):
        assert rows == [("step1", None), ("step2", "step1")], f"rank {rank}: (saving, latest) {rows}"
    assert _read(os.path.join(save, "latest")) == "step2"


BAD = [
    ({"strategy": "foo"}, "sequence_parallel.strategy='foo' is not valid"),
    ({"sp_size": 3}, "sequence_parallel.size=3 does not divide the world size 4"),
    ({"seq_len": 1}, "--seq_len=1 >= 2"),
    ({"n_heads": 3, "dim": 48, "n_kv_heads": None}, "3 q heads are not divisible by 2"),
]


def config_error_of(args):
    """On every rank: the ConfigError's message that stops ``run_training(args)``."""
    from ds_seqpar import ConfigError
    from ds_seqpar.train import run_training
    try:
        run_training(args)
    except ConfigError as err:
        return str(err)
    return "trained without error"


def assert_refused_before_training(messages, expected, run_dir):
    """Every rank stopped with the same message, naming ``expected``, and no run directory was
    written (the refusal came before training started)."""
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"
    assert expected in messages[0], messages[0]
    assert not os.path.exists(run_dir) or not os.listdir(run_dir), \
        "a run directory was created: the error came after training started"


@pytest.mark.parametrize("override,expected", BAD, ids=["strategy", "size", "seq_len", "heads"])
def test_bad_config_stops_every_rank_with_one_message(pool, tmp_path, override, expected):
    args = dict(TINY, deepspeed_config=shipped_config("ulysses"), run_dir=str(tmp_path), **override)
    assert_refused_before_training(pool.run(config_error_of, args), expected, tmp_path)
