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
from typing import Optional

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


class Seen:
    """Which tokens [off, off + n) of an accumulator hold a value yet: bytes, since a band's pieces ask
    per piece (a torch op per question cost as much as the merges it saved)."""

    def __init__(self, n: int, buf: Optional[bytearray] = None, off: int = 0):
        self.buf, self.off, self.n = (bytearray(n) if buf is None else buf), off, n

    def span(self, tokens: slice):
        a, b, _ = tokens.indices(self.n)
        return self.off + a, self.off + b

    def part(self, tokens: slice) -> "Seen":
        a, b = self.span(tokens)
        return Seen(b - a, self.buf, a)

    def none(self, a: int, b: int) -> bool:
        return self.buf.find(1, a, b) < 0

    def all(self, a: int, b: int) -> bool:
        return self.buf.find(0, a, b) < 0

    def mark(self, a: int, b: int) -> None:
        self.buf[a:b] = b"\x01" * (b - a)

    def unseen(self, a: int, b: int) -> torch.Tensor:
        """bool [b - a]: the tokens of [a, b) without a value."""
        return torch.frombuffer(bytearray(self.buf[a:b]), dtype=torch.uint8) == 0


class Merge:
    """(out, lse) accumulators (``acc_dtype``) of some query rows, and which rows hold a value yet: a block over
    rows none of which does is copied in, not merged. ``part(rows)`` is a view of some rows, so a
    kernel folds the pieces of a band straight into its caller's accumulators."""

    def __init__(self, out_acc_bshd, lse_acc_bhs, seen: Optional[Seen] = None):
        self.out, self.lse = out_acc_bshd, lse_acc_bhs
        self.seen = Seen(out_acc_bshd.shape[1]) if seen is None else seen

    @classmethod
    def empty(cls, q_bshd: torch.Tensor, head_dim_v: int) -> "Merge":
        return cls(*empty_accumulators(q_bshd, head_dim_v))

    def part(self, rows: slice) -> "Merge":
        return Merge(self.out[:, rows], self.lse[:, :, rows], self.seen.part(rows))

    def fold_(self, rows: slice, out_blk_bshd, lse_blk_bhs) -> None:
        """A block's (out, lse) of ``rows``: copied or merged."""
        a, b = self.seen.span(rows)
        if self.seen.none(a, b):
            self.out[:, rows].copy_(out_blk_bshd)
            self.lse[:, :, rows].copy_(lse_blk_bhs)
        else:
            merge_(self.out[:, rows], self.lse[:, :, rows], out_blk_bshd, lse_blk_bhs)
        self.seen.mark(a, b)


class Sum:
    """A sum (``acc_dtype``) of gradient pieces over the tokens (dim 1) of ``acc``, and which tokens hold a value
    yet: a piece over tokens none of which does is copied in, not added (no zero fill); ``total()``
    zeroes the tokens no piece reached. ``part(tokens)`` is a view, as Merge's."""

    def __init__(self, acc: torch.Tensor, seen: Optional[Seen] = None):
        self.acc = acc
        self.seen = Seen(acc.shape[1]) if seen is None else seen

    @classmethod
    def empty(cls, like: torch.Tensor) -> "Sum":
        return cls(torch.empty(like.shape, dtype=acc_dtype(like.dtype), device=like.device))

    def part(self, tokens: slice) -> "Sum":
        return Sum(self.acc[:, tokens], self.seen.part(tokens))

    def add_(self, tokens: slice, x: torch.Tensor) -> None:
        a, b = self.seen.span(tokens)
        if self.seen.none(a, b):
            self.acc[:, tokens].copy_(x)
        else:
            if not self.seen.all(a, b):
                self.acc[:, tokens][:, self.seen.unseen(a, b).to(self.acc.device)] = 0
            self.acc[:, tokens] += x
        self.seen.mark(a, b)

    def total(self) -> torch.Tensor:
        a, b = self.seen.off, self.seen.off + self.seen.n
        if not self.seen.all(a, b):
            self.acc[:, self.seen.unseen(a, b).to(self.acc.device)] = 0
        return self.acc


def empty_accumulators(q_bshd: torch.Tensor, head_dim_v: int):
    """(out, lse) in ``acc_dtype`` for 'no key seen yet': out = 0, lse = -inf."""
    b, s, h, _ = q_bshd.shape
    dtype = acc_dtype(q_bshd.dtype)
    out_acc = torch.zeros(b, s, h, head_dim_v, dtype=dtype, device=q_bshd.device)
    lse_acc = torch.full((b, h, s), NEG_INF, dtype=dtype, device=q_bshd.device)
    return out_acc, lse_acc
