"""The strategy registry: a flat name -> class mapping, one lookup that lists the valid names, and
one factory that builds any configured strategy (the 2D hybrid by composition)."""
from __future__ import annotations

from typing import Dict, Tuple, Type

from ..errors import ConfigError
from .base import Strategy, StrategyContext
from .hybrid import HybridAttention
from .lasp import LaspAttention
from .ring import RingAttention
from .ring_loop import RingFamily
from .striped import StripedAttention
from .ulysses import UlyssesAttention, check_ulysses_chunks, check_ulysses_heads
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
        raise ConfigError(f"sequence_parallel.strategy={name!r} is not available; registered strategies: "
                          f"{', '.join(sorted(STRATEGIES))}") from None


def build(config, ctx: StrategyContext) -> Strategy:
    """The strategy the config asks for, over ``ctx``: a ring strategy with ulysses_size > 1 is
    wrapped in the 2D hybrid (Ulysses inside groups, that ring strategy across them)."""
    strategy = get_strategy(config.strategy)(ctx)
    if config.is_hybrid:
        return HybridAttention(ctx, ring=strategy)
    return strategy


def check_heads(config, num_heads: int, num_kv_heads: int) -> None:
    """Raise if the configured strategy cannot split these heads (Ulysses and the hybrid split
    them over ranks). From the config alone, so a job runs it before joining the world: a rank that
    leaves while its peers still build groups would turn their copy of the message into a
    connection error. ``sp.attention`` runs the same check on every call."""
    size = config.effective_ulysses_size
    if size > 1:
        key = "sequence_parallel.size" if config.strategy == "ulysses" else "sequence_parallel.ulysses_size"
        check_ulysses_heads(num_heads, num_kv_heads, size, key)
        if config.overlap:
            check_ulysses_chunks(config.ulysses_chunks, num_heads, num_kv_heads, size)


__all__ = ["STRATEGIES", "RING_STRATEGIES", "Strategy", "StrategyContext", "build", "check_heads", "get_strategy"]
