"""Hugging Face transformers models under sequence parallelism (transformers is an optional
dependency: ``pip install 'ds_seqpar[hf]'``).

    from ds_seqpar.hf import apply_sequence_parallel, remove_sequence_parallel
    model = apply_sequence_parallel(model, sp)        # same object; every attention layer calls sp.attention
    batch = sp.shard_batch({"input_ids": ids, "labels": ids})
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    loss = sp.loss(out.logits, batch["labels"])       # or model(**batch).loss
    remove_sequence_parallel(model)                   # the original attention back

Registered through transformers' public AttentionInterface under a key of its own per
(sp, model); no built-in implementation is overwritten and no private function is patched.

Trainers (trainer.py): ``SequenceParallelTrainer`` (transformers.Trainer) and ``sequence_parallel(cls)``
for any Trainer subclass (TRL's SFTTrainer) take the strategy from the DeepSpeed JSON's
``sequence_parallel`` key.
"""
from ..errors import UnsupportedModelError
from .apply import apply_sequence_parallel, remove_sequence_parallel
from .trainer import sequence_parallel

__all__ = ["apply_sequence_parallel", "remove_sequence_parallel", "UnsupportedModelError", "sequence_parallel",
           "SequenceParallelTrainer"]


def __getattr__(name):
    if name == "SequenceParallelTrainer":          # transformers is imported only when asked for
        from transformers import Trainer
        return sequence_parallel(Trainer)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
