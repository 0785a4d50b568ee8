"""The last tiny vision-language configs for tests/zoo/vlm.py: the types whose zoo config (tests/zoo/decoders.py) does not
build or whose towers need hand sizes; the sizes of tests/zoo/vlm_configs.py (LLAMA decoders, 8 x 8 images in 2 x 2
patches, one-layer towers), image token 120."""
from .vlm_configs import LLAMA, TOWER
from .vlm_configs_more import from_zoo

# VQ image tokenizers: their GroupNorms have 32 groups, so 32 channels
VQ = dict(base_channels=32, channel_multiplier=[1], num_res_blocks=1, latent_channels=32, embed_dim=8)


def _janus():
    from transformers import JanusConfig
    # understanding path: a SigLIP-style tower (16 tokens per image) and its aligner; the VQ model and the
    # generation head (image generation only) built at VQ's sizes
    return JanusConfig(vision_config=dict(TOWER, projection_dim=64, num_image_tokens=16),
                       vq_config=dict(VQ, num_embeddings=8, projection_dim=64, image_token_embed_dim=64, num_patches=2),
                       text_config=dict(LLAMA, model_type="llama"), image_token_id=120)


def _granite4_vision():
    from transformers import CONFIG_MAPPING
    # LLaVA-NeXT tiles (the image and one 8 x 8 tile, 4 x 4 patches each) through window Q-Formers that pool every
    # 2 x 2 window to one query (downsample_rate "1/2"): 10 features an image (4, then 2 x 2 and a newline per row);
    # deepstack: the tower's embeddings feed layer 0, its last layer's four spatial offsets layers 1-4 (five layers,
    # so no injection overwrites another); the Q-Former at one layer, one head (its width: the tower's, 64) and
    # without dropout, which would differ between the runs compared
    return CONFIG_MAPPING["granite4_vision"](
        vision_config=dict(TOWER, model_type="clip_vision_model", hidden_size=64, num_attention_heads=4),
        text_config=dict(LLAMA, num_hidden_layers=5),
        qformer_config=dict(num_hidden_layers=1, intermediate_size=64, cross_attention_frequency=1, vocab_size=8,
                            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            use_qformer_text_input=False),
        image_token_index=120, image_grid_pinpoints=[[8, 8]], downsample_rate="1/2", deepstack_layer_map=[[0, 0]],
        spatial_target_layers=[1, 2, 3, 4], vision_feature_layer=-1, projector_dropout=0.0)


def _chameleon():
    from transformers import ChameleonConfig
    # images become VQ codes (16 an image: one 2x downsampling of 8 x 8) that index the decoder's own vocabulary
    # (vocabulary_map: code i -> token 110 + i, outside the row's text ids, whose logits Chameleon masks)
    vocab = {"<image>": 120, **{f"IMGIMG{chr(ord('A') + i)}Z": 110 + i for i in range(8)}}
    return ChameleonConfig(**{k: v for k, v in LLAMA.items() if k != "head_dim"}, image_token_id=120,
                           vq_config=dict(VQ, channel_multiplier=[1, 1], num_embeddings=8, resolution=8),
                           vocabulary_map=vocab)


def _emu3():
    from transformers import Emu3Config
    # as Chameleon's, codes in the vocabulary (110-117) and a row-end token (118) after each row of them: 4 x 4 codes,
    # 20 tokens an image; no temporal downsampling (an image is one frame), no attention blocks in the VQ model
    vocab = {"<image>": 120, "<|extra_200|>": 118, **{f"<|visual token{i:06d}|>": 110 + i for i in range(8)}}
    return Emu3Config(vq_config=dict(VQ, channel_multiplier=[1, 1], latent_channels=4, embed_dim=4, codebook_size=8,
                                     attn_resolutions=[], temporal_downsample_factor=1, hidden_size=32),
                      text_config=dict(LLAMA, model_type="emu3_text_model"), vocabulary_map=vocab, image_token_id=120)


CONFIGS = {"janus": _janus, "granite4_vision": _granite4_vision, "chameleon": _chameleon, "emu3": _emu3}
CONFIGS.update({
    # a one-layer tower of 2 x 2 patches; the indexer's top-k (8) a multiple of its key pooling (16 by default)
    "glm5_next": lambda: from_zoo("glm5_next", {"vision_config": dict(depth=1, patch_size=2, image_size=8)},
                                  built={"text_config": {"index_kpool": 4}}),
    # 3-D RoPE sections summing to half the tiny head (16), which the constructor checks
    "cosmos3_edge": lambda: from_zoo("cosmos3_edge", built={"text_config": {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}}}),
    # one crop of 4 x 4 patches an image (its position table: one entry per patch); the adapter reads the tower's
    # last two layers (of the two it keeps); image_token_id and video_token_id are one field (image_patch_id)
    "molmo2": lambda: from_zoo("molmo2", {"vision_config": dict(image_size=[8, 8], patch_size=2, num_position_embeddings=16)},
                               built={"adapter_config": {"vision_feature_layer": [-1, -2]}}, image_token_id=120),
})
