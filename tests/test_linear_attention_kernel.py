"""Single-process tests of the chunked linear-attention kernel (ds_seqpar/linear_attention.py).

Tolerances are derived, not guessed (STYLE 12): the fp32 fast path's max error against the float64
reference may be at most K_TOL times the error of the plain fp32 reference against the same float64
reference, plus a floor of a few fp32 ulps of the result's scale (for results that come out exact).
"""
import pytest
import torch

from ds_seqpar.linear_attention import (
    LinearAttentionFunction, chunked_backward, chunked_forward, intra_backward, intra_forward,
    linear_attention, linear_attention_reference, state_decay, state_local_backward, state_output,
    state_output_backward)

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
    o2, st2 = chunked_forward(q2, k2, v2, decay, chunk, state_in_bhkv=st1)
    # backward walks the blocks in reverse: block 2 hands the gradient of its state_in to block 1
    dq2, dk2, dv2, dst_in2 = chunked_backward(do2, q2, k2, v2, decay, chunk, state_in_bhkv=st1)
    dq1, dk1, dv1, dst_in1 = chunked_backward(do1, q1, k1, v1, decay, chunk, dstate_local_bhkv=dst_in2)
    assert dst_in1 is None, "the first block has no state_in, so no dstate_in"
    decay_s2 = state_decay(decay, q2.shape[1], st1.dtype)
    state_all = st2 + (st1 if decay_s2 is None else decay_s2 * st1)
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


@pytest.mark.parametrize("use_decay,kv_heads", [(False, 2), (True, 2), (True, 4)])
def test_overlap_pieces_compose_exactly(use_decay, kv_heads):
    """The pieces the LASP strategy overlaps with communication add up to chunked_forward/backward."""
    q, k, v, do = _inputs(4, kv_heads, 29, seed=5)
    decay = _decay(use_decay, 4)
    gen = torch.Generator().manual_seed(6)
    state_in = torch.randn(2, 4, 8, 12, generator=gen, dtype=torch.float64)
    dstate_local = torch.randn(2, 4, 8, 12, generator=gen, dtype=torch.float64)
    o_ref, st_ref = chunked_forward(q, k, v, decay, 8, state_in)
    o, st = intra_forward(q, k, v, decay, 8)
    state_output(q, state_in, decay, out=o)
    assert torch.allclose(o, o_ref, atol=1e-12) and torch.allclose(st, st_ref, atol=1e-12), "forward pieces"
    grads_ref = chunked_backward(do, q, k, v, decay, 8, state_in, dstate_local)
    dq, dk, dv = intra_backward(do, q, k, v, decay, 8)
    dq_state, dstate_in = state_output_backward(do, q, state_in, decay)
    dk_state, dv_state = state_local_backward(k, v, dstate_local, decay)
    for name, got, ref in zip(("dq", "dk", "dv", "dstate_in"),
                              (dq + dq_state, dk + dk_state, dv + dv_state, dstate_in), grads_ref):
        err = (got - ref).abs().max().item()
        assert err < 1e-11, f"{name}: overlap pieces differ from chunked_backward by {err:.3e}"


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
    (dict(k=torch.zeros(1, 5, 3, 4), v=torch.zeros(1, 5, 3, 4)), "multiple of kv heads"),
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
