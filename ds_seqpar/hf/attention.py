"""The attention function registered with transformers' ``AttentionInterface``, one per
(SequenceParallel, model) pair.

transformers calls it from every attention layer as

    fn(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs) -> (out, weights)

with query [b, heads, s, d] (RoPE applied, GQA heads NOT repeated) and expects out [b, s, heads, d]
(the caller reshapes it to [b, s, heads * d] without checking, so a wrong layout would silently mix
heads and tokens). ``sp.attention`` takes and returns bshd, so the function transposes on the way in
and returns the result as is.

Every refusal here depends only on the layer and the call's shapes and kwargs, which are the same on
every rank of a sequence group, so each rank raises the same error before the first collective.

Legend: b = batch, h = q heads, hkv = k/v heads, s = local tokens, d = qk head dim, dv = v head dim.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..masks import chunk_bounds, effective_window
from . import batch_check
from .checks import UnsupportedModelError
from .indexed import sparse_attention
from .vision import is_cross_attention


def make_attention_function(state) -> Callable:
    """The function for ``AttentionInterface.register``; ``state`` (apply.py) holds the sp, the
    layer names and the per-forward call record."""

    def ds_seqpar_attention(module, query, key, value, attention_mask=None, dropout: float = 0.0,
                            scaling: Optional[float] = None, **kwargs: Any):
        sp = state.sp
        where = state.layer_name(module)
        if sp is None:
            raise RuntimeError(f"ds_seqpar.hf: {where} called sequence-parallel attention after "
                               f"remove_sequence_parallel; this model's attention key is stale")
        if state.indexed is not None and id(module) in state.indexed.ids:
            state.calls.add(id(module))
            return indexed_attention(where, query, key, value, attention_mask, dropout, scaling, kwargs, sp.size), None
        run = state.generation                     # model.generate (generate.py)
        if run is not None and run.decoding:
            state.calls.add(id(module))
            if dropout and dropout > 0:
                raise UnsupportedModelError(f"ds_seqpar.hf: attention dropout {dropout} in training mode in {where} "
                                            f"during generate; call model.eval() or set attention_dropout=0.0")
            return run.decode_attention(module, query, key, value, scaling, kwargs), None
        if is_cross_attention(module):
            state.calls.add(id(module))
            return local_cross_attention(where, query, key, value, attention_mask, dropout, scaling, kwargs), None
        causal, seq_len, cu_seqlens = _call_options(module, kwargs)
        check_call(where, query, key, attention_mask, dropout, kwargs, sp.size, causal, seq_len)
        query = global_temperature(module, query, sp)
        n_global = query.shape[2] * sp.size
        window, softcap, sinks = score_options(kwargs, n_global)
        cu_seqlens = state.chunks(module, cu_seqlens, seq_len or n_global)
        if not state.calls and kwargs.get(batch_check.KWARG) is not None:     # compiled: the hook's checks
            query = batch_check.checked_query(query, kwargs[batch_check.KWARG], state.key)
        state.calls.add(id(module))
        # [b, h, s, d] -> [b, s, h, d]: sp.attention's layout (contiguous: strategies view and split it)
        q_bshd, k_bshd, v_bshd = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5     # before any padding
        q_bshd, k_bshd, v_bshd, dv = match_head_dims(q_bshd, k_bshd, v_bshd)
        blocks = None if state.vision is None else state.vision.layer_blocks(module)    # Gemma 3's images
        out_bshd = sp.attention(q_bshd, k_bshd, v_bshd, causal=causal, softmax_scale=scale, seq_len=seq_len,
                                cu_seqlens=cu_seqlens, window=window, softcap=softcap, sinks=sinks, blocks=blocks)
        if run is not None:                        # generate's prefill: a window layer's cache keeps what it still sees
            run.after_prefill_attention(module, kwargs)
        return out_bshd[..., :dv], None

    return ds_seqpar_attention


def local_cross_attention(where: str, query, key, value, mask, dropout: float, scaling, kwargs):
    """Cross-attention to the images' tokens (vision.is_cross_attention): every rank holds all the keys
    and values (the towers run whole) and its own queries with their rows of the mask (the decoder's
    pre-hook sharded them), so each query's softmax is the unsharded model's; no communication. The
    keys' gradients from this rank's queries are summed over the group like the towers' own."""
    if dropout and dropout > 0:
        raise UnsupportedModelError(f"ds_seqpar.hf: attention dropout {dropout} in training in {where} cannot be "
                                    f"exact under sequence parallelism; set dropout=0.0 in the config")
    if kwargs.get("output_attentions"):
        raise UnsupportedModelError(f"ds_seqpar.hf: output_attentions=True in {where}: call without it")
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def indexed_attention(where: str, query, key, value, seen, dropout: float, scaling, kwargs, sp_size: int):
    """A DeepSeek sparse attention layer (indexed.py): this rank's queries against the whole sequence's
    keys, which its pre-hook gathered, over the global top-k its indexer selected."""
    indices = kwargs.get("indices")
    n, n_global = query.shape[2], query.shape[2] * sp_size
    if dropout and dropout > 0:
        raise UnsupportedModelError(f"ds_seqpar.hf: attention dropout {dropout} in training in {where} cannot be "
                                    f"exact under sequence parallelism; set attention_dropout=0.0 in the config")
    if kwargs.get("output_attentions"):
        raise UnsupportedModelError(f"ds_seqpar.hf: output_attentions=True in {where} cannot be exact under sequence "
                                    f"parallelism; call without output_attentions")
    if indices is None or key.shape[2] != n_global or seen is None or tuple(seen.shape[-2:]) != (n, n_global):
        raise UnsupportedModelError(f"ds_seqpar.hf: {where} is an indexed attention layer but did not receive the "
                                    f"global keys, mask and top-k indices its pre-hook provides (keys {key.shape[2]}, "
                                    f"expected {n_global}; indices given: {indices is not None}); this layer's design "
                                    f"is not the DeepSeek sparse attention ds_seqpar adapts")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return sparse_attention(query, key, value, seen, indices, scale, kwargs.get("s_aux"))


def global_temperature(module, query, sp):
    """Llama 4's attention temperature tuning on NoPE layers scales each query by
    t(i) = 1 + attn_scale * log(1 + floor((i + 1) / floor_scale)) at its position i, which the layer takes
    from arange(local token count). Rescaled here by t(global) / t(local) (the ratio in float64, the
    positions as sp.position_ids gives them, as the whole-row arange the unsharded model uses); other
    layers unchanged. [b, h, s, d] in and out."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    n = query.shape[2]
    local = torch.arange(n, device=query.device)
    glob = sp.position_ids(n * sp.size, device=query.device)

    def tuned(pos):          # the layer's formula, in its float32
        return torch.log1p(torch.floor((pos.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    ratio = tuned(glob).double() / tuned(local).double()
    wide = torch.float64 if query.dtype == torch.float64 else torch.float32
    return (query.to(wide) * ratio.to(wide).view(1, 1, n, 1)).to(query.dtype)


def score_options(kwargs, n_global: int):
    """(window, softcap, sinks) of this layer's call, as transformers passes them to its attention
    functions: ``sliding_window`` (per layer: None on full-attention layers), ``softcap`` (Gemma 2),
    ``s_aux`` (gpt-oss sinks). A window that covers the whole sequence masks nothing and is dropped."""
    window = kwargs.get("sliding_window")
    window = None if window is None else effective_window(int(window), n_global)
    return window, kwargs.get("softcap"), kwargs.get("s_aux")


def is_chunked(module) -> bool:
    """Llama 4's chunked attention layers (layer_types[i] == "chunked_attention")."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None) or ()
    idx = getattr(module, "layer_idx", None)
    return idx is not None and idx < len(types) and types[idx] == "chunked_attention"


def chunked_documents(module, cu_seqlens, real_len: int):
    """A chunked layer's documents (is_chunked): a query sees the keys of its own chunk of
    ``attention_chunk_size`` global positions, i.e. documents that are the chunks intersected with
    the packed documents (if any). Other layers: ``cu_seqlens`` unchanged."""
    if not is_chunked(module):
        return cu_seqlens
    bounds = None if cu_seqlens is None else (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)
    return chunk_bounds(bounds, int(module.config.attention_chunk_size), real_len)


def _call_options(module, kwargs):
    """(causal, real global length for non-causal padding, packed-document boundaries)."""
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    seq_len = kwargs.get("sp_seq_len")
    cu_seqlens = kwargs.get("cu_seqlens")
    if cu_seqlens is None:
        # DataCollatorWithFlattening's names; q and k boundaries agree for self-attention
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is not None:
            if cu_k is not None and not torch.equal(cu_q, cu_k):
                raise UnsupportedModelError("ds_seqpar.hf: cu_seq_lens_q != cu_seq_lens_k: query and key "
                                            "documents differ (cross attention); pass one cu_seqlens")
            cu_seqlens = cu_q
    return bool(causal), seq_len, cu_seqlens


def check_call(where: str, query, key, attention_mask, dropout: float, kwargs, sp_size: int,
               causal: bool, seq_len: Optional[int]) -> None:
    """Refuse, before any communication, what this call cannot do exactly."""
    def refuse(feature: str, fix: str):
        raise UnsupportedModelError(f"ds_seqpar.hf: {feature} in {where} cannot be exact under sequence "
                                    f"parallelism; {fix}")

    if key.shape[2] != query.shape[2]:
        refuse(f"cached or cross attention (key length {key.shape[2]} != query length {query.shape[2]})",
               "train without past_key_values and use_cache=False (model.generate builds its own sharded cache)")
    if attention_mask is not None:
        refuse(f"an attention mask (shape {tuple(attention_mask.shape)})", "pass no attention_mask: causality "
               "is applied by the strategy; pack documents instead of padding")
    if dropout and dropout > 0:
        refuse(f"attention dropout {dropout} in training", "set attention_dropout=0.0 in the config")
    if kwargs.get("output_attentions"):
        refuse("output_attentions=True", "sequence-parallel attention never forms the attention weights; "
               "call without output_attentions")
    if not causal and seq_len is None:
        refuse("non-causal attention without the real sequence length",
               "pass sp_seq_len=<global length before padding> to the model call so padded keys are excluded")


def match_head_dims(q_bshd, k_bshd, v_bshd):
    """MLA (DeepSeek-V2/V3) has a value head size dv != the qk head size d. Zero-padding the smaller
    side to the larger one is exact: zero columns of q and k add nothing to the scores (the scale is
    passed explicitly), and zero columns of v give zero output columns, cropped after. Returns the
    padded (q, k, v) and dv, the width to keep."""
    d, dv = q_bshd.shape[-1], v_bshd.shape[-1]
    if dv < d:
        v_bshd = F.pad(v_bshd, (0, d - dv))
    elif dv > d:
        q_bshd, k_bshd = F.pad(q_bshd, (0, dv - d)), F.pad(k_bshd, (0, dv - d))
    return q_bshd, k_bshd, v_bshd, dv


__all__ = ["make_attention_function", "check_call", "match_head_dims", "global_temperature", "indexed_attention"]
