"""Every configuration of a cluster for one model and sequence, predicted and ranked.

A candidate is (strategy, size, ulysses_size, linear_strategy, ZeRO stage, memory features); the
data-parallel degree is gpus / size. Each is checked the way the main job would check it
(SequenceParallelConfig's validation, strategies.check_heads, the hybrid rules of hf/checks.py)
and then predicted: memory per GPU by phase (memory.py), bytes per rank per layer kind from the
strategies' closed forms (strategies/closed_form.py), their alpha-beta time (comm_model.py), the
compute time from FLOPs (flops.py) at the profile's assumed efficiency, the step time and tokens/s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .. import strategies
from ..config import ConfigError, SequenceParallelConfig
from ..strategies import RING_STRATEGIES
from ..strategies.closed_form import Shapes, closed_form_by_kind, conv_halo_bytes, linear_state_bytes, linear_ulysses_bytes
from . import comm_model, flops, masks, memory
from .hardware import Gpu
from .masks import Mask
from .memory import Features
from .model_shape import SOFTMAX_KINDS, ModelShape

FEATURE_SETS = (Features(on=False), Features(on=True), Features(on=True, offload_optimizer=True))
HOST_USABLE = 0.9                      # assumed: share of a node's host memory a run may fill


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: Gpu
    dtype: str = "bf16"


@dataclass(frozen=True)
class Candidate:
    strategy: str
    size: int
    ulysses_size: int
    zero: int
    features: Features
    linear_strategy: str = "lasp"
    lasp_comm: str = "allgather"           # strategy lasp (the project's LM): allgather (LASP-2) | ring (LASP-1)

    def label(self) -> str:
        comm = f" lasp_comm={self.lasp_comm}" if self.strategy == "lasp" else ""
        return (f"{self.strategy} size={self.size} u={self.ulysses_size}{comm} zero={self.zero} "
                f"features={self.features.label}")


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


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(shape: ModelShape, gpus: int, zero: Optional[int], features=FEATURE_SETS, own_linear: bool = False):
    stages = [zero] if zero else [1, 2, 3]
    lins = ["lasp", "ulysses"] if shape.hybrid else ["lasp"]
    for size in divisors(gpus):
        layouts: List[Tuple[str, int]] = []
        if own_linear:
            layouts = [("lasp", 1)]
            if size > 1:
                for z in stages:
                    for f in features:
                        yield Candidate("lasp", size, 1, z, f, "lasp", "allgather")
                        yield Candidate("lasp", size, 1, z, f, "lasp", "ring")
                continue
        elif size == 1:
            layouts = [("ulysses", 1)]
        else:
            layouts = [("ulysses", size)] + [(s, 1) for s in RING_STRATEGIES]
            layouts += [(s, u) for s in RING_STRATEGIES for u in divisors(size) if 1 < u < size]
        for strategy, u in layouts:
            for lin in lins:
                for z in stages:
                    for f in features:
                        yield Candidate(strategy, size, u, z, f, lin)


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


def _runs(strategy: str, size: int) -> list:
    """state_passing-style runs per rank: zigzag holds two, every other layout one (Ulysses: the
    linear layers see the contiguous layout)."""
    if strategy == "zigzag":
        return [[(r, r + 1), (2 * size - 1 - r, 2 * size - r)] for r in range(size)]
    return [[(r, r + 1)] for r in range(size)]


def _kind_mask(shape: ModelShape, kind: str, causal: bool, docs) -> Mask:
    return Mask(causal, shape.window if kind == "sliding" else None, docs)


def comm_per_layer(c: Candidate, shape: ModelShape, n: int, e: int, causal: bool = True,
                   docs: Optional[Tuple[int, ...]] = None, peers: Optional[Dict[str, int]] = None
                   ) -> Dict[str, Dict[str, float]]:
    """{layer kind: {CommStats kind: bytes}} the busiest rank sends per layer, forward + backward:
    softmax layers from the closed forms with each kind's mask (masks.busiest_bytes: the window's and
    the documents' exact spans); ``peers`` (filled if given) the ring peers a softmax kind talks to."""
    out: Dict[str, Dict[str, float]] = {}
    if c.size == 1:
        return out
    sh = Shapes(1, c.size * n, shape.heads, shape.kv_heads, shape.head_dim, e, shape.v_head_dim)
    for kind in SOFTMAX_KINDS:
        if shape.count(kind):
            by_kind, talks_to = masks.busiest_bytes(c.strategy, c.size, c.ulysses_size, sh,
                                                    _kind_mask(shape, kind, causal, docs))
            out[kind] = dict(by_kind)
            if peers is not None:
                peers[kind] = talks_to
    for kind in ("linear", "mamba"):
        if not shape.count(kind):
            continue
        if c.linear_strategy == "ulysses":
            width = shape.lin_heads * (2 * shape.lin_dk + 2 * shape.lin_dv)
            out[kind] = dict(linear_ulysses_bytes(c.size, [n * width], e))
        else:
            runs = _runs(c.strategy, c.size)
            b = dict(linear_state_bytes(runs, 0, 1, shape.lin_heads, shape.lin_dk, shape.lin_dv, "allgather",
                                        shape.transition if kind == "linear" else "scalar"))
            b.update(conv_halo_bytes(runs, 1, shape.conv_channels, max(shape.conv_width - 1, 0), e))
            out[kind] = b
    if shape.count("lasp"):
        state = Shapes(1, c.size * n, shape.heads, shape.kv_heads, shape.head_dim, e)
        out["lasp"] = dict(closed_form_by_kind("lasp", c.size, state, 0, lasp_comm=c.lasp_comm))
    return out


def _attention_keys(c: Candidate, shape: ModelShape, seq: int, causal: bool, docs) -> Dict[Optional[int], float]:
    """{window: the busiest rank's keys per local token} for every window a softmax layer uses."""
    u = c.ulysses_size if c.strategy in RING_STRATEGIES else c.size
    return {w: masks.busiest_keys_per_token(c.strategy, c.size, u, seq, Mask(causal, w, docs))
            for w in shape.softmax_windows()}


def _compute(c: Candidate, shape: ModelShape, seq: int, n: int, cl: Cluster, causal: bool = True,
             docs=None) -> Tuple[float, Dict[str, float]]:
    """(seconds of one step's compute on the busiest rank, {softmax kind: its attention seconds per
    layer}): each window's attention at the busiest rank's exact pairs (masks.py: the contiguous
    causal ring's last rank does (2R-1)/R of the average; with a short window nobody is much busier)."""
    keys = _attention_keys(c, shape, seq, causal, docs)
    parts = flops.step_per_token(shape, seq, c.features.on, causal, docs, keys)
    rate = cl.gpu.flops_s(cl.dtype, "attention")
    attn = parts["attention"] * n / rate
    rest = sum(v for k, v in parts.items() if k != "attention") * n / cl.gpu.flops_s(cl.dtype, "matmul")
    mixer = 4 if c.features.on else 3
    per_layer = {kind: mixer * 2.0 * keys[shape.window if kind == "sliding" else None] * shape.heads
                 * (shape.head_dim + shape.dv) * n / rate for kind in SOFTMAX_KINDS if shape.count(kind)}
    return attn + rest, per_layer


def _comm_time(c: Candidate, shape: ModelShape, per_layer, attn_s: Dict[str, float], cl: Cluster,
               peers: Optional[Dict[str, int]] = None) -> Dict[str, float]:
    """Exposed seconds per step by layer kind: Ulysses' all-to-alls in full, the ring's excess over
    the same layer's attention compute (a masked ring talks only to the peers whose blocks it needs),
    LASP's collectives (LASP-1: P - 1 hops one after the other, forward and back)."""
    g, out = cl.gpus_per_node, {}
    r = c.size // c.ulysses_size
    for kind, by_kind in per_layer.items():
        layers = shape.count(kind)
        t = comm_model.all_to_all_time(cl.gpu, by_kind.get("all_to_all", 0), c.ulysses_size if c.strategy != "ulysses"
                                       else c.size, g, calls=8)
        ring = by_kind.get("ring", 0) + by_kind.get("ring_grad", 0)
        hops = 2 * (peers or {}).get(kind, r - 1)
        t += comm_model.ring_time(cl.gpu, ring, r, c.ulysses_size, g, attn_s.get(kind, 0.0), hops=hops)
        rest = sum(v for k, v in by_kind.items() if k not in ("all_to_all", "ring", "ring_grad"))
        if kind in ("linear", "mamba") and c.linear_strategy == "ulysses":
            t += comm_model.all_to_all_time(cl.gpu, rest, c.size, g, calls=8)
        elif kind == "lasp" and c.lasp_comm == "ring":
            link = cl.gpu.inter if c.size > g else cl.gpu.intra
            t += 2 * (c.size - 1) * link.time(rest / 2)         # the state waits for every earlier rank
        else:
            t += comm_model.collective_time(cl.gpu, rest, c.size, g)
        out[kind] = t * layers
    return out


def predict(c: Candidate, shape: ModelShape, seq: int, cl: Cluster, own_linear: bool = False,
            causal: bool = True, docs: Optional[Tuple[int, ...]] = None, timing: bool = True) -> Prediction:
    """One candidate: refused (reason), or its memory, bytes, times and fit. ``docs``: packed
    documents' lengths (their mask sets the attention work and the ring's bytes); ``timing`` False:
    memory only (longest_sequence asks thousands of clusters)."""
    dp = cl.gpus // c.size if cl.gpus % c.size == 0 else 0
    p = Prediction(c, dp, ok=False, budget_bytes=cl.gpu.usable_bytes)
    reason = check(c, shape, cl.gpus, own_linear)
    if reason:
        p.reason = reason
        return p
    e = 4 if cl.dtype == "fp32" else 2
    n = masks.padded_length(c.strategy, c.size, c.ulysses_size, seq) // c.size
    on_device = not (c.features.on and c.features.cpu_checkpointing)
    lines = memory.phase_lines(shape, c.strategy, c.size, c.ulysses_size, cl.gpus, c.zero, cl.dtype, c.features,
                               on_device)
    p.phases = lines
    p.static_bytes = sum(memory.static_bytes(shape, cl.gpus, c.zero, cl.dtype, c.features.offload_optimizer).values())
    p.peak_phase = max(lines, key=lambda k: lines[k]["a"] + lines[k]["b"] * n)
    p.per_token_bytes = max(line["b"] for line in lines.values())
    p.peak_bytes = memory.peak(lines, n)
    p.host_bytes = memory.host_bytes_per_node(shape, n, min(cl.gpus_per_node, cl.gpus), cl.gpus, cl.dtype, c.features)
    p.max_seq = c.size * min(memory.max_tokens(lines, p.budget_bytes), _host_tokens(c, shape, cl))
    if not timing:
        return p
    peers: Dict[str, int] = {}
    per_layer = comm_per_layer(c, shape, n, e, causal, masks.cut_documents(docs, seq), peers)
    p.comm_bytes = {k: float(sum(v.values())) for k, v in per_layer.items()}
    p.compute_s, attn_s = _compute(c, shape, seq, n, cl, causal, docs)
    p.comm_s = _comm_time(c, shape, per_layer, attn_s, cl, peers)
    zb = comm_model.zero_bytes(shape.params(), cl.gpus, c.zero, 2 if e == 2 else 4, e)
    p.comm_s["zero"] = comm_model.collective_time(cl.gpu, zb, cl.gpus, cl.gpus_per_node)
    if c.features.offload_optimizer:
        share = shape.params() / cl.gpus
        p.comm_s["offload"] = 2 * e * share / cl.gpu.pcie_bytes_s + share / cl.gpu.assumed["cpu_adam_params_per_s"]
    p.step_s = p.compute_s + sum(p.comm_s.values())
    p.tokens_s = dp * seq / p.step_s
    peak_flops = cl.gpu.peaks["bf16_tflops" if e == 2 else "tf32_tflops"] * 1e12
    p.mfu = flops.model_flops_per_token(shape, seq, causal, docs) * seq * dp / p.step_s / (cl.gpus * peak_flops)
    if p.peak_bytes > p.budget_bytes:
        p.reason = (f"does not fit: {p.peak_bytes / 1e9:.1f} GB per GPU ({p.peak_phase}) > {p.budget_bytes / 1e9:.1f} GB "
                    f"usable; longest sequence for it {p.max_seq:,}")
    elif p.host_bytes > HOST_USABLE * cl.gpu.host_bytes_per_node:
        p.reason = (f"host memory: {p.host_bytes / 1e9:.0f} GB per node (checkpoints / optimizer offloaded) > "
                    f"{HOST_USABLE * cl.gpu.host_bytes_per_node / 1e9:.0f} GB usable")
    else:
        p.ok = True
    return p


def _host_tokens(c: Candidate, shape: ModelShape, cl: Cluster) -> int:
    """Tokens per rank the node's host memory allows (offloaded checkpoints)."""
    g = min(cl.gpus_per_node, cl.gpus)
    e = 4 if cl.dtype == "fp32" else 2
    optim = memory.host_bytes_per_node(shape, 0, g, cl.gpus, cl.dtype, c.features)
    per_token = g * shape.layers * shape.hidden * e if c.features.on and c.features.cpu_checkpointing else 0
    free = HOST_USABLE * cl.gpu.host_bytes_per_node - optim
    if free < 0:
        return 0
    return int(free / per_token) if per_token else 1 << 62


def plan(shape: ModelShape, seq: int, cl: Cluster, zero: Optional[int] = None, own_linear: bool = False,
         features=FEATURE_SETS, docs: Optional[Tuple[int, ...]] = None) -> Tuple[List[Prediction], List[Prediction]]:
    """(feasible ranked by tokens/s, then less memory; rejected)."""
    preds = [predict(c, shape, seq, cl, own_linear, docs=docs) for c in candidates(shape, cl.gpus, zero, features, own_linear)]
    ok = sorted((p for p in preds if p.ok), key=lambda p: (-p.tokens_s, p.peak_bytes))
    return ok, [p for p in preds if not p.ok]


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


__all__ = ["Candidate", "Cluster", "FEATURE_SETS", "Prediction", "candidates", "check", "comm_per_layer",
           "gpus_needed", "longest_sequence", "plan", "predict"]
