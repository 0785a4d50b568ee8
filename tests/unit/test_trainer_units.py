"""The Trainer mixin's pure pieces (no processes): what it refuses and how it treats padding."""
import pytest
import torch

from ds_seqpar.config import ConfigError
from ds_seqpar.hf.trainer import _refuse_inexact, _refuse_unverified_loss, drop_right_padding, sequence_parallel


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
             ({}, {"model_init": lambda: None}, "model_init"),
             (dict(predict_with_generate=True), {}, "predict_with_generate")]
    for args, kwargs, name in cases:
        with pytest.raises(ConfigError, match=name):
            _refuse_inexact(SimpleNamespace(**dict(vars(ok), **args)), kwargs)


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
