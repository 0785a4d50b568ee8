"""What a Hugging Face model may not do under sequence parallelism, checked before any communication.

transformers builds no attention mask for a custom attention key, so every feature that lives only
in the mask would be silently dropped. The ones transformers also passes to its attention functions
are made exact (attention.py): sliding windows (``sliding_window``, per layer), softcapping
(``softcap``), sinks (``s_aux``), Llama 4's chunked layers (chunks as documents) and its attention
temperature tuning (from global positions), and DeepSeek sparse attention (indexed.py). Padding and
token mixing outside attention is refused here, with the feature, the layer or config key, and what
would work, unless hf/linear/ has an adapter for the layer class (gated DeltaNet, Kimi delta
attention, short convolutions), every layer of a linear type holds one, and the strategy's layout
can carry their state (not striped; ``strategy: lasp`` is for the project's own linear models). The checks read only the config and the module tree,
identical on every rank, so every rank raises the same error; none needs a process group, so they
are unit-tested on config objects.

Made exact rather than refused: GQA (the strategies take fewer k/v heads), any ``scaling``
(Granite's attention_multiplier, Gemma's query_pre_attn_scalar), MLA's value head size != query
head size (attention.py pads and crops), sliding windows, softcapping, sinks, chunked attention.
"""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch.nn as nn

from .. import strategies
from ..errors import UnsupportedModelError
from .linear.families import LAYER_OPS, LINEAR_LAYER_TYPES, family

# model types whose attention does not go through AttentionInterface (transformers only warns when
# set_attn_implementation cannot switch them); apply.py also verifies the switch and the calls
LEGACY_MODEL_TYPES = frozenset({
    "big_bird", "bloom", "clvp", "codegen", "cpmant", "falcon", "gpt_neo", "gpt_neox_japanese", "gptj",
    "megatron-bert", "megatron_bert", "mpt", "mvp", "prophetnet", "rembert", "roformer", "rwkv", "trocr", "xglm",
})
# Unlimited-OCR's "reference sliding window": the window bounds only tokens decoded after a cached prefill; a
# training forward (no cache) is all prefill, and transformers' mask for it is the causal one (its layers pass
# no sliding_window to the attention function either)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention",
                         "reference_sliding_attention")
TOKENWISE_LAYER_TYPES = ("mlp", "moe")        # Nemotron-H's layers without a token mixer
# modules that mix tokens outside attention: the state / convolution would run on one shard only
TOKEN_MIXER_CLASS = re.compile(r"Mamba|GatedDeltaNet|ShortConv|SSM|Rwkv|RWKV|LinearAttention|Retention|Hyena|"
                               r"DeltaAttention|Lightning")
# models ds_seqpar cannot run exactly, by model type (the top config's or the decoder's): (feature, what works)
REFUSED_TYPES = {
    **{mt: ("Inkling's attention (an additive relative-position bias built per call as a dense [heads, queries, keys] "
            "tensor from the shard's local positions, short convolutions over the keys and values, and a query "
            "scaling by local position)",
            "use a model whose attention takes its positions from position_ids (RoPE) or has no position bias")
       for mt in ("inkling_text", "inkling2_text")},
    "instructblipvideo": ("InstructBLIP-Video's Q-Former reading the call's position_ids (transformers passes the "
                          "model call's keyword arguments on to it; sequence parallelism must pass each rank's global "
                          "positions, which the Q-Former would take for its instruction's)",
                          "use InstructBLIP, whose Q-Former reads only its own inputs"),
    "kosmos-2": ("Kosmos-2's image-to-text resampler (its latent queries cross-attend to the image through the "
                 "decoder's attention class, and the decoder scatters the image features into the positions "
                 "image_embeds_position_mask marks on its own shard)",
                 "apply to a model whose language model takes the merged embeddings (LLaVA-style placeholders)"),
}
# softmax attention despite the name (the model is "Kimi Linear"); the post-forward check still
# verifies that it called the registered attention function
SOFTMAX_DESPITE_NAME = frozenset({"KimiLinearAttention"})


def _mixes_outside_attention(module) -> bool:
    name = type(module).__name__
    if name in SOFTMAX_DESPITE_NAME or name.endswith("Norm"):       # Mamba2RMSNorm mixes nothing
        return False
    return bool(TOKEN_MIXER_CLASS.search(name))


def _refuse(feature: str, where: str, fix: str):
    raise UnsupportedModelError(f"ds_seqpar.hf: {feature} in {where} cannot be exact under sequence "
                                f"parallelism; {fix}")


def text_config(config):
    """The decoder's config (the config itself for a plain causal LM)."""
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if getter else config


def sliding_window_of(config) -> Optional[int]:
    """The window some layer applies, or None. Qwen2-style configs keep ``sliding_window`` but switch
    it off with use_sliding_window=False; ``layer_types`` without sliding layers means none is used."""
    tc = text_config(config)
    window = getattr(tc, "sliding_window", None)
    if window is None or getattr(tc, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(tc, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def check_config(config, training: Optional[bool] = None, linear_ok: bool = False, vision_ok: bool = False) -> None:
    """Refuse config-level features. ``training``: the mode, when known (dropout). ``linear_ok``:
    the model has adapted linear layers (check_modules then checks every linear-type layer has one).
    ``vision_ok``: a multimodal model whose decoder alone turns sequence-parallel (vision.py)."""
    tc = text_config(config)
    name = f"{type(tc).__name__} (model_type={getattr(tc, 'model_type', '?')!r})"
    model_type = getattr(tc, "model_type", "")
    for refused in {model_type, getattr(config, "model_type", "")} & set(REFUSED_TYPES):
        feature, fix = REFUSED_TYPES[refused]
        _refuse(feature, name, fix)
    if model_type in LEGACY_MODEL_TYPES or getattr(config, "model_type", "") in LEGACY_MODEL_TYPES:
        _refuse("an attention that ignores transformers' AttentionInterface", name,
                "use a model whose attention goes through the registry (Llama, Qwen2, Mistral, Gemma, GPT-2, ...)")
    if not vision_ok:
        _check_multimodal(config, tc, name)
    if getattr(config, "is_encoder_decoder", False) or getattr(tc, "add_cross_attention", False):
        _refuse("cross attention (is_encoder_decoder / add_cross_attention)", name, "use a decoder-only model")
    _check_layer_types(tc, name, linear_ok)
    dropout = getattr(tc, "attention_dropout", 0.0) or 0.0
    if training and dropout > 0:
        _refuse(f"attention dropout {dropout} in training", f"{name} config.attention_dropout",
                "set attention_dropout=0.0")


def _check_multimodal(config, tc, name: str) -> None:
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    if isinstance(rope, dict) and "mrope_section" in rope:
        _refuse("multimodal 3-D position ids (mrope_section)", f"{name} rope parameters",
                "use a text-only model with 1-D positions")
    others = [k for k in getattr(config, "sub_configs", {}) if k != "text_config" and getattr(config, k, None)]
    if others:
        _refuse(f"a multimodal model (sub-configs {others}) without a language model built from its text config",
                name, "apply to the text model alone")


# layer types that are refused for what they are, not as unknown token mixers
COMPRESSED_LAYER_TYPES = ("heavily_compressed_attention", "compressed_sparse_attention")


def _check_layer_types(tc, name: str, linear_ok: bool = False) -> None:
    allowed = ATTENTION_LAYER_TYPES + TOKENWISE_LAYER_TYPES + (LINEAR_LAYER_TYPES if linear_ok else ())
    for key in ("layer_types", "layers_block_type"):
        types = getattr(tc, key, None) or []
        for i, kind in enumerate(types):
            if key == "layers_block_type" and kind == "attention":
                continue
            if kind in COMPRESSED_LAYER_TYPES:
                # DeepSeek-V4: the compressor pools windows of compress_rate tokens counted from the layer's
                # first local token, places their RoPE and causality from that local count, and hands the
                # compressed entries' causal bias to attention only inside a tensor mask, which transformers
                # does not build for a custom attention key (the entries would be visible to every query)
                _refuse(f"compressed attention ({key}[{i}]={kind!r}: KV entries pooled over windows of "
                        f"compress_rate tokens counted from each rank's first token, with a causal bias the "
                        f"layer passes only inside an attention mask tensor)", f"{name} layer {i}",
                        "use a model whose attention reads its keys token by token (full, sliding, chunked or "
                        "DeepSeek-V3.2 indexed attention)")
            if kind not in allowed:
                # linear_ok is False here when no hybrid adapter wraps this family's layers (hf/linear/)
                what = ("a linear-attention, SSM or convolution layer of a family no hybrid adapter of ds_seqpar "
                        "wraps" if kind in LINEAR_LAYER_TYPES else "a layer type ds_seqpar does not know")
                _refuse(f"token mixing outside attention ({key}[{i}]={kind!r}: {what})", f"{name} layer {i}",
                        "use a model whose layers mix tokens only in softmax attention, or a hybrid family that "
                        "docs/hybrids.md lists")


def attention_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The softmax attention layers: the modules that must call the registered function."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and not _mixes_outside_attention(m)]


def check_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Refuse module-level features; return the attention layers. Token mixers are allowed only as
    adapted linear layers (linear/families.LAYER_OPS), and every layer whose config type is linear
    must hold one (so a layer type transformers adds later is refused, not run on one shard)."""
    adapted = [n for n, m in model.named_modules() if type(m).__name__ in LAYER_OPS]
    for n, m in model.named_modules():
        # an adapted layer, its children (its conv), and the decoder layer holding it
        if any(not n or n == a or n.startswith(a + ".") or a.startswith(n + ".") for a in adapted):
            continue
        if isinstance(m, nn.Conv1d) or _mixes_outside_attention(m):
            _refuse(f"token mixing outside attention ({type(m).__name__})", n or "the model",
                    "use a model whose layers mix tokens only in softmax attention, or one whose linear layers "
                    "ds_seqpar adapts (docs/models.md)")
    tc = text_config(model.config)
    types = getattr(tc, "layer_types", None) or []
    decoder = _decoder_layers(model, len(types))
    for i, kind in enumerate(types):
        if kind in LINEAR_LAYER_TYPES and decoder is not None and not any(
                type(m).__name__ in LAYER_OPS for m in decoder[i].modules()):
            _refuse(f"a {kind!r} layer with no adapted token mixer (layer_types[{i}])", f"{type(tc).__name__} layer {i}",
                    "use a model whose linear layers ds_seqpar adapts (docs/models.md)")
    layers = attention_modules(model)
    if not layers and not adapted:
        _refuse("no attention layer found (no module class named *Attention)", type(model).__name__,
                "use a transformers model whose attention goes through AttentionInterface")
    return layers


def _decoder_layers(model: nn.Module, count: int):
    """The ModuleList of decoder layers (the one with one entry per layer_types item)."""
    if not count:
        return None
    return next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == count), None)


def check_hybrid(model: nn.Module, sp_config, linear_layers) -> None:
    """A model with linear layers: the softmax strategy must lay tokens out in runs the linear layers
    can pass state along (contiguous, zigzag; not striped), and ``strategy: lasp`` is refused."""
    if not linear_layers:
        return
    kind = type(linear_layers[0][1]).__name__
    where = f"{type(model).__name__} ({kind} layers)"
    if sp_config.strategy == "lasp":
        _refuse("sequence_parallel.strategy='lasp' on a transformers model", where,
                "set strategy to the softmax layers' strategy (ulysses, ring or zigzag) and "
                "linear_strategy='lasp' (the default) for the linear layers")
    if sp_config.strategy == "striped":
        _refuse(f"sequence_parallel.strategy='striped' with {family(kind)} layers (one-token runs: every "
                "token's state and conv inputs would come from another rank)", where,
                "use strategy ulysses, ring or zigzag")


def check_heads(config, sp_config) -> None:
    """The strategy must be able to split these heads (Ulysses: heads over ranks). ``sp_config``:
    the SequenceParallelConfig, so this runs before any process group exists."""
    tc = text_config(config)
    for heads, kv_heads in _head_counts(tc):
        if heads is None:
            continue
        kv_heads = kv_heads or heads
        try:
            strategies.check_heads(sp_config, int(heads), int(kv_heads))
        except ValueError as err:
            raise UnsupportedModelError(f"ds_seqpar.hf: {type(tc).__name__} num_attention_heads={heads}, "
                                        f"num_key_value_heads={kv_heads}: {err}") from None


def _head_counts(tc):
    """{(q heads, k/v heads)} of the layers: per layer where the config sets them per layer (dots3's
    per_layer_config, whose global attributes refuse to be read), else the config's own."""
    per_layer = getattr(tc, "per_layer_config", None)
    configs = [per_layer[i] for i in range(tc.num_hidden_layers)] if per_layer is not None else [tc]
    return {(getattr(c, "num_attention_heads", None), getattr(c, "num_key_value_heads", None)) for c in configs}


def check_dropout(layers, training: bool) -> None:
    if not training:
        return
    for n, m in layers:
        p = getattr(m, "attention_dropout", 0.0) or 0.0
        if isinstance(p, (int, float)) and p > 0:
            _refuse(f"attention dropout {p} in training", f"{n} ({type(m).__name__})",
                    "set config.attention_dropout=0.0 or call model.eval()")


__all__ = ["UnsupportedModelError", "check_config", "check_modules", "check_hybrid", "check_heads", "check_dropout",
           "attention_modules", "sliding_window_of", "text_config", "LEGACY_MODEL_TYPES"]
