"""Forward hooks on the applied model: per-call refusals before the first collective, and a check
after the forward that the registered attention really ran.

Before the forward (refusals that depend on the call, not only on the config):
  * position_ids are required: without them the model numbers this rank's tokens from 0, and RoPE
    would see local instead of global positions;
  * 3-D (multimodal mrope) position ids, past_key_values (cached attention) are refused;
  * an attention_mask with zeros is refused on EVERY rank at once: transformers builds no mask for
    a custom key, so padding would be dropped silently. Only some ranks may hold the zeros, so the
    flag goes through one small all-reduce (max) over the sequence group; a mask of ones is dropped;
  * use_cache is forced off (a cache would make the model skip packed-sequence handling and keep
    keys it never needs in training).
After the forward: every attention layer must have called the function (models whose attention
ignores the registry are caught here at the latest), and labels must have reached sp.loss.
"""
from __future__ import annotations

import inspect

import torch

from .. import comm
from .checks import UnsupportedModelError, check_config, check_dropout


def install(model, state) -> list:
    params = inspect.signature(model.forward).parameters
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def pre(module, args, kwargs):
        call = dict(zip(names, args), **kwargs)
        kwargs = dict(kwargs)
        check_call(module, state, call)
        if _mask_has_zeros(call.get("attention_mask"), state.sp):
            raise UnsupportedModelError("ds_seqpar.hf: an attention_mask with zeros (padding) on some rank of the "
                                        "sequence group: transformers builds no mask for sequence-parallel attention, "
                                        "so it would be ignored; pack documents or trim padding instead")
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None          # all ones: nothing to mask
        if "use_cache" in params and "use_cache" not in names[:len(args)]:
            kwargs["use_cache"] = False
        state.calls = set()
        state.labels_given = call.get("labels") is not None
        state.loss_routed = False
        return args, kwargs

    def post(module, args, kwargs, output):
        missing = [state.names[id(m)] for _, m in state.layers if id(m) not in state.calls]
        if missing:
            raise UnsupportedModelError(f"ds_seqpar.hf: {len(missing)} attention layer(s) did not call the "
                                        f"sequence-parallel attention (first: {missing[0]}): this model's attention "
                                        f"does not go through transformers' AttentionInterface")
        if state.labels_given and not state.loss_routed:
            raise UnsupportedModelError(f"ds_seqpar.hf: {type(module).__name__} computed its loss without "
                                        f"model.loss_function, so it was not the sequence-parallel loss; call "
                                        f"without labels and use sp.loss(out.logits, batch['labels'])")
        return output

    return [model.register_forward_pre_hook(pre, with_kwargs=True),
            model.register_forward_hook(post, with_kwargs=True)]


def check_call(model, state, call: dict) -> None:
    """Local refusals: the same on every rank (shapes and options, not data)."""
    pos = call.get("position_ids")
    if pos is None:
        raise UnsupportedModelError("ds_seqpar.hf: position_ids are required under sequence parallelism: pass "
                                    "batch['position_ids'] from sp.shard_batch (the model would number this "
                                    "rank's tokens from 0)")
    if pos.dim() == 3:
        raise UnsupportedModelError(f"ds_seqpar.hf: multimodal 3-D position ids {tuple(pos.shape)} (mrope) cannot "
                                    f"be exact under sequence parallelism; pass [batch, seq] position_ids")
    if call.get("past_key_values") is not None:
        raise UnsupportedModelError("ds_seqpar.hf: past_key_values (cached attention) cannot be exact under "
                                    "sequence parallelism; call remove_sequence_parallel(model) before generate")
    mask = call.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise UnsupportedModelError(f"ds_seqpar.hf: a {mask.dim()}-D attention_mask {tuple(mask.shape)} cannot be "
                                    f"sharded; pass no mask (causality is applied by the strategy)")
    tokens = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    seq_len = tokens.shape[1] * state.sp.size if tokens is not None else None
    check_config(model.config, seq_len=seq_len, training=model.training)
    check_dropout(state.layers, model.training)


def _mask_has_zeros(mask, sp) -> bool:
    """Any rank of the sequence group holding a zero in its mask: one all-reduce of a flag, made on
    every call (with or without a mask) so the ranks' collectives always match."""
    device = mask.device if mask is not None else sp.device
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    if mask is not None and bool((mask == 0).any()):
        flag += 1
    return bool(comm.all_reduce(flag, sp.group, op="max").item())


__all__ = ["install", "check_call"]
