"""Vision-language models under sequence parallelism: tiny random-init models of each family, a row of
text with images (and a video) whose placeholders straddle the shard boundaries of every layout at P=2,
trained one step under every softmax strategy: exact against the unsharded model (logits, loss, every
parameter gradient summed over the sequence group, the vision tower's included; float64-derived bounds
as in tests/zoo/decoders.py) or refused by name. tests/dist/test_hf_vlm.py runs it.

Row layout (SEQ = 64 tokens; P=2 boundaries: contiguous 32, zigzag 16 / 32 / 48, striped every token):
every image's (and video's) placeholders centred on one of 16, 32, 48 (row()).
"""
import inspect

import torch

from ds_seqpar.hf.vision import VIDEO_AS_IMAGE_TOKENS

from .vlm_configs import CONFIGS as FIRST, FRAME_SPANS, fit_mrope  # noqa: F401 - fit_mrope: the tests' name
from .vlm_configs_more import CHW_PATCHES, CONFIGS as MORE, ONE_FRAME_VIDEOS
from .vlm_configs_rest import CONFIGS as REST
from .decoders import STRATEGIES, _gradient_ratio, _worst, message, verdict


SEQ = 64
CONFIGS = {**FIRST, **MORE, **REST}
IMAGE_GRIDS = ((1, 4, 4), (1, 4, 8))           # Qwen-VL: 4 and 8 placeholders (merge 2 x 2)
VIDEO_GRID = (2, 4, 4)                         # 8 placeholders
# the LLaVA families that take a video as frames of the images' size: its frames in the row (Video-LLaVA's tower
# keeps every patch and the class token of each frame: 5 tokens a frame; the others pool a frame to one token)
VIDEO_FRAMES = {"llava_onevision": 8, "llava_next_video": 8, "video_llava": 2}
# the [batch, seq] inputs that carry row()'s token types, as each model's forward names them
TYPE_KEYS = ("mm_token_type_ids", "token_type_ids")


def _merge(v):
    """The tower's spatial merge (side of the square of patches one feature pools)."""
    merge = getattr(v, "spatial_merge_size", None) or getattr(v, "merge_size", None) or getattr(v, "merge_kernel_size", 1)
    return merge[0] if isinstance(merge, (list, tuple)) else merge


def _grid_inputs(cfg, g, model):
    """Qwen-VL style: patches flattened to rows of C * tp * p * p (CHW_PATCHES: rows of [C, p, p] for a
    convolution), grids (t, h, w) in patches; two images and a video (where the model takes one)."""
    v = cfg.vision_config
    channels = getattr(v, "in_channels", None) or getattr(v, "num_channels", 3)
    patch = (channels, v.patch_size, v.patch_size) if cfg.model_type in CHW_PATCHES else \
        (channels * (getattr(v, "temporal_patch_size", None) or getattr(v, "patch_temporal", 1)) * v.patch_size ** 2,)
    images = torch.tensor(IMAGE_GRIDS)
    video = torch.tensor([(1, *VIDEO_GRID[1:]) if cfg.model_type in ONE_FRAME_VIDEOS else VIDEO_GRID])
    out = {"pixel_values": torch.randn(int(images.prod(-1).sum()), *patch, generator=g), "image_grid_thw": images,
           "pixel_values_videos": torch.randn(int(video.prod(-1).sum()), *patch, generator=g), "video_grid_thw": video}
    if hasattr(cfg.vision_config, "tokens_per_second"):
        out["second_per_grid_ts"] = torch.tensor([1.0])
    accepted = inspect.signature(model.forward).parameters
    merge = 2 if "image_merge_sizes" in accepted else _merge(v)
    if "image_merge_sizes" in accepted:       # VideoLLaMA3: the merge is an input, one per image and per video
        out.update(image_merge_sizes=torch.tensor([merge] * len(images)), video_merge_sizes=torch.tensor([merge]))
    merge = merge ** 2
    spans = [(n, cfg.image_token_id, 1) for n in _feature_counts(model, out, len(IMAGE_GRIDS))]
    t, h, w = video[0].tolist()
    if "pixel_values_videos" not in accepted or getattr(cfg, "video_token_id", None) is None:
        return {k: out[k] for k in out if "video" not in k}, spans
    if cfg.model_type in VIDEO_AS_IMAGE_TOKENS:
        # GLM-4V reads a video's frames at image placeholders, so a row holds images or a video: two images
        # (glm4v, glm4v_moe, glm5_next) or one video (glm46v, glm_ocr)
        if cfg.model_type in ("glm4v", "glm4v_moe", "glm5_next"):
            return {k: out[k] for k in ("pixel_values", "image_grid_thw")}, spans
        frames = [(h * w // merge, cfg.image_token_id, 2)] * t
        return {k: out[k] for k in ("pixel_values_videos", "video_grid_thw")}, frames
    if cfg.model_type in FRAME_SPANS:         # one span per frame, timestamps (text) between them
        return out, spans + [(h * w // merge, cfg.video_token_id, 2)] * t
    video = {k: out[k] for k in out if "video" in k}    # its placeholders: the model's own feature rows (ERNIE
    return out, spans + [(sum(_feature_counts(model, video, 1, "video")), cfg.video_token_id, 2)]  # pools 2 frames)


def _image_inputs(cfg, g, model):
    """Two images of the tower's size (LLaVA-NeXT: one, 36 features with its high-resolution tile; LLaVA-OneVision
    and LLaVA-NeXT-Video: one, 10 features, and a video; BLIP-2 and InstructBLIP: one; Gemma 3 and 4: three; Molmo2:
    one, as its image tokens are one bidirectional group) in the layout the family's processor
    gives, and a video of VIDEO_FRAMES frames where the family takes one as frames; their placeholder counts are the
    rows of the model's own image (video) features."""
    mt = cfg.model_type
    count = {"llava_next": 1, "llava_onevision": 1, "llava_next_video": 1, "gemma3": 3, "gemma4": 3,
             "gemma4_unified": 3, "blip-2": 1, "instructblip": 1, "molmo2": 1}.get(mt, 2)   # instructblipvideo: 2 frames
    tower = getattr(cfg, "vision_config", cfg)
    size = getattr(getattr(tower, "sam_config", tower), "image_size", 8)       # Unlimited-OCR: SAM's input size
    size = size[0] if isinstance(size, (list, tuple)) else size
    pixels = torch.randn(count, 3, size, size, generator=g)
    if mt == "gemma4_unified":           # 2 x 3 patches of 2 x 2 pixels, flattened, with their (x, y): 6 tokens,
        y, x = torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij")    # inside the window of 8
        out = {"pixel_values": torch.randn(count, 6, 12, generator=g),
               "image_position_ids": torch.stack([x.flatten(), y.flatten()], -1)[None].repeat(count, 1, 1)}
    elif mt == "gemma4":                 # 9 x 9 patches of 2 x 2 pixels, flattened, with their (x, y)
        y, x = torch.meshgrid(torch.arange(9), torch.arange(9), indexing="ij")
        out = {"pixel_values": torch.randn(count, 81, 12, generator=g),
               "image_position_ids": torch.stack([x.flatten(), y.flatten()], -1)[None].repeat(count, 1, 1)}
    elif mt == "nemotron_h_omni":        # RADIO: every image's 2 x 2 x 3 patches in rows, their (h, w) grids
        out = {"pixel_values": pixels.reshape(count, 3, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(-1, 12),
               "image_grid_hw": torch.tensor([[4, 4]] * count)}
    elif mt == "fuyu":                   # the processor's layout: one row of 2 x 2 x 3 patches per sample
        out = {"pixel_values": pixels.reshape(count, 3, 4, 2, 4, 2).permute(0, 2, 4, 3, 5, 1).reshape(1, -1, 12)}
    elif mt in ("llava_next", "llava_onevision", "llava_next_video", "granite4_vision"):
        out = {"pixel_values": torch.stack([pixels, pixels.flip(-1)], 1), "image_sizes": torch.tensor([[size, size]] * count)}
    elif mt == "deepseek_vl_hybrid":
        high = cfg.high_res_vision_config.image_size
        out = {"pixel_values": pixels, "high_res_pixel_values": torch.randn(count, 3, high, high, generator=g)}
    elif mt == "lfm2_vl":              # SigLIP 2: 2 x 2 x 3 patches flattened, with their grid and mask
        out = {"pixel_values": pixels.reshape(count, 3, 4, 2, 4, 2).permute(0, 2, 4, 3, 5, 1).reshape(count, 16, 12),
               "spatial_shapes": torch.tensor([[4, 4]] * count), "pixel_attention_mask": torch.ones(count, 16, dtype=torch.long)}
    elif mt.startswith("minicpm"):      # NaViT: the images' 2 x 2 patches side by side in one strip, their grids
        sizes = torch.tensor([[4, 4], [4, 8]])
        out = {"pixel_values": torch.randn(1, 3, 2, 2 * int(sizes.prod(-1).sum()), generator=g), "target_sizes": sizes}
        count = len(sizes)
    elif mt == "granite_docling":      # tiles of one sample, all real
        out = {"pixel_values": pixels[None], "pixel_attention_mask": torch.ones(1, count, dtype=torch.bool)}
    elif mt in ("mistral3", "lighton_ocr", "mistral_large4", "emu3"):
        out = {"pixel_values": pixels, "image_sizes": torch.tensor([[8, 8]] * count)}
    elif mt == "video_llava":
        out = {"pixel_values_images": pixels}
    elif mt == "blip":                # no placeholders: every text layer cross-attends to the image
        return {"pixel_values": pixels[:1]}, []
    elif mt == "idefics":             # gated cross-attention to the image from the tokens after 10
        seen = torch.zeros(1, SEQ, 1, dtype=torch.long)
        seen[0, 10:] = 1
        return {"pixel_values": pixels[None, :1], "image_attention_mask": seen}, []
    elif mt in ("instructblip", "instructblipvideo"):  # and the instruction its Q-Former reads, as long as the
        out = {"pixel_values": pixels if mt == "instructblip" else pixels[None],  # row: only its name keeps
               "qformer_input_ids": torch.randint(3, 100, (1, SEQ), generator=g),  # sp.shard_batch from cutting it
               "qformer_attention_mask": torch.ones(1, SEQ, dtype=torch.long)}
    elif mt == "molmo2":                 # one crop of 4 x 4 patches (2 x 2 x 3, flattened) an image, pooled 2 x 2: 4 tokens
        a, b, da, db = torch.meshgrid(*(torch.arange(2),) * 4, indexing="ij")
        pool = ((2 * a + da) * 4 + 2 * b + db).reshape(4, 4)
        out = {"pixel_values": pixels.reshape(count, 3, 4, 2, 4, 2).permute(0, 2, 4, 3, 5, 1).reshape(count, 16, 12),
               "image_token_pooling": torch.cat([pool + 16 * i for i in range(count)]),
               "image_grids": torch.tensor([[2, 2, 0, 0]] * count), "image_num_crops": torch.ones(count, dtype=torch.long)}
    elif mt in ("idefics3", "smolvlm", "idefics2"):
        out = {"pixel_values": pixels[None]}
    else:
        out = {"pixel_values": pixels}
    if mt == "instructblipvideo":      # one video of two frames, the queries of each frame its placeholders
        return out, [(n, cfg.video_token_id, 2) for n in _feature_counts(model, out, 1, "video")]
    spans = [(n, cfg.image_token_id, 1) for n in _feature_counts(model, out, count)]
    if mt in VIDEO_FRAMES:               # and one video of VIDEO_FRAMES frames of the same size
        video = {"pixel_values_videos": torch.randn(1, VIDEO_FRAMES[mt], 3, size, size, generator=g)}
        token = getattr(cfg, "video_token_id", None) or cfg.video_token_index
        return dict(out, **video), spans + [(n, token, 2) for n in _feature_counts(model, video, 1, "video")]
    return out, spans


def _feature_counts(model, vision, count, kind="image"):
    """The rows of the model's own features of each of ``count`` images (videos): their placeholder counts."""
    owner = getattr(model, "model", model)        # Llama 4: the top model embeds the images
    features = getattr(owner, f"get_{kind}_features")
    accepted = inspect.signature(features).parameters
    with torch.no_grad():
        feats = features(**{k: v for k, v in vision.items() if k in accepted}, return_dict=True)
    pooled = feats.pooler_output if getattr(feats, "pooler_output", None) is not None else feats.last_hidden_state
    if pooled is None:                  # Granite 4 Vision: only (decoder layer, per-image features) pairs
        pooled = feats.deepstack_features[0][1]
    return [t.numel() // t.shape[-1] for t in
            (pooled if isinstance(pooled, (list, tuple)) else pooled.reshape(count, -1, pooled.shape[-1]))]


def row(cfg, model, seed=1):
    """(input_ids [1, SEQ], labels, mm_token_type_ids, vision inputs): the placeholders of each image (and
    video) centred on a shard boundary (16, 32, 48: contiguous and zigzag at P=2; striped cuts every
    span), random text around them, 20% of the labels ignored."""
    g = torch.Generator().manual_seed(seed)
    if cfg.model_type == "mllama":
        return _cross_attention_row(g)
    features = getattr(getattr(model, "model", model), "get_image_features", None)     # InstructBLIP-Video: videos only
    grids = features is not None and "image_grid_thw" in inspect.signature(features).parameters
    vision, spans = _grid_inputs(cfg, g, model) if grids else _image_inputs(cfg, g, model)
    ids = torch.randint(3, 110, (1, SEQ), generator=g)
    types = torch.zeros(1, SEQ, dtype=torch.long)
    centres = {0: (), 1: (32,), 2: (16, 48), 3: (16, 32, 48), 4: (16, 32, 44, 54)}[len(spans)]
    end = 0
    for centre, (n, token, kind) in zip(centres, spans):
        start = centre - n // 2
        assert start > end and start + n < SEQ, (spans, "the spans overlap: shorten the images")
        ids[0, start:start + n], types[0, start:start + n] = token, kind
        end = start + n
    labels = ids.clone()
    labels[torch.rand(1, SEQ, generator=g) < 0.2] = -100
    return ids, labels, types, vision


def _cross_attention_row(g):
    """Mllama: two images of two tiles (the second with one real tile) seen through cross-attention from
    the tokens after their <|image|> tokens at 16 and 40 (cross_attention_mask rows: a per-token input)."""
    ids = torch.randint(3, 110, (1, SEQ), generator=g)
    ids[0, 16] = ids[0, 40] = 120
    labels = ids.clone()
    labels[torch.rand(1, SEQ, generator=g) < 0.2] = -100
    seen = torch.zeros(1, SEQ, 2, 2, dtype=torch.long)
    seen[0, 16:, 0, :] = 1
    seen[0, 40:, 1, 0] = 1
    vision = {"pixel_values": torch.randn(1, 2, 2, 3, 8, 8, generator=g), "aspect_ratio_ids": torch.tensor([[2, 1]]),
              "aspect_ratio_mask": torch.tensor([[[1, 1], [1, 0]]]), "cross_attention_mask": seen}
    return ids, labels, torch.zeros(1, SEQ, dtype=torch.long), vision


def build(cfg, dtype, state=None):
    import transformers as T
    torch.manual_seed(0)
    try:          # eager experts: grouped_mm has no float64 kernel (tests/zoo/decoders.py)
        model = T.AutoModelForImageTextToText.from_config(cfg, attn_implementation="sdpa", experts_implementation="eager")
    except (ValueError, ImportError, TypeError):
        model = T.AutoModelForImageTextToText.from_config(cfg, attn_implementation="eager")
    if cfg.model_type == "mllama":       # its cross-attention gates start at 0: the images would change nothing
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                    p.fill_(0.5)
    if state is not None:
        model.load_state_dict(state)
    # Module.to(float dtype) casts a complex buffer to real (Llama 4's vision RoPE): keep it complex
    rotations = {n: b for n, b in model.named_buffers() if b.is_complex()}
    model.to(dtype)
    for name, b in rotations.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, b.to(torch.complex128 if dtype == torch.float64 else torch.complex64))
    return model.train()


def _cast(vision, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in vision.items()}


def positions(model, ids, types, vision):
    """The whole row's 3-D RoPE positions from the model's own get_rope_index; 1-D for the others."""
    from ds_seqpar.hf.vision import rope_positions
    if not hasattr(getattr(model, "model", None), "get_rope_index"):
        return torch.arange(ids.shape[1])[None]
    return rope_positions(model, dict(vision, input_ids=ids, mm_token_type_ids=types, attention_mask=torch.ones_like(ids)),
                          text=True)


def unsharded(cfg, state, inputs, dtype, noise=None):
    """(logits, loss, gradients) of the whole row; ``noise``: a seed, every op's result carries a random
    relative error of fp32's size (tests/zoo/decoders.py's _RoundingNoise; float64 only)."""
    import contextlib
    from ..hf_models import textbook_loss
    from .decoders import _RoundingNoise
    ids, labels, types, vision = inputs
    model = build(cfg, dtype, state)
    pos = positions(model, ids, types, vision)
    extra = {k: types for k in TYPE_KEYS if k in inspect.signature(model.forward).parameters}
    if noise is not None:
        torch.manual_seed(noise)
    with _RoundingNoise() if noise is not None else contextlib.nullcontext():
        logits = model(input_ids=ids, position_ids=pos, **extra, **_cast(vision, dtype)).logits
        loss = textbook_loss(logits, labels)
        loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


def sharded_step(model, sp, inputs):
    """The documented call: sp.shard_batch on the [batch, seq] tensors, the whole row's 3-D positions and
    the vision inputs (passed whole), then model(**batch); (local logits, loss) after backward."""
    ids, labels, types, vision = inputs
    batch = dict(vision, input_ids=ids, labels=labels, position_ids=positions(model, ids, types, vision))
    batch.update({k: types for k in TYPE_KEYS if k in inspect.signature(model.forward).parameters})
    batch = sp.shard_batch(batch)
    res = model(**batch)
    res.loss.backward()
    return res.logits.detach(), res.loss.detach()


def check_vlm(name, sps):
    """{strategy: outcome} of one hand-built family (CONFIGS) on the image row."""
    cfg = CONFIGS[name]()
    return check(cfg, lambda model: row(cfg, model), sps)


def check(cfg, make_inputs, sps):
    """{strategy: ("exact", worst ratio) | ("mismatch", what) | ("refused" | "error", message)}."""
    from ds_seqpar.config import ConfigError
    from ds_seqpar.hf import apply_sequence_parallel
    from ..dist.test_hf import _summed_grads
    from ds_seqpar.hf.versions import upstream_break
    model = build(cfg, torch.float32)
    if upstream_break(type(model).__name__):        # the installed transformers breaks the model by itself
        return {s: _refusal(model, sp) for s, sp in sps.items()}
    state, inputs = model.state_dict(), make_inputs(model)
    ref, plain = (unsharded(cfg, state, inputs, dt) for dt in (torch.float64, torch.float32))
    out, rounding = {}, None
    for strategy, sp in sps.items():
        model = build(cfg, torch.float32, state)
        try:
            apply_sequence_parallel(model, sp)
            logits, loss = sharded_step(model, sp, inputs)
        except ConfigError as err:
            out[strategy] = ("refused", str(err).splitlines()[0])
            continue
        except Exception as err:                            # noqa: BLE001 - reported, not hidden
            out[strategy] = ("error", message(err))
            continue
        grads = _summed_grads(model, sp.group)
        ratios = {"logits": _worst(sp.unshard(logits, dim=1, seq_len=SEQ), ref[0], plain[0]),
                  "loss": _worst(loss, ref[1], plain[1])}
        ratios.update({f"grad {n}": _worst(g, ref[2][n], plain[2][n]) for n, g in grads.items() if n in ref[2]})
        over = [n for n in grads if ratios.get(f"grad {n}", 0.0) > 1.0]
        if over:                  # one plain run's error can be far below fp32's typical one: the Monte-Carlo scale
            rounding = rounding if rounding is not None else _rounding_scale(cfg, state, inputs, ref[2])
            ratios.update({f"grad {n}": _gradient_ratio(grads[n], ref[2][n], plain[2][n], rounding[n]) for n in over})
        out[strategy] = verdict(ratios, set(ref[2]) ^ set(grads))
    return out


def _refusal(model, sp):
    from ds_seqpar.config import ConfigError
    from ds_seqpar.hf import apply_sequence_parallel
    try:
        apply_sequence_parallel(model, sp)
    except ConfigError as err:
        return ("refused", str(err).splitlines()[0])
    return ("error", "applied although the installed transformers breaks the model")


def _rounding_scale(cfg, state, inputs, ref):
    """{parameter: max |gradient error|} of the float64 model under fp32-sized random rounding, over the
    zoo's samples (tests/zoo/decoders.py's _rounding_scale): the bound where a gradient is a small sum of large
    terms (DeepSeek-VL-Hybrid's high_res_vision_alpha: one scalar gating every image feature)."""
    from .decoders import ROUNDING_SAMPLES
    worst = {}
    for seed in range(ROUNDING_SAMPLES):
        for n, g in unsharded(cfg, state, inputs, torch.float64, noise=1000 + seed)[2].items():
            worst[n] = max(worst.get(n, 0.0), (g - ref[n]).abs().max().item())
    return worst


def sweep(names):
    """On every rank of the pool: each data-parallel group takes every other name."""
    from ds_seqpar import SequenceParallel
    sps = {s: SequenceParallel({"strategy": s, "size": 2}) for s in STRATEGIES}
    first = next(iter(sps.values()))
    return [(n, check_vlm(n, sps)) for i, n in enumerate(names) if i % first.dp_size == first.dp_rank]


def vlm_samples(cfg, model, n):
    """n rows of SEQ tokens, each with its own random images and video (row() with seeds 1..n)."""
    out = []
    for seed in range(1, n + 1):
        ids, labels, types, vision = row(cfg, model, seed)
        out.append(dict(vision, input_ids=ids[0], labels=labels[0], mm_token_type_ids=types[0]))
    return out


def collate(rows):
    """Token tensors stacked; Qwen-VL's patch rows and grids concatenated over the samples."""
    return {k: torch.stack([r[k] for r in rows]) if k in ("input_ids", "labels", "mm_token_type_ids")
            else torch.cat([r[k] for r in rows]) for k in rows[0]}


def train_vlm(cfg_ds, micro, steps=2):
    """SequenceParallelTrainer on a tiny Qwen2.5-VL with random images: rank 0 returns (per-step log,
    final parameters); the Trainer adds the whole rows' 3-D positions before sharding."""
    import tempfile
    from ds_seqpar.hf import SequenceParallelTrainer
    from ..dist.test_hf_trainer import _example, reset_worker_state
    example = _example()
    cfg = CONFIGS["qwen2_5_vl"]()
    model = build(cfg, torch.float32)
    # Qwen-VL opts out of the Trainer's token count (num_items_in_batch): each micro-batch's loss is then its
    # own mean, which depends on the micro-batch size (1 in the plain run, 2 sequence-parallel) in plain data
    # parallelism too; with the count, both runs take the token mean of the step, as for causal LMs
    model.accepts_loss_kwargs = True
    with tempfile.TemporaryDirectory() as out:
        try:
            args = example.arguments(cfg_ds, out, steps, 1, micro, remove_unused_columns=False)
            trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=vlm_samples(cfg, model, 8),
                                              data_collator=collate)
            trainer.train()
            params = example.final_parameters(trainer)
            return (example.logged_steps(trainer), params) if trainer.is_world_process_zero() else None
        finally:
            reset_worker_state()
