"""The strategy registry: a flat name -> class mapping, one lookup that lists the valid names, and
one factory that builds any configured strategy (the 2D hybrid by composition)."""
from __future__ import annotations

from typing import Dict, Tuple, Type

from .base import Strategy, StrategyContext
from .hybrid import HybridAttention
from .lasp import LaspAttention
from .ring import RingAttention
from .ring_loop import RingFamily
from .striped import StripedAttention
from .ulysses import UlyssesAttention
from .zigzag import ZigzagAttention

STRATEGIES: Dict[str, Type[Strategy]] = {
    "ulysses": UlyssesAttention,
    "ring": RingAttention,
    "zigzag": ZigzagAttention,
    "striped": StripedAttention,
    "lasp": LaspAttention,
}

# the strategies that run the ring loop, and so also run across Ulysses groups (2D hybrid)
RING_STRATEGIES: Tuple[str, ...] = tuple(n for n, c in STRATEGIES.items() if issubclass(c, RingFamily))


def get_strategy(name: str) -> Type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        from ..config import ConfigError
        raise ConfigError(f"sequence_parallel.strategy={name!r} is not available; registered strategies: "
                          f"{', '.join(sorted(STRATEGIES))}") from None


def build(config, ctx: StrategyContext) -> Strategy:
    """The strategy the config asks for, over ``ctx``: a ring strategy with ulysses_size > 1 is
    wrapped in the 2D hybrid (Ulysses inside groups, that ring strategy across them)."""
    strategy = get_strategy(config.strategy)(ctx)
    if config.is_hybrid:
        return HybridAttention(ctx, ring=strategy)
    return strategy


__all__ = ["STRATEGIES", "RING_STRATEGIES", "Strategy", "StrategyContext", "build", "get_strategy"]
