"""The only module that talks to torch.distributed.

Verbs, with the process group always passed in (no group singletons):
  all_to_all     exchange one dimension for another inside a group (differentiable)
  all_gather     concatenate every rank's tensor along a dim (differentiable; dual: reduce_scatter)
  reduce_scatter sum over ranks, keep this rank's slice (dual of all_gather)
  all_to_all_async, all_gather_async, reduce_scatter_async   the same, posted: wait() later (overlap)
  all_reduce     sum (or max) over the group, in place
  ring_send_recv post a send to rank+shift and a receive from rank-shift; wait() later (overlap)
Every verb records what it sent in a ``CommStats`` (bytes this rank put on the wire, calls, and
seconds this rank spent blocked on it), so bytes can be checked against closed forms.
"""
from __future__ import annotations

import datetime
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist


class CommStats:
    """Bytes sent, calls and blocked seconds per op kind, on this rank."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.bytes: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)
        self.seconds: Dict[str, float] = defaultdict(float)

    def record(self, kind: str, nbytes: int, seconds: float = 0.0) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1
        self.seconds[kind] += seconds

    def add_seconds(self, kind: str, seconds: float) -> None:
        self.seconds[kind] += seconds

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def as_dict(self) -> dict:
        return {k: {"bytes": self.bytes[k], "calls": self.calls[k], "seconds": self.seconds[k]}
                for k in sorted(self.calls)}

    def __repr__(self) -> str:
        return f"CommStats({self.as_dict()})"


@contextmanager
def _timed(stats: Optional[CommStats], kind: str):
    start = time.perf_counter()
    yield
    if stats is not None:
        stats.add_seconds(kind, time.perf_counter() - start)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------
# process groups and basic facts


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size()


def global_rank() -> int:
    return dist.get_rank()


def backend_name() -> str:
    return dist.get_backend()


# Process groups live as long as the world and are never freed by torch; gloo starts threads for
# each. Building fresh ones for every SequenceParallel (tests and benchmarks make hundreds) piles
# up thousands of spinning threads per rank, so groups with the same ranks and timeout are shared.
# Every rank asks for the same groups in the same order, so hits and misses agree across ranks.
_GROUPS: Dict[tuple, object] = {}


def new_group(ranks: Sequence[int], timeout_s: float):
    """Collective: every rank of the world calls this for every group, in the same order."""
    key = (id(dist.group.WORLD), tuple(ranks), float(timeout_s))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks=list(ranks), timeout=datetime.timedelta(seconds=timeout_s))
    return _GROUPS[key]


def group_size(group) -> int:
    return dist.get_world_size(group)


def barrier(group=None) -> None:
    dist.barrier(group=group)


# ---------------------------------------------------------------------------------------------
# plain collectives


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, stats, kind) -> torch.Tensor:
    """Split ``x`` into P chunks along scatter_dim, send chunk j to rank j, concatenate what
    arrives along gather_dim. Shapes: [.., S_scatter, .., S_gather, ..] -> [.., S/P, .., S*P, ..]."""
    return all_to_all_async(x, scatter_dim, gather_dim, group, stats, kind).wait()


def all_to_all_async(x: torch.Tensor, scatter_dim: int, gather_dim: int, group,
                     stats: Optional[CommStats] = None, kind: str = "all_to_all") -> "PendingCollective":
    """Post the all-to-all of ``_all_to_all``; ``wait()`` returns its result (Ulysses' head chunks:
    the next chunk's exchange runs while this one computes). Not differentiable."""
    p = dist.get_world_size(group)
    if p == 1:
        return PendingCollective(None, x, x, lambda x: x, stats, kind)
    if x.shape[scatter_dim] % p:
        raise ValueError(f"all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} is not divisible "
                         f"by the group size {p}")
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    # chunks_pX: [P, ..., S_scatter/P, ...], chunk j goes to rank j. Built by unflatten + movedim
    # so that .contiguous() copies only when it must (e.g. not for the sequence dim at batch 1).
    chunks_pX = x.unflatten(scatter_dim, (p, -1)).movedim(scatter_dim, 0).contiguous()
    received_pX = torch.empty_like(chunks_pX)
    work = dist.all_to_all_single(received_pX, chunks_pX, group=group, async_op=True)
    if stats is not None:
        stats.record(kind, _nbytes(chunks_pX) * (p - 1) // p)
    # received chunk j came from rank j, which held the j-th slice of the gathered dim; flatten
    # returns a view when the layout allows (batch 1, gathering the sequence), else one copy
    return PendingCollective(work, chunks_pX, received_pX,
                             lambda got_pX: got_pX.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1),
                             stats, kind)


def all_reduce(x: torch.Tensor, group, stats: Optional[CommStats] = None, op: str = "sum",
               kind: str = "all_reduce") -> torch.Tensor:
    p = dist.get_world_size(group)
    if p == 1:
        return x
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    with _timed(stats, kind):
        dist.all_reduce(x, op=reduce_op, group=group)
    if stats is not None:
        # ring all-reduce: each rank sends 2 (P-1)/P of the buffer
        stats.record(kind, 2 * _nbytes(x) * (p - 1) // p)
    return x


def _all_gather(x: torch.Tensor, dim: int, group, stats, kind) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    return torch.cat(all_gather_async(x, group, stats, kind).wait(), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group, stats, kind) -> torch.Tensor:
    """Sum over ranks, keep this rank's 1/P slice along ``dim``. Built on all-to-all (gloo has no
    reduce-scatter); the bytes on the wire are those of a reduce-scatter: (P-1)/P of x."""
    if dist.get_world_size(group) == 1:
        return x
    return reduce_scatter_async(x, dim, group, stats, kind).wait()


def gather_object(obj, group=None) -> list:
    """Every rank's python object, in rank order (used for startup agreement checks)."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# ---------------------------------------------------------------------------------------------
# differentiable collectives: each backward calls its dual


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, stats, kind):
        ctx.dims, ctx.group, ctx.stats, ctx.kind = (scatter_dim, gather_dim), group, stats, kind
        return _all_to_all(x, scatter_dim, gather_dim, group, stats, kind)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        # dual: the reverse exchange (gather_dim is split again, scatter_dim re-assembled)
        grad_in = _all_to_all(grad.contiguous(), gather_dim, scatter_dim, ctx.group, ctx.stats, ctx.kind)
        return grad_in, None, None, None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group,
               stats: Optional[CommStats] = None, kind: str = "all_to_all") -> torch.Tensor:
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, stats, kind)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, stats, kind):
        ctx.dim, ctx.group, ctx.stats, ctx.kind = dim, group, stats, kind
        return _all_gather(x, dim, group, stats, kind)

    @staticmethod
    def backward(ctx, grad):
        # dual of all-gather: every rank's copy of the output contributed, so sum and scatter
        return _reduce_scatter(grad.contiguous(), ctx.dim, ctx.group, ctx.stats, ctx.kind), None, None, None, None


def all_gather(x: torch.Tensor, dim: int, group, stats: Optional[CommStats] = None,
               kind: str = "all_gather") -> torch.Tensor:
    return _AllGather.apply(x, dim, group, stats, kind)


# not differentiable: used inside hand-written backward passes and the opaque ops (ds_seqpar/ops)
def reduce_scatter(x: torch.Tensor, dim: int, group, stats: Optional[CommStats] = None,
                   kind: str = "reduce_scatter") -> torch.Tensor:
    return _reduce_scatter(x, dim, group, stats, kind)


def all_gather_nograd(x: torch.Tensor, dim: int, group, stats: Optional[CommStats] = None,
                      kind: str = "all_gather") -> torch.Tensor:
    return _all_gather(x, dim, group, stats, kind)


def all_to_all_nograd(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, stats=None, kind="all_to_all"):
    return _all_to_all(x, scatter_dim, gather_dim, group, stats, kind)

# ---------------------------------------------------------------------------------------------
# point to point: the ring


class PendingP2P:
    """Posted sends/receives; ``wait()`` blocks until done and returns the received tensors."""

    def __init__(self, works, received: List[torch.Tensor], stats, kind):
        self._works, self._received, self._stats, self._kind = works, received, stats, kind

    def wait(self) -> List[torch.Tensor]:
        with _timed(self._stats, self._kind):
            for w in self._works:
                w.wait()
        self._works = []
        return self._received


class PendingCollective(PendingP2P):
    """A posted collective (async_op=True: gloo runs it on its own threads while this one
    computes); ``wait()`` blocks, then returns ``finish(received)``. Holds its send buffer so
    that it outlives the transfer."""

    def __init__(self, work, sent: torch.Tensor, received, finish: Callable, stats, kind):
        super().__init__([work] if work is not None else [], received, stats, kind)
        self._sent, self._finish = sent, finish

    def wait(self):
        return self._finish(super().wait())


def all_gather_async(x: torch.Tensor, group, stats: Optional[CommStats] = None,
                     kind: str = "all_gather") -> PendingCollective:
    """Post an all-gather of ``x``; ``wait()`` returns every rank's tensor, in rank order."""
    x = x.contiguous()
    p = dist.get_world_size(group)
    if p == 1:
        return PendingCollective(None, x, [x], lambda parts: parts, stats, kind)
    parts = [torch.empty_like(x) for _ in range(p)]
    work = dist.all_gather(parts, x, group=group, async_op=True)
    if stats is not None:
        stats.record(kind, _nbytes(x) * (p - 1))
    return PendingCollective(work, x, parts, lambda parts: parts, stats, kind)


def reduce_scatter_async(x: torch.Tensor, dim: int, group, stats: Optional[CommStats] = None,
                         kind: str = "reduce_scatter") -> PendingCollective:
    """Post a reduce-scatter of ``x`` along ``dim`` (an all-to-all then a local sum: gloo has no
    reduce-scatter; the bytes are a reduce-scatter's, (P-1)/P of x); ``wait()`` returns this
    rank's summed slice. Not differentiable (used inside hand-written backward passes)."""
    p = dist.get_world_size(group)
    if p == 1:
        return PendingCollective(None, x, x, lambda x: x, stats, kind)
    pieces_pX = torch.stack(torch.tensor_split(x, p, dim=dim)).contiguous()   # piece j goes to rank j
    received_pX = torch.empty_like(pieces_pX)
    work = dist.all_to_all_single(received_pX, pieces_pX, group=group, async_op=True)
    if stats is not None:
        stats.record(kind, _nbytes(pieces_pX) * (p - 1) // p)
    return PendingCollective(work, pieces_pX, received_pX, lambda received_pX: received_pX.sum(0), stats, kind)


def p2p(sends: Sequence, recvs: Sequence, group, stats: Optional[CommStats] = None,
        kind: str = "p2p") -> PendingP2P:
    """Post ``sends`` [(tensor, group_rank)] and ``recvs`` [(buffer, group_rank)] at once."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer), group)
           for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, peer), group) for buf, peer in recvs]
    works = dist.batch_isend_irecv(ops) if ops else []
    if stats is not None:
        stats.record(kind, sum(_nbytes(t) for t, _ in sends))
    return PendingP2P(works, [buf for buf, _ in recvs], stats, kind)


def ring_send_recv(tensors: Sequence[torch.Tensor], group, stats: Optional[CommStats] = None,
                   shift: int = 1, kind: str = "ring") -> PendingP2P:
    """Send ``tensors`` to rank+shift and receive same-shaped ones from rank-shift (mod P).
    shift=+1 walks the ring forward; shift=-1 walks it in reverse (backward passes)."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    dst, src = (r + shift) % p, (r - shift) % p
    sends = [(t, dst) for t in tensors]
    recvs = [(torch.empty_like(t), src) for t in tensors]
    return p2p(sends, recvs, group, stats, kind)


def init_local(rank: int, world: int, port: int, timeout_s: float, backend: str = "gloo") -> None:
    """Join a world of local processes (test pools and the benchmark's own launcher)."""
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def destroy() -> None:
    _GROUPS.clear()
    if is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# differentiable reductions (training loss)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, stats, kind):
        return all_reduce(x.clone(), group, stats, "sum", kind)

    @staticmethod
    def backward(ctx, grad):
        # dual of an all-reduce whose output is replicated: every rank back-propagates the same
        # upstream gradient, and d(sum_r x_r)/d x_r = 1, so each rank keeps the gradient as is
        # (Megatron's reduce-from-region). Summing it again here would count it P times.
        return grad, None, None, None


def all_reduce_sum(x: torch.Tensor, group, stats: Optional[CommStats] = None,
                   kind: str = "all_reduce") -> torch.Tensor:
    """Sum over the group, out of place, same value on every rank; backward is the identity."""
    return _AllReduceSum.apply(x, group, stats, kind)
