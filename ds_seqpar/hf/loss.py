"""``model(**batch).loss`` under sequence parallelism: the model's loss routed to ``sp.loss``.

transformers computes a causal LM's loss as ``self.loss_function(logits, labels, vocab_size, **kwargs)``
(keywords for most families, positionally for Gemma2, gpt-oss, Jamba...), and its default
ForCausalLMLoss shifts the labels by one and averages over THIS rank's tokens only. Labels from
``sp.shard_batch`` are already shifted over the whole sequence, so the routed loss must not shift
again, and the mean must cover every rank's tokens: exactly ``sp.loss`` (same value on every rank,
backward giving this rank's share). The override is per instance (``model.loss_function = fn``, the
public setter); other models keep the default.

With ``num_items_in_batch`` (the Trainer's token count of the accumulation window over every rank,
counted on the shards' shifted targets: hf/trainer.py) the loss is this rank's local sum over that
count: the Trainer scales it by the world size and DeepSpeed averages over the world, which gives
plain data parallelism's gradient with no sequence-group collective here. With dynamic groups it is
``dsp.loss`` of the running micro-batch: this rank's share of the global batch's token-level mean.
"""
from __future__ import annotations

from typing import Callable

import torch.nn.functional as F


def make_loss_function(state) -> Callable:
    def ds_seqpar_loss(logits, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
                       shift_labels=None, **kwargs):
        sp = state.sp
        if sp is None:
            raise RuntimeError("ds_seqpar.hf: the sequence-parallel loss was called after remove_sequence_parallel")
        targets = shift_labels if shift_labels is not None else labels      # already shifted: never again
        if targets is None:
            raise ValueError("ds_seqpar.hf: the loss needs labels (from sp.shard_batch)")
        state.loss_routed = True
        if num_items_in_batch is not None:
            local = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten().to(logits.device),
                                    ignore_index=ignore_index, reduction="sum")
            return local / num_items_in_batch
        if state.dynamic:         # this rank's share of the global batch's token-level mean
            runner = state.runner
            return runner.loss(logits, targets, runner.running_batch, ignore_index=ignore_index)
        return sp.loss(logits, targets, ignore_index=ignore_index)

    return ds_seqpar_loss


__all__ = ["make_loss_function"]
