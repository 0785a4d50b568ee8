"""Vision(/audio)-language models: the language model runs sequence-parallel, the towers as before.

The call convention (docs/hf.md): the vision inputs (``pixel_values``, ``image_grid_thw``,
``pixel_values_videos``, ``video_grid_thw``, ...) are passed whole to every rank; every [batch, seq]
tensor comes from ``sp.shard_batch`` (``input_ids``, ``labels``, ``mm_token_type_ids``, ...); a 3-D
RoPE model (Qwen-VL's mrope: the model has ``get_rope_index``) takes the whole row's positions from
that method, sharded along the last dim (``sp.shard_batch`` does it when given them).

How the features reach this rank's slots, for any model whose placeholder merge transformers writes
as "embed input_ids, scatter the tower's features at the placeholder tokens, call the decoder":
  1. the model pre-hook gathers the whole row of the token tensors the merge reads (WHOLE_ROW: input
     ids and token types, one all-gather each, integers) and hands those to the model in place of the
     shards, after the whole-row checks below (the same data on every rank, so the same verdict);
  2. the model embeds the whole row and scatters every feature into it with its own code and its own
     count checks (placeholders straddling shard boundaries are nothing special: the row is whole);
  3. a pre-hook on the decoder (the submodule whose config is the text config) takes this rank's
     tokens of ``inputs_embeds`` and every other per-token tensor of the row with ``sp.shard`` (the layout's own token set: zigzag and striped
     are not contiguous), and of the deepstack features (Qwen3-VL, Granite 4 Vision: DEEPSTACK's masks pick their rows).
Bidirectional image blocks (Gemma 3, ShieldGemma 2; Gemma 4 and Gemma 4 Unified with
use_bidirectional_attention="vision"): transformers lets the tokens of one image see each other both ways (its
block_sequence_ids: one block per run of vision tokens, OR'd onto the causal mask, the sliding window still
bounding earlier keys; Gemma 4 Unified's images longer than its window are refused, BLOCKS_PAST_WINDOW; Molmo2's one
group of every image token of the row, while it is one run: ONE_GROUP). The
blocks come from the whole row's token types (step 1: every rank the same, as the cu_seqlens of
sp.shard_batch), and the layers that have them (Gemma 3: all; Gemma 4: its sliding layers) pass them to
``sp.attention(blocks=...)``, a mask like the others for every strategy (masks.py).
Gradients: ``sp.shard``'s backward leaves zeros at the other ranks' slots, so each rank's tower and
embedding gradients are its slots' share and their sum over the sequence group is the unsharded
gradient, the same contract as every replicated parameter under ``sp.loss``.
Cost: one [batch, N, hidden] embedding per rank before the decoder (N = the whole padded row).
"""
from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch

from ..errors import UnsupportedModelError
from ..sharding.batch import is_vision_input

# [batch, seq] inputs the placeholder merge reads: handed to the model whole (labels and position_ids
# stay sharded: the loss and RoPE work on this rank's tokens)
WHOLE_ROW = ("input_ids", "mm_token_type_ids", "token_type_ids", "cross_attention_mask")
# Mllama: per-token masks of the cross-attention layers, [batch, 1, tokens, image tokens] by the time the
# decoder gets them (the top model builds them from the whole row's cross_attention_mask)
CROSS_MASKS = ("cross_attention_mask", "full_text_row_masked_out_mask")
# (pixels, grid) pairs whose grid rows (t, h, w) count the pixel rows (patches)
GRIDS = (("pixel_values", "image_grid_thw", "image_token_id"),
         ("pixel_values_videos", "video_grid_thw", "video_token_id"))
# GLM-4.1V / 4.5V / 4.6V / OCR / GA / 5-Next: transformers' merge reads a video's frames at image_token_id placeholders
VIDEO_AS_IMAGE_TOKENS = frozenset({"glm4v", "glm4v_moe", "glm46v", "glm_ocr", "glmga", "glm5_next"})
# HunYuan-VL: an image's placeholders are more than its merged patches (one more per row of them, and two around)
PLACEHOLDERS_BEYOND_GRID = frozenset({"hunyuan_vl"})
# model type -> (the [batch, seq] input marking vision tokens, its vision values, the layers whose mask has
# the blocks: "all" or "sliding"), as each model's get_block_sequence_ids_for_mask / create_masks_for_vision_model
# (Gemma 4 Unified's masks overlay the blocks on its full-attention layers too, unlike Gemma 4's)
IMAGE_BLOCKS = {"gemma3": ("token_type_ids", (1,), "all"), "shieldgemma2": ("token_type_ids", (1,), "all"),
                "gemma4": ("mm_token_type_ids", (1, 2), "sliding"),
                "gemma4_unified": ("mm_token_type_ids", (1, 2), "all"), "molmo2": ("mm_token_type_ids", (1,), "all")}
# models whose vision tokens are one bidirectional group per row (Molmo2: every image token sees every other, across
# the text between them): the same mask as IMAGE_BLOCKS' while the row holds one run of them
ONE_GROUP = frozenset({"molmo2"})
# models whose sliding layers let an image's tokens see the whole image past the window (the block ORed after the
# window, not inside it): the same mask as IMAGE_BLOCKS' while no image is longer than the window
BLOCKS_PAST_WINDOW = frozenset({"gemma4_unified"})
# deepstack: the whole row's visual-token mask -> the features it picks rows of, added to the hidden states of
# later decoder layers (Qwen3-VL: a list, one per layer; Granite 4 Vision: {decoder layer: features})
DEEPSTACK = {"visual_pos_masks": "deepstack_visual_embeds", "vision_mask": "deepstack_features"}
# prefix-LM models: the token_type_ids == 0 prefix attends bidirectionally as one group, in attention layers
# transformers builds non-causal (the causal suffix comes from the mask alone)
PREFIX_LM = frozenset({"paligemma"})


def _decoder_of(model):
    """(name, module) of the language model inside a multimodal model: the submodule built from the
    text config; None for a plain causal LM."""
    config = model.config
    tc = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if tc is config:
        return None
    for name, m in model.named_modules():
        if m is not model and getattr(m, "config", None) is tc and hasattr(m, "get_input_embeddings"):
            return name, m
    raise UnsupportedModelError(f"ds_seqpar.hf: {type(model).__name__} is multimodal but has no submodule built "
                                f"from its text config ({type(tc).__name__}) to run sequence-parallel; apply to "
                                f"the text model alone")


class VisionLanguage:
    """One applied multimodal model: its decoder, whether it uses 3-D RoPE, the row length of this call."""

    def __init__(self, model, decoder_name: str, decoder):
        self.model_type = getattr(model.config, "model_type", "")
        self.config = model.config
        self.decoder_name, self.decoder = decoder_name, decoder
        self.mrope = any(hasattr(m, "get_rope_index") for m in model.modules())
        self.row_len: Optional[int] = None      # the whole (padded) row length of the current call
        self.blocks: Optional[Tuple[Tuple[int, int], ...]] = None   # the current call's image blocks
        self.block_rule = IMAGE_BLOCKS.get(self.model_type)
        if self.model_type in ("gemma4", "gemma4_unified") and getattr(model.config.get_text_config(), "use_bidirectional_attention",
                                                   None) != "vision":
            self.block_rule = None              # smaller Gemma 4 models: causal masks only

    @classmethod
    def of(cls, model) -> Optional["VisionLanguage"]:
        found = _decoder_of(model)
        return None if found is None else cls(model, *found)

    def text_sub_config(self) -> Optional[str]:
        """The key under which the top config holds the decoder's config."""
        return next((k for k in getattr(self.config, "sub_configs", {}) if getattr(self.config, k, None)
                     is self.decoder.config), None)

    # -- the model call ------------------------------------------------------------------------------
    def check_call(self, call: dict) -> None:
        """Grids against their pixels; 3-D RoPE models: with vision inputs the positions must be the whole row's 3-D positions,
        sharded (the text positions sp.shard_batch adds would drop the image grid)."""
        check_grids(call, None, self.config)          # local: the vision inputs are whole on every rank
        pos, ids = call.get("position_ids"), call.get("input_ids")
        if not self.mrope or pos is None or ids is None:
            return
        want = f"[3, {ids.shape[0]}, {ids.shape[1]}]"
        fix = ("pass sp.shard_batch({..., 'position_ids': model.model.get_rope_index(input_ids, ...)[0]}) or "
               "sp.shard(positions, dim=-1) of the whole row's 3-D positions")
        if pos.dim() == 3:
            if pos.shape[0] != 3 or tuple(pos.shape[1:]) != tuple(ids.shape):
                raise ValueError(f"ds_seqpar.hf: position_ids {tuple(pos.shape)} do not fit this rank's input_ids "
                                 f"{tuple(ids.shape)}: a 3-D RoPE model ({self.model_type}) takes {want}; {fix}")
        elif has_vision_inputs(call):
            raise ValueError(f"ds_seqpar.hf: position_ids {tuple(pos.shape)} are 1-D text positions but the call "
                             f"has vision inputs: {self.model_type} uses 3-D RoPE (temporal, height, width), "
                             f"whose image positions differ; {fix} ({want} on this rank)")

    def whole_row(self, call: dict, sp, packed: bool) -> dict:
        """The WHOLE_ROW inputs in global order (every rank the same), after the whole-row checks; the
        image blocks of the call (``packed``: the row holds packed documents)."""
        rows = {k: sp.unshard(call[k], dim=1) for k in WHOLE_ROW if torch.is_tensor(call.get(k))}
        self.row_len = rows["input_ids"].shape[1] if "input_ids" in rows else None
        check_grids(call, rows.get("input_ids"), self.config)
        tt = rows.get("token_type_ids")
        if self.model_type in PREFIX_LM and tt is not None:
            raise UnsupportedModelError(
                f"ds_seqpar.hf: token_type_ids in {self.model_type} (a prefix LM: the token_type_ids == 0 prefix "
                f"attends bidirectionally as one group, in attention layers built non-causal) are not expressed "
                f"under sequence parallelism; train without sequence parallelism")
        self.blocks = None
        if self.block_rule is not None and torch.is_tensor(rows.get(self.block_rule[0])):
            self.blocks = image_blocks(rows[self.block_rule[0]], self.block_rule[1], self.model_type)
            if self.blocks and packed:
                raise UnsupportedModelError(
                    f"ds_seqpar.hf: image tokens in packed documents in {self.model_type} cannot be exact under "
                    f"sequence parallelism: transformers' sliding-window mask looks the image blocks up by "
                    f"within-document position there, which is not the per-document mask; pack text-only rows or "
                    f"pass rows with images one per row")
            self._check_block_window()
        return rows

    def _check_block_window(self) -> None:
        """BLOCKS_PAST_WINDOW models: an image longer than the sliding window is a mask ds_seqpar does not express;
        ONE_GROUP models: vision tokens in more than one run likewise."""
        if self.model_type in ONE_GROUP and len(self.blocks or ()) > 1:
            raise UnsupportedModelError(
                f"ds_seqpar.hf: image tokens in {len(self.blocks)} separate runs {list(self.blocks)} in "
                f"{self.model_type} are not expressed under sequence parallelism: transformers lets every image token "
                f"of the row attend to every other (one bidirectional group across the text between them), while "
                f"ds_seqpar's image blocks are runs of adjacent tokens; pass one run of image tokens per row or train "
                f"without sequence parallelism")
        window = getattr(self.decoder.config, "sliding_window", None)
        longest = max((e - s for s, e in self.blocks or ()), default=0)
        if self.model_type in BLOCKS_PAST_WINDOW and window and longest > window:
            raise UnsupportedModelError(
                f"ds_seqpar.hf: an image of {longest} tokens longer than sliding_window={window} in {self.model_type} "
                f"is not expressed under sequence parallelism: its sliding layers let an image's tokens see the whole "
                f"image past the window (OR(AND(window, causal), block)), while ds_seqpar's mask bounds every query's "
                f"earlier keys by the window (AND(window, OR(causal, block)), Gemma 3's and Gemma 4's rule); pass "
                f"images of at most {window} tokens or train without sequence parallelism")

    def layer_blocks(self, module) -> Optional[Tuple[Tuple[int, int], ...]]:
        """The image blocks of this call for ``module``'s mask (None: plain causal)."""
        if not self.blocks or self.block_rule[2] == "all":
            return self.blocks
        config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
        types = getattr(config, "layer_types", None) or ()
        return self.blocks if idx is not None and idx < len(types) and types[idx] == "sliding_attention" else None

    def decoder_inputs(self, kwargs: dict, sp) -> dict:
        """This rank's tokens of the decoder's whole-row inputs (its pre-hook): the embeddings (or, where
        the decoder embeds itself, Mllama's, the token ids), every other per-token tensor of the row, and
        the cross-attention layers' per-token masks."""
        emb = kwargs.get("inputs_embeds")
        emb = emb if emb is not None else kwargs.get("input_ids")
        if emb is None or self.row_len is None or emb.shape[1] != self.row_len:
            return kwargs
        kwargs = dict(kwargs)
        for key in CROSS_MASKS:
            v = kwargs.get(key)
            if torch.is_tensor(v) and v.dim() == 4 and v.shape[2] == self.row_len:
                kwargs[key] = sp.shard(v, dim=2)
        masks = {k: kwargs.pop(k) for k in DEEPSTACK
                 if torch.is_tensor(kwargs.get(k)) and kwargs[k].shape[1] == self.row_len}
        for key, v in kwargs.items():      # every per-token tensor of the row (embeddings, Gemma's per-layer inputs)
            if torch.is_tensor(v) and v.dim() >= 2 and tuple(v.shape[:2]) == tuple(emb.shape[:2]):
                kwargs[key] = sp.shard(v, dim=1)
        for key, mask in masks.items():
            # deepstack: feature row i belongs to the i-th visual token of the whole row
            flat = mask.reshape(mask.shape[:2])                        # Granite's [batch, N, 1] -> [batch, N]
            row_of = (flat.reshape(-1).cumsum(0) - 1).view_as(flat)
            local_mask, rows = sp.shard(mask, dim=1), sp.shard(row_of, dim=1)[sp.shard(flat, dim=1)]
            kwargs[key] = local_mask
            deep = kwargs.get(DEEPSTACK[key])
            if isinstance(deep, dict):
                kwargs[DEEPSTACK[key]] = {layer: d[rows] for layer, d in deep.items()}
            elif deep is not None:
                kwargs[DEEPSTACK[key]] = [d[rows] for d in deep]
        return kwargs


def is_cross_attention(module) -> bool:
    """A decoder layer's attention over the images' tokens (Mllama's cross_attention_layers): its queries
    are this rank's tokens and its keys every image token, whole on every rank, so it runs locally."""
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    return idx is not None and idx in (getattr(config, "cross_attention_layers", None) or ())


def image_blocks(types: torch.Tensor, values, model_type: str) -> Optional[Tuple[Tuple[int, int], ...]]:
    """The whole row's bidirectional blocks, global (start, end) pairs: one per run of tokens whose type is
    one of ``values`` (transformers' block_sequence_ids); None without any. Every row of the batch must
    have the same (one Mask per batch), else refused."""
    vision = torch.isin(types, torch.tensor(values, device=types.device)).to(torch.int8).cpu()
    if not bool(vision.any()):
        return None
    edges = torch.diff(vision, dim=1, prepend=vision[:, :1] * 0, append=vision[:, :1] * 0)     # +1 start, -1 end
    rows = {tuple(torch.nonzero(e != 0).flatten().tolist()) for e in edges}
    if len(rows) > 1:
        raise UnsupportedModelError(
            f"ds_seqpar.hf: the {types.shape[0]} rows of the batch hold image tokens at different positions in "
            f"{model_type}: its bidirectional image blocks are one mask per batch under sequence parallelism; pass "
            f"one row per batch (or rows whose images sit at the same positions)")
    flat = rows.pop()
    return tuple(zip(flat[::2], flat[1::2]))


def rope_positions(model, batch: dict, text: bool = False):
    """The whole batch's 3-D RoPE positions [3, B, N] from the model's own get_rope_index, or None (no
    3-D RoPE, no vision input unless ``text``, or position_ids given): what a Trainer adds before
    sp.shard_batch. The batch's inputs that get_rope_index names are passed (token types, grids, MiniCPM-V's
    target_sizes, ...)."""
    if batch.get("position_ids") is not None or not (text or has_vision_inputs(batch)):
        return None                     # a text batch: the model is not even looked at
    owner = next((m for m in model.modules() if hasattr(m, "get_rope_index")), None)
    if owner is None:
        return None
    names = inspect.signature(owner.get_rope_index).parameters
    return owner.get_rope_index(batch["input_ids"], **{k: v for k, v in batch.items() if k in names and k != "input_ids"
                                                       and v is not None})[0]


def has_vision_inputs(call: dict) -> bool:
    return any(is_vision_input(k) and v is not None for k, v in call.items())


def merge_area(vision, merge_sizes=None):
    """Patches per feature: the tower's spatial merge, a square (``spatial_merge_size``, Muse's ``merge_size``),
    a rectangle (Kimi-K2.5's ``merge_kernel_size``) or an input per grid row (VideoLLaMA3's
    ``image_merge_sizes`` / ``video_merge_sizes``)."""
    if torch.is_tensor(merge_sizes):
        return merge_sizes.to(torch.long) ** 2
    kernel = getattr(vision, "merge_kernel_size", None)
    if isinstance(kernel, (list, tuple)):
        return int(kernel[0]) * int(kernel[1])
    side = getattr(vision, "spatial_merge_size", None) or getattr(vision, "merge_size", None) or 1
    return side ** 2


def check_grids(call: dict, ids, config) -> None:
    """A grid must count the pixel rows it describes, and (``ids``: the whole row) the placeholders the
    features it gives (grid models: Qwen-VL); refused by input name before the tower runs. Other models'
    placeholder counts are checked by transformers' merge on the whole row, on every rank alike."""
    vision = getattr(config, "vision_config", None)
    wanted = {}                      # placeholder token key -> (features, the grids that give them)
    for pixels_key, grid_key, token_key in GRIDS:
        pixels, grid = call.get(pixels_key), call.get(grid_key)
        if not (torch.is_tensor(pixels) and torch.is_tensor(grid)):
            continue
        if grid.dim() != 2 or grid.shape[-1] != 3 or int(grid.prod(-1).sum()) != pixels.shape[0]:
            raise ValueError(f"ds_seqpar.hf: {grid_key} {grid.tolist()} does not match {pixels_key} "
                             f"{tuple(pixels.shape)}: the grid rows (t, h, w) must multiply to the number of "
                             f"patch rows ({pixels.shape[0]})")
        if getattr(config, "model_type", "") in VIDEO_AS_IMAGE_TOKENS:
            token_key = "image_token_id"
        # ERNIE-4.5-VL pools a video's frames in pairs (temporal_merge_size), an image's single frame not
        frames = grid[:, 0] // (getattr(vision, "temporal_merge_size", None) or 1 if "video" in grid_key else 1)
        area = merge_area(vision, call.get(grid_key.replace("grid_thw", "merge_sizes")))
        merged = frames * grid[:, 1] * grid[:, 2] // area
        features, grids = wanted.get(token_key, (0, []))
        wanted[token_key] = (features + int(merged.sum()), grids + [f"{grid_key} {grid.tolist()}"])
    if getattr(config, "model_type", "") in PLACEHOLDERS_BEYOND_GRID:
        return                       # transformers' own count check, on the whole row every rank gathers alike
    for token_key, (features, grids) in wanted.items():
        token = getattr(config, token_key, None)
        if ids is not None and token is not None and int((ids == token).sum()) != features:
            raise ValueError(f"ds_seqpar.hf: input_ids hold {int((ids == token).sum())} {token_key} placeholders "
                             f"(whole row) but {' and '.join(grids)} gives {features} features: one placeholder "
                             f"per feature")


__all__ = ["VisionLanguage", "WHOLE_ROW", "CROSS_MASKS", "is_cross_attention", "IMAGE_BLOCKS", "VIDEO_AS_IMAGE_TOKENS", "has_vision_inputs", "check_grids",
           "image_blocks", "rope_positions"]
