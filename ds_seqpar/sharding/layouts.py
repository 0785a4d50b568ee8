"""Token layouts: which global tokens each sequence-parallel rank holds, in what local order.

A layout is an invertible permutation of the N tokens of one sequence over the P ranks of a
sequence-parallel group. Pure arithmetic: no processes, no torch.distributed, nothing cached.

Legend: N = global sequence length, P = layout size (ranks), L = N // P tokens per rank,
C = N // (2P) tokens per zigzag chunk, R = ring_size, U = ulysses_size,
rank = ring_rank * U + ulysses_rank (as in topology.py).
"""
from __future__ import annotations

import math
import operator
from typing import List, Sequence, Tuple

import torch

__all__ = ["Layout", "ContiguousLayout", "ZigzagLayout", "StripedLayout", "HybridLayout",
           "LAYOUTS", "make_layout"]


def _positive_int(value, what: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{what} must be a positive integer, got {number}")
    return number


def _normalize_dim(x: torch.Tensor, dim: int) -> int:
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


class Layout:
    """Base class; the contract every layout keeps (tests/unit/test_layouts.py checks it for each):

    * `size` ranks, each holding exactly L = N // size tokens. `validate(N)` returns N when it is
      a positive multiple of `required_multiple`, else raises ValueError naming the length, the
      layout, the divisor and the nearest valid lengths below and above.
    * `indices(N, rank)`: global positions of rank's tokens in its local order (its RoPE
      position_ids). Over all ranks they partition range(N).
    * `permutation(N)` = cat(indices(N, r) for r in range(size)): global -> rank-major order,
      `x[permutation(N)][inverse(N)] == x`.
    * `shard(x, dim, rank) == x.index_select(dim, indices(N, rank))`, possibly as a view of x
      (do not modify it in place); `unshard([shard(x, dim, r) for r in ranks], dim) == x`.
      Both are differentiable.

    A subclass sets `name`, `required_multiple`, `_local_indices`; it may override `_piece` and
    `_unshard` with view-based fast paths (the defaults use index_select).
    """

    name = "layout"

    def __init__(self, size: int):
        self.size = _positive_int(size, f"{type(self).__name__} size")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size})"

    @property
    def ring_layout(self) -> "Layout":
        """The layout across ring positions (a hybrid's ring; a plain layout is its own ring)."""
        return self

    @property
    def required_multiple(self) -> int:
        raise NotImplementedError

    @property
    def _divisor_text(self) -> str:
        return f"size={self.required_multiple}"

    @property
    def _what(self) -> str:
        return f"{self.name} layout (size={self.size})"

    def validate(self, seq_len: int) -> int:
        """Return seq_len as an int, or raise ValueError saying how to fix it."""
        m = self.required_multiple
        n = _positive_int(seq_len, f"sequence length for the {self._what}")
        if n % m:
            below, above = n // m * m, n // m * m + m
            fix = (f"nearest valid lengths are {below} (below) and {above} (above): pad to "
                   f"{above} or truncate to {below}" if below else
                   f"there is no valid length below; the nearest above is {above}: pad to {above}")
            raise ValueError(f"sequence length {n} is not divisible by {self._divisor_text} as the "
                             f"{self._what} needs; {fix}")
        return n

    def _check_rank(self, rank: int) -> int:
        try:
            r = -1 if isinstance(rank, bool) else operator.index(rank)
        except TypeError:
            r = -1
        if not 0 <= r < self.size:
            raise ValueError(f"rank {rank} is out of range for the {self._what}: "
                             f"expected 0 <= rank < {self.size}")
        return r

    def local_len(self, seq_len: int) -> int:
        return self.validate(seq_len) // self.size

    def indices(self, seq_len: int, rank: int, device=None) -> torch.Tensor:
        """Global positions held by `rank`, in local order (int64, shape [N // size])."""
        idx = self._local_indices(self.validate(seq_len), self._check_rank(rank))
        return idx if device is None else idx.to(device)

    def permutation(self, seq_len: int, device=None) -> torch.Tensor:
        """perm[i] = global position of the i-th token in rank-major order."""
        n = self.validate(seq_len)
        perm = torch.cat([self._local_indices(n, r) for r in range(self.size)])
        return perm if device is None else perm.to(device)

    def inverse(self, seq_len: int, device=None) -> torch.Tensor:
        """inv[t] = rank-major slot of global token t (argsort of the permutation)."""
        return torch.argsort(self.permutation(seq_len, device))

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Global-order x -> this rank's tokens along `dim`, in local order."""
        d = _normalize_dim(x, dim)
        n = self.validate(x.size(d))
        return self._piece(x, d, self._check_rank(rank), 0, n // self.size)

    def unshard(self, shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """Per-rank tensors (rank order) -> the global-order tensor; inverse of shard."""
        shards = list(shards)
        if len(shards) != self.size:
            raise ValueError(f"the {self._what} unshards exactly {self.size} shards, "
                             f"got {len(shards)}")
        shapes = {tuple(s.shape) for s in shards}
        if len(shapes) != 1:
            raise ValueError(f"shards for the {self._what} must all have the same shape, "
                             f"got {sorted(shapes)}")
        d = _normalize_dim(shards[0], dim)
        n = self.validate(shards[0].size(d) * self.size)
        return self._unshard(shards, d, n)

    # -- overridable pieces; arguments already validated, dim >= 0 ----------------------------

    def _local_indices(self, n: int, rank: int) -> torch.Tensor:
        raise NotImplementedError

    def _piece(self, x: torch.Tensor, dim: int, rank: int, start: int, length: int):
        """Slots [start, start + length) of rank's local order, taken from global-order x."""
        idx = self._local_indices(x.size(dim), rank).narrow(0, start, length)
        return x.index_select(dim, idx.to(x.device))

    def _unshard(self, shards: List[torch.Tensor], dim: int, n: int) -> torch.Tensor:
        inv = self.inverse(n, device=shards[0].device)
        return torch.cat(shards, dim).index_select(dim, inv)


class ContiguousLayout(Layout):
    """Rank r holds tokens [r*L, (r+1)*L). Plain ring attention; causal work is imbalanced:
    the last rank does about 2P-1 times the work of the first (shard is a narrow, no copy).

    N=8, P=2:

        rank of each token: 0 0 0 0 1 1 1 1
               0 1 2 3 | 4 5 6 7
        r0  0  x . . . | . . . .
            1  x x . . | . . . .
            2  x x x . | . . . .
            3  x x x x | . . . .
               --------+--------
        r1  4  x x x x | x . . .
            5  x x x x | x x . .
            6  x x x x | x x x .
            7  x x x x | x x x x
        causal (q, k) pairs per rank: r0=10 r1=26
    """

    name = "contiguous"

    @property
    def required_multiple(self) -> int:
        return self.size

    def _local_indices(self, n: int, rank: int) -> torch.Tensor:
        length = n // self.size
        return torch.arange(rank * length, (rank + 1) * length)

    def _piece(self, x, dim, rank, start, length):
        return x.narrow(dim, rank * (x.size(dim) // self.size) + start, length)

    def _unshard(self, shards, dim, n):
        return torch.cat(shards, dim)


class ZigzagLayout(Layout):
    """The sequence in 2P chunks of C tokens; rank r holds chunk r then chunk 2P-1-r, so every
    rank pairs an early chunk with a late one and causal work is exactly equal (size 1 is the
    identity and accepts any length).

    N=8, P=2 (chunks [0 1] [2 3] [4 5] [6 7]):

        rank of each token: 0 0 1 1 1 1 0 0
               0 1 6 7 | 2 3 4 5
        r0  0  x . . . | . . . .
            1  x x . . | . . . .
            6  x x x . | x x x x
            7  x x x x | x x x x
               --------+--------
        r1  2  x x . . | x . . .
            3  x x . . | x x . .
            4  x x . . | x x x .
            5  x x . . | x x x x
        causal (q, k) pairs per rank: r0=18 r1=18
    """

    name = "zigzag"

    @property
    def required_multiple(self) -> int:
        return 2 * self.size if self.size > 1 else 1

    @property
    def _divisor_text(self) -> str:
        return f"2*size={2 * self.size}"

    def _spans(self, n: int, rank: int) -> List[Tuple[int, int]]:
        """(global start, length) of the runs that make up rank's local order."""
        if self.size == 1:
            return [(0, n)]
        c = n // (2 * self.size)
        return [(rank * c, c), ((2 * self.size - 1 - rank) * c, c)]

    def _local_indices(self, n, rank):
        return torch.cat([torch.arange(s, s + c) for s, c in self._spans(n, rank)])

    def _piece(self, x, dim, rank, start, length):
        parts, offset, end = [], 0, start + length
        for begin, c in self._spans(x.size(dim), rank):
            lo, hi = max(start, offset), min(end, offset + c)
            if lo < hi:
                parts.append(x.narrow(dim, begin + lo - offset, hi - lo))
            offset += c
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def _unshard(self, shards, dim, n):
        if self.size == 1:
            return torch.cat(shards, dim)
        c = n // (2 * self.size)
        early = [s.narrow(dim, 0, c) for s in shards]
        late = [s.narrow(dim, c, c) for s in reversed(shards)]
        return torch.cat(early + late, dim)


class StripedLayout(Layout):
    """Rank r holds tokens r, r+P, r+2P, ...: token-granular balance. Against keys of a lower
    (or the same) rank every block is causal with its diagonal; against a higher rank it is
    causal without the diagonal. Work differs by L per rank step (shard is a strided view).

    N=8, P=2:

        rank of each token: 0 1 0 1 0 1 0 1
               0 2 4 6 | 1 3 5 7
        r0  0  x . . . | . . . .
            2  x x . . | x . . .
            4  x x x . | x x . .
            6  x x x x | x x x .
               --------+--------
        r1  1  x . . . | x . . .
            3  x x . . | x x . .
            5  x x x . | x x x .
            7  x x x x | x x x x
        causal (q, k) pairs per rank: r0=16 r1=20
    """

    name = "striped"

    @property
    def required_multiple(self) -> int:
        return self.size

    def _local_indices(self, n, rank):
        return torch.arange(rank, n, self.size)

    def _piece(self, x, dim, rank, start, length):
        # [.., N, ..] -> [.., L, P, ..]: local slot j of rank r is global token j*P + r
        strided = x.unflatten(dim, (x.size(dim) // self.size, self.size)).select(dim + 1, rank)
        return strided.narrow(dim, start, length).contiguous()

    def _unshard(self, shards, dim, n):
        # P x [.., L, ..] -> [.., L, P, ..] -> [.., N, ..]
        return torch.stack(shards, dim + 1).flatten(dim, dim + 1)


class HybridLayout(Layout):
    """2D Ulysses x Ring (USP): the ring layout splits the sequence over R ring positions, then
    each ring shard (in its local order) is cut contiguously into U pieces; rank
    ring_rank * U + ulysses_rank holds piece ulysses_rank of ring shard ring_rank. The Ulysses
    all-to-all over one group thus reassembles exactly that ring position's shard.
    U == 1 is the plain ring layout; R == 1 is the contiguous layout.

    zigzag, R=2, U=2, N=16 (ring shards [0-3, 12-15] and [4-11]):

        rank of each token: 0 0 0 0 2 2 2 2 3 3 3 3 1 1 1 1
    """

    def __init__(self, ring_layout_cls, ring_size: int, ulysses_size: int):
        if not (isinstance(ring_layout_cls, type) and issubclass(ring_layout_cls, Layout)):
            raise ValueError(f"ring_layout_cls must be a Layout subclass such as one of "
                             f"{sorted(LAYOUTS)}, got {ring_layout_cls!r}")
        self.ring = ring_layout_cls(ring_size)
        self.ulysses_size = _positive_int(ulysses_size, "ulysses_size")
        self.ring_size = self.ring.size
        self.name = self.ring.name
        super().__init__(self.ring_size * self.ulysses_size)

    def __repr__(self) -> str:
        return (f"HybridLayout({type(self.ring).__name__}, ring_size={self.ring_size}, "
                f"ulysses_size={self.ulysses_size})")

    @property
    def ring_layout(self) -> Layout:
        return self.ring

    @property
    def required_multiple(self) -> int:
        return math.lcm(self.ring.required_multiple, self.size)

    @property
    def _divisor_text(self) -> str:
        return (f"{self.required_multiple} (lcm of the {self.name} ring's multiple "
                f"{self.ring.required_multiple} and ring_size*ulysses_size={self.size})")

    @property
    def _what(self) -> str:
        return (f"{self.name} x ulysses hybrid layout (ring_size={self.ring_size}, "
                f"ulysses_size={self.ulysses_size})")

    def coords(self, rank: int) -> Tuple[int, int]:
        """rank -> (ring_rank, ulysses_rank)."""
        return divmod(self._check_rank(rank), self.ulysses_size)

    def _local_indices(self, n, rank):
        ring_rank, ulysses_rank = divmod(rank, self.ulysses_size)
        piece = n // self.size
        return self.ring._local_indices(n, ring_rank).narrow(0, ulysses_rank * piece, piece)

    def _piece(self, x, dim, rank, start, length):
        ring_rank, ulysses_rank = divmod(rank, self.ulysses_size)
        offset = ulysses_rank * (x.size(dim) // self.size)
        return self.ring._piece(x, dim, ring_rank, offset + start, length)

    def _unshard(self, shards, dim, n):
        u = self.ulysses_size
        if u == 1:
            return self.ring._unshard(shards, dim, n)
        ring_shards = [torch.cat(shards[i * u:(i + 1) * u], dim) for i in range(self.ring_size)]
        return self.ring._unshard(ring_shards, dim, n)


LAYOUTS = {"contiguous": ContiguousLayout, "zigzag": ZigzagLayout, "striped": StripedLayout}


def make_layout(name: str, ring_size: int, ulysses_size: int = 1) -> Layout:
    """The layout called `name` over ring_size ring positions, hybrid when ulysses_size > 1.
    (The ring and Ulysses strategies use "contiguous".)"""
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; valid layouts: {', '.join(sorted(LAYOUTS))}")
    if _positive_int(ulysses_size, "ulysses_size") == 1:
        return LAYOUTS[name](ring_size)
    return HybridLayout(LAYOUTS[name], ring_size, ulysses_size)
