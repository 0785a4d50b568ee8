"""What a schedule is made of: the group a micro-batch runs on and the micro-batch itself."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Group:
    """Ranks [first, first + size) of the pre-built aligned family of this size."""

    size: int
    first: int

    @property
    def ranks(self) -> Tuple[int, ...]:
        return tuple(range(self.first, self.first + self.size))

    @property
    def index(self) -> int:
        """Which group of its size this is (the runtime's family is indexed the same way)."""
        return self.first // self.size


@dataclass(frozen=True)
class MicroBatch:
    """One forward + backward on ``group``: documents packed in order, ``cu_seqlens`` their
    boundaries [0, l1, l1+l2, ..., tokens]; ``loss_tokens`` the divisor of the global batch's mean."""

    group: Group
    documents: Tuple[int, ...]
    lengths: Tuple[int, ...]
    loss_tokens: int
    cost: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def cu_seqlens(self) -> Tuple[int, ...]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def empty(self) -> bool:
        return not self.lengths


__all__ = ["Group", "MicroBatch"]
