"""Sharding a training batch: labels shifted over the whole sequence, then every [batch, seq]
tensor cut into this rank's tokens in the strategy's layout.

Legend: B = micro batch, N = global sequence length, L = local tokens (N / sp size).
"""
from __future__ import annotations

from typing import Dict, Mapping

import torch

from .padding import pad_to

IGNORE_INDEX = -100          # labels the loss leaves out (Hugging Face's and torch's convention)


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
    if sp is None:
        whole = torch.arange(n, device=ids_bn.device).expand(b, n)
        out["position_ids"] = given_pos if given_pos is not None else whole
        return out
    # any length: pad at the end to what the layout needs (padding.py); pads are ignored labels
    padded = sp.padded_len(n)
    local = {}
    for key, v in out.items():
        if _is_token_tensor(v, b, n):
            fill = ignore_index if key == "labels" else 0
            v = sp.shard(pad_to(v, 1, padded, fill), dim=1)
        local[key] = v
    if given_pos is not None:
        local["position_ids"] = sp.shard(pad_to(given_pos.expand(b, n), 1, padded), dim=1)
    else:
        local["position_ids"] = sp.position_ids(n, device=ids_bn.device).expand(b, -1)   # [B, L]
    return local


def _is_token_tensor(v, b: int, n: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == b and v.shape[1] == n


__all__ = ["IGNORE_INDEX", "shard_batch", "shift_labels"]
