"""torch.compile(fullgraph=True) of modules that call sp.attention (every softmax strategy, window, softcap,
sinks, packed documents as a tensor and as a list, GQA): output, input gradient and EVERY parameter's
gradient (the projections before the attention included) equal a single-process dense reference within
the derived tolerance, eager and compiled alike, and the compiled run counts the same bytes and calls
in sp.stats as the eager one.

Backends (docs/compile.md): the sweep runs under "aot_eager", which traces forward and backward through
the ops' fake and autograd registrations (where a compiled graph can go wrong) without inductor's C++
builds, which cost minutes on this CPU with every rank compiling at once; one case per size runs under
"inductor".
"""
import copy

import pytest
import torch
from torch import nn

from ds_seqpar import SequenceParallel

from ..reference import assert_derived_close, dense_attention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ = 16, 4, 2, 8, 64
BOUNDS = [0, 11, 40, 64]
SCALE = HEAD_DIM ** -0.5
# the attention calls of one block, in order: every mask and score option once per compiled graph
LAYERS = (dict(causal=True), dict(causal=False, window=5, softcap=3.0, sinks=True),
          dict(causal=True, window=6, docs="tensor"), dict(causal=False, docs="list", sinks=True, softcap=2.0))


class Block(nn.Module):
    """Projections -> attention -> output projection, residual, once per entry of ``layers``."""

    def __init__(self, attend, layers=LAYERS):
        super().__init__()
        torch.manual_seed(0)
        self.wq = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.wk = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.wv = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM)
        self.wo = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.sinks = nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))
        self.attend, self.layers = attend, layers

    def forward(self, x, cu):
        b, n, _ = x.shape
        for o in self.layers:
            q = self.wq(x).view(b, n, HEADS, HEAD_DIM)
            k = self.wk(x).view(b, n, KV_HEADS, HEAD_DIM)
            v = self.wv(x).view(b, n, KV_HEADS, HEAD_DIM)
            a = self.attend(q, k, v, causal=o["causal"], window=o.get("window"), softcap=o.get("softcap"),
                            sinks=self.sinks if o.get("sinks") else None,
                            cu_seqlens={"tensor": cu, "list": BOUNDS}.get(o.get("docs")))
            x = x + self.wo(a.reshape(b, n, HEADS * HEAD_DIM))
        return x


def _dense(q, k, v, causal, window, softcap, sinks, cu_seqlens):
    return dense_attention(q, k, v, causal, SCALE, window, softcap, sinks, None if cu_seqlens is None else BOUNDS)


def run_block(module, x, dout, cu, backend=None):
    """(out, dx, {name: grad}) of one forward + backward, compiled with fullgraph under ``backend``."""
    module.zero_grad()
    run = module
    if backend is not None:
        torch._dynamo.reset()
        run = torch.compile(module, backend=backend, fullgraph=True)
    x = x.detach().requires_grad_()
    out = run(x, cu)
    out.backward(dout)
    return out.detach(), x.grad, {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                  for n, p in module.named_parameters()}


def dense_reference(x, dout):
    """(float64, float32) runs of the block over the whole sequence on one process."""
    runs = []
    for dtype in (torch.float64, torch.float32):
        module = Block(_dense).to(dtype)
        runs.append(run_block(module, x.to(dtype), dout.to(dtype), torch.tensor(BOUNDS)))
    return runs


def check_against(case, sp, got, ref64, plain):
    """Sharded output and input gradient; parameter gradients summed over the sequence group."""
    out, dx, grads = got
    for name, g, r, p in (("out", out, ref64[0], plain[0]), ("dx", dx, ref64[1], plain[1])):
        assert g is not None, f"{case}: no {name}"
        assert_derived_close(f"{case} {name}", g, sp.shard(r), sp.shard(p))
    for name, g in grads.items():
        total = g.clone()
        torch.distributed.all_reduce(total, group=sp.group)
        assert_derived_close(f"{case} d{name}", total, ref64[2][name], plain[2][name])


def _stats(sp):
    return {k: (v["bytes"], v["calls"]) for k, v in sp.stats.as_dict().items()}


def _compiled_attention(cfgs, backend):
    g = torch.Generator().manual_seed(7)
    x, dout = torch.randn(1, SEQ, HIDDEN, generator=g), torch.randn(1, SEQ, HIDDEN, generator=g)
    ref64, plain = dense_reference(x, dout)
    done = []
    for cfg in cfgs:
        sp = SequenceParallel(cfg)
        module = Block(sp.attention)
        cu = torch.tensor(BOUNDS)
        x_l, dout_l = sp.shard(x), sp.shard(dout)
        got = run_block(module, x_l, dout_l, cu)           # eager; also agrees the documents once
        check_against(f"{cfg} eager rank {sp.rank}", sp, got, ref64, plain)
        sp.stats.reset()
        got = run_block(module, x_l, dout_l, cu, backend)
        check_against(f"{cfg} {backend} rank {sp.rank}", sp, got, ref64, plain)
        compiled, _ = _stats(sp), sp.stats.reset()
        run_block(module, x_l, dout_l, cu)
        assert compiled == _stats(sp), f"{cfg}: compiled sp.stats {compiled} != eager {_stats(sp)}"
        assert compiled, f"{cfg}: nothing counted"
        done.append(cfg["strategy"])
    return done


SWEEP = {2: [{"strategy": s, "size": 2} for s in ("ulysses", "ring", "zigzag", "striped")],
         4: [{"strategy": s, "size": 4} for s in ("ulysses", "ring", "zigzag", "striped")]
         + [{"strategy": "zigzag", "size": 4, "ulysses_size": 2}, {"strategy": "ring", "size": 4, "overlap": False}]}


@pytest.mark.parametrize("size", [2, 4])
def test_attention_compiles_fullgraph_and_matches_dense_reference(pool, size):
    for done in pool.run(_compiled_attention, SWEEP[size], "aot_eager"):
        assert done == [c["strategy"] for c in SWEEP[size]]
