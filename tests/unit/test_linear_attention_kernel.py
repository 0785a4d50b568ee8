"""Single-process tests of the chunked linear-attention kernel (ds_seqpar/kernels/linear/).

Tolerances are derived, not guessed (tests/reference.py): the fp32 fast path's max error against the float64
reference may be at most K_TOL times the error of the plain fp32 reference against the same float64
reference, plus a floor of a few fp32 ulps of the result's scale (for results that come out exact).
"""
import pytest
import torch

from ds_seqpar.kernels.linear import (
    LinearAttentionFunction, backward_begin, backward_finish, backward_local, chunked_backward, chunked_forward,
    forward_begin, forward_diagonal, forward_finish, forward_states, intra_forward, linear_attention,
    linear_attention_reference, state_decay)

K_TOL = 8.0
ULPS = 4.0

# (heads, kv_heads, decay, seq, chunk): MHA and GQA (Hkv = 2, 1), with and without decay, seq
# lengths that are and are not a multiple of the chunk, and a chunk longer than the sequence
CASES = [
    (4, 4, False, 64, 16),
    (4, 4, True, 50, 16),
    (4, 2, False, 50, 16),
    (4, 2, True, 64, 16),
    (4, 1, True, 37, 8),
    (4, 1, False, 37, 8),
    (2, 2, True, 20, 64),
]
IDS = [f"h{h}-kv{hkv}-{'decay' if d else 'nodecay'}-s{s}-c{c}" for h, hkv, d, s, c in CASES]


def _inputs(heads, kv_heads, seq, seed, batch=2, dk=8, dv=12):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, dk, generator=gen, dtype=torch.float64) / dk ** 0.5
    k = torch.randn(batch, seq, kv_heads, dk, generator=gen, dtype=torch.float64) / dk ** 0.5
    v = torch.randn(batch, seq, kv_heads, dv, generator=gen, dtype=torch.float64)
    do = torch.randn(batch, seq, heads, dv, generator=gen, dtype=torch.float64)
    return q, k, v, do


def _decay(use, heads):
    return torch.linspace(0.9, 0.999, heads, dtype=torch.float64) if use else None


def _f32(*xs):
    return [None if x is None else x.float() for x in xs]


def _reference_state(k, v, decay, heads):
    """sum_s lambda^(S-1-s) k_s^T v_s per q head, written out plainly: [B, H, Dk, Dv]."""
    g = heads // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = k.shape[1]
    w = torch.ones(heads, s, dtype=k.dtype) if decay is None else \
        decay.to(k.dtype)[:, None] ** torch.arange(s - 1, -1, -1, dtype=k.dtype)
    return torch.einsum("bshk,hs,bshv->bhkv", k, w, v)


def _reference_grads(q, k, v, decay, do):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = linear_attention_reference(*leaves, None if decay is None else decay.to(q.dtype))
    return torch.autograd.grad(o, leaves, do)


def _assert_derived(name, fast32, ref32, ref64):
    err_fast = (fast32.double() - ref64).abs().max().item()
    err_ref = (ref32.double() - ref64).abs().max().item()
    floor = ULPS * torch.finfo(torch.float32).eps * ref64.abs().max().item()
    assert err_fast <= K_TOL * err_ref + floor, \
        f"{name}: fp32 fast-path error {err_fast:.3e} > {K_TOL} x fp32 reference error {err_ref:.3e} + {floor:.1e}"


def test_reference_matches_recurrence():
    """The quadratic reference equals the plain recurrence h_t = lambda h_{t-1} + k_t^T v_t, o_t = q_t h_t."""
    q, k, v, _ = _inputs(4, 2, 13, seed=1)
    decay = _decay(True, 4)
    k_r, v_r = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    state = torch.zeros(q.shape[0], 4, q.shape[-1], v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(q.shape[1]):
        state = decay.view(1, 4, 1, 1) * state + torch.einsum("bhk,bhv->bhkv", k_r[:, t], v_r[:, t])
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    err = (torch.stack(outs, 1) - linear_attention_reference(q, k, v, decay)).abs().max().item()
    assert err < 1e-12, f"quadratic reference differs from the recurrence by {err:.3e}"


@pytest.mark.parametrize("heads,kv_heads,use_decay,seq,chunk", CASES, ids=IDS)
def test_forward_and_state_match_reference(heads, kv_heads, use_decay, seq, chunk):
    q, k, v, _ = _inputs(heads, kv_heads, seq, seed=2)
    decay = _decay(use_decay, heads)
    o, state_local = chunked_forward(*_f32(q, k, v, decay), chunk)
    assert o.shape == (q.shape[0], seq, heads, v.shape[-1]) and o.dtype == torch.float32
    assert state_local.shape == (q.shape[0], heads, q.shape[-1], v.shape[-1]) and state_local.dtype == torch.float32
    _assert_derived("output", o, linear_attention_reference(*_f32(q, k, v, decay)),
                    linear_attention_reference(q, k, v, decay))
    _assert_derived("state_local", state_local, _reference_state(*_f32(k, v, decay), heads),
                    _reference_state(k, v, decay, heads))


@pytest.mark.parametrize("heads,kv_heads,use_decay,seq,chunk", CASES, ids=IDS)
def test_gradients_match_reference(heads, kv_heads, use_decay, seq, chunk):
    q, k, v, do = _inputs(heads, kv_heads, seq, seed=3)
    decay = _decay(use_decay, heads)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    o = linear_attention(*leaves, None if decay is None else decay.float(), chunk)
    fast = torch.autograd.grad(o, leaves, do.float())
    ref32 = _reference_grads(*_f32(q, k, v, decay, do))
    ref64 = _reference_grads(q, k, v, decay, do)
    for name, f, r32, r64 in zip(("dq", "dk", "dv"), fast, ref32, ref64):
        assert f.shape == r64.shape, f"{name}: shape {tuple(f.shape)} != {tuple(r64.shape)}"
        _assert_derived(name, f, r32, r64)


def _two_blocks(q, k, v, decay, do, chunk, split):
    """Run the kernel on [0, split) and [split, S) as two ranks would, passing states both ways."""
    halves = [(x[:, :split], x[:, split:]) for x in (q, k, v, do)]
    (q1, q2), (k1, k2), (v1, v2), (do1, do2) = halves
    o1, st1 = chunked_forward(q1, k1, v1, decay, chunk)
    o2, state_all = chunked_forward(q2, k2, v2, decay, chunk, state_in_bhkv=st1)   # the state after both
    # backward walks the blocks in reverse: block 2 hands the gradient of its state_in to block 1
    dq2, dk2, dv2, dst_in2 = chunked_backward(do2, q2, k2, v2, decay, chunk, state_in_bhkv=st1)
    dq1, dk1, dv1, dst_in1 = chunked_backward(do1, q1, k1, v1, decay, chunk, dstate_local_bhkv=dst_in2)
    assert dst_in1 is None, "the first block has no state_in, so no dstate_in"
    cat = [torch.cat(pair, 1) for pair in ((o1, o2), (dq1, dq2), (dk1, dk2), (dv1, dv2))]
    return cat, state_all


@pytest.mark.parametrize("heads,kv_heads,use_decay,seq,chunk",
                         [CASES[0], CASES[1], CASES[3], CASES[4], CASES[5]], ids=[IDS[i] for i in (0, 1, 3, 4, 5)])
def test_two_block_split_matches_whole_sequence(heads, kv_heads, use_decay, seq, chunk):
    q, k, v, do = _inputs(heads, kv_heads, seq, seed=4)
    decay = _decay(use_decay, heads)
    split = seq // 2 + 3                                  # neither half a multiple of the chunk
    (o, dq, dk, dv), state_all = _two_blocks(*_f32(q, k, v, decay, do), chunk, split)
    _assert_derived("split output", o, linear_attention_reference(*_f32(q, k, v, decay)),
                    linear_attention_reference(q, k, v, decay))
    _assert_derived("combined state", state_all, _reference_state(*_f32(k, v, decay), heads),
                    _reference_state(k, v, decay, heads))
    ref32 = _reference_grads(*_f32(q, k, v, decay, do))
    ref64 = _reference_grads(q, k, v, decay, do)
    for name, f, r32, r64 in zip(("split dq", "split dk", "split dv"), (dq, dk, dv), ref32, ref64):
        _assert_derived(name, f, r32, r64)


def _reference_block(q, k, v, decay, state_in, do, dstate_after):
    """Plain differentiable form of one block given the state before it: (o, state after the block,
    dq, dk, dv, dstate_in) with dstate_in the TOTAL gradient (through o and the state after)."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v, state_in)]
    q_, k_, v_, s_ = leaves
    heads, seq = q.shape[2], q.shape[1]
    pw = torch.ones(heads, seq + 1, dtype=q.dtype) if decay is None else \
        decay.to(q.dtype)[:, None] ** torch.arange(1, seq + 2, dtype=q.dtype)          # lambda^(t+1), t=0..S
    o = linear_attention_reference(q_, k_, v_, decay) + torch.einsum("bshk,hs,bhkv->bshv", q_, pw[:, :seq], s_)
    after = _reference_state(k_, v_, decay, heads) + pw[:, seq - 1].view(1, heads, 1, 1) * s_
    grads = torch.autograd.grad((o, after), leaves, (do, dstate_after))
    return (o.detach(), after.detach(), *grads)


def _block_inputs(heads, kv_heads, seq, seed):
    q, k, v, do = _inputs(heads, kv_heads, seq, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    # per q head and NOT shared within a kv group: the kernel takes any per-q-head state
    state_in, dstate_after = (torch.randn(q.shape[0], heads, q.shape[-1], v.shape[-1], generator=gen,
                                          dtype=torch.float64) for _ in range(2))
    return q, k, v, do, state_in, dstate_after


@pytest.mark.parametrize("heads,kv_heads,use_decay,seq,chunk", CASES, ids=IDS)
def test_block_with_state_in_and_dstate_local_matches_reference(heads, kv_heads, use_decay, seq, chunk):
    """chunked_forward / chunked_backward of a middle block (a state in, a state gradient out)."""
    q, k, v, do, state_in, dstate_after = _block_inputs(heads, kv_heads, seq, seed=12)
    decay = _decay(use_decay, heads)
    o, after = chunked_forward(*_f32(q, k, v, decay), chunk, state_in.float())
    dq, dk, dv, dstate_in = chunked_backward(*_f32(do, q, k, v, decay), chunk, state_in.float(), dstate_after.float())
    # the kernel's dstate_in is the share through o; the state after adds lambda^S dstate_after
    decay_s = state_decay(None if decay is None else decay.float(), seq)
    dstate_in = dstate_in + (dstate_after.float() if decay_s is None else decay_s * dstate_after.float())
    ref32 = _reference_block(*_f32(q, k, v, decay, state_in, do, dstate_after))
    ref64 = _reference_block(q, k, v, decay, state_in, do, dstate_after)
    for name, got, r32, r64 in zip(("o", "state after", "dq", "dk", "dv", "dstate_in"),
                                   (o, after, dq, dk, dv, dstate_in), ref32, ref64):
        assert got.shape == r64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(r64.shape)}"
        _assert_derived(f"block {name}", got, r32, r64)


def _three_blocks_in_lasp_order(q, k, v, decay, do, chunk, cuts):
    """Blocks [0, a), [a, b), [b, S) through the phase API in the orders the LASP strategy uses: the
    first sends its state before the intra work; the middle one sends its own state too and folds the
    incoming one in later (all-gather order); the last scans with the state that arrived (ring order)."""
    blocks = [[x[:, lo:hi] for x in (q, k, v, do)] for lo, hi in zip((0, *cuts), (*cuts, q.shape[1]))]
    fwds = [forward_begin(qb, kb, vb, decay, chunk) for qb, kb, vb, _ in blocks]
    s0, s1 = forward_states(fwds[0]), forward_states(fwds[1])
    forward_diagonal(fwds[1])
    forward_diagonal(fwds[2])
    state_in = [None, s0, forward_states(fwds[1], s0)]      # the last gets lambda^L1 s0 + s1
    state_all = forward_states(fwds[2], state_in[2])
    outs = [forward_finish(f) for f in fwds]
    bwds = [backward_begin(dob, qb, kb, vb, decay, chunk, st) for (qb, kb, vb, dob), st in zip(blocks, state_in)]
    assert bwds[0].dstate_in is None, "the first block has no state_in, so no dstate_in"
    for bwd in bwds:
        backward_local(bwd)
    decay_l1 = state_decay(decay, blocks[1][0].shape[1], s1.dtype)
    d1 = bwds[2].dstate_in                                   # gradient of the state after block 1
    d0 = bwds[1].dstate_in + (d1 if decay_l1 is None else decay_l1 * d1)
    grads = [backward_finish(bwd, d) for bwd, d in zip(bwds, (d0, d1, None))]
    cat = [torch.cat(parts, 1) for parts in (outs, *zip(*grads))]
    return cat, state_all, s1


@pytest.mark.parametrize("heads,kv_heads,use_decay,seq,chunk", CASES, ids=IDS)
def test_three_blocks_in_lasp_order_match_whole_sequence(heads, kv_heads, use_decay, seq, chunk):
    q, k, v, do = _inputs(heads, kv_heads, seq, seed=4)
    decay = _decay(use_decay, heads)
    cuts = (seq // 3 + 1, 2 * seq // 3 + 2)                # no block a multiple of the chunk
    (o, dq, dk, dv), state_all, s1 = _three_blocks_in_lasp_order(*_f32(q, k, v, decay, do), chunk, cuts)
    _assert_derived("split output", o, linear_attention_reference(*_f32(q, k, v, decay)),
                    linear_attention_reference(q, k, v, decay))
    _assert_derived("combined state", state_all, _reference_state(*_f32(k, v, decay), heads),
                    _reference_state(k, v, decay, heads))
    mid = slice(*cuts)
    _assert_derived("middle block's own state", s1, _reference_state(*_f32(k[:, mid], v[:, mid], decay), heads),
                    _reference_state(k[:, mid], v[:, mid], decay, heads))
    ref32 = _reference_grads(*_f32(q, k, v, decay, do))
    ref64 = _reference_grads(q, k, v, decay, do)
    for name, f, r32, r64 in zip(("split dq", "split dk", "split dv"), (dq, dk, dv), ref32, ref64):
        _assert_derived(name, f, r32, r64)


@pytest.mark.parametrize("use_decay,kv_heads,seq", [(False, 2, 29), (True, 2, 29), (True, 4, 32), (True, 4, 5)])
def test_phase_orders_compose_exactly(use_decay, kv_heads, seq):
    """Folding state_in into an existing scan equals scanning with it, and the phases in any order
    the strategy uses equal chunked_forward / chunked_backward (float64, up to rounding)."""
    q, k, v, do, state_in, dstate_after = _block_inputs(4, kv_heads, seq, seed=5)
    decay = _decay(use_decay, 4)
    o_ref, after_ref = chunked_forward(q, k, v, decay, 8, state_in)
    fwd = forward_begin(q, k, v, decay, 8)
    own = forward_states(fwd)
    forward_diagonal(fwd)
    after = forward_states(fwd, state_in)
    with pytest.raises(RuntimeError, match="already folded"):
        forward_states(fwd, state_in)
    o = forward_finish(fwd)
    assert torch.allclose(own, intra_forward(q, k, v, decay, 8)[1], rtol=0, atol=1e-12), "state_local"
    for name, got, ref in (("o", o, o_ref), ("state after", after, after_ref)):
        err = (got - ref).abs().max().item()
        assert err < 1e-12, f"{name}: scan-then-fold differs from scan-with-state_in by {err:.3e}"
    grads_ref = chunked_backward(do, q, k, v, decay, 8, state_in, dstate_after)
    bwd = backward_begin(do, q, k, v, decay, 8, state_in)
    dstate_in = bwd.dstate_in.clone()                    # available before backward_local
    backward_local(bwd)
    for name, got, ref in zip(("dq", "dk", "dv", "dstate_in"), (*backward_finish(bwd, dstate_after), dstate_in),
                              grads_ref):
        err = (got - ref).abs().max().item()
        assert err < 1e-12, f"{name}: phases differ from chunked_backward by {err:.3e}"


def test_gradcheck_fp64():
    q, k, v, _ = _inputs(4, 2, 11, seed=7, batch=1, dk=3, dv=2)
    decay = _decay(True, 4)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda a, b, c: LinearAttentionFunction.apply(a, b, c, decay, 4), leaves)


def test_chunk_size_does_not_change_result():
    q, k, v, _ = _inputs(4, 2, 23, seed=8)
    decay = _decay(True, 4)
    ref = linear_attention_reference(q, k, v, decay)
    for chunk in (1, 3, 8, 23, 100):
        err = (linear_attention(q, k, v, decay, chunk) - ref).abs().max().item()
        assert err < 1e-12, f"chunk_size={chunk}: fp64 error {err:.3e}"


def test_noncontiguous_inputs():
    """q, k, v as transposes of [B, H, S, D] (common in models), batch > 1, unaligned length."""
    q, k, v, do = _inputs(4, 2, 45, seed=11, batch=3)
    q, k, v, do = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, do))
    assert not q.is_contiguous()
    decay = _decay(True, 4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = linear_attention(*leaves, decay, 16)
    grads = torch.autograd.grad(o, leaves, do)
    refs = [linear_attention_reference(q, k, v, decay), *_reference_grads(q, k, v, decay, do)]
    for name, got, ref in zip(("o", "dq", "dk", "dv"), (o, *grads), refs):
        err = (got - ref).abs().max().item()
        assert err < 1e-12, f"{name} with non-contiguous inputs: fp64 error {err:.3e}"


def test_bf16_inputs_keep_fp32_states():
    q, k, v, _ = _inputs(4, 2, 64, seed=9)
    decay = _decay(True, 4)
    bf = [x.bfloat16() for x in (q, k, v)]
    o, st = chunked_forward(*bf, decay.float(), 16)
    assert o.dtype == torch.bfloat16 and st.dtype == torch.float32, f"dtypes: o {o.dtype}, state {st.dtype}"
    ref_bf16 = linear_attention_reference(*bf, decay.float())
    err_fast = (o.double() - linear_attention_reference(q, k, v, decay)).abs().max().item()
    err_ref = (ref_bf16.double() - linear_attention_reference(q, k, v, decay)).abs().max().item()
    assert err_fast <= K_TOL * err_ref, f"bf16 error {err_fast:.3e} > {K_TOL} x bf16 reference error {err_ref:.3e}"
    leaves = [x.requires_grad_() for x in bf]
    grads = torch.autograd.grad(linear_attention(*leaves, decay.float(), 16), leaves, torch.ones_like(o))
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads), "bf16 gradients"


def test_strong_decay_is_finite():
    """lambda = 1e-3 over many chunks: powers underflow to 0 and must never turn into inf or NaN."""
    q, k, v, do = _inputs(2, 2, 200, seed=10)
    decay = torch.tensor([1e-3, 0.5], dtype=torch.float64)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    o = linear_attention(*leaves, decay.float(), 64)
    grads = torch.autograd.grad(o, leaves, do.float())
    assert all(torch.isfinite(t).all() for t in (o, *grads)), "non-finite values with strong decay"
    _assert_derived("strong decay output", o, linear_attention_reference(*_f32(q, k, v, decay)),
                    linear_attention_reference(q, k, v, decay))


@pytest.mark.parametrize("bad,match", [
    (dict(k=torch.zeros(1, 5, 3, 4), v=torch.zeros(1, 5, 3, 4)), "multiple of k/v heads"),
    (dict(v=torch.zeros(1, 6, 2, 4)), "k must be"),
    (dict(decay=torch.tensor([0.5, 1.5, 0.5, 0.5])), r"lie in \(0, 1\]"),
    (dict(decay=torch.tensor([0.0, 0.5, 0.5, 0.5])), r"lie in \(0, 1\]"),
    (dict(decay=torch.full((3,), 0.5)), "shape"),
    (dict(decay=torch.full((4,), 0.5, requires_grad=True)), "no gradient"),
    (dict(q=torch.zeros(1, 5, 4, 4, dtype=torch.float64)), "dtype"),
])
def test_bad_inputs_raise_clear_errors(bad, match):
    args = dict(q=torch.zeros(1, 5, 4, 4), k=torch.zeros(1, 5, 2, 4), v=torch.zeros(1, 5, 2, 4), decay=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        intra_forward(args["q"], args["k"], args["v"], args["decay"], 4)


def test_state_decay_is_lambda_to_the_length():
    decay = torch.tensor([0.5, 0.9])
    got = state_decay(decay, 3).flatten()
    assert torch.allclose(got, decay ** 3), f"state_decay gave {got.tolist()}"
    assert state_decay(None, 3) is None
