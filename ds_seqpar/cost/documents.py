"""What one document costs the busiest rank of the group it runs on: the one price of a document.

The dynamic scheduler (schedule/rounds.py) places documents by ``price``; ``ds-seqpar plan --lengths``
(plan/lengths.py) places them by the same function at a GPU's rates (``gpu_rates``), so the placement
it predicts is the one the runtime's scheduler makes when given those rates (``DocumentPricer``, the
``pricer`` of schedule() and DynamicSequenceParallel.schedule). The parts (``work``) are the cost
model's own: the attention pairs the busiest rank computes under the document's causal mask on its
layout's global positions (pairs.py; the end padding sees nothing), the linear layers' multiply-adds
per token (model_shape.ModelShape.matmul_params) and the bytes of the strategies' closed forms
(strategies/closed_form.py, the oracle cost/bytes.py is held to).

Units: the parts are floating-point operations of forward + backward (3x the forward's) and the bytes
a rank sends; ``rates`` (steps.StepRates: price units per linear-layer operation, per attention
operation, per byte) add them up. SCHEDULER_RATES, the runtime's default, counts operations and
converts a byte at 100 (how many operations a machine does while one byte crosses the link).
Legend: L = document tokens, g = group size, H/Hkv = q/kv heads, D = head dim.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, Tuple

from ..masks import Mask
from ..strategies.closed_form import Shapes, closed_form_bytes
from ..topology import ulysses_degree
from .model_shape import ModelShape
from .pairs import pairs_per_rank, sharded_length
from .steps import StepRates

FWD_BWD = 3                                          # a backward costs about twice its forward
SCHEDULER_RATES = StepRates(1.0, 1.0, 100.0, 0.0, 0.0)   # operations; a byte = 100 of them


@functools.lru_cache(maxsize=65536)
def _parts(length: int, group_size: int, strategy: str, key: Tuple[int, int, int, int, int], elem: int,
           ulysses_size: int) -> Tuple[int, float, int]:
    """(linear-layer operations, attention operations of one layer, bytes sent) of a forward; ``key``:
    the shape's (layers, heads, kv heads, head dim, matmul params), all the price reads of it."""
    layers, heads, kv_heads, head_dim, matmul_params = key
    u = ulysses_degree(group_size, ulysses_size)
    n = sharded_length(strategy, group_size, u, length)
    linear = 2 * matmul_params * n // group_size
    if strategy == "lasp":
        # chunked linear attention: a [D, D] state update and read per token and head
        attention = 4 * heads * head_dim ** 2 * n // group_size
    else:
        pairs = max(pairs_per_rank(strategy, group_size, u, length, Mask(True)))
        attention = 4 * heads * head_dim * pairs
    sent = 0
    if group_size > 1:
        dims = Shapes(1, n, heads, kv_heads, head_dim, elem)
        sent = layers * closed_form_bytes(strategy, group_size, dims, ulysses_size=u)
    return linear, attention, sent


def _key(shape: ModelShape) -> Tuple[int, int, int, int, int]:
    return shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.matmul_params


def work(length: int, group_size: int, strategy: str, shape: ModelShape = ModelShape(), ulysses_size: int = 1,
         elem: int = 4) -> Tuple[float, float, float]:
    """(forward + backward operations of the linear layers, of attention, bytes sent) of the busiest
    rank when a document of ``length`` tokens runs alone on ``group_size`` ranks with ``strategy`` (the
    2D hybrid where ``ulysses_size`` divides the group), ``elem`` bytes per element of q, k, v: the
    parts ``price`` adds up, apart (a machine runs attention and matmuls at different rates)."""
    linear, attention, sent = _parts(length, group_size, strategy, _key(shape), elem, ulysses_size)
    return float(FWD_BWD * linear), float(FWD_BWD * shape.layers * attention), float(sent)


def price(length: int, group_size: int, strategy: str, shape: ModelShape = ModelShape(), ulysses_size: int = 1,
          rates: StepRates = SCHEDULER_RATES, elem: int = 4) -> float:
    """What a document of ``length`` tokens alone on ``group_size`` ranks with ``strategy`` costs its
    busiest rank: ``work``'s parts at ``rates`` (default: forward + backward operations, bytes
    converted at 100 operations each)."""
    linear, attention, sent = work(length, group_size, strategy, shape, ulysses_size, elem)
    return rates.s_per_op * linear + rates.s_per_attention_op * attention + rates.s_per_byte * sent


@dataclass(frozen=True)
class DocumentPricer:
    """``price`` of (length, group size) for one strategy, model and rates: the scheduler's ``pricer``
    (schedule(), DynamicSequenceParallel.schedule), the runtime's and the planner's alike."""

    strategy: str = "zigzag"
    shape: ModelShape = ModelShape()
    ulysses_size: int = 1
    rates: StepRates = SCHEDULER_RATES
    elem: int = 4
    _seen: Dict[Tuple[int, int], float] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __call__(self, length: int, group_size: int) -> float:
        # the placer asks for the same (length, size) many times per schedule: one dict lookup then
        got = self._seen.get((length, group_size))
        if got is None:
            got = self._seen[length, group_size] = price(length, group_size, self.strategy, self.shape,
                                                         self.ulysses_size, self.rates, self.elem)
        return got


def gpu_rates(gpu, dtype: str) -> StepRates:
    """Seconds per linear-layer FLOP, per attention FLOP and per byte on ``gpu`` (a plan.hardware.Gpu,
    read by attribute): its matmul and attention rates at the profile's assumed efficiencies, its
    node-local link (the placement's rates; the planner times the placed step with times.step_time)."""
    return StepRates(1.0 / gpu.flops_s(dtype, "matmul"), 1.0 / gpu.flops_s(dtype, "attention"),
                     1.0 / gpu.intra.beta_bytes_s, 0.0, 0.0)


__all__ = ["DocumentPricer", "FWD_BWD", "SCHEDULER_RATES", "gpu_rates", "price", "work"]
