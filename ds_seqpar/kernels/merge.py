"""Numerically stable merge of partial attention results over disjoint key blocks.

If block a gives (out_a, lse_a) and block b gives (out_b, lse_b) for the same queries, attention
over a ∪ b is

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Both weights are <= 1, so nothing overflows; the merge runs in fp32 whatever the input dtype.
A row that no key of either block may see has lse = -inf and stays (out = 0, lse = -inf).

Layouts: out_bshd [batch, seq, heads, dim], lse_bhs [batch, heads, seq] (fp32).
"""
import torch

NEG_INF = float("-inf")


def _weight_bsh1(lse_part_bhs: torch.Tensor, lse_bhs: torch.Tensor) -> torch.Tensor:
    w_bhs = torch.exp(lse_part_bhs - lse_bhs)
    # both -inf: the row saw no key in either part; its weight is 0, not nan
    w_bhs = torch.where(torch.isneginf(lse_bhs), torch.zeros_like(w_bhs), w_bhs)
    return w_bhs.transpose(1, 2).unsqueeze(-1)


def merge_(out_acc_bshd: torch.Tensor, lse_acc_bhs: torch.Tensor,
           out_blk_bshd: torch.Tensor, lse_blk_bhs: torch.Tensor) -> None:
    """Fold a block's (out, lse) into fp32 accumulators, in place."""
    lse_blk_bhs = lse_blk_bhs.float()
    lse_new_bhs = torch.logaddexp(lse_acc_bhs, lse_blk_bhs)
    # the two weights sum to 1, so the weighted sum is one fused lerp: acc + w_blk * (blk - acc)
    out_acc_bshd.lerp_(out_blk_bshd.float(), _weight_bsh1(lse_blk_bhs, lse_new_bhs))
    lse_acc_bhs.copy_(lse_new_bhs)


class FreshRows:
    """Which query rows of the accumulators no block has written yet: a block whose rows are all
    fresh is copied in (out, lse as they are), not merged."""

    def __init__(self, n: int):
        self._seen = torch.zeros(n, dtype=torch.bool)

    def fold_(self, out_acc_bshd, lse_acc_bhs, rows: slice, out_blk_bshd, lse_blk_bhs) -> None:
        """The block's (out, lse) of ``rows`` into the accumulators: copied or merged."""
        fresh = not bool(self._seen[rows].any())
        self._seen[rows] = True
        if fresh:
            out_acc_bshd[:, rows].copy_(out_blk_bshd)
            lse_acc_bhs[:, :, rows].copy_(lse_blk_bhs)
        else:
            merge_(out_acc_bshd[:, rows], lse_acc_bhs[:, :, rows], out_blk_bshd, lse_blk_bhs)


def empty_accumulators(q_bshd: torch.Tensor, head_dim_v: int):
    """fp32 (out, lse) for 'no key seen yet': out = 0, lse = -inf."""
    b, s, h, _ = q_bshd.shape
    out_acc = torch.zeros(b, s, h, head_dim_v, dtype=torch.float32, device=q_bshd.device)
    lse_acc = torch.full((b, h, s), NEG_INF, dtype=torch.float32, device=q_bshd.device)
    return out_acc, lse_acc
