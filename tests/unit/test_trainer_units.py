"""The Trainer mixin's pure pieces (no processes): what it refuses and how it treats padding."""
import pytest
import torch

from ds_seqpar.config import ConfigError
from ds_seqpar.hf.trainer import (_refuse_inexact, _refuse_unverified_eval, _refuse_unverified_loss, drop_right_padding,
                                  sequence_parallel)


def test_right_padding_is_dropped_and_left_padding_refused():
    batch = {"input_ids": torch.ones(2, 5), "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    drop_right_padding(batch)
    assert "attention_mask" not in batch
    left = {"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    with pytest.raises(ConfigError, match="left or inner padding"):
        drop_right_padding(left)
    inner = {"attention_mask": torch.tensor([[1, 0, 1]])}
    with pytest.raises(ConfigError, match="left or inner padding"):
        drop_right_padding(inner)


def test_options_that_cannot_be_exact_are_refused_by_name():
    from types import SimpleNamespace
    ok = SimpleNamespace(label_smoothing_factor=0.0, average_tokens_across_devices=True)
    _refuse_inexact(ok, {})
    cases = [(dict(label_smoothing_factor=0.1), {}, "label_smoothing_factor=0.1"),
             (dict(average_tokens_across_devices=False), {}, "average_tokens_across_devices=False"),
             ({}, {"compute_loss_func": lambda *a: 0}, "compute_loss_func"),
             ({}, {"model_init": lambda: None}, "model_init")]
    for args, kwargs, name in cases:
        with pytest.raises(ConfigError, match=name):
            _refuse_inexact(SimpleNamespace(**dict(vars(ok), **args)), kwargs)


def test_predict_with_generate_is_refused_where_not_verified():
    """Seq2SeqTrainer's predict_with_generate runs (tests/dist/test_trainer_generate.py) except beam search and
    ZeRO-3; the Trainer's own prediction_step ignores the flag (as plain transformers does)."""
    from types import SimpleNamespace
    from ds_seqpar.hf.trainer_generate import refuse_inexact
    zero2, zero3 = {"zero_optimization": {"stage": 2}}, {"zero_optimization": {"stage": 3}}
    greedy = SimpleNamespace(predict_with_generate=True, generation_num_beams=None)
    refuse_inexact(greedy, zero2, "Seq2SeqTrainer")
    refuse_inexact(greedy, zero3, "Trainer")
    refuse_inexact(SimpleNamespace(predict_with_generate=False, generation_num_beams=4), zero3, "Seq2SeqTrainer")
    with pytest.raises(ConfigError, match="generation_num_beams=4"):
        refuse_inexact(SimpleNamespace(predict_with_generate=True, generation_num_beams=4), zero2, "Seq2SeqTrainer")
    with pytest.raises(ConfigError, match="zero_optimization.stage=3"):
        refuse_inexact(greedy, zero3, "Seq2SeqTrainer")


def test_trainers_with_their_own_loss_are_refused_until_verified():
    import transformers
    _refuse_unverified_loss(sequence_parallel(transformers.Trainer))

    class OwnLoss(transformers.Trainer):
        def compute_loss(self, *a, **k):
            return super().compute_loss(*a, **k)

    with pytest.raises(ConfigError, match="OwnLoss overrides compute_loss"):
        _refuse_unverified_loss(sequence_parallel(OwnLoss))
    from trl import SFTTrainer
    _refuse_unverified_loss(sequence_parallel(SFTTrainer))        # its fused loss: tests/dist/test_hf_trainer.py
    cls = sequence_parallel(transformers.Trainer)
    assert sequence_parallel(cls) is cls and cls.__name__ == "SequenceParallelTrainer"
    from trl import DPOTrainer, GRPOTrainer, RLOOTrainer
    _refuse_unverified_loss(sequence_parallel(DPOTrainer))        # whole rows: tests/dist/test_trl_dpo.py
    for trainer in (GRPOTrainer, RLOOTrainer):                     # rollouts per replica: tests/dist/test_trl_grpo.py
        _refuse_unverified_loss(sequence_parallel(trainer))
        with pytest.raises(ConfigError, match=f"evaluation with {trainer.__name__} .* not verified"):
            _refuse_unverified_eval(sequence_parallel(trainer), None, {"eval_dataset": [1]})


def test_rollout_trainers_get_the_replicas_generation_batch_or_a_refusal():
    """4 ranks, size 2: 2 replicas. TRL sized the generation batch from the world (4 x 4 x 2 = 32); the plain run
    with 2 processes has 4 x 2 x 2 = 16. A batch that splits a group of num_generations is refused with the fix;
    so are vLLM and custom rollouts, by name."""
    from types import SimpleNamespace
    from ds_seqpar.hf.trl_rollouts import fit_generation_batch, refuse_inexact
    sp = SimpleNamespace(size=2, dp_size=2)
    targs = SimpleNamespace(per_device_train_batch_size=4, steps_per_generation=2, num_generations=4,
                            generation_batch_size=32)
    fit_generation_batch(targs, sp, "GRPOTrainer")
    assert targs.generation_batch_size == 16
    targs = SimpleNamespace(per_device_train_batch_size=3, steps_per_generation=1, num_generations=4,
                            generation_batch_size=12)
    with pytest.raises(ConfigError, match=r"GRPOTrainer .*size=2.* 3 x 2 x 1 = 6, not a multiple of "
                                          r"num_generations=4"):
        fit_generation_batch(targs, sp, "GRPOTrainer")
    with pytest.raises(ConfigError, match="use_vllm=True .*set use_vllm=False"):
        refuse_inexact(SimpleNamespace(use_vllm=True), {}, "GRPOTrainer")
    with pytest.raises(ConfigError, match="RLOOTrainer with rollout_func .*leave rollout_func unset"):
        refuse_inexact(SimpleNamespace(use_vllm=False), {"rollout_func": print}, "RLOOTrainer")


def test_train_batch_size_is_made_replica_aware_or_refused_with_the_fix():
    """4 ranks, size 2, micro 2, accumulation 3: HF's fill (and the literal HF requires) is the world value
    24 -> removed, DeepSpeed derives the replicas' 12 from the mpu; absent stays absent; anything else
    (the replica value 12 too: transformers refuses it at train()) is refused naming both values."""
    from ds_seqpar.hf.trainer import replica_batch_size
    ds = {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2}
    replica_batch_size(ds, 4, 2, 2, 3)
    assert ds == {"train_micro_batch_size_per_gpu": 2}
    ds = {}
    replica_batch_size(ds, 4, 2, 2, 3)
    assert ds == {}
    for bad in (12, 48, 6):
        with pytest.raises(ConfigError, match=rf"train_batch_size={bad}: .* = 24 .* replicas' batch is 12.*'auto'"):
            replica_batch_size({"train_batch_size": bad}, 4, 2, 2, 3)


def _targs(config, deepspeed="ds.json"):
    from types import SimpleNamespace
    return SimpleNamespace(deepspeed=deepspeed, hf_deepspeed_config=SimpleNamespace(config=config),
                           per_device_train_batch_size=2, gradient_accumulation_steps=3)


def test_no_sequence_parallel_key_or_size_one_is_plain_and_no_deepspeed_config_is_refused(monkeypatch):
    """docs/trainer.md: no key or size 1 -> the mixin steps aside (plain data parallelism, HF's batch keys
    untouched, no process group asked for); no deepspeed config -> an error naming the option; a bad
    section or a size that does not divide the world -> an error naming the key, before any collective."""
    from ds_seqpar.hf import trainer as module
    from ds_seqpar.hf.trainer import _sequence_parallel

    def no_world():
        raise AssertionError("asked for the world size (a process group) although the run is plain")

    monkeypatch.setattr(module.comm, "world_size", no_world)
    for section in ({}, {"sequence_parallel": {}}, {"sequence_parallel": {"strategy": "zigzag", "size": 1}}):
        config = dict(section, train_batch_size=24)
        assert _sequence_parallel(_targs(config)) is None, section
        assert config["train_batch_size"] == 24, section
    for deepspeed in (None, ""):
        with pytest.raises(ConfigError, match=r"deepspeed='ds.json'"):
            _sequence_parallel(_targs({}, deepspeed))
    with pytest.raises(ConfigError, match=r"sequence_parallel.strategy='spiral' is not valid"):
        _sequence_parallel(_targs({"sequence_parallel": {"strategy": "spiral", "size": 2}}))
    monkeypatch.setattr(module.comm, "world_size", lambda: 3)
    with pytest.raises(ConfigError, match=r"sequence_parallel.size=2 does not divide the world size 3"):
        _sequence_parallel(_targs({"sequence_parallel": {"strategy": "zigzag", "size": 2}}))
    monkeypatch.setattr(module.comm, "world_size", lambda: 4)
    with pytest.raises(ConfigError, match="train_batch_size=12"):
        _sequence_parallel(_targs({"sequence_parallel": {"strategy": "zigzag", "size": 2}, "train_batch_size": 12}))


def test_dispatch_batches_is_refused_before_any_collective():
    """accelerate's dispatcher reads every batch on rank 0 and slices it by world rank: a sequence group
    could not get whole batches. Refused when asked for, and for an IterableDataset that leaves it unset
    (accelerate then dispatches); an IterableDataset with dispatch_batches=False is sharded per process."""
    from types import SimpleNamespace

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

    def targs(dispatch):
        return SimpleNamespace(label_smoothing_factor=0.0, accelerator_config=SimpleNamespace(dispatch_batches=dispatch))

    with pytest.raises(ConfigError, match=r"dispatch_batches=True .*set dispatch_batches=False"):
        _refuse_inexact(targs(True), {"train_dataset": [1, 2]})
    with pytest.raises(ConfigError, match=r"IterableDataset with dispatch_batches unset"):
        _refuse_inexact(targs(None), {"train_dataset": Stream()})
    _refuse_inexact(targs(False), {"train_dataset": Stream()})
    _refuse_inexact(targs(None), {"train_dataset": [1, 2]})


def test_unverified_evaluation_is_refused_at_construction():
    """A Trainer subclass with its own prediction_step other than TRL's SFTTrainer (whose eval loss and
    metrics ds_seqpar/hf/trl_support.py makes the replica's) is refused when the trainer is built, if the run
    evaluates (an eval set or an eval strategy), not after hours of training."""
    from types import SimpleNamespace

    import transformers
    from trl import SFTTrainer

    from ds_seqpar.hf.trainer import _refuse_unverified_eval

    class OwnEval(transformers.Trainer):
        def prediction_step(self, *a, **k):
            return super().prediction_step(*a, **k)

    own = sequence_parallel(OwnEval)
    with pytest.raises(ConfigError, match=r"evaluation with OwnEval .*eval_strategy='no'"):
        _refuse_unverified_eval(own, SimpleNamespace(eval_strategy=transformers.IntervalStrategy.STEPS), {})
    with pytest.raises(ConfigError, match="evaluation with OwnEval"):
        _refuse_unverified_eval(own, SimpleNamespace(eval_strategy="no"), {"eval_dataset": [1]})
    _refuse_unverified_eval(own, SimpleNamespace(eval_strategy=transformers.IntervalStrategy.NO), {})
    for verified in (SFTTrainer, transformers.Trainer):
        _refuse_unverified_eval(sequence_parallel(verified), SimpleNamespace(eval_strategy="steps"),
                                {"eval_dataset": [1]})


def test_deepspeed_wandb_block_becomes_the_trainers_one_run(monkeypatch):
    """DeepSpeed's "wandb" block would start a second run (its monitor, with the engine's scaled loss): it
    is switched off and the Trainer reports to wandb under the block's project, team and group."""
    from ds_seqpar.hf.wandb_run import one_wandb_run
    for env in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("WANDB_ENTITY", "mine")
    config = {"wandb": {"enabled": True, "project": "p", "team": "t", "group": "g"}}
    targs = _targs(config)
    targs.report_to = ["none"]
    one_wandb_run(targs)
    assert config["wandb"]["enabled"] is False and targs.report_to == ["wandb"], (config, targs.report_to)
    import os
    assert (os.environ["WANDB_PROJECT"], os.environ["WANDB_ENTITY"], os.environ["WANDB_RUN_GROUP"]) == ("p", "mine", "g")
    targs.report_to = ["tensorboard", "wandb"]
    config["wandb"]["enabled"] = True
    one_wandb_run(targs)
    assert targs.report_to == ["tensorboard", "wandb"] and not config["wandb"]["enabled"]
    untouched = _targs({"wandb": {"enabled": False}})
    untouched.report_to = ["none"]
    one_wandb_run(untouched)
    assert untouched.report_to == ["none"]


def test_an_engine_without_sp_mpu_stops_the_run():
    """If accelerate ever stops calling deepspeed.initialize inside accelerator.prepare, the engine has no
    sp.mpu (DeepSpeed would reduce over the world as plain data parallelism): the first step refuses."""
    from types import SimpleNamespace

    from ds_seqpar.hf.trainer import SequenceParallelMixin
    trainer = SequenceParallelMixin.__new__(SequenceParallelMixin)
    trainer.sp = SimpleNamespace(mpu=object())
    trainer.deepspeed = SimpleNamespace(mpu=None)
    with pytest.raises(ConfigError, match="did not receive sp.mpu"):
        trainer._check_engine(None)
    trainer.deepspeed = SimpleNamespace(mpu=trainer.sp.mpu)
    trainer._check_engine(None)
    assert trainer._sp_engine_checked


def test_loader_is_resharded_per_replica_and_workers_seeded_by_replica():
    """accelerate shards the loader over the world (process 3 of 4); under size 2 it becomes replica 1 of 2
    (the batches plain data parallelism's process 1 reads) and its dataloader workers are seeded by the
    replica, so both ranks of a group draw the same random numbers in a random collator (with real
    workers and accelerate's loader: tests/dist/test_hf_trainer.py)."""
    from functools import partial
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard
    from transformers.trainer_utils import seed_worker

    from ds_seqpar.hf.trainer import SequenceParallelMixin
    trainer = SequenceParallelMixin.__new__(SequenceParallelMixin)
    trainer.sp = SimpleNamespace(dp_size=2, dp_rank=1)
    trainer.args = SimpleNamespace(dataloader_num_workers=2)
    shard = BatchSamplerShard(torch.utils.data.BatchSampler(range(16), 2, False), num_processes=4, process_index=3)
    loader = SimpleNamespace(batch_sampler=shard, dataset=list(range(16)),
                             worker_init_fn=partial(seed_worker, num_workers=2, rank=3))
    assert trainer._per_replica(loader, training=True) is loader
    assert (shard.num_processes, shard.process_index) == (2, 1)
    assert [b for b in shard] == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert loader.worker_init_fn.func is seed_worker and loader.worker_init_fn.keywords == {"num_workers": 2, "rank": 1}


def test_trl_num_tokens_counted_on_the_whole_batch_and_moe_router_loss_refused():
    """TRL adds the attention mask's ones (else the row width) to num_tokens; the mixin counts that on the
    batch before sharding (the shards have no mask and a padded width). TRL's MoE router loss is a mean
    over each rank's own tokens: refused."""
    from types import SimpleNamespace

    from ds_seqpar.hf import trl_support
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert int(trl_support.tokens_of({"attention_mask": mask, "position_ids": torch.zeros(2, 4)})) == 5
    assert int(trl_support.tokens_of({"position_ids": torch.zeros(1, 7)})) == 7
    with pytest.raises(ConfigError, match="attention_mask or position_ids"):
        trl_support.tokens_of({"input_ids": mask})
    trl_support.refuse_inexact(SimpleNamespace(aux_loss_enabled=False))
    with pytest.raises(ConfigError, match="output_router_logits"):
        trl_support.refuse_inexact(SimpleNamespace(aux_loss_enabled=True))
