"""Time: alpha-beta times of the collectives the strategies and ZeRO use, per link class; the compute
of a step from its FLOPs; a rank's kernel calls priced per call and per computed pair.

``gpu`` is a plan.hardware.Gpu (read by attribute: intra / inter links with ``alpha_s``,
``beta_bytes_s`` and ``time(bytes, messages)``, ``flops_s``, ``pcie_bytes_s``, ``assumed``).

A group of ranks placed on consecutive ranks (Ulysses groups are: topology.py) stays inside a node
when it has at most gpus_per_node ranks; otherwise part of its traffic crosses the inter-node
fabric, whose per-GPU bandwidth is the bottleneck. Bytes are the bytes one rank SENDS (the closed
forms' unit), so each formula below divides them by one link's bandwidth:

    all-to-all       alpha x calls + B_intra / beta_nvlink, B_inter / beta_ib in parallel
                     (B_inter = the share of its peers off the node: (p - g) / (p - 1) of B)
    ring send/recv   per hop alpha + b / beta of the slowest hop (inter-node if the ring leaves
                     the node); with overlap only what exceeds the compute of the same step shows
    LASP state chain P - 1 hops of one state (LASP-1); All-Scan P - 2 + K hops of one of K blocks
    all-gather, reduce-scatter, all-reduce (ring algorithms): (p - 1) alpha + B / beta
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..masks import Mask, cut_documents
from ..strategies import RING_STRATEGIES
from ..strategies.closed_form import Shapes
from ..strategies.ulysses import chunk_counts, kv_replication
from ..strategies.lasp_comm.allscan import scan_blocks
from .bytes import SPAN_BUDGET, comm_per_layer, exact_spans, layer_mask
from .candidate import SOFTMAX_KINDS
from .chunks import choose, comm_overlap, ulysses_exposed_s, why
from .flops import step_per_token
from .pairs import busiest_keys_per_token, computed_pairs


def spans_nodes(group_ranks: int, stride: int, gpus_per_node: int) -> bool:
    """A group of ``group_ranks`` ranks ``stride`` apart covers group_ranks x stride consecutive ranks."""
    return group_ranks * stride > gpus_per_node


def all_to_all_time(gpu, nbytes: float, p: int, gpus_per_node: int, calls: int) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    if p <= gpus_per_node:
        return gpu.intra.time(nbytes, calls)
    off = (p - gpus_per_node) / (p - 1)
    return calls * gpu.inter.alpha_s + max(nbytes * (1 - off) / gpu.intra.beta_bytes_s,
                                           nbytes * off / gpu.inter.beta_bytes_s)


def ring_link(gpu, r: int, stride: int, gpus_per_node: int):
    return gpu.inter if spans_nodes(r, stride, gpus_per_node) else gpu.intra


def ring_time(link, nbytes: float, r: int, compute_s: float, overlap: bool = True, hops: Optional[int] = None) -> float:
    """Exposed time of ``nbytes`` sent over r - 1 hops of ``link`` (``ring_link``; forward and backward
    passes together: 2 (r-1) hops; ``hops`` fewer where a mask leaves peers with nothing to send) beside
    ``compute_s`` seconds of attention compute spread evenly over the r steps."""
    if r <= 1 or nbytes <= 0:
        return 0.0
    hops = 2 * (r - 1) if hops is None else max(hops, 1)
    per_hop = link.alpha_s + nbytes / hops / link.beta_bytes_s
    if not overlap:
        return hops * per_hop
    per_step_compute = compute_s / (2 * r)
    return hops * max(0.0, per_hop - per_step_compute)


def collective_time(gpu, nbytes: float, p: int, gpus_per_node: int) -> float:
    """All-gather / reduce-scatter / all-reduce by ring: ``nbytes`` sent per rank in p - 1 steps."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    link = gpu.inter if p > gpus_per_node else gpu.intra
    return link.time(nbytes, p - 1)


def zero_bytes(params: int, ranks: int, zero: int, grad_bytes: int, weight_bytes: int) -> float:
    """Bytes per rank per step of ZeRO's collectives over ``ranks``: gradients reduce-scattered
    (stage 1 all-reduces: twice) and the updated weights all-gathered; stage 3 gathers the weights
    once more for the backward."""
    if ranks <= 1:
        return 0.0
    frac = (ranks - 1) / ranks
    grads = grad_bytes * params * frac * (2 if zero == 1 else 1)
    weights = weight_bytes * params * frac * (2 if zero >= 3 else 1)
    return grads + weights




def attention_keys(c, shape, seq: int, causal: bool, docs) -> Dict[Optional[int], float]:
    """{window: the busiest rank's keys per local token} for every window a softmax layer of ``shape``
    uses."""
    u = c.ulysses_size if c.strategy in RING_STRATEGIES else c.size
    return {w: busiest_keys_per_token(c.strategy, c.size, u, seq, Mask(causal, w, docs))
            for w in shape.softmax_windows()}


def compute_s(c, shape, seq: int, n: int, gpu, dtype: str, causal: bool = True,
              docs=None) -> Tuple[float, Dict[str, float]]:
    """(seconds of one step's compute on the busiest rank, {softmax kind: its attention seconds per
    layer}): each window's attention at the busiest rank's exact pairs (pairs.py: the contiguous causal
    ring's last rank does (2R-1)/R of the average; with a short window nobody is much busier)."""
    keys = attention_keys(c, shape, seq, causal, docs)
    parts = step_per_token(shape, seq, c.features.on, causal, docs, keys)
    rate = gpu.flops_s(dtype, "attention")
    attn = parts["attention"] * n / rate
    rest = sum(v for k, v in parts.items() if k != "attention") * n / gpu.flops_s(dtype, "matmul")
    mixer = 4 if c.features.on else 3
    per_layer = {kind: mixer * 2.0 * keys[shape.window if kind == "sliding" else None] * shape.heads
                 * (shape.head_dim + shape.dv) * n / rate for kind in SOFTMAX_KINDS if shape.count(kind)}
    return attn + rest, per_layer


def ulysses_degree(c) -> int:
    return c.size if c.strategy == "ulysses" else c.ulysses_size


def ulysses_a2a_s(c, shape, gpu, nbytes: float, gpus_per_node: int, attn_s: float, chunks: int = 1) -> float:
    """Exposed seconds of one softmax layer's all-to-alls (``nbytes``, forward + backward) in ``chunks``
    head chunks beside ``attn_s`` seconds of its attention (a third forward, two thirds backward):
    cost/chunks.py's price; 1 chunk: the whole exchange, 8 calls."""
    u = ulysses_degree(c)
    if chunks == 1:
        return all_to_all_time(gpu, nbytes, u, gpus_per_node, calls=8)
    kv = shape.kv_heads * kv_replication(shape.heads, shape.kv_heads, u)
    q_share = shape.heads / (shape.heads + kv)          # q, out, dout, dq vs k, v, dk, dv (their heads)
    return ulysses_exposed_s(lambda b, calls: all_to_all_time(gpu, b, u, gpus_per_node, calls), nbytes, q_share,
                             attn_s / 3, 2 * attn_s / 3, chunks, comm_overlap(gpu))


def ulysses_chunks(c, shape, per_layer, attn_s: Dict[str, float], gpu, gpus_per_node: int) -> Tuple[int, str]:
    """(head chunks, why) of candidate ``c``: its own count, or for "auto" the count of the lowest exposed
    all-to-all over the model's softmax layers (one count for every layer, as the runtime runs it)."""
    u = ulysses_degree(c)
    if u <= 1 or not any(kind in per_layer for kind in SOFTMAX_KINDS):
        return 1, ""
    if c.ulysses_chunks != "auto":
        return c.ulysses_chunks, f"{c.ulysses_chunks}: set"

    def price(chunks):
        return sum(shape.count(kind) * ulysses_a2a_s(c, shape, gpu, per_layer[kind].get("all_to_all", 0),
                                                      gpus_per_node, attn_s.get(kind, 0.0), chunks)
                   for kind in SOFTMAX_KINDS if kind in per_layer)
    best, prices = choose(chunk_counts(shape.heads, shape.kv_heads, u), price)
    return best, why(best, prices, comm_overlap(gpu))


def comm_s(c, shape, per_layer, attn_s: Dict[str, float], gpu, gpus_per_node: int,
           peers: Optional[Dict[str, int]] = None, chunks: int = 1) -> Dict[str, float]:
    """Exposed seconds per step by layer kind: Ulysses' all-to-alls (in ``chunks`` head chunks), the ring's excess over
    the same layer's attention compute (a masked ring talks only to the peers whose blocks it needs),
    LASP's collectives (LASP-1: P - 1 hops one after the other, forward and back; All-Scan: P - 2 + K hops
    of one block: lasp_chain_time)."""
    g, out = gpus_per_node, {}
    r = c.size // c.ulysses_size
    for kind, by_kind in per_layer.items():
        layers = shape.count(kind)
        t = ulysses_a2a_s(c, shape, gpu, by_kind.get("all_to_all", 0), g, attn_s.get(kind, 0.0),
                          chunks if kind in SOFTMAX_KINDS else 1)
        ring = by_kind.get("ring", 0) + by_kind.get("ring_grad", 0)
        hops = 2 * (peers or {}).get(kind, r - 1)
        t += ring_time(ring_link(gpu, r, c.ulysses_size, g), ring, r, attn_s.get(kind, 0.0), hops=hops)
        rest = sum(v for k, v in by_kind.items() if k not in ("all_to_all", "ring", "ring_grad"))
        if kind in ("linear", "mamba") and c.linear_strategy == "ulysses":
            t += all_to_all_time(gpu, rest, c.size, g, calls=8)
        elif kind == "lasp" and c.lasp_comm in ("ring", "allscan"):
            link = gpu.inter if c.size > g else gpu.intra
            t += 2 * lasp_chain_time(link, by_kind.get("lasp_state", 0), c.size, c.lasp_comm, shape.dv)
        else:
            t += collective_time(gpu, rest, c.size, g)
        out[kind] = t * layers
    return out


def lasp_chain_time(link, state_bytes: float, p: int, lasp_comm: str, columns: int) -> float:
    """One direction of a state that walks the ranks (forward; the backward's dstate the same):
    LASP-1 ("ring") waits P - 1 hops of one whole state; All-Scan ("allscan") cuts it into
    K = lasp_comm.allscan.scan_blocks(P, columns, state_bytes) blocks, each hop forwarding a block as soon as it came,
    so the last block is out after P - 2 + K hops of one block."""
    if p <= 1 or state_bytes <= 0:
        return 0.0
    if lasp_comm == "ring":
        return (p - 1) * link.time(state_bytes)
    k = scan_blocks(p, columns, int(state_bytes))
    return (p - 2 + k) * link.time(state_bytes / k)


@dataclass
class StepTime:
    """One training step of a candidate, the busiest rank's."""

    comm_bytes: Dict[str, float]       # bytes per layer of each kind
    comm_s: Dict[str, float]           # exposed seconds per step, by layer kind, "zero" and "offload"
    compute_s: float
    bytes_bounded: bool                # a masked layer's ring bytes are the no-mask upper bound (span budget)
    ulysses_chunks: int = 1            # the head chunks its all-to-alls run in (cost/chunks.py)
    chunks_why: str = ""

    @property
    def step_s(self) -> float:
        return self.compute_s + sum(self.comm_s.values())


def step_time(c, shape, seq: int, n: int, gpu, gpus: int, gpus_per_node: int, dtype: str, causal: bool = True,
              docs: Optional[Tuple[int, ...]] = None, span_budget: float = SPAN_BUDGET) -> StepTime:
    """Candidate ``c`` on ``gpus`` GPUs, ``n`` tokens per rank of a ``seq``-token sequence (``docs``: its
    packed documents): the layers' bytes and exposed communication, the compute from FLOPs, ZeRO's
    collectives over every rank and the offloaded optimizer's PCIe copies and CPU Adam step."""
    e = 4 if dtype == "fp32" else 2
    peers: Dict[str, int] = {}
    cut = cut_documents(docs, seq)
    per_layer = comm_per_layer(c, shape, n, e, causal, cut, peers, span_budget)
    sh = Shapes(1, c.size * n, shape.heads, shape.kv_heads, shape.head_dim, e, shape.v_head_dim)
    bounded = any(not exact_spans(c.strategy, c.size, c.ulysses_size, sh, layer_mask(shape, kind, causal, cut),
                                  span_budget) for kind in SOFTMAX_KINDS if shape.count(kind))
    compute, attn_s = compute_s(c, shape, seq, n, gpu, dtype, causal, docs)
    chunks, chunks_why = ulysses_chunks(c, shape, per_layer, attn_s, gpu, gpus_per_node)
    exposed = comm_s(c, shape, per_layer, attn_s, gpu, gpus_per_node, peers, chunks)
    exposed["zero"] = collective_time(gpu, zero_bytes(shape.params(), gpus, c.zero, e, e), gpus, gpus_per_node)
    if c.features.offload_optimizer:
        share = shape.params() / gpus
        exposed["offload"] = 2 * e * share / gpu.pcie_bytes_s + share / gpu.assumed["cpu_adam_params_per_s"]
    return StepTime({k: float(sum(v.values())) for k, v in per_layer.items()}, exposed, compute, bounded, chunks,
                    chunks_why)


def call_s(cost: Dict[str, float], nq: int, nk: int, causal: bool, anti: bool, heads: float) -> float:
    """One kernel call's seconds: c_call + t_pair x computed pairs x heads, times the measured factor of
    a tall causal block or an anti square (1 when the cost has none)."""
    factor = cost.get("anti_factor", 1.0) if anti else cost.get("tall_factor", 1.0) if causal and nq > nk else 1.0
    return factor * (cost["c_call_s"] + cost["t_pair_s"] * computed_pairs(nq, nk, causal or anti) * heads)


def busiest_calls_s(calls, cost: Dict[str, float], heads: float) -> float:
    """Seconds of kernel work of the busiest rank, ``calls`` per rank (queries, keys, causal, anti)."""
    return max(sum(call_s(cost, *call, heads) for call in rank) for rank in calls)


def busiest_kernel_s(strategy: str, p: int, seq: int, heads: int, cost: Dict[str, float], causal: bool = True) -> float:
    """Seconds of kernel work of the busiest rank over the strategy's blocks (Ulysses' rank holds H / P
    heads)."""
    return busiest_calls_s(rank_calls(strategy, p, seq, causal), cost, heads / p if strategy == "ulysses" else heads)


def rank_calls(strategy: str, p: int, seq: int, causal: bool = True,
               window: Optional[int] = None) -> List[List[Tuple[int, int, bool, bool]]]:
    """Per rank, the (queries, keys, causal, anti) of every kernel call of one attention fwd + bwd: the
    mask's plan over the strategy's layout (strategies/mask_plan.py), a plain plan's bands the whole
    blocks the ring loop calls, a masked plan's cut as the CPU torch kernel's ``band`` cuts them
    (``pieces``: its tiles and key columns). Ulysses: one position holding the whole sequence (its
    H / P heads counted by the caller)."""
    from ..kernels import get_kernel
    from ..sharding.layouts import make_layout
    from ..strategies import STRATEGIES
    from ..strategies.mask_plan import plain_blocks, plan_mask
    kernel, whole = get_kernel("torch", "cpu"), strategy == "ulysses" or p == 1
    layout = make_layout("contiguous" if whole else STRATEGIES[strategy].layout_name, 1 if whole else p)
    plan = plan_mask(Mask(causal, window), layout, seq, plain_blocks if whole else STRATEGIES[strategy].blocks)
    size = lambda s: len(range(*s.indices(plan.n)))  # noqa: E731
    out = []
    for me in range(layout.size):
        bands = [b for src in range(layout.size) for b in plan.bands(me, src)]
        out.append([(size(x.q), size(x.k), bool(x.causal), bool(x.anti)) for b in bands for x in
                    ([b] if plan.kernel_blocks else kernel.pieces(size(b.q), size(b.k), b.lo, b.hi, "cpu"))])
    return out * p if whole else out


__all__ = ["all_to_all_time", "attention_keys", "busiest_calls_s", "busiest_kernel_s", "call_s", "collective_time", "comm_s",
           "compute_s", "lasp_chain_time", "rank_calls", "ring_link", "ring_time", "spans_nodes", "StepTime",
           "step_time", "ulysses_a2a_s", "ulysses_chunks", "ulysses_degree", "zero_bytes"]
