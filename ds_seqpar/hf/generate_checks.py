"""What ``model.generate`` of an applied model refuses, and the one agreement check: the pure checks run
identically on every rank before any collective (options, the model's features, the mask's shape), then
one all-reduce checks that the prompt, the options and (sampling) the random state agree (generate.py
calls them in that order)."""
from __future__ import annotations

import zlib

import torch

from .. import comm
from .attention import is_chunked
from .checks import UnsupportedModelError
from .linear.prefill import check_decodes

# generate options that cannot run over a sequence-sharded cache: (name, the value in use or None, what works)
_OPTIONS = (
    ("num_beams", lambda g, kw: g.num_beams if (g.num_beams or 1) > 1 else None, "use num_beams=1 (greedy or sampling)"),
    ("assistant_model", lambda g, kw: _named(kw.get("assistant_model")), "generate without an assistant"),
    ("prompt_lookup_num_tokens", lambda g, kw: g.prompt_lookup_num_tokens, "generate without prompt lookup"),
    ("assistant_early_exit", lambda g, kw: getattr(g, "assistant_early_exit", None), "generate without self-speculation"),
    ("past_key_values",
     lambda g, kw: _named(kw.get("past_key_values", kw.get("cache", kw.get("cache_params")))),
     "pass no cache: ds_seqpar builds the sequence-sharded one"),
    ("use_cache", lambda g, kw: False if kw.get("use_cache") is False
     or getattr(kw.get("generation_config"), "use_cache", None) is False else None,
     "use use_cache=True (the default; a model config's use_cache=False, a training setting, is overridden)"),
    ("cache_implementation", lambda g, kw: g.cache_implementation, "leave it unset"),
    ("prefill_chunk_size", lambda g, kw: getattr(g, "prefill_chunk_size", None),
     "leave it unset: the prompt is already split over the sequence group"),
    ("inputs_embeds", lambda g, kw: _named(kw.get("inputs_embeds")), "pass input_ids"),
    ("output_attentions", lambda g, kw: True if g.output_attentions else None, "generate without it"),
    ("output_hidden_states", lambda g, kw: True if g.output_hidden_states else None,
     "generate without it (output_scores and output_logits work)"),
    ("guidance_scale", lambda g, kw: g.guidance_scale if g.guidance_scale not in (None, 1) else None,
     "generate without classifier-free guidance"),
    ("custom_generate", lambda g, kw: _named(kw.get("custom_generate")), "use transformers' own decoding methods"),
)


def _named(value):
    """An object option's value as a message shows it: its type's name (None: not in use)."""
    return None if value is None else type(value).__name__


def check_options(name: str, gen, kwargs) -> None:
    """The first option in use that a sequence-sharded cache cannot run, refused by name (pure)."""
    for option, value_of, fix in _OPTIONS:
        value = value_of(gen, kwargs)
        if value is not None:
            shown = value if isinstance(value, str) else repr(value)        # a type name, or the value
            raise UnsupportedModelError(f"ds_seqpar.hf: {name}.generate with {option}={shown} under sequence "
                                        f"parallelism (a sequence-sharded KV cache) is not supported; {fix}")


def check_left_padding(name: str, ids, mask) -> None:
    """The attention_mask (the same on every rank: checked) must be ones, or left padding: each row zeros then
    at least one one. Inner zeros (padding between real tokens), right padding (whose last token the unsharded
    generate would continue from a pad) and other values are refused by name (pure, every rank alike)."""
    if mask is None:
        return
    if not torch.is_tensor(mask) or tuple(mask.shape) != tuple(ids.shape):
        raise UnsupportedModelError(f"ds_seqpar.hf: {name}.generate with an attention_mask of shape "
                                    f"{tuple(getattr(mask, 'shape', ()))} for input_ids {tuple(ids.shape)} under "
                                    f"sequence parallelism; pass a [batch, tokens] mask of ones and left padding zeros")
    if bool((mask == 1).all()):
        return
    binary = bool(((mask == 0) | (mask == 1)).all())
    left = binary and bool((mask[:, 1:] >= mask[:, :-1]).all()) and bool((mask[:, -1] == 1).all())
    if not left:
        raise UnsupportedModelError(f"ds_seqpar.hf: {name}.generate with an attention_mask that is not left padding "
                                    f"(zeros between or after real tokens, a row without real tokens, or values "
                                    f"other than 0 / 1) under sequence parallelism is not supported; pad prompts on "
                                    f"the left (tokenizer padding_side='left'), as generate expects")


def text_config(model):
    """The decoder's config (a multimodal model's text config; here: the model's own)."""
    return getattr(model.config, "get_text_config", lambda: model.config)()


def check_model(model, state, left_padded: bool = False) -> None:
    """Model features the sequence-sharded decode does not cover: refused by name (pure, every rank).
    ``left_padded``: also those a left-padded batch adds (a hybrid's linear layers)."""
    name = type(model).__name__

    def refuse(feature, fix):
        raise UnsupportedModelError(f"ds_seqpar.hf: {name}.generate under sequence parallelism with {feature} is "
                                    f"not supported; {fix}")

    if state.dynamic:
        refuse("sequence_parallel.size='dynamic'", "apply a fixed-size SequenceParallel to generate")
    if state.sp.config.strategy == "lasp":
        refuse("strategy 'lasp' (linear attention)", "a softmax strategy (ulysses, ring, zigzag, striped)")
    if state.linear is not None:
        check_decodes(state.linear, refuse)
    if state.linear is not None and left_padded:
        refuse("a left-padded attention_mask and linear-attention / SSM layers (their recurrent state would run over "
               "the rotated pads)", "generate prompts of equal length, or remove_sequence_parallel(model) and "
                                   "generate on one process")
    if state.indexed is not None:
        refuse("DeepSeek sparse attention (indexer keys)", "remove_sequence_parallel(model) and generate on one process")
    if state.vision is not None:
        refuse("a multimodal model", "generate with the text model on one process")
    if model.training and getattr(model, "is_gradient_checkpointing", False):
        # transformers' checkpointed layers drop the cache in training mode: decode would attend without it
        refuse("gradient checkpointing in training mode", "call model.eval() (or gradient_checkpointing_disable()) "
                                                           "before generate")
    config = text_config(model)
    if getattr(config, "num_kv_shared_layers", 0):
        refuse("layers sharing another layer's KV cache (num_kv_shared_layers)", "generate on one process")
    for where, module in state.layers:
        if not isinstance(getattr(module, "layer_idx", None), int):
            refuse(f"attention layer {where} without a layer_idx", "generate on one process")
        if is_chunked(module):
            refuse(f"chunked attention ({where})", "generate on one process")
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            refuse(f"attention temperature tuning ({where})", "attn_temperature_tuning=False, or one process")


def check_agreement(sp, name: str, ids, mask, gen) -> None:
    """One all-reduce: the prompt, its mask, the options and (sampling) the random state agree."""
    try:
        options = gen.to_json_string(use_diff=False)
    except Exception:                                     # noqa: BLE001 - an option json cannot write
        options = repr(sorted(vars(gen).items()))
    fields = [("input_ids", _crc(ids) * 64 + ids.dim()), ("prompt shape", ids.numel()),
              ("attention_mask", 0 if mask is None else _crc(mask)), ("generation options", zlib.crc32(options.encode()))]
    if gen.do_sample:
        fields.append(("random state (torch.manual_seed)", _rng_crc(sp.device)))
    same = _same_on_ranks(sp, [v for _, v in fields])
    differ = [f for (f, _), ok in zip(fields, same) if not ok]
    if differ:
        raise UnsupportedModelError(f"ds_seqpar.hf: {name}.generate got a different {', '.join(differ)} on the ranks "
                                    f"of a sequence group; call it with the same prompt and options on every rank "
                                    f"(and torch.manual_seed(same seed) when sampling)")


def _same_on_ranks(sp, values):
    """[bool] per value: equal on every rank of sp's group (one all-reduce of max over v and -v)."""
    v = torch.tensor(values, dtype=torch.int64)
    both = comm.all_reduce(torch.cat([v, -v]).to(sp.device), sp.group, sp.stats, op="max", kind="agreement").cpu()
    k = len(values)
    return [bool(both[i] == -both[k + i]) for i in range(k)]


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())


def _rng_crc(device) -> int:
    state = torch.get_rng_state()
    if torch.device(device).type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    return zlib.crc32(state.numpy().tobytes())


__all__ = ["check_agreement", "check_left_padding", "check_model", "check_options", "text_config"]
