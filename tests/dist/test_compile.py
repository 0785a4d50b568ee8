"""torch.compile(fullgraph=True) of modules that call sp.attention (every softmax strategy and the 2D hybrid;
window, softcap, sinks, packed documents as a tensor and as a list, causal and not, GQA) and
sp.linear_attention (LASP allgather, ring and allscan; decay, packed documents): the output, the input's gradient
and EVERY parameter's gradient (the projections before the attention included) equal a single-process
dense reference within the derived tolerance, eager and compiled alike, and the compiled run counts the
same bytes and calls in sp.stats as the eager one.

Backends (docs/compile.md): the sweep runs under "aot_eager", which traces forward and backward through
the ops' fake and autograd registrations (where a compiled graph can go wrong) without inductor's C++
builds, which cost minutes on this CPU with every rank compiling at once; one module per size runs
under "inductor", shaped so that inductor builds no C++ kernel (bias-free projection, no pointwise op
around the ops): its graph is the ops and matmuls.
"""
import pytest
import torch
from torch import nn

from ds_seqpar import SequenceParallel, ops
from ds_seqpar.kernels.linear.naive import linear_attention_reference

from ..dist_checks import assert_each_config_checked, first_group_results, first_group_runs, group_shares
from ..reference import assert_derived_close, dense_attention
from .test_lasp import scan_blocks_of

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ = 16, 4, 2, 8, 64
BOUNDS = [0, 11, 40, 64]
SCALE = HEAD_DIM ** -0.5
# compiled vs eager where both run the same operations (only the order of a few sums may differ): x the
# eager tensor's largest entry
REL = 1e-5
# the attention calls of one block, in order: every mask and score option in one compiled graph
LAYERS = (dict(causal=True), dict(causal=False, window=5, softcap=3.0, sinks=True, docs="tensor"),
          dict(causal=True, window=6, softcap=2.0, sinks=True, docs="list"))
LINEAR_LAYERS = (dict(docs="list"), dict(decay=True, docs="tensor"), dict(decay=True))
DECAY = torch.tensor([0.9, 0.8, 0.95, 1.0])


def _docs(o, cu):
    return {"tensor": cu, "list": BOUNDS}.get(o.get("docs"))


class Block(nn.Module):
    """Projections -> attention -> output projection, residual, once per entry of ``layers``;
    ``linear``: sp.linear_attention's signature (decay, documents) instead of sp.attention's."""

    def __init__(self, attend, linear=False, kv_heads=KV_HEADS):
        super().__init__()
        torch.manual_seed(0)
        self.kv_heads = kv_heads
        self.wq = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.wk = nn.Linear(HIDDEN, kv_heads * HEAD_DIM)
        self.wv = nn.Linear(HIDDEN, kv_heads * HEAD_DIM)
        self.wo = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.sinks = nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))
        self.register_buffer("decay", DECAY.clone())
        self.attend, self.linear = attend, linear
        self.layers = LINEAR_LAYERS if linear else LAYERS

    def forward(self, x, cu):
        b, n, _ = x.shape
        for o in self.layers:
            q = self.wq(x).view(b, n, HEADS, HEAD_DIM)
            k = self.wk(x).view(b, n, self.kv_heads, HEAD_DIM)
            v = self.wv(x).view(b, n, self.kv_heads, HEAD_DIM)
            if self.linear:
                a = self.attend(q, k, v, decay=self.decay if o.get("decay") else None, cu_seqlens=_docs(o, cu))
            else:
                a = self.attend(q, k, v, causal=o["causal"], window=o.get("window"), softcap=o.get("softcap"),
                                sinks=self.sinks if o.get("sinks") else None, cu_seqlens=_docs(o, cu))
            x = x + self.wo(a.reshape(b, n, HEADS * HEAD_DIM))
        return x


def _dense(q, k, v, causal, window, softcap, sinks, cu_seqlens):
    return dense_attention(q, k, v, causal, SCALE, window, softcap, sinks, None if cu_seqlens is None else BOUNDS)


def _dense_linear(q, k, v, decay, cu_seqlens):
    bounds = [0, q.shape[1]] if cu_seqlens is None else BOUNDS
    return torch.cat([linear_attention_reference(q[:, a:b], k[:, a:b], v[:, a:b], decay)
                      for a, b in zip(bounds, bounds[1:])], dim=1)


def run_block(module, inputs, dout, backend=None):
    """(out, [input grads], {name: grad}) of one forward + backward, compiled with fullgraph under
    ``backend``; inputs: (tensors that get a gradient, *other arguments)."""
    module.zero_grad()
    run = module
    if backend is not None:
        torch._dynamo.reset()
        run = torch.compile(module, backend=backend, fullgraph=True)
    leaves = [t.detach().requires_grad_() for t in inputs[0]]
    out = run(*leaves, *inputs[1:])
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves], {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                                    for n, p in module.named_parameters()}


def check_against(case, sp, got, ref64, plain):
    """Sharded output and input gradients; parameter gradients summed over the sequence group."""
    out, dins, grads = got
    for name, g, r, p in [("out", out, ref64[0], plain[0])] + [(f"d_input{i}", g, r, p) for i, (g, r, p) in
                                                                enumerate(zip(dins, ref64[1], plain[1]))]:
        assert g is not None, f"{case}: no {name}"
        assert_derived_close(f"{case} {name}", g, sp.shard(r), sp.shard(p))
    for name, g in grads.items():
        total = g.clone()
        torch.distributed.all_reduce(total, group=sp.group)
        assert_derived_close(f"{case} d{name}", total, ref64[2][name], plain[2][name])


def _stats(sp):
    return {k: (v["bytes"], v["calls"]) for k, v in sp.stats.as_dict().items()}


def check_fakes(sp, linear, kv_heads=KV_HEADS):
    """Each op's fake against its real run (shapes, dtypes, strides: torch.library.opcheck), forward and
    backward, with documents, and sinks, window and softcap (softmax) or decay (linear)."""
    g = torch.Generator().manual_seed(5)
    n, cu, ops = SEQ // sp.size, torch.tensor(BOUNDS), torch.ops.ds_seqpar
    q = torch.randn(1, n, HEADS, HEAD_DIM, generator=g)
    k, v = (torch.randn(1, n, kv_heads, HEAD_DIM, generator=g) for _ in range(2))
    if linear:
        fwd, bwd, front, back = ops.linear_attention, ops.linear_attention_backward, (DECAY, cu, None), \
            (DECAY, cu, None, sp._handle)
        args = (q, k, v) + front + (sp._handle,)
        saved = lambda outs: (q, k, v, outs[1:])              # noqa: E731
    else:
        options = (cu, None, sp._handle, False, SCALE, None, 5, 3.0, None)      # ..., window, softcap, blocks
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
        fwd, bwd, args = ops.attention, ops.attention_backward, (q, k, v, sinks) + options
        saved = lambda outs: (q, k, v, sinks, outs[0], outs[1:])  # noqa: E731
        back = options
    outs = fwd(*args)
    for op, op_args in ((fwd, args), (bwd, (torch.randn_like(outs[0]),) + saved(outs) + back)):
        torch.library.opcheck(op, op_args, test_utils="test_faketensor")


def _compiled_blocks(cfgs, backend, linear, kv_heads=KV_HEADS):
    g = torch.Generator().manual_seed(7)
    x, dout = torch.randn(1, SEQ, HIDDEN, generator=g), torch.randn(1, SEQ, HIDDEN, generator=g)
    cu = torch.tensor(BOUNDS)
    ref64, plain = (run_block(Block(_dense_linear if linear else _dense, linear, kv_heads).to(dtype),
                              ([x.to(dtype)], cu), dout.to(dtype)) for dtype in (torch.float64, torch.float32))
    done = {}
    for i, cfg, sp in group_shares(cfgs):
        check_fakes(sp, linear, kv_heads)
        module = Block(sp.linear_attention if linear else sp.attention, linear, kv_heads)
        inputs, dout_l = ([sp.shard(x)], cu), sp.shard(dout)
        check_against(f"{cfg} eager rank {sp.rank}", sp, run_block(module, inputs, dout_l), ref64, plain)
        sp.stats.reset()                                   # the documents were agreed by the eager call
        got = run_block(module, inputs, dout_l, backend)
        check_against(f"{cfg} {backend} rank {sp.rank}", sp, got, ref64, plain)
        compiled, _ = _stats(sp), sp.stats.reset()
        run_block(module, inputs, dout_l)
        assert compiled == _stats(sp), f"{cfg}: compiled sp.stats {compiled} != eager {_stats(sp)}"
        assert compiled, f"{cfg}: nothing counted"
        done[i] = 1
    return done


SWEEP = {2: [{"strategy": s, "size": 2} for s in ("ulysses", "ring", "zigzag", "striped")],
         4: [{"strategy": s, "size": 4} for s in ("ulysses", "ring", "zigzag", "striped")]
         + [{"strategy": "zigzag", "size": 4, "ulysses_size": 2}]}
LINEAR_SWEEP = {p: [{"strategy": "lasp", "size": p, "lasp_comm": c} for c in ("allgather", "ring", "allscan")] for p in (2, 4)}


@pytest.mark.parametrize("size", [2, 4])
def test_attention_compiles_fullgraph_and_matches_dense_reference(pool, size):
    assert_each_config_checked(pool.run(_compiled_blocks, SWEEP[size], "aot_eager", False), SWEEP[size], 1)


# Ulysses in head chunks (the hybrid's Ulysses half at 4 ranks): with 4 k/v heads a rank of a Ulysses group
# of 2 holds 2, so two chunks, each chunk's all-to-all posted inside the one opaque op
CHUNKED = {2: [{"strategy": "ulysses", "size": 2, "ulysses_chunks": 2}],
           4: [{"strategy": "zigzag", "size": 4, "ulysses_size": 2, "ulysses_chunks": 2}]}


@pytest.mark.parametrize("size", [2, 4])
def test_ulysses_head_chunks_compile_fullgraph_and_match_dense_reference(pool, size):
    assert_each_config_checked(pool.run(_compiled_blocks, CHUNKED[size], "aot_eager", False, HEADS), CHUNKED[size], 1)


@pytest.mark.parametrize("size", [2, 4])
def test_linear_attention_compiles_fullgraph_and_matches_reference(pool, size):
    assert_each_config_checked(pool.run(scan_blocks_of, _compiled_blocks, LINEAR_SWEEP[size], "aot_eager", True),
                               LINEAR_SWEEP[size], 1)


# -- inductor: one module per size, both ops in one graph ------------------------------------------


class Both(nn.Module):
    """A bias-free q projection, then sp.attention (window, documents) and sp.linear_attention (decay)."""

    def __init__(self, attend, linear):
        super().__init__()
        torch.manual_seed(1)
        self.wq = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.attend, self.linear = attend, linear

    def forward(self, x, k, v, cu):
        q = self.wq(x).view(x.shape[0], x.shape[1], HEADS, HEAD_DIM)
        soft = self.attend(q, k, v, causal=True, window=6, softcap=None, sinks=None, cu_seqlens=cu)
        return soft, self.linear(q, k, v, decay=DECAY, cu_seqlens=None)


def _run_both(module, x, k, v, cu, douts, backend=None):
    class Summed(nn.Module):          # one output for run_block: the two outputs against their upstream grads
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, x, k, v, cu):
            soft, lin = self.inner(x, k, v, cu)
            return torch.cat([soft, lin], dim=-1)
    return run_block(Summed(), ([x, k, v], cu), torch.cat(douts, dim=-1), backend)


def _inductor(cfg):
    torch._inductor.config.compile_threads = 1            # no compile workers: the ranks share two cores
    sp, lasp = SequenceParallel(cfg), SequenceParallel({"strategy": "lasp", "size": cfg["size"]})
    if not first_group_runs(sp):
        return None
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, SEQ, HIDDEN, generator=g)
    k, v = (torch.randn(1, SEQ, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    douts = [torch.randn(1, SEQ, HEADS, HEAD_DIM, generator=g) for _ in range(2)]
    cu = torch.tensor(BOUNDS)
    ref64, plain = (_run_both(Both(_dense, _dense_linear).to(dtype), x.to(dtype), k.to(dtype), v.to(dtype), cu,
                              [d.to(dtype) for d in douts]) for dtype in (torch.float64, torch.float32))
    local = [sp.shard(t) for t in (x, k, v)] + [cu, [sp.shard(d) for d in douts]]
    got = _run_both(Both(sp.attention, lasp.linear_attention), *local, backend="inductor")
    check_against(f"{cfg} inductor rank {sp.rank}", sp, got, ref64, plain)
    return cfg["strategy"]


# contiguous layouts: the LASP shards are the softmax strategy's
@pytest.mark.parametrize("cfg", [{"strategy": "ring", "size": 2}, {"strategy": "ulysses", "size": 4}])
def test_inductor_compiles_both_ops_fullgraph(pool, cfg):
    assert first_group_results(pool.run(_inductor, cfg), cfg["size"]) == [cfg["strategy"]] * cfg["size"]


def _one_graph_several_sps():
    """One compiled function called with the SequenceParallel as an argument, several of them in turn (as
    the dynamic mode's groups, or two models): each call equals its eager call. Dynamo recompiles for a
    new object; the op must still find it (a changed int handle would turn into a SymInt)."""
    f = torch.compile(lambda sp, q, k, v: sp.attention(q, k, v, causal=True), backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, SEQ, HEADS, HEAD_DIM, generator=g) for _ in range(3))
    done = []
    for cfg in ({"strategy": "ring", "size": 2}, {"strategy": "zigzag", "size": 4}, {"strategy": "ulysses", "size": 2}):
        sp = SequenceParallel(cfg)
        local = [sp.shard(t) for t in (q, k, v)]
        assert torch.equal(f(sp, *local), sp.attention(*local, causal=True)), cfg
        done.append(cfg["strategy"])
    return done


def test_one_compiled_function_serves_several_sequence_parallel_objects(pool):
    assert pool.run(_one_graph_several_sps) == [["ring", "zigzag", "ulysses"]] * 4


# -- the collectives outside attention: sp.loss, sp.loss_from_hidden, sp.unshard --------------------------


def _collectives(cfg):
    """sp.loss, sp.loss_from_hidden (the head fused in, chunks of 8 tokens) and sp.unshard (then a product
    with an upstream tensor) compiled with fullgraph=True under aot_eager: each value and the gradients of
    the hidden states and of the head equal the eager run's, with the same sp.stats; the gathered tensor
    equals the global one. Then the gather and its dual pass torch.library.opcheck."""
    sp = SequenceParallel(cfg)
    if not first_group_runs(sp):
        return None
    g = torch.Generator().manual_seed(13)
    hidden, head = torch.randn(1, SEQ, HIDDEN, generator=g), torch.randn(24, HIDDEN, generator=g)
    labels = torch.randint(0, 24, (1, SEQ), generator=g)
    labels[0, ::5] = -100
    upstream = torch.randn(1, SEQ, 24, generator=g)
    h, y = sp.shard(hidden), sp.shard(labels)
    calls = {"loss": lambda h, w: sp.loss(h @ w.t(), y, grad_scale=1.0),
             "loss_from_hidden": lambda h, w: sp.loss_from_hidden(h, w, y, chunk_tokens=8, grad_scale=1.0),
             "unshard": lambda h, w: (sp.unshard(h @ w.t()) * upstream).sum()}
    for name, fn in calls.items():
        runs = []
        for backend in (None, "aot_eager"):
            torch._dynamo.reset()
            run = fn if backend is None else torch.compile(fn, backend=backend, fullgraph=True)
            leaves = [h.clone().requires_grad_(), head.clone().requires_grad_()]
            sp.stats.reset()
            value = run(*leaves)
            value.backward()
            runs.append(([value.detach()] + [t.grad for t in leaves], dict(sp.stats.bytes), dict(sp.stats.calls)))
        (eager, *eager_stats), (got, *got_stats) = runs
        assert got_stats == eager_stats and eager_stats[1], (name, got_stats, eager_stats)
        for what, a, b in zip(("value", "d hidden", "d head"), got, eager):
            torch.testing.assert_close(a, b, rtol=0, atol=REL * b.abs().max().item(), msg=f"{name} {what}")
    assert torch.equal(sp.unshard(sp.shard(hidden)), hidden)
    gathered = torch.ops.ds_seqpar.all_gather(h, 1, *(ops.handle(o) for o in (sp.group, sp.stats)), "unshard")
    for op, args in ((torch.ops.ds_seqpar.all_gather, (h.clone().requires_grad_(), 1)),
                     (torch.ops.ds_seqpar.reduce_scatter, (torch.randn_like(gathered), 1))):
        torch.library.opcheck(op, args + tuple(ops.handle(o) for o in (sp.group, sp.stats)) + ("unshard",),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    return sorted(calls)


@pytest.mark.parametrize("size", [2, 4])
def test_loss_and_unshard_compile_fullgraph_as_eager(pool, size):
    assert first_group_results(pool.run(_collectives, {"strategy": "zigzag", "size": size}), size) == \
        [["loss", "loss_from_hidden", "unshard"]] * size
