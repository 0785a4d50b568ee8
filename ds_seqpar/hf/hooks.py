"""Forward hooks on the applied model: per-call refusals before the first collective, and a check
after the forward that the registered attention really ran.

Before the forward (refusals that depend on the call, not only on the config):
  * position_ids are required: without them the model numbers this rank's tokens from 0, and RoPE
    would see local instead of global positions;
  * 3-D (multimodal mrope) position ids outside 3-D RoPE models, past_key_values (cached attention) are
    refused; multimodal models check their positions and gather their whole-row inputs (vision.py);
  * an attention_mask with zeros: transformers builds no mask for a custom key. Only some ranks may
    hold the zeros, so a flag goes through one small all-reduce (max) over the sequence group; if it
    is up, every rank gathers the mask (global order) and decides the same: right padding (every row
    ones then zeros) in a causal model is dropped (exact: no real query sees a later pad key; the
    pads' own targets must be ignore_index, as HF collators set them), left or inner zeros and
    padding in a non-causal model are refused by name; a mask of ones is dropped;
  * packed rows without cu_seqlens: plain transformers finds documents from position_ids that
    restart at 0, which no rank can see alone. The same all-reduce carries a second flag: this
    rank's position_ids are not the global positions sp.shard_batch gives. If any rank raises it,
    every rank gathers the position_ids (batch 1) and passes the documents they restart at as
    cu_seqlens, exactly as the model would mask them; with batch > 1 every rank refuses;
  * an indexer top-k (DeepSeek sparse attention) longer than the whole sequence;
  * use_cache is forced off (a cache would make the model skip packed-sequence handling and keep
    keys it never needs in training).
Under model.generate the forwards are generate.py's instead: the prompt sharded by the layout, then
one token whole on every rank per step.
After the forward: every attention layer must have called the function (models whose attention
ignores the registry are caught here at the latest), and a loss the model returns must have come
from the routed loss function (labels reached it).
"""
from __future__ import annotations

import inspect

import torch

from ..sharding.documents import boundaries_from_positions
from . import batch_check
from .batch_check import check_right_padding, group_flags
from .checks import UnsupportedModelError, check_config, check_dropout
from .indexed import check_topk
from .vision import is_cross_attention


def install(model, state) -> list:
    params = inspect.signature(model.forward).parameters
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def pre(module, args, kwargs):
        call = dict(zip(names, args), **kwargs)
        if state.generation is not None:     # model.generate's prefill and decode steps (generate.py)
            state.calls, state.chunked = set(), {}
            state.labels_given = state.shift_labels_given = state.loss_routed = False
            return (), state.generation.pre_forward(call, params)
        if state.vision is not None:     # by name: the whole-row inputs replace the shards below
            args = ()
        kwargs = dict(call) if state.vision is not None else dict(kwargs)
        check_call(module, state, call)
        packed = call.get("cu_seqlens") is None and call.get("cu_seq_lens_q") is None
        pos = call["position_ids"]
        if torch.compiler.is_compiling():       # the same checks, in the first attention call (batch_check.py)
            kwargs[batch_check.KWARG] = (pos, call.get("attention_mask"), packed and pos.dim() == 2)
        else:
            zeros, restarts = group_flags(call.get("attention_mask"), pos if packed and pos.dim() == 2 else None,
                                          state.sp)
            if zeros:
                check_right_padding(call["attention_mask"], state)
            if restarts:
                kwargs["cu_seqlens"] = documents_from_positions(pos, state.sp)
        if state.vision is not None:
            packed_row = any(kwargs.get(k, call.get(k)) is not None for k in ("cu_seqlens", "cu_seq_lens_q"))
            kwargs.update(state.vision.whole_row(call, state.sp, packed_row))
        if state.linear is not None:         # hybrids: the state and the conv restart at every document
            state.linear.documents = linear_documents(kwargs.get("cu_seqlens", call.get("cu_seqlens")),
                                                      call.get("cu_seq_lens_q"), call["position_ids"], module)
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None          # all ones, or right padding of a causal model
        if "use_cache" in params and "use_cache" not in names[:len(args)]:
            kwargs["use_cache"] = False
        state.calls = set()
        state.chunked = {}
        state.labels_given = call.get("labels") is not None
        state.shift_labels_given = call.get("shift_labels") is not None
        state.loss_routed = False
        return args, kwargs

    def post(module, args, kwargs, output):
        if state.vision is not None:
            state.vision.row_len = None
        # Mllama's cross-attention layers run only when the call has images (vision.is_cross_attention)
        missing = [state.names[id(m)] for _, m in state.layers if id(m) not in state.calls and not is_cross_attention(m)]
        if missing:
            raise UnsupportedModelError(f"ds_seqpar.hf: {len(missing)} attention layer(s) did not call the "
                                        f"sequence-parallel attention (first: {missing[0]}): this model's attention "
                                        f"does not go through transformers' AttentionInterface")
        if state.generation is not None:
            return state.generation.post_forward(output)
        if state.labels_given and not state.loss_routed and not state.shift_labels_given \
                and getattr(output, "loss", None) is not None:
            # a loss that did not go through model.loss_function would shift the labels again, unless the
            # call gave shift_labels (transformers' convention for already-shifted targets, which
            # sequence-parallel trainers pass and TRL's fused LM head scores as they are)
            raise UnsupportedModelError(f"ds_seqpar.hf: {type(module).__name__} computed its loss without "
                                        f"model.loss_function, so it was not the sequence-parallel loss; call "
                                        f"without labels and use sp.loss(out.logits, batch['labels'])")
        return output

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True)]
    if state.vision is not None:         # the decoder takes this rank's tokens of the whole-row embeddings
        handles.append(state.vision.decoder.register_forward_pre_hook(
            lambda m, a, kw: (a, state.vision.decoder_inputs(kw, state.sp)), with_kwargs=True))
    return handles


def check_call(model, state, call: dict) -> None:
    """Local refusals: the same on every rank (shapes and options, not data)."""
    if state.dynamic and state.runner.running_batch is None:
        raise UnsupportedModelError("ds_seqpar.hf: a model applied with sequence_parallel.size='dynamic' runs one "
                                    "micro-batch of a schedule at a time: call it inside `with dsp.running(mb):` "
                                    "with dsp.batch(mb, ...)'s batch (docs/dynamic.md)")
    pos = call.get("position_ids")
    if pos is None:
        raise UnsupportedModelError("ds_seqpar.hf: position_ids are required under sequence parallelism: pass "
                                    "batch['position_ids'] from sp.shard_batch (the model would number this "
                                    "rank's tokens from 0)")
    if state.vision is not None:
        state.vision.check_call(call)
    if pos.dim() == 3 and not (state.vision is not None and state.vision.mrope):
        raise UnsupportedModelError(f"ds_seqpar.hf: multimodal 3-D position ids {tuple(pos.shape)} (mrope) cannot "
                                    f"be exact under sequence parallelism; pass [batch, seq] position_ids")
    if not torch.compiler.is_compiling():    # shape comparisons would become guards (a recompile per length)
        check_sequences(model, call)
    if call.get("past_key_values") is not None or call.get("cache") is not None:   # "cache" from transformers 5.24
        raise UnsupportedModelError("ds_seqpar.hf: past_key_values (cached attention) cannot be exact under "
                                    "sequence parallelism in a forward call; pass no cache (model.generate builds "
                                    "its own sequence-sharded one)")
    mask = call.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        raise UnsupportedModelError(f"ds_seqpar.hf: a {mask.dim()}-D attention_mask {tuple(mask.shape)} cannot be "
                                    f"sharded; pass no mask (causality is applied by the strategy)")
    check_config(model.config, training=model.training, linear_ok=state.linear is not None,
                 vision_ok=state.vision is not None)
    check_dropout(state.layers, model.training)
    if state.indexed is not None:
        check_topk(model.config, pos.shape[-1] * state.sp.size)


SEQUENCE_INPUTS = ("input_ids", "inputs_embeds", "labels", "shift_labels", "attention_mask", "token_type_ids")


def check_sequences(model, call: dict) -> None:
    """The call's per-token inputs are this rank's tokens alike: one of input_ids / inputs_embeds, and every
    [batch, seq, ...] input as long as position_ids (a mismatch would surface as a raw size error deep in the
    model, or not at all)."""
    name = type(model).__name__
    if call.get("input_ids") is not None and call.get("inputs_embeds") is not None:
        raise UnsupportedModelError(f"ds_seqpar.hf: {name} got both input_ids and inputs_embeds; pass one of them, "
                                    f"this rank's shard (sp.shard_batch's input_ids, or sp.shard(embeds, dim=1))")
    pos = call.get("position_ids")
    if pos is None:
        return
    width = pos.shape[-1]
    for key in SEQUENCE_INPUTS:
        value = call.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] != width \
                and not (key == "attention_mask" and value.dim() != 2):      # other masks: refused below
            raise UnsupportedModelError(f"ds_seqpar.hf: {name}'s {key} has {value.shape[1]} tokens and position_ids "
                                        f"{width}: under sequence parallelism every per-token input is this rank's "
                                        f"shard of the same tokens; shard them together (sp.shard_batch, or "
                                        f"sp.shard(x, dim=1) for inputs_embeds)")


def linear_documents(cu_seqlens, cu_seq_lens_q, position_ids, module):
    """The global document bounds the linear layers cut at (a list; under compile a tensor stays one),
    or None; the same on every rank (the bounds are global). Packed rows must be batch 1, as for the
    attention layers."""
    bounds = cu_seqlens if cu_seqlens is not None else cu_seq_lens_q
    if bounds is None:
        return None
    if position_ids.shape[0] != 1:
        raise UnsupportedModelError(f"ds_seqpar.hf: packed documents with {position_ids.shape[0]} rows in "
                                    f"{type(module).__name__}: the linear layers' documents are one row's; pack "
                                    f"into batch size 1")
    if torch.is_tensor(bounds):
        # under compile an input of the layers' ops, read on the host in their bodies (opaque.py)
        return bounds if torch.compiler.is_compiling() else bounds.tolist()
    return list(bounds)


def documents_from_positions(position_ids, sp):
    """cu_seqlens of a packed row from its position_ids restarting at 0 (every rank: one all-gather,
    the same global row, the same boundaries or the same error)."""
    if position_ids.shape[0] != 1:
        raise UnsupportedModelError(f"ds_seqpar.hf: position_ids {tuple(position_ids.shape)} are not the global "
                                    f"positions sp.shard_batch gives (packed documents restarting at 0?) and the batch "
                                    f"has {position_ids.shape[0]} rows; packed documents need batch size 1: pass "
                                    f"sp.shard_batch's batch (with cu_seqlens) or one document per row")
    full = sp.unshard(position_ids, dim=1)[0]
    try:
        return torch.tensor(boundaries_from_positions(full), dtype=torch.int64)
    except ValueError as err:
        raise UnsupportedModelError(f"ds_seqpar.hf: position_ids are neither the global positions of "
                                    f"sp.shard_batch nor packed documents restarting at 0 ({err}); pass "
                                    f"batch['position_ids'] from sp.shard_batch") from None


__all__ = ["install", "check_call"]
