"""More tiny vision-language configs for tests/zoo/vlm.py (the families beyond tests/zoo/vlm_configs.py): the same
sizes (LLAMA decoders, 8 x 8 images in 2 x 2 patches, one-layer towers), image token 120."""
from .vlm_configs import LLAMA, TOWER


def _cohere2_vision():
    from transformers import Cohere2VisionConfig
    # a SigLIP tower pixel-shuffled (factor 2): 4 x 4 patches to 4 tokens per image
    return Cohere2VisionConfig(vision_config=dict(TOWER, model_type="siglip_vision_model"),
                               text_config=dict(LLAMA, model_type="cohere2", layer_types=["sliding_attention", "full_attention"],
                                                sliding_window=6),
                               image_token_id=120, downsample_factor=2, alignment_intermediate_size=64)


def _deepseek_vl():
    from transformers import DeepseekVLConfig
    return DeepseekVLConfig(vision_config=dict(TOWER, model_type="siglip_vision_model"),
                            text_config=dict(LLAMA, model_type="llama"), image_token_id=120)


def _fuyu():
    from transformers import FuyuConfig
    # no tower: each 2 x 2 x 3 patch is one linear embedding
    return FuyuConfig(text_config=dict(LLAMA, model_type="persimmon", qk_layernorm=False), patch_size=2,
                      num_channels=3, image_size=8, hidden_size=64, vocab_size=128, image_token_id=120)


def _llava_onevision():
    from transformers import LlavaOnevisionConfig
    # 4 x 4 images and frames: an image with its high-resolution tile and a video fit one row
    return LlavaOnevisionConfig(vision_config=dict(TOWER, model_type="siglip_vision_model", image_size=4),
                                text_config=dict(LLAMA, model_type="qwen2"), image_token_index=120,
                                video_token_index=121, vision_feature_layer=-1, image_grid_pinpoints=[[4, 4], [4, 8]])


def _llava_next_video():
    from transformers import LlavaNextVideoConfig
    return LlavaNextVideoConfig(vision_config=dict(TOWER, model_type="clip_vision_model", image_size=4),
                                text_config=dict(LLAMA, model_type="llama"), image_token_index=120,
                                video_token_index=121, vision_feature_layer=-1, image_grid_pinpoints=[[4, 4], [4, 8]])


def _video_llava():
    from transformers import VideoLlavaConfig
    # 4 x 4 frames and images (5 tokens each): a video's frames keep every patch
    return VideoLlavaConfig(vision_config=dict(TOWER, model_type="clip_vision_model", image_size=4),
                            text_config=dict(LLAMA, model_type="llama"), image_token_index=120, video_token_index=121,
                            vision_feature_layer=-1)


def _ovis2():
    from transformers import Ovis2Config
    return Ovis2Config(vision_config=dict(TOWER, model_type="ovis2_vision", vocab_size=32, num_visual_indicator_tokens=5,
                                          hidden_stride=2),
                       text_config=dict(LLAMA, model_type="qwen2"), hidden_size=64, vocab_size=128,
                       image_token_id=120, visual_indicator_token_ids=[121, 122, 123, 124, 125])


def _idefics2():
    from transformers import Idefics2Config
    return Idefics2Config(vision_config=dict(TOWER), text_config=dict(LLAMA, model_type="mistral", sliding_window=None),
                          perceiver_config=dict(hidden_size=64, resampler_n_latents=4, resampler_depth=1,
                                                resampler_n_heads=2, resampler_head_dim=16, num_key_value_heads=2),
                          image_token_id=120)


def _aria():
    from transformers import AriaConfig
    # 4 x 4 patches mapped to 4 queries each
    return AriaConfig(vision_config=dict(TOWER, model_type="idefics3_vision"),
                      text_config=dict(LLAMA, model_type="aria_text", moe_num_experts=4, moe_topk=2,
                                       moe_intermediate_size=32, moe_num_shared_experts=1),
                      projector_patch_to_query_dict={16: 4}, image_token_index=120)


# BLIP-2 / InstructBLIP: the Q-Former's 8 learned queries read the image and become the image's 8 placeholders;
# an OPT decoder (BLIP-2) and a Llama one (InstructBLIP, whose Q-Former also reads an instruction)
QFORMER = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, encoder_hidden_size=32,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=128)
OPT = dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, max_position_embeddings=512,
           word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
           use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, model_type="opt")


def _blip_2():
    from transformers import Blip2Config
    return Blip2Config(vision_config=TOWER, qformer_config=QFORMER, text_config=OPT, num_query_tokens=8,
                       image_token_id=120)


def _instructblip():
    from transformers import InstructBlipConfig
    return InstructBlipConfig(vision_config=TOWER, qformer_config=QFORMER, text_config=dict(LLAMA, model_type="llama"),
                              num_query_tokens=8, image_token_id=120)


def _blip():
    from transformers import BlipConfig
    return BlipConfig(vision_config=dict(TOWER, image_size=8), text_config=dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
        encoder_hidden_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, use_cache=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, sep_token_id=3),
        projection_dim=32, image_text_hidden_size=32)


def _idefics():
    from transformers import IdeficsConfig
    # cross-attention layers after every decoder layer, to the tower's patches (no perceiver resampler)
    return IdeficsConfig(**{k: LLAMA[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "use_cache", "bos_token_id", "eos_token_id",
                                                  "pad_token_id")},
                         additional_vocab_size=0, cross_layer_interval=1, dropout=0.0,
                         vision_config=dict(embed_dim=32, image_size=8, patch_size=2, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=48),
                         perceiver_config=dict(use_resampler=False))


def _instructblipvideo():
    from transformers import InstructBlipVideoConfig
    # 4 queries a frame: a video of two frames has 8 placeholders
    return InstructBlipVideoConfig(vision_config=TOWER, qformer_config=QFORMER, text_config=dict(LLAMA, model_type="llama"),
                                   num_query_tokens=4, video_token_index=121)


CONFIGS = {"cohere2_vision": _cohere2_vision, "deepseek_vl": _deepseek_vl, "fuyu": _fuyu,
           "llava_onevision": _llava_onevision, "llava_next_video": _llava_next_video, "video_llava": _video_llava,
           "ovis2": _ovis2, "idefics2": _idefics2, "aria": _aria, "blip": _blip, "idefics": _idefics, "blip-2": _blip_2, "instructblip": _instructblip,
           "instructblipvideo": _instructblipvideo}


VISION_TOKENS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
                     image_token_index=120, video_token_index=121)


def from_zoo(model_type, sub=None, built=None, **top):
    """The zoo's generic tiny config (tests/zoo/decoders.py: every size key shrunk, its text row exact) with the vision
    token ids it has moved inside the 128-token vocabulary (120-123); ``sub``: {sub-config: {key: value}} (tiny
    images), ``top``: the top config's keys; ``built``: keys its constructor needs (validated there), as ``sub``."""
    from transformers import CONFIG_MAPPING
    from .vlm_configs import fit_mrope
    from .decoders import _tiny_kwargs, tiny_config
    if built:
        kw = _tiny_kwargs(CONFIG_MAPPING[model_type](), sizes=True)
        kw.update({k: dict(kw.get(k) or {}, **v) for k, v in built.items()})
        cfg = fit_mrope(CONFIG_MAPPING[model_type](**kw))
    else:
        cfg = fit_mrope(tiny_config(model_type))
    for key, token in VISION_TOKENS.items():
        if getattr(cfg, key, None) is not None:
            setattr(cfg, key, token)
    for name, values in (sub or {}).items():
        for key, value in values.items():
            setattr(getattr(cfg, name), key, value)
    for key, value in top.items():
        setattr(cfg, key, value)
    return cfg


SMALL = dict(image_size=8, patch_size=2)         # an 8 x 8 image in 2 x 2 patches
QWEN_TOWER = dict(depth=1, patch_size=2, out_hidden_size=64, num_position_embeddings=16)
GATED_DELTA = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


ZOO = ("deepseek_vl_hybrid", "exaone4_5", "granite_docling", "glmga", "kimi_k25", "lfm2_vl", "lfm3_vl", "minicpm_ocr",
       "minicpmv4_6", "minicpmv4_7", "minimax_m3_vl", "mistral_large4", "muse_glimmer", "hyperclovax_vision_v2",
       "qianfan_ocr", "shieldgemma2", "gemma4_unified", "cohere_compass", "cosmos3_omni", "dots3_note",
       "nemotron_h_omni", "paddleocr_vl", "video_llama_3")
CONFIGS.update({mt: (lambda mt=mt: from_zoo(mt)) for mt in ZOO})


def _dots3_note():
    cfg = from_zoo("dots3_note")
    cfg.vision_config.num_experts_per_tok = 1      # the tower's second layer keeps one expert (per_layer_config)
    return cfg


def _muse_glimmer():
    cfg = from_zoo("muse_glimmer")
    cfg.out_hidden_size = cfg.vision_config.hidden_size * cfg.vision_config.merge_size ** 2   # the merged patch's width
    return cfg


def _muse_spark():
    # Muse Glimmer's tower beside an audio tower (not run: no audio in the rows) shrunk to two small stages
    cfg = from_zoo("muse_spark", built={"audio_config": {"hidden_sizes": [16, 32], "depths": [1, 1]}})
    cfg.out_hidden_size = cfg.vision_config.hidden_size * cfg.vision_config.merge_size ** 2
    return cfg


def _gemma4_unified():
    # no tower: 2 x 2 x 3 patches projected (pooling 1), 9 per image with their (x, y) positions, as Gemma 4's
    cfg = from_zoo("gemma4_unified").to_dict()
    cfg["vision_config"] = dict(patch_size=2, pooling_kernel_size=1, mm_embed_dim=32, mm_posemb_size=16,
                                output_proj_dims=32)
    return type(from_zoo("gemma4_unified")).from_dict(cfg)


CONFIGS.update(dots3_note=_dots3_note, muse_glimmer=_muse_glimmer, muse_spark=_muse_spark, gemma4_unified=_gemma4_unified)
CONFIGS.update({
    # SAM's high-resolution tower: 64 x 64 in 4 x 4 patches, its neck's two stride-2 convolutions to 4 x 4, as
    # many features as the low-resolution tower's
    "deepseek_vl_hybrid": lambda: from_zoo("deepseek_vl_hybrid", {"vision_config": SMALL, "high_res_vision_config": dict(
        image_size=64, patch_size=4, window_size=4, global_attn_indexes=[1])}),
    "granite_docling": lambda: from_zoo("granite_docling", {"vision_config": dict(SMALL, scale_factor=2)}),
    "lfm2_vl": lambda: from_zoo("lfm2_vl", {"vision_config": dict(patch_size=2, num_patches=16)}),
    "qianfan_ocr": lambda: from_zoo("qianfan_ocr", {"vision_config": dict(image_size=[8, 8], patch_size=[2, 2])},
                                    image_seq_length=4),
    "mistral_large4": lambda: from_zoo("mistral_large4", {"vision_config": SMALL}),
    **{mt: (lambda mt=mt: from_zoo(mt, {"vision_config": SMALL}, image_token_id=120, video_token_id=121,
                                   downsample_mode="4x")) for mt in ("minicpm_ocr", "minicpmv4_6", "minicpmv4_7")},
    # RADIO: 2 x 2 x 3 patches, a position table of 8 x 8 patches; pixel-shuffled (ratio 1/2) to 4 tokens per image
    "nemotron_h_omni": lambda: from_zoo("nemotron_h_omni", {"vision_config": dict(
        SMALL, patch_dim=12, video_patch_dim=24, max_img_size=16)}, image_token_id=120, video_token_id=121),
    # the zoo's tiny config keeps the towers' depth and widths and the gated DeltaNet's head sizes (3-4M parameters)
    **{mt: (lambda mt=mt: from_zoo(mt, {"vision_config": QWEN_TOWER, "text_config": GATED_DELTA}))
       for mt in ("qwen3_5", "qwen3_5_moe", "qwen4_exp")},
    # the thinkers' get_rope_index reads vision_start_token_id, a field their config class does not have
    **{mt: (lambda mt=mt: from_zoo(mt, {"vision_config": dict(depth=1, patch_size=2, out_hidden_size=64)},
                                   vision_start_token_id=122))
       for mt in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")},
    # the zoo's tiny config fails its constructor's checks or transformers' own code: the keys they need
    "ernie4_5_vl_moe": lambda: from_zoo("ernie4_5_vl_moe", built={"text_config": {"moe_intermediate_size": [32, 32],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}}}),
    "step3p7": lambda: from_zoo("step3p7", {"vision_config": dict(image_size=16, patch_size=2)}, built={"text_config": {"sliding_window": 8}}),
    "hunyuan_vl": lambda: from_zoo("hunyuan_vl", built={"text_config": {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}}),
    "shieldgemma2": lambda: from_zoo("shieldgemma2", {"vision_config": dict(image_size=12, patch_size=2)},
                                     mm_tokens_per_image=9),
})
def _unlimited_ocr():
    # DeepSeek-OCR's towers: SAM (16 x 16 images in 2 x 2 patches, its neck's two stride-2 convolutions to 2 x 2)
    # whose features are the patch embeddings of a CLIP encoder (2 x 2 positions); 7 features an image (a newline
    # after each row, a view separator)
    cfg = from_zoo("unlimited_ocr")
    sam = dict(hidden_size=16, output_channels=16, num_hidden_layers=1, global_attn_indexes=[0], num_attention_heads=2,
               image_size=16, patch_size=2, window_size=4, mlp_dim=32, downsample_channels=[16, 16])
    clip = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                patch_size=14)
    for sub, values in ((cfg.vision_config.sam_config, sam), (cfg.vision_config.encoder_config, clip)):
        for key, value in values.items():
            setattr(sub, key, value)
    return cfg


CONFIGS.update(unlimited_ocr=_unlimited_ocr)
# towers whose patch embedding is a convolution over [C, p, p] patches (the others reshape a flat row)
CHW_PATCHES = ("kimi_k25", "paddleocr_vl")
# Kimi-K2.5's tower pools a video's frames into one, but transformers splits its features per t * h * w: a
# multi-frame video does not run unsharded, so its rows hold a one-frame video
ONE_FRAME_VIDEOS = ("kimi_k25",)


def _mllama():
    from transformers import MllamaConfig
    # Llama 3.2 Vision: the images reach the decoder through its cross-attention layer (layer 1), not placeholders;
    # two tiles of 8 x 8 in 4 x 4 patches per image (5 tokens a tile with the class token)
    return MllamaConfig(vision_config=dict(hidden_size=16, num_hidden_layers=1, num_global_layers=1, attention_heads=2,
                                           intermediate_size=32, image_size=8, patch_size=4, max_num_tiles=2,
                                           intermediate_layers_indices=[0], vision_output_dim=32,
                                           supported_aspect_ratios=[[1, 1], [1, 2]]),
                        text_config=dict(LLAMA, model_type="mllama_text_model", cross_attention_layers=[1]),
                        image_token_index=120)


CONFIGS.update(mllama=_mllama)
