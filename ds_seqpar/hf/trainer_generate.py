"""``sequence_parallel(Seq2SeqTrainer)`` with ``predict_with_generate=True`` for causal LMs: evaluate() and
predict() return generated tokens, each replica's through the applied model's ``generate`` over a
sequence-sharded KV cache (generate.py), gathered over the replicas by the mixin's evaluation loop.

Seq2SeqTrainer's own prediction_step cannot run as is under sequence parallelism: its loss forward gets the
whole batch, while the applied model takes this rank's shard. This step is that prediction_step with the two
halves routed: the tokens from ``model.generate`` on the whole prompts (the same on every rank of the group:
the sharded generate checks it), the loss from the mixin's own sharded step (the replica's loss, as plain
data parallelism reports it); the padding of tokens and labels to the generation length is Seq2SeqTrainer's.
Supported: causal LMs, greedy or seeded sampling, a batch of 1 or of equal-length prompts (generate.py refuses
a padded batch by name), ZeRO-1/2. Refused at construction (refuse_inexact): beam search
(generation_num_beams > 1) and ZeRO-3 (not verified here: its synced_gpus loop).
"""
from __future__ import annotations

from ..config import ConfigError

SEQ2SEQ = "Seq2SeqTrainer"
GENERATE_ONLY = ("labels", "shift_labels", "decoder_input_ids", "decoder_attention_mask")   # not prompt inputs


def generates(trainer, owner: str, prediction_loss_only: bool) -> bool:
    """Does this step return generated tokens? Seq2SeqTrainer's predict_with_generate path (the Trainer's own
    prediction_step ignores the flag, as it does in plain transformers)."""
    return owner == SEQ2SEQ and bool(getattr(trainer.args, "predict_with_generate", False)) \
        and not prediction_loss_only


def refuse_inexact(targs, ds: dict, owner: str) -> None:
    """predict_with_generate where it is not verified: by name, at construction, on every rank. ``owner``: the
    class whose prediction_step runs (a subclass's own one is refused by trainer_refusals when it evaluates)."""
    if owner != SEQ2SEQ or not getattr(targs, "predict_with_generate", False):
        return
    beams = getattr(targs, "generation_num_beams", None)
    if beams is not None and beams > 1:
        raise ConfigError(f"ds_seqpar.hf: predict_with_generate with generation_num_beams={beams} under sequence "
                          f"parallelism is not supported (beam search over a sequence-sharded KV cache); set "
                          f"generation_num_beams=1 (greedy or sampling)")
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3:
        raise ConfigError("ds_seqpar.hf: predict_with_generate with zero_optimization.stage=3 under sequence "
                          "parallelism is not verified (ZeRO-3's synced_gpus generation loop); use stage 1 or 2, or "
                          "evaluate the loss only (predict_with_generate=False)")


def prediction_step(trainer, model, inputs, ignore_keys, gen_kwargs):
    """Seq2SeqTrainer.prediction_step's predict_with_generate path under sequence parallelism (module doc)."""
    has_labels = inputs.get("labels") is not None
    if not gen_kwargs and hasattr(trainer, "_gen_kwargs"):        # what evaluate() / predict() were given
        gen_kwargs = trainer._gen_kwargs.copy()
    for key in ("num_beams", "max_length"):
        if key in gen_kwargs and gen_kwargs[key] is None:
            gen_kwargs.pop(key)
    prompt = trainer._prepare_inputs({k: v for k, v in inputs.items() if k not in GENERATE_ONLY})
    hf_model = trainer.model                                        # the applied model: its sharded generate
    tokens = hf_model.generate(**prompt, **gen_kwargs)
    config = hf_model.generation_config
    if config._from_model_config:          # as Seq2SeqTrainer: the config is not re-made from the model's each step
        config._from_model_config = False
    config.update(**config._get_default_generation_params(), defaults_only=True)
    tokens = _pad(trainer, tokens, config)
    # the loss: the mixin's sharded step on the same batch (the replica's loss, what plain dp reports)
    loss = trainer.prediction_step(model, inputs, True, ignore_keys)[0] if has_labels else None
    if trainer.args.prediction_loss_only:
        return loss, None, None
    labels = _pad(trainer, inputs["labels"].to(trainer.args.device), config) if has_labels else None
    return loss, tokens, labels


def _pad(trainer, tensor, config):
    """Seq2SeqTrainer's padding of a step's tokens / labels to the generation length."""
    if tensor.shape[-1] < config.max_length:
        return trainer._pad_tensors_to_max_len(tensor, config.max_length)
    if config.max_new_tokens is not None and tensor.shape[-1] < config.max_new_tokens + 1:
        return trainer._pad_tensors_to_max_len(tensor, config.max_new_tokens + 1)
    return tensor


__all__ = ["generates", "refuse_inexact", "prediction_step", "SEQ2SEQ"]
