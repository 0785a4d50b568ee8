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
