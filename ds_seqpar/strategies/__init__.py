"""The strategy registry: a flat name -> class mapping and one lookup that lists valid names."""
from __future__ import annotations

from typing import Dict, Type

from .base import Strategy, StrategyContext
from .hybrid import HybridAttention
from .lasp import LaspAttention
from .ring import RingAttention
from .striped import StripedAttention
from .ulysses import UlyssesAttention
from .zigzag import ZigzagAttention

STRATEGIES: Dict[str, Type[Strategy]] = {
    "ulysses": UlyssesAttention,
    "ring": RingAttention,
    "zigzag": ZigzagAttention,
    "striped": StripedAttention,
    "hybrid": HybridAttention,
    "lasp": LaspAttention,
}


def get_strategy(name: str) -> Type[Strategy]:
    try:
        return STRATEGIES[name]
    except KeyError:
        from ..config import ConfigError
        raise ConfigError(f"sequence_parallel.strategy={name!r} is not available; registered strategies: "
                          f"{', '.join(sorted(STRATEGIES))}") from None


__all__ = ["STRATEGIES", "Strategy", "StrategyContext", "get_strategy"]
