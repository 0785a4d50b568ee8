"""The tiny vision-language configs tests/zoo/vlm.py builds its image rows for: each family at the smallest
sizes its code accepts, its image / video token ids inside a 128-token vocabulary (120-125), and the
features that make it differ (windows, deepstack, bidirectional blocks, chunks, temperature tuning, MoE).
"""
import torch

TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=512, attention_dropout=0.0, use_cache=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, head_dim=16)
TEXT = dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
PATCH = dict(patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
# an 8 x 8 image in 2 x 2 patches, one layer: the towers of the LLaVA / Idefics families
TOWER = dict(image_size=8, patch_size=2, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
             num_attention_heads=2, attention_dropout=0.0)


def fit_mrope(cfg):
    """The config's 3-D RoPE sections (``mrope_section``: temporal, height, width frequencies) scaled to the
    tiny head's frequency count, which the defaults (sized for 128-wide heads, in the config or the modeling
    code) overrun; in place."""
    import transformers as T
    with torch.device("meta"):           # shapes only: the rotary module's inv_freq holds one entry per frequency
        model = T.AutoModelForImageTextToText.from_config(cfg)
    rotary = next((m for m in model.modules() if getattr(m, "mrope_section", None) and hasattr(m, "inv_freq")), None)
    tc = cfg.get_text_config(decoder=True)
    if rotary is None or not isinstance(getattr(tc, "rope_parameters", None), dict):
        return cfg
    section, freqs = list(rotary.mrope_section), rotary.inv_freq.shape[-1]
    if sum(section) == freqs:
        return cfg
    exact = [freqs * v / sum(section) for v in section]
    fitted = [max(1, int(v)) for v in exact]
    for i in sorted(range(len(exact)), key=lambda i: int(exact[i]) - exact[i])[:freqs - sum(fitted)]:
        fitted[i] += 1                  # the largest remainders take what rounding down left
    tc.rope_parameters["mrope_section"] = fitted
    return cfg


def _qwen2_vl():
    from transformers import Qwen2VLConfig
    return Qwen2VLConfig(text_config=dict(TEXT), vision_config=dict(PATCH, depth=1, embed_dim=32, hidden_size=64,
                                                                        num_heads=2, mlp_ratio=2), **TOKENS)


def _qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig
    # a window of 8 pixels = 2 x 2 merged patches, so the tower's windowed and full blocks both run
    return Qwen2_5_VLConfig(text_config=dict(TEXT), vision_config=dict(
        PATCH, depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=8,
        fullatt_block_indexes=[1], tokens_per_second=2), **TOKENS)


def _qwen3_vl():
    from transformers import Qwen3VLConfig
    # deepstack: the tower's first block also feeds the decoder's first layer
    return Qwen3VLConfig(text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                 "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
                         vision_config=dict(PATCH, depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                                            out_hidden_size=64, num_position_embeddings=16,
                                            deepstack_visual_indexes=[0]), **TOKENS)


def _llava():
    from transformers import LlavaConfig
    return LlavaConfig(vision_config=dict(TOWER, model_type="clip_vision_model"), text_config=dict(LLAMA, model_type="llama"),
                       image_token_id=120, vision_feature_layer=-1)


def _llava_next():
    from transformers import LlavaNextConfig
    return LlavaNextConfig(vision_config=dict(TOWER, model_type="clip_vision_model"),
                           text_config=dict(LLAMA, model_type="llama"), image_token_id=120, vision_feature_layer=-1,
                           image_grid_pinpoints=[[8, 8], [8, 16]])


def _mistral3():
    from transformers import Mistral3Config
    return Mistral3Config(vision_config=dict(TOWER, model_type="pixtral", head_dim=16),
                          text_config=dict(LLAMA, model_type="mistral", sliding_window=None), image_token_id=120,
                          spatial_merge_size=2, vision_feature_layer=-1)


def _idefics3(kind="idefics3"):
    from transformers import CONFIG_MAPPING
    return CONFIG_MAPPING[kind](vision_config=dict(TOWER), text_config=dict(LLAMA, model_type="llama"),
                                image_token_id=120, scale_factor=2)


def _gemma3():
    from transformers import Gemma3Config
    # 12 x 12 images in 2 x 2 patches pooled to 3 x 3: 9 tokens each, every image a bidirectional block
    # straddling a shard boundary; a window of 6 shorter than a block (the sliding layer's edge inside it)
    text = {k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}
    return Gemma3Config(text_config=dict(text, model_type="gemma3_text", sliding_window=6, query_pre_attn_scalar=16,
                                         layer_types=["sliding_attention", "full_attention"]),
                        vision_config=dict(TOWER, image_size=12, model_type="siglip_vision_model"),
                        mm_tokens_per_image=9, image_token_index=120, boi_token_index=124, eoi_token_index=125)


def _gemma4():
    from transformers import Gemma4Config
    # use_bidirectional_attention="vision": image blocks on the sliding layers only; 9 x 9 patches of 2 x 2
    # pixels pooled 3 x 3: 9 tokens per image, as Gemma 3's
    text = {k: v for k, v in LLAMA.items() if k != "max_position_embeddings"}
    return Gemma4Config(text_config=dict(text, model_type="gemma4_text", sliding_window=6,
                                         layer_types=["sliding_attention", "full_attention"],
                                         use_bidirectional_attention="vision", vocab_size_per_layer_input=128,
                                         hidden_size_per_layer_input=16),
                        vision_config=dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=48,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                           head_dim=16, patch_size=2, pooling_kernel_size=3,
                                           position_embedding_size=16),
                        image_token_id=120, video_token_id=121, boi_token_id=124, eoi_token_id=125)


def _llama4():
    from transformers import Llama4Config
    # layer 0: RoPE, chunks of 8 tokens (the images straddle chunk edges too); layer 1: NoPE, full, with the
    # attention temperature stepping every 4 positions (floor_scale), so it differs between the shards; both
    # MoE. An 8 x 8 image in 2 x 2 patches, pixel-shuffled (ratio 1/2) to 4 tokens: its channels
    # (hidden / ratio^2 = 128) are the adapter MLP's input, the tower's intermediate size
    text = dict(LLAMA, attention_chunk_size=8, floor_scale=4, attn_scale=0.1, no_rope_layers=[1, 0],
                layer_types=["chunked_attention", "full_attention"], num_local_experts=4, num_experts_per_tok=1,
                intermediate_size_mlp=96, interleave_moe_layer_step=1)
    return Llama4Config(text_config=text, vision_config=dict(
        image_size=8, patch_size=2, hidden_size=32, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32),
        image_token_index=120, boi_token_index=124, eoi_token_index=125)


GLM_TOKENS = dict(image_token_id=120, video_token_id=121, image_start_token_id=122, image_end_token_id=123,
                  video_start_token_id=124, video_end_token_id=125)


def _glm4v(kind="glm4v", **text):
    from transformers import CONFIG_MAPPING
    # the video as frames (GLM's get_rope_index splits its grid per frame, as Qwen3-VL's timestamps)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = CONFIG_MAPPING[kind](text_config=dict(LLAMA, rope_parameters=rope, **text), vision_config=dict(
        PATCH, depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, image_size=8),
        **GLM_TOKENS)
    return fit_mrope(cfg)


def _qwen3_vl_moe():
    from transformers import Qwen3VLMoeConfig
    base = _qwen3_vl().to_dict()
    text = dict(base["text_config"], model_type="qwen3_vl_moe_text", num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, decoder_sparse_step=1)
    return Qwen3VLMoeConfig(text_config=text, vision_config=dict(base["vision_config"], model_type="qwen3_vl_moe"),
                            **TOKENS)


def _vipllava():
    from transformers import VipLlavaConfig
    # the projector concatenates two of the tower's hidden states (the embeddings' and the layer's)
    return VipLlavaConfig(vision_config=dict(TOWER, model_type="clip_vision_model"),
                          text_config=dict(LLAMA, model_type="llama"), image_token_index=120,
                          vision_feature_layer=[0, 1])


def _aya_vision():
    from transformers import AyaVisionConfig
    # a SigLIP tower, its 4 x 4 patches pixel-shuffled (factor 2) to 4 tokens per image
    return AyaVisionConfig(vision_config=dict(TOWER, model_type="siglip_vision_model"),
                           text_config=dict(LLAMA, model_type="llama"), image_token_index=120, downsample_factor=2)


def _internvl():
    from transformers import InternVLConfig
    # an 8 x 8 image in 2 x 2 patches, pixel-shuffled (ratio 1/2) to 4 tokens
    return InternVLConfig(vision_config=dict(TOWER, image_size=[8, 8], patch_size=[2, 2]),
                          text_config=dict(LLAMA, model_type="qwen2"), image_token_id=120, image_seq_length=4)


def _lighton_ocr():
    from transformers import LightOnOcrConfig
    return LightOnOcrConfig(vision_config=dict(TOWER, model_type="pixtral", head_dim=16),
                            text_config=dict(LLAMA, model_type="qwen3"), image_token_id=120, spatial_merge_size=2)


CONFIGS = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "qwen3_vl": _qwen3_vl, "llava": _llava, "llava_next": _llava_next,
           "mistral3": _mistral3, "idefics3": _idefics3, "smolvlm": lambda: _idefics3("smolvlm"), "gemma3": _gemma3,
           "gemma4": _gemma4, "llama4": _llama4,
           "glm4v": _glm4v, "glm46v": lambda: _glm4v("glm46v"), "glm_ocr": lambda: _glm4v("glm_ocr"),
           "glm4v_moe": lambda: _glm4v("glm4v_moe", n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
           "qwen3_vl_moe": _qwen3_vl_moe, "vipllava": _vipllava, "aya_vision": _aya_vision, "internvl": _internvl,
           "lighton_ocr": _lighton_ocr}
# Qwen3-VL and GLM-4V: a video's frames are separate spans (timestamps / frame tokens between them)
FRAME_SPANS = ("qwen3_vl", "qwen3_vl_moe", "glm4v", "glm46v", "glm_ocr", "glm4v_moe", "cohere_compass", "cosmos3_omni", "cosmos3_edge",
               "qwen3_5", "qwen3_5_moe", "qwen4_exp")
