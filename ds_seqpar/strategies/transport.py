"""How K/V blocks and their dK/dV reach the ranks of the ring loop (ring_loop.py), kept apart from
what is computed on them. Two schedules, both walking ``shift`` = +1 (forward) or -1 (backward), so
that at step s this rank holds the block of src = me - shift * s:

* relay (the ring): a block hops one rank per step, every block visits every rank; in backward
  its fp32 dK/dV accumulator travels with it and lands at its owner after P-1 hops.
* direct (packed documents): at step s a rank sends its OWN block straight to me + shift*s, and
  only when that rank computes on it (``needs``, from the global cu_seqlens, so every rank agrees
  on the schedule); in backward each rank sends its share of a block's dK/dV straight home. A
  block nobody else needs never leaves its rank. When every rank needs every block the bytes are
  the relay's; otherwise fewer (strategies/closed_form.py: ring_documents).

Legend: kv_block = (k [b, n, H_kv, d], v [b, n, H_kv, dv]); dkv = their fp32 gradients.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from .. import comm

Needs = Callable[[int, int], bool]          # needs(me, src): does ring position me compute on src's block
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
    """Packed documents: for step s+1, send the own block to me + shift*(s+1) if that rank needs it,
    receive src = me - shift*(s+1)'s block if this rank needs it; ``current`` is None when this rank
    computes nothing at a step (no transfer was made for it)."""

    def __init__(self, ctx, shift: int, own: Sequence[torch.Tensor], needs: Needs):
        self._ctx, self._shift, self._own, self._needs = ctx, shift, tuple(own), needs
        self._p, self._me = ctx.ring_size, ctx.ring_rank
        self.current: Optional[tuple] = self._own
        self._step, self._pending, self._free = 0, None, []

    def post(self) -> None:
        nxt = self._step + 1
        if nxt >= self._p or self._pending is not None:
            return
        dst, src = (self._me + self._shift * nxt) % self._p, (self._me - self._shift * nxt) % self._p
        sends = [(t, dst) for t in self._own] if self._needs(dst, self._me) else []
        recvs = []
        if self._needs(self._me, src):
            bufs = self._free.pop() if self._free else [torch.empty_like(t) for t in self._own]
            recvs = [(b, src) for b in bufs]
        self._pending = comm.p2p(sends, recvs, self._ctx.ring_group, self._ctx.stats, "ring")

    def advance(self) -> None:
        self.post()
        received = self._pending.wait()
        if self.current is not None and self.current is not self._own:
            self._free.append(list(self.current))          # the block of the step just done
        self.current = tuple(received) if received else None
        self._step, self._pending = self._step + 1, None


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
    """Packed documents: at step s this rank sends its share of src's dK/dV to src (if it computed
    on src's block) and receives its own block's share from me + s (if that rank computed on it)."""

    def __init__(self, ctx, like: Sequence[torch.Tensor], overlap: bool, needs: Needs):
        self._ctx, self._like, self._overlap, self._needs = ctx, like, overlap, needs
        self._p, self._me = ctx.ring_size, ctx.ring_rank
        self._pending, self._sent = None, None

    def _land(self, home) -> None:
        if self._pending is not None:
            for h, arrived in zip(home, self._pending.wait()):
                h += arrived
            self._pending = self._sent = None

    def add(self, step: int, src: int, accumulate: Accumulate, home) -> None:
        self._land(home)
        sends = []
        if self._needs(self._me, src):
            share = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in self._like]
            accumulate(share, True)
            sends = [(t, src) for t in share]
        frm = (self._me - step) % self._p                   # backward: it holds my block at this step
        recvs = [(torch.empty(t.shape, dtype=t.dtype, device=t.device), frm) for t in self._like] \
            if self._needs(frm, self._me) else []
        self._pending = comm.p2p(sends, recvs, self._ctx.ring_group, self._ctx.stats, "ring_grad")
        self._sent = sends                                  # alive until the transfer is waited for
        if not self._overlap:
            self._land(home)

    def land(self, home, p: int) -> None:
        self._land(home)


__all__ = ["RelayKV", "DirectKV", "RelayGrads", "DirectGrads", "Needs"]
