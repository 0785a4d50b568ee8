"""Where a LASP rank's time goes, without the transfers: the kernel work of one fwd+bwd at the local
length for each rank position (``ds-seqpar bench --preset lasp``, or ``--lasp-breakdown``).

A block with no states is what the "halves" case runs on every rank; the single process never does
the state work of a LASP rank: rank 0 sends its state and receives its gradient, the last rank the
other way round, a middle rank (all-gather) both. The calls are strategies/lasp.py's, in its order.
"""
from __future__ import annotations

import statistics
from typing import Callable, Dict, Optional

from torch import Tensor

from .harness import timed

CHUNK = 64          # the kernel's chunk, as strategies/lasp.py uses


def rank_kernel(q, k, v, dout, decay_h, state_in: Optional[Tensor], dstate_local: Optional[Tensor],
                send_own: bool) -> None:
    """The kernel calls of one LASP rank's forward + backward (strategies/lasp.py), without the transfers."""
    from ..kernels import linear as la
    fwd = la.forward_begin(q, k, v, decay_h, CHUNK)
    if send_own:
        la.forward_states(fwd)
    if state_in is not None:
        la.forward_diagonal(fwd)
        la.forward_states(fwd, state_in)
    la.forward_finish(fwd)
    bwd = la.backward_begin(dout, q, k, v, decay_h, CHUNK, state_in)
    la.backward_local(bwd)
    la.backward_finish(bwd, dstate_local)


def pieces(q, k, v, dout, decay_h) -> Dict[str, Callable[[], None]]:
    """Label -> the kernel work of that rank position on these local tensors."""
    from ..kernels import linear as la
    state = la.intra_forward(q, k, v, decay_h, CHUNK)[1]
    return {
        "no states (intra_forward + intra_backward)":
            lambda: (la.intra_forward(q, k, v, decay_h, CHUNK), la.intra_backward(dout, q, k, v, decay_h, CHUNK)),
        "first rank (state_local out, dstate_local in)":
            lambda: rank_kernel(q, k, v, dout, decay_h, None, state, True),
        "middle rank, allgather (both)": lambda: rank_kernel(q, k, v, dout, decay_h, state, state, True),
        "last rank (state_in in, dstate_in out)": lambda: rank_kernel(q, k, v, dout, decay_h, state, None, False),
    }


def breakdown(q, k, v, dout, decay_h, rounds: int, device: str = "cpu") -> Dict[str, float]:
    """Median CPU seconds of each piece over ``rounds`` interleaved rounds, each round starting at
    the next piece, so load from other processes and allocator state hit all pieces alike."""
    work = pieces(q, k, v, dout, decay_h)
    names = list(work)
    times = {name: [] for name in names}
    for rnd in range(rounds):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(work[name], device=device)["cpu"])
    return {name: statistics.median(ts) for name, ts in times.items()}


__all__ = ["breakdown", "pieces", "rank_kernel"]
