"""The group family of the dynamic runtime, as pure arithmetic: which group sizes exist, which of
them run the 2D hybrid, and the process groups (rank lists) built once for all of them.

A group of size s is ranks [k*s, (k+1)*s): aligned, neighbouring ranks. With ``ulysses_size`` U > 1
(a ring strategy, the 2D hybrid) a group whose size U divides runs U x (s/U): the all-to-all inside
the aligned blocks of U ranks, the ring across them; a smaller group (or one U does not divide)
runs the ring strategy alone, which splits tokens and needs no head condition. With U a power of
two such a group lies inside one block of U ranks, so its ring stays where the all-to-all would
have been: inside a node when U ranks are.

    world 8, sizes (1, 2, 4, 8), U = 2:
    size 2  ranks [0 1] [2 3] ...      all-to-all over each pair (ring of 1)
    size 4  ranks [0 1 2 3] [4 5 6 7]  all-to-all over [0 1], [2 3]; ring over [0 2], [1 3]
    size 8  every rank                 all-to-all over the pairs; ring over [0 2 4 6], [1 3 5 7]
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from ..config import KEY
from ..errors import ConfigError
from ..sharding.layouts import make_layout
from ..strategies import get_strategy
from ..topology import ulysses_degree


def group_sizes(world_size: int, heads: Optional[int] = None) -> Tuple[int, ...]:
    """The pre-built family: powers of two that divide the world, and the world itself; with
    ``heads`` (Ulysses splits heads over a group) only the sizes that divide it."""
    sizes = {s for s in (2 ** k for k in range(world_size.bit_length())) if world_size % s == 0}
    sizes.add(world_size)
    return tuple(sorted(s for s in sizes if heads is None or heads % s == 0))


def family_sizes(strategy: str, world_size: int, heads: Optional[int] = None, ulysses_size: int = 1) -> Tuple[int, ...]:
    """The group sizes a dynamic runtime of ``strategy`` builds on ``world_size`` ranks, or a
    ConfigError naming the key, the value and what works (the same on every rank, before any
    collective). Ulysses keeps the sizes that divide the heads; the 2D hybrid needs U to divide
    the world (the largest group), or no group would run it."""
    if strategy == "ulysses":
        sizes = group_sizes(world_size, heads)
        if len(sizes) == 1 and world_size > 1:
            raise ConfigError(f"{KEY}.strategy='ulysses' with size='dynamic': no group size of "
                              f"{list(group_sizes(world_size))} but 1 divides the {heads} heads, so no document "
                              f"could be split; use zigzag, ring or striped (any size)")
        return sizes
    if world_size % ulysses_size:
        fits = [u for u in range(1, world_size + 1) if world_size % u == 0 and (heads is None or heads % u == 0)]
        raise ConfigError(f"{KEY}.ulysses_size={ulysses_size} with size='dynamic' must divide the world size "
                          f"{world_size} (the largest group), or no group would run the 2D hybrid; valid values "
                          f"here: {fits}")
    return group_sizes(world_size)


def check_max_tokens(strategy: str, sizes: Sequence[int], max_tokens_per_rank: int, ulysses_size: int = 1) -> None:
    """max_tokens_per_rank is what a rank holds: a full micro-batch of s x T tokens must split over
    its s ranks without padding past T per rank. A layout splits a sequence into a multiple of its
    chunks (zigzag: two per rank), so T too small for them (zigzag: T = 1) or not a multiple of
    their share would leave every split document's ranks over the budget; refused by name."""
    t, step = max_tokens_per_rank, 1
    for s in sizes:
        u = ulysses_degree(s, ulysses_size)
        chunks = make_layout(get_strategy(strategy).layout_name, s // u, u).required_multiple
        step = math.lcm(step, chunks // math.gcd(chunks, s))     # s x T must be a multiple of chunks
    if t % step:
        raise ConfigError(f"{KEY}.max_tokens_per_rank={t} with strategy={strategy!r}: its layouts split a group's "
                          f"tokens into chunks of which each rank holds a multiple of {step}, so {t} tokens per rank "
                          f"would be padded past the budget; use a multiple of {step} (e.g. {max(t // step, 1) * step})")


def family_groups(world_size: int, sizes: Sequence[int], ulysses_size: int = 1) -> List[Tuple[int, ...]]:
    """The process groups the dynamic runtime builds once, as rank lists, each once: the world (the
    gradient reduction), the one-rank groups (DeepSpeed's model-parallel group), every aligned
    group of each size between 1 and the world, and with the 2D hybrid its all-to-all blocks of U
    ranks and, for each size s > U that U divides, its rings (ranks U apart inside each group)."""
    out = [tuple(range(world_size))] + [(r,) for r in range(world_size)]
    for s in sorted(set(sizes)):
        if 1 < s < world_size:
            out += [tuple(range(f, f + s)) for f in range(0, world_size, s)]
    u = ulysses_size
    if u > 1:
        out += [tuple(range(f, f + u)) for f in range(0, world_size, u)]
        out += [tuple(range(f + k, f + s, u)) for s in sorted(set(sizes)) if s > u and ulysses_degree(s, u) == u
                for f in range(0, world_size, s) for k in range(u)]
    return list(dict.fromkeys(out))


__all__ = ["check_max_tokens", "family_groups", "family_sizes", "group_sizes", "ulysses_degree"]
