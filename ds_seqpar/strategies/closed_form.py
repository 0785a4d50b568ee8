"""Closed forms of the bytes one rank sends for one forward + backward, for every strategy: the one
oracle. The benchmark prints measured / closed form (must be 1.000), and each strategy family's
distributed test (tests/dist/test_ulysses.py, test_ring.py, test_lasp.py) asserts ``sp.stats``
against ``closed_form_by_kind`` on real ranks, so a strategy that starts sending more than its
design note says fails loudly.

Each form is the one in the strategy's docstring (strategies/*.py); the notation is theirs:

    P        sequence-parallel size (U x R for the 2D hybrid)
    S        elements of one local full-head tensor        [b, n, H, d]      n = N / P
    S_kv     elements of the local k (= of v when dv = d)  [b, n, H_kv, d]
    e        element size of q, k, v; e_acc = 4 (the ring's fp32 dK/dV accumulators)
    f        Ulysses k/v head replication P / gcd(H_kv, P) (1 when P divides H_kv)

Forms are split by the CommStats kind each exchange records under ("all_to_all", "ring",
"ring_grad", "lasp_state", "lasp_dstate"; "dsa_latent", "dsa_index_keys" for DeepSeek sparse attention), so a test also sees which exchange is off; the own LM's
LASP and the hybrids' linear layers share one state exchange and so one form (state_exchange_bytes).

Packed documents and sliding windows: Ulysses and the hybrid's all-to-alls are unchanged; the ring
loop's K/V and dK/dV go only to the ranks whose queries see them, and only the span of keys they see
(masked_key_ranges: the plan's spans, tests/reference.py's key-by-key derivation their oracle;
ring_masked_bytes: for a causal window w <= n on the contiguous ring, the last w-1 tokens of one
neighbour instead of P-1 blocks), LASP's states only across rank boundaries a document crosses
(lasp_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..masks import Mask
from ..sharding.documents import Documents
from . import RING_STRATEGIES
from .lasp_chain import LaspChain, StateChain
from .mask_plan import masked_plan
from .ulysses import kv_replication

E_ACC = 4            # ring dK/dV accumulators are fp32 whatever the input dtype (ring_loop.py)


@dataclass(frozen=True)
class Shapes:
    """One attention call over the whole sequence: batch, global length, heads, head dims, element size."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    elem: int = 4                       # bytes per element of q, k, v (fp32: 4, bf16: 2, fp64: 8)
    v_head_dim: Optional[int] = None    # None: = head_dim

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def local(self, p: int) -> "Shapes":
        return Shapes(self.batch, self.seq // p, self.heads, self.kv_heads, self.head_dim, self.elem,
                      self.v_head_dim)

    def elements(self, heads: int, dim: int) -> int:
        return self.batch * self.seq * heads * dim


def _all_to_all(p: int, loc: Shapes, f: int) -> int:
    """Ulysses inside ``p`` ranks on these local shapes: q, k, v, out forward and dout, dq, dk, dv
    backward, each all-to-all keeping 1/p of its tensor at home; k, v (and their grads) f-replicated."""
    tensors = (loc.elements(loc.heads, loc.head_dim), loc.elements(loc.heads, loc.dv),        # q / dq, out / dout
               f * loc.elements(loc.kv_heads, loc.head_dim), f * loc.elements(loc.kv_heads, loc.dv))  # k / dk, v / dv
    return sum(2 * (t * loc.elem * (p - 1) // p) for t in tensors)


def _ring(p: int, kv_elems: int, elem: int) -> Dict[str, int]:
    """K/V (S_k + S_v elements) forward P-1 hops and again backward P-1 hops; fp32 dK/dV P-1 hops."""
    return {"ring": kv_elems * (p - 1) * 2 * elem, "ring_grad": kv_elems * (p - 1) * E_ACC}


def ulysses_bytes(p: int, sh: Shapes) -> Dict[str, int]:
    """8 all-to-alls: 8 e S (P-1)/P for MHA."""
    return {"all_to_all": _all_to_all(p, sh.local(p), kv_replication(sh.heads, sh.kv_heads, p))}


def ring_bytes(p: int, sh: Shapes) -> Dict[str, int]:
    """Ring, zigzag, striped: S_kv (P-1) (4e + 2 e_acc) when dv = d."""
    loc = sh.local(p)
    return _ring(p, loc.elements(sh.kv_heads, sh.head_dim + sh.dv), sh.elem)


def hybrid_bytes(p: int, sh: Shapes, ulysses_size: int) -> Dict[str, int]:
    """Ulysses inside groups of U ranks, the ring form across R = P/U groups on the head-sharded,
    U-times-longer k (whose elements equal f * S_kv)."""
    u, r = ulysses_size, p // ulysses_size
    loc, f = sh.local(p), kv_replication(sh.heads, sh.kv_heads, ulysses_size)
    out = {"all_to_all": _all_to_all(u, loc, f)}
    out.update(_ring(r, f * loc.elements(sh.kv_heads, sh.head_dim + sh.dv), sh.elem))
    return out


def lasp_state_bytes(sh: Shapes) -> int:
    """One [b, H, Dk, Dv] state: fp32 (fp64 for fp64 inputs), one per q head."""
    return sh.batch * sh.heads * sh.head_dim * sh.dv * (8 if sh.elem == 8 else 4)


def lasp_bytes(p: int, sh: Shapes, rank: int, lasp_comm: str, cu_seqlens: Optional[Sequence[int]] = None
               ) -> Dict[str, int]:
    """The own LM's LASP: the exchange's form on the contiguous chain (lasp_chain.LaspChain, packed
    documents cut it), fixed transition. Without documents LASP-1 ("ring") sends one state forward to
    r+1 and one dstate backward to r-1; LASP-2 ("allgather") all-gathers (P-1 states) and
    reduce-scatters ((P-1)/P of P states). Independent of the sequence length."""
    docs = None if cu_seqlens is None else Documents(cu_seqlens, sh.seq)
    return state_exchange_bytes(LaspChain(p, sh.seq // p, docs), rank, lasp_state_bytes(sh), 0, lasp_comm)


def state_exchange_bytes(chain, rank: int, state_bytes: int, map_bytes: int, lasp_comm: str) -> Dict[str, int]:
    """One fwd+bwd through lasp_comm/ over ``chain`` (lasp_chain.StateChain), CommStats kinds
    "lasp_state" (forward) and "lasp_dstate" (backward). allgather: the widest rank's slots (fragments
    that feed another) of B, and of A where the transition travels (``map_bytes`` per slot; 0 for the
    fixed decay), all-gathered (P-1 pieces) and reduce-scattered back ((P-1)/P of P pieces); nothing
    when no state crosses a rank. ring: one state per hop to another rank, forward (to the next
    fragment's owner) and backward (to the previous one's). allscan: the ring's, each state in K
    blocks (constant in P: no rank sends more than its fragments' boundary states). No term grows
    with N."""
    if lasp_comm not in ("allgather", "ring", "allscan"):
        raise ValueError(f"lasp_comm {lasp_comm!r}: allgather, ring or allscan")
    if lasp_comm == "allgather":
        each = (chain.p - 1) * chain.width * (state_bytes + map_bytes)
        return {"lasp_state": each, "lasp_dstate": each}
    mine = [(rank, j) for j in chain.local(rank)]
    out = sum(1 for key in mine if chain.feeds[key] and chain.next[key][0] != rank)
    back = sum(1 for key in mine if chain.fed[key] and chain.prev[key][0] != rank)
    return {"lasp_state": out * state_bytes, "lasp_dstate": back * state_bytes}


# -- hybrids' linear layers (linear_exchange.py) -----------------------------------------------


def linear_state_bytes(frags, rank: int, rows: int, heads: int, dk: int, dv: int, lasp_comm: str,
                       transition: str = "matrix") -> Dict[str, int]:
    """One linear layer, forward + backward, under linear_strategy lasp; ``frags`` = the layout's
    runs (lasp_chain.fragments). Maps are fp32: B [rows, heads, dk, dv] and A by ``transition``:
    "matrix" [.., dk, dk] (the delta rule), "scalar" [.., 1, 1] (Mamba2 SSD: a data-dependent decay per
    head), "diagonal" [.., dk, 1] (Mamba-1: one decay per channel and state entry; heads = channels,
    dv = 1), "fixed" (lightning attention: lambda^n, derived on every rank, never sent). Kinds that send
    nothing are left out."""
    map_elems = {"matrix": rows * heads * dk * dk, "scalar": rows * heads, "diagonal": rows * heads * dk,
                 "fixed": 0}[transition]
    out = state_exchange_bytes(StateChain(frags), rank, rows * heads * dk * dv * 4, map_elems * 4, lasp_comm)
    return {kind: n for kind, n in out.items() if n}


def linear_ulysses_bytes(p: int, local_elems: Sequence[int], elem: int) -> Dict[str, int]:
    """One linear layer under linear_strategy ulysses, forward + backward: each input of the op and
    its output all-to-all once each way ((P-1)/P of each tensor's local bytes), and the duals of all
    of them in backward. ``local_elems``: each tensor's element count on one rank."""
    return {"linear_all_to_all": 2 * sum(n * elem * (p - 1) // p for n in local_elems)}


def conv_halo_bytes(frags, rows: int, channels: int, width: int, elem: int) -> Dict[str, int]:
    """One short causal conv, forward + backward: every rank's run tails ([rows, channels, width],
    the most runs any rank holds) all-gathered, their gradients reduce-scattered back."""
    p, f = len(frags), max(len(fr) for fr in frags)
    return {"conv_halo": 2 * (p - 1) * f * rows * channels * width * elem}


def indexed_attention_bytes(p: int, batch: int, seq: int, latent_dim: int, index_dim: int, elem: int
                            ) -> Dict[str, int]:
    """One DeepSeek sparse attention layer, forward + backward (hf/indexed.py), whatever the softmax
    strategy: the n = N / P local latents (``latent_dim`` = kv_lora_rank + qk_rope_head_dim per token)
    all-gathered forward (P-1 pieces) and their gradients reduce-scattered backward ((P-1)/P of P
    pieces), kind "dsa_latent"; the indexer keys (``index_dim`` per token; 0 on a layer that reuses an
    earlier layer's selection) all-gathered forward only (the indexer runs without gradient), kind
    "dsa_index_keys". Independent of heads and top-k; linear in N."""
    if p == 1:
        return {}
    piece = batch * (seq // p) * elem
    out = {"dsa_latent": 2 * (p - 1) * piece * latent_dim, "dsa_index_keys": (p - 1) * piece * index_dim}
    return {kind: n for kind, n in out.items() if n}


# -- packed documents (cu_seqlens) -------------------------------------------------------------


def masked_key_ranges(mask: Mask, ring_layout, padded: int) -> List[List[Optional[Tuple[int, int]]]]:
    """ranges[me][src] (me != src): the local slots [a, b) of src's block that ring position me computes
    on under ``mask`` (documents, a window, bidirectional blocks, end padding), or None: the runtime's own
    spans, read from the mask's plan (mask_plan.masked_plan: MaskPlan.key_range, the span
    transport.DirectKV sends). tests/reference.py derives the same spans key by key from the mask on
    global positions, independently of the plan: the oracle a unit test holds these to."""
    plan = masked_plan(mask, ring_layout, padded)
    p = ring_layout.size
    return [[None if me == src else plan.key_range(me, src) for src in range(p)] for me in range(p)]


def ring_masked_bytes(ranges, me: int, token_elems: int, elem: int) -> Dict[str, int]:
    """Bytes ring position ``me`` sends for one fwd+bwd under a mask (transport.py: direct): to every
    rank, the keys of its block that rank can see, forward and backward; its fp32 share of dK/dV
    for the keys it saw of every other block. ``token_elems``: elements of one token of the k and v
    the ring loop holds (f times the local ones for the hybrid). Every key needed everywhere:
    exactly _ring's form."""
    p = len(ranges)
    width = lambda r: 0 if r is None else r[1] - r[0]       # noqa: E731
    sent = sum(width(ranges[other][me]) for other in range(p) if other != me)
    used = sum(width(ranges[me][other]) for other in range(p) if other != me)
    return {"ring": sent * token_elems * 2 * elem, "ring_grad": used * token_elems * E_ACC}


def _masked_by_kind(strategy: str, p: int, sh: Shapes, rank: int, ulysses_size: int, lasp_comm: str,
                    cu_seqlens: Sequence[int], causal: bool, window: Optional[int], blocks) -> Dict[str, int]:
    from ..sharding.layouts import make_layout
    from . import get_strategy
    if strategy == "ulysses":
        return ulysses_bytes(p, sh)
    if strategy == "lasp":
        return lasp_bytes(p, sh, rank, lasp_comm, cu_seqlens)
    ring = make_layout(get_strategy(strategy).layout_name, p // ulysses_size)
    mask = Mask.from_boundaries(list(cu_seqlens), causal, window, blocks=blocks)
    return masked_ring_by_kind(masked_key_ranges(mask, ring, sh.seq), p, sh, rank, ulysses_size)


def masked_ring_by_kind(ranges, p: int, sh: Shapes, rank: int, ulysses_size: int) -> Dict[str, int]:
    """The ring family's bytes under a mask, from its key spans (``masked_key_ranges``, which a caller
    pricing many ranks finds once): the 2D hybrid's all-to-all is the mask's no-mask one; after it a
    ring position holds U x n tokens of H_kv / U (f-replicated) heads, so one of its tokens is f x
    the local k/v elements over the position's tokens."""
    u, loc = ulysses_size, sh.local(p)
    f = kv_replication(sh.heads, sh.kv_heads, u) if u > 1 else 1
    out = {"all_to_all": _all_to_all(u, loc, f)} if u > 1 else {}
    token_elems = f * loc.elements(sh.kv_heads, sh.head_dim + sh.dv) // (sh.seq // len(ranges))
    out.update(ring_masked_bytes(ranges, rank // u, token_elems, sh.elem))
    return out


def closed_form_by_kind(strategy: str, p: int, shapes: Shapes, rank: int = 0, ulysses_size: int = 1,
                        lasp_comm: str = "allgather", cu_seqlens: Optional[Sequence[int]] = None,
                        causal: bool = True, window: Optional[int] = None, blocks=None) -> Dict[str, int]:
    """{CommStats kind: bytes} rank ``rank`` of a sequence group of ``p`` ranks sends for one
    fwd+bwd of one attention call over ``shapes`` (global length); kinds that send nothing are left
    out. ``ulysses_size`` > 1 with a ring strategy is the 2D hybrid, as in the config key;
    ``lasp_comm`` picks LASP-1 (ring), LASP-2 (allgather) or All-Scan (allscan: the ring's bytes). ``cu_seqlens``: packed documents over
    shapes.seq tokens (the padded length; ``causal`` matters to the ring family then); ``window``: a
    sliding window (the ring family sends only the keys it reaches; Ulysses' bytes are unchanged);
    ``blocks``: bidirectional blocks, global (start, end) pairs (a block's keys also reach its earlier
    queries' positions)."""
    if strategy not in ("lasp", "ulysses") + RING_STRATEGIES:
        raise ValueError(f"no closed form for strategy {strategy!r}; known: lasp, ulysses, "
                         f"{', '.join(RING_STRATEGIES)}")
    if p == 1:
        return {}
    if cu_seqlens is not None or ((window is not None or blocks) and strategy != "lasp"):
        bounds = list(cu_seqlens) if cu_seqlens is not None else [0, shapes.seq]
        out = _masked_by_kind(strategy, p, shapes, rank, ulysses_size, lasp_comm, bounds, causal, window, blocks)
    elif strategy == "lasp":
        out = lasp_bytes(p, shapes, rank, lasp_comm)
    elif strategy == "ulysses":
        out = ulysses_bytes(p, shapes)
    else:
        out = hybrid_bytes(p, shapes, ulysses_size) if ulysses_size > 1 else ring_bytes(p, shapes)
    return {kind: n for kind, n in out.items() if n}


def closed_form_bytes(strategy: str, p: int, shapes: Shapes, rank: int = 0, ulysses_size: int = 1,
                      lasp_comm: str = "allgather", cu_seqlens: Optional[Sequence[int]] = None,
                      causal: bool = True, window: Optional[int] = None, blocks=None) -> int:
    """The total of ``closed_form_by_kind``: what CommStats.total_bytes must read (with packed
    documents or blocks, less the "cu_seqlens_check" all-reduce of three int64 per call)."""
    return sum(closed_form_by_kind(strategy, p, shapes, rank, ulysses_size, lasp_comm, cu_seqlens, causal,
                                   window, blocks).values())


def transient_bytes(strategy: str, p: int, shapes: Shapes, ulysses_size: int = 1) -> Dict[str, int]:
    """{"forward", "backward"}: the most bytes of communication buffers a rank holds at once inside one
    attention call, beyond what the single-device kernel holds for the same local tokens: the memory
    a token costs at P ranks and not at one (upper bounds; ``shapes`` global, n = N / P per rank).

    Ring family: the ring is double buffered (transport.py), so at most two K/V block sets are in
    flight forward, and two K/V sets plus two fp32 dK/dV sets backward:
        forward 2 S_kv' e, backward 2 S_kv' (e + e_acc)       S_kv' = elements of local k and v
    Ulysses: the head-sharded, whole-sequence copies of q, k, v and out live next to the rank's own
    (the all-to-all needs a send and a receive side), and backward the same again for dout, dq, dk, dv:
        forward (S_q + S_o + f S_kv') e, backward twice that
    Hybrid: the Ulysses form inside U ranks plus the ring form on the head-sharded, U-times-longer k/v.
    LASP: one state per head, independent of N (no per-token term).
    Tokens need no other buffer at P ranks: the loss, the data and ZeRO's buffers are per rank and
    per parameter alike at every P (measured: reports/memory_cpu.md)."""
    if p == 1 or strategy == "lasp":
        return {"forward": 0, "backward": 0}
    loc = shapes.local(p)
    kv = loc.elements(shapes.kv_heads, shapes.head_dim + shapes.dv)

    def ring_form(r: int, kv_elems: int) -> Dict[str, int]:
        return {"forward": 2 * kv_elems * loc.elem, "backward": 2 * kv_elems * (loc.elem + E_ACC)} if r > 1 else \
            {"forward": 0, "backward": 0}

    def ulysses_form(u: int) -> Dict[str, int]:
        f = kv_replication(shapes.heads, shapes.kv_heads, u)
        fwd = (loc.elements(shapes.heads, shapes.head_dim) + loc.elements(shapes.heads, shapes.dv) + f * kv) * loc.elem
        return {"forward": fwd, "backward": 2 * fwd}

    if strategy == "ulysses":
        return ulysses_form(p)
    if strategy not in RING_STRATEGIES:
        raise ValueError(f"no transient form for strategy {strategy!r}; known: lasp, ulysses, "
                         f"{', '.join(RING_STRATEGIES)}")
    if ulysses_size > 1:
        inner = ulysses_form(ulysses_size)
        outer = ring_form(p // ulysses_size, kv_replication(shapes.heads, shapes.kv_heads, ulysses_size) * kv)
        return {k: inner[k] + outer[k] for k in inner}
    return ring_form(p, kv)


__all__ = ["Shapes", "closed_form_bytes", "transient_bytes", "closed_form_by_kind", "kv_replication", "E_ACC",
           "masked_key_ranges", "ring_masked_bytes", "masked_ring_by_kind", "lasp_bytes", "state_exchange_bytes",
           "indexed_attention_bytes"]
