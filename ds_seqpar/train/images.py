"""``--images N``: the main job trains a vision-language ``--model`` on rows that each carry N random
images (docs/hf.md, "The main job with a vision-language model").

Grid models only (Qwen-VL style: the vision config has ``temporal_patch_size``; pixels are patch rows
of C x tp x p x p values, one ``image_grid_thw`` row (t, h, w) per image). Every row of text gets N
images of ``--image_grid`` patches: their t*h*w / merge^2 placeholders (``image_token_id``) replace the
text at N evenly spaced places, ``mm_token_type_ids`` marks them, their labels are ignored (a
placeholder is not a target), and the pixels are random, drawn from (seed, step, micro step, global
row): the ranks of a sequence group and the plain reference draw the same images for the same row.
The whole row's 3-D positions come from the model's own ``get_rope_index`` before sharding, as the
call convention asks.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import torch

from ..hf.vision import rope_positions
from .args import TrainConfigError, parse_grid  # noqa: F401  (parse_grid: its home is args)
from .data import IGNORE_INDEX


class RandomImages:
    """N random images per row for a grid vision-language model; ``batch`` turns a text batch into the
    whole-row call (placeholders, token types, pixels, grids, 3-D positions)."""

    def __init__(self, config, count: int, grid: Sequence[int], seq_len: int, data_vocab: int):
        vision = getattr(config, "vision_config", None)
        name = f"--model ({getattr(config, 'model_type', '?')})"
        if vision is None or not hasattr(vision, "temporal_patch_size"):
            raise TrainConfigError(f"--images={count} with {name}: random images are built for Qwen-VL-style grid "
                                   f"models only (a vision config with temporal_patch_size: qwen2_vl, qwen2_5_vl, "
                                   f"qwen3_vl, ...); train this model on text (--images 0) or with your own loop")
        t, h, w = grid
        self.merge = getattr(vision, "spatial_merge_size", 1) or 1
        if h % self.merge or w % self.merge:
            raise TrainConfigError(f"--image_grid={t},{h},{w}: h and w must be multiples of the model's "
                                   f"spatial_merge_size={self.merge}")
        self.token = config.image_token_id
        if self.token < data_vocab:
            raise TrainConfigError(f"{name} has image_token_id={self.token} inside the training data's vocabulary "
                                   f"({data_vocab} ids): text tokens would be read as image placeholders; use a model "
                                   f"whose image_token_id is >= {data_vocab}")
        self.count, self.grid, self.seq_len = count, (t, h, w), seq_len
        self.per_image = t * h * w // self.merge ** 2                   # placeholders of one image
        gap = seq_len // (count + 1)
        if self.per_image >= gap:
            raise TrainConfigError(f"--images={count} of --image_grid={t},{h},{w} ({self.per_image} placeholders "
                                   f"each) do not fit --seq_len={seq_len} with text between them: use fewer or "
                                   f"smaller images or a longer --seq_len (>= {(count + 1) * (self.per_image + 1)})")
        self.starts = [(k + 1) * gap - self.per_image // 2 for k in range(count)]
        self.width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        self.model = None

    @classmethod
    def of(cls, opts, config, data_vocab: int, tiled_loss_tokens: int = 0) -> Optional["RandomImages"]:
        if not opts.images:
            return None
        if tiled_loss_tokens:
            raise TrainConfigError(f"--images={opts.images} with sequence_parallel.tiled_loss_tokens={tiled_loss_tokens}"
                                   f": the tiled loss of a vision-language model is not built (not verified exact); "
                                   f"set tiled_loss_tokens to 0")
        if opts.images < 0:
            raise TrainConfigError(f"--images={opts.images} must be >= 0")
        if opts.compile:
            raise TrainConfigError(f"--images={opts.images} with --compile: vision-language models under torch.compile "
                                   f"are not built (not verified exact); train them eagerly (no --compile)")
        return cls(config, opts.images, parse_grid(opts.image_grid), opts.seq_len, data_vocab)

    def attach(self, model) -> "RandomImages":
        """The transformers model whose get_rope_index gives the rows' 3-D positions."""
        self.model = model
        return self

    def batch(self, batch: Dict[str, torch.Tensor], seed: int, step: int, micro: int, first_row: int
              ) -> Dict[str, torch.Tensor]:
        """``batch`` (input_ids, labels [B, N]: rows first_row.. of the step's global batch) with the images."""
        ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
        types = torch.zeros_like(ids)
        for s in self.starts:
            span = slice(s, s + self.per_image)
            ids[:, span], labels[:, span], types[:, span] = self.token, IGNORE_INDEX, 1
        patches = int(np.prod(self.grid))
        pixels = [np.random.default_rng([seed, step, micro, first_row + r, 7]).standard_normal(
            (self.count * patches, self.width), dtype=np.float32) for r in range(ids.shape[0])]
        out = dict(batch, input_ids=ids, labels=labels, mm_token_type_ids=types,
                   pixel_values=torch.from_numpy(np.concatenate(pixels)),
                   image_grid_thw=torch.tensor([self.grid] * (self.count * ids.shape[0])))
        pos = rope_positions(self.model, out)
        if pos is not None:
            out["position_ids"] = pos
        return out


__all__ = ["RandomImages", "parse_grid"]
