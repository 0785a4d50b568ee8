"""Ulysses: all-to-all from sequence-sharded to head-sharded, full-sequence attention, and back.

Notation: P ranks in the Ulysses group, S_local tokens per rank, H q heads, H_kv k/v heads.

    q_bshd [b, S_local, H, d] --all_to_all(heads -> seq)--> [b, P*S_local, H/P, d]
    local kernel over the whole sequence (this rank's H/P heads)
    out    [b, P*S_local, H/P, d] --all_to_all(seq -> heads)--> [b, S_local, H, d]

Backward is the same exchanges in reverse (each all-to-all's dual): dout goes heads-sharded, the
kernel's backward runs on the saved head-sharded q, k, v, out, lse, and dq, dk, dv come back
sequence-sharded. ``head_parallel_forward`` / ``_backward`` are that sandwich around any inner
attention (the kernel here; the ring loop in the 2D hybrid, hybrid.py).

Head chunks (C = ctx.ulysses_chunks, "ulysses_chunks" in the config): this rank's H/P heads are
cut into C chunks of whole K/V groups (C divides this rank's k/v heads: ``chunk_counts``), and the
sandwich runs per chunk, pipelined through comm.all_to_all_async:

    post q,k,v chunk 0 | wait 0, post 1 | attend 0, post out 0 | wait 1, post 2 | attend 1, post out 1 ...

so only chunk 0's exchange in and chunk C-1's exchange out are exposed (cost/chunks.py prices it);
backward pipelines dout in and dq, dk, dv out the same way. Exact: attention is independent per head,
the kernel sees the same rows of the same heads, so the result is bit for bit that of C = 1; the
bytes are the same (each tensor still sends (P-1)/P of itself), in C times the calls.

GQA: K/V travel with their own H_kv heads. When P does not divide H_kv, each k/v head is
repeated the least number of times f = P / gcd(H_kv, P) that makes H_kv*f split over P ranks;
backward sums the copies' gradients back (``_sum_copies``). Rank r then holds q heads
[r*H/P, (r+1)*H/P) and exactly the k/v heads they use.

Bytes per rank, one forward + backward, element size e: q, k, v, out forward and dout, dq, dk,
dv backward, each sending (P-1)/P of its local tensor: 8*e*S*(P-1)/P for MHA, where S is the
number of elements of one local full-head tensor.

Packed documents (cu_seqlens) and sliding windows: after the all-to-all every rank holds the whole
sequence, so local attention follows the mask's plan over one position (mask_plan.py: a causal band
per document, a window's band; end padding pairs with nothing) through the ring loop's single step;
the bytes are unchanged. Softcap goes to the
kernel; sinks join the final merge (ring_loop.apply_sinks_), each rank with its heads' sinks
(``local_heads``): its sink gradient is its heads' share, the others' rows are zero.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from .. import comm
from ..kernels import acc_dtype
from ..errors import ConfigError
from ..kernels.base import check_head_groups
from ..masks import Mask
from ..sharding.layouts import make_layout
from .base import Strategy
from .mask_plan import plain_blocks, plan_mask
from .ring_loop import ring_forward, ring_grads


def kv_replication(num_heads: int, num_kv_heads: int, size: int) -> int:
    """Least repeat factor of each k/v head so the k/v heads split evenly over ``size`` ranks."""
    return size // math.gcd(num_kv_heads, size)


def check_ulysses_heads(num_heads: int, num_kv_heads: int, size: int, key: str) -> None:
    if num_heads % size:
        valid = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(f"{key}={size}: Ulysses splits attention heads over ranks, and {num_heads} q heads "
                         f"are not divisible by {size}; use a {key} that divides {num_heads} "
                         f"({', '.join(map(str, valid))}) or a ring strategy (ring, zigzag, striped)")
    check_head_groups(num_heads, num_kv_heads)


def chunk_counts(num_heads: int, num_kv_heads: int, size: int) -> List[int]:
    """The head chunk counts a Ulysses rank can run: divisors of its k/v heads after the exchange
    (H_kv * f / P, f = kv_replication), so that every chunk holds whole K/V groups and their q heads."""
    kv_local = num_kv_heads * kv_replication(num_heads, num_kv_heads, size) // size
    return [c for c in range(1, kv_local + 1) if kv_local % c == 0]


def check_ulysses_chunks(chunks, num_heads: int, num_kv_heads: int, size: int,
                         key: str = "sequence_parallel.ulysses_chunks") -> None:
    """ConfigError unless ``chunks`` ("auto" or an int) splits this rank's heads into whole K/V groups."""
    if chunks == "auto" or size == 1:
        return
    valid = chunk_counts(num_heads, num_kv_heads, size)
    if chunks not in valid:
        raise ConfigError(f"{key}={chunks!r}: after the all-to-all each of the {size} ranks holds "
                          f"{num_heads // size} q heads and {valid[-1]} k/v heads ({num_heads} q / {num_kv_heads} kv "
                          f"heads in all), and chunks must hold whole k/v groups; valid: "
                          f"{', '.join(map(str, valid))} or 'auto'")


def _head_chunk(x_bshd: torch.Tensor, size: int, chunks: int, c: int) -> torch.Tensor:
    """[b, s, H, d] -> [b, s, H/C, d]: the c-th of C equal pieces of every rank's H/P heads, in rank
    order, so that seq_to_heads hands rank r the c-th chunk of its own heads."""
    if chunks == 1:
        return x_bshd
    return x_bshd.unflatten(2, (size, chunks, -1))[:, :, :, c].flatten(2, 3)     # [b, s, P, H/(P C), d] -> ..


def _join_chunks(parts_bshd: List[torch.Tensor], size: int) -> torch.Tensor:
    """_head_chunk's inverse: C tensors [b, s, H/C, d] -> [b, s, H, d]."""
    if len(parts_bshd) == 1:
        return parts_bshd[0]
    return torch.stack([p.unflatten(2, (size, -1)) for p in parts_bshd], 3).flatten(2, 4)   # [b, s, P, C, h, d]


def _sum_copies(dx_bshd: torch.Tensor, f: int) -> torch.Tensor:
    """repeat_interleave's dual: [b, s, H_kv*f, d] -> [b, s, H_kv, d], each head's f copies summed."""
    if f == 1:
        return dx_bshd
    b, s, h, d = dx_bshd.shape
    return dx_bshd.reshape(b, s, h // f, f, d).sum(3)


def local_heads(per_head: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """The entries of a per-q-head tensor (sinks) for the heads this rank holds after the exchange."""
    return per_head.chunk(size)[rank]


def _all_heads(dper_head_local: Optional[torch.Tensor], like: torch.Tensor, size: int, rank: int):
    """local_heads' dual: this rank's heads' gradient in a zero [H] tensor (the others' rows are zero)."""
    if dper_head_local is None:
        return None
    out = torch.zeros_like(like)
    out.chunk(size)[rank].copy_(dper_head_local)
    return out


# Inner = (q_u, k_u, v_u, sinks_h) -> (out_u, lse_u); InnerGrads = (dout_u, q_u, k_u, v_u, out_u, lse_u,
# sinks_h) -> (dq_u, dk_u, dv_u, dsinks_h or None): the attention of the head-sharded, whole-shard tensors
# (one head chunk of them: heads are independent)
Inner = Callable
InnerGrads = Callable
SAVED_PER_CHUNK = 5            # q_u, k_u, v_u, out_u, lse_u


def head_chunks(ctx, q_bshd, k_bshd) -> int:
    """How many head chunks this call runs (ctx.ulysses_chunks: the configured count, or "auto"'s
    price from cost/chunks.py): a function of the shapes only, so forward, fake and every rank agree;
    refused (ConfigError) unless the chunks hold whole K/V groups."""
    size = ctx.ulysses_size
    if size == 1:
        return 1
    b, n, h, d = q_bshd.shape
    chunks = ctx.ulysses_chunks(n, h, k_bshd.shape[2], d, q_bshd.element_size())
    check_ulysses_chunks(chunks, h, k_bshd.shape[2], size)
    return chunks


def head_parallel_forward(ctx, q_bshd, k_bshd, v_bshd, sinks, inner: Inner):
    """(out [b, n, H, d], saved: [q_u, k_u, v_u, out_u, lse_u] per head chunk): all-to-all to
    head-sharded tensors [b, U*n, H/(U C), d] one head chunk at a time, ``inner`` on each, all-to-all
    back. Chunk c+1's exchange is in flight while chunk c computes, and chunk c's output travels while
    c+1 computes (C = 1: today's exposed sandwich)."""
    group, size, stats = ctx.ulysses_group, ctx.ulysses_size, ctx.stats
    chunks = head_chunks(ctx, q_bshd, k_bshd)
    f = kv_replication(q_bshd.shape[2], k_bshd.shape[2], size)
    if f > 1:
        k_bshd = k_bshd.repeat_interleave(f, dim=2)   # [b, S_local, H_kv*f, d]
        v_bshd = v_bshd.repeat_interleave(f, dim=2)
    sinks_h = None if sinks is None else local_heads(sinks, size, ctx.ulysses_rank).chunk(chunks)

    def post(c):                                      # chunk c of q, k, v: seq -> heads, posted
        return [comm.all_to_all_async(_head_chunk(t, size, chunks, c), 2, 1, group, stats)
                for t in (q_bshd, k_bshd, v_bshd)]
    arriving, leaving, saved = post(0), [], []
    for c in range(chunks):
        q_u, k_u, v_u = (p.wait() for p in arriving)
        if c + 1 < chunks:
            arriving = post(c + 1)                    # the next chunk travels while this one computes
        out_u, lse_u = inner(q_u, k_u, v_u, None if sinks_h is None else sinks_h[c])
        leaving.append(comm.all_to_all_async(out_u, 1, 2, group, stats))
        saved += [q_u, k_u, v_u, out_u, lse_u]
    return _join_chunks([p.wait() for p in leaving], size), saved


def head_parallel_backward(ctx, dout_bshd, k_bshd, saved: List[torch.Tensor], sinks, inner_grads: InnerGrads):
    """(dq, dk, dv, dsinks or None) of head_parallel_forward: per head chunk (as many as it saved),
    dout's exchange, ``inner_grads``, dq/dk/dv's exchange back, the next chunk's dout in flight while
    one computes; k/v copies summed back."""
    group, size, stats = ctx.ulysses_group, ctx.ulysses_size, ctx.stats
    chunks = len(saved) // SAVED_PER_CHUNK
    sinks_h = None if sinks is None else local_heads(sinks, size, ctx.ulysses_rank).chunk(chunks)
    dout_bshd = dout_bshd.contiguous()

    def post(c):
        return comm.all_to_all_async(_head_chunk(dout_bshd, size, chunks, c), 2, 1, group, stats)
    arriving, leaving, dsinks = post(0), [], []
    for c in range(chunks):
        dout_u = arriving.wait()
        if c + 1 < chunks:
            arriving = post(c + 1)
        q_u, k_u, v_u, out_u, lse_u = saved[SAVED_PER_CHUNK * c:SAVED_PER_CHUNK * (c + 1)]
        *grads, ds = inner_grads(dout_u, q_u, k_u, v_u, out_u, lse_u, None if sinks_h is None else sinks_h[c])
        leaving.append([comm.all_to_all_async(g.contiguous(), 1, 2, group, stats) for g in grads])
        dsinks.append(ds)
    f = kv_replication(saved[0].shape[2] * chunks * size, k_bshd.shape[2], size)
    dq, dk, dv = (_join_chunks([p[i].wait() for p in leaving], size) for i in range(3))
    dsinks_h = None if dsinks[0] is None else torch.cat(dsinks)
    return dq, _sum_copies(dk, f), _sum_copies(dv, f), _all_heads(dsinks_h, sinks, size, ctx.ulysses_rank)


def fake_head_parallel(ctx, q_bshd, k_bshd, v_bshd):
    """(out, saved) of head_parallel_forward, shapes and dtypes only (the compiler's fake)."""
    b, n, h, d = q_bshd.shape
    u, chunks = ctx.ulysses_size, head_chunks(ctx, q_bshd, k_bshd)
    h_kv = k_bshd.shape[2] * kv_replication(h, k_bshd.shape[2], u)
    dv = v_bshd.shape[-1]
    hc, kc = h // (u * chunks), h_kv // (u * chunks)
    saved = [t for _ in range(chunks) for t in (
        q_bshd.new_empty((b, u * n, hc, d)), k_bshd.new_empty((b, u * n, kc, d)),
        v_bshd.new_empty((b, u * n, kc, dv)), q_bshd.new_empty((b, u * n, hc, dv)),
        q_bshd.new_empty((b, hc, u * n), dtype=acc_dtype(q_bshd.dtype)))]
    return q_bshd.new_empty((b, n, h, dv)), saved


class UlyssesAttention(Strategy):
    name = "ulysses"
    layout_name = "contiguous"

    def __init__(self, ctx):
        super().__init__(ctx)
        whole = make_layout("contiguous", 1)            # after the all-to-all: one position, global order
        self._build = lambda mask, padded: plan_mask(mask, whole, padded, plain_blocks)

    def plan(self, mask: Mask, padded: int):
        """The one-position plan of ``mask`` over the whole ``padded`` sequence (built once per mask: the plans
        the context keeps, sharding/batch_masks.py)."""
        return self.ctx.plans.get(mask, padded, self._build)

    @staticmethod
    def _kernel_alone(mask: Mask, softcap, sinks) -> bool:
        """A plain mask (end padding at most) and no score modifier: one kernel call on the whole sequence."""
        return mask.docs is None and mask.window is None and mask.blocks is None and softcap is None and sinks is None

    @staticmethod
    def _keys(mask: Mask, padded: int) -> int:
        """Non-causal end padding (padding.py): the real keys are the first ``real`` of the whole sequence."""
        return padded if mask.causal else mask.real(padded)

    def forward(self, q_bshd, k_bshd, v_bshd, mask: Mask, scale, softcap=None, sinks=None):
        ctx = self.ctx

        def inner(q_u, k_u, v_u, sinks_h):
            padded = q_u.shape[1]
            if self._kernel_alone(mask, softcap, sinks):
                keys = self._keys(mask, padded)
                return ctx.kernel.forward(q_u, k_u[:, :keys], v_u[:, :keys], mask.causal, scale)
            # the whole sequence is here, in global order: the plan's bands through the ring loop's
            # single step (one position, nothing travels), which also applies softcap in the kernel and
            # sinks in the final merge
            return ring_forward(q_u, k_u, v_u, scale, ctx, self.plan(mask, padded), softcap, sinks_h)
        return head_parallel_forward(ctx, q_bshd, k_bshd, v_bshd, sinks, inner)

    def backward(self, dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, saved, mask: Mask, scale, softcap=None,
                 sinks=None):
        ctx = self.ctx

        def inner_grads(dout_u, q_u, k_u, v_u, out_u, lse_u, sinks_h):
            padded = q_u.shape[1]
            if self._kernel_alone(mask, softcap, sinks):
                keys = self._keys(mask, padded)
                dq, dk, dv = ctx.kernel.backward(dout_u, q_u, k_u[:, :keys], v_u[:, :keys], out_u, lse_u,
                                                 mask.causal, scale)
                pad = (0, 0, 0, 0, 0, padded - keys)     # the padding keys get no gradient
                return dq, F.pad(dk, pad), F.pad(dv, pad), None
            return ring_grads(dout_u, q_u, k_u, v_u, out_u, lse_u, scale, ctx, self.plan(mask, padded),
                              softcap, sinks_h)
        return head_parallel_backward(ctx, dout_bshd, k_bshd, saved, sinks, inner_grads)

    def fake(self, q_bshd, k_bshd, v_bshd, sinks=None):
        return fake_head_parallel(self.ctx, q_bshd, k_bshd, v_bshd)
