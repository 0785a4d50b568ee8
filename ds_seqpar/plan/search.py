"""Every configuration of a cluster for one model and sequence, predicted and ranked.

A candidate is (strategy, size, ulysses_size, linear_strategy, ZeRO stage, memory features); the
data-parallel degree is gpus / size. Each is checked the way the main job would check it
(SequenceParallelConfig's validation, strategies.check_heads, the hybrid rules of hf/checks.py)
and then predicted by the cost model (cost/): memory per GPU by phase, bytes per rank per layer kind,
their alpha-beta time, the compute time from FLOPs at the profile's assumed efficiency, the step time
and tokens/s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Dict, List, Optional, Tuple

from .. import strategies
from ..config import LASP_COMMS, ConfigError, SequenceParallelConfig
from ..strategies import RING_STRATEGIES
from ..cost import flops, memory, times
from ..cost.bytes import SPAN_BUDGET
from ..cost.candidate import Candidate, Features
from ..cost.pairs import sharded_length
from .hardware import Gpu
from ..cost.model_shape import ModelShape

HEADROOM = 0.10          # of the usable memory a configuration leaves free by default (--headroom)
NEAR_TIE = 0.02          # predicted tokens/s closer than this are a tie: the model is not more precise
FEATURE_SETS = (Features(on=False), Features(on=True), Features(on=True, offload_optimizer=True))
HOST_USABLE = 0.9                      # assumed: share of a node's host memory a run may fill


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: Gpu
    dtype: str = "bf16"


@dataclass
class Prediction:
    candidate: Candidate
    dp: int
    ok: bool
    reason: str = ""
    static_bytes: float = 0.0
    per_token_bytes: float = 0.0
    peak_bytes: float = 0.0
    peak_phase: str = ""
    budget_bytes: float = 0.0
    host_bytes: float = 0.0
    comm_bytes: Dict[str, float] = field(default_factory=dict)     # per layer of each kind, one rank
    comm_s: Dict[str, float] = field(default_factory=dict)         # exposed, per step, by kind
    compute_s: float = 0.0
    step_s: float = 0.0
    tokens_s: float = 0.0
    mfu: float = 0.0
    max_seq: int = 0
    phases: Dict[str, Dict[str, float]] = field(default_factory=dict)   # {phase: {"a": bytes, "b": bytes/token}}
    bytes_bounded: bool = False     # a masked layer's ring bytes are the no-mask upper bound (span budget)
    headroom: float = 0.0           # the fraction of usable memory kept free (budget_bytes is what is left)
    ulysses_chunks: int = 1         # the head chunks its all-to-alls run in, and why (cost/chunks.py)
    chunks_why: str = ""

    @property
    def free(self) -> float:
        """The fraction of the usable memory this configuration leaves free at its peak."""
        usable = self.budget_bytes / (1 - self.headroom)
        return 1 - self.peak_bytes / usable

    @property
    def moving_parts(self) -> int:
        """What a user has to get right: a 2D layout, the memory features, optimizer offload, ZeRO-3."""
        c = self.candidate
        return (1 < c.ulysses_size < c.size) + c.features.on + c.features.offload_optimizer + (c.zero == 3)


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(shape: ModelShape, gpus: int, zero: Optional[int], features=FEATURE_SETS, own_linear: bool = False):
    """Every layout of each size dividing ``gpus`` (the own LM's linear layers: lasp, with every
    lasp_comm past one rank: lasp_comm_reasons says which one the cost model prefers and why), linear_strategy (hybrids), ZeRO stage and features."""
    stages, lins = [zero] if zero else [1, 2, 3], ["lasp", "ulysses"] if shape.hybrid else ["lasp"]
    for size in divisors(gpus):
        if own_linear:
            layouts = [("lasp", 1)]
        elif size == 1:
            layouts = [("ulysses", 1)]
        else:
            layouts = [("ulysses", size)] + [(s, 1) for s in RING_STRATEGIES]
            layouts += [(s, u) for s in RING_STRATEGIES for u in divisors(size) if 1 < u < size]
        comms = LASP_COMMS if own_linear and size > 1 else ("allgather",)
        for (strategy, u), lin, z, f, comm in product(layouts, lins, stages, features, comms):
            yield Candidate(strategy, size, u, z, f, lin, comm)


def check(c: Candidate, shape: ModelShape, gpus: int, own_linear: bool) -> str:
    """The main job's refusals, as a reason ('' = accepted)."""
    try:
        cfg = SequenceParallelConfig(strategy=c.strategy, size=c.size, ulysses_size=c.ulysses_size,
                                     linear_strategy=c.linear_strategy, lasp_comm=c.lasp_comm)
        cfg.check_world(gpus)
        if not own_linear and (shape.count("attention") + shape.count("sliding")):
            strategies.check_heads(cfg, shape.heads, shape.kv_heads)
    except (ConfigError, ValueError) as err:
        return f"heads/sizes: {err}"
    if shape.hybrid and c.size > 1 and c.strategy == "striped":
        return "striped with linear-attention / convolution layers (hf/checks.check_hybrid: one-token runs)"
    if shape.hybrid and c.size > 1 and c.linear_strategy == "ulysses" and shape.lin_heads % c.size:
        return f"linear_strategy ulysses: {shape.lin_heads} linear heads not divisible by size {c.size}"
    return ""


def predict(c: Candidate, shape: ModelShape, seq: int, cl: Cluster, own_linear: bool = False,
            causal: bool = True, docs: Optional[Tuple[int, ...]] = None, timing: bool = True,
            span_budget: float = SPAN_BUDGET, headroom: float = HEADROOM) -> Prediction:
    """One candidate: refused (reason), or its memory, bytes, times and fit. ``docs``: packed
    documents' lengths (their mask sets the attention work and the ring's bytes); ``timing`` False:
    memory only (longest_sequence asks thousands of clusters); ``span_budget``: cost.bytes'; ``headroom``:
    the fraction of usable memory a configuration must leave free (fragmentation, a longer batch)."""
    dp = cl.gpus // c.size if cl.gpus % c.size == 0 else 0
    p = Prediction(c, dp, ok=False, budget_bytes=cl.gpu.usable_bytes * (1 - headroom), headroom=headroom)
    reason = check(c, shape, cl.gpus, own_linear)
    if reason:
        p.reason = reason
        return p
    e = 4 if cl.dtype == "fp32" else 2
    n = sharded_length(c.strategy, c.size, c.ulysses_size, seq) // c.size
    on_device = not (c.features.on and c.features.cpu_checkpointing)
    lines = memory.phase_lines(shape, c.strategy, c.size, c.ulysses_size, cl.gpus, c.zero, cl.dtype, c.features,
                               on_device)
    p.phases = lines
    p.static_bytes = sum(memory.static_bytes(shape, cl.gpus, c.zero, cl.dtype, c.features.offload_optimizer).values())
    p.peak_phase = max(lines, key=lambda k: lines[k]["a"] + lines[k]["b"] * n)
    p.per_token_bytes = max(line["b"] for line in lines.values())
    p.peak_bytes = memory.peak(lines, n)
    p.host_bytes = memory.host_bytes_per_node(shape, n, min(cl.gpus_per_node, cl.gpus), cl.gpus, cl.dtype, c.features)
    p.max_seq = c.size * min(memory.max_tokens(lines, p.budget_bytes, 1 << 62), _host_tokens(c, shape, cl))
    if not timing:
        return p
    t = times.step_time(c, shape, seq, n, cl.gpu, cl.gpus, cl.gpus_per_node, cl.dtype, causal, docs, span_budget)
    p.comm_bytes, p.comm_s, p.bytes_bounded = t.comm_bytes, t.comm_s, t.bytes_bounded
    p.compute_s, p.step_s = t.compute_s, t.step_s
    p.ulysses_chunks, p.chunks_why = t.ulysses_chunks, t.chunks_why
    p.tokens_s = dp * seq / p.step_s
    peak_flops = cl.gpu.peaks["bf16_tflops" if e == 2 else "tf32_tflops"] * 1e12
    p.mfu = flops.model_flops_per_token(shape, seq, causal, docs) * seq * dp / p.step_s / (cl.gpus * peak_flops)
    if p.peak_bytes > p.budget_bytes:
        p.reason = (f"does not fit: {p.peak_bytes / 1e9:.1f} GB per GPU ({p.peak_phase}) > "
                    f"{p.budget_bytes / 1e9:.1f} GB usable with {headroom:.0%} headroom; longest sequence for it "
                    f"{p.max_seq:,}")
    elif p.host_bytes > HOST_USABLE * cl.gpu.host_bytes_per_node:
        p.reason = (f"host memory: {p.host_bytes / 1e9:.0f} GB per node (checkpoints / optimizer offloaded) > "
                    f"{HOST_USABLE * cl.gpu.host_bytes_per_node / 1e9:.0f} GB usable")
    else:
        p.ok = True
    return p


def _host_tokens(c: Candidate, shape: ModelShape, cl: Cluster) -> int:
    """Tokens per rank the node's host memory allows (offloaded checkpoints)."""
    g, e = min(cl.gpus_per_node, cl.gpus), 4 if cl.dtype == "fp32" else 2
    free = HOST_USABLE * cl.gpu.host_bytes_per_node - memory.host_bytes_per_node(shape, 0, g, cl.gpus, cl.dtype,
                                                                                   c.features)
    per_token = g * shape.layers * shape.hidden * e if c.features.on and c.features.cpu_checkpointing else 0
    if free < 0:
        return 0
    return int(free / per_token) if per_token else 1 << 62


def plan(shape: ModelShape, seq: int, cl: Cluster, zero: Optional[int] = None, own_linear: bool = False,
         features=FEATURE_SETS, docs: Optional[Tuple[int, ...]] = None, span_budget: float = SPAN_BUDGET,
         headroom: float = HEADROOM) -> Tuple[List[Prediction], List[Prediction]]:
    """(feasible ranked, rejected). Ranked by tokens/s; predictions within NEAR_TIE of each other are
    one tie (the model is not that precise), broken toward fewer moving parts, then more free memory."""
    preds = [predict(c, shape, seq, cl, own_linear, docs=docs, span_budget=span_budget, headroom=headroom)
             for c in candidates(shape, cl.gpus, zero, features, own_linear)]
    return rank([p for p in preds if p.ok]), [p for p in preds if not p.ok]


def lasp_comm_reasons(feasible: List[Prediction]) -> List[str]:
    """Per size, the lasp_comm the cost model picks for the own LM and why: each exchange's exposed
    LASP seconds per step (cost/times.py: LASP-2's all-gather grows with P, LASP-1 waits P - 1 whole
    states, All-Scan P - 2 + K blocks) and its bytes per rank per layer."""
    best: Dict[int, Dict[str, Prediction]] = {}
    for p in feasible:
        c = p.candidate
        if c.strategy == "lasp" and c.size > 1:
            mine = best.setdefault(c.size, {})
            if c.lasp_comm not in mine or p.tokens_s > mine[c.lasp_comm].tokens_s:
                mine[c.lasp_comm] = p
    out = []
    for size, by_comm in sorted(best.items()):
        order = sorted(by_comm.values(), key=lambda p: (p.comm_s.get("lasp", 0.0), -p.tokens_s))
        parts = [f"{p.candidate.lasp_comm} {p.comm_s.get('lasp', 0.0) * 1e3:.2f} ms, "
                 f"{p.comm_bytes.get('lasp', 0.0) / 1e6:.2f} MB/layer" for p in order]
        out.append(f"size {size}: lasp_comm {order[0].candidate.lasp_comm} (exposed LASP time per step, bytes per "
                   f"rank: {' < '.join(parts)})")
    return out


def rank(feasible: List[Prediction]) -> List[Prediction]:
    """Ties: each run of predictions within NEAR_TIE of the fastest not yet placed."""
    rest, ranked = sorted(feasible, key=lambda p: -p.tokens_s), []
    while rest:
        tie = [p for p in rest if p.tokens_s >= (1 - NEAR_TIE) * rest[0].tokens_s]
        ranked += sorted(tie, key=lambda p: (p.moving_parts, -p.free, -p.tokens_s))
        rest = rest[len(tie):]
    return ranked


def longest_sequence(shape: ModelShape, cl: Cluster, zero: Optional[int] = None, own_linear: bool = False) -> int:
    """The longest sequence some accepted configuration fits (memory and host memory only)."""
    best = 0
    for c in candidates(shape, cl.gpus, zero, FEATURE_SETS, own_linear):
        if check(c, shape, cl.gpus, own_linear):
            continue
        best = max(best, predict(c, shape, c.size, cl, own_linear, timing=False).max_seq)
    return best


def gpus_needed(shape: ModelShape, seq: int, cl: Cluster, zero: Optional[int] = None, own_linear: bool = False,
                limit: int = 16384) -> Optional[int]:
    """The fewest GPUs (gpus x 2^k, whole nodes) whose longest sequence reaches ``seq``; None past ``limit``."""
    g = max(cl.gpus, 1)
    while g <= limit:
        g *= 2
        bigger = Cluster(g, cl.gpus_per_node, cl.gpu, cl.dtype)
        if longest_sequence(shape, bigger, zero, own_linear) >= seq:
            return g
    return None


__all__ = ["Cluster", "FEATURE_SETS", "HEADROOM", "NEAR_TIE", "Prediction", "candidates", "check", "gpus_needed",
           "lasp_comm_reasons",
           "longest_sequence", "plan", "predict", "rank"]
