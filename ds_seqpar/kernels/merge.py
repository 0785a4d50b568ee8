"""Numerically stable merge of partial attention results over disjoint key blocks.

If block a gives (out_a, lse_a) and block b gives (out_b, lse_b) for the same queries, attention
over a ∪ b is

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Both weights are <= 1, so nothing overflows; the merge runs in fp32 for fp32 and narrower inputs
(bf16, fp16) and in fp64 for fp64 inputs (``acc_dtype``): a float64 run is then exact to float64
rounding end to end, which is how the tests tell a rounding difference from a sharding error.
A row that no key of either block may see has lse = -inf and stays (out = 0, lse = -inf).

Layouts: out_bshd [batch, seq, heads, dim], lse_bhs [batch, heads, seq] (``acc_dtype``).
"""
import torch

NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator dtype of merges and log-sum-exps: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _weight_bsh1(lse_part_bhs: torch.Tensor, lse_bhs: torch.Tensor) -> torch.Tensor:
    w_bhs = torch.exp(lse_part_bhs - lse_bhs)
    # both -inf: the row saw no key in either part; its weight is 0, not nan
    w_bhs = torch.where(torch.isneginf(lse_bhs), torch.zeros_like(w_bhs), w_bhs)
    return w_bhs.transpose(1, 2).unsqueeze(-1)


def merge_(out_acc_bshd: torch.Tensor, lse_acc_bhs: torch.Tensor,
           out_blk_bshd: torch.Tensor, lse_blk_bhs: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the accumulators (``acc_dtype``), in place."""
    lse_blk_bhs = lse_blk_bhs.to(lse_acc_bhs.dtype)
    lse_new_bhs = torch.logaddexp(lse_acc_bhs, lse_blk_bhs)
    # the two weights sum to 1, so the weighted sum is one fused lerp: acc + w_blk * (blk - acc)
    out_acc_bshd.lerp_(out_blk_bshd.to(out_acc_bshd.dtype), _weight_bsh1(lse_blk_bhs, lse_new_bhs))
    lse_acc_bhs.copy_(lse_new_bhs)


def empty_accumulators(q_bshd: torch.Tensor, head_dim_v: int):
    """(out, lse) in ``acc_dtype`` for 'no key seen yet': out = 0, lse = -inf."""
    b, s, h, _ = q_bshd.shape
    dtype = acc_dtype(q_bshd.dtype)
    out_acc = torch.zeros(b, s, h, head_dim_v, dtype=dtype, device=q_bshd.device)
    lse_acc = torch.full((b, h, s), NEG_INF, dtype=dtype, device=q_bshd.device)
    return out_acc, lse_acc
