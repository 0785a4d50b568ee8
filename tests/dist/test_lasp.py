"""LASP (strategy 'lasp', sp.linear_attention) on 4 CPU gloo ranks: exactness against single-process
linear attention, bytes against the closed forms (and their independence of the sequence length),
overlap on/off bit-identical, and clear errors before any communication.

Size 2 on the 4-rank pool is two sequence groups of 2 ranks (dp=2), both checking their results.
"""
import pytest
import torch

from ds_seqpar import SequenceParallel
from ds_seqpar.kernels.linear import forward_begin, forward_states, intra_forward, linear_attention_reference
from ds_seqpar.models.lm import Attention, ModelConfig
from ds_seqpar.strategies.closed_form import Shapes, closed_form_by_kind

from ..reference import assert_derived_close

# 320 tokens: 160 per rank at size 2 (2.5 chunks of 64), 80 at size 4 (1.25 chunks): several chunks
# per rank, a front-padded one, and states crossing ranks. Dv != Dk catches transposed states.
SEQ, BATCH, DK, DV = 320, 2, 16, 12
DECAY = torch.tensor([0.9, 0.95, 0.99, 1.0])       # per q head; 1.0: a head without decay
# (decay, q heads, kv heads): with and without decay, MHA and GQA with kv heads 2 and 1
CASES = [(d, 4, hkv) for d in (False, True) for hkv in (4, 2, 1)]
MODES = ("ring", "allgather", "allscan")


def scan_blocks_of(fn, *args, blocks=5):
    """fn(*args) with All-Scan cutting even these tiny states into up to ``blocks`` blocks past P = 2
    (its rule would send them whole: they are far below a link's latency-bandwidth product), so the
    pipelined path, uneven blocks included (12 columns in 5: 3, 3, 2, 2, 2), is what runs."""
    from ds_seqpar.strategies.lasp_comm import allscan
    saved = allscan.LINK_BYTES, allscan.MAX_SCAN_BLOCKS
    allscan.LINK_BYTES, allscan.MAX_SCAN_BLOCKS = 1, blocks
    try:
        return fn(*args)
    finally:
        allscan.LINK_BYTES, allscan.MAX_SCAN_BLOCKS = saved


def lasp_inputs(seed, seq_len, heads, kv_heads):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, seq_len, heads, DK, generator=g) / DK ** 0.5
    k = torch.randn(BATCH, seq_len, kv_heads, DK, generator=g) / DK ** 0.5
    v = torch.randn(BATCH, seq_len, kv_heads, DV, generator=g)
    do = torch.randn(BATCH, seq_len, heads, DV, generator=g)
    return q, k, v, do


def reference_with_grads(q, k, v, do, decay, dtype):
    """(o, dq, dk, dv) of the plain quadratic form on the whole sequence, computed in ``dtype``."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    o = linear_attention_reference(*leaves, None if decay is None else decay.to(dtype))
    return (o.detach(), *torch.autograd.grad(o, leaves, do.to(dtype)))


def lasp_with_grads(sp, q, k, v, do, decay):
    q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
    o_l = sp.linear_attention(q_l, k_l, v_l, decay=decay)
    o_l.backward(sp.shard(do))
    return o_l.detach(), q_l.grad, k_l.grad, v_l.grad


def _check_exact(size):
    """Every mode x case: output and dq, dk, dv within the derived bound of the fp64 reference,
    and overlap off bit-identical to overlap on. Returns the names of the cases checked."""
    sps = {(mode, overlap): SequenceParallel({"strategy": "lasp", "size": size, "lasp_comm": mode,
                                              "overlap": overlap})
           for mode in MODES for overlap in (True, False)}
    checked = []
    for use_decay, heads, kv_heads in CASES:
        decay = DECAY if use_decay else None
        q, k, v, do = lasp_inputs(len(checked), SEQ, heads, kv_heads)
        ref64 = reference_with_grads(q, k, v, do, decay, torch.float64)
        plain = reference_with_grads(q, k, v, do, decay, torch.float32)
        for mode in MODES:
            sp = sps[mode, True]
            got = lasp_with_grads(sp, q, k, v, do, decay)
            case = f"lasp size={size} {mode} decay={use_decay} heads={heads} kv_heads={kv_heads} sp_rank={sp.rank}"
            for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, ref64, plain):
                assert g is not None, f"{case}: no gradient for {name}"
                assert_derived_close(f"{case} {name}", g, sp.shard(r), sp.shard(p))
            serial = lasp_with_grads(sps[mode, False], q, k, v, do, decay)
            for name, g, s in zip(("out", "dq", "dk", "dv"), got, serial):
                assert torch.equal(g, s), f"{case} {name}: overlap off differs from overlap on"
            checked.append(case)
    return checked


@pytest.mark.parametrize("size", [2, 4])
def test_lasp_matches_single_process(pool, size):
    for counts in pool.run(scan_blocks_of, _check_exact, size):
        assert len(counts) == len(CASES) * len(MODES), counts


# -- bytes ------------------------------------------------------------------------------------


def _bytes_sent(size, heads, kv_heads):
    """{(mode, seq_len): bytes per kind} on this rank, at SEQ and 2*SEQ."""
    out = {}
    for mode in MODES:
        sp = SequenceParallel({"strategy": "lasp", "size": size, "lasp_comm": mode})
        for seq_len in (SEQ, 2 * SEQ):
            q, k, v, do = lasp_inputs(5, seq_len, heads, kv_heads)
            sp.stats.reset()
            lasp_with_grads(sp, q, k, v, do, DECAY[:heads])
            out[mode, seq_len] = {kind: sent for kind, sent in sp.stats.bytes.items() if sent}
            out[mode, "calls"] = {kind: sp.stats.calls[kind] for kind in ("lasp_state", "lasp_dstate")}
    return sp.rank, out


@pytest.mark.parametrize("size", [2, 4])
def test_lasp_bytes_match_closed_form_and_do_not_grow_with_length(pool, size):
    heads = 4
    for kv_heads in (4, 1):                  # states are per q head: GQA sends as much as MHA
        for rank, sent in pool.run(scan_blocks_of, _bytes_sent, size, heads, kv_heads):
            for mode in MODES:
                want = closed_form_by_kind("lasp", size, Shapes(BATCH, SEQ, heads, kv_heads, DK, 4, v_head_dim=DV),
                                           rank=rank, lasp_comm=mode)
                what = f"lasp {mode} size={size} kv_heads={kv_heads} sp_rank {rank}"
                assert sent[mode, SEQ] == want, f"{what}: sent {sent[mode, SEQ]}, closed form {want}"
                assert sent[mode, 2 * SEQ] == sent[mode, SEQ], \
                    f"{what}: bytes changed when the sequence doubled: {sent[mode, SEQ]} -> {sent[mode, 2 * SEQ]}"
            # All-Scan posts the ring's sends and receives once per block: 5 blocks past P = 2 (scan_blocks_of)
            blocks = 5 if size > 2 else 1
            assert sent["allscan", "calls"] == {k: blocks * n for k, n in sent["ring", "calls"].items()}, \
                (size, rank, sent["allscan", "calls"], sent["ring", "calls"])


# -- errors before communication ---------------------------------------------------------------


def _errors(size):
    sp = SequenceParallel({"strategy": "lasp", "size": size})
    q = torch.randn(1, 8, 4, DK)
    attempts = {"attention": lambda: sp.attention(q, q, q),
                "decay requires grad": lambda: sp.linear_attention(q, q, q, DECAY.clone().requires_grad_()),
                "decay out of range": lambda: sp.linear_attention(q, q, q, torch.tensor([0.5, 1.0, 1.5, 0.9])),
                "decay shape": lambda: sp.linear_attention(q, q, q, DECAY[:2])}
    out = {}
    for name, attempt in attempts.items():
        sp.stats.reset()
        try:
            attempt()
            out[name] = ("no error", sp.stats.total_bytes)
        except ValueError as err:
            out[name] = (str(err), sp.stats.total_bytes)
    return out


def test_lasp_errors_are_clear_and_come_before_communication(pool):
    results = pool.run(_errors, 2)
    needles = {"attention": ["strategy='lasp'", "sp.linear_attention"], "decay requires grad": ["decay.detach()"],
               "decay out of range": ["(0, 1]"], "decay shape": ["shape [4]"]}
    for name, wanted in needles.items():
        msgs = {r[name] for r in results}
        assert len(msgs) == 1, f"{name}: ranks disagree: {msgs}"
        msg, sent = msgs.pop()
        assert all(n in msg for n in wanted), f"{name}: {msg}"
        assert sent == 0, f"{name}: {sent} bytes sent before the error"


# -- single process ----------------------------------------------------------------------------


@pytest.mark.parametrize("heads,kv_heads,use_decay", [(4, 4, True), (4, 2, False), (4, 1, True)])
def test_state_local_equals_the_intra_forward_state(heads, kv_heads, use_decay):
    """The state LASP sends before its intra work (the scan of forward_begin's chunk products) is the
    one intra_forward ends with."""
    q, k, v, _ = (t.double() for t in lasp_inputs(7, 150, heads, kv_heads))
    decay = DECAY.double() if use_decay else None
    want = intra_forward(q, k, v, decay)[1]
    got = forward_states(forward_begin(q, k, v, decay))
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12), \
        (got - want).abs().max().item()


class _RecordingSP:
    def linear_attention(self, q, k, v, decay=None):
        self.decay = decay
        return q


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")   # autocast meets RMSNorm
def test_model_passes_the_decay_uncast_in_bf16():
    """bf16 would round lambda = 1 - 2^-9 (head 4) to exactly 1.0; the kernel casts to fp32 itself."""
    sp = _RecordingSP()
    attn = Attention(ModelConfig(attention="linear", dim=80, n_heads=5), sp=sp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(torch.randn(1, 4, 80), torch.arange(4)[None])
    assert sp.decay.dtype == torch.float32 and bool((sp.decay < 1).all()), sp.decay


def test_decay_powers_flush_to_zero_instead_of_denormals():
    """lambda^(S-1-t) over a long block underflows; denormal weights made LASP's state terms 2-3x
    slower on CPU, so they are exact zeros (and normal powers are untouched)."""
    from ds_seqpar.kernels.linear.common import position_decay as _position_decay
    decay = torch.tensor([0.5, 1 - 2.0 ** -5])
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        pw = _position_decay(decay, torch.zeros(1, 4096, 2, 1, dtype=dtype), 0)
        tiny = torch.finfo(dtype).tiny
        assert not bool(((pw > 0) & (pw < tiny)).any()), f"{dtype}: denormal decay powers"
        exact = torch.exp(torch.arange(4096, dtype=torch.float64)[None, :, None] * decay.double().log()[:, None, None])
        normal = exact >= 2 * tiny
        # the fp32 exponent carries up to |4096 log lambda| * eps relative error; bf16 its own rounding
        rtol = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float64: 1e-12}[dtype]
        assert torch.allclose(pw[normal].double(), exact[normal], rtol=rtol, atol=0), f"{dtype}: normal powers changed"
