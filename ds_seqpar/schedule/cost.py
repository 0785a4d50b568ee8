"""What one document costs the busiest rank of the group it runs on: the scheduler's one price.

``price`` is the only place the dynamic scheduler (rounds.py) values a document. Its attention pairs
are the cost model's (cost/: the pairs the busiest rank computes under the document's causal
mask, on its layout's global positions, the end padding seeing nothing); its bytes are the
strategies' closed forms (strategies/closed_form.py, the oracle cost/'s bytes are held to).

Units are floating-point operations of forward + backward (3x the forward's), with the bytes a rank
sends converted at ``flops_per_byte`` (how many operations the machine does while one byte crosses
the link). Legend: L = document tokens, g = group size, H/Hkv = q/kv heads, D = head dim.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Tuple

from ..masks import Mask
from ..cost import pairs_per_rank
from ..sharding.layouts import make_layout
from ..sharding.padding import padded_len
from ..strategies import get_strategy
from ..strategies.closed_form import Shapes, closed_form_bytes
from .family import ulysses_degree

FWD_BWD = 3          # a backward costs about twice its forward


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a token's and an attention pair's price (defaults: the main job's own LM)."""

    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 32
    matmul_params: int = 4 * (4 * 128 * 128 + 3 * 128 * 352)    # per-token multiply-adds of the linear layers
    elem: int = 4                                               # bytes per element of q, k, v
    flops_per_byte: float = 100.0

    @classmethod
    def of_lm(cls, cfg, elem: int = 4, flops_per_byte: float = 100.0) -> "ModelShape":
        """From the own LM's ModelConfig (models/lm.py): q, kv, o projections, SwiGLU MLP, lm head."""
        d, hd = cfg.dim, cfg.head_dim
        per_layer = d * cfg.n_heads * hd * 2 + d * 2 * cfg.n_kv_heads * hd + 3 * d * cfg.mlp_hidden
        return cls(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, hd, cfg.n_layers * per_layer + d * cfg.vocab_size,
                   elem, flops_per_byte)


@functools.lru_cache(maxsize=65536)
def _parts(length: int, group_size: int, strategy: str, shape: ModelShape, ulysses_size: int) -> Tuple[int, int, int]:
    """(linear-layer operations, attention operations of one layer, bytes sent) of a forward (the 2D
    hybrid where ``ulysses_size`` divides the group: family.ulysses_degree)."""
    u = ulysses_degree(group_size, ulysses_size)
    layout = make_layout(get_strategy(strategy).layout_name, group_size // u, u)
    n = padded_len(layout, length)
    linear = 2 * shape.matmul_params * n // group_size
    if strategy == "lasp":
        # chunked linear attention: a [D, D] state update and read per token and head
        attention = 4 * shape.heads * shape.head_dim ** 2 * n // group_size
    else:
        pairs = max(pairs_per_rank(strategy, group_size, u, length, Mask(True)))
        attention = 4 * shape.heads * shape.head_dim * pairs
    sent = 0
    if group_size > 1:
        dims = Shapes(1, n, shape.heads, shape.kv_heads, shape.head_dim, shape.elem)
        sent = shape.layers * closed_form_bytes(strategy, group_size, dims, ulysses_size=u)
    return linear, attention, sent


def work(length: int, group_size: int, strategy: str, shape: ModelShape = ModelShape(),
         ulysses_size: int = 1) -> Tuple[float, float, float]:
    """(forward + backward operations of the linear layers, of attention, bytes sent) of the busiest
    rank when a document of ``length`` tokens runs alone on ``group_size`` ranks with ``strategy``:
    the parts ``price`` adds up, apart (a machine runs attention and matmuls at different rates)."""
    linear, attention, sent = _parts(length, group_size, strategy, shape, ulysses_size)
    return float(FWD_BWD * linear), float(FWD_BWD * shape.layers * attention), float(sent)


def price(length: int, group_size: int, strategy: str, shape: ModelShape = ModelShape(),
          ulysses_size: int = 1) -> float:
    """Forward + backward operations (bytes converted) of the busiest rank when a document of
    ``length`` tokens runs alone on ``group_size`` ranks with ``strategy``."""
    linear, attention, sent = _parts(length, group_size, strategy, shape, ulysses_size)
    return float(FWD_BWD * (linear + shape.layers * attention) + shape.flops_per_byte * sent)


__all__ = ["ModelShape", "price", "work"]
