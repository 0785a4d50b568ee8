"""Rank-side measurements of the attention suite: its cases (the single-process kernels, each strategy,
DeepSpeed's own Ulysses, the no-communication "halves" bound) built once per rank and timed at every
length in the harness's interleaved rounds, with the bytes each saves for backward; then the longest
sequence in a memory budget and the LASP kernel pieces. A "single" case runs on rank 0 only (one thread,
the whole sequence) while the other ranks wait in the next barrier; DeepSpeed's collectives bypass
CommStats, so its bytes are not measured. attention.py drives it, attention_rows.py turns it into rows.
"""
from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from .harness import (LINEAR, SOFTMAX, SP_KEYS, ULYSSES_CHUNKED, alone, attention_inputs, fwd_bwd, interleaved_rounds,
                      on_rank0, saved_bytes, strategy_config)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


class Case(NamedTuple):
    """How a case of the vocabulary runs. runner: "single" (rank 0, whole sequence), "sp" (our strategy,
    harness.strategy_config), "deepspeed" (deepspeed.sequence.layer.DistributedAttention), "local" (every
    rank runs the single-process kernel on its own N/P tokens and exchanges nothing: not attention over the
    sequence, but the bound no exact scheme beats on this machine, since ranks running at once share
    caches and memory bandwidth)."""

    attention: str                                   # softmax | linear
    runner: str


# in the pages' order: each family's baseline first
CASES: Dict[str, Case] = {"single": Case("softmax", "single"),
                          **{name: Case("softmax", "sp")
                             for name in SOFTMAX + ("zigzag_no_overlap", "hybrid") + ULYSSES_CHUNKED},
                          "ds_ulysses": Case("softmax", "deepspeed"), "single_linear": Case("linear", "single"),
                          **{name: Case("linear", "sp") for name in LINEAR}, "halves": Case("linear", "local")}
BASELINE = {"softmax": "single", "linear": "single_linear"}


@dataclass(frozen=True)
class BenchSpec:
    """What every rank needs to build the same cases (picklable: it travels to the ranks)."""

    world: int
    cases: Tuple[str, ...]
    batch: int = 1
    heads: int = 8
    kv_heads: int = 8
    head_dim: int = 64
    dtype: str = "fp32"
    causal: bool = True
    backend: str = "torch"
    device: str = "cpu"
    decay: bool = True              # linear attention: the small LM's per-head decay
    warmup: int = 1
    repeats: int = 5
    lasp_breakdown: bool = False    # kernel work per LASP rank position (lasp_pieces), rank 0 alone


class RankCases:
    """The attend function, shards and CommStats of every selected case on this rank, built once (process
    groups are collective to create, so all SequenceParallel objects live for the whole measurement)."""

    def __init__(self, spec: BenchSpec):
        from .. import comm
        from ..kernels import get_kernel
        from ..models.lm import head_decay
        from ..sequence_parallel import SequenceParallel
        self.spec, self.rank = spec, comm.global_rank()
        self.device = torch.device(spec.device, int(os.environ.get("LOCAL_RANK", 0))) \
            if spec.device == "cuda" else torch.device("cpu")
        self.dtype = DTYPES[spec.dtype]
        self.kernel = get_kernel(spec.backend, self.device)
        self.decay = head_decay(spec.heads, self.device) if spec.decay else None
        self.sps = {name: SequenceParallel(strategy_config(name, spec.world, spec.backend), device=self.device)
                    for name in spec.cases if CASES[name].runner == "sp"}
        self.ds_attn = self._deepspeed_ulysses() if "ds_ulysses" in spec.cases else None

    def _deepspeed_ulysses(self) -> Callable:
        """DeepSpeed's Ulysses around the same local kernel, on the group of our Ulysses."""
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention
        from .. import comm
        from ..kernels import local_attention
        from ..sequence_parallel import SequenceParallel
        deepspeed.init_distributed(dist_backend=comm.backend_name())     # adopt the running world
        group = SequenceParallel(strategy_config("ds_ulysses", self.spec.world), device=self.device).group
        causal, kernel, scale = self.spec.causal, self.kernel, self.spec.head_dim ** -0.5

        def local(q, k, v, *args, **kwargs):                  # [b, N, H/P, d] head-sharded, whole sequence
            return local_attention(q, k, v, kernel, causal, scale)

        # bshd tensors: scatter heads (dim 2), gather the sequence (dim 1), batch first
        return DistributedAttention(local, group, scatter_idx=2, gather_idx=1)

    def attend(self, name: str) -> Callable:
        """q, k, v (this case's shards) -> output, differentiable."""
        from ..kernels import local_attention
        from ..kernels.linear import linear_attention
        case, causal, scale = CASES[name], self.spec.causal, self.spec.head_dim ** -0.5
        if case.runner == "deepspeed":
            return lambda q, k, v: self.ds_attn(q, k, v, 0)
        sp = self.sps.get(name)
        if sp is not None:
            if case.attention == "linear":
                return lambda q, k, v: sp.linear_attention(q, k, v, self.decay)
            return lambda q, k, v: sp.attention(q, k, v, causal=causal)
        if case.attention == "linear":                            # single_linear, halves
            return lambda q, k, v: linear_attention(q, k, v, self.decay)
        return lambda q, k, v: local_attention(q, k, v, self.kernel, causal, scale)

    def inputs(self, name: str, seq: int, seed: int = 0) -> Optional[List[torch.Tensor]]:
        """This rank's q, k, v, dout for the case (None: the case does not run on this rank)."""
        s = self.spec
        full = attention_inputs(seq, s.heads, s.head_dim, s.kv_heads, s.batch, self.dtype, self.device, seed)
        if CASES[name].runner == "single":
            return full if self.rank == 0 else None
        # clone: a shard may be a view of the global tensor, whose whole storage would then count as
        # this rank's saved memory; a rank of a real run holds only its own tokens
        if name in self.sps:
            return [self.sps[name].shard(t).clone() for t in full]
        return [t.chunk(s.world, dim=1)[self.rank].clone() for t in full]      # DeepSpeed, halves: contiguous


# ---------------------------------------------------------------------------------------------
# what the ranks run


def run_rank(spec: BenchSpec, seq_lens: List[int], budget_n: Optional[int]) -> Dict[str, Any]:
    """What every rank runs: timing and memory at each length, then the longest-sequence search."""
    cases = RankCases(spec)
    out = measure(cases, seq_lens)
    if budget_n:
        out["max_seq"] = max_seq_search(cases, budget_n)
    if spec.lasp_breakdown:
        out["lasp_breakdown"] = on_rank0(lasp_breakdown, cases, max(seq_lens))
    return out


def lasp_breakdown(cases: "RankCases", seq: int) -> Dict[str, Any]:
    """Where a LASP rank's time goes without the transfers: the kernel work of one fwd+bwd at the local
    length seq / P per rank position (lasp_pieces), median CPU seconds (rank 0 alone, after the rounds)."""
    spec, local = cases.spec, seq // cases.spec.world
    q, k, v, dout = attention_inputs(local, spec.heads, spec.head_dim, spec.kv_heads, spec.batch, cases.dtype,
                                     cases.device)
    times = alone(lasp_pieces(q, k, v, dout, cases.decay), 3 * spec.repeats, device=spec.device)
    return {"local_len": local, "cpu_s": {name: statistics.median(t) for name, t in times.items()}}


def lasp_rank(q, k, v, dout, decay_h, state_in: Optional[torch.Tensor], dstate_local: Optional[torch.Tensor],
              send_own: bool, chunk: int = 64) -> None:
    """The kernel calls of one LASP rank's forward + backward (strategies/lasp.py, in its order, with its
    chunk), without the transfers."""
    from ..kernels import linear as la
    fwd = la.forward_begin(q, k, v, decay_h, chunk)
    if send_own:
        la.forward_states(fwd)
    if state_in is not None:
        la.forward_diagonal(fwd)
        la.forward_states(fwd, state_in)
    la.forward_finish(fwd)
    bwd = la.backward_begin(dout, q, k, v, decay_h, chunk, state_in)
    la.backward_local(bwd)
    la.backward_finish(bwd, dstate_local)


def lasp_pieces(q, k, v, dout, decay_h, chunk: int = 64) -> Dict[str, Callable[[], None]]:
    """Label -> the kernel work of that rank position. No states is what the "halves" case runs on every
    rank; rank 0 sends its state and receives its gradient, the last rank the other way round, a middle
    rank (all-gather) both: work the single process never does."""
    from ..kernels import linear as la
    state = la.intra_forward(q, k, v, decay_h, chunk)[1]
    return {
        "no states (intra_forward + intra_backward)":
            lambda: (la.intra_forward(q, k, v, decay_h, chunk), la.intra_backward(dout, q, k, v, decay_h, chunk)),
        "first rank (state_local out, dstate_local in)": lambda: lasp_rank(q, k, v, dout, decay_h, None, state, True),
        "middle rank, allgather (both)": lambda: lasp_rank(q, k, v, dout, decay_h, state, state, True),
        "last rank (state_in in, dstate_in out)": lambda: lasp_rank(q, k, v, dout, decay_h, state, None, False),
    }


def measure(cases: "RankCases", seq_lens: List[int]) -> Dict[str, Dict[str, Any]]:
    """Every case at every length on this rank, keyed "case/N": the interleaved timing rounds and the bytes
    saved for backward; and per length the 1-minute load as its rounds end (a neighbour's burst shows)."""
    from .. import comm
    out: Dict[str, Dict[str, Any]] = {"rounds": {}, "saved_bytes": {}, "load_1min": {}}
    for seq in seq_lens:
        shards = {name: cases.inputs(name, seq) for name in cases.spec.cases}
        fns = {(name, seq): (None if x is None else (lambda a=cases.attend(name), x=x: fwd_bwd(a, *x)),
                             cases.sps[name].stats if name in cases.sps else None) for name, x in shards.items()}
        out["rounds"].update(interleaved_rounds(fns, cases.spec.warmup, cases.spec.repeats, cases.spec.device))
        out["saved_bytes"].update({f"{name}/{seq}": _saved(cases, name, x) for name, x in shards.items()})
        out["load_1min"][seq] = os.getloadavg()[0]
        del shards, fns
    comm.barrier()
    return out


def _saved(cases: RankCases, name: str, shard) -> Optional[int]:
    if shard is None:
        return None
    q, k, v = (t.detach().requires_grad_() for t in shard[:3])
    return saved_bytes(lambda: cases.attend(name)(q, k, v))


def max_seq_search(cases: RankCases, budget_n: int) -> Dict[str, Dict[str, int]]:
    """Per case, the longest global length (a multiple of ``step``) whose saved bytes on the
    fullest rank fit the budget = what the case's single-process baseline saves at ``budget_n``.
    Forward only. Exponential then binary search; every rank takes the same decisions (the probe
    is the max over ranks), so the collectives line up."""
    from .. import comm
    spec = cases.spec
    # every layout's divisor (zigzag: 2P chunks, the hybrid: times U) and no finer than 64 tokens, so a
    # search costs ~2 log2(N / 64) forward passes
    step = math.lcm(64, *(2 * spec.world * SP_KEYS.get(n, {}).get("ulysses_size", 1) for n in spec.cases))
    budgets = {}
    for base in ("single", "single_linear"):
        if base in spec.cases and cases.rank == 0:
            budgets[base] = _probe(cases, base, budget_n)
    budgets = comm.gather_object(budgets)[0]          # rank 0's numbers, to every rank
    out = {}
    for name in spec.cases:
        budget = budgets.get(BASELINE[CASES[name].attention])
        if budget is None or CASES[name].runner == "local" or (CASES[name].runner == "single" and cases.rank != 0):
            continue
        fits = lambda n, name=name, budget=budget: _probe(cases, name, n) <= budget  # noqa: E731
        out[name] = {"max_seq": _largest(fits, step, limit=4 * spec.world * budget_n), "budget_bytes": budget,
                     "step": step}
    comm.barrier()
    return out


def _probe(cases: RankCases, name: str, seq: int) -> int:
    """Saved bytes of the fullest rank at global length ``seq`` (single cases: rank 0 alone)."""
    from .. import comm
    mine = _saved(cases, name, cases.inputs(name, seq, seed=1))
    if CASES[name].runner == "single":
        return mine
    worst = torch.tensor([float(mine)], dtype=torch.float64, device=cases.device)     # nccl: on the GPU
    return int(comm.all_reduce(worst, cases.sps[name].group if name in cases.sps else None, op="max").item())


def _largest(fits: Callable[[int], bool], step: int, limit: int) -> int:
    """Largest k*step <= limit with fits(k*step), assuming fits is monotone (saved bytes grow with
    N). The limit (4x the ideal answer) keeps a case that saves nothing from probing forever."""
    if not fits(step):
        return 0
    lo, hi = 1, 2
    while hi * step <= limit and fits(hi * step):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step
