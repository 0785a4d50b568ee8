"""DeepSeek sparse attention (transformers' "indexed_attention" layers: DeepSeek-V3.2, GLM-5
``glm_moe_dsa``, HY-V4, dots3, AXK2) under sequence parallelism, exact whatever the softmax strategy.

The lightning indexer scores each query against every earlier key of the WHOLE sequence,
``sum_h w[q, h] * relu(q_h . k)``, and keeps the top ``index_topk``; the attention then reads only those
keys. A rank's own keys give the wrong top-k, so the layer must see all N keys. transformers' layer
asks a cache for the keys it attends to (``update``: the MLA latents, ``update_indexer``: the indexer
keys); a forward pre-hook on each indexed layer hands it

  * ``GlobalKeys``: a key source whose ``update`` / ``update_indexer`` all-gather this rank's latents /
    indexer keys over the sequence group, in global order. The layer then expands all N keys itself
    (its own kv_b_proj), and its own indexer scores this rank's n queries against all N indexer keys
    and takes the top-k of each query's whole row: the rows the unsharded model ranks, the same keys in
    the same order, so the selection (ties included, broken as ``torch.topk`` breaks them) is the
    unsharded model's. The indices it returns are global positions.
  * the mask [b, 1, n, N] of this rank's queries over the global keys (causal, packed documents, end
    padding; masks.Mask), which transformers does not build for a custom attention key.

The attention function (attention.py) then gets [b, h, n, d] queries, [b, h, N, d] keys and values
and the indices, and ``sparse_attention`` computes each query's softmax over its selected, visible
keys (sinks, as HY-V4 passes them, join the denominator). Layers that reuse an earlier layer's
selection (GLM's and HY-V4's "shared" indexer_types) reuse those global indices.

Training rules are transformers' own: the indexer runs under ``torch.no_grad`` in every one of these
models (no indexer loss), so its weights get no gradient, sharded or not; the indices are integers.

What travels, per indexed layer and rank (strategies/closed_form.indexed_attention_bytes), n = N / P:
forward, the latents (n x (kv_lora_rank + qk_rope_head_dim)) and, where the layer has its own indexer,
the indexer keys (n x index_head_dim, no gradient) all-gathered; backward, the latents' gradients
reduce-scattered. Neither grows with heads or top-k. The cost: every rank expands the N latents
(kv_b_proj over N tokens, P times its share) and holds the N expanded keys and values; the indexer
scores n x N pairs (1/P of the unsharded model's). A ring over latent blocks would bound that memory
(docs/hf.md says when it pays).
"""
from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from ..masks import Mask
from ..sharding.documents import as_boundaries, check_documents
from .checks import UnsupportedModelError, text_config

INDEXED = "indexed_attention"


def is_indexed(module) -> bool:
    """A DSA attention layer: its layer type is indexed_attention and it holds an ``indexer`` slot (None
    on layers that reuse an earlier layer's selection) beside MLA's ``expand_kv``."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None) or ()
    idx = getattr(module, "layer_idx", None)
    return (idx is not None and idx < len(types) and types[idx] == INDEXED and hasattr(module, "indexer")
            and hasattr(module, "expand_kv"))


def indexed_layers(model: nn.Module, layers) -> List[Tuple[str, nn.Module]]:
    """The attention layers among ``layers`` that are indexed; refuses an indexed_attention layer of
    another design (its keys would reach it some other way than the latent cache)."""
    out = [(n, m) for n, m in layers if is_indexed(m)]
    types = getattr(text_config(model.config), "layer_types", None) or ()
    if INDEXED in types and not out:
        raise UnsupportedModelError(f"ds_seqpar.hf: indexed_attention layers in {type(model).__name__} whose "
                                    f"attention is not DeepSeek sparse attention (no indexer beside MLA's expand_kv) "
                                    f"cannot be exact under sequence parallelism; ds_seqpar makes DeepSeek-V3.2-style "
                                    f"layers exact (deepseek_v32, glm_moe_dsa, hy_v4, dots3, axk2)")
    return out


def check_topk(config, n_global: int) -> None:
    """The indexer's top-k must not exceed the sequence (refused on every rank alike: config and shapes)."""
    tc = text_config(config)
    if INDEXED not in (getattr(tc, "layer_types", None) or ()):
        return
    k = getattr(tc, "index_topk", None)
    if k is not None and int(k) > n_global:
        raise UnsupportedModelError(
            f"ds_seqpar.hf: the indexer's top-k (config.index_topk={k}) is larger than the sequence ({n_global} "
            f"tokens over the sequence group) in {type(tc).__name__}: every key would be selected, which is dense "
            f"attention, not the sparse attention the model was trained with; train on sequences of at least "
            f"{k} tokens or set config.index_topk <= {n_global}")


class GlobalKeys:
    """What an indexed layer reads from its cache, for the whole sequence in global order: its
    ``update`` (MLA latents, differentiable: their gradients go home by reduce-scatter) and
    ``update_indexer`` (the indexer keys, under the indexer's no_grad). Nothing is stored."""

    def __init__(self, sp):
        self.sp = sp

    def _gather(self, local, dim: int, kind: str):
        parts = ops.all_gather(local.contiguous(), dim, self.sp.group, self.sp.stats, kind=kind)
        return self.sp.layout.unshard(list(parts.chunk(self.sp.size, dim=dim)), dim)

    def update(self, k_pass, k_rot, layer_idx: int, **_):     # transformers >= 5.24 also passes kwargs=
        # [b, 1, n, kv_lora_rank] and [b, 1, n, rope] -> [b, 1, N, .]: one all-gather for both
        width = k_pass.shape[-1]
        full = self._gather(torch.cat([k_pass, k_rot], dim=-1), 2, "dsa_latent")
        return full[..., :width], full[..., width:]

    def update_indexer(self, keys_bnd, layer_idx: int):
        return self._gather(keys_bnd, 1, "dsa_index_keys")      # [b, n, d] -> [b, N, d]


class IndexedState:
    """The indexed layers of one applied model and this forward's mask (every layer shares it)."""

    def __init__(self, layers):
        self.ids = {id(m) for _, m in layers}
        self._mask_key, self._mask = None, None

    def mask(self, sp, batch: int, n: int, device, cu_seqlens, seq_len: Optional[int]) -> torch.Tensor:
        """bool [b, 1, n, N]: which global keys each of this rank's queries sees. Every query sees itself
        (end padding's queries see nothing else; their rows stay finite and no real query reads them)."""
        bounds = None if cu_seqlens is None else as_boundaries(cu_seqlens)
        padded = n * sp.size
        key = (batch, n, bounds, seq_len, str(device))
        if key != self._mask_key:
            if bounds is not None:
                try:
                    check_documents(bounds, batch, padded, sp.layout.required_multiple, seq_len)
                except ValueError as err:
                    raise UnsupportedModelError(f"ds_seqpar.hf: {err}") from None
            q_pos = sp.position_ids(padded, device=device)
            k_pos = torch.arange(padded, device=device)
            seen = Mask.from_boundaries(bounds, True, None, seq_len).visible(q_pos, k_pos, padded)
            seen |= q_pos[:, None] == k_pos[None, :]
            self._mask_key, self._mask = key, seen
        return self._mask[None, None].expand(batch, 1, n, padded)


def install(layers, state) -> list:
    """A forward pre-hook on each indexed layer: the global key source and mask in place of the cache
    and mask transformers passes (None under sequence parallelism: the model's pre-hook refuses caches)."""
    handles = []
    for _, module in layers:
        params = inspect.signature(module.forward).parameters
        names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        # the layer's cache argument: "past_key_values" up to transformers 5.23, "cache" from 5.24 (the old
        # name then deprecated: given beside the decoder's cache=None it would be dropped)
        cache_arg = "cache" if "cache" in params else "past_key_values"

        def pre(mod, args, kwargs, names=names, cache_arg=cache_arg):
            call = dict(zip(names, args), **kwargs)
            hidden = call["hidden_states"]
            cu_seqlens = call.get("cu_seqlens")
            if cu_seqlens is None:
                cu_seqlens = call.get("cu_seq_lens_q")
            call["attention_mask"] = state.indexed.mask(state.sp, hidden.shape[0], hidden.shape[1], hidden.device,
                                                        cu_seqlens, call.get("sp_seq_len"))
            call.pop("past_key_values", None)
            call[cache_arg] = GlobalKeys(state.sp)
            return (), call

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    return handles


def sparse_attention(query, key, value, seen, indices, scale: float, sinks=None) -> torch.Tensor:
    """Each query's softmax over the keys it both sees and selected. query [b, h, n, d]; key [b, hk, N, d];
    value [b, hk, N, dv]; seen bool [b, 1, n, N]; indices [b, n, k] global key positions; sinks [h] or
    None. Returns [b, n, h, dv] (transformers' attention output layout). Without sinks PyTorch's fused
    SDPA with the boolean mask; with sinks written out, scores and softmax in fp32 (fp64 for fp64
    inputs). The query's own key is always among the allowed ones, so no row is empty."""
    b, h, n, _ = query.shape
    if key.shape[1] != h:                                     # grouped k/v heads
        key, value = (t.repeat_interleave(h // key.shape[1], dim=1) for t in (key, value))
    chosen = torch.zeros(b, n, key.shape[2], dtype=torch.bool, device=query.device)
    chosen.scatter_(-1, indices.long(), True)
    allowed = seen & chosen[:, None]                          # [b, 1, n, N]
    if sinks is None:       # the fused kernel, as transformers' SDPA path masks the whole sequence
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale)
        return out.transpose(1, 2)
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = torch.matmul(query.to(acc), key.to(acc).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    scores = torch.cat([scores, sinks.to(acc).view(1, h, 1, 1).expand(b, h, n, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :-1]          # the sink's share dropped
    out = torch.matmul(probs.to(value.dtype), value)         # [b, h, n, dv]
    return out.transpose(1, 2)


__all__ = ["INDEXED", "is_indexed", "indexed_layers", "check_topk", "GlobalKeys", "IndexedState", "install",
           "sparse_attention"]
