"""Sharding a training batch: labels shifted over the whole sequence, then every [batch, seq]
tensor cut into this rank's tokens in the strategy's layout.

Packed documents (Hugging Face's DataCollatorWithFlattening: one row whose position_ids restart at
0 at every document, or a ``cu_seqlens`` entry): the batch also gets ``cu_seqlens``, the GLOBAL
document boundaries (the same tensor value on every rank, int32 as flash-attn takes it), checked
across the sequence group once here so that attention calls with it need no further check;
position_ids stay within-document (for RoPE), and the last token of each document gets
ignore_index, so no label crosses a document boundary.

Vision-language models: the vision inputs (``pixel_values``, ``image_grid_thw``, ...: is_vision_input)
pass whole whatever their shape; 3-D RoPE positions ``position_ids`` [3, B, N] (the whole row's, from
the model's ``get_rope_index``) are sharded along their last dim like the tokens.

Legend: B = micro batch, N = global sequence length, L = local tokens (N / sp size).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch

from .agreement import check_same_on_ranks
from .documents import (as_boundaries, boundaries_from_positions, check_boundaries, positions_from_boundaries)
from .padding import continue_positions, pad_to

IGNORE_INDEX = -100          # labels the loss leaves out (Hugging Face's and torch's convention)
# vision inputs passed whole to every rank (the towers run on whole images), never cut along dim 1
WHOLE_INPUTS = ("image_sizes", "second_per_grid_ts", "video_second_per_grid", "image_attention_mask",
                "image_position_ids", "video_position_ids", "image_grid_hw", "image_merge_sizes", "video_merge_sizes",
                "target_sizes", "spatial_shapes", "high_res_pixel_values",
                # InstructBLIP: the instruction its Q-Former reads, a text of its own beside the row
                "qformer_input_ids", "qformer_attention_mask")


def is_vision_input(key: str) -> bool:
    """Inputs shard_batch passes whole, whatever their shape (an image count may equal the batch)."""
    return key.startswith("pixel_") or key.endswith("_grid_thw") or key in WHOLE_INPUTS


def shift_labels(labels_bn: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Target of token t = label t+1 over the WHOLE sequence; the last token has none.
    Done before sharding so the token at a shard edge keeps its target on the next rank."""
    shifted = torch.full_like(labels_bn, ignore_index)
    shifted[:, :-1] = labels_bn[:, 1:]
    return shifted


def shard_batch(batch: Mapping[str, torch.Tensor], sp=None, ignore_index: int = IGNORE_INDEX
                ) -> Dict[str, torch.Tensor]:
    """Global-order batch -> this rank's tokens, with labels shifted and global position_ids.

    ``labels`` (default: input_ids) are aligned with input_ids as in Hugging Face. Any other
    tensor shaped [B, N, ...] (attention/padding masks, loss masks) is sharded along dim 1 in
    the same layout; anything else passes through unchanged. ``sp=None``: no sharding.
    """
    if "input_ids" not in batch:
        raise ValueError(f"shard_batch needs an 'input_ids' tensor [batch, seq]; got keys {sorted(batch)}")
    ids_bn = batch["input_ids"]
    if ids_bn.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(ids_bn.shape)}")
    b, n = ids_bn.shape
    labels_bn = batch.get("labels", ids_bn)
    if labels_bn.shape != ids_bn.shape:
        raise ValueError(f"labels {tuple(labels_bn.shape)} must be aligned with input_ids "
                         f"{tuple(ids_bn.shape)} (one label per token, not yet shifted)")
    out = dict(batch)
    out["labels"] = shift_labels(labels_bn, ignore_index)
    given_pos = out.pop("position_ids", None)      # e.g. packed documents restarting at 0
    if given_pos is not None and given_pos.dim() == 1:
        given_pos = given_pos[None]                # [N] -> [1, N]
    rope3d = given_pos is not None and given_pos.dim() == 3
    if rope3d and tuple(given_pos.shape[1:]) != (b, n):
        raise ValueError(f"position_ids {tuple(given_pos.shape)} (3-D RoPE) must be [3, batch, seq] of the whole "
                         f"row: input_ids are {tuple(ids_bn.shape)}")
    bounds = packed_documents(out.pop("cu_seqlens", None), None if rope3d else given_pos, b, n, sp)
    if bounds is not None:
        out["labels"][:, [t - 1 for t in bounds[1:-1]]] = ignore_index    # a document's last token
        if given_pos is None:
            given_pos = positions_from_boundaries(bounds, ids_bn.device)[None]
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=ids_bn.device)
    if sp is None:
        whole = torch.arange(n, device=ids_bn.device).expand(b, n)
        out["position_ids"] = given_pos if given_pos is not None else whole
        if cu is not None:
            out["cu_seqlens"] = cu
        return out
    # any length: pad at the end to what the layout needs (padding.py); pads are ignored labels
    padded = sp.padded_len(n)
    local = {}
    for key, v in out.items():
        if _is_token_tensor(v, b, n) and not is_vision_input(key):
            fill = ignore_index if key == "labels" else 0
            v = sp.shard(pad_to(v, 1, padded, fill), dim=1)
        local[key] = v
    if rope3d:
        local["position_ids"] = sp.shard(pad_to(given_pos, 2, padded), dim=2)        # [3, B, L]
    elif given_pos is not None:
        local["position_ids"] = sp.shard(continue_positions(given_pos.expand(b, n), padded), dim=1)
    else:
        local["position_ids"] = sp.position_ids(n, device=ids_bn.device).expand(b, -1)   # [B, L]
    if cu is not None:
        local["cu_seqlens"] = cu
        sp.masks.agreed(cu, bounds)                # attention skips the check (batch_masks.py)
    return local


def packed_documents(cu_seqlens, pos_bn, b: int, n: int, sp=None) -> Optional[Tuple[int, ...]]:
    """Document boundaries of a packed batch, or None for an ordinary one. From ``cu_seqlens`` if
    given (position_ids must then agree), else from position_ids restarting at 0 inside the row.
    With ``sp``, every rank of the sequence group learns whether all passed the same (agreement.py)."""
    restarts = pos_bn is not None and pos_bn.dim() == 2 and bool((pos_bn[:, 1:] == 0).any())
    if cu_seqlens is None and not restarts:
        return None
    bounds, error = None, None
    try:
        if b != 1:
            given = "cu_seqlens" if cu_seqlens is not None else "position_ids restarting at 0"
            raise ValueError(f"packed documents ({given}) "
                             f"need batch size 1, as flash-attn's varlen API: got batch {b}; concatenate the "
                             f"rows into one packed sequence")
        if cu_seqlens is not None:
            bounds = as_boundaries(cu_seqlens)
            check_boundaries(bounds, n, what_len="the sequence length of input_ids")
            if pos_bn is not None and not torch.equal(pos_bn[0].cpu().long(), positions_from_boundaries(bounds)):
                raise ValueError("position_ids disagree with cu_seqlens: they must count 0, 1, 2, ... from each "
                                 "document start (or leave one of them out)")
        else:
            bounds = boundaries_from_positions(pos_bn[0])
    except ValueError as err:
        error = err
    if sp is not None:
        check_same_on_ranks(bounds, error, sp.group, sp.stats, sp.device,
                            "cu_seqlens" if cu_seqlens is not None else "position_ids")
    elif error is not None:
        raise error
    return bounds


def _is_token_tensor(v, b: int, n: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == b and v.shape[1] == n


__all__ = ["IGNORE_INDEX", "is_vision_input", "shard_batch", "shift_labels", "packed_documents"]
