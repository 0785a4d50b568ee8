"""How K/V blocks and their dK/dV reach the ranks of the ring loop (ring_loop.py), kept apart from
what is computed on them. Two schedules, both walking ``shift`` = +1 (forward) or -1 (backward), so
that at step s this rank holds the block of src = me - shift * s:

* relay (the ring): a block hops one rank per step, every block visits every rank; in backward
  its fp32 dK/dV accumulator travels with it and lands at its owner after P-1 hops.
* direct (masked: packed documents, sliding windows): at step s a rank sends the part of its OWN
  block that me + shift*s computes on (``key_range``: the span of keys its queries can see, from
  the global mask, so every rank agrees on the schedule without a word exchanged), straight there;
  in backward each rank sends its share of that part's dK/dV straight home. A block nobody else
  needs never leaves its rank; a window sends only the keys it reaches (the last w-1 tokens of a
  contiguous neighbour). When every rank needs every key the bytes are the relay's; otherwise
  fewer (strategies/closed_form.py: ring_masked_bytes).

Legend: kv_block = (k [b, n, H_kv, d], v [b, n, H_kv, dv]); dkv = their fp32 gradients.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .. import comm

# key_range(me, src): the slots [a, b) of src's block that ring position me computes on, or None
KeyRange = Callable[[int, int], Optional[Tuple[int, int]]]
Accumulate = Callable[[List[torch.Tensor], bool], None]   # (dkv buffers, fresh): add this step's share


class _Ring:
    """Rotates a tuple of same-shaped tensors one hop per call, ``shift`` ranks along the ring.

    Double buffer: receives land in buffers this object owns; a buffer that was sent on becomes
    free again once its transfer is waited for, so P steps use at most two buffer sets.
    """

    def __init__(self, ctx, shift: int, kind: str):
        p, r = ctx.ring_size, ctx.ring_rank
        self.dst, self.src = (r + shift) % p, (r - shift) % p
        self.group, self.stats, self.kind = ctx.ring_group, ctx.stats, kind
        self._free: List[List[torch.Tensor]] = []
        self._pending: Optional[comm.PendingP2P] = None
        self._sent_owned: Optional[List[torch.Tensor]] = None
        self._received: Optional[List[torch.Tensor]] = None

    def buffers(self, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """A free buffer set shaped like ``like`` (contiguous), reused when one is available."""
        if self._free:
            return self._free.pop()
        return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]

    def start(self, tensors: Sequence[torch.Tensor], owned: bool) -> None:
        """Post: send ``tensors`` to dst, receive the next ones from src. ``owned``: the tensors
        are buffers of this ring (reusable once sent), not the caller's inputs."""
        recv = self.buffers(tensors)
        self._pending = comm.p2p([(t, self.dst) for t in tensors], [(b, self.src) for b in recv],
                                 self.group, self.stats, self.kind)
        self._sent_owned = list(tensors) if owned else None
        self._received = None

    def finish(self) -> List[torch.Tensor]:
        """Wait for the posted hop (idempotent); return the received tensors."""
        if self._received is None:
            self._received = self._pending.wait()
            if self._sent_owned is not None:
                self._free.append(self._sent_owned)
            self._pending = self._sent_owned = None
        return self._received


# ---------------------------------------------------------------------------------------------
# K/V: the block held at each step


class RelayKV:
    """The ring: ``post`` sends the block held now to me+shift and receives the next one."""

    def __init__(self, ctx, shift: int, own: Sequence[torch.Tensor]):
        self._ring, self._p = _Ring(ctx, shift, "ring"), ctx.ring_size
        self.current, self._step, self._posted = tuple(own), 0, False

    def post(self) -> None:
        if self._step < self._p - 1 and not self._posted:
            self._ring.start(self.current, owned=self._step > 0)
            self._posted = True

    def advance(self) -> None:
        self.post()
        self.current, self._step, self._posted = tuple(self._ring.finish()), self._step + 1, False


class DirectKV:
    """Masked schedules (packed documents, sliding windows): for step s+1, send the part of the own
    block that me + shift*(s+1) needs (``key_range``: the keys its queries can see), receive the part
    of src = me - shift*(s+1)'s block this rank needs. ``current`` is None when this rank computes
    nothing at a step (no transfer was made for it); the plan counts the keys of what arrived
    (mask_plan.MaskPlan.received)."""

    def __init__(self, ctx, shift: int, own: Sequence[torch.Tensor], key_range: KeyRange):
        self._ctx, self._shift, self._own, self._range = ctx, shift, tuple(own), key_range
        self._p, self._me = ctx.ring_size, ctx.ring_rank
        self.current: Optional[tuple] = self._own
        self._step, self._pending = 0, None

    def post(self) -> None:
        nxt = self._step + 1
        if nxt >= self._p or self._pending is not None:
            return
        dst, src = (self._me + self._shift * nxt) % self._p, (self._me - self._shift * nxt) % self._p
        theirs, mine = self._range(dst, self._me), self._range(self._me, src)
        sends = [(t[:, theirs[0]:theirs[1]], dst) for t in self._own] if theirs else []
        recvs = [(_empty_rows(t, mine[1] - mine[0]), src) for t in self._own] if mine else []
        self._pending = comm.p2p(sends, recvs, self._ctx.ring_group, self._ctx.stats, "ring")

    def advance(self) -> None:
        self.post()
        received = self._pending.wait()
        self.current = tuple(received) if received else None
        self._step, self._pending = self._step + 1, None


def _empty_rows(like: torch.Tensor, rows: int, dtype=None) -> torch.Tensor:
    """A buffer shaped like ``like`` with ``rows`` tokens (dim 1)."""
    return torch.empty((like.shape[0], rows) + tuple(like.shape[2:]), dtype=dtype or like.dtype, device=like.device)


# ---------------------------------------------------------------------------------------------
# dK/dV of blocks computed away from home (backward; step 0's share stays home)


class RelayGrads:
    """The ring: src's accumulator starts at step 1 and travels with its block (module doc)."""

    def __init__(self, ctx, like: Sequence[torch.Tensor], overlap: bool):
        self._ring, self._like, self._overlap = _Ring(ctx, -1, "ring_grad"), like, overlap

    def add(self, step: int, src: int, accumulate: Accumulate, home) -> None:
        # step 1 starts src's travelling accumulator; later steps add to the one that arrived
        acc = self._ring.buffers(self._like) if step == 1 else self._ring.finish()
        accumulate(acc, step == 1)
        self._ring.start(acc, owned=True)
        if not self._overlap:
            self._ring.finish()

    def land(self, home: Sequence[torch.Tensor], p: int) -> None:
        if p > 1:
            for h, arrived in zip(home, self._ring.finish()):   # own accumulator, back from me+1
                h += arrived


class DirectGrads:
    """Masked schedules: at step s this rank sends its share of src's dK/dV (the key range it used)
    to src, and receives the share of its own block from the rank that holds it at this step,
    added into that rank's key range of the home gradient."""

    def __init__(self, ctx, like: Sequence[torch.Tensor], overlap: bool, key_range: KeyRange):
        self._ctx, self._like, self._overlap, self._range = ctx, like, overlap, key_range
        self._p, self._me = ctx.ring_size, ctx.ring_rank
        self._pending, self._sent, self._into = None, None, None

    def _land(self, home) -> None:
        if self._pending is not None:
            a, b = self._into
            for h, arrived in zip(home, self._pending.wait()):
                h[:, a:b] += arrived
            self._pending = self._sent = self._into = None

    def add(self, step: int, src: int, accumulate: Accumulate, home) -> None:
        self._land(home)
        sends, used = [], self._range(self._me, src)
        if used:
            share = [_empty_rows(t, used[1] - used[0]) for t in self._like]
            accumulate(share, True)
            sends = [(t, src) for t in share]
        frm = (self._me - step) % self._p                   # backward: it holds my block at this step
        theirs = self._range(frm, self._me)
        recvs = [(_empty_rows(t, theirs[1] - theirs[0]), frm) for t in self._like] if theirs else []
        self._into = theirs or (0, 0)                      # where the arriving share lands in home
        self._pending = comm.p2p(sends, recvs, self._ctx.ring_group, self._ctx.stats, "ring_grad")
        self._sent = sends                                  # alive until the transfer is waited for
        if not self._overlap:
            self._land(home)

    def land(self, home, p: int) -> None:
        self._land(home)


__all__ = ["RelayKV", "DirectKV", "RelayGrads", "DirectGrads", "KeyRange"]
